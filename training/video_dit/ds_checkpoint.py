"""DeepSpeed entry point checkpoints: the engine's own save_checkpoint / load_checkpoint, inside the
atomic layout of checkpoint.py (new directory per step, ``latest`` moved last, --keep-last), with
every file gated through ``torch.load(weights_only=True)`` before DeepSpeed (which loads with
weights_only=False) opens it.

Resharding: model weights and, without ZeRO partitioning (stage 0), the optimizer state resume at
any SP size / cp_comm_type / block form. ZeRO stage >= 1 partitions the optimizer state over all
sequence x data ranks; DeepSpeed re-partitions only through its universal checkpoint
(ds_to_universal), whose converter reads our SP mpu (DeepSpeed aliases model parallel to SP) as
tensor parallel and refuses the checkpoint - so a ZeRO checkpoint resumes on the same world size
(any SP split of it) and a different one is refused up front with the reason.
"""
from __future__ import annotations

import glob
import os
import time

import torch.distributed as dist

from .checkpoint import _world, begin_save, commit_save, iter_name, load_rng, read_run, resolve, save_rng
from .safe_load import CheckpointError, check_weights_only


def _allowed_globals() -> list:
    """The classes DeepSpeed pickles into its ZeRO files (plain state holders and enums)."""
    out = []
    for mod, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                       ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
                       ("deepspeed.utils.tensor_fragment", ("fragment_address",))):
        try:
            m = __import__(mod, fromlist=list(names))
        except ImportError:
            continue
        out += [getattr(m, n) for n in names if hasattr(m, n)]
    return out


def save(engine, root: str, step: int, run: dict, keep_last: int) -> dict:
    """Collective. Returns {"path", "seconds"}."""
    t0 = time.perf_counter()
    tmp = begin_save(root, step)
    engine.save_checkpoint(root, tag=os.path.basename(tmp), client_state={"step": step}, save_latest=False)
    save_rng(tmp, dist.get_rank())
    final = commit_save(root, tmp, step, {**run, "world": _world(), "zero_stage": int(engine.zero_optimization_stage())},
                        keep_last)
    return {"path": final, "seconds": time.perf_counter() - t0}


def load(engine, load_path: str, expect: dict) -> dict:
    """Collective. Returns run.json (its "step" is where to continue)."""
    t0 = time.perf_counter()
    step_dir = resolve(load_path)
    run = read_run(step_dir, expect)
    zero = int(engine.zero_optimization_stage())
    if run.get("zero_stage", 0) != zero:
        raise CheckpointError(f"{step_dir}: saved with ZeRO stage {run.get('zero_stage')}, this run uses stage {zero}; "
                              f"set zero_optimization.stage to {run.get('zero_stage')}")
    if zero > 0 and run.get("world") != _world():
        raise CheckpointError(f"{step_dir}: ZeRO stage {zero} optimizer state is partitioned over {run.get('world')} "
                              f"ranks; this run has {_world()}. Resume on {run.get('world')} ranks (any SP size that "
                              f"divides it), or save with zero_optimization.stage 0 to change the world size")
    allowed = _allowed_globals()
    for f in sorted(glob.glob(os.path.join(step_dir, "**", "*.pt"), recursive=True)):
        check_weights_only(f, allowed)
    try:
        path, _ = engine.load_checkpoint(os.path.dirname(step_dir), tag=os.path.basename(step_dir))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{step_dir}: DeepSpeed could not load it: {str(e).strip().splitlines()[-1][:400]}") from e
    if path is None:
        raise CheckpointError(f"{step_dir}: DeepSpeed found no model states in it")
    load_rng(step_dir, dist.get_rank(), run.get("world") == _world())
    return {**run, "path": step_dir, "seconds": time.perf_counter() - t0}


__all__ = ["save", "load", "iter_name"]
