"""TransformerConfig with our fields, named like the launch-script flags so that Megatron-LM's
``core_transformer_config_from_args`` copies them by name (``--hcms-head-chunks`` ->
``hcms_head_chunks``). Validation stays in ``megatron_sp_ext.config.SPConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import MODES, SPConfig


@dataclass
class SPTransformerConfig(TransformerConfig):
    """Megatron TransformerConfig plus megatron_sp_ext settings (flag names in parentheses).

    hcms_head_chunks (--hcms-head-chunks): HCMS chunks per rank or "auto".
    sp_arrangement (--sp-arrangement): mesh arrangement for usp/tas/torus/auto: auto, usp, tas.
    sp_placement (--sp-placement): its older name (None: unset; still taken).
    sp_nodes (--sp-nodes): machines to assume (simulate several on one machine).
    sp_ulysses_size (--sp-ulysses-size): Ulysses degree of the mesh.
    sp_ring_variant (--sp-ring-variant): ring or tasp inside ring/hybrid modes.
    sp_attention_backend (--sp-attention-backend): auto, cudnn, torch_flash, sdpa, math, flash_attn, te.
    sp_transport (--sp-transport): nccl (default), symm_mem or copy_engine (copy-engine exchanges).
    sp_async_qkv (--sp-async-qkv): off, on (SPSelfAttention overlaps its projections with the
        exchanges), allgather (QKV by a sequence all-gather fused with the QKV GEMM), auto (video
        DiT only: the runtime layer policy).
    """

    hcms_head_chunks: Union[int, str] = 1
    sp_arrangement: str = "auto"
    sp_placement: Optional[str] = None
    sp_nodes: Optional[int] = None
    sp_ulysses_size: Optional[int] = None
    sp_ring_variant: str = "ring"
    sp_attention_backend: str = "auto"
    sp_transport: str = "nccl"
    sp_async_qkv: str = "off"

    def __post_init__(self) -> None:
        super().__post_init__()
        base = sp_config_from(self)  # validates; errors name the flags
        types = self.cp_comm_type if isinstance(self.cp_comm_type, (list, tuple)) else [self.cp_comm_type]
        for t in types:  # --attention-dropout: applied by the Ulysses family, refused by the others
            if t in MODES and self.attention_dropout:
                base.for_mode(t, dropout_p=self.attention_dropout)


def sp_config_from(config) -> SPConfig:
    """SPConfig from any TransformerConfig (our fields when present, defaults otherwise)."""
    return SPConfig(
        head_chunks=getattr(config, "hcms_head_chunks", 1),
        ring_variant=getattr(config, "sp_ring_variant", "ring"),
        arrangement=getattr(config, "sp_arrangement", "auto"),
        placement=getattr(config, "sp_placement", None),
        ulysses_size=getattr(config, "sp_ulysses_size", None),
        nodes=getattr(config, "sp_nodes", None),
        backend=getattr(config, "sp_attention_backend", "auto"),
        transport=getattr(config, "sp_transport", "nccl"),
        async_qkv=getattr(config, "sp_async_qkv", "off"),
        source="megatron",
    )
