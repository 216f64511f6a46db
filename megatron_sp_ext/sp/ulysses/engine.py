"""The Ulysses exchange engine: sequence-sharded <-> head-sharded all-to-alls per HCMS chunk, on a
communication stream joined to the compute stream by events (CPU: the same code in program order).

``exchange_all_chunks`` puts every chunk's seq->head exchange in flight at once; ``attend_and_send`` runs each
chunk's attention as soon as its inputs arrive and starts its output's head->seq exchange as soon as it is
done (every Ulysses-family Function's forward loop); ``send_head_major`` / ``alloc`` / ``transport_of`` are the
buffers and transport of the reverse exchanges the Functions' backwards issue.

Placement permutations without a copy (``by_piece``): with a placement order (causal zigzag, padding) and B == 1,
the head-sharded side's [S, h, D] rows of one placement piece are contiguous, so the group's own all-to-all runs
once per piece slot (list form, one contiguous view per peer) and lands or reads each piece at its global
position: the output and gradient sends read the kernel's results in place (``send_to_seq``), the backward's dO
lands in the kernel's layout and order, and the forward's q|k|v land in global order (``exchange_all_chunks(...,
land_global=True)``; their copy into the kernel's dense layout becomes a plain copy, and the zero-copy views of
``qkv_contiguous=False`` / packed q|k|v now serve these placements too). The same values move; only the index
copies that carried the permutation are gone.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...comm import streams as st
from ...comm.transport import NcclTransport, table_head_to_seq, table_seq_to_head
from . import layout as lay
from .attend import attend, explicit_kernels
from .plan import AttendPlan


def alloc(numel: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised flat receive buffer of ``numel`` elements in ``like``'s dtype and device."""
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def exchange_all_chunks(parts, kinds, plan: AttendPlan, tokens: int, d: int, compute, comm,
                        land_global: bool = False):
    """Seq-sharded ``parts`` -> one head-sharded flat buffer per chunk, all exchanges in flight at once.

    Receive buffers are allocated on the compute stream (their readers); packing and the collectives
    run on ``comm``. Returns (buffers, events): ``events[c]`` fires when chunk c has arrived. Each buffer is
    [S, B, w, D] in rank order, or in global order with ``land_global`` (only where ``by_piece(plan, B)``).
    """
    hl, me, like = plan.heads, plan.rank, parts[0]
    tr = transport_of(plan)
    if land_global:
        return _exchange_pieces_in(parts, kinds, plan, tokens, d, compute, comm)
    recv = [alloc(hl.world * tokens * sum(lay.widths(hl, kinds, me, c)) * d, like) for c in range(hl.chunks)]
    ready = st.record(compute)
    events = []
    with st.on_stream(comm):
        st.wait(comm, ready)
        if tr.stream_ordered:  # copy-engine: pack chunk c straight into the workspace, exchange, next
            for c in range(hl.chunks):
                splits = lay.seg_splits(hl, kinds, c, tokens, d)
                buf = tr.send_buffer(sum(splits), like)
                splits = lay.pack(parts, kinds, hl, c, plan.seq_layout, buf)
                tr.all_to_all(buf, recv[c], splits, table=table_seq_to_head(splits))
                events.append(st.record(comm))
            return recv, events
        sends = []
        for c in range(hl.chunks):
            buf = tr.send_buffer(sum(lay.seg_splits(hl, kinds, c, tokens, d)), like)
            sends.append((buf, lay.pack(parts, kinds, hl, c, plan.seq_layout, buf)))
        works = [tr.all_to_all(buf, recv[c], splits, None, async_op=True, table=table_seq_to_head(splits))
                 for c, (buf, splits) in enumerate(sends)]
        for w in works:
            w.wait()
            events.append(st.record(comm))
        # send buffers live on the comm stream, whose later work is ordered after these waits,
        # so dropping them now cannot race (and keeps the peak low)
        del sends, works
    return recv, events


def transport_of(plan) -> object:
    return plan.transport if plan.transport is not None else NcclTransport(plan.group)


def send_head_major(t_bhsd: torch.Tensor, tr, order: Optional[lay.SeqOrder] = None) -> torch.Tensor:
    """[B, h, S, D] head-sharded result (global order) -> flat [S, B, h, D] send buffer in rank order (in
    the transport's workspace when it has one). Zero-copy when the result already is that buffer: rank
    order == global order, the group's own all_to_all (no workspace), and [S, B, h, D]-contiguous memory
    (B == 1 with the kernels' native [B, S, h, D] output)."""
    b, h, s, d = t_bhsd.shape
    t_sbhd = t_bhsd.detach().permute(2, 0, 1, 3)
    if order is None and isinstance(tr, NcclTransport) and t_sbhd.is_contiguous():
        return t_sbhd.view(-1)
    send = tr.send_buffer(t_bhsd.numel(), t_bhsd)
    lay.to_send_layout(t_bhsd.detach(), order, send.view(s, b, h, d))
    return send


MAX_PIECE_SLOTS = 4  # collectives per exchange the per-piece path may take (zigzag: 2)


def list_all_to_all_runs(tr, device: torch.device) -> bool:
    """Whether the group of transport ``tr`` runs torch's list all-to-all on ``device`` tensors: NCCL does, gloo on
    CPU tensors only (gloo with CUDA tensors: "Backend gloo does not support alltoall")."""
    return dist.get_backend(tr.group) != "gloo" or torch.device(device).type == "cpu"


def by_piece(plan: AttendPlan, bsz: int, device: torch.device) -> bool:
    """Whether the placement's permutation can ride on the exchange itself (module docstring): an order to apply,
    B == 1, even heads, the group's own all-to-all (NCCL, or gloo on CPU tensors), at most ``MAX_PIECE_SLOTS``
    pieces per rank."""
    order, tr = plan.order, transport_of(plan)
    return (order is not None and bsz == 1 and plan.heads.even and isinstance(tr, NcclTransport)
            and list_all_to_all_runs(tr, device) and len(order.to_global) // plan.heads.world <= MAX_PIECE_SLOTS)


def _slots(order: lay.SeqOrder, world: int) -> list[list[int]]:
    """slots[j][p]: the global piece index of rank p's j-th local piece."""
    k = len(order.to_global) // world
    return [[order.to_global[p * k + j] for p in range(world)] for j in range(k)]


def sends_in_place(t_bhsd: torch.Tensor, tr, order: Optional[lay.SeqOrder], splits) -> bool:
    """Whether ``send_pieces`` can read the head-sharded result ``t_bhsd`` [B, h, S, D] in place: an order to
    apply, the group's own all-to-all (``list_all_to_all_runs``), even heads (equal ``splits``: gloo's list all-to-all takes equal sizes
    only), B == 1 with [S, h, D]-contiguous rows, at most ``MAX_PIECE_SLOTS`` slots."""
    return (order is not None and t_bhsd.shape[0] == 1 and isinstance(tr, NcclTransport)
            and list_all_to_all_runs(tr, t_bhsd.device) and len(set(splits)) == 1 and t_bhsd.permute(2, 0, 1, 3).is_contiguous()
            and len(order.to_global) // len(splits) <= MAX_PIECE_SLOTS)


def send_pieces(t_bhsd: torch.Tensor, tr, order: lay.SeqOrder, recv: torch.Tensor, splits) -> None:
    """The head->seq exchange straight from ``t_bhsd`` (global order; ``sends_in_place``) into ``recv`` (flat,
    rank-order segments of ``splits``, each [S_loc, B, h_src, D]): one list all-to-all per piece slot."""
    u, world = order.piece, len(splits)
    k = len(order.to_global) // world
    t_sbhd = t_bhsd.detach().permute(2, 0, 1, 3)
    segs = [seg.view(k, -1) for seg in recv.split(list(splits))]
    for j, slot in enumerate(_slots(order, world)):
        dist.all_to_all([seg[j] for seg in segs], [t_sbhd[g * u:(g + 1) * u].reshape(-1) for g in slot],
                        group=tr.group)


def send_to_seq(t_bhsd: torch.Tensor, tr, order: Optional[lay.SeqOrder], recv: torch.Tensor, splits) -> None:
    """Head-sharded [B, h, S, D] result (global order) -> ``recv`` (flat, rank-order segments of ``splits``): in
    place per piece where ``sends_in_place``, else ``send_head_major`` (zero-copy where it can) and one exchange."""
    if sends_in_place(t_bhsd, tr, order, splits):
        send_pieces(t_bhsd, tr, order, recv, splits)
        return
    send = send_head_major(t_bhsd, tr, order)
    tr.all_to_all(send, recv, None, splits, table=table_head_to_seq(splits))


def receive_pieces(send: torch.Tensor, splits, order: lay.SeqOrder, recv: torch.Tensor, tr) -> list:
    """The seq->head exchange of ``send`` (flat, one [S_loc, B, w, D] segment per peer, sizes ``splits``) landing
    the gathered sequence in global order in ``recv`` ([S, B, w, D] flat): one async list all-to-all per piece slot
    (``by_piece``). Returns the works."""
    world = len(splits)
    k = len(order.to_global) // world
    rows = recv.view(world * k, -1)  # row g: global piece g
    segs = [seg.view(k, -1) for seg in send.split(list(splits))]
    return [dist.all_to_all([rows[g] for g in slot], [seg[j] for seg in segs], group=tr.group, async_op=True)
            for j, slot in enumerate(_slots(order, world))]


def _exchange_pieces_in(parts, kinds, plan: AttendPlan, tokens: int, d: int, compute, comm):
    """``exchange_all_chunks`` landing each piece at its global position (``by_piece``): per chunk, pack as usual,
    then one list all-to-all per piece slot from each peer's segment into the rows of that piece."""
    hl, me, like, order, world = plan.heads, plan.rank, parts[0], plan.order, plan.heads.world
    tr = transport_of(plan)
    recv = [alloc(world * tokens * sum(lay.widths(hl, kinds, me, c)) * d, like) for c in range(hl.chunks)]
    ready = st.record(compute)
    events = []
    with st.on_stream(comm):
        st.wait(comm, ready)
        sends, works = [], []
        for c in range(hl.chunks):
            buf = tr.send_buffer(sum(lay.seg_splits(hl, kinds, c, tokens, d)), like)
            splits = lay.pack(parts, kinds, hl, c, plan.seq_layout, buf)
            sends.append(buf)
            works.append(receive_pieces(buf, splits, order, recv[c], tr))
        for ws in works:
            for w in ws:
                w.wait()
            events.append(st.record(comm))
        del sends, works  # as in exchange_all_chunks: later comm-stream work is ordered after these waits
    return recv, events


def attend_and_send(views, plan: AttendPlan, out, tokens: int, d: int, compute, comm) -> list:
    """Attention of each HCMS chunk, its output exchange started as soon as it is done (every Ulysses-family
    Function's forward loop).

    views(c) -> chunk c's (q, k, v) head-sharded bhsd [B, n, S, D] (waits for them first); ``out``
    [B, S_local, H, D] receives the exchanged outputs. Returns per chunk what ``attend`` kept for
    ``attend_backward`` (saved tensors that activation checkpointing can drop, or the inner graph).
    """
    chunks, explicit = [], None
    for c in range(plan.heads.chunks):
        qc, kc, vc = views(c)
        if explicit is None:
            explicit = explicit_kernels(plan, qc)
        oc, kept = attend(plan, qc, kc, vc, explicit, c)
        chunks.append(kept)
        _exchange_out_chunk(oc, out, plan, c, tokens, d, compute, comm)
    if comm is not None:
        compute.wait_stream(comm)
    return chunks


def _exchange_out_chunk(oc, out, plan: AttendPlan, c: int, tokens: int, d: int, compute, comm) -> None:
    """Chunk c's attention output oc [B, h_c, S, D] (head-sharded) -> its heads of ``out`` (local
    layout), on ``comm`` once the compute stream's work so far is done."""
    done = st.record(compute)
    with st.on_stream(comm):
        st.wait(comm, done)
        tr = transport_of(plan)
        if comm is not None:  # a compute-stream tensor (maybe sent in place) read by the comm stream
            oc.record_stream(comm)
        splits = lay.seg_splits(plan.heads, ("q",), c, tokens, d)
        recv_o = alloc(sum(splits), out)
        send_to_seq(oc, tr, plan.order, recv_o, splits)
        lay.unpack(recv_o, (out,), ("q",), plan.heads, c, plan.seq_layout)
