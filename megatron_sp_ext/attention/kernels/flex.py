"""torch's flex_attention (compiled) with a ``BlockMask`` whose ``mask_mod`` indexes the tile mask: block sparsity at
any tile size and placement on CUDA, differentiable through autograd (its backward is compiled with its forward: no
backward from a given out/lse, so ring steps do not use it). Measured 323-392 useful TFLOP/s at 128-token tiles and
59-255 at 64-token tiles on an H100 (2026-11-25), below FA4's block sparsity (440-571)."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .base import Capabilities, Kernel

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1)
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415
    return torch.compile(flex_attention, dynamic=False)


def flex_mask(ts, *, causal: bool = False, compiled: Optional[bool] = None):
    """flex_attention's ``BlockMask`` for a tile slice ``ts`` (its mask_mod indexes the tile mask rows of the
    slice's heads, AND causal by global position, AND kv_valid_len). compiled (default: on CUDA): built through
    torch.compile (no [h, Sq, Sk] mask materialised); False evaluates the mask_mod eagerly (small shapes, CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415
    dev = ts.device
    rows = ts.mask_rows().contiguous()
    one_head = rows.shape[0] == 1
    qp, kp = (p.contiguous() for p in ts.positions_on_device())
    qt, kt = (qp // ts.tile).contiguous(), (kp // ts.tile).contiguous()
    # no padding: every key is valid (read off the host positions: no device sync)
    valid = ts.kv_valid_len if ts.kv_valid_len is not None else int(ts.k_pos.max()) + 1 if ts.k_pos.numel() else 0

    def mask_mod(b, h, q_idx, kv_idx):
        keep = rows[0 if one_head else h, qt[q_idx], kt[kv_idx]]
        if causal:
            keep = keep & (kp[kv_idx] <= qp[q_idx])
        return keep & (kp[kv_idx] < valid)

    compiled = dev.type == "cuda" if compiled is None else compiled
    return create_block_mask(mask_mod, None, None if one_head else rows.shape[0], qp.numel(), kp.numel(),
                             device=dev, _compile=compiled)


def flex_attention_masked(q, k, v, flex_mask, scale: float, *, compiled: bool = True):
    """(out [B, H, Sq, D], lse [B, H, Sq] fp32) of flex_attention under ``flex_mask``; differentiable in out.
    ``compiled=False`` runs flex_attention eagerly (its reference mode; CPU forward only)."""
    from torch.nn.attention import flex_attention as fa  # noqa: PLC0415
    fn = compiled_flex() if compiled else fa.flex_attention
    gqa = k.shape[1] != q.shape[1]
    if hasattr(fa, "AuxRequest"):  # torch >= 2.9: return_lse is deprecated
        out, aux = fn(q, k, v, block_mask=flex_mask, scale=scale, enable_gqa=gqa, return_aux=fa.AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, block_mask=flex_mask, scale=scale, enable_gqa=gqa, return_lse=True)


class FlexKernel(Kernel):
    name = setting = "flex"
    label = "flex_attention (torch.compile)"
    caps = Capabilities(plain=True, lse=False, varlen=None, tiles="any",
                        dropout=False, dtypes={"cuda": DTYPES})

    def installed(self) -> bool:
        try:
            from torch.nn.attention import flex_attention  # noqa: F401, PLC0415
        except ImportError:  # pragma: no cover - depends on the torch build
            return False
        return True

    def why_not_here(self, call):
        if call.tiles is None and "plain" in call.needs:
            return "it runs block-sparse calls only (give a block mask)"
        return None

    def prepare(self, tiles, sq, sk, causal):
        key = ("flex_mask", bool(causal))
        if key not in tiles.cache:
            tiles.cache[key] = flex_mask(tiles, causal=causal)
        return tiles.cache[key]

    def attention(self, q, k, v, causal, scale, tiles=None):
        return flex_attention_masked(q, k, v, self.prepare(tiles, q.shape[2], k.shape[2], causal), scale)[0]
