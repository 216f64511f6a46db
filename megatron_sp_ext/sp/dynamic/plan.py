"""The dynamic-SP packer: each sample of a pack over an aligned sub-group of ranks sized to its length.

For a pack of samples (token counts ``lengths``) and P ranks, every sample gets an SP size d from the divisors of P
(at least ``min_size``) and an aligned sub-group: ranks [start, start + d) with start a multiple of d (for P=8: the
eight single ranks, four pairs, two quads and the whole group; ``groups.DynamicGroups`` creates them once). Whole
short samples sit on single ranks (no exchange); a long sample is split over as few ranks as its work needs.

Work model (``CostModel``, in units of one query-key pair's attention): a sample of n tokens split over d ranks
costs each of them ceil(n/d) * (n + linear_tokens) (attention ~ n^2, the rest of the layer ~ n) plus, when d > 1,
exchange_tokens * ceil(n/d) * (d-1)/d (the all-to-all volume of its tokens). ``plan_pack`` tries a set of work caps
(each sample at the smallest size whose per-rank share fits the cap; and the same with every sample that does not
fit one rank spread over all P), places the samples largest first on the least-loaded aligned sub-group of its
size, then improves each by moving one sample of the busiest rank at a time (to any allowed size and aligned
sub-group) while that lowers (busiest rank, sum of squared loads); it keeps only
plans that give every rank tokens, adds uniform SP (every sample over all P ranks) and returns the plan with the
lowest busiest-rank work (ties: less exchange, then the earlier candidate), but uniform SP unless that plan's busiest
rank is at least ``min_gain`` lighter than uniform SP's (the model leaves out each sub-group's own calls and launches:
on 2 x H100 a plan modelled 1.9% lighter ran 4% slower, unchecked, so the entries keep ``MIN_GAIN``). A pure function of
(lengths, P, min_size, cost, min_gain): identical on every rank.

Local rows: rank r holds, for each of its samples in sample order, piece (r - start) of d of the sample padded at its
tail to a multiple of d (contiguous per-sample placement inside the sub-group, as ``shard_sequence(cu_seqlens=)``
places it over that sub-group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ...errors import SPConfigError

# the modelled gain below which the entries keep uniform SP (2 x H100, 2026-11-25: a plan modelled 1.9% lighter than
# uniform SP ran 4% slower at P=2 over NVLink, before that path's gradients were checked there: a conservative
# margin until a checked rerun; results/2026-11-25_h100x2_fa4_lists_dynamic)
MIN_GAIN = 0.05
# the caps tried, as multiples of the mean work per rank (inf: every sample at its smallest allowed size)
CAPS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, float("inf"))


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class CostModel:
    """Per-rank work of a sample in units of one query-key pair's attention. linear_tokens: the rest of the layer
    per token (projections, MLP, cross-attention); exchange_tokens: one token's Ulysses exchange per rank (q, k, v and
    the output); ring: exchange as the ring's instead (k and v, d - 1 times)."""

    linear_tokens: float = 0.0
    exchange_tokens: float = 0.0
    ring: bool = False

    @classmethod
    def for_dims(cls, dim: int, ffn: int, text_len: int = 0, flops_per_byte: float = 0.0,
                 bytes_per_value: int = 2, ring: bool = False) -> "CostModel":
        """A DiT layer of width ``dim``, MLP width ``ffn`` and ``text_len`` text tokens: linear FLOPs per token
        2 * (6 dim^2 + 2 dim ffn) + 4 dim text_len over 4 dim per pair; the exchange of q, k, v and the output
        (4 dim values of ``bytes_per_value``) at ``flops_per_byte`` (the GPU's FLOP/s over the link's bytes/s;
        0: exchange not counted); ring: the ring's exchange (``CostModel.ring``)."""
        lin = (2 * (6 * dim * dim + 2 * dim * ffn) + 4 * dim * text_len) / (4 * dim)
        return cls(linear_tokens=lin, exchange_tokens=4 * dim * bytes_per_value * flops_per_byte / (4 * dim),
                   ring=ring)

    def compute(self, n: int, d: int) -> float:
        """A rank's attention + linear work for its share of an n-token sample split over d ranks."""
        rows = -(-n // d)
        return rows * (n + self.linear_tokens)

    def exchange(self, n: int, d: int) -> float:
        """A rank's exchange work for its share of an n-token sample over d ranks (0 on one rank): Ulysses sends
        4 tensors of its rows x (d-1)/d, the ring 2 tensors of its rows d - 1 times."""
        if d == 1:
            return 0.0
        rows = -(-n // d)
        return self.exchange_tokens * rows * ((d - 1) / 2 if self.ring else (d - 1) / d)

    def work(self, n: int, d: int) -> float:
        return self.compute(n, d) + self.exchange(n, d)


@dataclass(frozen=True)
class DynamicPlan:
    """Which ranks run each sample of a pack. lengths: tokens per sample; sizes: each sample's SP size (a divisor of
    world); starts: the first rank of its aligned sub-group (a multiple of its size)."""

    world: int
    lengths: tuple[int, ...]
    sizes: tuple[int, ...]
    starts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.lengths) == len(self.sizes) == len(self.starts)):
            raise SPConfigError("dynamic SP plan: lengths, sizes and starts must have one entry per sample")
        for i, (d, s) in enumerate(zip(self.sizes, self.starts)):
            if d < 1 or self.world % d or s % d or not 0 <= s < self.world:
                raise SPConfigError(f"dynamic SP plan: sample {i} has size {d} at rank {s}: the size must divide "
                                    f"{self.world} and the start be a multiple of the size below {self.world}")

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return tuple(out)

    def ranks_of(self, i: int) -> range:
        return range(self.starts[i], self.starts[i] + self.sizes[i])

    def on(self, i: int, rank: int) -> bool:
        return self.starts[i] <= rank < self.starts[i] + self.sizes[i]

    def samples_on(self, rank: int) -> list[int]:
        return [i for i in range(len(self.lengths)) if self.on(i, rank)]

    def local_lens(self, rank: int) -> tuple[int, ...]:
        """Rows of each sample on ``rank`` (ceil(n / d) for its samples, padding included; 0 for the others)."""
        return tuple(-(-n // d) if self.on(i, rank) else 0
                     for i, (n, d) in enumerate(zip(self.lengths, self.sizes)))

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(sample, first row within the sample, rows) of ``rank``'s local rows in order; rows past the sample's
        length are its tail padding."""
        out = []
        for i in self.samples_on(rank):
            rows = -(-self.lengths[i] // self.sizes[i])
            out.append((i, (rank - self.starts[i]) * rows, rows))
        return out

    def groups(self) -> list[tuple[int, int]]:
        """The (start, size) sub-groups with samples, largest first then by start: the order every rank runs them
        in (one global order: no two ranks wait on each other in opposite orders)."""
        return sorted({(s, d) for s, d in zip(self.starts, self.sizes)}, key=lambda g: (-g[1], g[0]))

    def loads(self, cost: CostModel) -> list[float]:
        """Work of each rank (compute + exchange)."""
        load = [0.0] * self.world
        for n, d, s in zip(self.lengths, self.sizes, self.starts):
            w = cost.work(n, d)
            for r in range(s, s + d):
                load[r] += w
        return load

    def exchanged_tokens(self) -> float:
        """Tokens each rank sends in all (per exchanged tensor), summed over ranks: sum over split samples of
        n * (d - 1) / d."""
        return sum(n * (d - 1) / d for n, d in zip(self.lengths, self.sizes) if d > 1)

    def describe(self, cost: Optional[CostModel] = None) -> str:
        """The plan in a user's words: how many samples run on how many ranks, their token range, the busiest
        rank against the mean, and the exchange against uniform SP."""
        parts = []
        for d in sorted(set(self.sizes)):
            ns = [n for n, s in zip(self.lengths, self.sizes) if s == d]
            span = f"{min(ns):,}" if min(ns) == max(ns) else f"{min(ns):,}-{max(ns):,}"
            where = "on one rank each" if d == 1 else f"over {d} ranks"
            parts.append(f"{len(ns)} sample{'s' if len(ns) > 1 else ''} of {span} tokens {where}")
        loads = self.loads(cost or CostModel())
        mean = sum(loads) / len(loads)
        uniform = sum(n * (self.world - 1) / self.world for n in self.lengths)
        ex = self.exchanged_tokens()
        return (f"dynamic SP over {self.world} ranks: " + "; ".join(parts)
                + f". Busiest rank {max(loads) / mean if mean else 1.0:.2f}x the mean work; exchange "
                + (f"{ex / uniform:.0%} of uniform SP's" if uniform else "none"))


def _fits(n: int, allowed: Sequence[int], cap: float, cost: CostModel) -> int:
    """The smallest allowed size whose per-rank share of an n-token sample fits ``cap`` (else the largest)."""
    for d in allowed:
        if cost.work(n, d) <= cap:
            return d
    return allowed[-1]


def _place(lengths: Sequence[int], sizes: Sequence[int], world: int, cost: CostModel) -> DynamicPlan:
    """Largest first (size, then work), each sample on the aligned sub-group of its size whose busiest rank is
    least loaded (ties: the lower start)."""
    load = [0.0] * world
    starts = [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (-sizes[i], -cost.work(lengths[i], sizes[i]), i))
    for i in order:
        d = sizes[i]
        best = min(range(0, world, d), key=lambda s: (max(load[s:s + d]), s))
        starts[i] = best
        w = cost.work(lengths[i], d)
        for r in range(best, best + d):
            load[r] += w
    return DynamicPlan(world, tuple(lengths), tuple(sizes), tuple(starts))


def _refine(plan: DynamicPlan, allowed: Sequence[int], cost: CostModel, rounds: int) -> DynamicPlan:
    """Move one sample touching the busiest rank at a time (any allowed size, any aligned start) while the move
    lowers (busiest rank's work, sum of squared loads); deterministic (first best move in index order)."""
    sizes, starts = list(plan.sizes), list(plan.starts)
    load = plan.loads(cost)

    def score(ld):
        return (max(ld), sum(x * x for x in ld))
    for _ in range(rounds):
        best, top = None, max(load)
        busiest = load.index(top)
        now = score(load)
        for i in range(len(sizes)):
            if not starts[i] <= busiest < starts[i] + sizes[i]:
                continue
            n, w = plan.lengths[i], cost.work(plan.lengths[i], sizes[i])
            base = list(load)
            for r in range(starts[i], starts[i] + sizes[i]):
                base[r] -= w
            for d in allowed:
                wd = cost.work(n, d)
                for s in range(0, plan.world, d):
                    if (d, s) == (sizes[i], starts[i]):
                        continue
                    trial = list(base)
                    for r in range(s, s + d):
                        trial[r] += wd
                    sc = score(trial)
                    if sc < now and (best is None or sc < best[0]):
                        best = (sc, i, d, s, trial)
        if best is None:
            break
        _, i, d, s, load = best
        sizes[i], starts[i] = d, s
    return DynamicPlan(plan.world, plan.lengths, tuple(sizes), tuple(starts))


def plan_pack(lengths: Sequence[int], world: int, *, min_size: int = 1, cost: Optional[CostModel] = None,
              min_size_name: str = "min_size", min_gain: float = 0.0) -> DynamicPlan:
    """The dynamic-SP plan of a pack (see the module docstring). lengths: tokens per sample (positive ints);
    world: P; min_size: the smallest SP size a sample may get (a divisor of P; Megatron-LM's
    --min-dynamic-context-parallel-size, named by ``min_size_name`` in errors); min_gain: uniform SP unless the best
    plan's busiest rank is at least this fraction lighter (0: the lightest plan)."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths or any(n < 1 for n in lengths):
        raise SPConfigError(f"dynamic SP: every sample needs at least one token (lengths {list(lengths)})")
    if world < 1 or isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1 or world % min_size:
        raise SPConfigError(f"{min_size_name}={min_size!r} is invalid: use a divisor of the sequence-parallel size "
                            f"{world} ({', '.join(map(str, divisors(world)))})")
    cost = cost or CostModel()
    allowed = tuple(d for d in divisors(world) if d >= min_size)
    mean = sum(cost.compute(n, 1) for n in lengths) / world
    candidates = []
    for f in CAPS:
        sizes = tuple(_fits(n, allowed, mean * f, cost) for n in lengths)
        bimodal = tuple(allowed[0] if d == allowed[0] else world for d in sizes)  # small samples whole, others on all
        for choice in (sizes, bimodal):
            plan = _refine(_place(lengths, choice, world, cost), allowed, cost, rounds=4 * len(lengths))
            if all(plan.samples_on(r) for r in range(world)) and plan not in candidates:
                candidates.append(plan)
    uniform = DynamicPlan(world, lengths, (world,) * len(lengths), (0,) * len(lengths))
    candidates.append(uniform)
    best = min(candidates, key=lambda p: (max(p.loads(cost)), p.exchanged_tokens()))
    if max(best.loads(cost)) > (1 - min_gain) * max(uniform.loads(cost)):
        return uniform
    return best
