"""(Test oracle: the ring/TASP implementation before the overlapped rewrite, kept so tests can check that
the new path equals it where the kernels are the same. Not used by the package.)

Ring attention and TASP multi-ring attention (forward and backward) as one autograd Function.

Q stays on its rank; K|V blocks travel. ``variant="ring"`` moves the whole local K|V block around
one ring (send/recv, next block in flight while the current one is attended). ``variant="tasp"``
splits it into one slot per Hamiltonian cycle of K_P* and advances all rings with ONE all_to_all
per step driven by precomputed routing tables (TASP Algorithm 3). Partial results merge by
log-sum-exp in fp32 (fp64 for fp64 inputs). Backward recomputes each block against the final
out/lse; dK|dV accumulators (same dtype) travel with their blocks and take one extra hop home.

Causal masks come from global token positions of the placement: a (q run, kv run) pair is full,
skipped, diagonal-causal or (misaligned) explicitly masked. With "zigzag" (ring) or "tasp_zigzag"
(tasp) every rank does the same work at every step. Buffers: K|V slots are [S_kv, 2, B, Hkv, D]
so a block is one contiguous slice and K, V are zero-copy bhsd views.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist

from megatron_sp_ext.attention.backends import LocalAttention, get_backend
from megatron_sp_ext.attention.lse import acc_dtype, merge_into
from megatron_sp_ext.comm.multiring import MultiRingExchange
from megatron_sp_ext.config import LAYOUTS
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.topology.hamiltonian import RoutingTables, routing_tables
from megatron_sp_ext.sp.heads import split_more_first
from megatron_sp_ext.sp.placement import pieces
from megatron_sp_ext.sp.ulysses import check_same_shape_across_ranks

VARIANTS = ("ring", "tasp")


@lru_cache(maxsize=None)
def _single_ring(n: int) -> RoutingTables:
    cyc = (tuple(range(n)),)
    nxt = (tuple((r + 1) % n for r in range(n)),)
    prv = (tuple((r - 1) % n for r in range(n)),)
    out_ring = tuple(tuple(0 if p == (r + 1) % n and n > 1 else -1 for p in range(n)) for r in range(n))
    in_ring = tuple(tuple(0 if p == (r - 1) % n and n > 1 else -1 for p in range(n)) for r in range(n))
    return RoutingTables(n, cyc, nxt, prv, out_ring, in_ring)


@dataclass
class _Item:
    """One attention call: q rows x kv buffer rows, with a mask kind."""

    q_rows: Optional[torch.Tensor]   # None = all rows, else int64 index
    kv_rows: Optional[tuple]         # None = whole buffer, (start, len) contiguous, or int64 index tensor
    causal: bool = False
    mask: Optional[torch.Tensor] = None


@dataclass
class RingPlan:
    group: dist.ProcessGroup
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
    items_cache: dict = field(default_factory=dict)

    def slot_runs(self, origin: int, slot: int) -> list[tuple[int, int, int]]:
        """Global (start, len, buffer_row) runs of ``slot`` when it carries rank ``origin``'s block."""
        lo, n = self.slot_off[slot], self.slot_len[slot]
        runs, row = [], 0
        for a, ln in self.kv_runs[origin]:
            s, e = max(lo, row), min(lo + n, row + ln)
            if s < e:
                g, length = a + (s - row), e - s
                if self.kv_valid_len is not None:
                    length = min(length, self.kv_valid_len - g)
                if length > 0:
                    runs.append((g, length, s))
            row += ln
        return runs

    def origins(self, step: int) -> tuple[int, ...]:
        return tuple(self.routing.origin(i, self.rank, step) for i in range(len(self.slot_len)))

    def items(self, step: int, device) -> list[_Item]:
        """Work of one step (cached by the slot origins)."""
        key = self.origins(step)
        if key in self.items_cache:
            return self.items_cache[key]
        if not self.causal and self.kv_valid_len is None:
            its = [_Item(None, None)]
        else:
            its = self._masked_items(key, device)
        self.items_cache[key] = its
        return its

    def _masked_items(self, origins, device) -> list[_Item]:
        qruns, row = [], 0
        for a, ln in self.q_runs:
            qruns.append((a, ln, row))
            row += ln
        n_q = row
        kvruns = [run for i, o in enumerate(origins) for run in self.slot_runs(o, i)]
        groups: dict = {}
        its = []
        for ka, kl, krow in kvruns:
            full = []
            for qa, ql, qrow in qruns:
                if not self.causal or ka + kl <= qa:
                    full.append((qrow, ql))
                elif ka >= qa + ql:
                    continue
                elif ka == qa and kl == ql:
                    its.append(_Item(_idx([(qrow, ql)], n_q, device), (krow, kl), causal=True))
                else:  # misaligned runs: explicit mask
                    qpos = torch.arange(qa, qa + ql, device=device)
                    kpos = torch.arange(ka, ka + kl, device=device)
                    its.append(_Item(_idx([(qrow, ql)], n_q, device), (krow, kl),
                                     mask=qpos[:, None] >= kpos[None, :]))
            if full:
                groups.setdefault(tuple(full), []).append((krow, kl))
        for qset, kvs in groups.items():
            its.append(_Item(_idx(list(qset), n_q, device), _kv_rows(kvs, device)))
        return its


def _idx(runs, total, device) -> Optional[torch.Tensor]:
    runs = sorted(runs)
    if len(runs) == 1 and runs[0] == (0, total):
        return None
    return torch.cat([torch.arange(r, r + n, device=device) for r, n in runs])


def _kv_rows(runs, device):
    runs = sorted(runs)
    merged = []
    for r, n in runs:
        if merged and merged[-1][0] + merged[-1][1] == r:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((r, n))
    if len(merged) == 1:
        return merged[0]
    return torch.cat([torch.arange(r, r + n, device=device) for r, n in merged])


def _kv_view(buf: torch.Tensor, rows):
    """K, V (bhsd) of ``rows`` of a [S, 2, B, H, D] buffer."""
    if rows is None:
        sel = buf
    elif isinstance(rows, tuple):
        sel = buf.narrow(0, rows[0], rows[1])
    else:
        sel = buf.index_select(0, rows)
    return sel[:, 0].permute(1, 2, 0, 3), sel[:, 1].permute(1, 2, 0, 3)


def _kv_add(acc: torch.Tensor, rows, dk: torch.Tensor, dv: torch.Tensor) -> None:
    g = torch.stack([dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)], dim=1).to(acc.dtype)
    if rows is None:
        acc.add_(g)
    elif isinstance(rows, tuple):
        acc.narrow(0, rows[0], rows[1]).add_(g)
    else:
        acc.index_add_(0, rows, g)


def _rows(x: torch.Tensor, idx: Optional[torch.Tensor]) -> torch.Tensor:
    return x if idx is None else x.index_select(2, idx)


def ring_forward(q_bhsd, k_bhsd, v_bhsd, plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the keys of every ring rank.

    q: [B, H, S_q, D]; k, v: [B, Hkv, S_kv, D] (this rank's block). Returns (out, lse) in the accumulator dtype (fp32, or fp64 for fp64).
    Rows that see no key keep out = 0 and lse = -inf.
    """
    b, h, s_q, d = q_bhsd.shape
    ex = MultiRingExchange(plan.routing, plan.group, plan.rank, plan.slot_off, plan.slot_len)
    cur = torch.stack([k_bhsd.permute(2, 0, 1, 3), v_bhsd.permute(2, 0, 1, 3)], dim=1).contiguous()
    nxt = torch.empty_like(cur) if plan.world > 1 else None
    acc = torch.zeros(b, h, s_q, d, dtype=acc_dtype(q_bhsd), device=q_bhsd.device)
    lse = torch.full((b, h, s_q), float("-inf"), dtype=acc.dtype, device=q_bhsd.device)
    for step in range(plan.world):
        handle = ex.start(cur, nxt) if step < plan.world - 1 else None
        for it in plan.items(step, q_bhsd.device):
            k_, v_ = _kv_view(cur, it.kv_rows)
            o, l_ = plan.backend.forward_lse(_rows(q_bhsd, it.q_rows), k_, v_, causal=it.causal,
                                             softmax_scale=plan.scale, mask=it.mask)
            if it.q_rows is None:
                merge_into(acc, lse, o, l_)
            else:
                a, l0 = acc.index_select(2, it.q_rows), lse.index_select(2, it.q_rows)
                merge_into(a, l0, o, l_)
                acc.index_copy_(2, it.q_rows, a)
                lse.index_copy_(2, it.q_rows, l0)
        if handle is not None:
            ex.wait(handle)
            cur, nxt = nxt, cur
    return acc, lse


def ring_backward(dout, q, k, v, out, lse, plan: RingPlan):
    """Gradients of ``ring_forward`` given the FINAL out (q dtype) and lse of the query rows.

    Returns (dq [B,H,S_q,D], dk, dv [B,Hkv,S_kv,D] of this rank's own block) in the accumulator dtype.
    """
    dout = dout.contiguous()
    ex = MultiRingExchange(plan.routing, plan.group, plan.rank, plan.slot_off, plan.slot_len)
    cur = torch.stack([k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)], dim=1).contiguous()
    nxt = torch.empty_like(cur) if plan.world > 1 else None
    dq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    dkv_in = torch.zeros(cur.shape, dtype=dq.dtype, device=q.device)
    dkv_next = torch.empty_like(dkv_in)
    dkv_handle = None
    for step in range(plan.world):
        handle = ex.start(cur, nxt) if step < plan.world - 1 else None
        local = torch.zeros_like(dkv_in)
        for it in plan.items(step, q.device):
            k_, v_ = _kv_view(cur, it.kv_rows)
            gq, gk, gv = plan.backend.backward_lse(
                _rows(dout, it.q_rows), _rows(q, it.q_rows), k_, v_, _rows(out, it.q_rows),
                lse if it.q_rows is None else lse.index_select(2, it.q_rows),
                causal=it.causal, softmax_scale=plan.scale, mask=it.mask)
            if it.q_rows is None:
                dq.add_(gq.to(dq.dtype))
            else:
                dq.index_add_(2, it.q_rows, gq.to(dq.dtype))
            _kv_add(local, it.kv_rows, gk, gv)
        if dkv_handle is not None:  # accumulator of this block from the ranks before us
            ex.wait(dkv_handle)
            dkv_in, dkv_next = dkv_next, dkv_in
        local.add_(dkv_in)
        dkv_in = local
        if plan.world > 1:
            dkv_handle = ex.start(dkv_in, dkv_next)  # the last one is the hop home
        if handle is not None:
            ex.wait(handle)
            cur, nxt = nxt, cur
    if plan.world > 1:
        ex.wait(dkv_handle)
        dkv = dkv_next
    else:
        dkv = dkv_in
    return dq, dkv[:, 0].permute(1, 2, 0, 3), dkv[:, 1].permute(1, 2, 0, 3)


class _RingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_bhsd, k_bhsd, v_bhsd, plan: RingPlan):
        acc, lse = ring_forward(q_bhsd, k_bhsd, v_bhsd, plan)
        out = acc.to(q_bhsd.dtype)
        ctx.save_for_backward(q_bhsd, k_bhsd, v_bhsd, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def make_ring_plan(group, *, variant: str, s_loc: int, q_runs, kv_runs, causal: bool, scale: float,
                   backend: LocalAttention, balanced_slots: bool = False,
                   kv_valid_len: Optional[int] = None) -> RingPlan:
    """Plan for one ring group (None or size 1 = no exchange). kv_runs[o] = runs of ring rank o."""
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    if variant == "tasp" and world > 1:
        rt = routing_tables(world)
        m = len(rt.cycles)
        if balanced_slots:  # tasp_zigzag: ring i carries [piece, mirror] = 2 * (s_loc / 2m) tokens
            lens = (s_loc // m,) * m
        else:
            lens = split_more_first(s_loc, m)
            if min(lens) == 0:
                raise SPConfigError(f"tasp needs at least {m} tokens per rank, got {s_loc}")
    else:
        rt, lens = _single_ring(world), (s_loc,)
    offs = tuple(sum(lens[:i]) for i in range(len(lens)))
    return RingPlan(group, rank, world, variant, rt, offs, tuple(lens), tuple(q_runs), tuple(kv_runs),
                    causal, scale, backend, kv_valid_len)


class RingBackend(LocalAttention):
    """Ring/TASP over ``group`` as a local-attention backend (for hybrid meshes).

    Queries and keys of this rank cover global runs ``q_runs``; ``kv_runs[o]`` are ring rank o's.
    """

    def __init__(self, group, variant: str, q_runs, kv_runs, inner: LocalAttention,
                 kv_valid_len: Optional[int] = None) -> None:
        self.group, self.variant, self.q_runs, self.kv_runs, self.inner = group, variant, q_runs, kv_runs, inner
        self.kv_valid_len = kv_valid_len
        self.name = f"{variant}[{inner.name}]"
        self._plans: dict = {}

    def plan(self, s_loc: int, causal: bool, scale: float) -> RingPlan:
        key = (s_loc, causal, scale)
        if key not in self._plans:
            self._plans[key] = make_ring_plan(self.group, variant=self.variant, s_loc=s_loc, q_runs=self.q_runs,
                                              kv_runs=self.kv_runs, causal=causal, scale=scale, backend=self.inner,
                                              kv_valid_len=self.kv_valid_len)
        return self._plans[key]

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return _RingFn.apply(q, k, v, self.plan(k.shape[2], causal, softmax_scale))

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None):
        assert mask is None
        return ring_forward(q, k, v, self.plan(k.shape[2], causal, softmax_scale))

    def backward_lse(self, do, q, k, v, out, lse, *, causal, softmax_scale, mask=None):
        assert mask is None
        return ring_backward(do, q, k, v, out, lse, self.plan(k.shape[2], causal, softmax_scale))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, *,
                   variant: str = "ring", causal: bool = False, softmax_scale: Optional[float] = None,
                   layout: str = "bshd", placement: Optional[str] = None,
                   backend: "str | LocalAttention" = "sdpa", kv_valid_len: Optional[int] = None) -> torch.Tensor:
    """Ring or TASP attention over ``group``. q: [B, S_loc, H, D] (or sbhd); k, v: Hkv heads.

    ``placement`` says which tokens each rank holds: by default "zigzag" for causal ring,
    "tasp_zigzag" for causal tasp, and "contiguous" otherwise (for non-causal any placement gives
    the same result). Use ``shard_sequence(x, group, placement=...)`` to produce matching shards.
    ``kv_valid_len``: keys at global positions >= kv_valid_len are padding and get no attention.
    Local attention uses the backend's log-sum-exp kernels (``forward_lse`` / ``backward_lse``).
    """
    if variant not in VARIANTS:
        raise SPConfigError(f"variant={variant!r} is invalid: choose one of {', '.join(VARIANTS)}")
    if layout not in LAYOUTS:
        raise SPConfigError(f"layout={layout!r} is invalid: choose one of {', '.join(LAYOUTS)}")
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise SPConfigError(f"q/k/v shapes do not agree ({layout}): {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise SPConfigError(f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")
    if placement is None:
        placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    be = get_backend(backend)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t.permute(1, 2, 0, 3))
    key = (id(group), tuple(q.shape), layout, "ring")
    if key not in _VALIDATED:
        check_same_shape_across_ranks(q, group, what="sequence shard (q)")
        _VALIDATED.add(key)
    s_loc = q.shape[1] if layout == "bshd" else q.shape[0]
    seqlen = s_loc * world
    q_runs = pieces(placement, rank, world, seqlen)  # validates divisibility
    kv_runs = tuple(pieces(placement, o, world, seqlen) for o in range(world))
    plan = make_ring_plan(group, variant=variant, s_loc=s_loc, q_runs=q_runs, kv_runs=kv_runs, causal=causal,
                          scale=scale, backend=be, balanced_slots=placement == "tasp_zigzag", kv_valid_len=kv_valid_len)
    out = _RingFn.apply(to_bhsd(q), to_bhsd(k), to_bhsd(v), plan)
    return out.transpose(1, 2) if layout == "bshd" else out.permute(2, 0, 1, 3)


_VALIDATED: set = set()
