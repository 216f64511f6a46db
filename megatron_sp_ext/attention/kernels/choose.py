"""The one kernel choice: which registry kernel runs a call (``KernelCall``: device, dtype, head dim, needs, tile
slice) for a setting ("auto", or a kernel's setting). Every place that needs a kernel asks here (the backends'
log-sum-exp, plain and block-sparse calls, ``block_sparse.resolve_kernel``, the varlen methods' candidates, the DiT's
reference route, the plain calls through torch's SDPA dispatch and attention dropout); tests/test_registry.py scans
that no other module makes the choice, nor calls torch's SDPA itself (the registry's SDPA kernel does).

  "auto" (``AUTO_SETTINGS``: "sdpa" is its older name): the first of ``candidates(call)`` (``AUTO``, for a
      block-sparse call ``TILE_ORDER``'s kernels for its tile size first, whose declared calls cover the call's
      needs) that runs the call here, the math kernel as the last resort;
  a kernel's setting: that kernel if it runs the call here, else SPConfigError naming the user's setting and the
      reason, never a silent replacement.
"Runs here" is the kernel's ``why_not`` (its declared calls, device, dtype, architecture, own conditions); a caller
may add a probe (``lse_kernels.why_not_call``: a tiny call against math). Timing-based decisions (the varlen methods'
``VarlenChooser``) time the candidates this module lists.
"""
from __future__ import annotations

from typing import Callable, Optional

from ...errors import SPConfigError
from .base import Kernel, KernelCall
from .registry import AUTO, FALLBACK, SDPA, TILE_ORDER, by_setting, get, names, settings

AUTO_SETTINGS = ("auto", "sdpa")   # the settings that mean "auto" ("sdpa": the backend setting's older word)

PICKS: dict = {}   # (kernel name, "tiles" or "dense") -> calls routed to it by pick/require (reports, benchmarks)

WhyNot = Callable[[Kernel, KernelCall], Optional[str]]


def is_auto(setting: object) -> bool:
    """Whether ``setting`` (a backend or kernel setting's value) means "auto"."""
    return isinstance(setting, str) and setting in AUTO_SETTINGS


def auto_order(call: KernelCall) -> tuple[str, ...]:
    """AUTO for ``call``: for a block-sparse call, the kernels ``TILE_ORDER`` names for its tile size first."""
    if call.tiles is None:
        return AUTO
    bs = call.tiles.tile
    first = next(order for multiple, order in TILE_ORDER if bs % multiple == 0)
    return tuple(first) + tuple(n for n in AUTO if n not in first)


def candidates(call: KernelCall, setting: str = "auto", *, after: Optional[str] = None) -> tuple[str, ...]:
    """The kernels ``setting`` may run ``call`` on, in the order "auto" tries them, by their declared calls (no device
    check): "auto": ``auto_order(call)`` from ``after`` on (when given: a kernel "auto" chose for the call's other
    blocks); a kernel's setting: that kernel. Without "tiles" among the needs, only kernels with dense calls."""
    if is_auto(setting):
        order = auto_order(call)
        order = order[order.index(after):] if after is not None else order
    else:
        kernel = by_setting(setting)
        order = (kernel.name,) if kernel is not None else ()
    declared = set(names(*call.needs))
    return tuple(n for n in order if n in declared)


def _own_why_not(kernel: Kernel, call: KernelCall) -> Optional[str]:
    return kernel.why_not(call)


def choose(call: KernelCall, setting: str = "auto", *, name: str = "backend", why_not: Optional[WhyNot] = None,
           count: bool = True) -> Kernel:
    """The kernel that runs ``call`` for ``setting`` (module docstring): "auto": the first of ``candidates(call)``
    that runs it here, else the math kernel; a kernel's setting: that kernel if it runs the call, else SPConfigError
    naming ``name`` (the user's name of the setting: flag, JSON key, keyword) and the reason. ``why_not(kernel,
    call)``: the test (default: the kernel's own ``why_not``). ``count``: record the pick in ``PICKS``."""
    test = why_not or _own_why_not
    if is_auto(setting):
        for n in candidates(call):
            if test(get(n), call) is None:
                return _picked(get(n), call, count)
        return _picked(get(FALLBACK), call, count)
    kernel = by_setting(setting)
    if kernel is None:
        raise SPConfigError(f"{name}={setting!r} is invalid: choose 'auto' or one of {', '.join(settings())}")
    reason = test(kernel, call)
    if reason is not None:
        here = [n for n in candidates(call) if test(get(n), call) is None]
        detail = (", block_mask" if call.tiles is not None else "") + \
            (f", head dim {call.head_dim}" if "tiles" not in call.needs and call.head_dim is not None else "")
        raise SPConfigError(f"{name}={kernel.setting!r} cannot run here ({call.device}, {call.dtype}{detail}): "
                            f"{reason}; use 'auto' (kernels that run it here: {', '.join(here) or FALLBACK})")
    return _picked(kernel, call, count)


def _picked(kernel: Kernel, call: KernelCall, count: bool) -> Kernel:
    if count:
        key = (kernel.name, "tiles" if call.tiles is not None else "dense")
        PICKS[key] = PICKS.get(key, 0) + 1
    return kernel


def pick(call: KernelCall) -> Kernel:
    """``choose(call, "auto")``: the first kernel that runs ``call`` here; math as the last resort."""
    return choose(call, "auto")


def require(kernel: Kernel, call: KernelCall, setting: str) -> Kernel:
    """``choose(call, kernel.setting, name=setting)``: ``kernel`` if it runs ``call``, else SPConfigError naming
    ``setting`` and the reason (never a silent replacement)."""
    return choose(call, kernel.setting, name=setting)


def plain_kernel(kernel: Kernel) -> Kernel:
    """The kernel of "auto"'s plain calls where its log-sum-exp calls run on ``kernel``: torch's SDPA dispatch (the
    registry's SDPA kernel) when ``kernel`` is one of the kernels that dispatch picks among (``in_torch_sdpa``:
    cuDNN, FlashAttention-2, math), else ``kernel`` itself (FA4, a fixed kernel: its own plain call)."""
    return get(SDPA) if kernel.in_torch_sdpa else kernel


def dropout_kernel(setting: str, name: str, dropout_p: float) -> Kernel:
    """The kernel of a plain call with attention dropout ``dropout_p`` for the backend setting ``setting``: torch's
    SDPA dispatch (SDPA's own dropout: the one kernel that draws dropout masks) for "auto" and for a kernel that
    declares dropout (torch's dispatch picks among those); SPConfigError naming ``name`` for a kernel without."""
    kernel = None if is_auto(setting) else by_setting(setting)
    if kernel is not None and not kernel.caps.dropout:
        able = [get(n).setting for n in names("plain", "dropout")]
        raise SPConfigError(f"{name}={setting!r} cannot apply attention dropout (dropout_p={dropout_p}): "
                            f"{kernel.label} has none; set the attention dropout to 0, or choose {name} 'auto' or "
                            f"one of {', '.join(able)}")
    return get(SDPA)


def torch_sdpa() -> Kernel:
    """The registry's SDPA kernel (torch's own dispatch, kernels/sdpa.py) for the calls that want torch's SDPA itself:
    explicit keep masks (a model's key padding, a reference's token mask) and small fp32 / float64 side calls (the
    video tiles' coarse branch, a cross-attention)."""
    return get(SDPA)


def via_torch_sdpa(kernel: Kernel) -> bool:
    """Whether "auto"'s plain calls, where its log-sum-exp blocks run on ``kernel``, go through torch's SDPA dispatch
    (torch then picks among cuDNN, FlashAttention-2 and math) rather than ``kernel``'s own plain call (FA4)."""
    return kernel.in_torch_sdpa
