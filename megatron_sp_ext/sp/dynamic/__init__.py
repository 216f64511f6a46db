"""Dynamic sequence parallelism (Megatron-LM's --dynamic-context-parallel): each sample of a packed step over an
aligned sub-group of ranks sized to its length.

  plan        the packer: SP size and sub-group per sample, balanced work, deterministic (DynamicPlan, plan_pack)
  groups      the aligned sub-groups, created once per job (DynamicGroups)
  attention   per-sample attention on the sub-groups through the factory (DynamicAttention)
  problems    a pack's AttentionProblems, built once per pack and step (PackProblems)
  rows        which rows of a full pack each rank holds (shard_dynamic / unshard_dynamic)
"""
from .attention import DYNAMIC_MODES, DynamicAttention, check_dynamic_mode
from .groups import DynamicGroups
from .plan import MIN_GAIN, CostModel, DynamicPlan, divisors, plan_pack
from .problems import PackProblems
from .rows import local_rows, shard_dynamic, unshard_dynamic

__all__ = ["MIN_GAIN", "CostModel", "DYNAMIC_MODES", "DynamicAttention", "DynamicGroups", "DynamicPlan",
           "PackProblems", "check_dynamic_mode", "divisors", "local_rows", "plan_pack", "shard_dynamic",
           "unshard_dynamic"]
