"""Float64 single-device reference attention and error metrics for the tests."""
from __future__ import annotations

import math
import numbers

import torch


def reference_attention(q_bshd, k_bshd, v_bshd, *, causal=False, softmax_scale=None, mask=None):
    """Full-sequence attention in float64. Inputs [B, S, H, D] (k/v may have fewer heads: GQA).

    mask: optional bool [S, S] (True = keep), overriding ``causal``.
    Returns [B, S, H, D] float64, differentiable w.r.t. the inputs.
    """
    q, k, v = (t.double().transpose(1, 2) for t in (q_bshd, k_bshd, v_bshd))
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None and causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v).transpose(1, 2)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ||x - ref|| / ||ref|| in float64; inf if x or ref has a NaN or an inf anywhere (a
    non-finite value is never close, and inf - inf would give a NaN that ``max`` over errors drops)."""
    x, ref = x.double(), ref.double()
    if not (torch.isfinite(x).all() and torch.isfinite(ref).all()):
        return math.inf
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def rel_diff(a: float, ref: float) -> float:
    """|a - ref| / |ref| of two scalars (losses); inf if either is not finite (0 / 0 = 0, x / 0 = inf)."""
    if not (math.isfinite(a) and math.isfinite(ref)):
        return math.inf
    if ref == 0:
        return 0.0 if a == 0 else math.inf
    return abs(a - ref) / abs(ref)


def nan_worst(e: float) -> float:
    """Sort key of an error where a NaN (or a non-number) counts as the worst (Python's ``max([x, nan])`` is x: it
    drops the NaN)."""
    return e if isinstance(e, numbers.Real) and not math.isnan(e) else math.inf


def worst(errors) -> float:
    """The largest of ``errors`` (an iterable of floats), a NaN counting as the largest."""
    return max(errors, key=nan_worst)


def curve_err(got: list, ref: list) -> float:
    """Worst ``rel_diff`` of two loss curves step by step; inf when their lengths differ or either is empty."""
    if len(got) != len(ref) or not ref:
        return math.inf
    return worst(rel_diff(a, b) for a, b in zip(got, ref))


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float64: 1e-10}


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = rel_err(x, ref)
    assert err <= TOL[dtype], f"{name}: relative error {err:.3e} > {TOL[dtype]:.0e} ({dtype})"


def make_qkv(seed, b, s, h, hkv, d, dtype=torch.float32):
    """Deterministic full (unsharded) q, k, v [B, S, H(kv), D] identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype)


def pad_mask(s: int, valid: int, causal: bool) -> torch.Tensor:
    """[S, S] bool for key padding: keys at positions >= ``valid`` get no attention (causal: also j <= i)."""
    m = torch.zeros(s, s, dtype=torch.bool)
    m[:, :valid] = True
    return m & torch.ones(s, s, dtype=torch.bool).tril() if causal else m
