"""Per-step training metrics without per-step host syncs: values stay on the device and are read back
every ``--log-interval`` steps (and before a checkpoint), then written to metrics.jsonl, TensorBoard
(``--tensorboard-dir``) and the progress bar.

Row fields: step, loss, grad_norm, lr, step_time_s, tokens_per_s, mfu, peak_mem_gib (max over ranks),
peak_mem_gib_per_rank, alloc_retries (CUDA: the most caching-allocator cudaMalloc retries of any rank so far),
skipped_steps, and with --timing model_fwd_bwd_ms / optimizer_ms (CUDA events in
the same run); data_wait_ms (the loop waiting on its data path) and gc_ms (host time in Python's garbage collector)
per step. step_time_s is the interval's wall time over its steps (exact per step at --log-interval 1).

MFU = model FLOPs per second / (world x peak dense bf16 FLOP/s of one GPU), where model FLOPs per
token = 6 x (matmul parameters a video token passes) + 12 x layers x dim x (video tokens + text tokens)
(attention scores and values, forward + backward; recomputation not counted): DiTConfig.flops_per_token.
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .engine import PEAK_BF16_FLOPS, MetricsLog
from .faults import on_rank0


def peak_flops(device) -> Optional[float]:
    """Dense bf16 peak FLOP/s of this GPU (989e12 for H100/H200 SXM), None on CPU / unknown GPUs."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


class _Events:
    """fwd+bwd and optimizer spans of one step (CUDA events; perf_counter on CPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else [0.0, 0.0, 0.0]

    def mark(self, i: int) -> None:
        if self.cuda:
            self.marks[i].record()
        else:
            self.marks[i] = time.perf_counter()

    def spans_ms(self) -> tuple:
        m = self.marks
        if self.cuda:
            return m[0].elapsed_time(m[1]), m[1].elapsed_time(m[2])
        return (m[1] - m[0]) * 1e3, (m[2] - m[1]) * 1e3


class GcTimer:
    """Host milliseconds spent in Python's garbage collector (``gc.callbacks``) since the last ``take()``: a
    collection of a large heap where the host has no lead on the GPU (between two steps) leaves the GPU idle.
    A context manager: the callback is registered inside the ``with`` block only."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._t0: Optional[float] = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += 1e3 * (time.perf_counter() - self._t0)
            self._t0 = None

    def take(self) -> float:
        """The ms collected since the last call (then 0)."""
        ms, self.ms = self.ms, 0.0
        return ms

    def __enter__(self) -> "GcTimer":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


class Telemetry:
    """Collects step values (device tensors or floats) and flushes them every ``interval`` steps."""

    def __init__(self, log: MetricsLog, *, cfg, device, world: int, interval: int = 1, timing: bool = False,
                 tensorboard_dir: Optional[str] = None, writer_rank: bool = False, group=None) -> None:
        if interval < 1:
            raise ValueError(f"--log-interval={interval}: must be >= 1")
        self.log, self.cfg, self.device, self.world = log, cfg, torch.device(device), world
        self.interval, self.timing, self.group = interval, timing, group
        self.peak = peak_flops(self.device)
        self.pending: list = []
        self.t_last = time.perf_counter()
        self.tb = None

        def open_writer() -> None:
            if writer_rank:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
                self.tb = SummaryWriter(log_dir=tensorboard_dir, purge_step=log.start_step or None)
        if tensorboard_dir:   # the writing rank alone opens it; its failure (no tensorboard installed, a directory
            # it cannot write) ends every rank of ``group`` rather than leaving them in the first step's collectives
            on_rank0(f"--tensorboard-dir {tensorboard_dir}", open_writer, group)

    def events(self) -> Optional[_Events]:
        return _Events(self.device.type == "cuda") if self.timing else None

    def record(self, step: int, loss, grad_norm, lr: float, tokens: int, seqlen: int, skipped: int,
               ev: Optional[_Events] = None, extra: Optional[dict] = None) -> None:
        """loss / grad_norm: device tensors or floats (None allowed). No host sync."""
        self.pending.append((step, loss, grad_norm, lr, tokens, seqlen, skipped, ev, extra or {}))
        if len(self.pending) >= self.interval:
            self.flush()

    def flush(self) -> list:
        """Read back the pending steps (one sync), write their rows; returns them."""
        if not self.pending:
            return []
        for p in self.pending:  # CUDA events must have completed before elapsed_time
            if p[7] is not None and p[7].cuda:
                p[7].marks[2].synchronize()
        vals = [x for p in self.pending for x in (p[1], p[2])]
        dev = [v for v in vals if isinstance(v, torch.Tensor)]
        host = iter(torch.stack([v.detach().float().reshape(()) for v in dev]).tolist()) if dev else iter(())
        vals = [None if v is None else (next(host) if isinstance(v, torch.Tensor) else float(v)) for v in vals]
        now = time.perf_counter()
        dt = (now - self.t_last) / len(self.pending)
        self.t_last = now
        mem, retries = self._peak_mem()
        rows = []
        for i, (step, _, _, lr, tokens, seqlen, skipped, ev, extra) in enumerate(self.pending):
            loss, gn = vals[2 * i], vals[2 * i + 1]
            row = {"step": step, "loss": loss, "grad_norm": gn, "lr": lr, "step_time_s": dt,
                   "tokens_per_s": tokens / max(dt, 1e-9), "skipped_steps": skipped}
            if self.cfg is not None and self.peak:
                row["mfu"] = self.cfg.flops_per_token(seqlen, self.cfg.text_len) * row["tokens_per_s"] / (
                    self.peak * self.world)
            if mem is not None:
                row["peak_mem_gib"], row["peak_mem_gib_per_rank"] = max(mem), mem
            if retries is not None:
                row["alloc_retries"] = retries
            if ev is not None:
                row["model_fwd_bwd_ms"], row["optimizer_ms"] = ev.spans_ms()
            row.update(extra)
            rows.append(row)
            self.log.write(row)
            if self.tb is not None:
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)) and v is not None:
                        self.tb.add_scalar(f"train/{k}", v, step)
        self.pending = []
        if self.tb is not None:
            self.tb.flush()
        return rows

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work between steps that is not a step (validation sampling): the pending steps are written first, and
        neither its time nor (CUDA) its memory peak counts in the next steps' rows (the peak restarts at the next
        step's; the run's earlier peaks are in the rows already written)."""
        self.flush()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self.t_last = time.perf_counter()

    def _peak_mem(self) -> tuple:
        """(every rank's peak GiB, the most caching-allocator cudaMalloc retries of any rank since the run began)
        in one all-reduce; (None, None) off CUDA. A retry frees the allocator's cache and synchronizes: a step near
        the memory limit slowed by them shows in the count."""
        if self.device.type != "cuda":
            return None, None
        t = torch.zeros(2 * self.world, device=self.device)
        r = dist.get_rank() if dist.is_initialized() else 0
        t[r] = torch.cuda.max_memory_allocated(self.device) / 2**30
        t[self.world + r] = float(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        vals = t.tolist()
        return [round(x, 3) for x in vals[:self.world]], int(max(vals[self.world:]))

    def close(self) -> None:
        self.flush()
        if self.tb is not None:
            self.tb.close()
