"""The math kernel: explicit softmax attention in fp32 (fp64 for fp64) with exact masks; the reference of every
other kernel, and the one that runs anywhere (any device, any dtype, any tile mask)."""
from __future__ import annotations

import torch

from .. import blockwise
from .base import Capabilities, Kernel, LseFunction

ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def keep_mask(q, k, causal: bool, tiles):
    """blockwise's mask for a call: None / "causal" / a bool keep mask [h or 1, Sq, Sk] (tiles AND causal)."""
    if tiles is None:
        return "causal" if causal else None
    m = tiles.token_mask()
    if causal:
        m = m & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=m.device).tril()
    return m


class MathKernel(Kernel):
    name = setting = "math"
    label = "math (fp32 reference)"
    in_torch_sdpa = True   # "auto"'s plain calls go through torch's SDPA dispatch
    caps = Capabilities(plain=True, lse=True, varlen=None, tiles="any",
                        dropout=False, dtypes={"cpu": ALL_DTYPES, "cuda": ALL_DTYPES})

    def attention(self, q, k, v, causal, scale, tiles=None):
        return LseFunction.apply(q, k, v, self, causal, scale, tiles)

    def forward(self, q, k, v, scale, causal, tiles=None):
        return blockwise.math_forward(q, k, v, scale, keep_mask(q, k, causal, tiles))

    def backward(self, do, q, k, v, out, lse, scale, causal, tiles=None):
        return blockwise.math_backward(do, q, k, v, out, lse, scale, keep_mask(q, k, causal, tiles))
