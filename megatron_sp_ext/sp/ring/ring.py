"""Ring attention and TASP multi-ring attention (forward and backward) as one autograd Function.

Q stays on its rank; K|V blocks travel. ``variant="ring"`` moves the whole local K|V block around
one ring; ``variant="tasp"`` splits it into one slot per Hamiltonian cycle of K_P* and advances all
rings at once (TASP Algorithm 3) as one batch of point-to-point sends/receives. Each step's exchange
is started before that step's kernels and waited after them, into the second of two preallocated
buffers (double buffering); with NCCL it runs on NCCL's own stream, so the rotation overlaps the
local kernels, forward and backward. Partial results merge by log-sum-exp in fp32 (fp64 for fp64).
Backward recomputes each kv block against the final out/lse; each step's partial dK|dV (kernel dtype)
goes straight to its kv block's home, which accumulates in fp32 in step order, and the last step runs
per head chunk so only one chunk's transfer is exposed (``rotation``: byte/time model, and the
previous traveling-accumulator schedule kept as a baseline).

What each step computes comes from ``schedule``: tokens in compute order, kernel calls on contiguous
slices (the zigzag diagonal is one causal call, other steps one unmasked call on a half), and for
causal TASP a per-step buffer layout that keeps every step at <= 2 calls. Local kernels are the
backend's ``forward_lse``/``backward_lse`` (backend "auto": cuDNN where it runs).

Under a block mask (``block_mask=``) the same plan, Function, rotation and transports run: the step's calls are made
per slot (a call never reads a slot whose hop was skipped), each gets its ``TileSlice`` (``tiles=`` of the
backend's kernels, whichever kernel runs it), and ``skips``' tables (built once per plan, identical on every rank)
drop the calls that select nothing, the (step, slot) kv blocks left without calls, the K|V hops no later rank needs
and the dK|dV partials of kv blocks that did not run. Point-to-point batches: ``comm.p2p``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist

from ... import modes
from ...attention import block_sparse
from ...attention.backends import LocalAttention
from ...attention.lse import acc_dtype, merge_into
from ...attention.tiles import TileSlice
from ...comm.p2p import wait_handles
from ...config import DEFAULT_PLACEMENT
from ...errors import SPConfigError
from ...topology.hamiltonian import RoutingTables, routing_tables
from ..heads import split_more_first
from ..problem import VARIANTS, AttentionProblem, problem_from_keywords  # VARIANTS: re-exported (sp.ring, sparse)
from .rotation import (backward_steps, check_travel, dkv_schedule_from_env, kv_view as _kv_view, sel_rows as _sel,
                       pair_ops, start_ops, tiles_kw)
from .skips import SkipTables, TileSpec, skip_tables
from .schedule import Item, ab_layout, is_identity, permute_rows, sorted_order, step_items


@lru_cache(maxsize=None)
def _single_ring(n: int) -> RoutingTables:
    cyc = (tuple(range(n)),)
    nxt = (tuple((r + 1) % n for r in range(n)),)
    prv = (tuple((r - 1) % n for r in range(n)),)
    out_ring = tuple(tuple(0 if p == (r + 1) % n and n > 1 else -1 for p in range(n)) for r in range(n))
    in_ring = tuple(tuple(0 if p == (r - 1) % n and n > 1 else -1 for p in range(n)) for r in range(n))
    return RoutingTables(n, cyc, nxt, prv, out_ring, in_ring)


def _local_runs(runs, lo: int, n: int, valid: Optional[int]) -> list[tuple[int, int, int]]:
    """Global (start, len, offset from ``lo``) of local rows [lo, lo+n) of a kv block with global ``runs``,
    keys at global positions >= ``valid`` dropped."""
    out, row = [], 0
    for a, ln in runs:
        s, e = max(lo, row), min(lo + n, row + ln)
        if s < e:
            g, length = a + (s - row), e - s
            if valid is not None:
                length = min(length, valid - g)
            if length > 0:
                out.append((g, length, s - lo))
        row += ln
    return out


@dataclass(eq=False)
class RingPlan:
    """One rank's schedule (see ``schedule``). ``mode``: "plain" (local order, one segment per slot),
    "ab" (causal tasp_zigzag: zigzag compute order, two segments per slot, per-step layout) or
    "sorted" (one rank: q and k/v sorted by position, no exchange)."""

    group_ref: "Optional[weakref.ReferenceType]"  # the ring's group, weakly: a cached plan must not keep it alive
    rank: int
    world: int
    variant: str
    routing: RoutingTables
    slot_off: tuple
    slot_len: tuple
    q_runs: tuple      # global (start, len) runs of this rank's queries, local order
    kv_runs: tuple     # kv_runs[o]: runs of ring rank o's keys/values, local order
    causal: bool
    scale: float
    backend: LocalAttention
    kv_valid_len: Optional[int] = None  # keys at global position >= this are padding (never attended)
    mode: str = "plain"
    q_moves: tuple = ()   # (local_row, compute_row, len) of the queries
    kv_moves: tuple = ()  # the same for this rank's k/v into the step-0 buffer
    cu_seqlens: Optional[tuple] = None  # packed samples: cumulative lengths; q and k interact only within one
    tiles: Optional[TileSpec] = None  # a block mask: calls that select nothing, and hops nobody needs, are skipped
    q_runs_of: tuple = ()  # q_runs_of[o]: ring rank o's query runs (masked plans build every rank's tables)
    cache: dict = field(default_factory=dict)

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return None if self.group_ref is None else self.group_ref()

    def origins(self, step: int, rank: Optional[int] = None) -> tuple[int, ...]:
        r = self.rank if rank is None else rank
        return tuple(self.routing.origin(i, r, step) for i in range(len(self.slot_len)))

    def segments(self, step: int, rank: Optional[int] = None) -> tuple:
        """Per slot: ((buffer_row, slot_local_row, len), ...) of ``rank``'s buffer at ``step`` (step = world: home)."""
        r = self.rank if rank is None else rank
        if self.mode != "ab":
            return tuple(((o, o, n),) for o, n in zip(self.slot_off, self.slot_len))
        u = self.slot_len[0] // 2
        rows = ab_layout(self.origins(step % self.world, r), r, u)
        return tuple(((pr, off, u), (mr, off + u, u)) for (pr, mr), off in zip(rows, self.slot_off))

    def q_moves_of(self, rank: int) -> tuple:
        """(local_row, compute_row, len) of ``rank``'s queries (this rank's: ``q_moves``)."""
        if rank == self.rank or self.mode == "plain":
            return self.q_moves if rank == self.rank else ()
        return sorted_order(tuple(self.q_runs_of[rank]))[0]

    def q_compute_runs(self, rank: Optional[int] = None) -> list[tuple[int, int, int]]:
        """(global start, len, compute row) of ``rank``'s queries."""
        r = self.rank if rank is None else rank
        local, row = [], 0
        for a, n in (self.q_runs if r == self.rank else self.q_runs_of[r]):
            local.append((a, n, row))
            row += n
        dest = {lr: cr for lr, cr, _ in self.q_moves_of(r)}
        return [(a, n, dest.get(lr, lr)) for a, n, lr in local]

    def slot_kv_runs(self, step: int, rank: Optional[int] = None, valid: bool = True) -> list[list[tuple]]:
        """Per slot: (global start, len, buffer row) of the keys ``rank`` holds at ``step`` (``valid``: keys at
        positions >= kv_valid_len dropped)."""
        r = self.rank if rank is None else rank
        cut = self.kv_valid_len if valid else None
        if self.mode == "sorted":
            kvr, row, local = [], 0, []
            for a, n in self.kv_runs[0]:
                local.append((a, n, row))
                row += n
            dest = {lr: cr for lr, cr, _ in self.kv_moves}
            for a, n, lr in local:
                kvr += [(g, ln, dest.get(lr, lr) + off) for g, ln, off in _local_runs(((a, n),), 0, n, cut)]
            return [kvr]
        out = []
        for i, o in enumerate(self.origins(step, r)):
            out.append([(g, ln, brow + off) for brow, lrow, n in self.segments(step, r)[i]
                        for g, ln, off in _local_runs(self.kv_runs[o], lrow, n, cut)])
        return out

    def slot_calls(self, step: int, rank: Optional[int], device) -> list[list[Item]]:
        """Per slot: the kernel calls of ``rank`` at ``step`` on that slot's keys (masked plans: one slot's
        kv block per call, so a call never reads a slot whose hop was skipped)."""
        qr = self.q_compute_runs(rank)
        return [step_items(qr, kvr, self.causal, device, self.cu_seqlens)
                for kvr in self.slot_kv_runs(step, rank)]

    def step_tiles(self, step: int, rank: Optional[int], block_mask: torch.Tensor) -> TileSlice:
        """The mask's view of ``rank``'s whole step: its queries (compute order) x its K|V buffer rows (positions on
        the host, as ``TileSlice`` keeps them)."""
        q_pos = _positions((g, n, row) for g, n, row in self.q_compute_runs(rank))
        kv_pos = _positions(run for slot in self.slot_kv_runs(step, rank, valid=False) for run in slot)
        return TileSlice(block_mask, self.tiles.tile, q_pos, kv_pos, self.tiles.heads, self.kv_valid_len)

    def skips(self) -> SkipTables:
        """The mask's skip tables (``skips``), built once per plan on the host for every rank."""
        if "skips" not in self.cache:
            sel = self.tiles.selection_mask()

            def selected(step: int, r: int) -> list:
                base = self.step_tiles(step, r, sel)
                return [[j for j, it in enumerate(calls) if base.rows(it.q_rows, it.kv_rows).selects_any(self.causal)]
                        for calls in self.slot_calls(step, r, "cpu")]
            self.cache["skips"] = skip_tables(self.world, self.routing.nxt, self.routing.prv, selected)
        return self.cache["skips"]

    def items(self, step: int, device) -> list[Item]:
        """Kernel calls of ``step`` (cached); masked plans: the calls that select anything, each with its
        ``TileSlice``."""
        key = ("items", step, str(device))
        if key not in self.cache:
            if self.tiles is not None:
                keep = self.skips().keep
                base = self.step_tiles(step, None, self.mask_on(device))
                on_host = self.slot_calls(step, None, "cpu")   # the same calls, rows on the host: the slices' rows
                its = [Item(it.q_rows, it.kv_rows, it.causal, it.mask, base.rows(h.q_rows, h.kv_rows))
                       for i, (calls, host) in enumerate(zip(self.slot_calls(step, None, device), on_host))
                       for j, (it, h) in enumerate(zip(calls, host)) if j in keep[i][self.rank][step]]
            elif not self.causal and self.kv_valid_len is None and self.cu_seqlens is None:
                its = [Item(slice(None), slice(None))]
            else:
                its = step_items(self.q_compute_runs(), [run for slot in self.slot_kv_runs(step) for run in slot],
                                 self.causal, device, self.cu_seqlens)
            self.cache[key] = its
        return self.cache[key]

    def mask_on(self, device) -> torch.Tensor:
        """The plan's block mask on ``device`` (one copy per device)."""
        key = ("mask", str(device))
        if key not in self.cache:
            self.cache[key] = self.tiles.block_mask.to(device)
        return self.cache[key]

    def runs(self, slot: int, step: int, rank: Optional[int] = None) -> bool:
        """Whether ``rank`` runs any call on slot ``slot`` at ``step`` (always, without a mask)."""
        return self.tiles is None or self.skips().runs(slot, self.rank if rank is None else rank, step)

    def hop(self, slot: int, step: int, rank: Optional[int] = None) -> tuple[bool, bool]:
        """(sends, receives) of ``rank``'s slot ``slot`` after ``step`` (both, without a mask)."""
        if self.tiles is None:
            return True, True
        r, t = self.rank if rank is None else rank, self.skips()
        return t.sends(slot, r, step), t.receives(slot, r, step)

    def transfer(self, step: int, rank: Optional[int] = None) -> list[tuple[str, int, int, int]]:
        """Point-to-point ops of ``rank`` (default: this rank) moving the slots from the layout of ``step`` to
        that of ``step + 1``: (kind, group rank of the peer, buffer row, rows), slot by slot; touching segments
        on both ends go as one; under a mask only the hops of ``hop``. ``start`` sends them as one ``comm.p2p``
        batch."""
        r = self.rank if rank is None else rank
        key = ("transfer", step, r)
        if key not in self.cache:
            ops: list = []
            rt = self.routing
            for i in range(len(self.slot_len)):
                sends, receives = self.hop(i, step, r)
                for kind, peer, mine, theirs in (
                        ("send", rt.nxt[i][r], self.segments(step, r)[i], self.segments(step + 1, rt.nxt[i][r])[i]),
                        ("recv", rt.prv[i][r], self.segments(step + 1, r)[i], self.segments(step, rt.prv[i][r])[i])):
                    if sends if kind == "send" else receives:
                        ops += pair_ops(kind, peer, mine, theirs)
            self.cache[key] = ops
        return self.cache[key]

    def start(self, step: int, src: torch.Tensor, dst: torch.Tensor) -> list:
        """Begin the step -> step+1 transfer of ``src`` into ``dst`` (returns works for ``wait``)."""
        return start_ops(self, "kv", step, lambda s_, r: self.transfer(s_, r), src, dst)

    @staticmethod
    def wait(works) -> None:
        wait_handles(works)

    def tile_heads(self, heads: slice) -> slice:
        """The global query heads (mask rows) of ``heads``, a slice of this plan's q heads."""
        base = self.tiles.heads.start or 0
        return slice(base + (heads.start or 0), base + heads.stop)


def _positions(runs) -> torch.Tensor:
    """Global position of each row (a host tensor) given (global start, len, row) runs covering the rows."""
    runs = sorted(runs, key=lambda run: run[2])
    return torch.cat([torch.arange(g, g + n) for g, n, _ in runs]) if runs else torch.empty(0, dtype=torch.long)


def _fill_kv(buf: torch.Tensor, k_bhsd, v_bhsd, moves) -> None:
    """This rank's k/v (local order) into the step-0 buffer rows (compute order): one copy."""
    if not moves or is_identity(moves):
        buf[:, 0].copy_(k_bhsd.permute(2, 0, 1, 3))
        buf[:, 1].copy_(v_bhsd.permute(2, 0, 1, 3))
        return
    for lr, cr, n in moves:
        buf[cr:cr + n, 0].copy_(k_bhsd[:, :, lr:lr + n].permute(2, 0, 1, 3))
        buf[cr:cr + n, 1].copy_(v_bhsd[:, :, lr:lr + n].permute(2, 0, 1, 3))


def _kv_buffers(k_bhsd, v_bhsd, plan: RingPlan):
    b, hkv, s_kv, d = k_bhsd.shape
    cur = torch.empty(s_kv, 2, b, hkv, d, dtype=k_bhsd.dtype, device=k_bhsd.device)
    _fill_kv(cur, k_bhsd, v_bhsd, plan.kv_moves)
    return cur, (torch.empty_like(cur) if plan.world > 1 else None)


def _all_rows(rows, n: int) -> bool:
    return isinstance(rows, slice) and (rows.start or 0) == 0 and (rows.stop is None or rows.stop == n)


def forward_compute_order(q_c, k_bhsd, v_bhsd, plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(acc, lse) of the queries ``q_c`` (compute order) over every ring rank's keys; acc dtype fp32/fp64.
    Rows that see no key keep out = 0 and lse = -inf."""
    b, h, s_q, d = q_c.shape
    cur, nxt = _kv_buffers(k_bhsd, v_bhsd, plan)
    acc = torch.zeros(b, h, s_q, d, dtype=acc_dtype(q_c), device=q_c.device)
    lse = torch.full((b, h, s_q), float("-inf"), dtype=acc.dtype, device=q_c.device)
    for step in range(plan.world):
        works = plan.start(step, cur, nxt) if step < plan.world - 1 else []
        for n, it in enumerate(plan.items(step, q_c.device)):
            k_, v_ = _kv_view(cur, it.kv_rows)
            o, l_ = plan.backend.forward_lse(_sel(q_c, it.q_rows, 2), k_, v_, causal=it.causal,
                                             softmax_scale=plan.scale, mask=it.mask, **tiles_kw(it.tiles))
            first = step == 0 and n == 0 and it.mask is None and it.tiles is None and plan.kv_valid_len is None
            if first and _all_rows(it.q_rows, s_q):
                acc.copy_(o)   # the first result of every row (each sees itself): the merge would give exactly this
                lse.copy_(l_)
            elif isinstance(it.q_rows, slice):
                merge_into(acc[:, :, it.q_rows], lse[:, :, it.q_rows], o, l_)
            else:
                a, l0 = acc.index_select(2, it.q_rows), lse.index_select(2, it.q_rows)
                merge_into(a, l0, o, l_)
                acc.index_copy_(2, it.q_rows, a)
                lse.index_copy_(2, it.q_rows, l0)
        if works:
            plan.wait(works)
            cur, nxt = nxt, cur
    return acc, lse


def backward_compute_order(dout_c, q_c, k_bhsd, v_bhsd, out_c, lse_c, plan: RingPlan):
    """Gradients given the FINAL out/lse (compute order). Returns dq (compute order, acc dtype) and the
    dK|dV buffer [S_kv, 2, B, Hkv, D] of this rank's own kv block in step-0 (compute) order. The dK|dV route
    and the last step's head chunks: ``rotation`` (SPX_RING_DKV, SPX_RING_DKV_CHUNKS)."""
    cur, nxt = _kv_buffers(k_bhsd, v_bhsd, plan)
    return backward_steps(dout_c, q_c, cur, nxt, out_c, lse_c, plan, dkv_schedule_from_env())


def _dkv_local(dkv: torch.Tensor, plan: RingPlan):
    """dK, dV (bhsd, local order) from the home dK|dV buffer (compute order)."""
    dk, dv = dkv[:, 0].permute(1, 2, 0, 3), dkv[:, 1].permute(1, 2, 0, 3)
    if plan.kv_moves and not is_identity(plan.kv_moves):
        dk, dv = permute_rows(dk, plan.kv_moves, 2, inverse=True), permute_rows(dv, plan.kv_moves, 2, inverse=True)
    return dk, dv


def ring_forward(q_bhsd, k_bhsd, v_bhsd, plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the keys of every ring rank.

    q: [B, H, S_q, D]; k, v: [B, Hkv, S_kv, D] (this rank's kv block, local order). Returns (out, lse) in
    the accumulator dtype (fp32, or fp64 for fp64), local order. Rows that see no key: out 0, lse -inf.
    """
    acc, lse = forward_compute_order(permute_rows(q_bhsd, plan.q_moves, 2), k_bhsd, v_bhsd, plan)
    return permute_rows(acc, plan.q_moves, 2, inverse=True), permute_rows(lse, plan.q_moves, 2, inverse=True)


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan):
    """Gradients of ``ring_forward`` given the FINAL out (q dtype) and lse of the query rows (local order).

    Returns (dq [B,H,S_q,D], dk, dv [B,Hkv,S_kv,D] of this rank's own kv block) in the accumulator dtype.
    """
    mv = plan.q_moves
    dq, dkv = backward_compute_order(permute_rows(dout.contiguous(), mv, 2), permute_rows(q, mv, 2), k, v,
                                     permute_rows(out, mv, 2), permute_rows(lse, mv, 2), plan)
    dk, dv = _dkv_local(dkv, plan)
    return permute_rows(dq, mv, 2, inverse=True), dk, dv


class _RingFn(torch.autograd.Function):
    """``ring_forward`` / ``ring_backward`` as one autograd node: q [B, H, S_q, D], k, v [B, Hkv, S_kv, D]; dense
    or under the plan's block mask, ring or TASP."""

    @staticmethod
    def forward(ctx, q_bhsd, k_bhsd, v_bhsd, plan: RingPlan):
        if dkv_schedule_from_env().route == "travel":
            check_travel(plan)
        acc, lse = ring_forward(q_bhsd, k_bhsd, v_bhsd, plan)
        out = acc.to(q_bhsd.dtype)
        ctx.save_for_backward(q_bhsd, k_bhsd, v_bhsd, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.plan)
        ctx.plan = None  # nothing of the call keeps its group alive once the gradients exist
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None




@dataclass(frozen=True)
class RingSpec:
    """What one ring plan depends on besides its group and block mask (hashable: plans are cached by it).
    kv_runs[o] = runs of ring rank o; cu_seqlens: packed samples' cumulative lengths (queries see keys of their own
    sample only); heads: (start, stop) of the global query heads q carries (a masked plan's mask rows); q_runs_of[o]:
    ring rank o's query runs (default kv_runs)."""

    variant: str
    s_loc: int
    q_runs: tuple
    kv_runs: tuple
    causal: bool
    scale: float
    backend: Optional[LocalAttention]
    balanced_slots: bool = False
    kv_valid_len: Optional[int] = None
    cu_seqlens: Optional[tuple] = None
    tile: int = block_sparse.DEFAULT_TILE_SIZE
    heads: tuple = (None, None)
    q_runs_of: Optional[tuple] = None

    @staticmethod
    def of(**fields) -> "RingSpec":
        """A spec from keywords (runs as any sequences, ``heads`` as a slice, ``block_size`` for ``tile``)."""
        heads = fields.pop("heads", slice(None))
        if "block_size" in fields:
            fields["tile"] = fields.pop("block_size")
        for name in ("q_runs", "kv_runs", "q_runs_of"):
            if fields.get(name) is not None:
                fields[name] = tuple(tuple(x) if isinstance(x, list) else x for x in fields[name])
        return RingSpec(heads=(heads.start, heads.stop) if isinstance(heads, slice) else tuple(heads), **fields)


_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> {RingSpec: RingPlan} (no mask)
_NO_GROUP: dict = {}


def make_ring_plan(group, spec: Optional[RingSpec] = None, *, block_mask: Optional[torch.Tensor] = None,
                   owner=None, **fields) -> RingPlan:
    """Plan for one ring group (None or size 1 = no exchange) of ``spec`` (or its ``fields`` as keywords).
    block_mask (checked, [H or 1, T, T]): the skips of ``skips`` (a host copy of the mask, once per plan).
    Plans without a mask are cached per group by their spec; plans with one on ``owner`` (the call's
    ``AttentionProblem``: ``cached``), which lives as long as the mask it was built with (None: not cached)."""
    spec = spec if spec is not None else RingSpec.of(**fields)
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    ref = weakref.ref(group) if group is not None else None
    if block_mask is not None:
        def build() -> RingPlan:   # the skip tables' host copy of the mask (one sync); the kernels use the caller's
            tiles = TileSpec(block_mask.detach().to("cpu", copy=True), spec.tile, slice(*spec.heads))
            plan = build_ring_plan(ref, rank, world, spec, tiles)
            plan.cache[("mask", str(block_mask.device))] = block_mask.detach()   # device mask (no copy back)
            return plan
        return build() if owner is None else owner.cached(("ring_plan", group, spec), build)
    plans = _PLANS.setdefault(group, {}) if group is not None else _NO_GROUP
    if spec not in plans:
        if len(plans) > 256:
            plans.clear()
        plans[spec] = build_ring_plan(ref, rank, world, spec, None)
    return plans[spec]


def build_ring_plan(group_ref, rank: int, world: int, spec: RingSpec, tiles: Optional[TileSpec]) -> RingPlan:
    """The ``RingPlan`` of ring rank ``rank`` of ``world`` for ``spec`` (uncached; ``make_ring_plan`` caches it)."""
    variant, s_loc, q_runs, kv_runs = spec.variant, spec.s_loc, spec.q_runs, spec.kv_runs
    q_runs_of = tuple(kv_runs) if spec.q_runs_of is None else tuple(spec.q_runs_of)
    if tiles is None:
        q_runs_of = ()
    if modes.get(variant).multi_ring and world > 1:
        rt = routing_tables(world)
        m = len(rt.cycles)
        if spec.balanced_slots:  # tasp_zigzag: ring i carries [piece, mirror] = 2 * (s_loc / 2m) tokens
            lens = (s_loc // m,) * m
        else:
            lens = split_more_first(s_loc, m)
            if min(lens) == 0:
                raise SPConfigError(f"tasp needs at least {m} tokens per rank, got {s_loc}")
    else:
        rt, lens = _single_ring(world), (s_loc,)
    offs = tuple(sum(lens[:i]) for i in range(len(lens)))
    mode, q_moves, kv_moves = "plain", (), ()
    if world == 1:
        mode = "sorted"
        q_moves, _ = sorted_order(tuple(q_runs))
        kv_moves, _ = sorted_order(tuple(kv_runs[0]))
    elif spec.causal and modes.get(variant).multi_ring and spec.balanced_slots:
        mode = "ab"
        q_moves, _ = sorted_order(tuple(q_runs))
        kv_moves, _ = sorted_order(tuple(kv_runs[rank]))
    plan = RingPlan(group_ref, rank, world, variant, rt, offs, tuple(lens), tuple(q_runs), tuple(kv_runs),
                    spec.causal, spec.scale, spec.backend, spec.kv_valid_len, mode, q_moves, kv_moves,
                    spec.cu_seqlens, tiles, tuple(q_runs_of))
    if mode == "ab":  # the step-0 layout must be the sorted order the k/v were filled in
        filled = {lr: cr for lr, cr, _ in kv_moves}
        for slot in plan.segments(0):
            for brow, lrow, _ in slot:
                assert filled.get(lrow) == brow, "tasp_zigzag layout does not match its sorted order"
    return plan


class RingBackend(block_sparse.BlockSparseBackend):
    """Ring/TASP over ``group`` as a local-attention backend (hybrid meshes, torus pairs).

    Queries and keys of this rank cover global runs ``q_runs``; ``kv_runs[o]`` are ring rank o's.
    ``cu_seqlens`` (packed samples, tuple of cumulative lengths): attention only within each sample.
    ``problem``: the caller's ``AttentionProblem`` when it has a block mask (over a ``seq_len`` sequence): the ring
    runs under the mask with its skips, and its plans (their host copy of the mask and skip tables) are kept on the
    problem, so the backends a call builds reuse them for every later call of the same problem; ``q_runs_of[o]``:
    ring rank o's query runs (default ``kv_runs``); ``heads``: the global query heads of q (``attend`` passes them per
    Ulysses chunk)."""

    def __init__(self, group, variant: str, q_runs, kv_runs, inner: LocalAttention,
                 kv_valid_len: Optional[int] = None, cu_seqlens: Optional[tuple] = None, *,
                 problem: Optional[AttentionProblem] = None, seq_len: int = 0, q_runs_of: Optional[tuple] = None,
                 heads: slice = slice(None)) -> None:
        self.group, self.variant, self.q_runs, self.kv_runs, self.inner = group, variant, q_runs, kv_runs, inner
        self.kv_valid_len, self.cu_seqlens = kv_valid_len, cu_seqlens
        self.problem = problem if problem is not None and problem.block_mask is not None else None
        self.seq_len, self.q_runs_of, self.heads = seq_len, q_runs_of, heads
        self.name = f"{variant}[{inner.name}]"
        self._plans: dict = {}

    def plan(self, k_bhsd: torch.Tensor, causal: bool, scale: float, heads: Optional[slice] = None) -> RingPlan:
        heads = self.heads if heads is None else heads
        key = (k_bhsd.shape[2], causal, scale, heads.start, heads.stop)
        if key not in self._plans:   # the shapes were agreed over the mesh by the caller's problem
            pb = self.problem
            self._plans[key] = make_ring_plan(
                self.group, variant=self.variant, s_loc=k_bhsd.shape[2], q_runs=self.q_runs, kv_runs=self.kv_runs,
                causal=causal, scale=scale, backend=self.inner, kv_valid_len=self.kv_valid_len,
                cu_seqlens=self.cu_seqlens, block_mask=None if pb is None else pb.mask_on(k_bhsd.device),
                tile=block_sparse.DEFAULT_TILE_SIZE if pb is None else pb.tile, heads=heads,
                q_runs_of=self.q_runs_of, owner=pb)
        return self._plans[key]

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return _RingFn.apply(q, k, v, self.plan(k, causal, softmax_scale))

    def attend(self, q_bhsd, k_bhsd, v_bhsd, *, heads: slice, causal: bool, softmax_scale: float) -> torch.Tensor:
        return _RingFn.apply(q_bhsd, k_bhsd, v_bhsd, self.plan(k_bhsd, causal, softmax_scale, heads))

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None, tiles=None):
        assert mask is None and tiles is None
        return ring_forward(q, k, v, self.plan(k, causal, softmax_scale))

    def backward_lse(self, do, q, k, v, out, lse, *, causal, softmax_scale, mask=None, tiles=None):
        assert mask is None and tiles is None
        return ring_backward(do, q, k, v, out, lse, self.plan(k, causal, softmax_scale))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   problem: Optional[AttentionProblem] = None, *, variant: str = "ring",
                   backend: "str | LocalAttention" = "auto", **keywords) -> torch.Tensor:
    """Ring or TASP attention over ``group``. q: [B, S_loc, H, D] (or sbhd); k, v: Hkv heads.

    problem: the ``AttentionProblem`` built once by the caller, or its settings as keywords (causal, placement,
    kv_valid_len, cu_seqlens, block_mask, tile / block_size, softmax_scale, layout): one problem per call.

    ``placement`` says which tokens each rank holds (default ``DEFAULT_PLACEMENT``, "contiguous", as
    ``shard_sequence``); causal load balance is one keyword away: "zigzag" (ring) or "tasp_zigzag" (tasp),
    passed the same to ``shard_sequence(x, group, placement=...)``.
    ``kv_valid_len``: keys at global positions >= kv_valid_len are padding and get no attention.
    Local attention uses the backend's log-sum-exp kernels (``forward_lse`` / ``backward_lse``).
    cu_seqlens: packed variable-length samples (B=1): 1-D int tensor [n_samples + 1] of the samples' cumulative
    lengths, the same on every rank; shards from ``shard_sequence(x, group, placement=..., cu_seqlens=)`` with
    placement "contiguous" or "zigzag" ("tasp_zigzag" does not take packed samples). Each sample attends only within itself; samples that do not divide by the placement's
    divisor are padded as in ``ulysses_attention``; not combined with kv_valid_len.
    block_mask: block-sparse attention (attention/block_sparse.py), bool [H or 1, T, T], T = ceil(S / block_size),
    over the full sequence in global order, the same on every rank: the same ring or TASP multi-ring (any
    placement; AND causal, AND kv_valid_len) runs only the kernel calls whose tiles select anything (each call gets
    its ``TileSlice``), skips the (step, slot) kv blocks with none and the K|V hops no later rank needs
    (``skips``). Not with cu_seqlens.
    """
    problem, _ = problem_from_keywords("ring_attention", problem, keywords)
    pr = problem.bind(q, k, v, group, what="ring_attention", mode=variant if variant in VARIANTS else "ring",
                      backend=backend, variant=("variant", variant), p2p=(group,))
    causal, placement = pr.causal, pr.placement
    plan = make_ring_plan(group, variant=variant, s_loc=pr.s_loc, q_runs=pr.runs(pr.rank),
                          kv_runs=tuple(pr.runs(o) for o in range(pr.world)), causal=causal, scale=pr.scale,
                          backend=pr.backend, balanced_slots=placement == "tasp_zigzag" and pr.packed is None,
                          kv_valid_len=pr.kv_valid_len, cu_seqlens=pr.segments, block_mask=pr.block_mask,
                          tile=pr.block_size, owner=problem)
    return pr.from_kernel(_RingFn.apply(*pr.to_kernel(q, k, v), plan))
