"""DeepSpeed entry point checkpoints: the engine's own save_checkpoint / load_checkpoint, inside the
atomic layout of checkpoint.py (new directory per step, ``latest`` moved last, --keep-last), with
every file gated through ``torch.load(weights_only=True)`` before DeepSpeed (which loads with
weights_only=False) opens it.

Resharding: any SP size / cp_comm_type / block form. ZeRO stage 1/2 partitions the optimizer state
over all sequence x data ranks, so a resume on another world size goes through DeepSpeed's
universal checkpoint: rank 0 runs ``deepspeed.checkpoint.ds_to_universal`` once into
``iter_N/universal/`` and the engine loads that with ``load_universal``. One fix-up on the way:
DeepSpeed aliases model parallel to SP for an SP mpu, so its files record ``tp_degree`` = SP size
although every rank holds full parameters; the converter reads a copy of the model-states file
with ``tp_degree`` 1 (the files in the checkpoint are not changed). ZeRO stage 3 across world sizes
is refused.
"""
from __future__ import annotations

import glob
import os
import time

import torch.distributed as dist

from .checkpoint import (_world, begin_save, commit_save, iter_name, load_rng, read_run, resolve, save_rng,
                         verify_checksums)
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
    verify_checksums(step_dir, run)
    zero = int(engine.zero_optimization_stage())
    if run.get("zero_stage", 0) != zero:
        raise CheckpointError(f"{step_dir}: saved with ZeRO stage {run.get('zero_stage')}, this run uses stage {zero}; "
                              f"set zero_optimization.stage to {run.get('zero_stage')}")
    universal = zero > 0 and run.get("world") != _world()
    if universal and zero > 2:
        raise CheckpointError(f"{step_dir}: ZeRO stage 3 state is partitioned over {run.get('world')} ranks; this run "
                              f"has {_world()}. Resume on {run.get('world')} ranks (any SP size that divides it)")
    allowed = _allowed_globals()
    for f in sorted(glob.glob(os.path.join(step_dir, "*.pt"))):
        check_weights_only(f, allowed)
    load_dir, tag = os.path.dirname(step_dir), os.path.basename(step_dir)
    if universal:
        load_dir, tag = step_dir, os.path.basename(to_universal(step_dir))
        for f in sorted(glob.glob(os.path.join(load_dir, tag, "**", "*.pt"), recursive=True)):
            check_weights_only(f, allowed)
    cfg = engine._config  # DeepSpeed reads this flag at load time; set it for this load only
    was = cfg.load_universal_checkpoint
    cfg.load_universal_checkpoint = universal
    try:
        path, _ = engine.load_checkpoint(load_dir, tag=tag)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{step_dir}: DeepSpeed could not load it: {str(e).strip().splitlines()[-1][:400]}") from e
    finally:
        cfg.load_universal_checkpoint = was
    if path is None:
        raise CheckpointError(f"{step_dir}: DeepSpeed found no model states in it")
    load_rng(step_dir, dist.get_rank(), run.get("world") == _world())
    return {**run, "path": step_dir, "seconds": time.perf_counter() - t0}


def to_universal(step_dir: str) -> str:
    """``step_dir/universal``: DeepSpeed's universal form of a ZeRO-1/2 checkpoint (rank 0 converts
    once, atomically; collective). Returns its path. A failed conversion (unwritable directory, a
    checkpoint DeepSpeed's converter rejects) is one ``CheckpointError`` on every rank, not a hang."""
    out = os.path.join(step_dir, "universal")
    failure = [None]
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(out, "converted")):
        try:
            _convert(step_dir, out)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - reported on every rank below
            failure[0] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise CheckpointError(f"{step_dir}: converting the ZeRO checkpoint to DeepSpeed's universal form (for a "
                              f"resume on another world size) failed on rank 0: {failure[0]}; the conversion "
                              f"writes {out}, so the checkpoint directory must be writable")
    return out


def _convert(step_dir: str, out: str) -> None:
    """Rank 0: run DeepSpeed's ds_to_universal on ``step_dir`` into ``out`` (via ``out.partial``)."""
    import argparse  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS  # noqa: PLC0415
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # noqa: PLC0415
    work = out + ".partial"
    shutil.rmtree(work, ignore_errors=True)
    src = os.path.join(work, "src")
    os.makedirs(src)
    for f in sorted(os.listdir(step_dir)):
        full = os.path.abspath(os.path.join(step_dir, f))
        if f.endswith("model_states.pt"):
            with torch.serialization.safe_globals(_allowed_globals()):
                sd = torch.load(full, map_location="cpu", weights_only=True)
            sd[CHECKPOINT_PARALLEL_DIMS] = {"pp_degree": 1, "tp_degree": 1}  # SP ranks hold full params
            torch.save(sd, os.path.join(src, f))
        elif f.endswith("optim_states.pt"):
            os.symlink(full, os.path.join(src, f))
    ds_to_universal(argparse.Namespace(input_folder=src, output_folder=os.path.join(work, "out"),
                                       num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                       strict=True, inject_missing_state=True))
    with open(os.path.join(work, "out", "converted"), "w") as f:
        f.write("ds_to_universal\n")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(os.path.join(work, "out"), out)
    shutil.rmtree(work, ignore_errors=True)


__all__ = ["save", "load", "to_universal"]
