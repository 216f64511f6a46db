"""Where one benchmarked call's GPU time goes: ``fn`` run ``reps`` times under torch.profiler on every rank, its
kernels sorted by tools/profile_train_step.py's categories (attention, exchange, elementwise = the layouts' copies,
GEMM, ..., idle) per call, the exchange's exposed time (NCCL kernels running while no other kernel does), the top
kernels by time; rank 0's summary and the largest value of each category over ranks. What tools/bench_cp.py's
``--profile-reps`` adds to each mode and to the FA4 floor (#68: where the 32K gap to the floor goes).
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tools.profile_train_step import categorize_trace


def profile_calls(fn: Callable[[], object], reps: int, group: Optional[dist.ProcessGroup] = None,
                  trace_dir: Optional[str] = None, tag: str = "call") -> dict:
    """{"rank0": summary, "max_over_ranks": {category: ms per call}, "window_ms_max": ...} of ``reps`` profiled
    calls of ``fn`` (one unprofiled call first; every rank of ``group`` calls this together). A summary is
    ``categorize_trace``'s dict per call. ``trace_dir``: rank 0's Chrome trace kept there as <tag>_rank0.json."""
    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rank = dist.get_rank(group) if group is not None else 0
    keep = trace_dir is not None and rank == 0
    # whatever fails here (a folder that cannot be made, a full disk, a trace without GPU kernels on a CPU run) is
    # this rank's "error": every rank still reaches the gather below, so the ranks' collectives stay in step
    try:
        with tempfile.TemporaryDirectory(prefix="spx_prof_") as tmp:
            path = os.path.join(trace_dir if keep else tmp, f"{tag}_rank{rank}.json")
            if keep:
                os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(path)
            mine = categorize_trace(path, reps)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - reported in the result, never raised past the gather
        mine = {"error": f"{type(e).__name__}: {e}"}
    every = [mine]
    if group is not None and dist.get_world_size(group) > 1:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
    ok = [s for s in every if "error" not in s]
    out: dict = {"reps": reps, "rank0": every[0]}
    failed = {r: s["error"] for r, s in enumerate(every) if "error" in s}
    if failed:
        out["failed_ranks"] = failed   # left out of max_over_ranks
    if ok:
        cats = ok[0]["ms_per_step"].keys()
        out["max_over_ranks"] = {c: max(s["ms_per_step"][c] for s in ok) for c in cats}
        out["window_ms_max"] = max(s["window_ms_per_step"] for s in ok)
        out["exchange_exposed_ms_max"] = max(s["exchange_exposed_ms_per_step"] for s in ok)
        out["exchange_beside_ms_min"] = min(s.get("exchange_beside_ms_per_step", 0.0) for s in ok)
    return out
