"""Where a step's peak memory goes: the CUDA caching allocator's history over one step, replayed to the moment of
the step's peak, with the blocks alive then grouped by the code that allocated them.

    report = peak_report(lambda: setup.step(batch), device)     # CUDA: one step recorded (torch's own history)
    report = peak_from_trace(trace, base_bytes)                 # the replay alone (tested on CPU with a trace)

``record_step`` turns torch's allocator history on (``torch.cuda.memory._record_memory_history``, Python frames)
for one call of ``fn``, reads the snapshot in memory (nothing written, nothing unpickled) and turns it off.
``peak_from_trace`` replays the device's trace (alloc, then free_requested or free_completed once per block; a block
freed in the window but allocated before it lowers the total below the base) and returns the peak's bytes above the base and the blocks alive at
that moment that the window allocated, grouped by their first frame outside torch (file:line function), largest
first. Two variants' reports side by side name the code that makes one peak higher.
"""
from __future__ import annotations

import gc
from typing import Callable, Iterable, Optional

import torch

SKIP_IN_PATH = ("/torch/", "/contextlib.py", "/functools.py", "/threading.py")


def site(frames: Iterable[dict]) -> str:
    """The first frame outside torch and the standard library's wrappers: "file:line function" (the path from its
    last "site-packages/" or the repository's root folder name on), or "?" without frames."""
    frames = list(frames)
    for f in frames:
        name = str(f.get("filename", ""))
        if name and not any(s in name for s in SKIP_IN_PATH) and not name.startswith("<"):
            for cut in ("site-packages/", "megatron_sp_ext/", "training/", "tools/", "tests/"):
                if cut in name:
                    name = (cut if cut != "site-packages/" else "") + name.split(cut, 1)[1]
                    break
            return f"{name}:{f.get('line', '?')} {f.get('name', '?')}"
    return "?" if not frames else f"{frames[0].get('filename', '?')}:{frames[0].get('line', '?')} (torch)"


def peak_from_trace(trace: list, base_bytes: int = 0, top: int = 25) -> dict:
    """``trace``: one device's allocator events in order (dicts with "action", "addr", "size", "frames"). Returns
    {"peak_above_base_bytes", "peak_event", "live_at_peak": [{"site", "bytes", "blocks"}], "events"}."""
    live: dict = {}
    now = best = 0   # bytes above the base: frees of blocks allocated before the window go below zero
    best_i, best_live = -1, {}
    requested: set = set()   # a free counts once: at free_requested, or at free_completed when none was logged
    for i, ev in enumerate(trace):
        action, addr, size = ev.get("action"), ev.get("addr"), int(ev.get("size", 0))
        if action == "alloc":
            requested.discard(addr)
            live[addr] = (size, ev.get("frames") or [])
            now += size
            if now > best:
                best, best_i, best_live = now, i, dict(live)
        elif action == "free_requested" or (action == "free_completed" and addr not in requested):
            requested.add(addr)
            live.pop(addr, None)
            now -= size
    groups: dict = {}
    for size, frames in best_live.values():
        g = groups.setdefault(site(frames), [0, 0])
        g[0] += size
        g[1] += 1
    rows = sorted(({"site": k, "bytes": v[0], "blocks": v[1]} for k, v in groups.items()), key=lambda r: -r["bytes"])
    return {"peak_above_base_bytes": best, "base_bytes": base_bytes, "peak_event": best_i,
            "live_at_peak": rows[:top], "events": len(trace)}


def record_step(fn: Callable[[], object], device: torch.device, max_entries: int = 2_000_000,
                early_stop: bool = True) -> tuple:
    """(trace of ``device``, bytes allocated before ``fn``) of one call of ``fn`` under the allocator's history:
    Python frames kept for allocations only (``context="alloc"``: the replay needs no frame of a free).
    ``early_stop=False`` turns off checkpoint's early stop of the recompute for the call."""
    from torch.cuda import memory  # noqa: PLC0415
    from torch.utils import checkpoint  # noqa: PLC0415
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    # 2026-11-28 (4 x H100, diffusers' Wan with gradient checkpointing): with frames taken at frees too, the step
    # died twice in backward's recompute ("WanTransformerBlock.forward returned NULL without setting an exception"),
    # the second time with backward on the calling thread. The recompute stops early by raising an exception; the
    # blocks freed while it unwinds took a Python traceback each, the likely loss of the pending exception.
    memory._record_memory_history(max_entries=max_entries, context="alloc", stacks="python")
    try:
        with torch.autograd.set_multithreading_enabled(False), checkpoint.set_checkpoint_early_stop(early_stop):
            fn()
        torch.cuda.synchronize(device)
        snap = memory._snapshot()
    finally:
        memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    traces = snap.get("device_traces", [])
    return (traces[index] if index < len(traces) else []), base


def peak_report(fn: Callable[[], object], device: torch.device, top: int = 25) -> Optional[dict]:
    """``peak_from_trace`` of one recorded call of ``fn`` on ``device`` (CUDA), in GiB and MiB for reading."""
    early_stop = True
    try:
        trace, base = record_step(fn, device)
    except SystemError:   # the recompute's early stop under the history (see record_step): once more without it
        early_stop = False
    if not early_stop:   # outside the except: its traceback no longer holds the failed step's frames and tensors
        gc.collect()
        torch.cuda.empty_cache()
        trace, base = record_step(fn, device, early_stop=False)
    rep = peak_from_trace(trace, base, top)
    rep["checkpoint_early_stop"] = early_stop
    rep["peak_gib"] = (rep["base_bytes"] + rep["peak_above_base_bytes"]) / 2**30
    for r in rep["live_at_peak"]:
        r["mib"] = round(r["bytes"] / 2**20, 1)
    return rep
