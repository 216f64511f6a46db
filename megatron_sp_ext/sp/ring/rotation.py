"""The ring's transfers: starting a step's point-to-point exchange, and the backward's dK|dV return.

K|V rotation (unchanged). Q stays; each step's K|V exchange (``plan.transfer``: the neighbour ring,
or TASP's multi-ring hop from ``topology/hamiltonian`` routing tables) is started before the step's
kernels into the second of two buffers and waited after them, forward and backward.

dK|dV return, route "home" (default). At step s >= 1 a rank holds, per slot, the K|V block of
another rank (its *home*). Its kernels give that K|V block's PARTIAL dK|dV in the kernels' own output
dtype (``backward_lse`` returns dK, dV in the K/V dtype: bf16 for bf16 inputs, fp32 for fp32), and
the partial goes straight home (per slot, to ``routing.origin(slot, rank, s)``; the same segment rows
as the K|V layout of that step, into the home's step-0 layout). The home accumulates in fp32 (fp64
for fp64) in a fixed order: its own step-0 kernels, then the partials of steps 1, 2, ... P-1, each
added when it arrives: deterministic, and bitwise the sums of the old route where a step's kernel
calls touch disjoint key rows (every zigzag ring / tasp_zigzag / non-causal step). Where they overlap
(the general fallback of ``schedule.step_items``: e.g. causal contiguous placement, packed samples),
the step's calls are summed in the accumulator dtype and rounded once to the wire dtype.
The K|V pattern is not changed: ring and TASP keep their own routing; only the dK|dV destinations
differ (shift-by-s along each ring, an all-to-all of per-slot segments per step; on the emulated
host-staged link one ``all_to_all`` with its table, on NCCL/gloo one ``batch_isend_irecv``: ``comm.p2p``).
Each rank still sends one partial per slot and receives one per slot per step; across machines with
a NIC per GPU a step costs one cross-machine transfer as the ring's slowest hop does, but where GPUs
share a NIC the shift-by-s steps put more ranks on it at once (``SPX_RING_DKV=travel`` keeps the
neighbour pattern).

The last step's partial is the one transfer nothing can hide behind (no kernel follows it). It is
computed per chunk of K/V heads (HCMS: heads are independent) and each chunk is sent as soon as its
kernels finish, so only the last chunk's transfer is exposed (``SPX_RING_DKV_CHUNKS``: a count, or
"auto": 4 chunks, capped by Hkv, when the partial is >= 16 MiB, else 1).

Route "travel" (the previous schedule, kept as a baseline for benchmarks: ``SPX_RING_DKV=travel``):
an fp32 accumulator per K|V block travels with it and takes one extra hop home after the last step.

Byte/time model (one rank, S = local tokens, bf16, E = S*B*Hkv*D elements; not yet measured on 2 GPUs):
  forward  per step: K|V 2E*2 B = 4E B behind one step of kernels (unchanged).
  travel   backward: every step moves K|V (4E B) + the fp32 accumulator (8E B); after the last
           kernel the accumulator's hop home (8E B) is fully exposed.
  home     backward: steps 0..P-2 move K|V (4E B), steps 1..P-1 a bf16 partial (4E B): 8E B per
           middle step (2/3 of travel's 12E B); exposed after the last kernel: one chunk, 4E/C B.
  At P=2, 64K, H=Hkv=40, D=128 (E = 32768*40*128): K|V 671 MB (27 ms at 25 GB/s) behind step 0's
  kernels in both; travel then moves a 1.34 GB fp32 hop behind step 1's kernels and exposes a second
  one home (~54 ms), home moves nothing behind step 1 and exposes 671 MB / C (~7 ms with C=4).
  32K causal, zigzag (S=16K, an estimated ~14 ms of backward kernels per step): travel's first fp32 hop (671 MB,
  ~27 ms) runs behind step 1's kernels (~13 ms exposed), its hop home (~27 ms) is exposed: ~40 ms;
  home: 335 MB / C exposed (~3.4 ms with C=4). The forward first transfer is not
  chunked: it starts before the step's kernels, so it is exposed only where a step's kernels are
  shorter than a K|V block's transfer (causal at 32K: a link-bound regime that chunking cannot change,
  only fewer bytes could).
For fp32/fp64 inputs the wire dtype equals the accumulator's: the same bytes per hop as travel, one
hop fewer, and the chunked last step. Every rank must see the same SPX_RING_DKV[_CHUNKS] (torchrun
passes the environment to all ranks); each value is checked (SPConfigError names the variable).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol

import torch
import torch.distributed as dist

from ...attention.lse import acc_dtype
from ...comm import p2p
from ...comm.p2p import wait_handles
from ...errors import SPConfigError
from ..heads import split_more_first

DKV_ROUTE_ENV = "SPX_RING_DKV"
DKV_CHUNKS_ENV = "SPX_RING_DKV_CHUNKS"
ROUTES = ("home", "travel")
AUTO_CHUNKS = 4
AUTO_CHUNK_MIN_BYTES = 16 << 20

Op = tuple  # (kind "send"/"recv", group rank of the peer, buffer row, rows)


class StepPlan(Protocol):
    """What the transfers need of a ring plan (``ring.RingPlan``)."""

    rank: int
    world: int
    routing: object
    slot_len: tuple
    cache: dict
    backend: object
    scale: float
    tiles: object

    @property
    def group(self) -> Optional[dist.ProcessGroup]: ...

    def segments(self, step: int, rank: Optional[int] = None) -> tuple: ...

    def transfer(self, step: int, rank: Optional[int] = None) -> list: ...

    def items(self, step: int, device) -> list: ...

    def start(self, step: int, src: torch.Tensor, dst: torch.Tensor) -> list: ...

    def runs(self, slot: int, step: int, rank: Optional[int] = None) -> bool: ...

    def tile_heads(self, heads: slice) -> slice: ...


@dataclass(frozen=True)
class DkvSchedule:
    """How the backward returns dK|dV: ``route`` "home" or "travel"; ``chunks`` of the last step (0 = auto)."""

    route: str = "home"
    chunks: int = 0


def dkv_schedule_from_env(environ: Optional[Mapping[str, str]] = None) -> DkvSchedule:
    """The schedule named by SPX_RING_DKV ("home" default, "travel") and SPX_RING_DKV_CHUNKS (int >= 1, "auto")."""
    env = os.environ if environ is None else environ
    route = env.get(DKV_ROUTE_ENV, "home").strip() or "home"
    if route not in ROUTES:
        raise SPConfigError(f"{DKV_ROUTE_ENV}={route!r} is invalid: choose one of {', '.join(ROUTES)}")
    raw = env.get(DKV_CHUNKS_ENV, "auto").strip() or "auto"
    if raw == "auto":
        return DkvSchedule(route, 0)
    try:
        chunks = int(raw)
    except ValueError:
        chunks = -1
    if chunks < 1:
        raise SPConfigError(f"{DKV_CHUNKS_ENV}={raw!r} is invalid: give a head-chunk count >= 1 or 'auto'")
    return DkvSchedule(route, chunks)


def head_chunks(schedule: DkvSchedule, hkv: int, partial_bytes: int) -> list[tuple[int, int]]:
    """K/V head ranges [h0, h1) of the last step's chunks (the same on every rank: shapes are equal)."""
    c = schedule.chunks or (AUTO_CHUNKS if partial_bytes >= AUTO_CHUNK_MIN_BYTES else 1)
    sizes = split_more_first(hkv, max(1, min(c, hkv)))
    out, h0 = [], 0
    for n in sizes:
        out.append((h0, h0 + n))
        h0 += n
    return out


# ---------------------------------------------------------------- buffers: [S, 2, B, Hkv, D]
def sel_rows(x: torch.Tensor, rows, dim: int) -> torch.Tensor:
    """Rows of ``x`` along ``dim``: a slice (view) or int64 indices (copy)."""
    if isinstance(rows, slice):
        return x[(slice(None),) * dim + (rows,)]
    return x.index_select(dim, rows)


def kv_view(buf: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V (bhsd) of ``rows`` of a [S, 2, B, H, D] buffer (zero-copy for a row range)."""
    sel = sel_rows(buf, rows, 0)
    return sel[:, 0].permute(1, 2, 0, 3), sel[:, 1].permute(1, 2, 0, 3)


def kv_add(acc: torch.Tensor, rows, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """acc[rows] += (dk, dv) (bhsd) in acc's dtype."""
    if isinstance(rows, slice):
        sel = acc[rows]
        sel[:, 0].add_(dk.permute(2, 0, 1, 3))
        sel[:, 1].add_(dv.permute(2, 0, 1, 3))
    else:
        acc.index_add_(0, rows, torch.stack([dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)], dim=1).to(acc.dtype))


# ---------------------------------------------------------------- point-to-point ops
def holder(routing, ring: int, home: int, step: int) -> int:
    """Rank that holds ``home``'s ring-``ring`` K|V block after ``step`` steps."""
    return routing.origin(ring, home, -step)


def pair_ops(kind: str, peer: int, mine, theirs) -> list[Op]:
    """Ops for one slot: its segments on both ends paired in order; touching ones go as one op."""
    joined = all(a[0] + a[2] == b[0] for a, b in zip(mine, mine[1:])) and \
        all(a[0] + a[2] == b[0] for a, b in zip(theirs, theirs[1:]))
    if joined:
        return [(kind, peer, mine[0][0], sum(sg[2] for sg in mine))]
    return [(kind, peer, sg[0], sg[2]) for sg in mine]


def home_ops(plan: StepPlan, step: int, rank: Optional[int] = None) -> list[Op]:
    """Ops of ``rank`` at ``step`` >= 1 returning partial dK|dV: send each held slot (rows of this step's
    layout) to its home (rows of the home's step-0 layout); receive each own slot from its holder; only for the
    (step, slot) pairs that ran (``plan.runs``)."""
    r = plan.rank if rank is None else rank
    key = ("home_ops", step, r)
    if key not in plan.cache:
        rt, ops = plan.routing, []
        for i in range(len(plan.slot_len)):
            dest = rt.origin(i, r, step)
            assert dest != r, "a ring step >= 1 holds another rank's K|V block"
            if plan.runs(i, step, r):
                ops += pair_ops("send", dest, plan.segments(step, r)[i], plan.segments(0, dest)[i])
        for i in range(len(plan.slot_len)):
            src = holder(rt, i, r, step)
            if plan.runs(i, step, src):
                ops += pair_ops("recv", src, plan.segments(0, r)[i], plan.segments(step, src)[i])
        plan.cache[key] = ops
    return plan.cache[key]


def start_ops(plan: StepPlan, kind: str, step: int, ops_of: Callable[[int, int], list], src: torch.Tensor,
              dst: torch.Tensor) -> list:
    """Begin the exchange ``ops_of(step, rank)`` (rows of dim 0) of ``src`` into ``dst`` as one ``comm.p2p`` batch;
    handles for ``wait_handles``. The table of every rank's sends (for a group spanning emulated machines) comes
    from the same ops on every rank, once per plan."""
    group = plan.group
    if group is None or plan.world == 1:
        return []
    key = (kind, "table", step)
    if key not in plan.cache:
        table = [[0] * plan.world for _ in range(plan.world)]
        for r in range(plan.world):
            for k, peer, _, n in ops_of(step, r):
                if k == "send":
                    table[r][peer] += n
        plan.cache[key] = table
    row = src[0].numel() if src.shape[0] else 1
    table = [[n * row for n in t] for t in plan.cache[key]]
    ops = [(k, (src if k == "send" else dst).narrow(0, r0, n), peer) for k, peer, r0, n in ops_of(step, plan.rank)]
    return p2p.start(ops, group, like=src, table=table)


def moves_any(plan: StepPlan, kind: str, step: int, ops_of: Callable[[int, int], list]) -> bool:
    """Whether any rank moves anything in the exchange ``kind`` of ``step`` (the same answer on every rank)."""
    key = (kind, "any", step)
    if key not in plan.cache:
        plan.cache[key] = any(ops_of(step, r) for r in range(plan.world))
    return plan.cache[key]


# ---------------------------------------------------------------- backward
def tiles_kw(tiles) -> dict:
    """``tiles=`` for a kernel call under a block mask; nothing for a dense call (backends written before the
    ``tiles`` keyword keep working on the dense ring)."""
    return {} if tiles is None else {"tiles": tiles}


def _disjoint(items) -> bool:
    """Whether the calls' key rows are pairwise disjoint (index rows: assumed not)."""
    spans = []
    for it in items:
        if not isinstance(it.kv_rows, slice):
            return False
        spans.append((it.kv_rows.start or 0, it.kv_rows.stop))
    if any(stop is None for _, stop in spans):
        return len(spans) <= 1
    spans.sort()
    return all(a_stop <= b_start for (_, a_stop), (b_start, _) in zip(spans, spans[1:]))


def _kernel(plan: StepPlan, it, cur, dout_c, q_c, out_c, lse_c, kh: Optional[tuple[int, int]], rep: int):
    """backward_lse of one call, over K/V heads ``kh`` (None: all) and their query heads."""
    k_, v_ = kv_view(cur, it.kv_rows)
    r = it.q_rows
    do_, q_, o_, l_ = (sel_rows(t, r, 2) for t in (dout_c, q_c, out_c, lse_c))
    tiles = it.tiles
    if kh is not None:
        qh = slice(kh[0] * rep, kh[1] * rep)
        k_, v_ = k_[:, kh[0]:kh[1]], v_[:, kh[0]:kh[1]]
        do_, q_, o_, l_ = do_[:, qh], q_[:, qh], o_[:, qh], l_[:, qh]
        tiles = None if tiles is None else tiles.with_heads(plan.tile_heads(qh))
    return plan.backend.backward_lse(do_, q_, k_, v_, o_, l_, causal=it.causal, softmax_scale=plan.scale,
                                     mask=it.mask, **tiles_kw(tiles))


def _dq_add(dq: torch.Tensor, rows, heads: Optional[slice], gq: torch.Tensor) -> None:
    d = dq if heads is None else dq[:, heads]
    if isinstance(rows, slice):
        d[:, :, rows].add_(gq)
    else:
        d.index_add_(2, rows, gq.to(d.dtype))


def check_travel(plan: StepPlan) -> None:
    """The travel route moves accumulators along the K|V hops: a masked ring skips some of them."""
    if plan.tiles is not None:
        raise SPConfigError(f"{DKV_ROUTE_ENV}=travel cannot return dK|dV of a block-masked ring (its skipped K|V "
                            f"hops would strand the accumulators): unset it or use {DKV_ROUTE_ENV}=home")


def backward_steps(dout_c, q_c, cur: torch.Tensor, nxt: Optional[torch.Tensor], out_c, lse_c, plan: StepPlan,
                   schedule: DkvSchedule) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring backward given the FINAL out/lse (compute order, [B, H, S_q, D] / [B, H, S_q]) and this rank's
    K|V in the step-0 buffer ``cur`` ([S_kv, 2, B, Hkv, D]; ``nxt`` its twin, None for one rank).
    Returns dq (compute order, acc dtype) and this rank's dK|dV [S_kv, 2, B, Hkv, D] (step-0 layout, acc dtype)."""
    if schedule.route == "travel":
        check_travel(plan)
        return _backward_travel(dout_c, q_c, cur, nxt, out_c, lse_c, plan)
    return _backward_home(dout_c, q_c, cur, nxt, out_c, lse_c, plan, schedule)


def _backward_home(dout_c, q_c, cur, nxt, out_c, lse_c, plan: StepPlan, schedule: DkvSchedule):
    dev, world = q_c.device, plan.world
    dq = torch.zeros(q_c.shape, dtype=acc_dtype(q_c), device=dev)
    dkv = torch.zeros(cur.shape, dtype=dq.dtype, device=dev)  # stays home; partials of steps >= 1 come to it
    hkv = cur.shape[3]
    rep = q_c.shape[1] // hkv
    wire = cur.dtype                     # backward_lse returns dK, dV in the K/V dtype
    pending: list = []                   # (works, partial, recv, kv heads) in step order
    for step in range(world):
        last = step == world - 1
        works = plan.start(step, cur, nxt) if not last else []
        its = plan.items(step, dev)
        done = len(pending)              # the partials of earlier steps, retired after this step's kernels
        if step == 0:
            for it in its:
                gq, gk, gv = _kernel(plan, it, cur, dout_c, q_c, out_c, lse_c, None, rep)
                _dq_add(dq, it.q_rows, None, gq)
                kv_add(dkv, it.kv_rows, gk, gv)
        elif its or moves_any(plan, "home", step, lambda s_, r: home_ops(plan, s_, r)):
            exact = _disjoint(its)
            full = [(0, hkv)]
            chunks = head_chunks(schedule, hkv, cur.numel() * cur.element_size()) if last else full
            for h0, h1 in chunks:
                kh = None if (h0, h1) == (0, hkv) else (h0, h1)
                shape = cur.shape[:3] + (h1 - h0,) + cur.shape[4:]
                part = torch.zeros(shape, dtype=wire if exact else dkv.dtype, device=dev)
                for it in its:
                    gq, gk, gv = _kernel(plan, it, cur, dout_c, q_c, out_c, lse_c, kh, rep)
                    _dq_add(dq, it.q_rows, None if kh is None else slice(h0 * rep, h1 * rep), gq)
                    kv_add(part, it.kv_rows, gk, gv)
                if not exact:
                    part = part.to(wire)  # overlapping calls: summed in the acc dtype, rounded once
                # a masked ring receives only the slots that ran elsewhere: the other rows must add nothing
                recv = torch.empty_like(part) if plan.tiles is None else torch.zeros_like(part)
                w = start_ops(plan, "home", step, lambda s, r: home_ops(plan, s, r), part, recv)
                pending.append((w, part, recv, (h0, h1)))
        for w, _, recv, (h0, h1) in pending[:done]:  # fixed order: steps 1, 2, ... (chunks in head order)
            wait_handles(w)
            dkv[:, :, :, h0:h1].add_(recv)
        del pending[:done]
        if works:
            plan.wait(works)
            cur, nxt = nxt, cur
    for w, _, recv, (h0, h1) in pending:
        wait_handles(w)
        dkv[:, :, :, h0:h1].add_(recv)
    return dq, dkv


def _backward_travel(dout_c, q_c, cur, nxt, out_c, lse_c, plan: StepPlan):
    """The previous schedule: fp32 accumulators travel with their K|V blocks and take one extra hop home."""
    dq = torch.zeros(q_c.shape, dtype=acc_dtype(q_c), device=q_c.device)
    dkv = [torch.zeros(cur.shape, dtype=dq.dtype, device=q_c.device)]
    if plan.world > 1:
        dkv.append(torch.empty_like(dkv[0]))
    dkv_works: list = []
    rep = q_c.shape[1] // cur.shape[3]
    for step in range(plan.world):
        works = plan.start(step, cur, nxt) if step < plan.world - 1 else []
        grads = []
        for it in plan.items(step, q_c.device):
            gq, gk, gv = _kernel(plan, it, cur, dout_c, q_c, out_c, lse_c, None, rep)
            _dq_add(dq, it.q_rows, None, gq)
            grads.append((it.kv_rows, gk, gv))
        if dkv_works:  # this step's K|V blocks' accumulators, from the ranks before us
            wait_handles(dkv_works)
            dkv.reverse()
        for rows, gk, gv in grads:
            kv_add(dkv[0], rows, gk, gv)
        if plan.world > 1:
            dkv_works = plan.start(step, dkv[0], dkv[1])  # after the last step: the hop home
        if works:
            wait_handles(works)
            cur, nxt = nxt, cur
    if plan.world > 1:
        wait_handles(dkv_works)
        dkv.reverse()
    return dq, dkv[0]
