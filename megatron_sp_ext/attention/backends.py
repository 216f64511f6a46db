"""Local (single-device) attention backends behind one signature, on the registry's kernels (``kernels``).

Every backend is a ``LocalAttention`` with
  ``__call__(q, k, v, *, causal, softmax_scale) -> out``   differentiable, [B, H, S, D] in and out
  ``forward_lse(q, k, v, *, causal, softmax_scale, mask=None, tiles=None) -> (out, lse)``   no autograd, lse fp32
  ``backward_lse(do, q, k, v, out, lse, *, causal, softmax_scale, mask=None, tiles=None) -> (dq, dk, dv)``
k/v may carry fewer heads than q (GQA). ``tiles``: a block mask's slice for the call (attention/tiles.py), ANDed with
causal and ``mask``. Backends ("backend" setting; ``config.BACKENDS`` = "auto", "sdpa" and every kernel's setting):
  "auto" (default; "sdpa" is the same, ``kernels.is_auto``): ``AutoBackend``, every call on the kernel the one
      choice (``kernels.choose``) names for it: the first of the registry's order that runs it here
      (FlashAttention-4 where it runs; else plain calls through torch's SDPA dispatch and log-sum-exp calls on
      cuDNN, FlashAttention-2 or math; block-sparse calls on FA4's or cuDNN frontend's block sparsity, flex_attention
      or math)
  a kernel's setting ("fa4", "cudnn", "torch_flash", "math", "flash_attn", "te"): every call on that kernel; a
      call it cannot run (no block sparsity, wrong device/dtype, ...) raises SPConfigError naming the setting and
      the reason, never a silent replacement.
``get_backend`` logs the choice once per name. ``with_tile_kernel`` gives a backend whose block-sparse calls
(``tiles=``) run on one named block-sparse kernel whatever the backend's own choice (the DiT's
--sparse-attention-kernel).
"""
from __future__ import annotations

import copy
import logging
from typing import Callable, Optional

import torch

from ..errors import SPConfigError
from . import kernels, lse_kernels
from .kernels import math as math_kernel
from .kernels import Kernel, KernelCall

log = logging.getLogger("megatron_sp_ext")

AUTO_NAMES = kernels.AUTO_SETTINGS   # the backend settings that mean "auto" (decided by the kernel choice)


def _combined_mask(q, k, causal: bool, mask, tiles):
    """The math kernel's mask: None / "causal" / a bool keep mask (tiles AND causal by position AND mask)."""
    if tiles is None:
        return mask if mask is not None else ("causal" if causal else None)
    m = math_kernel.keep_mask(q, k, causal, tiles)
    return m if mask is None else m & mask


def tile_call(q: torch.Tensor, tiles, causal: bool, lse: bool) -> KernelCall:
    """The registry call of a block-sparse block on ``q`` (``lse``: forward with lse + backward from it)."""
    needs = {"tiles"} | ({"lse"} if lse else {"plain"}) | ({"causal"} if causal else set())
    return KernelCall(q.device, q.dtype, q.shape[-1], frozenset(needs), tiles)


class LocalAttention:
    """A named local attention implementation (see module docstring for the contract). ``tile_setting``: "auto"
    (block-sparse calls on the backend's own choice, ``tile_kernel``) or the setting of a kernel with block sparsity
    that every block-sparse call must run on (``with_tile_kernel``; ``tile_setting_name`` names it in refusals)."""

    name = "base"
    tile_setting = "auto"
    tile_setting_name = "tile_setting"

    def __call__(self, q, k, v, *, causal: bool, softmax_scale: float) -> torch.Tensor:
        raise NotImplementedError

    def forward_lse(self, q, k, v, *, causal: bool, softmax_scale: float, mask=None, tiles=None):
        """(out, lse) of one call; ``mask``: bool [Sq, Sk] (or [h, Sq, Sk]) keep mask; ``tiles``: a
        ``tiles.TileSlice`` of a block mask for these rows (ANDed with causal and mask)."""
        if tiles is not None and mask is None and self.tile_setting != "auto":
            return self.tile_kernel(q, tiles, causal, True).forward(q, k, v, softmax_scale, causal, tiles)
        return math_kernel.math_forward(q, k, v, softmax_scale, _combined_mask(q, k, causal, mask, tiles))

    def backward_lse(self, do, q, k, v, out, lse, *, causal: bool, softmax_scale: float, mask=None, tiles=None):
        """(dq, dk, dv) of ``forward_lse``'s call given the FINAL out/lse of its rows."""
        if tiles is not None and mask is None and self.tile_setting != "auto":
            return self.tile_kernel(q, tiles, causal, True).backward(do, q, k, v, out, lse, softmax_scale, causal,
                                                                     tiles)
        return math_kernel.math_backward(do, q, k, v, out, lse, softmax_scale, _combined_mask(q, k, causal, mask, tiles))

    def tile_kernel(self, q: torch.Tensor, tiles, causal: bool, lse: bool) -> Kernel:
        """The kernel that runs a block-sparse call of this backend (the math kernel here, or ``tile_setting``)."""
        fixed = self.fixed_tile_kernel(q, tiles, causal, lse)
        return fixed if fixed is not None else kernels.get(kernels.FALLBACK)

    def fixed_tile_kernel(self, q: torch.Tensor, tiles, causal: bool, lse: bool) -> Optional[Kernel]:
        """None for ``tile_setting`` "auto"; else that kernel if it runs the call (SPConfigError naming
        ``tile_setting_name`` and the reason otherwise). ``tiles`` None (which kernel the backend names here, before a
        call's slice is known): the device and dtype are checked, the call's needs when its slice comes."""
        if self.tile_setting == "auto":
            return None
        call = tile_call(q, tiles, causal, lse) if tiles is not None else \
            KernelCall(q.device, q.dtype, q.shape[-1], frozenset({"tiles"}))
        return kernels.choose(call, self.tile_setting, name=self.tile_setting_name)


class AutoBackend(LocalAttention):
    """The "auto" backend (also named "sdpa"): per call the kernel ``kernels.choose`` names. Plain calls on
    FlashAttention-4 where it runs, else through torch's SDPA dispatch; calls with log-sum-exp on the fastest
    ``lse_kernels`` kernel available per (device, dtype, head dim); block-sparse calls on ``tile_kernel``."""

    name = "auto"
    kernel = "auto"   # or a kernel name, fixed (FixedKernelBackend)

    def __init__(self, name: Optional[str] = None, setting: str = "backend") -> None:
        if name is not None:
            self.name = name
        self.setting = setting
        self._chosen: dict = {}

    @property
    def kernel_setting(self) -> str:
        """The kernel setting this backend's calls are chosen for: "auto", or the fixed kernel's setting."""
        return self.kernel if self.kernel == "auto" else kernels.get(self.kernel).setting

    def kernel_for(self, q: torch.Tensor) -> str:
        """The log-sum-exp kernel for q's (device, dtype, head dim): ``kernels.choose`` of a log-sum-exp call, each
        candidate probed (``lse_kernels.why_not_call``); a fixed kernel that cannot run here raises naming the
        setting and the reason. Chosen once per key and logged once."""
        key = (str(q.device), q.dtype, q.shape[-1])
        if key not in self._chosen:
            call = KernelCall(q.device, q.dtype, q.shape[-1], frozenset({"lse"}))
            k = kernels.choose(call, self.kernel_setting, name=self.setting, why_not=lse_kernels.why_not_call,
                               count=False).name
            log.debug("megatron_sp_ext: %s=%r runs attention on the %s kernel (%s, %s, head dim %d)",
                      self.setting, self.name, k, q.device, q.dtype, q.shape[-1])
            self._chosen[key] = k
        return self._chosen[key]

    def chosen(self) -> dict:
        """{(device, dtype, head dim): kernel} chosen so far (what a job reports to its user)."""
        return dict(self._chosen)

    def tile_kernel(self, q: torch.Tensor, tiles, causal: bool, lse: bool) -> Kernel:
        """The kernel of a block-sparse call (``lse``: one that offers forward with lse and backward from it):
        "auto" picks the registry's first that runs it (FA4's block sparsity, flex, math); a fixed kernel must run it
        (SPConfigError naming the setting otherwise)."""
        fixed = self.fixed_tile_kernel(q, tiles, causal, lse)
        if fixed is not None:
            return fixed
        return kernels.choose(tile_call(q, tiles, causal, lse), self.kernel_setting, name=self.setting)

    def plain_via_torch_sdpa(self, q: torch.Tensor) -> bool:
        """Whether a plain call on q's (device, dtype, head dim) goes through torch's SDPA dispatch (the DiT's
        reference route) rather than a kernel's own plain call (FA4; a fixed kernel)."""
        return kernels.via_torch_sdpa(kernels.get(self.kernel_for(q)))

    def __call__(self, q, k, v, *, causal, softmax_scale):
        if _one_row_call(q, k):
            return MathBackend()(q, k, v, causal=causal, softmax_scale=softmax_scale)
        # the plain call's kernel: FA4's own, or torch's SDPA dispatch where the lse kernel is one of torch's
        kern = kernels.plain_kernel(kernels.get(self.kernel_for(q)))
        scale = softmax_scale if kernels.via_torch_sdpa(kern) else _scale(q, softmax_scale)
        return kern.attention(q, k, v, causal, scale)

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None, tiles=None):
        if mask is not None:
            return super().forward_lse(q, k, v, causal=causal, softmax_scale=softmax_scale, mask=mask, tiles=tiles)
        if tiles is not None:
            return self.tile_kernel(q, tiles, causal, True).forward(q, k, v, softmax_scale, causal, tiles)
        return lse_kernels.forward(self.kernel_for(q), q, k, v, softmax_scale, causal)

    def backward_lse(self, do, q, k, v, out, lse, *, causal, softmax_scale, mask=None, tiles=None):
        if mask is not None:
            return super().backward_lse(do, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, mask=mask,
                                        tiles=tiles)
        if tiles is not None:
            return self.tile_kernel(q, tiles, causal, True).backward(do, q, k, v, out, lse, softmax_scale, causal,
                                                                     tiles)
        return lse_kernels.backward(self.kernel_for(q), do, q, k, v, out, lse, softmax_scale, causal)


class FixedKernelBackend(AutoBackend):
    """Every call on one named kernel (its setting: "fa4", "cudnn", "torch_flash"). Unavailable here = an error
    naming the setting and the reason, never a silent fallback."""

    def __init__(self, name: str, kernel: str, setting: str = "backend") -> None:
        super().__init__(name, setting)
        self.kernel = kernel

    def plain_via_torch_sdpa(self, q: torch.Tensor) -> bool:
        return False   # every call on the named kernel's own calls

    def __call__(self, q, k, v, *, causal, softmax_scale):
        kern = kernels.get(self.kernel_for(q))
        if _one_row_call(q, k):
            kern = kernels.get(kernels.FALLBACK)
        return kern.attention(q, k, v, causal, _scale(q, softmax_scale))


def lse_attention(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: Optional[float]) -> torch.Tensor:
    """Differentiable attention [B, H, S, D] on one ``lse_kernels`` kernel's forward/backward (the calls the ring
    and the head chunks make, so a plain call and a one-rank ring compute the same bits)."""
    return kernels.LseFunction.apply(q, k, v, kernels.get(kernel), causal, _scale(q, softmax_scale), None)


def _scale(q: torch.Tensor, softmax_scale: Optional[float]) -> float:
    """The softmax scale of a call: the given one, else 1/sqrt(head dim)."""
    return softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5


def _one_row_call(q: torch.Tensor, k: torch.Tensor) -> bool:
    """A CUDA call with one query or one key row (``lse_kernels.one_row_call``): it runs on the math kernel."""
    return q.is_cuda and lse_kernels.one_row_call(q, k)


class MathBackend(LocalAttention):
    """Explicit fp32 softmax attention; the reference path (slow, exact masks)."""

    name = "math"

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return kernels.get(kernels.FALLBACK).attention(q, k, v, causal, _scale(q, softmax_scale))


class PlainKernelBackend(LocalAttention):
    """A kernel with plain calls only (flash_attn, te): ring steps and block-sparse calls are refused by name."""

    def __init__(self, kernel: Kernel, setting: str = "backend") -> None:
        self.kern, self.name, self.setting = kernel, kernel.setting, setting

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return self.kern.attention(q, k, v, causal, softmax_scale)

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None, tiles=None):
        if tiles is not None and mask is None and self.tile_setting != "auto":     # on the named tile kernel
            return super().forward_lse(q, k, v, causal=causal, softmax_scale=softmax_scale, tiles=tiles)
        raise SPConfigError(f"{self.setting}={self.name!r} has no forward with log-sum-exp (ring, TASP, torus, "
                            f"hybrid and block-sparse calls need one): use 'auto' or one of "
                            f"{', '.join(kernels.get(n).setting for n in kernels.names('lse'))}")

    def backward_lse(self, do, q, k, v, out, lse, *, causal, softmax_scale, mask=None, tiles=None):
        if tiles is not None and mask is None and self.tile_setting != "auto":
            return super().backward_lse(do, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                        tiles=tiles)
        return self.forward_lse(q, k, v, causal=causal, softmax_scale=softmax_scale, mask=mask)


def _factory(name: str) -> Optional[Callable[[str], LocalAttention]]:
    if kernels.is_auto(name):
        return lambda setting: AutoBackend(name, setting)
    kern = kernels.by_setting(name)
    if kern is None:
        return None
    if kern.name == kernels.FALLBACK:
        return lambda setting: MathBackend()
    if kern.caps.lse and kern.caps.dense:
        return lambda setting: FixedKernelBackend(name, kern.name, setting)
    if kern.caps.tiles == "none":
        return lambda setting: PlainKernelBackend(kern, setting)
    return None   # a block-sparse-only kernel (flex, cudnn_block_sparse): not a backend (a tile_setting value)


def backend_names() -> tuple[str, ...]:
    """The backend setting's choices: "auto", the fused kernels with log-sum-exp, "sdpa" (= auto), the math kernel,
    the plain-call kernels (every kernel of the registry that can be a backend)."""
    usable = [s for s in kernels.settings() if _factory(s) is not None]
    fast = [s for s in usable if kernels.by_setting(s).caps.lse and s != kernels.FALLBACK]
    first, *others = kernels.AUTO_SETTINGS
    return (first,) + tuple(fast) + tuple(others) + tuple(s for s in usable if s not in fast)


def available_backends() -> list[str]:
    """Names whose packages import here."""
    return [n for n in backend_names() if kernels.is_auto(n) or kernels.by_setting(n).installed()]


def tile_kernel_settings() -> tuple[str, ...]:
    """The choices of a block-sparse kernel setting: "auto" and every kernel "auto" may pick that has block sparsity
    (``attention.block_sparse.KERNELS``)."""
    return ("auto",) + tuple(kernels.get(n).setting for n in kernels.names("tiles", auto_only=True))


def with_tile_kernel(backend: "str | LocalAttention", tile_setting: str, setting: str = "tile_setting",
                      backend_setting: str = "backend") -> LocalAttention:
    """``backend`` (a name or a backend) whose block-sparse calls all run on ``tile_setting`` (one of
    ``tile_kernel_settings``; "auto": the backend itself, its own choice); its dense calls are unchanged. A copy:
    the shared instance ``get_backend`` returns is not changed. Raises SPConfigError naming ``setting`` for an unknown
    kernel; a call the kernel cannot run is refused then, naming ``setting``."""
    be = get_backend(backend, backend_setting)
    choices = tile_kernel_settings()
    if tile_setting not in choices:
        raise SPConfigError(f"{setting}={tile_setting!r} is invalid: choose one of {', '.join(choices)}")
    if tile_setting == "auto":
        return be
    out = copy.copy(be)
    out.tile_setting, out.tile_setting_name = tile_setting, setting
    return out


class BackendRegistry:
    """Instantiates backends on first use and logs each choice once."""

    def __init__(self) -> None:
        self._instances: dict[tuple, LocalAttention] = {}

    def get(self, name: str, setting: str = "backend") -> LocalAttention:
        if isinstance(name, LocalAttention):
            return name
        make = _factory(name) if isinstance(name, str) else None
        if make is None:
            raise SPConfigError(f"{setting}={name!r} is invalid: choose one of {', '.join(backend_names())}")
        if (name, setting) not in self._instances:
            kern = kernels.by_setting(name)
            if kern is not None and not kern.installed():
                hint = f" ({kern.install_hint})" if getattr(kern, "install_hint", None) else ""
                raise SPConfigError(
                    f"{setting}={name!r} needs the package {kern.package!r}, which is not installed here{hint}; "
                    f"available: {', '.join(available_backends())}")
            self._instances[(name, setting)] = make(setting)
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
