"""Attention calls with log-sum-exp, and their backward given the FINAL out/lse: the calls ring steps, head
chunks and packed samples make, on the registry's kernels that offer them (``kernels.names("lse")``).

One call: q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (bhsd, any strides with stride(-1) == 1), ``causal`` = top-left
aligned (used with Sq == Sk only). Forward returns (out [B, H, Sq, D] in q's dtype, lse fp32 [B, H, Sq]); backward
takes the merged out/lse of the rows, which makes every call's gradient exact (the kernels recompute P = exp(S *
scale - lse) and D = rowsum(dO * O)). ``tiles``: a tile mask's slice for the call (attention/tiles.py).

``KERNELS`` (fastest first on Hopper; the registry's ORDER says what was measured) today: FlashAttention-4,
cuDNN, torch's FlashAttention-2, math. The memory-efficient kernel is not offered: on an H100 (torch 2.11) its
backward was wrong when fed merged out/lse with strided k/v (dq/dk errors 0.1-3.9 and NaN;
results/2026-11-23_h100_early), which is exactly how ring steps call it.
Calls with one query or one key row run on the math kernel whatever the kernel: on an H100 (torch 2.11, CUDA 13)
cuDNN's 1 x 1 call crashed the process (segfault) and flash's returned garbage (error 1e24), while 2 x 2 and 1 x 5
were right (results/2026-11-24_h100_packed_padding/tiny_blocks.txt). Packed samples make such calls: a
one-token sample, or a sample's one padding row.
Availability: the kernel's own conditions (``Kernel.why_not``) plus a tiny probe call per (kernel, device, dtype)
against math, cached; ``why_not_call`` is that test in the form ``kernels.choose`` takes (the one choice).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from . import kernels
from .kernels import math as math_kernel
from .kernels.base import Kernel, KernelCall
from .lse import merge

log = logging.getLogger("megatron_sp_ext")

KERNELS = kernels.names("lse", auto_only=True)
MATH = kernels.FALLBACK

_PROBED: dict = {}


def _call(device, dtype, head_dim: Optional[int]) -> KernelCall:
    return KernelCall(torch.device(device), dtype, head_dim, frozenset({"lse"}))


def schema_ok(kernel: str) -> bool:
    """Whether ``kernel``'s code is here with the calls this library makes (no device check)."""
    return kernels.get(kernel).schema_ok()


def why_not(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> str:
    """Why ``kernel`` does not run for (device, dtype, head_dim) here, in a user's words ("" if it runs)."""
    return why_not_call(kernels.get(kernel), _call(device, dtype, head_dim)) or ""


def available(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> bool:
    """Whether ``kernel`` runs here for ``dtype`` (its conditions and one tiny probe call, cached) and, when given,
    ``head_dim``."""
    device = torch.device(device)
    if kernel not in KERNELS or kernels.why_not(kernel, _call(device, dtype, head_dim)) is not None:
        return False
    key = (kernel, str(device), dtype)
    if key not in _PROBED:
        failures = getattr(kernels.get(kernel), "probe_failures", (RuntimeError, NotImplementedError, TypeError))
        try:
            ok = _probe(kernel, device, dtype)
        except failures as e:  # noqa: BLE001 - a kernel's own package may fail in its own ways
            log.info("megatron_sp_ext: attention kernel %s unavailable on %s/%s: %s", kernel, device, dtype, e)
            ok = False
        _PROBED[key] = ok
    return _PROBED[key]


def _probe(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel used as a ring uses it, on a tiny case (40 rows: not a multiple of any tile), against math:
    a causal call and a call over a full K|V block merged by log-sum-exp, then each call's backward fed the MERGED
    out/lse (a kernel that only handles a lone call must not pass)."""
    g = torch.Generator().manual_seed(0)
    q, k0, v0, k1, v1, do = (torch.randn(1, 2, 40, 64, generator=g).to(device=device, dtype=dtype) for _ in range(6))
    kv_parts = ((k0, v0, True), (k1, v1, False))
    parts = [forward(kernel, q, k, v, 0.125, c) for k, v, c in kv_parts]
    o, lse = merge([p[0] for p in parts], [p[1] for p in parts])
    o = o.to(dtype)
    grads = [backward(kernel, do, q, k, v, o, lse, 0.125, c) for k, v, c in kv_parts]
    ref = [math_kernel.math_forward(q.float(), k.float(), v.float(), 0.125, "causal" if c else None)
           for k, v, c in kv_parts]
    o_m, lse_m = merge([r[0] for r in ref], [r[1] for r in ref])
    grads_m = [math_kernel.math_backward(do.float(), q.float(), k.float(), v.float(), o_m, lse_m, 0.125,
                                       "causal" if c else None) for k, v, c in kv_parts]
    close = lambda a, b: bool((a.float() - b.float()).abs().max() <= 3e-2 * (1 + b.float().abs().max()))  # noqa: E731
    return (close(o, o_m) and close(lse, lse_m)
            and all(close(a, b) for gk, gm in zip(grads, grads_m) for a, b in zip(gk, gm)))


def why_not_call(kernel: Kernel, call: KernelCall) -> Optional[str]:
    """None if ``kernel`` runs the log-sum-exp ``call`` here (``available``: its conditions and its probe), else the
    reason in a user's words: the test ``kernels.choose`` applies to these calls."""
    if available(kernel.name, call.device, call.dtype, call.head_dim):
        return None
    return kernel.why_not(call) or "its probe call against the math kernel failed here"


def best(device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> str:
    """The first of ``KERNELS`` available for (device, dtype, head_dim): ``kernels.choose`` of that call."""
    return kernels.choose(_call(device, dtype, head_dim), "auto", why_not=why_not_call, count=False).name


def one_row_call(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a call (q [B, H, Sq, D], k [B, Hkv, Sk, D]) has one query or one key row: the fused kernels are not
    trusted with it (see the module docstring); it runs on the math kernel."""
    return q.shape[2] == 1 or k.shape[2] == 1


def _for_call(kernel: str, q, k, tiles=None) -> str:
    """``kernel``, or math for a one-row call without tiles."""
    return MATH if tiles is None and one_row_call(q, k) else kernel


def forward(kernel: str, q, k, v, scale: float, causal: bool, tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One call: (out in q.dtype, lse fp32 [B, H, Sq]) with ``kernel`` (see module docstring)."""
    return kernels.get(_for_call(kernel, q, k, tiles)).forward(q, k, v, scale, causal, tiles)


def backward(kernel: str, do, q, k, v, out, lse, scale: float, causal: bool, tiles=None):
    """Call gradients (dq, dk, dv) given the FINAL out (q dtype) and lse (fp32 [B, H, Sq]) of the rows."""
    return kernels.get(_for_call(kernel, q, k, tiles)).backward(do, q, k, v, out, lse, scale, causal, tiles)
