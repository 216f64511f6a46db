"""DeepSpeed adapters (need deepspeed; imported only when this subpackage is used).

    from megatron_sp_ext.deepspeed import SPDistributedAttention, initialize
"""
from .attention import SPDistributedAttention
from .initialize import initialize, sp_config_from_deepspeed, validate_deepspeed_config
from .mpu import SequenceParallelMPU, build_sequence_parallel_groups

__all__ = ["SPDistributedAttention", "initialize", "sp_config_from_deepspeed", "validate_deepspeed_config",
           "SequenceParallelMPU", "build_sequence_parallel_groups"]
