"""The DiT block's elementwise work, optionally fused by ``torch.compile`` (``--fused-elementwise``).

On one H100 (wan-1.3b dims, 32,760 tokens, bf16) a quarter of the step's GPU time went to unfused
elementwise kernels around the GEMMs and attention: AdaLN modulation, gated residuals, the fp32 QK
RMSNorm and RoPE, each a few passes over [S, d] forward and backward (profile:
tools/results/2026-11-23_h100_dit_profile). Each function below is one region that ``torch.compile``
turns into a few fused kernels, forward and backward; the math is the eager one, so results agree to
rounding (fused fp32 reductions may sum in another order).

``ElementwiseOps(backend=None)`` is the eager path (the default on CPU); ``ElementwiseOps("inductor")``
compiles each region on first use (and once more, shape-generic, when a run's token count changes). The model holds one instance and calls it explicitly.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .rope import apply_rope

FUSED_CHOICES = ("auto", "on", "off")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32; return x's dtype (under autocast q, k and v must share one dtype)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def ln_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """AdaLN: LayerNorm without affine, then ``* (1 + scale) + shift``. x [B, S, d]; scale, shift [B, 1, d]."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate * y`` (AdaLN-zero gate [B, 1, d])."""
    return x + gate * y


def qk_prep(t: torch.Tensor, weight: torch.Tensor, eps: float, angles: torch.Tensor, heads: int) -> torch.Tensor:
    """QK RMSNorm over all heads, then RoPE: [B, S, H*D] -> [B, S, H, D]."""
    b, s, _ = t.shape
    return apply_rope(rms_norm(t, weight, eps).reshape(b, s, heads, -1), angles)


class ElementwiseOps:
    """The block's elementwise regions, eager (``backend=None``) or compiled with ``backend``."""

    def __init__(self, backend: Optional[str] = None) -> None:
        self.backend = backend
        wrap: Callable = (lambda f: f) if backend is None else (
            lambda f: torch.compile(f, backend=backend, fullgraph=True))  # dynamic=None: a shape that changes
        # (runs cycling frame counts or resolutions) is recompiled once as dynamic, not once per shape
        self.rms_norm = wrap(rms_norm)
        self.ln_modulate = wrap(ln_modulate)
        self.gated_residual = wrap(gated_residual)
        self.qk_prep = wrap(qk_prep)


def resolve_fused(choice: str, device: torch.device, flag: str = "--fused-elementwise") -> Optional[str]:
    """The compile backend for ``choice``: ``auto`` compiles on CUDA only, ``on`` everywhere, ``off`` never."""
    if choice not in FUSED_CHOICES:
        raise ValueError(f"{flag}={choice!r}: choose one of {', '.join(FUSED_CHOICES)}")
    on = choice == "on" or (choice == "auto" and torch.device(device).type == "cuda")
    return "inductor" if on else None
