"""Predictions: one mode's forward and forward+backward time (``predict``), every mode that can run a problem on a
cluster (``candidates``), and ``auto``'s use of them (``rank_modes``, ``separable``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from ... import modes
from ...errors import SPConfigError
from ..placement import balanced_placement, divisor
from .cluster import Cluster
from .rates import KernelRates, package_rates
from .schedules import Problem, Setting, simulate, ulysses_mode

TASP_PLAN_RANKS = 32   # candidates: TASP rings up to this size (a 64-rank TASP plan takes ~10 s to read)
from .timeline import Result


@dataclass(frozen=True)
class Prediction:
    """``setting`` on ``tokens`` (the problem's, padded to what the mode's placement divides); ``fwd`` / ``bwd``
    the simulated timelines (``timeline.Result``)."""

    setting: Setting
    tokens: int
    fwd: Result
    bwd: Result

    @property
    def fwd_ms(self) -> float:
        return self.fwd.total_ms

    @property
    def fwd_bwd_ms(self) -> float:
        return self.fwd.total_ms + self.bwd.total_ms

    @property
    def both(self) -> Result:
        return self.fwd + self.bwd

    def line(self) -> str:
        b = self.both
        share = b.exchange_ms / self.fwd_bwd_ms if self.fwd_bwd_ms else 0.0
        return (f"{self.setting.label():<26} fwd {self.fwd_ms:9.2f} ms  fwd+bwd {self.fwd_bwd_ms:9.2f} ms  kernels "
                f"{b.kernel_ms:9.2f}  copies {b.copy_ms:7.2f}  exchange {b.exchange_ms:8.2f} ({share:.0%} of the "
                f"time) hidden {b.hidden_ms:8.2f} exposed {b.exposed_ms:8.2f}")


def padded_tokens(problem: Problem, world: int, setting: Setting) -> int:
    """The sequence the mode runs: ``problem.tokens`` padded to a multiple of its placement's divisor (as the
    entries pad a sample)."""
    spec = modes.get(setting.mode)
    variant = setting.mode if spec.ring_variant else modes.names(ring_variant=True, multi_ring=False)[0]
    d = divisor(balanced_placement(variant, problem.causal), world)
    return -(-problem.tokens // d) * d


def predict(problem: Problem, cluster: Cluster, setting: Setting, rates: Optional[KernelRates] = None) -> Prediction:
    """The forward and forward+backward time of ``setting`` (a registry mode with its settings) on ``cluster``
    (all its GPUs one sequence-parallel group). Raises SPConfigError where the mode cannot run the problem."""
    rates = rates or package_rates()
    if modes.get(setting.mode).auto:
        raise SPConfigError("auto is not a schedule: rank its candidates (speed_plan.rank_modes)")
    tokens = padded_tokens(problem, cluster.gpus, setting)
    pb = replace(problem, tokens=tokens)
    return Prediction(setting, tokens, simulate(pb, cluster, setting, rates, False),
                      simulate(pb, cluster, setting, rates, True))


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(problem: Problem, cluster: Cluster, max_chunks: int = 4, mesh_chunks: int = 2,
               tasp_ranks: int = TASP_PLAN_RANKS) -> list:
    """Every mode (registry order) and setting that can run ``problem`` on ``cluster``: Ulysses / HCMS with 1..
    ``max_chunks`` head chunks where every GPU gets a head; the ring variants (TASP on rings of at most
    ``tasp_ranks``: its P-1 rings make its plan O(P^3) per step to read); each mesh arrangement with each Ulysses size
    P_u (1 < P_u < P dividing P and the heads), ring variant and 1..``mesh_chunks`` chunks; Torus on each arrangement
    and P_u."""
    p, h = cluster.gpus, problem.heads
    out: list = []
    if p < 2:
        return [Setting(ulysses_mode(False))]
    sizes = [u for u in _divisors(math.gcd(p, h)) if 1 < u < p]
    variants = modes.names(ring_variant=True)
    arrangements = [a for a in modes.names(arrangement=True) if cluster.machines > 1 or not modes.get(a).ulysses_across]
    for name in modes.NAMES:
        spec = modes.get(name)
        if spec.auto:
            continue
        if spec.heads_per_rank:
            if h >= p:
                fixed = spec.head_chunks
                top = min(max_chunks, h // p)
                out += [Setting(name, c) for c in ([fixed] if fixed else range(2, top + 1))]
        elif spec.ring_variant:
            if not spec.multi_ring or p <= tasp_ranks:
                out.append(Setting(name))
        elif spec.arrangement:
            if name not in arrangements:
                continue
            for u in sizes:
                for v in variants:
                    if modes.get(v).multi_ring and (p // u <= 2 or p // u > tasp_ranks):
                        continue
                    out += [Setting(name, c, v, "", u) for c in range(1, min(mesh_chunks, h // u) + 1)]
        elif spec.mesh:   # torus: a mesh of either arrangement
            out += [Setting(name, 1, variants[0], a, u) for a in arrangements for u in sizes]
    return out


def predict_all(problem: Problem, cluster: Cluster, settings: Optional[Iterable[Setting]] = None,
                rates: Optional[KernelRates] = None) -> tuple:
    """(predictions, refused): every candidate's ``Prediction`` and, for each that cannot run, (setting, why)."""
    preds, refused = [], []
    for st in (settings if settings is not None else candidates(problem, cluster)):
        try:
            preds.append(predict(problem, cluster, st, rates))
        except SPConfigError as e:
            refused.append((st, str(e)))
    return preds, refused


def rank_modes(problem: Problem, cluster: Cluster, settings: Optional[Iterable[Setting]] = None,
               rates: Optional[KernelRates] = None, fwd_bwd: bool = True) -> list:
    """[(setting, predicted ms)] fastest first (forward+backward, or forward alone), over ``settings`` (default:
    ``candidates``); settings that cannot run the problem are left out."""
    preds, _ = predict_all(problem, cluster, settings, rates)
    ranked = [(p.setting, p.fwd_bwd_ms if fwd_bwd else p.fwd_ms) for p in preds]
    return sorted(ranked, key=lambda sm: sm[1])


def separable(ranking: list, margin: float = 0.1) -> list:
    """The head of ``ranking`` (``rank_modes``' list) the plan cannot separate: the fastest and every setting
    predicted within ``margin`` (a fraction) of it. One entry: the plan alone decides; more: time those."""
    if not ranking:
        return []
    best = ranking[0][1]
    return [sm for sm in ranking if sm[1] <= best * (1 + margin)]
