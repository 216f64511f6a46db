"""``head_chunks="auto"``: choose the HCMS chunk count C per shape from a short calibration that never
picks a loser.

Model (HCMS paper, sec. 3.6): T(C) ~= T_attn + T_comm / C + (C - 1) * beta, minimised at
C* = sqrt(T_comm / beta). The first time a shape key is seen the policy screens plain Ulysses
T(1), the bare exchange T_comm and T(2), solves for beta and predicts C*. Then the candidates
(C = 1, the plain path, always among them; C* and its neighbours; 2) are timed in ``rounds``
interleaved rounds (the order rotates every round, so warm-up and drift hit every candidate alike).
``decide`` keeps C = 1 unless a chunked C has a median at least ``margin`` below plain's AND is
``margin`` faster than plain in a strict majority of the rounds (paired, same round); if plain's own spread over
the rounds (``calibration.spread``: from 4 rounds on without plain's slowest round, so one interfered round cannot
veto) exceeds ``max_noise`` the measurement cannot separate them and plain is kept. Every timing is all-reduced
(max) over the group, so all ranks hold the same numbers and take the same decision; the key names the group
by its global ranks (``calibration.group_key``), the same on every member. The cost of
the calibration itself is recorded (``Calibration.cost_ms``). After calibration a call costs one
dict lookup (``chunks_for``; ~1 us of host time on CPU). On CPU (no streams, nothing overlaps) it is C = 1.
The attention function to time is passed in (``chunks_for(..., attention=ulysses_attention)``): this module never
imports the Ulysses Function that uses it. The decision rule and timer are ``sp.calibration``'s.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from ...comm.exchange import all_to_all_flat
from ...trials import isolated_trial
from ..calibration import Calibration, decide, group_key, median, time_ms
from ..heads import head_layout

log = logging.getLogger("megatron_sp_ext")


class ChunkPolicy(Protocol):
    """What ``ulysses_attention(head_chunks="auto", policy=...)`` calls: the chunk count for a shape."""

    def chunks_for(self, q: torch.Tensor, k: torch.Tensor, group, *, causal: bool, layout: str, scale: float,
               backend, comm_stream, transport=None, attention: Callable[..., torch.Tensor]) -> int: ...


class HCMSPolicy:
    """Per-shape chunk-count chooser (see module docstring). ``timer(fn, iters, warmup, group) -> ms``
    (default ``time_ms``: CUDA events, max over ranks) and ``timed_devices`` (default CUDA: elsewhere C = 1,
    untimed) are injectable for tests. The calibration runs in ``trials.isolated_trial`` (activation
    checkpointing's saved-tensor hooks never see it)."""

    def __init__(self, objective: str = "fwd_bwd", iters: int = 3, warmup: int = 2, margin: float = 0.02,
                 max_chunks: int = 8, rounds: int = 5, max_noise: float = 0.10, timer=None, *,
                 timed_devices: tuple = ("cuda",)) -> None:
        self.objective, self.iters, self.warmup = objective, iters, warmup
        self.margin, self.max_chunks, self.rounds, self.max_noise = margin, max_chunks, rounds, max_noise
        self.timer = timer or time_ms
        self.timed_devices = tuple(timed_devices)
        self.cache: dict = {}

    def chunks_for(self, q, k, group, *, causal, layout, scale, backend, comm_stream, transport=None,
               attention: Callable[..., torch.Tensor]) -> int:
        """The chunk count for calls shaped like q [B, S_loc, H, D] / k (Hkv heads); calibrates ``attention``
        (``ulysses_attention``'s signature) the first time a shape key is seen."""
        key = (q.shape, k.shape, q.dtype, q.device.type, group_key(group), causal, layout,
               getattr(backend, "name", "?"), getattr(transport, "name", "nccl"),
               self.objective == "fwd_bwd" and torch.is_grad_enabled())
        cal = self.cache.get(key)
        if cal is not None:
            return cal.chunks
        world = dist.get_world_size(group)
        if q.device.type not in self.timed_devices or world == 1:
            cal = Calibration(1, reason="no CUDA streams here: chunking cannot overlap" if world > 1 else "world 1")
        else:
            with isolated_trial():  # a checkpointed forward's saved-tensor hooks never see the trials
                cal = self._calibrate(attention, q, k, group, causal, layout, scale, backend, comm_stream, key[-1],
                                      transport)
        self.cache[key] = cal
        log.info("megatron_sp_ext: head_chunks=auto -> %d for q%s k%s %s P=%d (%s; calibration %.0f ms)",
                 cal.chunks, tuple(q.shape), tuple(k.shape), q.dtype, world, cal.reason or cal.measured, cal.cost_ms)
        return cal.chunks

    def _calibrate(self, attention, q, k, group, causal, layout, scale, backend, comm_stream, fwd_bwd,
                   transport=None) -> Calibration:
        t0 = time.perf_counter()
        world = dist.get_world_size(group)
        max_c = min(self.max_chunks, min(head_layout(q.shape[2], k.shape[2], world, 1).q_counts))
        gen = torch.Generator(device=q.device).manual_seed(0)  # the caller's RNG streams stay untouched
        qs, ks, vs, go = (torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype) for t in (q, k, k, q))
        qs, ks, vs = (t.requires_grad_(fwd_bwd) for t in (qs, ks, vs))

        def measure(c, iters=None, warmup=None):
            def step():
                with torch.set_grad_enabled(fwd_bwd):
                    o = attention(qs, ks, vs, group, head_chunks=c, causal=causal, softmax_scale=scale,
                                    layout=layout, backend=backend, comm_stream=comm_stream,
                                    transport=transport or "nccl")
                    if fwd_bwd:
                        o.backward(go)
            return self.timer(step, iters or self.iters, self.warmup if warmup is None else warmup, group)

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
        cal = self.search(measure, lambda: self.timer(comm, self.iters, self.warmup, group), max_c)
        cal.cost_ms = (time.perf_counter() - t0) * 1e3
        return cal

    def search(self, measure, comm_time, max_c: int) -> Calibration:
        """The calibration given ``measure(c) -> ms`` (same value on every rank) and ``comm_time() -> ms``."""
        cal = Calibration(1)
        cal.t_plain = cal.measured[1] = measure(1)
        if max_c < 2:
            cal.reason = "one head per rank: nothing to chunk"
            return cal
        # screen: the bare exchange (what chunking can hide) and C=2 give beta and the model's C*
        cal.t_comm = comm_time()
        cal.measured[2] = measure(2)
        t_attn = max(cal.t_plain - cal.t_comm, 1e-3)
        cal.beta = max(cal.measured[2] - t_attn - cal.t_comm / 2, 1e-3)
        cal.c_model = max(1, min(max_c, round(math.sqrt(cal.t_comm / cal.beta))))
        for c in (cal.c_model - 1, cal.c_model, cal.c_model + 1):
            if 2 <= c <= max_c and c not in cal.measured:
                cal.measured[c] = measure(c)
        # the interleaved rounds: plain plus the two best screened chunk counts
        chunked = sorted((c for c in cal.measured if c != 1), key=lambda c: (cal.measured[c], c))[:2]
        cands = [1] + chunked
        cal.rounds = {c: [] for c in cands}
        for r in range(self.rounds):
            for i in range(len(cands)):
                c = cands[(r + i) % len(cands)]
                cal.rounds[c].append(measure(c, warmup=1))
        cal.chunks, cal.reason = decide(cal.rounds, self.margin, self.max_noise)
        cal.confirm = (median(cal.rounds[1]), median(cal.rounds[cal.chunks]))
        return cal


_DEFAULT: Optional[HCMSPolicy] = None


def default_policy() -> HCMSPolicy:
    """The process-wide policy used when the caller passes none."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = HCMSPolicy()
    return _DEFAULT
