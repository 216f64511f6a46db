"""Megatron-core adapters (need megatron-core; imported only when this subpackage is used).

    from megatron_sp_ext.megatron import SPDotProductAttention, with_sp_core_attention, add_arguments

The names below are loaded on first use (PEP 562 ``__getattr__``), after ``compat.check_supported`` (one clear
error for a megatron-core release outside the supported range), so ``python -m megatron_sp_ext.megatron.launch``
checks its command line before anything imports megatron.core.
"""
from __future__ import annotations

from typing import Any

__all__ = ["add_arguments", "validate_args", "SPTransformerConfig", "sp_config_from", "SPContext",
           "SPDotProductAttention", "SPSelfAttention", "with_sp_core_attention", "OUR_CP_TYPES", "TE_CP_TYPES"]


def _load() -> None:
    """Check the megatron-core release, then bind every public name here."""
    from .compat import check_supported  # noqa: PLC0415
    check_supported()
    from .arguments import add_arguments, validate_args  # noqa: PLC0415
    from .async_attention import SPSelfAttention  # noqa: PLC0415
    from .config import SPTransformerConfig, sp_config_from  # noqa: PLC0415
    from .core_attention import OUR_CP_TYPES, TE_CP_TYPES, SPContext, SPDotProductAttention  # noqa: PLC0415
    from .spec import with_sp_core_attention  # noqa: PLC0415
    loaded = locals()
    globals().update({name: loaded[name] for name in __all__})


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
