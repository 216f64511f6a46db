"""The Ulysses exchange engine: sequence-sharded <-> head-sharded all-to-alls per HCMS chunk, on a
communication stream joined to the compute stream by events (CPU: the same code in program order).

``exchange_all_chunks`` puts every chunk's seq->head exchange in flight at once; ``attend_and_send`` runs each
chunk's attention as soon as its inputs arrive and starts its output's head->seq exchange as soon as it is
done (every Ulysses-family Function's forward loop); ``send_head_major`` / ``alloc`` / ``transport_of`` are the
buffers and transport of the reverse exchanges the Functions' backwards issue.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...comm import streams as st
from ...comm.transport import NcclTransport, table_head_to_seq, table_seq_to_head
from . import layout as lay
from .attend import attend, explicit_kernels
from .plan import AttendPlan


def alloc(numel: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised flat receive buffer of ``numel`` elements in ``like``'s dtype and device."""
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def exchange_all_chunks(parts, kinds, plan: AttendPlan, tokens: int, d: int, compute, comm):
    """Seq-sharded ``parts`` -> one head-sharded flat buffer per chunk, all exchanges in flight at once.

    Receive buffers are allocated on the compute stream (their readers); packing and the collectives
    run on ``comm``. Returns (buffers, events): ``events[c]`` fires when chunk c has arrived.
    """
    hl, me, like = plan.heads, plan.rank, parts[0]
    tr = transport_of(plan)
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
        oc, kept = attend(plan, qc, kc, vc, explicit)
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
        send_o = send_head_major(oc, tr, plan.order)
        if comm is not None:  # a compute-stream tensor (maybe sent in place) read by the comm stream
            oc.record_stream(comm)
        splits = lay.seg_splits(plan.heads, ("q",), c, tokens, d)
        recv_o = alloc(sum(splits), out)
        tr.all_to_all(send_o, recv_o, None, splits, table=table_head_to_seq(splits))
        lay.unpack(recv_o, (out,), ("q",), plan.heads, c, plan.seq_layout)
