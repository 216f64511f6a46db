"""Runtime policy for a whole attention layer: plain vs async projections, HCMS chunks, transport.

No single strategy wins every regime (the async-Ulysses note; our own 4 x H200 runs): the policy
times the candidates on the caller's real shapes the first time a key is seen and keeps the fastest.

Candidates: ``LayerChoice(async_qkv, head_chunks, transport, allgather)`` for async_qkv in
{False, True}, the all-gather QKV layer (allgather=True, sp/layers/allgather.py), head_chunks in
``chunk_candidates`` (those that fit the heads per rank) and each transport that can run here
(symm_mem needs CUDA + NCCL; for the all-gather layer it selects torch's fused symm_mem matmuls
and the copy-engine output exchange). Timing: ``rounds`` interleaved rounds after ``warmup`` (every
round times each candidate once, in an order rotated per round, so clock and allocator drift hit
all alike); per-candidate medians are all-reduced (max) so every rank takes the same decision. The
plain layer (no async, C=1, NCCL) is the baseline: another candidate wins only if it is faster by
more than ``margin`` and then again in an interleaved confirmation against the baseline. Cached per
key, logged once. On CPU or a single rank nothing can overlap: the baseline is chosen without timing.

Tensor parallelism (TP > 1 with TP sequence parallelism, sp/layers/tp_cp.py) is chosen by ``FormPolicy`` below:
the Megatron adapter's candidates are Megatron's own path (the baseline) and the TP x CP layer's forms
(pipelined, mixed, mixed_in), timed over the tensor-and-context-parallel group (every rank of it takes the same
decision; with one CP rank it still has T ranks). So the TP x CP forms run only where they measured faster
than the standard path, never on CPU.

``FormPolicy`` is the same idea for a layer whose candidates are named callables, the first being the baseline
(the Megatron adapter's ``--sp-async-qkv auto``: Megatron's own attention path against the TP x CP layer's forms,
or at TP 1 against the async and all-gather layers). Per key, on the first call: ``warmup`` calls of each, then
``rounds`` interleaved rounds (order rotated per round) of ``timer(name, step, iters, warmup, group)``; every
round's time is all-reduced (max) over ``group``, so every rank feeds ``calibration.decide`` the same table and
takes the same decision: the baseline unless a form is ``margin`` faster by median AND in a strict majority of
the rounds. Logged once per key. The timer is injectable (tests drive the decision on CPU); without one,
CUDA events (``calibration.time_ms``), and off CUDA the baseline untimed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ...comm.transport import copy_engine_unavailable_reason, symm_mem_unavailable_reason
from ...trials import isolated_trial
from ..calibration import decide, median, time_ms

log = logging.getLogger("megatron_sp_ext")


@dataclass(frozen=True)
class LayerChoice:
    """How one attention layer runs."""

    async_qkv: bool = False
    head_chunks: int = 1
    transport: str = "nccl"
    allgather: bool = False   # QKV by sequence all-gather + local-head GEMM instead of q/k/v exchanges

    @property
    def label(self) -> str:
        form = "allgather" if self.allgather else ("async" if self.async_qkv else "plain")
        s = form + (f"_hcms{self.head_chunks}" if self.head_chunks > 1 else "")
        return s + ("" if self.transport == "nccl" else f"_{self.transport}")


PLAIN = LayerChoice()


@dataclass
class LayerDecision:
    choice: LayerChoice
    measured_ms: dict = field(default_factory=dict)
    confirm: tuple = ()
    reason: str = ""


class LayerPolicy:
    """Per-key layer strategy chooser (see module docstring). ``timed_devices`` (default CUDA, timed with CUDA
    events; elsewhere the host clock) exists for tests. The calibration runs in ``trials.isolated_trial``
    (activation checkpointing's saved-tensor hooks never see it)."""

    def __init__(self, chunk_candidates: Sequence[int] = (1, 2), transports: Sequence[str] = ("nccl", "symm_mem"),
                 async_candidates: Sequence[bool] = (False, True), allgather: bool = True, rounds: int = 5,
                 warmup: int = 2, margin: float = 0.02, *, timed_devices: Sequence[str] = ("cuda",)) -> None:
        self.chunk_candidates, self.transports = tuple(chunk_candidates), tuple(transports)
        self.async_candidates, self.allgather = tuple(async_candidates), allgather
        self.rounds, self.warmup, self.margin = rounds, warmup, margin
        self.timed_devices = tuple(timed_devices)
        self.cache: dict = {}

    def candidates(self, heads_per_rank: int, group, device: torch.device) -> list[LayerChoice]:
        why = {"symm_mem": symm_mem_unavailable_reason, "copy_engine": copy_engine_unavailable_reason}
        trs = [t for t in self.transports if t == "nccl" or why[t](group, device) is None]
        forms = [(a, False) for a in self.async_candidates] + ([(False, True)] if self.allgather else [])
        out = [PLAIN]
        for tr in trs:
            for a, ag in forms:
                if ag and tr == "copy_engine":  # the all-gather layer has no copy_engine form (its NCCL path is it)
                    continue
                for c in self.chunk_candidates:
                    ch = LayerChoice(a, c, tr, ag)
                    if c <= max(1, heads_per_rank) and ch not in out:
                        out.append(ch)
        return out

    def form_for(self, key: Hashable, run: Callable[[LayerChoice], None], group, device: torch.device,
                 heads_per_rank: int) -> LayerChoice:
        """The choice for ``key``; the first time, time ``run(choice)`` (one fwd+bwd) per candidate."""
        if key in self.cache:
            return self.cache[key].choice
        world = dist.get_world_size(group)
        if device.type not in self.timed_devices or world == 1:
            dec = LayerDecision(PLAIN, reason="no CUDA streams here: nothing overlaps" if world > 1 else "world 1")
        else:
            with isolated_trial():  # a checkpointed forward's saved-tensor hooks never see the trials
                dec = self._calibrate(run, self.candidates(heads_per_rank, group, device), group, device)
        self.cache[key] = dec
        log.info("megatron_sp_ext: layer policy -> %s for %s (%s)", dec.choice.label, key,
                 dec.reason or {c.label: round(t, 3) for c, t in dec.measured_ms.items()})
        return dec.choice

    def _timed_rounds(self, run, cands, rounds, group, device: Optional[torch.device] = None) -> dict:
        """Median ms of each candidate over ``rounds`` rotated rounds, max over ``group``: CUDA events on CUDA
        (``device`` None: CUDA), the host clock elsewhere."""
        dev = device or torch.device("cuda")
        cuda = dev.type == "cuda"
        for c in cands:
            for _ in range(self.warmup):
                run(c)
        if cuda:
            torch.cuda.synchronize()
        times = {c: [] for c in cands}
        for r in range(rounds):
            k = r % len(cands)  # rotate the order: every candidate leads equally often (no slot bias)
            for c in cands[k:] + cands[:k]:
                if cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    run(c)
                    b.record()
                    b.synchronize()
                    times[c].append(a.elapsed_time(b))
                else:
                    t0 = time.perf_counter()
                    run(c)
                    times[c].append((time.perf_counter() - t0) * 1e3)
        med = torch.tensor([sorted(t)[len(t) // 2] for t in times.values()], device=dev)
        dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
        return dict(zip(cands, med.tolist()))

    def _calibrate(self, run, cands, group, device: Optional[torch.device] = None) -> LayerDecision:
        dec = LayerDecision(PLAIN)
        dec.measured_ms = self._timed_rounds(run, cands, self.rounds, group, device)
        best = min(dec.measured_ms, key=lambda c: (dec.measured_ms[c], c != PLAIN))
        if best == PLAIN:
            return dec
        if dec.measured_ms[best] > dec.measured_ms[PLAIN] * (1 - self.margin):
            dec.reason = f"{best.label} within {self.margin:.0%} of plain: keep plain"
            return dec
        conf = self._timed_rounds(run, [PLAIN, best], 3, group, device)
        dec.confirm = (conf[PLAIN], conf[best])
        if conf[best] <= conf[PLAIN] * (1 - self.margin):
            dec.choice = best
        else:
            dec.reason = f"{best.label} lost the interleaved confirmation {dec.confirm}"
        return dec


# timer(name, step, iters, warmup, group) -> ms of one call of ``step`` (the candidate called ``name``)
FormTimer = Callable[[str, Callable[[], None], int, int, Optional[dist.ProcessGroup]], float]


def cuda_event_timer(name: str, step: Callable[[], None], iters: int, warmup: int, group) -> float:
    """The default FormTimer: ``calibration.time_ms`` (CUDA events, median of ``iters``, max over ``group``)."""
    return time_ms(step, iters, warmup, group)


@dataclass
class FormDecision:
    """What FormPolicy decided for one key: the form, per-round ms (max over the group), why, calibration cost."""

    form: str
    rounds: dict = field(default_factory=dict)
    reason: str = ""
    cost_ms: float = 0.0

    @property
    def measured_ms(self) -> dict:
        return {n: median(t) for n, t in self.rounds.items()}


class FormPolicy:
    """Per-key choice among named layer forms; the first candidate is the baseline (see module docstring). The
    calibration runs in ``trials.isolated_trial`` (activation checkpointing's saved-tensor hooks never see it)."""

    def __init__(self, margin: float = 0.02, rounds: int = 5, max_noise: float = 0.10, iters: int = 3,
                 warmup: int = 2, timer: Optional[FormTimer] = None) -> None:
        self.margin, self.rounds, self.max_noise, self.iters, self.warmup = margin, rounds, max_noise, iters, warmup
        self.timer = timer
        self.cache: dict = {}

    def fastest(self, key: Hashable, candidates: Mapping[str, Callable[[], None]], group,
                device: torch.device) -> str:
        """The form for ``key``; the first time, time each ``candidates[name]()`` (one step of that form at the
        caller's shapes, e.g. fwd+bwd on detached copies) and decide. Later calls: a dict lookup."""
        dec = self.cache.get(key)
        if dec is not None:
            return dec.form
        names = list(candidates)
        world = dist.get_world_size(group) if group is not None else 1
        t0 = time.perf_counter()
        if len(names) == 1 or world == 1:
            dec = FormDecision(names[0], reason="one candidate / one rank: the baseline, untimed")
        elif self.timer is None and device.type != "cuda":
            dec = FormDecision(names[0], reason="no CUDA streams here (nothing overlaps): the baseline, untimed")
        else:
            with isolated_trial():  # a checkpointed forward's saved-tensor hooks never see the trials
                dec = FormDecision(names[0], rounds=self._rounds(names, candidates, group, device))
            dec.form, dec.reason = decide(dec.rounds, self.margin, self.max_noise, plain=names[0])
        dec.cost_ms = (time.perf_counter() - t0) * 1e3
        self.cache[key] = dec
        log.info("megatron_sp_ext: layer form -> %s for %s (%s; %s; calibration %.0f ms)", dec.form, key, dec.reason,
                 {n: round(t, 3) for n, t in dec.measured_ms.items()}, dec.cost_ms)
        return dec.form

    def _rounds(self, names, candidates, group, device) -> dict:
        timer = self.timer or cuda_event_timer
        for _ in range(self.warmup):
            for n in names:
                candidates[n]()
        rounds = {n: [] for n in names}
        for r in range(self.rounds):
            for i in range(len(names)):  # rotated order: every candidate leads equally often (no slot bias)
                n = names[(r + i) % len(names)]
                rounds[n].append(float(timer(n, candidates[n], self.iters, 1, group)))
        # every rank decides from the same table: each round's time, max over the group
        table = torch.tensor([rounds[n] for n in names], dtype=torch.float64, device=device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        return {n: row for n, row in zip(names, table.tolist())}
