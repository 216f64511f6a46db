"""Layer-spec helpers: put SPDotProductAttention into an existing Megatron layer spec."""
from __future__ import annotations

import copy
from typing import Optional

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from .async_attention import SPSelfAttention
from .core_attention import SPContext, SPDotProductAttention


def with_sp_core_attention(layer_spec: ModuleSpec, *, context: Optional[SPContext] = None,
                           no_mask: bool = False) -> ModuleSpec:
    """A copy of ``layer_spec`` (e.g. ``get_gpt_layer_local_spec()`` or the TE spec) whose self-attention
    uses megatron_sp_ext core attention; ``no_mask=True`` sets AttnMaskType.no_mask (DiTs).

    All layers built from the returned spec share one SPContext (streams, HCMS policy, meshes).
    A plain SelfAttention module becomes SPSelfAttention, which is the parent unchanged unless
    ``--sp-async-qkv`` asks for the async layer.
    """
    from megatron.core.transformer.attention import SelfAttention  # noqa: PLC0415
    spec = copy.deepcopy(layer_spec)
    attn = spec.submodules.self_attention
    if attn.module is SelfAttention:
        attn.module = SPSelfAttention
    attn.submodules.core_attention = ModuleSpec(module=SPDotProductAttention,
                                                params={"sp_context": context or SPContext()})
    if no_mask:
        attn.params = dict(attn.params or {}, attn_mask_type=AttnMaskType.no_mask)
    return spec
