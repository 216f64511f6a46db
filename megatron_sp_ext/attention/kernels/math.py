"""The math kernel: explicit softmax attention in fp32 (fp64 for fp64) with exact masks; the reference of every
other kernel, and the one that runs anywhere (any device, any dtype, any tile mask)."""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..lse import acc_dtype
from .base import Capabilities, Kernel, LseFunction, expand_kv, fold_kv_grad

ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# mask of math_forward / math_backward: None (full), "causal" (top-left aligned, Sq == Sk) or a bool tensor [Sq, Sk]
# or [H or 1, Sq, Sk] (True = keep)
Mask = Union[None, str, torch.Tensor]


def _bool_mask(mask: Mask, sq: int, sk: int, device) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    return mask


def math_forward(q, k, v, scale: float, mask: Mask = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference-quality block forward in fp32 (fp64 for fp64). Returns (out in q.dtype, lse)."""
    k, v, _ = expand_kv(k, v, q.shape[1])
    acc = acc_dtype(q)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    m = _bool_mask(mask, q.shape[2], k.shape[2], q.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    out = torch.matmul(p, v.to(acc))
    return out.to(q.dtype), lse


def math_backward(do, q, k, v, out, lse, scale: float, mask: Mask = None):
    """Block backward in fp32 (fp64 for fp64) given final out/lse of the rows. Returns (dq, dk, dv) in
    input dtypes."""
    hk = k.shape[1]
    ke, ve, rep = expand_kv(k, v, q.shape[1])
    acc = acc_dtype(q)
    qf, kf, vf, dof = q.to(acc), ke.to(acc), ve.to(acc), do.to(acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    m = _bool_mask(mask, q.shape[2], ke.shape[2], q.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(acc)
    p = torch.exp(s - safe.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dk, dv = fold_kv_grad(dk, rep), fold_kv_grad(dv, rep)
    assert dk.shape[1] == hk
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def keep_mask(q, k, causal: bool, tiles):
    """math_forward's mask for a call: None / "causal" (top-left aligned rows) / with a tile slice the bool keep mask
    [h or 1, Sq, Sk] (tiles AND, with ``causal``, key position <= query position: tril where the rows are the same
    increasing positions, the rule by global position elsewhere)."""
    if tiles is None:
        return "causal" if causal else None
    return tiles.token_mask(causal)


class MathKernel(Kernel):
    name = setting = "math"
    label = "math (fp32 reference)"
    in_torch_sdpa = True   # "auto"'s plain calls go through torch's SDPA dispatch
    caps = Capabilities(plain=True, lse=True, varlen=None, tiles="any",
                        dropout=False, dtypes={"cpu": ALL_DTYPES, "cuda": ALL_DTYPES}, deterministic="all")

    def attention(self, q, k, v, causal, scale, tiles=None):
        return LseFunction.apply(q, k, v, self, causal, scale, tiles)

    def forward(self, q, k, v, scale, causal, tiles=None):
        return math_forward(q, k, v, scale, keep_mask(q, k, causal, tiles))

    def backward(self, do, q, k, v, out, lse, scale, causal, tiles=None):
        return math_backward(do, q, k, v, out, lse, scale, keep_mask(q, k, causal, tiles))
