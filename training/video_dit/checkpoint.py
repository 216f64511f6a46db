"""Sharded, atomic checkpoints for the megatron-core entry point, and the directory layout both
entry points share.

Layout under ``--save ROOT``::

    ROOT/iter_0000040/            one directory per saved step
        .metadata, __<r>_0.distcp torch.distributed.checkpoint: every rank writes its own file
        rng/rank_00003.safetensors that rank's RNG states
        run.json                  step, layout, model, format tag, every file's size (written last)
    ROOT/latest                   "iter_0000040", replaced (temp file + os.replace) after run.json

A save writes ``ROOT/iter_0000040.partial/``; after every rank finished (barrier) rank 0 writes
``run.json``, renames the directory to its final name, points ``latest`` at it and removes all
but the newest ``--keep-last`` directories. A crash at any moment leaves ``latest`` on a
complete checkpoint. The data position is the step: batches are a pure function of it.

Model and optimizer state are saved per parameter name (full, unsharded tensors), so a run may
resume at another SP size, DP size, cp_comm_type or block form: torch AdamW through
``torch.distributed.checkpoint.state_dict``; Megatron's optimizer (GPU, incl. the distributed
optimizer) through ``megatron.core.dist_checkpointing`` with the ``fully_reshardable`` optimizer format
(``fully_sharded_model_space`` is deprecated and fails in megatron-core 0.16: "ShardedTensor.flattened_range is
not supported", seen on 1 x H100, 2026-11-23). ``fully_reshardable`` builds the whole optimizer state (12 bytes
per parameter) in host memory on every rank, on save (all-gathered) and on load (each rank reads all of it).

Every file's size and CRC-32 go into run.json and are checked before a load; DCP's non-tensor items are
read through ``safe_load.safe_byte_items``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from .faults import on_rank0
from .safe_load import CheckpointError, SafeFileSystemReader, check_weights_only, read_dcp_metadata, safe_byte_items

FORMAT = "megatron_sp_ext.video_dit/1"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def add_checkpoint_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("checkpoints and faults")
    g.add_argument("--keep-last", type=_count, default=3,
                   help="keep the newest K checkpoints under --save (0: keep all)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="collective timeout: a rank that stops answering ends the job after this long")
    return p


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 0 (0 keeps every checkpoint)")
    return n


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# ----------------------------------------------------------------------------- layout

def begin_save(root: str, step: int) -> str:
    """Create (rank 0) an empty ``ROOT/iter_N.partial`` directory; every rank returns its path."""
    tmp = os.path.join(root, iter_name(step) + ".partial")

    def make() -> None:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    # the others wait for it in on_rank0's broadcast (the barrier it was), which also ends them if it fails
    on_rank0(f"--save {root}: creating {tmp}", make)
    return tmp


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit_save(root: str, tmp: str, step: int, run: dict, keep_last: int) -> str:
    """After every rank wrote into ``tmp``: run.json, rename, ``latest``, pruning (rank 0). Returns
    the final directory. Collective."""
    _barrier()
    final = os.path.join(root, iter_name(step))
    sums = _crc_share(tmp, sorted(_files_under(tmp)))

    def publish() -> None:
        files = {rel: os.path.getsize(os.path.join(tmp, rel)) for rel in _files_under(tmp)}
        _write_atomic(os.path.join(tmp, "run.json"),
                      json.dumps({"format": FORMAT, "step": step, **run, "files": files, "crc32": sums},
                                 indent=1, sort_keys=True))
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step (e.g. after a resume): swap, then drop the old one
            stale = final + ".stale"
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        _write_atomic(os.path.join(root, "latest"), iter_name(step) + "\n")
        _fsync_dir(root)
        prune(root, keep_last)
    # rank 0 alone; the others wait for it in on_rank0's broadcast (the barrier it was), which also ends them if it
    # fails (an unwritable --save, a full disk) rather than leaving them in that barrier
    on_rank0(f"--save {root}: publishing {final}", publish)
    return final


def _files_under(step_dir: str) -> list:
    out = []
    for dirpath, _, names in os.walk(step_dir):
        out += [os.path.relpath(os.path.join(dirpath, n), step_dir) for n in names]
    return out


def _crc32(path: str, chunk: int = 64 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _crc_share(step_dir: str, rels: list) -> dict:
    """CRC-32 of every file in ``rels``, each rank reading its share (collective); returns them all."""
    mine = {rel: _crc32(os.path.join(step_dir, rel)) for rel in rels[_rank()::_world()]}
    if _world() == 1:
        return mine
    parts = [None] * _world()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def verify_checksums(step_dir: str, run: dict) -> None:
    """Re-read every file ``run.json`` has a CRC-32 for, each rank its share (collective when a process
    group is up); raise ``CheckpointError`` naming the first file whose bytes changed since the save
    (checkpoints written before checksums were recorded are checked for size only)."""
    want = run.get("crc32") or {}
    got = _crc_share(step_dir, sorted(want)) if dist.is_initialized() else \
        {rel: _crc32(os.path.join(step_dir, rel)) for rel in want}
    bad = [rel for rel in sorted(want) if got.get(rel) != want[rel]]
    if bad:
        raise CheckpointError(f"{os.path.join(step_dir, bad[0])}: its bytes changed since the save (CRC-32 "
                              f"{got.get(bad[0])} vs {want[bad[0]]} in run.json"
                              f"{f', and {len(bad) - 1} more file(s)' if len(bad) > 1 else ''}): corrupt")


def list_checkpoints(root: str) -> list:
    """Complete checkpoint directories under root (those with run.json), oldest first."""
    out = []
    for n in os.listdir(root) if os.path.isdir(root) else []:
        m = _ITER_RE.match(n)
        if m and os.path.isfile(os.path.join(root, n, "run.json")):
            out.append((int(m.group(1)), os.path.join(root, n)))
    return [p for _, p in sorted(out)]


def prune(root: str, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints (0: keep all), never the one
    ``latest`` names, and leftovers of interrupted saves older than it."""
    latest = _read_latest(root) if os.path.isfile(os.path.join(root, "latest")) else None
    done = list_checkpoints(root)
    if keep_last > 0:
        for p in done[:-keep_last]:
            if os.path.basename(p) != latest:
                shutil.rmtree(p, ignore_errors=True)
    for n in os.listdir(root):
        if n.endswith((".partial", ".stale")) and n.split(".")[0] != latest:
            m = _ITER_RE.match(n.split(".")[0])
            if m and latest and int(m.group(1)) < int(latest.split("_")[1]):
                shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def _read_latest(root: str) -> str:
    path = os.path.join(root, "latest")
    with open(path) as f:
        name = f.read().strip()
    if not _ITER_RE.match(name):
        raise CheckpointError(f"{path}: holds {name[:80]!r}, expected a checkpoint name like 'iter_0000040' "
                              f"(corrupt or not written by this trainer)")
    return name


def resolve(load: str) -> str:
    """The checkpoint directory ``--load`` names: a --save root (follows ``latest``) or one
    ``iter_N`` directory. Anything else is a ``CheckpointError`` - never a fresh start."""
    if not os.path.isdir(load):
        raise CheckpointError(f"--load={load!r}: no such directory")
    if os.path.isfile(os.path.join(load, "run.json")):
        return load
    if os.path.isfile(os.path.join(load, "latest")):
        step_dir = os.path.join(load, _read_latest(load))
        stale = step_dir + ".stale"
        if not os.path.isdir(step_dir) and os.path.isfile(os.path.join(stale, "run.json")):
            # a re-save of this step stopped between its two renames (commit_save): the previous,
            # complete copy is still there under .stale
            return stale
        pointer = os.path.join(load, "latest")
        if not os.path.isdir(step_dir):
            others = [os.path.basename(p) for p in list_checkpoints(load)]
            raise CheckpointError(
                f"{pointer} names {os.path.basename(step_dir)}, but {step_dir} does not exist (deleted or moved "
                f"after the save); " + (f"complete checkpoints there: {', '.join(others[-4:])}: give one as "
                                        f"--load {os.path.join(load, others[-1])}" if others else
                                        "no complete checkpoint is left there: drop --load to start a fresh run"))
        if not os.path.isfile(os.path.join(step_dir, "run.json")):
            raise CheckpointError(f"{step_dir}: named by {pointer} but incomplete "
                                  f"(no run.json); the directory was changed after the save")
        return step_dir
    found = sorted(os.listdir(load))
    if not found:
        raise CheckpointError(f"--load={load!r}: the directory is empty, nothing to resume from "
                              f"(drop --load to start a fresh run)")
    raise CheckpointError(f"--load={load!r}: no 'latest' pointer and no run.json, so not a checkpoint written by "
                          f"this trainer (holds: {', '.join(found[:6])}{' ...' if len(found) > 6 else ''})")


def read_run(step_dir: str, expect: dict) -> dict:
    """run.json of a checkpoint, checked: format, every ``expect`` key equal, every file present with
    the size it had when saved (truncation)."""
    path = os.path.join(step_dir, "run.json")
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(run, dict) or run.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {run.get('format') if isinstance(run, dict) else None!r}, "
                              f"expected {FORMAT!r} (a foreign checkpoint)")
    for key, want in expect.items():
        saved = run.get(key, _IDENTITY_DEFAULTS.get(key))
        if key == "model" and isinstance(saved, dict) and isinstance(want, dict):  # fields this entry's models have
            saved = {**{k: v for k, v in _MODEL_DEFAULTS.items() if k in want}, **saved}
        if saved != want:
            raise CheckpointError(f"{step_dir}: {_mismatch(key, saved, want, run.get('init'))}")
    for rel, size in run.get("files", {}).items():
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full}: missing (the checkpoint is incomplete)")
        got = os.path.getsize(full)
        if got != size:
            raise CheckpointError(f"{full}: {got} bytes, {size} when saved: truncated or overwritten")
    return run


# identity keys added later: what a checkpoint written before them had
_IDENTITY_DEFAULTS = {"sparse_gates": False, "lora": None, "task": {"task": "t2v", "expert": None, "boundary": None}}
# model fields added later, likewise: checkpoints written before 2026-11-29 hold a Linear per block (--modulation)
_MODEL_DEFAULTS = {"modulation": "linear"}

_ENTRY_SCRIPT = {"megatron-core": "training/pretrain_video_dit.py", "deepspeed": "training/train_deepspeed.py",
                 "diffusers-wan": "training/train_wan_diffusers.py"}


# the model "preset" of a run that loaded its model with --init DIR (training/train_wan_diffusers.py)
PRETRAINED = "pretrained"


def _mismatch(key: str, saved, now, init: Optional[str] = None) -> str:
    """What differs between a checkpoint's identity ``key`` and this run's, and the setting that fixes it. ``init``:
    the --init the checkpoint's run gave (run.json "init"; train_wan_diffusers.py), None where unknown."""
    if key == "model" and isinstance(saved, dict) and isinstance(now, dict):
        diff = [f"{k}: {saved.get(k)!r} saved, {now.get(k)!r} now"
                for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if saved.get("preset") == PRETRAINED:   # a model loaded from a directory: no --model names it
            where = init if init is not None and init != "random" else "DIR"
            return (f"another model ({'; '.join(diff)}); the checkpoint's run loaded its model with --init {where}: "
                    f"resume with --init {where} (the same pretrained model, its config.json's layers)")
        modulation = f" --modulation {saved['modulation']}" if "modulation" in saved else ""
        random_init = "--init random " if now.get("preset") == PRETRAINED else ""
        return (f"another model ({'; '.join(diff)}); resume with the saved --model / --num-layers"
                f"{' / --modulation' if modulation else ''} ({random_init}--model {saved.get('preset')} --num-layers "
                f"{saved.get('layers')}{modulation})")
    if key == "optimizer_impl":
        return (f"saved by the {saved!r} optimizer, this run uses {now!r}; resume with --ddp-impl {saved} "
                f"(--ddp-impl auto picks megatron on CUDA, torch on CPU; the two optimizer formats do not convert)")
    if key == "sparse_gates":
        return ("saved with the top-k sparse attention's coarse-branch gates (--sparse-attention tiles --sparse-topk K)"
                if saved else "saved without the top-k sparse attention's gates (dense or --sparse-window)") + \
            ": the parameter sets differ; resume with the same kind of run (--sparse-topk with --sparse-topk, dense or " \
            "--sparse-window otherwise)"
    if key == "lora":
        return (f"saved by a {'LoRA run (' + _lora_words(saved) + ')' if saved else 'full fine-tuning run'}, this run "
                f"is {'LoRA (' + _lora_words(now) + ')' if now else 'full fine-tuning'}: resume with the saved "
                f"{'--lora-rank / --lora-alpha / --lora-target-modules' if saved else '--lora-rank 0'}")
    if key == "task":
        return (f"saved training {saved.get('task')}" + (f" (expert {saved.get('expert')}, boundary "
                                                          f"{saved.get('boundary')})" if saved.get("expert") else "")
                + f", this run trains {now.get('task')}" + (f" (expert {now.get('expert')})" if now.get("expert")
                                                             else "") + ": resume with the saved --task / --expert")
    if key == "entry":
        return (f"written by the {saved!r} entry point ({_ENTRY_SCRIPT.get(saved, '?')}); this is {now!r}: resume "
                f"it with the entry point that wrote it")
    return f"saved with {key}={saved!r}, this run has {key}={now!r}; resume with the same {key}"


def _lora_words(lora: dict) -> str:
    return f"rank {lora.get('rank')}, alpha {lora.get('alpha')}, targets {','.join(lora.get('targets') or [])}"


def check_resume_step(loaded: dict, train_iters: int) -> int:
    """The step a resumed run starts at; refuses a checkpoint already past ``--train-iters`` (continuing
    would label step-N weights as an earlier step and move ``latest`` back)."""
    step = int(loaded["step"])
    if step > train_iters:
        raise CheckpointError(f"{loaded['path']}: saved at step {step}, past --train-iters={train_iters}; "
                              f"set --train-iters to {step} or more to continue this run")
    return step


# ----------------------------------------------------------------------------- RNG

def save_rng(step_dir: str, rank: int) -> None:
    """This rank's CPU (and CUDA) RNG state as a safetensors file (no pickle)."""
    from safetensors.torch import save_file  # noqa: PLC0415
    os.makedirs(os.path.join(step_dir, "rng"), exist_ok=True)
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    save_file(states, os.path.join(step_dir, "rng", f"rank_{rank:05d}.safetensors"))


def load_rng(step_dir: str, rank: int, same_world: bool) -> bool:
    """Restore this rank's RNG states when the world size is unchanged (per-rank streams only mean
    something then; batches do not depend on them). Returns whether it restored."""
    path = os.path.join(step_dir, "rng", f"rank_{rank:05d}.safetensors")
    if not same_world or not os.path.isfile(path):
        return False
    from safetensors.torch import load_file  # noqa: PLC0415
    try:
        states = load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types
        raise CheckpointError(f"{path}: unreadable RNG state ({e})") from None
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    return True


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return " ".join(text[-3:])[:600] if text else type(e).__name__


# ----------------------------------------------------------------------------- megatron-core entry

def save(root: str, step: int, model: torch.nn.Module, opt, run: dict, keep_last: int,
         trainable_only: bool = False) -> dict:
    """Save model + optimizer + RNG at ``step`` (collective). ``model`` is the DDP wrapper when
    ``opt`` is Megatron's optimizer, else the plain module. ``trainable_only``: the model's parameters that
    train (requires_grad: a LoRA run's adapters), not its frozen base weights. Returns {"path", "seconds"}."""
    t0 = time.perf_counter()
    tmp = begin_save(root, step)
    if _is_megatron_opt(opt):
        from megatron.core import dist_checkpointing  # noqa: PLC0415
        dist_checkpointing.save(_megatron_sharded_state(model, opt, is_loading=False), tmp)
    else:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415
        msd, osd = get_state_dict(model, opt, options=_dcp_options(trainable_only))
        dcp.save({"model": msd, "optimizer": osd}, storage_writer=dcp.FileSystemWriter(tmp))
    save_rng(tmp, _rank())
    final = commit_save(root, tmp, step, {**run, "world": _world(), "optimizer_impl": _impl(opt)}, keep_last)
    return {"path": final, "seconds": time.perf_counter() - t0}


def load(load_path: str, model: torch.nn.Module, opt, expect: dict, trainable_only: bool = False) -> dict:
    """Load what ``save`` wrote into ``model`` and ``opt`` (collective). ``expect``: run.json keys
    that must match (model, entry point); ``trainable_only`` as ``save``'s (the frozen weights stay as they are).
    Returns run.json (its "step" is where to continue)."""
    t0 = time.perf_counter()
    step_dir = resolve(load_path)
    run = read_run(step_dir, {**expect, "optimizer_impl": _impl(opt)})
    verify_checksums(step_dir, run)
    try:
        with safe_byte_items() as guard:
            _load_state(step_dir, model, opt, trainable_only)
    except CheckpointError:
        raise
    except (Exception, _dcp_exception()) as e:  # noqa: BLE001 - the library's many error types: one message
        raise (guard.error(step_dir) or CheckpointError(
            f"{step_dir}: could not be loaded (corrupt, truncated or of another model): {_short(e)}")) from e
    load_rng(step_dir, _rank(), run.get("world") == _world())
    return {**run, "path": step_dir, "seconds": time.perf_counter() - t0}


def _dcp_exception() -> type:
    """DCP's collective error type: a BaseException, so ``except Exception`` misses it."""
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415
    return CheckpointException


def _dcp_options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # noqa: PLC0415
    return StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None


def _load_state(step_dir: str, model: torch.nn.Module, opt, trainable_only: bool = False) -> None:
    """Model and optimizer state from ``step_dir`` (collective), through the library that wrote it."""
    if _is_megatron_opt(opt):
        _load_megatron(step_dir, model, opt)
    else:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415
        read_dcp_metadata(os.path.join(step_dir, ".metadata"))
        options = _dcp_options(trainable_only)
        msd, osd = get_state_dict(model, opt, options=options)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, storage_reader=SafeFileSystemReader(step_dir))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)


def load_model_tensors(load_path: str) -> dict:
    """The model's full tensors {name: tensor} from a torch-path checkpoint, on one process without
    a process group (export, inspection). Read through the safe reader."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415
    step_dir = resolve(load_path)
    verify_checksums(step_dir, read_run(step_dir, {}))
    meta = read_dcp_metadata(os.path.join(step_dir, ".metadata"))
    model = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not model:
        raise CheckpointError(f"{step_dir}: holds no model tensors (saved through Megatron's optimizer? "
                              f"use megatron.core.dist_checkpointing to read it)")
    state = {"model": model}
    import warnings  # noqa: PLC0415
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        with safe_byte_items():
            dcp.load(state, storage_reader=SafeFileSystemReader(step_dir), no_dist=True)
    return state["model"]


def _impl(opt) -> str:
    return "megatron" if _is_megatron_opt(opt) else "torch"


def _is_megatron_opt(opt) -> bool:
    return type(opt).__module__.startswith("megatron.")


def _megatron_sharded_state(ddp_model, opt, is_loading: bool) -> dict:
    """Model parameters as replicated ShardedTensors keyed by name, and the optimizer's sharded state
    in megatron-core's canonical per-parameter form (reshardable across DP/CP sizes). GPU only (Megatron's DDP
    needs CUDA)."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint  # noqa: PLC0415
    module = getattr(ddp_model, "module", ddp_model)
    model_sd = {name: make_sharded_tensor_for_checkpoint(t, f"model.{name}")
                for name, t in module.state_dict(keep_vars=True).items()}
    opt_sd = opt.sharded_state_dict(model_sd, is_loading=is_loading,
                                    metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return {"model": model_sd, "optimizer": opt_sd}


def _load_megatron(step_dir: str, ddp_model, opt) -> None:
    from megatron.core import dist_checkpointing  # noqa: PLC0415
    read_dcp_metadata(os.path.join(step_dir, ".metadata"))  # the gate: the library then unpickles it
    common = os.path.join(step_dir, "common.pt")
    if os.path.isfile(common):
        check_weights_only(common)
    init_adam_state(opt)
    state = dist_checkpointing.load(_megatron_sharded_state(ddp_model, opt, is_loading=True), step_dir)
    module = getattr(ddp_model, "module", ddp_model)
    module.load_state_dict(state["model"])
    load_megatron_optimizer(opt, state["optimizer"], step_dir)


def load_megatron_optimizer(opt, opt_state: dict, step_dir: str) -> None:
    """Load a ``fully_reshardable`` distributed-optimizer state dict into ``opt`` (one DistributedOptimizer,
    chained or not).

    Works around megatron-core 0.16-0.19 without TE/Apex (torch AdamW): its
    ``load_parameter_state_from_fully_reshardable`` copies every entry of the optimizer's per-parameter
    state from the loaded tensors, "step" included, which the format does not store (KeyError 'step',
    1 x H100, 2026-11-23). So the common part (param groups, which carry the step) is loaded first, then
    the parameter state with the step entries set aside and put back.
    """
    param_state = opt_state.pop("param_state", None)
    sharding = opt_state.pop("param_state_sharding_type", None)
    opt.load_state_dict(opt_state)
    if param_state is None:
        return
    subs = getattr(opt, "chained_optimizers", None) or [opt]
    if sharding != "fully_reshardable" or len(subs) != 1:
        raise CheckpointError(f"{step_dir}: optimizer state of format {sharding!r} for {len(subs)} optimizer(s); "
                              f"this entry point reads 'fully_reshardable' for one distributed optimizer")
    inner = subs[0].optimizer
    steps = {p: st.pop("step") for p, st in inner.state.items() if "step" in st}
    try:
        subs[0].load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, t in steps.items():
            inner.state[p]["step"] = t


def init_adam_state(opt) -> None:
    """Give a fresh optimizer's torch Adam/AdamW its zero state (step 0, zero moments), so that a load can fill it.

    megatron-core without TE/Apex runs torch's AdamW, and its DistributedOptimizer.state_dict() asserts on
    an optimizer that has not stepped yet (no "step" to read); its load path builds that state dict first,
    so a resume into a fresh process failed with a bare AssertionError (1 x H100, 2026-11-23). The load
    then overwrites every value set here (moments, main params, and the step from the param groups).
    ``opt``: a megatron-core optimizer (chained or not) or a torch optimizer; others are left alone.
    """
    for sub in getattr(opt, "chained_optimizers", None) or [opt]:
        inner = getattr(sub, "optimizer", sub)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or len(inner.state) > 0:
            continue
        for group in inner.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = inner.state[p]
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def describe(cfg, name: str, sparse_gates: bool = False) -> dict:
    """The model identity a checkpoint must match on resume. ``sparse_gates``: the model has the top-k sparse
    attention's gate parameters (--sparse-topk); a window or dense model has none (their checkpoints interchange)."""
    import dataclasses  # noqa: PLC0415
    return {"model": {"preset": name, **{k: (list(v) if isinstance(v, tuple) else v)
                                         for k, v in dataclasses.asdict(cfg).items()}},
            "sparse_gates": sparse_gates}
