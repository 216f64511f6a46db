"""torch's own SDPA dispatch (``F.scaled_dot_product_attention``: torch picks cuDNN, FlashAttention-2, the
memory-efficient kernel or math per call) as the registry's one SDPA kernel: every call of it in the library goes
through here, so ``kernels.choose`` sees every decision (``choose.plain_kernel``: "auto"'s plain calls where its
log-sum-exp kernel is one of torch's; ``choose.dropout_kernel``: attention dropout; ``choose.torch_sdpa``: the
explicit masks and fp32 / float64 side calls of the models, e.g. the video tiles' coarse branch).

Shapes: q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (GQA through SDPA's ``enable_gqa``), out [B, H, Sq, D] in q's dtype.
Plain calls only (no log-sum-exp, no block sparsity): ring steps and block-sparse calls run elsewhere. Not a setting a
user gives (``offered`` False): "auto" / "sdpa" reach it, a named kernel never does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .base import Capabilities, Kernel
from .cudnn import dense, grad_in_own_layout

ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def torch_sdpa_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q, k, v as a plain call through torch's SDPA dispatch gets them: contiguous on CUDA, where torch picks cuDNN
    on Hopper whichever kernel the registry named (why: kernels/cudnn.py), as they are elsewhere."""
    return dense(q, k, v) if q.is_cuda else (q, k, v)


def torch_sdpa_output(out: torch.Tensor) -> torch.Tensor:
    """The output of a plain call through torch's SDPA dispatch: on CUDA its gradient reaches SDPA's backward in
    the output's own layout (``cudnn.grad_in_own_layout``: torch's cuDNN graph cache), as it is elsewhere."""
    return grad_in_own_layout(out) if out.is_cuda else out


class TorchSdpaKernel(Kernel):
    """torch's SDPA dispatch: plain calls, attention dropout, explicit keep masks; any device and dtype."""

    name = setting = "torch_sdpa"
    label = "torch SDPA dispatch"
    offered = False        # reached through the chooser only, never named by a user
    in_torch_sdpa = True
    caps = Capabilities(plain=True, lse=False, varlen=None, tiles="none", dropout=True,
                        dtypes={"cpu": ALL_DTYPES, "cuda": ALL_DTYPES})

    def attention(self, q, k, v, causal, scale, tiles=None):
        """A backend's plain call (differentiable): inputs and output gradient laid out as cuDNN needs on CUDA."""
        q, k, v = torch_sdpa_inputs(q, k, v)
        return torch_sdpa_output(self.call(q, k, v, causal=causal, scale=scale))

    def dropout_attention(self, q, k, v, causal: bool, scale: Optional[float], dropout_p: float) -> torch.Tensor:
        """A plain call with attention dropout (SDPA's own, under autograd: the backward reuses the forward's mask)."""
        return torch_sdpa_output(self.call(q, k, v, causal=causal, scale=scale, dropout_p=dropout_p))

    @staticmethod
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
             scale: Optional[float] = None, mask: Optional[torch.Tensor] = None,
             dropout_p: float = 0.0) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` as it is (no copies, no hooks): ``mask`` a bool keep mask broadcastable
        to [B, H, Sq, Sk] (or an additive float one), GQA when k/v carry fewer heads."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                              scale=scale, enable_gqa=k.shape[1] != q.shape[1])
