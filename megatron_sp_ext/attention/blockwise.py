"""Attention on one (q block, kv block) pair with log-sum-exp, and its backward.

These are the building blocks of every ring-style algorithm: forward returns (out, lse) for the
block; backward takes the FINAL (merged) out and lse of the query rows, which makes each block's
gradient contribution exact. All tensors are [B, H, S, D] ("bhsd"); lse is fp32 [B, H, Sq].
GQA: k/v may have fewer heads (H % Hkv == 0); they are expanded here and dk/dv summed back.
mask: None (full), "causal" (top-left aligned, Sq == Sk) or a bool tensor [Sq, Sk] (True = keep).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .lse import acc_dtype

Mask = Union[None, str, torch.Tensor]


def expand_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """k, v [B, Hkv, S, D] repeated to ``heads`` heads (GQA), and the repeat factor."""
    rep = heads // k.shape[1]
    if rep == 1:
        return k, v, 1
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), rep


def fold_kv_grad(g: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient [B, Hkv * rep, S, D] of ``expand_kv``'s output summed back to [B, Hkv, S, D]."""
    if rep == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // rep, rep, s, d).sum(dim=2)


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


def fused_forward(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused-kernel block forward (torch flash attention on CUDA or CPU). Returns (out, lse fp32)."""
    k, v, _ = expand_kv(k, v, q.shape[1])
    if q.is_cuda:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


_FLASH_AUX: dict = {}


def _flash_aux(device, dtype):
    """The flash forward's non-data outputs for a dense (non-varlen, dropout-free) call: its
    sequence-offset placeholders and RNG state. The backward needs them back; they do not depend on
    the data, so one tiny forward per (device, dtype) provides them."""
    key = (str(device), dtype)
    if key not in _FLASH_AUX:
        x = torch.zeros(1, 1, 16, 64, device=device, dtype=dtype)
        res = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
        _FLASH_AUX[key] = (res[2], res[3], res[6], res[7])
    return _FLASH_AUX[key]


def fused_backward(do, q, k, v, out, lse, scale: float, causal: bool):
    """Fused-kernel block backward given final out/lse. Returns (dq, dk, dv)."""
    ke, ve, rep = expand_kv(k, v, q.shape[1])
    if q.is_cuda:
        sq, sk = q.shape[2], ke.shape[2]
        cum_q, cum_k, rng, unused = _flash_aux(q.device, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, ke, ve, out, lse.contiguous(), cum_q, cum_k, sq, sk, 0.0, causal, rng, unused, scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, ke, ve, out, lse, 0.0, causal, scale=scale)
    return dq, fold_kv_grad(dk, rep), fold_kv_grad(dv, rep)
