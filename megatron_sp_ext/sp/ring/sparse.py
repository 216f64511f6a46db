"""Block-sparse ring attention: the ring (``variant="ring"``) and TASP's multi-ring (``variant="tasp"``) under a block
mask, skipping what the mask leaves out.

The mask (attention/block_sparse.py) is the same on every rank, so every rank computes the same plan
(``SparseRingPlan``) from it and the global positions of every rank's tokens, and the send/receive schedule agrees
on all ranks (no rank waits for a transfer its peer skips). Each rank's K|V is cut into m slots (m = 1 for the
ring; TASP: one per Hamiltonian cycle of ``topology.hamiltonian.routing_tables``, slot i travelling cycle i):

* ``need[i][r][o]``: whether rank r's queries attend any key of slot i of rank o (tile level, any head, AND causal
  AND kv_valid_len; ``block_sparse.pair_selected``). A (step, slot) whose block is not needed where it sits is
  SKIPPED (no kernel call); a step with all its slots skipped runs no kernel.
* Slot i of rank o travels its cycle (ring: o -> o+1 -> ...; one hop per step). Its hop after step s is sent only if
  a later rank on its path needs it; otherwise that K|V transfer is skipped.
* Backward: K|V travel as in the forward (same skips); each run (step, slot) recomputes its block against the FINAL
  out/lse and sends its dK|dV partial straight to the slot's home (skipped with it); the home adds them.

Local kernel: the math block kernel (``block_sparse.math_forward`` / ``math_backward``, token masks from global
positions) on every device; partial results merge by log-sum-exp (fp32, fp64 for fp64). Counters for benchmarks:
``SparseRingPlan.counts(rank)`` (slot steps run / skipped, K|V bytes sent / skipped, dK|dV bytes sent / skipped).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist

from ...attention import block_sparse
from ...attention.backends import LocalAttention
from ...attention.lse import acc_dtype, merge_into
from ...errors import SPConfigError
from ...topology.hamiltonian import routing_tables
from ..checks import check_ring_inputs, check_same_shape_across_ranks
from ..heads import split_more_first
from ..placement import positions


@dataclass(frozen=True)
class SparseRingPlan:
    """The skip schedule of one block-sparse ring call, identical on every rank.

    world: P. nxt[i][r] / prv[i][r]: the next / previous rank of r on slot i's cycle. need[i][r][o]: rank r's
    queries attend some key of slot i of rank o. hop[i][o][s] (s < P - 1): slot i of rank o is sent on its step-s
    hop. slot_bytes[i]: bytes of one rank's slot i (k and v); 0 when unknown.
    """

    world: int
    nxt: tuple
    prv: tuple
    need: tuple
    hop: tuple
    slot_bytes: tuple

    @property
    def slots(self) -> int:
        return len(self.nxt)

    def origin(self, slot: int, rank: int, step: int) -> int:
        """The rank whose slot ``slot`` ``rank`` holds at ``step``."""
        for _ in range(step):
            rank = self.prv[slot][rank]
        return rank

    def runs(self, slot: int, rank: int, step: int) -> bool:
        """Whether ``rank`` calls the kernel on slot ``slot`` at ``step``."""
        return self.need[slot][rank][self.origin(slot, rank, step)]

    def sends(self, slot: int, rank: int, step: int) -> bool:
        """Whether ``rank`` sends its held slot ``slot`` to ``nxt[slot][rank]`` after ``step`` (step < P - 1)."""
        return step < self.world - 1 and self.hop[slot][self.origin(slot, rank, step)][step]

    def receives(self, slot: int, rank: int, step: int) -> bool:
        """Whether ``rank`` receives slot ``slot`` from ``prv[slot][rank]`` after ``step``."""
        return self.sends(slot, self.prv[slot][rank], step)

    def counts(self, rank: int) -> dict:
        """Per-rank counters of one forward (K|V hops) and backward (dK|dV partials sent home; its K|V hops repeat
        the forward's), over (step, slot) pairs (the ring: one slot, so steps): steps_run, steps_skipped,
        bytes_sent, bytes_skipped, dkv_bytes_sent, dkv_bytes_skipped."""
        p, m = self.world, self.slots
        run = sum(self.runs(i, rank, s) for i in range(m) for s in range(p))
        hops = [(i, s) for i in range(m) for s in range(p - 1)]
        sent = sum(self.slot_bytes[i] for i, s in hops if self.sends(i, rank, s))
        dkv = sum(self.slot_bytes[i] for i in range(m) for s in range(1, p) if self.runs(i, rank, s))
        total = sum(self.slot_bytes[i] for i, _ in hops)
        return {"steps_run": run, "steps_skipped": p * m - run, "bytes_sent": sent, "bytes_skipped": total - sent,
                "dkv_bytes_sent": dkv, "dkv_bytes_skipped": total - dkv}


def _ring_tables(variant: str, world: int) -> tuple[tuple, tuple]:
    """(nxt, prv) per slot: one ring, or TASP's Hamiltonian cycles; raises SPConfigError for another variant."""
    if variant not in ("ring", "tasp"):
        raise SPConfigError(f"variant={variant!r} is invalid: choose one of ring, tasp")
    if variant == "tasp" and world > 1:
        rt = routing_tables(world)
        return rt.nxt, rt.prv
    return (tuple((r + 1) % world for r in range(world)),), (tuple((r - 1) % world for r in range(world)),)


def slot_spans(variant: str, world: int, s_kv: int, balanced: bool = False) -> tuple:
    """(offset, length) of each slot in a rank's local K|V rows: the whole block for the ring; TASP: one per cycle,
    equal (``balanced``: tasp_zigzag's ring-major pieces) or more-first. Raises SPConfigError when a slot is empty."""
    m = len(_ring_tables(variant, world)[0])
    if m == 1:
        return ((0, s_kv),)
    lens = (s_kv // m,) * m if balanced else split_more_first(s_kv, m)
    if min(lens) == 0 or sum(lens) != s_kv:
        raise SPConfigError(f"variant='tasp' with block_mask needs at least {m} key tokens per rank, split evenly "
                            f"for tasp_zigzag; got {s_kv}")
    offs = [sum(lens[:i]) for i in range(m)]
    return tuple(zip(offs, lens))


def sparse_ring_plan(block_mask: torch.Tensor, *, world: int, seq_len: int, block_size: int, placement: str,
                     causal: bool, kv_valid_len: Optional[int] = None, block_bytes: int = 0,
                     variant: str = "ring") -> SparseRingPlan:
    """The ``SparseRingPlan`` of ``block_mask`` ([H or 1, T, T], checked) for ``variant`` over ``world`` ranks
    holding a ``seq_len`` sequence in ``placement``; block_bytes: one rank's K|V bytes (split over the slots)."""
    pos = _positions(placement, world, seq_len)
    spans = slot_spans(variant, world, seq_len // world, placement == "tasp_zigzag")
    return plan_from_positions(block_mask, pos, block_size, causal=causal, kv_valid_len=kv_valid_len,
                               block_bytes=block_bytes, variant=variant, spans=spans)


def plan_from_positions(block_mask: torch.Tensor, pos: tuple, block_size: int, heads: slice = slice(None), *,
                        causal: bool, kv_valid_len: Optional[int] = None, block_bytes: int = 0,
                        kv_pos: Optional[tuple] = None, variant: str = "ring",
                        spans: Optional[tuple] = None) -> SparseRingPlan:
    """The plan of a ring (``variant``) whose rank r holds queries at global positions ``pos[r]`` and keys at
    ``kv_pos[r]`` (default: the same tokens), cut into slots ``spans`` (default: one), for the query heads
    ``heads`` (rows of the mask)."""
    world = len(pos)
    kv_pos = pos if kv_pos is None else kv_pos
    spans = spans if spans is not None else ((0, int(kv_pos[0].numel())),)
    nxt, prv = _ring_tables(variant, world)
    assert len(nxt) == len(spans), (len(nxt), len(spans))
    block_mask = block_mask.cpu()  # tile-level work: one copy, no device syncs
    pos, kv_pos = tuple(p.cpu() for p in pos), tuple(p.cpu() for p in kv_pos)
    need = tuple(tuple(tuple(block_sparse.pair_selected(block_mask, pos[r], kv_pos[o][a:a + n], block_size, heads,
                                                        causal=causal, kv_valid_len=kv_valid_len)
                             for o in range(world)) for r in range(world)) for a, n in spans)
    hop = []
    for i in range(len(spans)):
        per_origin = []
        for o in range(world):
            path = [o]
            for _ in range(world - 1):
                path.append(nxt[i][path[-1]])
            per_origin.append(tuple(any(need[i][path[t]][o] for t in range(s + 1, world)) for s in range(world - 1)))
        hop.append(tuple(per_origin))
    total = int(kv_pos[0].numel())
    slot_bytes = tuple(block_bytes * n // total if total else 0 for _, n in spans)
    return SparseRingPlan(world, nxt, prv, need, tuple(hop), slot_bytes)


@dataclass
class SparseRingCall:
    """What one call needs: the group, this rank, the plan, the mask and positions, the slots, the softmax settings."""

    group: Optional[dist.ProcessGroup]
    rank: int
    plan: SparseRingPlan
    block_mask: torch.Tensor
    block_size: int
    q_pos: torch.Tensor          # [S_q] global positions of this rank's queries
    kv_pos: tuple                # kv_pos[o]: [S_kv] global positions of rank o's keys (local order)
    causal: bool
    scale: float
    kv_valid_len: Optional[int] = None
    heads: slice = field(default_factory=lambda: slice(None))  # the global query heads q carries (mask rows)
    spans: tuple = ()            # (offset, length) of each slot in the local K|V rows

    def mask(self, slot: int, origin: int) -> torch.Tensor:
        """Token mask [h or 1, S_q, n_slot] of this rank's queries against slot ``slot`` of rank ``origin``."""
        a, n = self.spans[slot]
        return block_sparse.token_mask(self.block_mask, self.q_pos, self.kv_pos[origin][a:a + n], self.block_size,
                                       self.heads, causal=self.causal, kv_valid_len=self.kv_valid_len)

    def peer(self, rank: int) -> int:
        """The global rank of ``rank`` of the group."""
        return dist.get_global_rank(self.group, rank)


class _Batch:
    """One batch of point-to-point ops in flight. With a gloo group and CUDA tensors (gloo's send/recv cannot take
    them) the tensors go through host copies, received ones copied back by ``wait``; same bytes, same order."""

    def __init__(self, ops: list, group: dist.ProcessGroup) -> None:
        self.copies: list = []
        staged = ops[0][1].is_cuda and dist.get_backend(group) == "gloo"
        p2p = []
        for kind, t, peer in ops:
            if staged:
                host = t.cpu() if kind == "send" else torch.empty(t.shape, dtype=t.dtype)
                if kind == "recv":
                    self.copies.append((host, t))
                t = host
            p2p.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group))
        self.keep = p2p  # the sent tensors live until the works are done
        self.works = dist.batch_isend_irecv(p2p)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        for host, t in self.copies:
            t.copy_(host)


def _start(ops: list, group: dist.ProcessGroup) -> list:
    """Start ``ops`` [("send" | "recv", tensor, global peer)] as one batch; the handles for ``_wait``."""
    return [_Batch(ops, group)] if ops else []


def _start_hops(call: SparseRingCall, step: int, cur: list, nxt: list) -> tuple[list, list]:
    """Start the K|V hops after ``step`` of every slot (only the sends and receives the plan keeps), one batch;
    (handles, the slots receiving)."""
    plan, r = call.plan, call.rank
    if step >= plan.world - 1:
        return [], []
    ops, receiving = [], []
    for i in range(plan.slots):
        if plan.sends(i, r, step):
            ops.append(("send", cur[i], call.peer(plan.nxt[i][r])))
        if plan.receives(i, r, step):
            ops.append(("recv", nxt[i], call.peer(plan.prv[i][r])))
            receiving.append(i)
    return _start(ops, call.group), receiving


def _wait(handles: list) -> None:
    for h in handles:
        h.wait()


def _slot_buffers(k_bhsd: torch.Tensor, v_bhsd: torch.Tensor, call: SparseRingCall) -> tuple[list, list]:
    """Per slot: this rank's k|v rows stacked [2, B, Hkv, n, D] (contiguous), and a receive buffer like it."""
    cur = [torch.stack([k_bhsd[:, :, a:a + n], v_bhsd[:, :, a:a + n]]).contiguous() for a, n in call.spans]
    return cur, [torch.empty_like(c) for c in cur]


def sparse_ring_forward(q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor,
                        call: SparseRingCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, S_q, D], lse [B, H, S_q]) in the accumulator dtype of this rank's queries over every needed
    block; k, v [B, Hkv, S_kv, D] this rank's block. Rows with no selected key: out 0, lse -inf."""
    b, h, s_q, d = q_bhsd.shape
    plan, r = call.plan, call.rank
    acc = torch.zeros(b, h, s_q, d, dtype=acc_dtype(q_bhsd), device=q_bhsd.device)
    lse = torch.full((b, h, s_q), float("-inf"), dtype=acc.dtype, device=q_bhsd.device)
    cur, nxt = _slot_buffers(k_bhsd, v_bhsd, call)
    for step in range(plan.world):
        works, receiving = _start_hops(call, step, cur, nxt)
        for i in range(plan.slots):
            if plan.runs(i, r, step):
                o, l_ = block_sparse.math_forward(q_bhsd, cur[i][0], cur[i][1],
                                                  call.mask(i, plan.origin(i, r, step)), call.scale)
                merge_into(acc, lse, o, l_)
        _wait(works)
        for i in receiving:
            cur[i], nxt[i] = nxt[i], cur[i]
    return acc, lse


def sparse_ring_backward(do_bhsd: torch.Tensor, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor,
                         out_bhsd: torch.Tensor, lse_bhs: torch.Tensor, call: SparseRingCall):
    """Gradients of ``sparse_ring_forward`` given the FINAL out (q dtype) and lse: (dq [B, H, S_q, D], dk, dv
    [B, Hkv, S_kv, D] of this rank's own block) in the accumulator dtype."""
    plan, r, world = call.plan, call.rank, call.plan.world
    do_bhsd = do_bhsd.contiguous()
    dq = torch.zeros(q_bhsd.shape, dtype=acc_dtype(q_bhsd), device=q_bhsd.device)
    dkv = torch.zeros((2,) + tuple(k_bhsd.shape), dtype=dq.dtype, device=q_bhsd.device)
    cur, nxt = _slot_buffers(k_bhsd, v_bhsd, call)
    pending: list = []   # (handles, [(slot, inbox)]) of dK|dV partials in flight
    for step in range(world):
        works, receiving = _start_hops(call, step, cur, nxt)
        ops, inboxes = [], []
        for i in range(plan.slots):
            if plan.runs(i, r, step):
                origin = plan.origin(i, r, step)
                dq_s, dk_s, dv_s = block_sparse.math_backward(do_bhsd, q_bhsd, cur[i][0], cur[i][1], out_bhsd,
                                                              lse_bhs, call.mask(i, origin), call.scale)
                dq += dq_s
                if step == 0:
                    a, n = call.spans[i]
                    dkv[0][:, :, a:a + n] += dk_s
                    dkv[1][:, :, a:a + n] += dv_s
                else:  # the partial goes straight home
                    ops.append(("send", torch.stack([dk_s, dv_s]), call.peer(origin)))
        for i in range(plan.slots):  # our slot i sits on ``holder`` at this step: its partial comes home
            holder = r
            for _ in range(step):
                holder = plan.nxt[i][holder]
            if step > 0 and plan.need[i][holder][r]:
                inbox = torch.empty_like(cur[i])
                ops.append(("recv", inbox, call.peer(holder)))
                inboxes.append((i, inbox))
        if ops:
            pending.append((_start(ops, call.group), inboxes))
        _wait(works)
        for i in receiving:
            cur[i], nxt[i] = nxt[i], cur[i]
    for ws, inboxes in pending:
        _wait(ws)
        for i, inbox in inboxes:
            a, n = call.spans[i]
            dkv[:, :, :, a:a + n] += inbox
    return dq, dkv[0], dkv[1]


class SparseRingFn(torch.autograd.Function):
    """``sparse_ring_forward`` / ``sparse_ring_backward`` as one autograd node: q [B, H, S_q, D], k, v
    [B, Hkv, S_kv, D] (bhsd views), returning out in q's dtype."""

    @staticmethod
    def forward(ctx, q_bhsd, k_bhsd, v_bhsd, call: SparseRingCall):
        acc, lse = sparse_ring_forward(q_bhsd, k_bhsd, v_bhsd, call)
        out = acc.to(q_bhsd.dtype)
        ctx.save_for_backward(q_bhsd, k_bhsd, v_bhsd, out, lse)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = sparse_ring_backward(dout, q, k, v, out, lse, ctx.call)
        ctx.call = None  # nothing of the call keeps its group alive once the gradients exist
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


@lru_cache(maxsize=64)
def _positions(placement: str, world: int, seq_len: int) -> tuple:
    return tuple(positions(placement, r, world, seq_len) for r in range(world))


def make_sparse_ring_call(group: Optional[dist.ProcessGroup], block_mask: torch.Tensor, *, block_size: int,
                          pos: tuple, causal: bool, scale: float, kv_valid_len: Optional[int], block_bytes: int,
                          heads: slice = slice(None), kv_pos: Optional[tuple] = None, variant: str = "ring",
                          balanced: bool = False) -> SparseRingCall:
    """The call of this rank of ``group`` (None: one rank) whose ring rank r holds queries at global positions
    ``pos[r]`` and keys at ``kv_pos[r]`` (default: the same tokens); ``variant`` "ring" or "tasp" (slots:
    ``slot_spans``, ``balanced`` for tasp_zigzag)."""
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    kv_pos = pos if kv_pos is None else kv_pos
    assert len(pos) == world and len(kv_pos) == world, (len(pos), len(kv_pos), world)
    spans = slot_spans(variant, world, int(kv_pos[0].numel()), balanced)
    plan = plan_from_positions(block_mask, pos, block_size, heads, causal=causal, kv_valid_len=kv_valid_len,
                               block_bytes=block_bytes, kv_pos=kv_pos, variant=variant, spans=spans)
    dev = block_mask.device
    return SparseRingCall(group, rank, plan, block_mask, block_size, pos[rank].to(dev),
                          tuple(p.to(dev) for p in kv_pos), causal, scale, kv_valid_len, heads, spans)


def runs_positions(runs) -> torch.Tensor:
    """Global positions [n] of the tokens of ``runs`` ((start, len), ... in local order)."""
    return torch.cat([torch.arange(a, a + n) for a, n in runs])


class SparseRingBackend(block_sparse.BlockSparseBackend):
    """The sparse ring (``variant`` "ring" or "tasp") over ``group`` as the local attention of a hybrid mesh's Ulysses
    exchange: ring rank o holds the tokens of ``runs[o]`` (global (start, len) runs, the order of the Ulysses group's
    gathered sequence)."""

    def __init__(self, group: Optional[dist.ProcessGroup], runs: tuple, block_mask: torch.Tensor, block_size: int,
                 seq_len: int, kv_valid_len: Optional[int] = None, variant: str = "ring") -> None:
        self.group, self.block_mask, self.block_size = group, block_mask, block_size
        self.seq_len, self.kv_valid_len, self.variant = seq_len, kv_valid_len, variant
        self.pos = tuple(runs_positions(r) for r in runs)
        self.name = f"sparse_{variant}"

    def attend(self, q_bhsd, k_bhsd, v_bhsd, *, heads: slice, causal: bool, softmax_scale: float) -> torch.Tensor:
        if self.group is not None:  # the ring group's shapes, checked once per shape by a collective (so NCCL's
            # first call on the group involves every rank before the plan may leave some rank out of a step)
            check_ring_inputs(q_bhsd.transpose(1, 2), k_bhsd.transpose(1, 2), v_bhsd.transpose(1, 2), "bshd",
                              self.group)
        call = make_sparse_ring_call(self.group, self.block_mask, block_size=self.block_size, pos=self.pos,
                                     causal=causal, scale=softmax_scale, kv_valid_len=self.kv_valid_len,
                                     block_bytes=2 * k_bhsd.numel() * k_bhsd.element_size(), heads=heads,
                                     variant=self.variant)
        return SparseRingFn.apply(q_bhsd, k_bhsd, v_bhsd, call)


class SparseRingBlocks(LocalAttention):
    """The sparse ring (``variant`` "ring" or "tasp") over ``group`` in log-sum-exp block form, for torus attention's
    blocks: ring rank r holds queries ``q_runs[r]`` and keys ``kv_runs[r]`` (global (start, len) runs), query heads
    ``heads`` of the mask. ``forward_lse`` -> (out, lse) in the accumulator dtype; ``backward_lse`` from the FINAL
    out/lse of the rows."""

    def __init__(self, group: Optional[dist.ProcessGroup], q_runs: tuple, kv_runs: tuple, block_mask: torch.Tensor,
                 block_size: int, heads: slice, kv_valid_len: Optional[int] = None, variant: str = "ring") -> None:
        self.group, self.block_mask, self.block_size, self.heads = group, block_mask, block_size, heads
        self.kv_valid_len, self.variant = kv_valid_len, variant
        self.q_pos = tuple(runs_positions(r) for r in q_runs)
        self.kv_pos = tuple(runs_positions(r) for r in kv_runs)
        self.name = "sparse_ring_blocks"
        self._calls: dict = {}

    def _call(self, k_bhsd: torch.Tensor, causal: bool, scale: float) -> SparseRingCall:
        key = (causal, scale, tuple(k_bhsd.shape), k_bhsd.dtype)
        if key not in self._calls:
            if self.group is not None:  # one collective on the ring group before its first point-to-point batch
                check_same_shape_across_ranks(k_bhsd, self.group, "key block (torus ring)")
            self._calls[key] = make_sparse_ring_call(
                self.group, self.block_mask, block_size=self.block_size, pos=self.q_pos, kv_pos=self.kv_pos,
                causal=causal, scale=scale, kv_valid_len=self.kv_valid_len,
                block_bytes=2 * k_bhsd.numel() * k_bhsd.element_size(), heads=self.heads, variant=self.variant)
        return self._calls[key]

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return SparseRingFn.apply(q, k, v, self._call(k, causal, softmax_scale))

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None):
        assert mask is None
        return sparse_ring_forward(q, k, v, self._call(k, causal, softmax_scale))

    def backward_lse(self, do, q, k, v, out, lse, *, causal, softmax_scale, mask=None):
        assert mask is None
        return sparse_ring_backward(do, q, k, v, out, lse, self._call(k, causal, softmax_scale))
