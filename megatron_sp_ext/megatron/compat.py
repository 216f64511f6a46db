"""The one place that knows how megatron-core releases differ for our adapters.

Supported: megatron-core 0.16.x through 0.19.x and Megatron-LM main (0.20.0 dev); CI tests 0.16.1 and 0.19.2. Differences
handled here:
  * 0.18+: ``TransformerLayer`` passes ``name=`` (and ``pp_layer_offset=``) to its self-attention
    submodule. ``SPSelfAttention`` forwards unknown keyword arguments to its parent, and
    ``parent_kwargs`` keeps only those the installed parent accepts.
  * 0.19+: ``megatron.core.utils.get_batch_on_this_cp_rank`` takes a required ``is_hybrid_cp`` and a
    ``cp_group`` whose default (None) means the WORLD group, not the context-parallel one (with TP x CP it
    would split over TP ranks too); ``cp_rank_batch`` passes parallel_state's CP group explicitly.
Other releases raise one error naming the installed version and the supported range.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from ..errors import SPConfigError

SUPPORTED_RANGE = (">=0.16", "<0.21")
_MIN, _MAX = (0, 16), (0, 21)


def megatron_core_version() -> str:
    """The installed megatron-core version string (``megatron.core.package_info.__version__``)."""
    try:
        from megatron.core import package_info  # noqa: PLC0415
        return str(package_info.__version__)
    except ImportError:  # pragma: no cover - very old releases
        import importlib.metadata as md  # noqa: PLC0415
        return md.version("megatron-core")


def _release(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def check_supported(version: str | None = None) -> str:
    """Raise SPConfigError unless ``version`` (default: the installed one) is in the supported range."""
    version = version or megatron_core_version()
    if not (_MIN <= _release(version) < _MAX):
        raise SPConfigError(
            f"megatron-core {version} is not supported by megatron_sp_ext: supported releases are "
            f"megatron-core {','.join(SUPPORTED_RANGE)} (0.16.x-0.19.x and Megatron-LM main, 0.20.0 dev); install one of those, e.g. "
            f"pip install 'megatron-core>=0.16,<0.21'")
    return version


@functools.lru_cache(maxsize=None)
def _accepted(fn: Callable) -> tuple[frozenset, bool]:
    params = inspect.signature(fn).parameters
    return frozenset(params), any(p.kind is p.VAR_KEYWORD for p in params.values())


def parent_kwargs(cls_init: Callable, kwargs: dict) -> dict:
    """``kwargs`` restricted to what ``cls_init`` accepts (all of them if it takes ``**kwargs``)."""
    names, var_kw = _accepted(cls_init)
    return dict(kwargs) if var_kw else {k: v for k, v in kwargs.items() if k in names}


def cp_rank_batch(batch: dict, cp_group: Any = None) -> dict:
    """Megatron's zigzag split of a batch for this context-parallel rank, on every supported release.

    ``cp_group`` defaults to ``parallel_state.get_context_parallel_group()`` (releases that take the group
    would otherwise split over the default group, i.e. every rank)."""
    from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: PLC0415
    names, _ = _accepted(get_batch_on_this_cp_rank)
    kw: dict = {}
    if "is_hybrid_cp" in names:
        kw["is_hybrid_cp"] = False
    if "cp_group" in names:
        if cp_group is None:
            from megatron.core import parallel_state  # noqa: PLC0415
            cp_group = parallel_state.get_context_parallel_group()
        kw["cp_group"] = cp_group
    return get_batch_on_this_cp_rank(batch, **kw)
