"""Megatron-core adapters (need megatron-core; imported only when this subpackage is used).

    from megatron_sp_ext.megatron import SPDotProductAttention, with_sp_core_attention, add_arguments
"""
from .compat import check_supported

check_supported()  # one clear error for a megatron-core release outside the supported range

from .arguments import add_arguments, validate_args  # noqa: E402
from .async_attention import SPSelfAttention  # noqa: E402
from .config import SPTransformerConfig, sp_config_from  # noqa: E402
from .core_attention import OUR_CP_TYPES, TE_CP_TYPES, SPContext, SPDotProductAttention  # noqa: E402
from .spec import with_sp_core_attention  # noqa: E402

__all__ = ["add_arguments", "validate_args", "SPTransformerConfig", "sp_config_from", "SPContext",
           "SPDotProductAttention", "SPSelfAttention", "with_sp_core_attention", "OUR_CP_TYPES", "TE_CP_TYPES"]
