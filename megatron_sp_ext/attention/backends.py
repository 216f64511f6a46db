"""Local (single-device) attention backends behind one signature.

Every backend is a ``LocalAttention`` with
  ``__call__(q, k, v, *, causal, softmax_scale) -> out``   differentiable, [B, H, S, D] in and out
  ``forward_lse(q, k, v, *, causal, softmax_scale) -> (out, lse)``   no autograd, lse fp32 [B, H, S]
  ``backward_lse(do, q, k, v, out, lse, *, causal, softmax_scale) -> (dq, dk, dv)``
k/v may carry fewer heads than q (GQA). Backends: "sdpa" (default, torch), "math" (fp32 reference
with explicit masks), "flash_attn" and "te" when those packages import. ``get_backend`` logs the
choice once per name.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..errors import SPConfigError
from . import blockwise

log = logging.getLogger("megatron_sp_ext")


class LocalAttention:
    """A named local attention implementation (see module docstring for the contract)."""

    name = "base"

    def __call__(self, q, k, v, *, causal: bool, softmax_scale: float) -> torch.Tensor:
        raise NotImplementedError

    def forward_lse(self, q, k, v, *, causal: bool, softmax_scale: float, mask=None):
        return blockwise.math_forward(q, k, v, softmax_scale, mask if mask is not None else ("causal" if causal else None))

    def backward_lse(self, do, q, k, v, out, lse, *, causal: bool, softmax_scale: float, mask=None):
        m = mask if mask is not None else ("causal" if causal else None)
        return blockwise.math_backward(do, q, k, v, out, lse, softmax_scale, m)


class SDPABackend(LocalAttention):
    """torch.nn.functional.scaled_dot_product_attention (flash / efficient / cuDNN / math, torch picks)."""

    name = "sdpa"

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None):
        if mask is not None or not _fused_ok(q):
            return super().forward_lse(q, k, v, causal=causal, softmax_scale=softmax_scale, mask=mask)
        return blockwise.fused_forward(q, k, v, softmax_scale, causal)

    def backward_lse(self, do, q, k, v, out, lse, *, causal, softmax_scale, mask=None):
        if mask is not None or not _fused_ok(q):
            return super().backward_lse(do, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, mask=mask)
        return blockwise.fused_backward(do, q, k, v, out, lse, softmax_scale, causal)


def _fused_ok(q: torch.Tensor) -> bool:
    # torch's flash kernels: fp16/bf16 on CUDA; fp32/bf16/fp16 on CPU.
    if q.is_cuda:
        return q.dtype in (torch.float16, torch.bfloat16)
    return q.dtype in (torch.float32, torch.bfloat16, torch.float16)


class MathBackend(LocalAttention):
    """Explicit fp32 softmax attention; the reference path (slow, exact masks)."""

    name = "math"

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return _MathAttnFn.apply(q, k, v, causal, softmax_scale)


class _MathAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = blockwise.math_forward(q, k, v, scale, "causal" if causal else None)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = blockwise.math_backward(do, q, k, v, out, lse, ctx.scale, "causal" if ctx.causal else None)
        return dq, dk, dv, None, None


class FlashAttnBackend(LocalAttention):
    """flash-attn 2/3 (``flash_attn.flash_attn_func``), CUDA only."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_func  # noqa: PLC0415
        self._fn = flash_attn_func

    def __call__(self, q, k, v, *, causal, softmax_scale):
        out = self._fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       softmax_scale=softmax_scale, causal=causal)
        return out.transpose(1, 2)


class TEBackend(LocalAttention):
    """Transformer Engine's fused attention (``transformer_engine.pytorch.DotProductAttention``), CUDA only."""

    name = "te"

    def __init__(self) -> None:
        import transformer_engine.pytorch as te  # noqa: PLC0415
        self._te = te
        self._mods: dict = {}

    def __call__(self, q, k, v, *, causal, softmax_scale):
        b, h, s, d = q.shape
        key = (h, k.shape[1], d, causal, softmax_scale)
        if key not in self._mods:
            self._mods[key] = self._te.DotProductAttention(
                h, d, num_gqa_groups=k.shape[1], attention_dropout=0.0, qkv_format="bshd",
                attn_mask_type="causal" if causal else "no_mask", softmax_scale=softmax_scale)
        out = self._mods[key](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.view(b, s, h, d).transpose(1, 2)


_FACTORIES: dict[str, Callable[[], LocalAttention]] = {
    "sdpa": SDPABackend,
    "math": MathBackend,
    "flash_attn": FlashAttnBackend,
    "te": TEBackend,
}
_MODULES = {"flash_attn": "flash_attn", "te": "transformer_engine"}


def available_backends() -> list[str]:
    """Names whose packages import here."""
    return [n for n in _FACTORIES if n not in _MODULES or importlib.util.find_spec(_MODULES[n]) is not None]


class BackendRegistry:
    """Instantiates backends on first use and logs each choice once."""

    def __init__(self) -> None:
        self._instances: dict[str, LocalAttention] = {}

    def get(self, name: str, setting: str = "backend") -> LocalAttention:
        if isinstance(name, LocalAttention):
            return name
        if name not in _FACTORIES:
            raise SPConfigError(f"{setting}={name!r} is invalid: choose one of {', '.join(_FACTORIES)}")
        if name not in self._instances:
            if name in _MODULES and importlib.util.find_spec(_MODULES[name]) is None:
                raise SPConfigError(
                    f"{setting}={name!r} needs the package {_MODULES[name]!r}, which is not installed here; "
                    f"available: {', '.join(available_backends())}")
            self._instances[name] = _FACTORIES[name]()
            log.info("megatron_sp_ext: local attention backend = %s", name)
        return self._instances[name]


_REGISTRY = BackendRegistry()


def get_backend(name: "str | LocalAttention" = "sdpa", setting: str = "backend") -> LocalAttention:
    """The backend called ``name`` (or ``name`` itself if it already is one)."""
    return _REGISTRY.get(name, setting)


def wrap_callable(fn: Callable, name: Optional[str] = None) -> LocalAttention:
    """Adapt a user callable ``fn(q, k, v, causal=..., softmax_scale=...) -> out`` (bhsd) as a backend."""
    return _CallableBackend(fn, name or getattr(fn, "__name__", "user"))


class _CallableBackend(LocalAttention):
    def __init__(self, fn: Callable, name: str) -> None:
        self._fn, self.name = fn, name

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return self._fn(q, k, v, causal=causal, softmax_scale=softmax_scale)
