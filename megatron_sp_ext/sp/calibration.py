"""Timing-based choices that never pick a loser: the decision rule, the timers, and ``ModePolicy``.

``decide`` keeps the baseline unless another candidate is ``margin`` faster by median AND in a strict
majority of interleaved rounds (paired, same round), and the baseline's own spread is within ``max_noise``
(``spread``: from 4 rounds on without the baseline's slowest round, so one interfered round cannot veto).
``time_ms`` times a step with CUDA events, ``wall_time_ms`` with the host clock (CPU); both return the max over
the group, and every loop decision (the early stop of long calls) is taken on group-wide numbers, so every rank
runs the same collectives and decides alike. ``ModePolicy`` is ``auto`` across algorithms (Ulysses/HCMS, ring,
TASP); the HCMS chunk count's policy is ``sp.ulysses.policy.HCMSPolicy``.

What ``auto`` (the factory's ``SPAttention`` with ``mode="auto"``) guarantees, and the tests that show it
(tests/test_auto_mode.py, tests/test_policy.py):
  * the regime is measured, never told: each candidate runs fwd(+bwd) at the call's own shapes on the call's own
    group and transport, so NVLink vs host links (NCCL_P2P_DISABLE), node spans and kernel speed all show up in
    the timings; nothing reads an environment variable or a topology guess;
  * one decision per key, identical on every rank: the key holds what changes the speed (shapes, dtype, causal,
    padding, layout, placement, the group's global ranks, transport, local kernel, chunk setting, grad mode;
    ``group_key``), every timing is the group's max, and the rule is deterministic on those numbers;
  * the candidates' math is equal: Ulysses/HCMS, the ring and TASP give the same output and gradients (within
    rounding) whatever is picked; tests force each branch with an injected timer and compare with float64,
    causal zigzag and not, P=2,3,4, GQA, padding;
  * the cost is bounded and logged: ``warmup`` + ``rounds`` x ``iters`` calls per candidate, rounds stop early
    (from round ``min_rounds`` on) once the measured time exceeds ``budget_ms`` (a group-wide number), and the
    choice, its reason and the calibration's wall time are logged once per key (logger "megatron_sp_ext");
  * activation checkpointing is unaffected: the trials run in ``trials.isolated_trial``, so a forward under torch's
    non-reentrant checkpoint saves through its hooks exactly what its recompute (a cache hit) saves, and the
    gradients equal those without checkpoint (tests/test_trials.py; reentrant checkpoint too).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..trials import isolated_trial

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


ROBUST_SPREAD_ROUNDS = 4  # from this many rounds on, ``spread`` drops the slowest round


def spread(times_ms: Sequence[float]) -> tuple[float, str]:
    """How far apart one candidate's per-round times are: ((max - min) / median, which measure). With
    ``ROBUST_SPREAD_ROUNDS`` (4) or more rounds the slowest round is left out first, so one round slowed by
    something outside the candidate (another stream's allocator, a host hiccup) does not count as noise, while two
    slow rounds still do; with fewer rounds (3 leave too few to tell an outlier) all of them count. 0 for one
    round."""
    ts = sorted(times_ms)
    if len(ts) < 2:
        return 0.0, "spread of one round"
    if len(ts) >= ROBUST_SPREAD_ROUNDS:
        ts, how = ts[:-1], "spread without the slowest round"
    else:
        how = "spread over all rounds"
    return (ts[-1] - ts[0]) / median(ts), how


def decide(rounds: dict, margin: float, max_noise: float, plain=1) -> tuple:
    """The chunk count to run from interleaved per-round timings ``rounds[C]`` (ms, equal lengths, C = 1
    included; ``plain`` names the baseline). Plain unless a chunked C is ``margin`` faster by median and by
    ``margin`` in a strict majority of the rounds (each compared with plain's time of the same round), and plain's
    ``spread`` ((max - min) / median; from 4 rounds on without plain's slowest round) is within ``max_noise``.
    Ties go to plain. Returns (C, reason); the reason names the spread measure used."""
    base = rounds[plain]
    m1 = median(base)
    noise, how = spread(base)
    if noise > max_noise:
        return plain, f"plain's {how} {noise:.1%} > {max_noise:.0%}: kept plain"
    others = [c for c in rounds if c != plain]
    if not others:
        return plain, "no other candidate"
    best = min(others, key=lambda c: (median(rounds[c]), str(c)))
    mb = median(rounds[best])
    wins = sum(1 for a, b in zip(rounds[best], base) if a <= b * (1 - margin))  # paired: same round
    quiet = f"plain's {how} {noise:.1%} <= {max_noise:.0%}"
    if mb <= m1 * (1 - margin) and 2 * wins > len(base):
        return best, f"{best} median {mb:.3f} ms vs plain {m1:.3f} ms, won {wins}/{len(base)} rounds ({quiet})"
    return plain, (f"best other {best} ({mb:.3f} ms, won {wins}/{len(base)}) not {margin:.0%} under plain "
                   f"({m1:.3f} ms; {quiet})")


def time_ms(fn, iters: int, warmup: int, group, long_ms: Optional[float] = 50.0) -> float:
    """Median ms of ``iters`` event-timed calls of ``fn`` after ``warmup`` calls and a barrier, max over
    the ranks of ``group``. With ``long_ms``, calls longer than that stop after 2 repetitions (the spread
    there is far below the policies' 2% decision margin; decided on the group's max, so every rank stops
    alike); benchmarks pass None."""
    return _timed(fn, iters, warmup, group, long_ms, "cuda")


def wall_time_ms(fn, iters: int, warmup: int, group, long_ms: Optional[float] = 50.0) -> float:
    """``time_ms`` with the host clock (CPU tensors, gloo): what lets ``ModePolicy`` calibrate off CUDA (tests)."""
    return _timed(fn, iters, warmup, group, long_ms, "wall")


def group_max(x: float, group, device: str) -> float:
    """``x`` maxed over ``group`` (a float64 all-reduce on ``device``); ``x`` itself without a group."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _timed(fn, iters: int, warmup: int, group, long_ms: Optional[float], clock: str) -> float:
    cuda = clock == "cuda"
    dev = "cuda" if cuda else "cpu"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier(group=group)
    times = []
    for i in range(iters):
        # the early stop is a group-wide decision: a rank that stopped alone would leave its peers' next
        # collective (inside fn) unmatched
        if long_ms is not None and i == 2 and group_max(min(times), group, dev) > long_ms:
            break
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return group_max(sorted(times)[len(times) // 2], group, dev)


def group_key(group) -> tuple:
    """What identifies ``group`` for a cached choice: its global ranks (the same tuple on every member, unlike
    ``id``, which differs per process and can be reused after a group is destroyed); () without a group."""
    if not dist.is_initialized():
        return ()
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


class ModePolicy:
    """``auto`` across algorithms (Ulysses/HCMS, ring, TASP) per shape key, from its own calibration.

    ``fastest(key, candidates, group, device)``: ``candidates`` maps a mode name to a zero-argument step
    (one fwd+bwd at the caller's shapes); the first is the baseline. The first time a key is seen every
    candidate is timed in up to ``rounds`` interleaved rounds (rotating order), all-reduced (max) over the group,
    and ``decide`` keeps the baseline unless another mode is ``margin`` faster by median and in a strict
    majority of the rounds. Rounds stop early, from ``min_rounds`` on, once the summed measured time passes
    ``budget_ms`` (the same group-wide sum on every rank). Devices outside ``timed_devices`` (default: CUDA; no
    streams elsewhere) or one rank: the baseline, untimed. Later calls: a dict lookup. The cached
    ``Calibration``'s ``chunks`` field holds the chosen mode name. ``timer(fn, iters, warmup, group) -> ms``
    (default ``time_ms``) is injectable; each step it is handed carries its mode name as ``fn.mode``. The
    trials run in ``trials.isolated_trial``: inside a forward under non-reentrant activation checkpointing they
    save nothing through its hooks, so the recompute (a cache hit) saves what the forward saved.
    """

    def __init__(self, margin: float = 0.02, rounds: int = 5, max_noise: float = 0.10, iters: int = 3,
                 warmup: int = 2, timer=None, *, budget_ms: float = 4000.0, min_rounds: int = 3,
                 timed_devices: tuple = ("cuda",)) -> None:
        self.margin, self.rounds, self.max_noise, self.iters, self.warmup = margin, rounds, max_noise, iters, warmup
        self.budget_ms, self.min_rounds, self.timed_devices = budget_ms, min_rounds, tuple(timed_devices)
        self.timer = timer or time_ms
        self.cache: dict = {}

    def fastest(self, key, candidates: dict, group, device) -> str:
        cal = self.cache.get(key)
        if cal is not None:
            return cal.chunks
        names = list(candidates)
        steps = {n: _named(n, f) for n, f in candidates.items()}
        t0 = time.perf_counter()
        if device.type not in self.timed_devices or dist.get_world_size(group) == 1 or len(names) == 1:
            cal = Calibration(names[0], reason=f"{device.type} not timed / one rank / one candidate: the baseline, "
                                               f"untimed")
        else:
            cal = Calibration(names[0])
            cal.rounds = {n: [] for n in names}
            with isolated_trial():  # a checkpointed forward's saved-tensor hooks never see the trials
                for _ in range(self.warmup):
                    for n in names:
                        steps[n]()
                spent = 0.0  # measured ms so far: group-wide numbers, so every rank stops after the same round
                for r in range(self.rounds):
                    if r >= self.min_rounds and spent > self.budget_ms:
                        break
                    for i in range(len(names)):
                        n = names[(r + i) % len(names)]
                        ms = self.timer(steps[n], self.iters, 1, group)
                        cal.rounds[n].append(ms)
                        spent += ms * (self.iters + 1)
            cal.measured = {n: median(v) for n, v in cal.rounds.items()}
            cal.chunks, cal.reason = decide(cal.rounds, self.margin, self.max_noise, plain=names[0])
            cal.confirm = (cal.measured[names[0]], cal.measured[cal.chunks])
        cal.cost_ms = (time.perf_counter() - t0) * 1e3
        self.cache[key] = cal
        log.info("megatron_sp_ext: auto mode -> %s for %s (%s; %d rounds, calibration %.0f ms)", cal.chunks, key,
                 cal.reason or cal.measured, len(next(iter(cal.rounds.values()), ())), cal.cost_ms)
        return cal.chunks

    def fastest_for(self, q, k, group, attention: dict, *, extra_key=(), device=None,
                   fwd_bwd: Optional[bool] = None) -> str:
        """``fastest`` for attention calls shaped like ``q``/``k``: each ``attention[name](q, k, v)`` is timed on
        fresh random tensors of those shapes (private RNG: the model's random streams stay untouched), with a
        backward when grad is enabled. Devices outside ``timed_devices``: the first (baseline) name, untimed.
        The key: shapes, dtype, device type, the group's global ranks (``group_key``), ``extra_key`` (what else
        changes the speed: causal, padding, layout, placement, transport, kernel, ...), and whether fwd+bwd is
        timed: ``fwd_bwd`` (the caller's module is training; a no_grad forward of activation recompute then keys
        and decides like its recompute) or, when None, grad mode. ``device`` overrides the device whose type
        decides whether to time (tests)."""
        names = list(attention)
        device = device or q.device
        if device.type not in self.timed_devices:
            return names[0]
        fwd_bwd = torch.is_grad_enabled() if fwd_bwd is None else bool(fwd_bwd)
        key = (tuple(q.shape), tuple(k.shape), q.dtype, device.type, group_key(group), *extra_key, fwd_bwd)
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
        return self.fastest(key, {n: step(fn) for n, fn in attention.items()}, group, device)


def _named(name: str, fn):
    """``fn`` as a function carrying ``.mode = name`` (what an injected timer may read)."""
    def run():
        return fn()
    run.mode = name
    return run
