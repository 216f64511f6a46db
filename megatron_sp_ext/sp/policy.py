"""``head_chunks="auto"``: choose the HCMS chunk count C per shape from a short calibration.

Model (HCMS paper, sec. 3.6): T(C) ~= T_attn + T_comm / C + (C - 1) * beta, minimised at
C* = sqrt(T_comm / beta). The first time a shape key is seen the policy measures plain Ulysses
T(1), the bare exchange T_comm and T(2), solves for beta, predicts C*, then measures the
neighbours of C* and keeps the fastest, C = 1 unless a chunked run is faster than plain by more
than ``margin``. All timings are all-reduced (max) so every rank takes the same decision. The
result is cached per key and logged once. On CPU (no streams, nothing overlaps) it is C = 1.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .heads import head_layout

log = logging.getLogger("megatron_sp_ext")


@dataclass
class Calibration:
    """What the policy measured for one key (milliseconds)."""

    chunks: int
    t_plain: float = float("nan")
    t_comm: float = float("nan")
    beta: float = float("nan")
    c_model: int = 1
    measured: dict = field(default_factory=dict)
    reason: str = ""
    confirm: tuple = ()


def time_ms(fn, iters: int, warmup: int, group, long_ms: Optional[float] = 50.0) -> float:
    """Median ms of ``iters`` event-timed calls of ``fn`` after ``warmup`` calls and a barrier, max over
    the ranks of ``group``. With ``long_ms``, calls longer than that stop after 2 repetitions (the spread
    there is far below the policies' 2% decision margin); benchmarks pass None."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(iters):
        if long_ms is not None and i == 2 and min(times) > long_ms:
            break
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor(sorted(times)[len(times) // 2], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


class HCMSPolicy:
    """Per-shape chunk-count chooser (see module docstring)."""

    def __init__(self, objective: str = "fwd_bwd", iters: int = 5, warmup: int = 2, margin: float = 0.02,
                 max_chunks: int = 8) -> None:
        self.objective, self.iters, self.warmup = objective, iters, warmup
        self.margin, self.max_chunks = margin, max_chunks
        self.cache: dict = {}

    def choose(self, q, k, group, *, causal, layout, scale, backend, comm_stream, transport=None) -> int:
        world = dist.get_world_size(group)
        training = torch.is_grad_enabled()
        key = (tuple(q.shape), tuple(k.shape), q.dtype, str(q.device.type), world, causal, layout,
               getattr(backend, "name", "?"), getattr(transport, "name", "nccl"),
               training and self.objective == "fwd_bwd")
        if key in self.cache:
            return self.cache[key].chunks
        if q.device.type != "cuda" or world == 1:
            cal = Calibration(1, reason="no CUDA streams here: chunking cannot overlap" if world > 1 else "world 1")
        else:
            cal = self._calibrate(q, k, group, causal, layout, scale, backend, comm_stream, key[-1], transport)
        self.cache[key] = cal
        log.info("megatron_sp_ext: head_chunks=auto -> %d for q%s k%s %s P=%d (%s)", cal.chunks, tuple(q.shape),
                 tuple(k.shape), q.dtype, world, cal.reason or cal.measured)
        return cal.chunks

    def _calibrate(self, q, k, group, causal, layout, scale, backend, comm_stream, fwd_bwd,
                   transport=None) -> Calibration:
        from ..comm.exchange import all_to_all_flat  # noqa: PLC0415
        from .ulysses import ulysses_attention  # noqa: PLC0415

        world = dist.get_world_size(group)
        max_c = min(self.max_chunks, min(head_layout(q.shape[2], k.shape[2], world, 1).q_counts))
        qs = torch.randn_like(q).requires_grad_(fwd_bwd)
        ks = torch.randn_like(k).requires_grad_(fwd_bwd)
        vs = torch.randn_like(k).requires_grad_(fwd_bwd)
        go = torch.randn_like(q)

        def run(c):
            def step():
                with torch.set_grad_enabled(fwd_bwd):
                    o = ulysses_attention(qs, ks, vs, group, head_chunks=c, causal=causal, softmax_scale=scale,
                                          layout=layout, backend=backend, comm_stream=comm_stream,
                                          transport=transport or "nccl")
                    if fwd_bwd:
                        o.backward(go)
            return time_ms(step, self.iters, self.warmup, group)

        cal = Calibration(1)
        cal.t_plain = cal.measured[1] = run(1)
        if max_c < 2:
            cal.reason = "one head per rank: nothing to chunk"
            return cal
        # bare exchange: q|k|v in + o out (x2 for backward), the communication chunking can hide
        n_in = q.numel() + 2 * k.numel()
        send, recv = q.new_empty(n_in), q.new_empty(n_in)
        send_o, recv_o = q.new_empty(q.numel()), q.new_empty(q.numel())

        a2a = transport.all_to_all if transport is not None else (lambda s, r: all_to_all_flat(s, r, group))

        def comm():
            a2a(send, recv)
            a2a(send_o, recv_o)
            if fwd_bwd:
                a2a(send_o, recv_o)
                a2a(send, recv)
        cal.t_comm = time_ms(comm, self.iters, self.warmup, group)
        cal.measured[2] = run(2)
        t_attn = max(cal.t_plain - cal.t_comm, 1e-3)
        cal.beta = max(cal.measured[2] - t_attn - cal.t_comm / 2, 1e-3)
        cal.c_model = max(1, min(max_c, round(math.sqrt(cal.t_comm / cal.beta))))
        for c in {cal.c_model - 1, cal.c_model, cal.c_model + 1}:
            if 2 <= c <= max_c and c not in cal.measured:
                cal.measured[c] = run(c)
        best = min(cal.measured, key=lambda c: (cal.measured[c], c))
        if best != 1 and cal.measured[best] <= cal.t_plain * (1 - self.margin):
            # confirm against plain Ulysses, interleaved, before switching (guards against noise and
            # warm-up order: a wrong switch costs every later step)
            plain, chunked = [], []
            for _ in range(3):
                plain.append(run(1))
                chunked.append(run(best))
            cal.confirm = (sorted(plain)[1], sorted(chunked)[1])
            if cal.confirm[1] <= cal.confirm[0] * (1 - self.margin):
                cal.chunks = best
            else:
                cal.reason = f"C={best} looked faster but lost the interleaved confirmation {cal.confirm}"
        return cal


_DEFAULT: Optional[HCMSPolicy] = None


def default_policy() -> HCMSPolicy:
    """The process-wide policy used when the caller passes none."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = HCMSPolicy()
    return _DEFAULT
