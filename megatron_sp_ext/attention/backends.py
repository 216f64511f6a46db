"""Local (single-device) attention backends behind one signature.

Every backend is a ``LocalAttention`` with
  ``__call__(q, k, v, *, causal, softmax_scale) -> out``   differentiable, [B, H, S, D] in and out
  ``forward_lse(q, k, v, *, causal, softmax_scale) -> (out, lse)``   no autograd, lse fp32 [B, H, S]
  ``backward_lse(do, q, k, v, out, lse, *, causal, softmax_scale) -> (dq, dk, dv)``
k/v may carry fewer heads than q (GQA). Backends: "auto" (default; "sdpa" is the same): every call on
FlashAttention-4 where it runs (flash-attn-4 installed, Hopper/Blackwell, bf16/fp16, its head dims), else plain
calls through torch's SDPA and log-sum-exp blocks on the fastest kernel that runs here (cuDNN,
FlashAttention-2, math; see lse_kernels); "fa4", "cudnn" and "torch_flash": every call on that one kernel (an
error naming the setting and the reason where it does not run); "math" (fp32 reference with explicit masks);
"flash_attn" and "te" when those packages import. ``get_backend`` logs the choice once per name.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..errors import SPConfigError
from . import blockwise, fa4, lse_kernels

log = logging.getLogger("megatron_sp_ext")


class LocalAttention:
    """A named local attention implementation (see module docstring for the contract)."""

    name = "base"

    def __call__(self, q, k, v, *, causal: bool, softmax_scale: float) -> torch.Tensor:
        raise NotImplementedError

    def forward_lse(self, q, k, v, *, causal: bool, softmax_scale: float, mask=None, tiles=None):
        """(out, lse) of one block; ``mask``: bool [Sq, Sk] (or [h, Sq, Sk]) keep mask; ``tiles``: a
        ``tiles.TileSlice`` of a block mask for these rows (ANDed with causal and mask)."""
        return blockwise.math_forward(q, k, v, softmax_scale, _combined_mask(q, k, causal, mask, tiles))

    def backward_lse(self, do, q, k, v, out, lse, *, causal: bool, softmax_scale: float, mask=None, tiles=None):
        """(dq, dk, dv) of ``forward_lse``'s block given the FINAL out/lse of its rows."""
        return blockwise.math_backward(do, q, k, v, out, lse, softmax_scale, _combined_mask(q, k, causal, mask, tiles))


def _combined_mask(q, k, causal: bool, mask, tiles):
    """The math kernel's mask: None / "causal" / a bool keep mask (tiles AND causal AND mask)."""
    if tiles is None:
        return mask if mask is not None else ("causal" if causal else None)
    m = tiles.token_mask()
    if causal:
        m = m & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=m.device).tril()
    if mask is not None:
        m = m & mask
    return m


class SDPABackend(LocalAttention):
    """Plain calls: torch.nn.functional.scaled_dot_product_attention. Blocks with log-sum-exp (ring, TASP,
    Torus, hybrid, masked Ulysses): the fastest available kernel of ``lse_kernels.KERNELS`` (cuDNN, then
    torch's FlashAttention-2, math), chosen per (device, dtype). Names "auto" and "sdpa"."""

    name = "sdpa"
    kernel = "auto"   # or one of lse_kernels.KERNELS, fixed

    def __init__(self, name: Optional[str] = None, setting: str = "backend") -> None:
        if name is not None:
            self.name = name
        self.setting = setting
        self._chosen: dict = {}

    def kernel_for(self, q: torch.Tensor) -> str:
        """The block kernel for q's (device, dtype, head dim); a fixed kernel that cannot run here raises naming the
        setting and the reason. Chosen once per key and logged once."""
        key = (str(q.device), q.dtype, q.shape[-1])
        if key not in self._chosen:
            if self.kernel == "auto":
                k = lse_kernels.best(q.device, q.dtype, q.shape[-1])
            else:
                k = self.kernel
                if not lse_kernels.available(k, q.device, q.dtype, q.shape[-1]):
                    here = [n for n in lse_kernels.KERNELS
                            if lse_kernels.available(n, q.device, q.dtype, q.shape[-1])]
                    raise SPConfigError(
                        f"{self.setting}={self.name!r} cannot run here ({q.device}, {q.dtype}, head dim "
                        f"{q.shape[-1]}): {lse_kernels.why_not(k, q.device, q.dtype, q.shape[-1])}; use 'auto' "
                        f"(kernels that run here: {', '.join(here)})")
            log.debug("megatron_sp_ext: %s=%r runs attention on the %s kernel (%s, %s, head dim %d)",
                      self.setting, self.name, k, q.device, q.dtype, q.shape[-1])
            self._chosen[key] = k
        return self._chosen[key]

    def chosen(self) -> dict:
        """{(device, dtype, head dim): kernel} chosen so far (what a job reports to its user)."""
        return dict(self._chosen)

    def __call__(self, q, k, v, *, causal, softmax_scale):
        if _one_row_block(q, k):
            return MathBackend()(q, k, v, causal=causal, softmax_scale=softmax_scale)
        if self.kernel_for(q) == "fa4":
            return lse_attention("fa4", q, k, v, causal, softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None, tiles=None):
        if mask is not None or tiles is not None:
            return super().forward_lse(q, k, v, causal=causal, softmax_scale=softmax_scale, mask=mask, tiles=tiles)
        return lse_kernels.forward(self.kernel_for(q), q, k, v, softmax_scale, causal)

    def backward_lse(self, do, q, k, v, out, lse, *, causal, softmax_scale, mask=None, tiles=None):
        if mask is not None or tiles is not None:
            return super().backward_lse(do, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, mask=mask,
                                        tiles=tiles)
        return lse_kernels.backward(self.kernel_for(q), do, q, k, v, out, lse, softmax_scale, causal)


class FixedKernelBackend(SDPABackend):
    """Every call on one named kernel: "fa4" (FlashAttention-4), "cudnn" (cuDNN attention) or "torch_flash"
    (torch's FlashAttention-2, the kernel of the ring paths before "auto"). Unavailable here = an error naming the
    setting and the reason, never a silent fallback."""

    def __init__(self, name: str, kernel: str, setting: str = "backend") -> None:
        super().__init__(name, setting)
        self.kernel = kernel

    def __call__(self, q, k, v, *, causal, softmax_scale):
        kern = self.kernel_for(q)
        if kern == "math" or _one_row_block(q, k):
            return MathBackend()(q, k, v, causal=causal, softmax_scale=softmax_scale)
        if kern == "fa4":
            return lse_attention("fa4", q, k, v, causal, softmax_scale)
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
        sdp = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kern]
        if k.shape[1] != q.shape[1]:   # not every kernel takes GQA: expand (autograd sums the copies back)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        with sdpa_kernel([sdp]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)


def lse_attention(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: Optional[float]) -> torch.Tensor:
    """Differentiable attention [B, H, S, D] on one ``lse_kernels`` kernel's forward/backward (the calls the ring
    and head-chunked blocks make, so a plain call and a one-block ring compute the same bits)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _LseKernelFn.apply(q, k, v, kernel, causal, scale)


class _LseKernelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel, causal, scale):
        out, lse = lse_kernels.forward(kernel, q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, causal, scale)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, causal, scale = ctx.args
        dq, dk, dv = lse_kernels.backward(kernel, do, q, k, v, out, lse, scale, causal)
        return dq, dk, dv, None, None, None


def _one_row_block(q: torch.Tensor, k: torch.Tensor) -> bool:
    """A CUDA block with one query or one key row (``lse_kernels.one_row_block``): it runs on the math kernel."""
    return q.is_cuda and lse_kernels.one_row_block(q, k)


class MathBackend(LocalAttention):
    """Explicit fp32 softmax attention; the reference path (slow, exact masks)."""

    name = "math"

    def __call__(self, q, k, v, *, causal, softmax_scale):
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return _MathAttnFn.apply(q, k, v, causal, scale)


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


_FACTORIES: dict[str, Callable[[str], LocalAttention]] = {
    "auto": lambda setting: SDPABackend("auto", setting),
    "sdpa": lambda setting: SDPABackend("sdpa", setting),
    "fa4": lambda setting: FixedKernelBackend("fa4", "fa4", setting),
    "cudnn": lambda setting: FixedKernelBackend("cudnn", "cudnn", setting),
    "torch_flash": lambda setting: FixedKernelBackend("torch_flash", "flash", setting),
    "math": lambda setting: MathBackend(),
    "flash_attn": lambda setting: FlashAttnBackend(),
    "te": lambda setting: TEBackend(),
}
_MODULES = {"flash_attn": "flash_attn", "te": "transformer_engine"}


def _installed(name: str) -> bool:
    if name == "fa4":
        return fa4.installed()
    return name not in _MODULES or importlib.util.find_spec(_MODULES[name]) is not None


def available_backends() -> list[str]:
    """Names whose packages import here."""
    return [n for n in _FACTORIES if _installed(n)]


class BackendRegistry:
    """Instantiates backends on first use and logs each choice once."""

    def __init__(self) -> None:
        self._instances: dict[tuple, LocalAttention] = {}

    def get(self, name: str, setting: str = "backend") -> LocalAttention:
        if isinstance(name, LocalAttention):
            return name
        if name not in _FACTORIES:
            raise SPConfigError(f"{setting}={name!r} is invalid: choose one of {', '.join(_FACTORIES)}")
        if (name, setting) not in self._instances:
            if not _installed(name):
                package = fa4.PACKAGE if name == "fa4" else _MODULES[name]
                hint = f" ({fa4.INSTALL_HINT})" if name == "fa4" else ""
                raise SPConfigError(
                    f"{setting}={name!r} needs the package {package!r}, which is not installed here{hint}; "
                    f"available: {', '.join(available_backends())}")
            self._instances[(name, setting)] = _FACTORIES[name](setting)
            log.debug("megatron_sp_ext: local attention backend = %s", name)
        return self._instances[(name, setting)]


_REGISTRY = BackendRegistry()


def get_backend(name: "str | LocalAttention" = "auto", setting: str = "backend") -> LocalAttention:
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
