"""The DiT block's elementwise work, optionally fused by ``torch.compile`` (``--fused-elementwise``).

On one H100 (wan-1.3b dims, 32,760 tokens, bf16) a quarter of the step's GPU time went to unfused
elementwise kernels around the GEMMs and attention: AdaLN modulation, gated residuals, the fp32 QK
RMSNorm and RoPE, each a few passes over [S, d] forward and backward (profile:
results/2026-11-23_h100_dit_profile). Each function below is one region that ``torch.compile``
turns into a few fused kernels, forward and backward; the math is the eager one, so results agree to
rounding (fused fp32 reductions may sum in another order).

``ElementwiseOps(backend=None)`` is the eager path (the default on CPU); ``ElementwiseOps("inductor")``
compiles each region on first use (and once more, shape-generic, when a run's token count changes). The model holds one instance and calls it explicitly.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron_sp_ext.inductor import compile_options  # noqa: F401 - the regions' options (re-exported)

from .rope import apply_rope

FUSED_CHOICES = ("auto", "on", "off")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32; return x's dtype (under autocast q, k and v must share one dtype)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def ln_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """AdaLN: LayerNorm without affine, then ``* (1 + scale) + shift``. x [B, S, d]; scale, shift [B, 1, d].
    out_dtype: the autocast dtype of the Linear that reads the result (its input cast, done here: fused when
    compiled; the same rounding the Linear's own cast would do)."""
    y = F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift
    return y if out_dtype is None else y.to(out_dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """LayerNorm with affine over x [B, S, d], cast to ``out_dtype`` as ``ln_modulate``."""
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return y if out_dtype is None else y.to(out_dtype)


def linear_input_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype a Linear under the current autocast casts its input to (None without autocast, and on a device
    type autocast does not know, e.g. meta)."""
    kind = x.device.type
    if not torch.amp.is_autocast_available(kind):
        return None
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate * y`` (AdaLN-zero gate [B, 1, d])."""
    return x + gate * y


def qk_prep(t: torch.Tensor, weight: torch.Tensor, eps: float, angles: torch.Tensor, heads: int) -> torch.Tensor:
    """QK RMSNorm over all heads, then RoPE: [B, S, H*D] -> [B, S, H, D]."""
    b, s, _ = t.shape
    return apply_rope(rms_norm(t, weight, eps).reshape(b, s, heads, -1), angles)


def qkv_pack(y: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps_q: float, eps_k: float,
             angles: torch.Tensor, heads: int, layout) -> list:
    """The fused QKV projection's output y [B, S, 3*H*D] -> QK-norm + RoPE of q and k, and q|k|v written
    straight into packed Ulysses' send layout (``megatron_sp_ext.sp.ulysses.packed.pack_qkv`` with HeadLayout
    ``layout``): one kernel when compiled, so the exchange's pack costs no pass of its own."""
    from megatron_sp_ext.sp.ulysses.packed import pack_qkv  # noqa: PLC0415
    b, s, _ = y.shape
    q, k, v = y.chunk(3, dim=-1)
    q, k = qk_prep(q, wq, eps_q, angles, heads), qk_prep(k, wk, eps_k, angles, heads)
    return pack_qkv(q, k, v.reshape(b, s, heads, -1), layout)


class ElementwiseOps:
    """The block's elementwise regions, eager (``backend=None``) or compiled with ``backend``
    (``compile_options``)."""

    def __init__(self, backend: Optional[str] = None) -> None:
        self.backend = backend
        options = compile_options(backend)
        wrap: Callable = (lambda f: f) if backend is None else (
            lambda f: torch.compile(f, backend=backend, fullgraph=True, options=options))  # dynamic=None: a shape
        # that changes (runs cycling frame counts or resolutions) is recompiled once as dynamic, not once per shape
        self.rms_norm = wrap(rms_norm)
        self.ln_modulate = wrap(ln_modulate)
        self.layer_norm = wrap(layer_norm)
        self.gated_residual = wrap(gated_residual)
        self.qk_prep = wrap(qk_prep)
        self._wrap, self._qkv_pack = wrap, {}

    def qkv_pack(self, layout) -> Callable:
        """``qkv_pack`` for one HeadLayout (compiled once per layout: the layout is a constant of the kernel)."""
        if layout not in self._qkv_pack:
            self._qkv_pack[layout] = self._wrap(functools.partial(qkv_pack, layout=layout))
        return self._qkv_pack[layout]


def resolve_packed(choice: str, fused_backend: Optional[str], flag: str = "--ulysses-packed-qkv",
                   packed_samples: bool = False, sparse: bool = False) -> bool:
    """Whether blocks write q|k|v in the exchange's send layout: ``auto`` when the elementwise regions are
    compiled (eager, the layout change would be a copy of its own, as in the plain path), ``on``, ``off``.
    With ``packed_samples`` (--pack-samples: several clips per sequence, which that exchange does not take)
    ``auto`` is off and ``on`` is refused; likewise with ``sparse`` (--sparse-attention tiles, whose block-sparse
    attention takes q, k, v on the plain path)."""
    if choice not in FUSED_CHOICES:
        raise ValueError(f"{flag}={choice!r}: choose one of {', '.join(FUSED_CHOICES)}")
    if sparse:
        if choice == "on":
            raise ValueError(f"{flag}=on cannot run --sparse-attention tiles (the block-sparse attention takes q, k, "
                             f"v on the plain path): use {flag} off or auto")
        return False
    if packed_samples:
        if choice == "on":
            raise ValueError(f"{flag}=on cannot run --pack-samples (the packed q|k|v exchange takes one sample per "
                             f"sequence): use {flag} off or auto")
        return False
    return choice == "on" or (choice == "auto" and fused_backend is not None)


def resolve_fused(choice: str, device: torch.device, flag: str = "--fused-elementwise") -> Optional[str]:
    """The compile backend for ``choice``: ``auto`` compiles on CUDA only, ``on`` everywhere, ``off`` never."""
    if choice not in FUSED_CHOICES:
        raise ValueError(f"{flag}={choice!r}: choose one of {', '.join(FUSED_CHOICES)}")
    on = choice == "on" or (choice == "auto" and torch.device(device).type == "cuda")
    return "inductor" if on else None
