"""DeepSpeed adapters (need deepspeed; imported only when this subpackage is used).

    from megatron_sp_ext.deepspeed import SPDistributedAttention, initialize
    from megatron_sp_ext.deepspeed import activate   # the JSON switch (docs/deepspeed.md)
"""
from .attention import SPDistributedAttention
from .hook import activate
from .initialize import initialize, sp_config_from_deepspeed, validate_deepspeed_config
from .mpu import SequenceParallelMPU, build_sequence_parallel_groups

__all__ = ["SPDistributedAttention", "activate", "initialize", "sp_config_from_deepspeed", "validate_deepspeed_config",
           "SequenceParallelMPU", "build_sequence_parallel_groups"]
