"""``initialize``: wire sequence parallelism from the DeepSpeed JSON, then call deepspeed.initialize.

JSON (next to DeepSpeed's own ``"sequence_parallel_size": P``):
    "sequence_parallel_ext": {"mode": "hcms", "head_chunks": "auto", "arrangement": "auto",
                              "ring_variant": "tasp", "nodes": null, "ulysses_size": null,
                              "backend": "auto", "causal": false, "dropout_p": 0.0}
Steps: validate the section (errors name the JSON key) -> build SP / data / sequence-data groups
-> install the mpu in deepspeed.utils.groups -> swap the attention of opting-in modules ->
deepspeed.initialize(model=..., config=..., mpu=..., **kwargs) and return what it returns.

Opt-in protocol (either):
  * a module that is a DeepSpeed ``DistributedAttention`` is replaced by ``SPDistributedAttention``
    with the same arguments (local attention, scatter/gather indices, num_kv_heads);
  * a module with ``configure_sequence_parallel(make_attention)`` is called with a factory
    ``make_attention(local_attention, scatter_idx=2, gather_idx=0, num_kv_heads=None)`` that
    returns a configured ``SPDistributedAttention``.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from .. import modes
from ..config import ARRANGEMENTS, MESH_MODES, SPConfig
from ..errors import SPConfigError
from .mpu import SequenceParallelMPU, build_sequence_parallel_groups

_EXTRA_KEYS = ("causal",)
# modes whose attention runs the model's own local attention (which masks itself); the others run our kernels
LOCAL_ATTENTION_MODES = modes.names(local_attention=True)


def _load(config: Union[str, Mapping[str, Any]]) -> dict:
    if isinstance(config, str):
        with open(config) as f:
            return json.load(f)
    return dict(config)


def sp_config_from_deepspeed(config: Union[str, Mapping[str, Any]]) -> tuple[SPConfig, dict]:
    """(SPConfig, extras) from the ``sequence_parallel_ext`` section; extras hold adapter-only keys (causal)."""
    section = dict(_load(config).get("sequence_parallel_ext", {}))
    extras = {k: section.pop(k) for k in _EXTRA_KEYS if k in section}
    if "causal" in extras and not isinstance(extras["causal"], bool):
        raise SPConfigError(f"sequence_parallel_ext.causal={extras['causal']!r} is invalid: use true or false")
    return SPConfig.from_dict(section, source="deepspeed", adapter_keys=_EXTRA_KEYS), extras


def causal_of(cfg: SPConfig, extras: dict, where: str) -> bool:
    """``sequence_parallel_ext.causal`` for DeepSpeed ``DistributedAttention`` modules (``where``: the model's
    module) that a mode replaces by our kernels. DeepSpeed's forward passes no causal flag (its ``*args,
    **kwargs`` go to the model's local attention, which applies its own mask), so for every mode but ulysses and
    hcms (``auto`` may pick the ring) the section must say it: SPConfigError naming the key when it does not (a
    causal model would otherwise train bidirectional)."""
    if "causal" in extras:
        return extras["causal"]
    if cfg.mode in LOCAL_ATTENTION_MODES:
        return False  # the model's local attention runs and masks itself; our kernels only for padded calls
    raise SPConfigError(
        f"{cfg.name('mode')}={cfg.mode!r} replaces {where}'s local attention by megatron_sp_ext's kernels, and "
        f"DeepSpeed does not say whether that attention is causal: set sequence_parallel_ext.causal to true (a "
        f"causal model, e.g. GPT) or false (bidirectional, e.g. a DiT), or use mode "
        f"{modes.listing(LOCAL_ATTENTION_MODES)} (they run the model's own local attention)")


def validate_deepspeed_config(config: Union[str, Mapping[str, Any]], world_size: int,
                              num_heads: Optional[int] = None) -> tuple[SPConfig, dict, int]:
    """All checks that need no process group; raise SPConfigError naming the JSON key."""
    cfg_dict = _load(config)
    sp = cfg_dict.get("sequence_parallel_size", 1)
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise SPConfigError(f"sequence_parallel_size={sp!r} is invalid: use a positive integer")
    if world_size % sp != 0:
        raise SPConfigError(f"sequence_parallel_size={sp} does not divide the world size {world_size}: "
                            f"use a divisor of {world_size}")
    cfg, extras = sp_config_from_deepspeed(cfg_dict)
    cfg.validate_world(sp, world_size, num_heads)
    across = modes.get(cfg.mode).ulysses_across or modes.get(cfg.arrangement).ulysses_across
    if cfg.mode in MESH_MODES or across:
        if sp < 2:
            raise SPConfigError(f"sequence_parallel_ext.mode={cfg.mode!r} needs a mesh of at least 2 ranks: "
                                f"sequence_parallel_size={sp}")
        if across and (cfg.nodes is None or cfg.nodes < 2) and not _multi_machine():
            within = "/".join(repr(p) for p in ARRANGEMENTS[::-1] if not modes.get(p).ulysses_across)
            raise SPConfigError(f"sequence_parallel_ext.arrangement/mode {', '.join(modes.names(ulysses_across=True))!r}"
                                f" needs a multi-machine mesh but this job runs on one machine: set "
                                f"sequence_parallel_ext.nodes to simulate machines, or use {within}")
    return cfg, extras, sp


def _multi_machine() -> bool:
    import os  # noqa: PLC0415
    from ..topology.emulate import emulated_machine_size  # noqa: PLC0415
    w, lw = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    emulated = emulated_machine_size()  # machines emulated on one box (SPX_EMULATED_MACHINE_SIZE)
    if w and emulated:
        return int(w) > emulated
    return bool(w and lw and int(w) > int(lw))


def swap_attention(model: torch.nn.Module, mpu: SequenceParallelMPU, cfg: SPConfig, extras: dict) -> int:
    """Apply the opt-in protocol (module docstring); returns how many attentions were configured."""
    from deepspeed.sequence.layer import DistributedAttention  # noqa: PLC0415

    from .attention import SPDistributedAttention  # noqa: PLC0415
    n = 0

    def make(local_attention, scatter_idx=2, gather_idx=0, num_kv_heads=None, causal=False):
        return SPDistributedAttention(local_attention, mpu.get_sequence_parallel_group(), scatter_idx, gather_idx,
                                      None, num_kv_heads, sp_config=cfg, causal=extras.get("causal", causal))
    for parent in list(model.modules()):
        if hasattr(parent, "configure_sequence_parallel"):
            parent.configure_sequence_parallel(make)
            n += 1
        for name, child in list(parent.named_children()):
            if isinstance(child, DistributedAttention) and not isinstance(child, SPDistributedAttention):
                if cfg.dynamic:  # DistributedAttention sees one exchange per call: no per-sample sub-groups
                    raise SPConfigError(f"{cfg.name('dynamic')}=true needs a model that runs packed samples on "
                                        f"sub-groups (the video DiT's train_deepspeed.py with --pack-samples); "
                                        f"{type(parent).__name__}.{name} is a DistributedAttention: set it to false")
                setattr(parent, name, make(child.local_attn, child.scatter_idx, child.gather_idx, child.num_kv_heads,
                                           causal_of(cfg, extras, f"{type(parent).__name__}.{name}")))
                n += 1
    return n


def initialize(model: torch.nn.Module, config: Union[str, Mapping[str, Any]], num_heads: Optional[int] = None,
               **kwargs):
    """Validate, build groups and mpu, swap attention, then ``deepspeed.initialize``; returns its result.

    num_heads: attention heads (lets validation check head-based limits early). Mode "auto" is resolved by
    each attention (megatron_sp_ext.sp.factory) at its first call: statically from its heads, then per shape by
    its calibration on CUDA, as in the Megatron and DiT entries.
    """
    import deepspeed  # noqa: PLC0415
    cfg_dict = _load(config)
    if not dist.is_initialized():
        deepspeed.init_distributed()
    else:
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    cfg, extras, sp = validate_deepspeed_config(cfg_dict, dist.get_world_size(), num_heads)
    mpu = build_sequence_parallel_groups(sp).install()
    n = swap_attention(model, mpu, cfg, extras)
    if n == 0 and sp > 1:
        import logging  # noqa: PLC0415
        logging.getLogger("megatron_sp_ext").warning(
            "megatron_sp_ext.deepspeed.initialize: no module opted in to sequence parallelism "
            "(no DistributedAttention and no configure_sequence_parallel found)")
    ds_initialize = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)  # the JSON switch's work is done
    return ds_initialize(model=model, config=cfg_dict, mpu=mpu, **kwargs)
