"""``parallelize``: the one call that makes a ``VideoDiT`` sequence parallel (both entries call it).

    from training.video_dit.parallel import DiTParallelConfig, parallelize
    handle = parallelize(model, group, DiTParallelConfig(sp=SPConfig(mode="ulysses", source="megatron"), ...))
    ... train ...
    handle.remove()                     # the model as VideoDiT(cfg) built it: local attention, no options

``group``: the SP process group (None or size 1: one rank). Everything runs through megatron_sp_ext's public API
(``SPConfig``, ``make_attention``) in ``engine.core_of``: one core family for the Megatron and DeepSpeed entries
(the factory's attention, its one-rank path on one rank; the block-sparse kernel for sparse steps), or
dynamic SP's ``dynamic.make_dynamic_core``. Call it before the optimizer is built: top-k sparse attention adds
the coarse branch's gates (parameters). Errors name the user's settings (``config.sp.source``: flags or JSON keys).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_sp_ext import SPConfig, SPConfigError

from .dynamic import make_dynamic_core
from .engine import core_of
from .model import StepProblems, VideoDiT, local_core
from .sparse import SparseSpec


@dataclass
class DiTParallelConfig:
    """What ``parallelize`` sets up. sp: the attention's SPConfig (mode, chunks, backend, transport, ...; ``dynamic``
    true: each packed sample on its own sub-group, ``dynamic_min_size`` the smallest; ``async_qkv`` on / allgather:
    the fused async Ulysses / all-gather QKV block forms, auto: a runtime policy picks per shape; SP > 1 only);
    sparse: --sparse-attention tiles (None: dense); tile_setting: --sparse-attention-kernel; recompute_*: --recompute-granularity / -modules / -num-layers; cpu_offloading(_num_layers):
    --cpu-offloading(-num-layers); fused_backend: the resolved --fused-elementwise (None: eager); packed_qkv: the
    resolved --ulysses-packed-qkv."""

    sp: SPConfig = field(default_factory=SPConfig)
    sparse: Optional[SparseSpec] = None
    tile_setting: str = "auto"
    dynamic_min_size: int = 1
    recompute_granularity: Optional[str] = None
    recompute_modules: Sequence[str] = ("core_attn",)
    recompute_num_layers: Optional[int] = None
    cpu_offloading: bool = False
    cpu_offloading_num_layers: Optional[int] = None
    fused_backend: Optional[str] = None
    packed_qkv: bool = False


@dataclass
class DiTParallelHandle:
    """What ``parallelize`` did: config, group (None: one rank), sp_size, core (the installed attention core).
    ``remove()`` puts the model back as built (local attention, dense, no recompute/offload, eager, plain q|k|v)."""

    model: VideoDiT = field(repr=False)
    config: DiTParallelConfig
    group: Optional[dist.ProcessGroup]
    sp_size: int
    core: object = field(repr=False)
    removed: bool = False

    def remove(self) -> None:
        """Undo ``parallelize`` (idempotent). The sparse gates leave the model (rebuild the optimizer after it)."""
        if self.removed:
            return
        m = self.model
        m.set_packed_qkv(False)
        m.set_fused_elementwise(None)
        m.set_cpu_offloading(False)
        m.set_recompute(None)
        for blk in m.blocks:
            blk.attn.sp_layer = None
            blk.attn.rope_memo, blk.attn.layer_problems = {}, StepProblems()
        m.__dict__.pop("layer_policy", None)
        m.set_attention_core(local_core)
        m.set_sparse_attention(None)
        self.removed = True


def parallelize(model: VideoDiT, group: Optional[dist.ProcessGroup],
                config: Optional[DiTParallelConfig] = None) -> DiTParallelHandle:
    """Make ``model`` sequence parallel over ``group`` (None or size 1: one rank) with ``config`` (default: dense
    Ulysses-or-local attention on the auto backend) in one call; returns the handle whose ``remove()`` undoes it.
    Collective when ``config.sp.dynamic`` (its sub-groups): every process of the job calls it then."""
    config = config or DiTParallelConfig()
    if not isinstance(model, VideoDiT):
        raise SPConfigError(f"parallelize takes a training.video_dit VideoDiT; got {type(model).__name__}")
    if any(getattr(b.attn, "sp_layer", None) is not None for b in model.blocks) or \
            any(b.attn.core is not local_core for b in model.blocks):
        raise SPConfigError("parallelize: this VideoDiT is already parallelized: call remove() on its handle first")
    if config.sp.dropout_p:
        raise SPConfigError(f"{config.sp.name('dropout_p')}={config.sp.dropout_p}: the video DiT's attention is "
                            f"dropout-free (its one-rank and sequence-parallel cores apply none); set it to 0")
    world = dist.get_world_size(group) if group is not None else 1
    sp_group = group if world > 1 else None
    model.set_sparse_attention(config.sparse)  # first: top-k adds the gates (parameters) the optimizer needs
    if config.sp.dynamic and sp_group is not None:  # each packed sample on its own sub-group of the SP ranks
        core = make_dynamic_core(config.sp, sp_group, num_heads=model.cfg.heads, min_size=config.dynamic_min_size)
    else:
        core = core_of(config.sp, sp_group, num_heads=model.cfg.heads, tile_setting=config.tile_setting)
    model.set_attention_core(core)
    if sp_group is not None and config.sp.async_qkv in ("on", "allgather"):
        model.set_async_attention(sp_group, config.sp.head_chunks, config.sp.transport,
                                  allgather=config.sp.async_qkv == "allgather")
    elif sp_group is not None and config.sp.async_qkv == "auto":
        model.set_layer_policy(sp_group)
    model.set_recompute(config.recompute_granularity, config.recompute_modules, config.recompute_num_layers)
    model.set_cpu_offloading(config.cpu_offloading, config.cpu_offloading_num_layers)
    model.set_fused_elementwise(config.fused_backend)
    model.set_packed_qkv(config.packed_qkv)
    return DiTParallelHandle(model, config, sp_group, world, core)
