"""The benchmark harness: what every bench script shares, so that each keeps only what it measures.

    results = launch(worker, [2, 4], args, out_dir, stem)   # torchrun: this process's world; else one spawn per size
    finish_worker(rank, path, result)        # last line of a worker: rank 0's result to path, barrier, group down
    rank, world, device = init_world()       # torchrun-style scripts that run in this process's group
    median_ms(fn, iters, warmup, group)      # median of event-timed calls after warm-up, max over the ranks
    medians = interleaved_ms([fwd_fns, fwd_bwd_fns], iters, group)   # every round times each fn once, rotated
    write_results(out_dir, "bench", {"meta": run_meta(), "results": rows}, lines)   # .json (+ .md table, printed)
    plot_or_skip(path, draw)                 # matplotlib (Agg) figure from draw(plt), or a line saying why not

The start-up itself (spawned NCCL ranks, the ``--links`` regime, ``run_meta``: date, device, command, commit)
is tools/gpu_ranks.py; its names are re-exported here so a script imports one module.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sp_ext.sp.calibration import time_ms, wall_time_ms
from tools.gpu_ranks import (git_commit, init_nccl_rank, links_option, run_meta, run_world_sizes, spawn,
                             transports_for_links)
from training.video_dit.faults import on_rank0

__all__ = [  # the start-up, from tools/gpu_ranks.py
    "git_commit", "init_nccl_rank", "links_option", "run_meta", "run_world_sizes", "spawn", "transports_for_links",
    # this module
    "torchrun_rank", "launch", "finish_worker", "init_world", "rotated", "event_ms", "host_ms", "median_ms",
    "median_max", "interleaved_ms", "no_grad", "write_json", "write_results", "plot_or_skip"]

Fn = Callable[[], object]


# -- start ranks ------------------------------------------------------------------------------------------------
def torchrun_rank() -> Optional[tuple]:
    """(rank, world, port) when this process was started by torchrun (``LOCAL_RANK`` set), else None."""
    if "LOCAL_RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"])


def launch(worker: Callable, world_sizes: Sequence[int], args, out_dir: str, stem: str,
           max_world: Optional[int] = None) -> Optional[list]:
    """Rank 0's results of ``worker(rank, world, port, args, path)``, one entry per world size run. Under
    torchrun: this process is one rank of one world (as users launch training); ranks other than 0 get None.
    Else: spawned ranks per world size that fits (``run_world_sizes``; ``max_world``, default the GPUs)."""
    here = torchrun_rank()
    if here is None:
        return run_world_sizes(worker, list(world_sizes), args, out_dir, stem, max_world)
    rank, world, port = here
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"_{stem}_P{world}.json")
    worker(rank, world, port, args, path)
    if rank != 0:
        return None
    with open(path) as f:
        result = json.load(f)
    os.remove(path)
    return [result]


def finish_worker(rank: int, path: str, result, barrier: bool = True) -> None:
    """The end of a worker: rank 0 writes ``result`` (JSON) to ``path``; then a barrier (``barrier``) and the
    process group destroyed. With ``barrier`` the write goes through on_rank0: a failure there (a value JSON cannot
    hold, the disk) ends every rank instead of leaving the others in the barrier."""
    def write() -> None:
        with open(path, "w") as f:
            json.dump(result, f)
    if barrier:
        on_rank0(f"writing {path}", write)
        dist.barrier()
    elif rank == 0:
        write()
    dist.destroy_process_group()


def init_world(backend: Optional[str] = None, timeout_s: float = 600, share_gpu: bool = False,
               high_priority: bool = False) -> tuple:
    """Join the process group torchrun describes (cuda: NCCL on GPU ``LOCAL_RANK``; else gloo) ->
    (rank, world, device). ``share_gpu``: every rank on GPU 0 over gloo (CUDA tensors cross host memory: the
    library's CUDA paths at P ranks on one GPU; times are not the method's speed, per-rank memory is).
    ``high_priority``: NCCL's streams created at high priority (``ProcessGroupNCCL.Options(is_high_priority_stream=
    True)``, what Megatron's ``--high-priority-stream-groups`` sets per group): its kernels are dispatched before a
    compute kernel that would otherwise take every SM first."""
    if share_gpu and backend not in (None, "gloo"):
        raise ValueError(f"init_world: share_gpu runs gloo (several ranks on one GPU), not backend={backend!r}")
    if high_priority and (share_gpu or backend not in (None, "nccl") or not torch.cuda.is_available()):
        raise ValueError("init_world: high_priority is an option of NCCL's process group (CUDA, backend nccl)")
    cuda = torch.cuda.is_available()
    local = 0 if share_gpu else int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    backend = "gloo" if share_gpu else (backend or ("nccl" if cuda else "gloo"))
    kw = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if cuda:
        torch.cuda.set_device(device)
        if backend == "nccl":
            kw["device_id"] = device
            if high_priority:
                kw["pg_options"] = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    dist.init_process_group(backend, **kw)
    return dist.get_rank(), dist.get_world_size(), device


# -- time ----------------------------------------------------------------------------------------------------------
def join_torchrun(use_cuda: bool = True) -> tuple:
    """A tool run as one process or under torchrun -> (rank, world, device, own_pg): GPU ``LOCAL_RANK`` when CUDA is
    there and ``use_cuda``; the process group (NCCL on CUDA, else gloo) joined when torchrun's WORLD_SIZE > 1 and no
    one joined it yet (``own_pg``: the caller destroys it at the end)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = use_cuda and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    own_pg = world > 1 and not dist.is_initialized()
    if own_pg:
        dist.init_process_group("nccl" if cuda else "gloo")
    return (dist.get_rank() if dist.is_initialized() else 0), world, device, own_pg


def rotated(items: list, i: int) -> list:
    """``items`` rotated by ``i``: interleaved timing starts each repetition with a different mode, so
    no mode always runs first (or right after the same neighbour)."""
    k = i % len(items) if items else 0
    return items[k:] + items[:k]


def event_ms(fn: Fn) -> float:
    """ms of one call of ``fn`` between two CUDA events on the current stream."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def host_ms(fn: Fn) -> float:
    """ms of one call of ``fn`` on the host clock, the device synchronized before and after (when CUDA is up)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn: Fn, iters: int, warmup: int, group, cuda: bool = True) -> float:
    """Median ms of ``iters`` calls after ``warmup`` calls and a barrier, max over the ranks of ``group``
    (CUDA events; ``cuda=False``: the host clock). Every repetition is kept (no early stop)."""
    timer = time_ms if cuda else wall_time_ms
    return timer(fn, iters, warmup, group, long_ms=None)


def median_max(times: dict, group, device="cuda") -> dict:
    """{name: [ms, ...]} -> {name: median}, each the max over the ranks of ``group`` (one all-reduce; no
    reduction without a process group)."""
    names = list(times)
    med = [sorted(times[n])[len(times[n]) // 2] for n in names]
    if dist.is_initialized() and names:
        t = torch.tensor(med, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        med = t.tolist()
    return dict(zip(names, med))


def interleaved_ms(phases: Sequence[dict], iters: int, group=None, *, barrier_each: bool = False,
                   clock: str = "cuda", device="cuda") -> list:
    """Median ms per fn of each phase (a dict name -> fn), max over the ranks of ``group`` (None: this process
    only). Each of ``iters`` rounds times every fn of every phase once, phase after phase, each phase in an
    order rotated by the round (clock and allocator drift hit every fn alike, none always leads). clock:
    "cuda" (events) or "wall" (host clock between synchronizations); ``barrier_each``: a barrier before
    every call."""
    one = event_ms if clock == "cuda" else host_ms
    times = [{n: [] for n in ph} for ph in phases]
    if clock == "cuda":
        torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group=group)
    for it in range(iters):
        for ph, t in zip(phases, times):
            for name, fn in rotated(list(ph.items()), it):
                if barrier_each:
                    dist.barrier(group=group)
                t[name].append(one(fn))
    if group is None:
        return [{n: sorted(v)[len(v) // 2] for n, v in t.items()} for t in times]
    return [median_max(t, group, device) for t in times]


def no_grad(fn: Callable) -> Callable:
    """``fn`` called under ``torch.no_grad()`` (the forward-only timings)."""
    def call(*a, **kw):
        with torch.no_grad():
            return fn(*a, **kw)
    return call


# -- write -------------------------------------------------------------------------------------------------------
class AutoDecisions(logging.Filter):
    """The library's "auto" decisions logged while a block of code runs (logger "megatron_sp_ext" at INFO: the mode
    and head chunks auto picked per shape, with the reason), for a benchmark's row:

        with AutoDecisions() as decisions:
            run()
        row["auto_decisions"] = decisions.messages

    A filter of the logger, not a handler: an entry that replaces the logger's handlers (setup_logging) keeps it.
    The logger is lowered to INFO for the block where it was above (restored after)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list = []
        self.logger = logging.getLogger("megatron_sp_ext")
        self.level_before = self.logger.level

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "auto" in msg and "->" in msg:
            self.messages.append(msg)
        return True

    def __enter__(self) -> "AutoDecisions":
        self.logger.addFilter(self)
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeFilter(self)
        self.logger.setLevel(self.level_before)


def cp_grid(args) -> list:
    """The (heads, L, causal) rows of a CP benchmark's grid, in order: ``args.heads`` and ``args.seqlens`` comma lists
    of ints, ``args.causal`` a comma list of yes / no."""
    return [(h, L, c == "yes") for h in [int(x) for x in args.heads.split(",")]
            for L in [int(x) for x in args.seqlens.split(",")] for c in args.causal.split(",")]


def write_json(path: str, doc) -> str:
    """``doc`` as indented JSON at ``path`` (its folder made); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def write_results(out_dir: str, name: str, doc, lines: Optional[list] = None) -> str:
    """``<out_dir>/<name>.json`` (``doc``, normally {"meta": run_meta(), ...}) and, with ``lines``, the table
    ``<name>.md``, also printed. Returns the JSON path."""
    path = write_json(os.path.join(out_dir, f"{name}.json"), doc)
    if lines is not None:
        with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    return path


def plot_or_skip(path: str, draw: Callable, who: str = "bench", dpi: int = 90) -> bool:
    """Save ``draw(plt)``'s figure (matplotlib, Agg backend) at ``path``; when matplotlib is missing or the
    plot fails, say so in one line and go on. Returns whether the plot was written."""
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        fig = draw(plt)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        return True
    except Exception as e:  # noqa: BLE001 - a plot is never worth the measured results
        print(f"[{who}] plot skipped: {e}", flush=True)
        return False
