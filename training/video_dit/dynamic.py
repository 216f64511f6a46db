"""Dynamic sequence parallelism in the video DiT (--dynamic-context-parallel / ``"dynamic": true``).

Each packed step's samples get their own SP sizes and aligned sub-groups (megatron_sp_ext.sp.dynamic.plan_pack,
the same plan on every rank); this rank's rows are its samples' pieces (``packing.packed_host_inputs(dynamic=)``),
the projections, MLP, norms and cross-attention run on them as in any packed step, and the self-attention core
(``make_dynamic_core``) runs each sample on its sub-group with the configured mode. The loss is the packed step's:
each token weighted 1 / (N * n_i), summed over the SP group, so the step equals SP=1 on the same pack.

Work model for the packer: the block's linear FLOPs per token against attention's per query-key pair
(``CostModel.for_dims``), and each exchanged token at ``EXCHANGE_FLOPS_PER_BYTE`` (an H100's bf16 attention
throughput over an NVLink all-to-all's per-GPU rate, about 500 TFLOP/s / 125 GB/s).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_sp_ext import modes
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.dynamic import MIN_GAIN, CostModel, DynamicAttention, DynamicGroups, DynamicPlan, plan_pack
from megatron_sp_ext.sp.factory import SPResources

from .config import DiTConfig

log = logging.getLogger("video_dit")  # the entries' logger (logs.setup_logging)

DYNAMIC_FLAG, MIN_FLAG = "--dynamic-context-parallel", "--min-dynamic-context-parallel-size"
EXCHANGE_FLOPS_PER_BYTE = 4000.0


class DynamicSP:
    """The packer's settings for one run: ``plan(cu_seqlens)`` gives a pack's plan (pure; every rank and DataLoader
    worker computes the same)."""

    def __init__(self, world: int, cfg: DiTConfig, min_size: int = 1, min_size_name: str = MIN_FLAG,
                 mode: str = "ulysses") -> None:
        """mode: the SP mode (the ring family's exchange is modelled as the ring's)."""
        self.world, self.min_size, self.min_size_name = world, min_size, min_size_name
        self.cost = CostModel.for_dims(cfg.dim, cfg.ffn, cfg.text_len, flops_per_byte=EXCHANGE_FLOPS_PER_BYTE,
                                       ring=modes.get(mode).ring_variant)
        plan_pack([1], world, min_size=min_size, min_size_name=min_size_name)  # refuses a bad size now, by name

    def plan(self, cu_seqlens: Sequence[int]) -> DynamicPlan:
        cu = [int(c) for c in cu_seqlens]
        return plan_pack([b - a for a, b in zip(cu, cu[1:])], self.world, min_size=self.min_size, cost=self.cost,
                         min_size_name=self.min_size_name, min_gain=MIN_GAIN)


def make_dynamic_core(cfg: SPConfig, group: dist.ProcessGroup, *, num_heads: int, min_size: int = 1):
    """The DiT's attention core for dynamic SP over ``group`` with ``cfg`` (its mode, chunks, backend, ...):
    core(q, k, v, None, cu_seqlens=plan) on this rank's rows [1, S_loc, H, D] of a packed step (plan: the step's
    DynamicPlan). An unpacked call (cu_seqlens None: sampling after training, [B, S_loc, H, D] contiguous shards,
    kv_valid_len n) runs the uniform SP attention of ``cfg`` over the whole group: the dynamic plan of one sample
    on every rank is that attention (``DynamicAttention.sub_attention(0, world)``). Creates the aligned sub-groups
    (collective: every process of the job calls it). Refuses modes that cannot run on a sub-group, naming the
    user's settings (``cfg.source``). The problems are built once per forward (``core.begin_step``, which the
    model's forward calls on every rank): a pack's ``PackProblems`` and the unpacked call's problem per padding, so
    each sub-group agrees its problem at the forward's first layer, not at every layer."""
    cfg = dataclasses.replace(cfg, dynamic=True)
    attn = DynamicAttention(cfg, DynamicGroups(group, min_size), num_heads=num_heads, layout="bshd",
                            resources=SPResources(cfg))
    name = cfg.name("dynamic")
    step: dict = {"problems": None}   # this forward's problems (begin_step); None before the first: one per call

    def problems_of(key, build):
        memo = step["problems"]
        if memo is None:
            return build()
        if key not in memo:
            memo[key] = build()
        return memo[key]

    def core(q, k, v, n=None, cu_seqlens=None, block_mask=None, block_size=None):
        if cu_seqlens is None:  # one unpacked sequence over every rank (sampling): the uniform attention
            uniform = attn.sub_attention(0, attn.groups.world)
            problem = problems_of(("uniform", n), lambda: uniform.problem(kv_valid_len=n))
            if block_mask is not None:   # compared once per mask object (the layers share a window mask)
                base = problem
                problem = base.cached(("mask", id(block_mask), block_size),
                                      lambda: base.with_mask(block_mask, tile=block_size))
            return uniform(q, k, v, problem)
        if not isinstance(cu_seqlens, DynamicPlan) or n is not None or block_mask is not None:
            raise SPConfigError(f"{name} runs packed steps only (--pack-samples, no padding, no block mask)")
        # keyed by the plan's value (frozen, the same on every rank): the forward's layers share its problems
        return attn(q, k, v, problems_of(("pack", cu_seqlens), lambda: attn.problems(cu_seqlens, causal=False)))

    def begin_step() -> None:
        """A new forward: its problems are built afresh (called by the model's forward on every rank)."""
        step["problems"] = {}
    core.begin_step = begin_step
    core.group = group
    core.attention = attn
    return core


class PlanLog:
    """Logs the first dynamic plan of the run once, in a user's words (rank 0)."""

    def __init__(self, enabled: bool, cost: Optional[CostModel]) -> None:
        self.enabled, self.cost, self.done = enabled, cost, False

    def see(self, plan: Optional[DynamicPlan]) -> None:
        if plan is None or self.done:
            return
        self.done = True
        if self.enabled:
            log.info("%s (first pack; each step's pack gets its own plan)", plan.describe(self.cost))
