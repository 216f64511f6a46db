"""``head_chunks="auto"``: choose the HCMS chunk count C per shape from a short calibration that never
picks a loser.

Model (HCMS paper, sec. 3.6): T(C) ~= T_attn + T_comm / C + (C - 1) * beta, minimised at
C* = sqrt(T_comm / beta). The first time a shape key is seen the policy screens plain Ulysses
T(1), the bare exchange T_comm and T(2), solves for beta and predicts C*. Then the candidates
(C = 1, the plain path, always among them; C* and its neighbours; 2) are timed in ``rounds``
interleaved rounds (the order rotates every round, so warm-up and drift hit every candidate alike).
``decide`` keeps C = 1 unless a chunked C has a median at least ``margin`` below plain's AND is
``margin`` faster than plain in a strict majority of the rounds (paired, same round); if plain's own spread over the rounds exceeds
``max_noise`` the measurement cannot separate them and plain is kept. Every timing is all-reduced
(max) over the group, so all ranks hold the same numbers and take the same decision. The cost of
the calibration itself is recorded (``Calibration.cost_ms``). After calibration a call costs one
dict lookup (``choose``; ~1 us of host time on CPU). On CPU (no streams, nothing overlaps) it is C = 1.
"""
from __future__ import annotations

import logging
import math
import time
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
    confirm: tuple = ()   # (plain median, chosen median) over the interleaved rounds
    rounds: dict = field(default_factory=dict)  # C -> per-round ms of the interleaved rounds
    cost_ms: float = 0.0  # host wall time the calibration took


def _median(xs) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def decide(rounds: dict, margin: float, max_noise: float, plain=1) -> tuple:
    """The chunk count to run from interleaved per-round timings ``rounds[C]`` (ms, equal lengths, C = 1
    included; ``plain`` names the baseline). Plain unless a chunked C is ``margin`` faster by median and by ``margin`` in a strict
    majority of the rounds (each compared with plain's time of the same round), and plain's spread ((max - min) / median) is within ``max_noise``. Ties go to plain.
    Returns (C, reason)."""
    base = rounds[plain]
    m1 = _median(base)
    if len(base) > 1 and (max(base) - min(base)) / m1 > max_noise:
        return plain, f"plain's spread over the rounds {(max(base) - min(base)) / m1:.1%} > {max_noise:.0%}: kept plain"
    others = [c for c in rounds if c != plain]
    if not others:
        return plain, "no other candidate"
    best = min(others, key=lambda c: (_median(rounds[c]), str(c)))
    mb = _median(rounds[best])
    wins = sum(1 for a, b in zip(rounds[best], base) if a <= b * (1 - margin))  # paired: same round
    if mb <= m1 * (1 - margin) and 2 * wins > len(base):
        return best, f"{best} median {mb:.3f} ms vs plain {m1:.3f} ms, won {wins}/{len(base)} rounds"
    return plain, f"best other {best} ({mb:.3f} ms, won {wins}/{len(base)}) not {margin:.0%} under plain ({m1:.3f} ms)"


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
    """Per-shape chunk-count chooser (see module docstring). ``timer(fn, iters, warmup, group) -> ms``
    (default ``time_ms``: CUDA events, max over ranks) is injectable for tests."""

    def __init__(self, objective: str = "fwd_bwd", iters: int = 3, warmup: int = 2, margin: float = 0.02,
                 max_chunks: int = 8, rounds: int = 5, max_noise: float = 0.10, timer=None) -> None:
        self.objective, self.iters, self.warmup = objective, iters, warmup
        self.margin, self.max_chunks, self.rounds, self.max_noise = margin, max_chunks, rounds, max_noise
        self.timer = timer or time_ms
        self.cache: dict = {}

    def choose(self, q, k, group, *, causal, layout, scale, backend, comm_stream, transport=None) -> int:
        key = (q.shape, k.shape, q.dtype, q.device.type, id(group), causal, layout,
               getattr(backend, "name", "?"), getattr(transport, "name", "nccl"),
               self.objective == "fwd_bwd" and torch.is_grad_enabled())
        cal = self.cache.get(key)
        if cal is not None:
            return cal.chunks
        world = dist.get_world_size(group)
        if q.device.type != "cuda" or world == 1:
            cal = Calibration(1, reason="no CUDA streams here: chunking cannot overlap" if world > 1 else "world 1")
        else:
            cal = self._calibrate(q, k, group, causal, layout, scale, backend, comm_stream, key[-1], transport)
        self.cache[key] = cal
        log.info("megatron_sp_ext: head_chunks=auto -> %d for q%s k%s %s P=%d (%s; calibration %.0f ms)",
                 cal.chunks, tuple(q.shape), tuple(k.shape), q.dtype, world, cal.reason or cal.measured, cal.cost_ms)
        return cal.chunks

    def _calibrate(self, q, k, group, causal, layout, scale, backend, comm_stream, fwd_bwd,
                   transport=None) -> Calibration:
        from ..comm.exchange import all_to_all_flat  # noqa: PLC0415
        from .ulysses import ulysses_attention  # noqa: PLC0415

        t0 = time.perf_counter()
        world = dist.get_world_size(group)
        max_c = min(self.max_chunks, min(head_layout(q.shape[2], k.shape[2], world, 1).q_counts))
        gen = torch.Generator(device=q.device).manual_seed(0)  # the caller's RNG streams stay untouched
        qs, ks, vs, go = (torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype) for t in (q, k, k, q))
        qs, ks, vs = (t.requires_grad_(fwd_bwd) for t in (qs, ks, vs))

        def measure(c, iters=None, warmup=None):
            def step():
                with torch.set_grad_enabled(fwd_bwd):
                    o = ulysses_attention(qs, ks, vs, group, head_chunks=c, causal=causal, softmax_scale=scale,
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
        cal.confirm = (_median(cal.rounds[1]), _median(cal.rounds[cal.chunks]))
        return cal


class ModePolicy:
    """``auto`` across algorithms (Ulysses/HCMS, ring, ...) per shape key, from its own calibration.

    ``choose(key, candidates, group, device)``: ``candidates`` maps a mode name to a zero-argument step
    (one fwd+bwd at the caller's shapes); the first is the baseline. The first time a key is seen every
    candidate is timed in ``rounds`` interleaved rounds (rotating order), all-reduced (max) over the group,
    and ``decide`` keeps the baseline unless another mode is ``margin`` faster by median and in a strict
    majority of the rounds. Without CUDA or with one rank: the baseline, untimed. Later calls: a dict lookup.
    The cached ``Calibration``'s ``chunks`` field holds the chosen mode name.
    """

    def __init__(self, margin: float = 0.02, rounds: int = 5, max_noise: float = 0.10, iters: int = 3,
                 warmup: int = 2, timer=None) -> None:
        self.margin, self.rounds, self.max_noise, self.iters, self.warmup = margin, rounds, max_noise, iters, warmup
        self.timer = timer or time_ms
        self.cache: dict = {}

    def choose(self, key, candidates: dict, group, device) -> str:
        cal = self.cache.get(key)
        if cal is not None:
            return cal.chunks
        names = list(candidates)
        t0 = time.perf_counter()
        if device.type != "cuda" or dist.get_world_size(group) == 1 or len(names) == 1:
            cal = Calibration(names[0], reason="no CUDA / one rank / one candidate: the baseline, untimed")
        else:
            cal = Calibration(names[0])
            cal.rounds = {n: [] for n in names}
            for _ in range(self.warmup):
                for n in names:
                    candidates[n]()
            for r in range(self.rounds):
                for i in range(len(names)):
                    n = names[(r + i) % len(names)]
                    cal.rounds[n].append(self.timer(candidates[n], self.iters, 1, group))
            cal.measured = {n: _median(v) for n, v in cal.rounds.items()}
            cal.chunks, cal.reason = decide(cal.rounds, self.margin, self.max_noise, plain=names[0])
            cal.confirm = (cal.measured[names[0]], cal.measured[cal.chunks])
        cal.cost_ms = (time.perf_counter() - t0) * 1e3
        self.cache[key] = cal
        log.info("megatron_sp_ext: auto mode -> %s for %s (%s; calibration %.0f ms)", cal.chunks, key,
                 cal.reason or cal.measured, cal.cost_ms)
        return cal.chunks


    def choose_for(self, q, k, group, attention: dict, *, extra_key=(), device=None) -> str:
        """``choose`` for attention calls shaped like ``q``/``k``: each ``attention[name](q, k, v)`` is timed on
        fresh random tensors of those shapes (private RNG: the model's random streams stay untouched), with a
        backward when grad is enabled. Without CUDA: the first (baseline) name, untimed. ``device`` overrides
        the device whose type decides that (tests)."""
        names = list(attention)
        device = device or q.device
        if device.type != "cuda":
            return names[0]
        fwd_bwd = torch.is_grad_enabled()
        key = (tuple(q.shape), tuple(k.shape), q.dtype, device.type, id(group), *extra_key, fwd_bwd)
        if key in self.cache:
            return self.cache[key].chunks
        gen = torch.Generator(device=q.device).manual_seed(0)
        qs, ks, vs, go = (torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype) for t in (q, k, k, q))
        qs, ks, vs = (t.requires_grad_(fwd_bwd) for t in (qs, ks, vs))

        def step(fn):
            def run():
                with torch.set_grad_enabled(fwd_bwd):
                    o = fn(qs, ks, vs)
                    if fwd_bwd:
                        o.backward(go)
            return run
        return self.choose(key, {n: step(fn) for n, fn in attention.items()}, group, device)


_DEFAULT: Optional[HCMSPolicy] = None


def default_policy() -> HCMSPolicy:
    """The process-wide policy used when the caller passes none."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = HCMSPolicy()
    return _DEFAULT
