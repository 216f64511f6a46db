"""Ulysses on pre-packed q|k|v: the producer writes the input exchange's send layout itself.

Plain Ulysses copies around its exchanges: q, k, v into the send buffer (pack), the received
buffer into the kernel's layout, and received gradients back into dq, dk, dv (unpack). Here the
caller hands over the send buffers (``pack_qkv``, which torch.compile fuses into the QK-norm /
RoPE kernel that produces q and k), attention reads the received buffer in place, and the
gradients are returned in the send layout, straight from the reverse exchange; ``pack_qkv``'s
backward (fused the same way) turns them into the producer's gradients. What remains: the output
and dO exchanges (zero-copy sends for B == 1) and the output / gradient copies into the send
buffers of the reverse exchanges.

Send layout of chunk c (even heads: H and the replicated Hkv divisible by P): [P, S_loc, B, w_c, D],
segment p = q | k | v of peer p's heads in HCMS chunk c, for this rank's tokens (the layout
``layout.pack`` writes). Same kernels on the same values as ``ulysses_attention(...,
qkv_contiguous=False)``, so equal to it bit for bit on one backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from torch.autograd.function import once_differentiable

from ...attention.backends import LocalAttention, get_backend
from ...comm import streams as st
from ...comm.transport import default_transports, table_head_to_seq, table_seq_to_head
from ...config import DEFAULT_PLACEMENT
from ...errors import SPConfigError
from ..checks import valid_kv_len
from ..problem import AttentionProblem, problem_from_keywords
from ..heads import HeadLayout, head_layout
from . import layout as lay
from .attend import attend_backward
from .engine import attend_and_send, by_piece, exchange_all_chunks, receive_pieces
from .function import ulysses_attention
from .plan import local_order
from .policy import ChunkPolicy, default_policy

_QKV = ("q", "kv", "kv")


def packed_head_layout(num_heads: int, num_kv_heads: int, world: int, head_chunks: int) -> HeadLayout:
    """The HeadLayout of a packed call; raises SPConfigError when the heads do not split evenly (the send
    layout is one [P, S, B, w, D] tensor per chunk only then)."""
    hl = head_layout(num_heads, num_kv_heads, world, head_chunks)
    if not hl.even:
        raise SPConfigError(f"packed q|k|v needs heads divisible by the SP size: H={num_heads}, "
                            f"Hkv={num_kv_heads} (x{hl.kv_repeat} replicated), P={world}; use ulysses_attention")
    return hl


def packable(num_heads: int, num_kv_heads: int, world: int, head_chunks: int) -> bool:
    """Whether ``packed_head_layout`` accepts these sizes."""
    try:
        packed_head_layout(num_heads, num_kv_heads, world, head_chunks)
    except SPConfigError:
        return False
    return True


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hl: HeadLayout) -> list[torch.Tensor]:
    """q [B, S_loc, H, D], k, v [B, S_loc, Hkv, D] ("bshd") -> per HCMS chunk c the send buffer
    [P, S_loc, B, w_c, D] (contiguous). Differentiable; compile it together with the ops that make q, k, v
    so the layout change is the store of that kernel, not a copy of its own."""
    if hl.kv_repeat > 1:
        k, v = (t.repeat_interleave(hl.kv_repeat, dim=2) for t in (k, v))
    return [torch.cat([lay.all_peers_view(t, hl, kind, c, "bshd") for t, kind in zip((q, k, v), _QKV)], dim=3)
            for c in range(hl.chunks)]


@dataclass
class PackedPlan:
    group: dist.ProcessGroup
    heads: HeadLayout
    q_shape: tuple            # [B, S_loc, H, D]
    causal: bool
    scale: float
    backend: LocalAttention
    comm_stream: Optional["torch.cuda.Stream"]
    transport: object
    order: Optional[lay.SeqOrder]
    kv_valid_len: Optional[int]
    seq_layout: str = "bshd"
    rank: int = 0
    need_grad: bool = True
    dropout_p: float = 0.0  # packed calls carry no attention dropout


def _start_exchanges(sends: Sequence[torch.Tensor], plan: PackedPlan, compute, comm, in_order: bool = False):
    """Every chunk's seq->head exchange in flight at once, straight from the caller's buffers (every transport
    takes any contiguous send buffer). Returns (recv buffers, arrival events); with ``in_order`` (``by_piece``)
    each buffer holds the gathered sequence in global order (one list all-to-all per piece slot)."""
    tr, hl = plan.transport, plan.heads
    tokens = plan.q_shape[0] * plan.q_shape[1]
    d = plan.q_shape[3]
    recv = [torch.empty(s.numel(), dtype=s.dtype, device=s.device) for s in sends]
    ready = st.record(compute)
    events, works = [], []
    with st.on_stream(comm):
        st.wait(comm, ready)
        for c, send in enumerate(sends):
            flat = send.view(-1)
            if comm is not None:
                send.record_stream(comm)
            splits = lay.seg_splits(hl, _QKV, c, tokens, d)
            if in_order:
                works.extend(receive_pieces(flat, splits, plan.order, recv[c], tr))
                works.append(None)  # chunk c's last work: its event follows
                continue
            w = tr.all_to_all(flat, recv[c], splits, None, async_op=True, table=table_seq_to_head(splits))
            if tr.stream_ordered:
                events.append(st.record(comm))
            else:
                works.append(w)
        if in_order:
            for w in works:
                if w is None:
                    events.append(st.record(comm))
                else:
                    w.wait()
            return recv, events
        for w in works:
            w.wait()
            events.append(st.record(comm))
    return recv, events


class _PackedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: PackedPlan, *sends):
        hl, world = plan.heads, plan.heads.world
        bsz, s_loc, _, d = plan.q_shape
        tokens = s_loc * bsz
        compute, comm = st.current(sends[0].device), plan.comm_stream
        out = torch.empty(plan.q_shape, dtype=sends[0].dtype, device=sends[0].device)
        in_order = by_piece(plan, bsz, sends[0].device)  # the exchange lands q|k|v in global order (B == 1, engine.by_piece)
        recv, events = _start_exchanges(sends, plan, compute, comm, in_order)

        def views(c):
            st.wait(compute, events[c])
            ws = lay.widths(hl, _QKV, plan.rank, c)
            buf, recv[c] = recv[c].view(world * s_loc, bsz, sum(ws), d), None
            if plan.order is None or in_order:  # attention reads the received buffer in place
                return lay.columns(buf, ws)
            # the placement's permutation rides on one copy into the kernel layout
            return [lay.to_kernel_layout(t, plan.order) for t in lay.columns_sbhd(buf, ws)]
        ctx.plan, ctx.chunks = plan, attend_and_send(views, plan, out, tokens, d, compute, comm)
        ctx.send_shapes = [s.shape for s in sends]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        plan: PackedPlan = ctx.plan
        hl, world = plan.heads, plan.heads.world
        bsz, s_loc, _, d = plan.q_shape
        tokens = s_loc * bsz
        grad_out = grad_out.contiguous()
        compute, comm = st.current(grad_out.device), plan.comm_stream
        in_order = by_piece(plan, bsz, grad_out.device)  # dO lands in global order: already the kernel's layout (B == 1)
        recv_g, ev_in = exchange_all_chunks((grad_out,), ("q",), plan, tokens, d, compute, comm, land_global=in_order)
        grads_packed = []
        for c in range(hl.chunks):
            st.wait(compute, ev_in[c])
            ws = lay.widths(hl, _QKV, plan.rank, c)
            do_c = recv_g[c].view(world * s_loc, bsz, ws[0], d)
            do_c = do_c.permute(1, 2, 0, 3) if plan.order is None or in_order else \
                lay.to_kernel_layout(do_c, plan.order)
            grads = attend_backward(plan, c, do_c, ctx.chunks)
            del do_c
            recv_g[c] = None
            done = st.record(compute)
            with st.on_stream(comm):
                st.wait(comm, done)
                tr = plan.transport
                flat = tr.send_buffer(world * tokens * sum(ws) * d, grad_out)
                for i, view in enumerate(lay.columns_sbhd(flat.view(world * s_loc, bsz, sum(ws), d), ws)):
                    g, grads[i] = grads[i], None
                    lay.to_send_layout(g, plan.order, view)
                    if comm is not None:  # a compute-stream tensor read by the comm stream: guard its reuse
                        g.record_stream(comm)
                    del g  # each gradient is freed once packed (peak memory)
                with st.on_stream(compute):  # allocated once the gradients are freed, on its reader's stream
                    received = torch.empty(ctx.send_shapes[c], dtype=grad_out.dtype, device=grad_out.device)
                if comm is not None:  # written by the comm stream
                    received.record_stream(comm)
                splits = lay.seg_splits(hl, _QKV, c, tokens, d)
                # head-sharded grads -> this rank's tokens, landing in the send layout: the gradient of chunk c
                tr.all_to_all(flat, received.view(-1), None, splits, table=table_head_to_seq(splits))
            grads_packed.append(received)
        if comm is not None:
            compute.wait_stream(comm)
        ctx.plan = ctx.chunks = None  # nothing of the call (its group, transport) outlives its gradients
        return (None, *grads_packed)


class PackedUlysses:
    """A packed Ulysses / HCMS entry bound to a group, for a model's layer that can write q|k|v itself.

    ``layout(H, Hkv, q_like)`` is the HeadLayout to pack for, or None (heads not divisible by the SP size, or a
    group of one rank): then the layer keeps its plain path. ``entry(H, Hkv, kv_valid_len, *sends)`` runs the
    attention. head_chunks: an int, or "auto": ``policy`` (an HCMSPolicy, shared with the plain path) picks the
    count per shape from its own calibration; ``q_like`` ([B, S_loc, H, D], dtype and device of q; a
    zero-stride view will do) gives it the shape.
    """

    def __init__(self, group: dist.ProcessGroup, head_chunks: "int | str", *, backend: "str | LocalAttention" = "auto",
                 transport: "str | object" = "nccl", causal: bool = False,
                 comm_stream: Optional["torch.cuda.Stream"] = None, policy: Optional[ChunkPolicy] = None) -> None:
        if head_chunks != "auto" and (isinstance(head_chunks, bool) or not isinstance(head_chunks, int)):
            raise SPConfigError(f"head_chunks={head_chunks!r} is invalid: use a positive integer or 'auto'")
        self.group, self.chunks, self.backend, self.transport = group, head_chunks, backend, transport
        self.causal, self.comm_stream, self.policy = causal, comm_stream, policy

    def layout(self, num_heads: int, num_kv_heads: int,
               q_like: Optional[torch.Tensor] = None) -> Optional[HeadLayout]:
        world = dist.get_world_size(self.group)
        if world == 1:
            return None  # one rank: nothing to exchange, the plain local path is cheaper
        chunks = self.chunks
        if chunks == "auto":
            if q_like is None:
                raise SPConfigError("PackedUlysses with head_chunks='auto' needs q_like (q's shape, dtype, device)")
            d = q_like.shape[-1]
            k_like = q_like[:, :, :1].expand(*q_like.shape[:2], num_kv_heads, d)
            be = get_backend(self.backend)
            tr = default_transports().get(self.transport, self.group, q_like.device)
            chunks = (self.policy or default_policy()).chunks_for(
                q_like, k_like, self.group, causal=self.causal, layout="bshd", scale=1.0 / math.sqrt(d), backend=be,
                comm_stream=self.comm_stream, transport=tr, attention=ulysses_attention)
        if not packable(num_heads, num_kv_heads, world, chunks):
            return None
        return packed_head_layout(num_heads, num_kv_heads, world, chunks)

    def __call__(self, num_heads: int, num_kv_heads: int, problem: "AttentionProblem | int | None",
                 *sends: torch.Tensor) -> torch.Tensor:
        """The attention of ``sends`` for ``problem`` (an ``AttentionProblem`` built once per step; or, the old
        form, its kv_valid_len: a problem per call), this entry's causal flag."""
        if not isinstance(problem, AttentionProblem):
            problem = AttentionProblem(causal=self.causal, kv_valid_len=problem)
        return packed_ulysses_attention(list(sends), self.group, problem, num_heads=num_heads,
                                        num_kv_heads=num_kv_heads, head_chunks=len(sends), backend=self.backend,
                                        comm_stream=self.comm_stream, transport=self.transport)


PACKED_OPTIONS = {"comm_stream": None, "transport": "nccl"}   # packed_ulysses_attention's options and defaults


def packed_ulysses_attention(sends: Sequence[torch.Tensor], group: dist.ProcessGroup,
                             problem: Optional[AttentionProblem] = None, *, num_heads: int, num_kv_heads: int,
                             head_chunks: int = 1, backend: "str | LocalAttention" = "auto",
                             **keywords) -> torch.Tensor:
    """Ulysses / HCMS attention on ``sends`` = ``pack_qkv(q, k, v, layout)``; returns [B, S_loc, H, D] ("bshd").

    sends[c]: [P, S_loc, B, w_c, D] for chunk c of ``packed_head_layout(num_heads, num_kv_heads, P,
    head_chunks)``. problem: the ``AttentionProblem`` (causal, placement, kv_valid_len, softmax_scale; "bshd"), or its
    settings as keywords; options comm_stream, transport (``PACKED_OPTIONS``). Other arguments as in
    ``ulysses_attention``. Gradients come back in the same layout. The problem is agreed across ranks on its first
    call over ``group`` (one all_gather every rank reaches, with this rank's refusal of its buffers folded in).
    """
    problem, opts = problem_from_keywords("packed_ulysses_attention", problem, keywords, tuple(PACKED_OPTIONS))
    opts = {**PACKED_OPTIONS, **opts}
    try:
        plan = _packed_plan(sends, group, problem, num_heads, num_kv_heads, head_chunks, backend, opts)
        error = None
    except SPConfigError as e:
        plan, error = None, e
    if dist.get_world_size(group) > 1:
        x = sends[0] if len(sends) else torch.empty(0)
        problem.agree(group, x, x, x, what="packed_ulysses_attention", error=error)
    elif error is not None:
        raise error
    return _PackedFn.apply(plan, *sends)


def _packed_plan(sends, group, problem: AttentionProblem, num_heads: int, num_kv_heads: int, head_chunks: int,
                 backend, opts: dict) -> PackedPlan:
    """The plan of one packed call, after every local check (SPConfigError naming the mismatch)."""
    causal, placement, softmax_scale = problem.causal, problem.placement, problem.softmax_scale
    if problem.layout != "bshd" or problem.cu_seqlens is not None or problem.block_mask is not None \
            or problem.dropout_p:
        raise SPConfigError("packed_ulysses_attention takes a problem of layout 'bshd' without cu_seqlens, "
                            "block_mask or dropout_p: use ulysses_attention for those")
    comm_stream, transport = opts["comm_stream"], opts["transport"]
    world = dist.get_world_size(group)
    hl = packed_head_layout(num_heads, num_kv_heads, world, head_chunks)
    if len(sends) != hl.chunks:
        raise SPConfigError(f"packed q|k|v has {len(sends)} chunk buffers; head_chunks={head_chunks} needs {hl.chunks}")
    p, s_loc, bsz, _, d = sends[0].shape
    if p != world:
        raise SPConfigError(f"packed q|k|v was packed for {p} ranks; the group has {world}")
    for c, s in enumerate(sends):
        w = sum(lay.widths(hl, _QKV, 0, c))
        if tuple(s.shape) != (world, s_loc, bsz, w, d) or not s.is_contiguous():
            raise SPConfigError(f"packed chunk {c}: expected a contiguous {(world, s_loc, bsz, w, d)} buffer, "
                                f"got {tuple(s.shape)}; build it with pack_qkv")
    kv_valid_len = valid_kv_len(problem.kv_valid_len, s_loc * world)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    order, valid = local_order(placement, world, s_loc, causal, kv_valid_len)
    stream = None if hl.chunks == 1 else (comm_stream if comm_stream is not None
                                          else st.default_pool().comm_stream(sends[0].device))
    tr = default_transports().get(transport, group, sends[0].device)
    need_grad = torch.is_grad_enabled() and any(s.requires_grad for s in sends)
    return PackedPlan(group, hl, (bsz, s_loc, num_heads, d), causal, scale, get_backend(backend), stream, tr,
                      order, valid, "bshd", dist.get_rank(group), need_grad)
