"""Timing-based choices that never pick a loser: the decision rule, the timer, and ``ModePolicy``.

``decide`` keeps the baseline unless another candidate is ``margin`` faster by median AND in a strict
majority of interleaved rounds (paired, same round), and the baseline's own spread is within ``max_noise``.
``time_ms`` times a step with CUDA events, max over the group (so every rank decides alike).
``ModePolicy`` is ``auto`` across algorithms (Ulysses/HCMS, ring, ...); the HCMS chunk count's policy is
``sp.ulysses.policy.HCMSPolicy``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

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


def median(xs) -> float:
    """The median of ``xs`` (the mean of the middle two for an even count)."""
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def decide(rounds: dict, margin: float, max_noise: float, plain=1) -> tuple:
    """The chunk count to run from interleaved per-round timings ``rounds[C]`` (ms, equal lengths, C = 1
    included; ``plain`` names the baseline). Plain unless a chunked C is ``margin`` faster by median and by ``margin`` in a strict
    majority of the rounds (each compared with plain's time of the same round), and plain's spread ((max - min) / median) is within ``max_noise``. Ties go to plain.
    Returns (C, reason)."""
    base = rounds[plain]
    m1 = median(base)
    if len(base) > 1 and (max(base) - min(base)) / m1 > max_noise:
        return plain, f"plain's spread over the rounds {(max(base) - min(base)) / m1:.1%} > {max_noise:.0%}: kept plain"
    others = [c for c in rounds if c != plain]
    if not others:
        return plain, "no other candidate"
    best = min(others, key=lambda c: (median(rounds[c]), str(c)))
    mb = median(rounds[best])
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
            cal.measured = {n: median(v) for n, v in cal.rounds.items()}
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
