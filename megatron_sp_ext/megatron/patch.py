"""Runtime patch for megatron.core: its GPT layer-spec factories return our core attention.

For launchers that build specs through ``megatron.core.models.gpt.gpt_layer_specs`` and that we
cannot edit (subclassing cannot change which class those factories put in the spec).
Applied only by an explicit ``apply()``, never on import; idempotent; ``remove()`` restores the
originals. Apply it before the launcher does ``from ...gpt_layer_specs import get_gpt_layer_*``.
Our core attention delegates Transformer Engine's own cp types (p2p, a2a, ...) to TE unchanged,
so the patch is safe whatever ``--cp-comm-type`` says.
"""
from __future__ import annotations

import functools
from typing import Optional

from ..config import SPConfig

_TARGETS = ("get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec")
_STATE: dict = {}


def apply(sp_config: Optional[SPConfig] = None) -> bool:
    """Patch the factories; returns False if they were already patched."""
    from megatron.core.models.gpt import gpt_layer_specs as mod  # noqa: PLC0415

    from .core_attention import SPContext  # noqa: PLC0415
    from .spec import with_sp_core_attention  # noqa: PLC0415
    if _STATE:
        return False
    ctx = SPContext(sp_config)
    for name in _TARGETS:
        orig = getattr(mod, name)

        @functools.wraps(orig)
        def patched(*args, __orig=orig, **kwargs):
            return with_sp_core_attention(__orig(*args, **kwargs), context=ctx)
        _STATE[name] = orig
        setattr(mod, name, patched)
    return True


def remove() -> bool:
    """Restore the original factories; returns False if nothing was patched."""
    from megatron.core.models.gpt import gpt_layer_specs as mod  # noqa: PLC0415
    if not _STATE:
        return False
    for name, orig in _STATE.items():
        setattr(mod, name, orig)
    _STATE.clear()
    return True


def is_applied() -> bool:
    return bool(_STATE)
