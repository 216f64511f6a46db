"""Megatron-core adapters (need megatron-core; imported only when this subpackage is used).

    from megatron_sp_ext.megatron import SPDotProductAttention, with_sp_core_attention, add_arguments
"""
from .arguments import add_arguments, validate_args
from .async_attention import SPSelfAttention
from .config import SPTransformerConfig, sp_config_from
from .core_attention import OUR_CP_TYPES, TE_CP_TYPES, SPContext, SPDotProductAttention
from .spec import with_sp_core_attention

__all__ = ["add_arguments", "validate_args", "SPTransformerConfig", "sp_config_from", "SPContext",
           "SPDotProductAttention", "SPSelfAttention", "with_sp_core_attention", "OUR_CP_TYPES", "TE_CP_TYPES"]
