"""Ulysses sequence-parallel attention and its head-chunked multi-stream form (HCMS).

One autograd Function covers both: ``chunks == 1`` is plain Ulysses, ``chunks > 1`` pipelines the
heads of each rank in C chunks (HCMS, Algorithm 1). Forward: all input exchanges are issued on the
communication stream first (one collective per chunk carrying q|k|v side by side), then chunk c's
attention runs on the compute stream as soon as its event fires, and its output exchange starts on
the communication stream as soon as the attention's event fires. Backward mirrors it: grad-output
exchange per chunk, attention backward per chunk, then the chunk's dq, dk, dv exchanges (one per
tensor by default, freed as they go; one packed exchange with ``qkv_contiguous=False``). On CPU
the same code runs in program order (no streams), so tests cover its logic.

Because every head is computed by the same kernel on the same data whatever the chunking,
HCMS is bit-identical to plain Ulysses on the same backend.

Saved state: with SDPA-family backends each chunk's attention runs the fused kernel's own forward and
backward (with log-sum-exp) and its (q, k, v, out, lse) sit in autograd's saved tensors (``hold``), so
activation checkpointing drops them and recomputes the call once (key padding included); other backends
keep an inner autograd graph per chunk (``attend``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist

from torch.autograd.function import once_differentiable

from ..attention.backends import LocalAttention, SDPABackend, get_backend
from ..comm import streams as st
from ..comm.transport import NcclTransport, default_transports, table_head_to_seq, table_seq_to_head
from ..config import LAYOUTS
from ..errors import SPConfigError
from . import layout as lay
from .heads import HeadLayout, head_layout

_QKV = ("q", "kv", "kv")


@dataclass
class UlyssesPlan:
    """Everything one call needs that depends only on shapes and settings."""

    group: dist.ProcessGroup
    rank: int
    heads: HeadLayout
    seq_layout: str
    causal: bool
    scale: float
    backend: LocalAttention
    comm_stream: Optional["torch.cuda.Stream"]
    need_grad: bool = True
    qkv_contiguous: bool = True  # hand the kernel contiguous q/k/v and exchange grads one tensor at a time
    transport: Optional[object] = None  # comm.transport object (None: the group's own all_to_all)
    order: Optional[lay.SeqOrder] = None  # gathered (rank) order -> global order; None: already global
    kv_valid_len: Optional[int] = None  # keys at global positions >= this are padding (0 < it < S)
    dropout_p: float = 0.0  # attention dropout inside each chunk's kernel (forces the inner-graph path)


def _alloc(numel: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def _exchange_all_chunks(parts, kinds, plan: "UlyssesPlan", tokens: int, d: int, compute, comm):
    """Seq-sharded ``parts`` -> one head-sharded flat buffer per chunk, all exchanges in flight at once.

    Receive buffers are allocated on the compute stream (their readers); packing and the collectives
    run on ``comm``. Returns (buffers, events): ``events[c]`` fires when chunk c has arrived.
    """
    hl, me, like = plan.heads, plan.rank, parts[0]
    tr = _transport(plan)
    recv = [_alloc(hl.world * tokens * sum(lay.widths(hl, kinds, me, c)) * d, like) for c in range(hl.chunks)]
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


def _transport(plan) -> object:
    return plan.transport if plan.transport is not None else NcclTransport(plan.group)


def _send_head_major(t_bhsd: torch.Tensor, tr, order: Optional[lay.SeqOrder] = None) -> torch.Tensor:
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


def _local_attention(be: LocalAttention, q, k, v, causal: bool, scale: float, valid: Optional[int],
                     dropout_p: float = 0.0):
    """The local kernel on global-order bhsd q/k/v; keys at positions >= ``valid`` are padding: they are
    cut off (one call; causal: a causal call for the valid queries and a full one for the padded rows).
    dropout_p > 0: torch's SDPA with its own dropout instead of ``be`` (under autograd, so the backward
    reuses the forward's mask)."""
    if dropout_p > 0.0:
        be = _DropoutSDPA(dropout_p)
    if valid is None:
        return be(q, k, v, causal=causal, softmax_scale=scale)
    kv = (k[:, :, :valid], v[:, :, :valid])
    if not causal:
        return be(q, *kv, causal=False, softmax_scale=scale)
    head = be(q[:, :, :valid], *kv, causal=True, softmax_scale=scale)
    tail = be(q[:, :, valid:], *kv, causal=False, softmax_scale=scale)
    return torch.cat([head, tail], dim=2)


class _DropoutSDPA(LocalAttention):
    """torch SDPA with attention dropout [B, H, S, D] (GQA allowed); differentiable, no log-sum-exp."""

    name = "sdpa_dropout"

    def __init__(self, dropout_p: float) -> None:
        self.dropout_p = dropout_p

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=softmax_scale, dropout_p=self.dropout_p,
            enable_gqa=k.shape[1] != q.shape[1])


def explicit_kernels(plan, like: torch.Tensor) -> bool:
    """Whether a call runs the kernels' own forward/backward (with log-sum-exp) and keeps each chunk's
    (q, k, v, out, lse) in autograd's saved tensors (``hold``) instead of an inner autograd graph per chunk:
    SDPA-family backends whose log-sum-exp kernel for ``like``'s device and dtype is a fused one (cuDNN or
    flash; not the math fallback, e.g. fp32 on CUDA), gradients wanted. Saved tensors go through autograd's
    saved-tensor hooks, so activation checkpointing drops them and recomputes the call once; an inner graph
    kept on ``ctx`` stayed alive under checkpointing (no memory saved) and was recomputed once per chunk."""
    if not (getattr(plan, "need_grad", True) and isinstance(plan.backend, SDPABackend)):
        return False
    if getattr(plan, "dropout_p", 0.0) > 0.0:  # the kernels' explicit forward/backward carry no dropout mask
        return False
    from ..attention import lse_kernels  # noqa: PLC0415
    kernel = plan.backend.kernel if plan.backend.kernel != "auto" else lse_kernels.best(like.device, like.dtype)
    return kernel != "math"


class _Hold(torch.autograd.Function):
    """A node that only keeps tensors through ``ctx.save_for_backward`` (see ``hold``); never differentiated."""

    @staticmethod
    def forward(ctx, token, *tensors):
        ctx.save_for_backward(*tensors)
        return token.new_empty(0)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - its output is never used
        raise RuntimeError("megatron_sp_ext: a saved-tensor holder was differentiated")


def hold(*tensors: torch.Tensor):
    """Keep ``tensors`` for a backward through autograd's saved-tensor mechanism, so saved-tensor hooks
    (activation checkpointing's) apply; one node per call, freed on its own when dropped. Returns the node's
    (empty) output, which keeps the node alive: ``out.grad_fn.saved_tensors`` gives the tensors back (under
    checkpointing: recomputed once, at the first access)."""
    token = torch.empty(0, device=tensors[0].device, requires_grad=True)
    with torch.enable_grad():
        return _Hold.apply(token, *tensors)


def attend(plan, qc, kc, vc, explicit: bool):
    """Chunk attention on head-sharded bhsd q/k/v. explicit: kernel forward with log-sum-exp, (q, k, v, out,
    lse) held (``hold``); else the backend under autograd (the inner graph) when gradients are wanted.
    Returns (out, what ``attend_backward`` needs or None)."""
    if explicit:
        oc, lse = _forward_lse(plan, qc, kc, vc)
        return oc, hold(qc, kc, vc, oc, lse)
    need_grad = getattr(plan, "need_grad", True)  # the block Functions' plans: always
    if need_grad:
        qc, kc, vc = (t.detach().requires_grad_() for t in (qc, kc, vc))
    with torch.set_grad_enabled(need_grad):
        oc = _local_attention(plan.backend, qc, kc, vc, plan.causal, plan.scale, getattr(plan, "kv_valid_len", None),
                              getattr(plan, "dropout_p", 0.0))
    return oc, ((qc, kc, vc, oc) if need_grad else None)


def attend_backward(plan, c: int, do_c, chunks: list) -> list:
    """Chunk c's (dq, dk, dv), head-sharded bhsd, from what ``attend`` kept in chunks[c] (dropped here: the
    chunk's saved tensors are freed as soon as its gradients exist)."""
    kept, chunks[c] = chunks[c], None
    if isinstance(kept, tuple):  # the inner autograd graph
        qc, kc, vc, oc = kept
        del kept
        return list(torch.autograd.grad(oc, (qc, kc, vc), do_c))
    qc, kc, vc, oc, lse = kept.grad_fn.saved_tensors
    del kept
    return _backward_lse(plan, do_c, qc, kc, vc, oc, lse)


def attend_and_send(views, plan, out, tokens: int, d: int, compute, comm) -> list:
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


def _forward_lse(plan, q, k, v):
    """``_local_attention``'s calls through the backend's kernels with log-sum-exp: (out, lse) over global-order
    bhsd q/k/v; keys at positions >= kv_valid_len are cut off (causal: a causal call for the valid queries
    and a full one for the padded rows, their outputs and lse side by side)."""
    be, valid, scale = plan.backend, getattr(plan, "kv_valid_len", None), plan.scale
    if valid is None:
        return be.forward_lse(q, k, v, causal=plan.causal, softmax_scale=scale)
    kv = (k[:, :, :valid], v[:, :, :valid])
    if not plan.causal:
        return be.forward_lse(q, *kv, causal=False, softmax_scale=scale)
    head = be.forward_lse(q[:, :, :valid], *kv, causal=True, softmax_scale=scale)
    tail = be.forward_lse(q[:, :, valid:], *kv, causal=False, softmax_scale=scale)
    return torch.cat([head[0], tail[0]], dim=2), torch.cat([head[1], tail[1]], dim=2)


def _backward_lse(plan, do, q, k, v, out, lse) -> list:
    """The gradients of ``_forward_lse``: [dq, dk, dv] (padded keys get zero gradients)."""
    be, valid, scale = plan.backend, getattr(plan, "kv_valid_len", None), plan.scale
    if valid is None:
        return list(be.backward_lse(do, q, k, v, out, lse, causal=plan.causal, softmax_scale=scale))
    kv = (k[:, :, :valid], v[:, :, :valid])
    if not plan.causal:
        dq, dk_v, dv_v = be.backward_lse(do, q, *kv, out, lse, causal=False, softmax_scale=scale)
    else:
        cut = (slice(None), slice(None), slice(None, valid))
        rest = (slice(None), slice(None), slice(valid, None))
        dq1, dk1, dv1 = be.backward_lse(do[cut], q[cut], *kv, out[cut], lse[cut], causal=True, softmax_scale=scale)
        dq2, dk2, dv2 = be.backward_lse(do[rest], q[rest], *kv, out[rest], lse[rest], causal=False,
                                        softmax_scale=scale)
        dq, dk_v, dv_v = torch.cat([dq1, dq2], dim=2), dk1 + dk2, dv1 + dv2
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[:, :, :valid], dv[:, :, :valid] = dk_v, dv_v
    return [dq, dk, dv]


def _exchange_out_chunk(oc, out, plan: "UlyssesPlan", c: int, tokens: int, d: int, compute, comm) -> None:
    """Chunk c's attention output oc [B, h_c, S, D] (head-sharded) -> its heads of ``out`` (local
    layout), on ``comm`` once the compute stream's work so far is done."""
    done = st.record(compute)
    with st.on_stream(comm):
        st.wait(comm, done)
        tr = _transport(plan)
        send_o = _send_head_major(oc, tr, getattr(plan, "order", None))  # async_block's plan has no order
        if comm is not None:  # a compute-stream tensor (maybe sent in place) read by the comm stream
            oc.record_stream(comm)
        splits = lay.seg_splits(plan.heads, ("q",), c, tokens, d)
        recv_o = _alloc(sum(splits), out)
        tr.all_to_all(send_o, recv_o, None, splits, table=table_head_to_seq(splits))
        lay.unpack(recv_o, (out,), ("q",), plan.heads, c, plan.seq_layout)


class _UlyssesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: UlyssesPlan):
        hl, world = plan.heads, plan.heads.world
        me, lay_ = plan.rank, plan.seq_layout
        s_loc, bsz = (q.shape[1], q.shape[0]) if lay_ == "bshd" else (q.shape[0], q.shape[1])
        d = q.shape[-1]
        tokens = s_loc * bsz
        compute, comm = st.current(q.device), plan.comm_stream
        out = torch.empty_like(q)
        recv_in, ev_in = _exchange_all_chunks((q, k, v), _QKV, plan, tokens, d, compute, comm)

        def views(c):
            st.wait(compute, ev_in[c])
            ws = lay.widths(hl, _QKV, me, c)
            buf, recv_in[c] = recv_in[c].view(world * s_loc, bsz, sum(ws), d), None
            if plan.qkv_contiguous or plan.order is not None:
                # [B, S, h, D]-backed copies in global order (the kernel's native layout; the placement's
                # permutation rides on this copy); the buffer is freed with this frame
                return [lay.to_kernel_layout(t, plan.order) for t in lay.columns_sbhd(buf, ws)]
            return lay.columns(buf, ws)  # zero-copy views of the received buffer
        chunks = attend_and_send(views, plan, out, tokens, d, compute, comm)
        ctx.plan, ctx.chunks = plan, chunks
        ctx.shapes = (q.shape, k.shape)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        plan: UlyssesPlan = ctx.plan
        hl, world, C = plan.heads, plan.heads.world, plan.heads.chunks
        me, lay_ = plan.rank, plan.seq_layout
        grad_out = grad_out.contiguous()
        q_shape, kv_shape = ctx.shapes
        s_loc, bsz = (q_shape[1], q_shape[0]) if lay_ == "bshd" else (q_shape[0], q_shape[1])
        d = q_shape[-1]
        tokens = s_loc * bsz
        compute, comm = st.current(grad_out.device), plan.comm_stream
        recv_g, ev_in = _exchange_all_chunks((grad_out,), ("q",), plan, tokens, d, compute, comm)
        dq = dk = dv = None
        for c in range(C):
            st.wait(compute, ev_in[c])
            hq = lay.widths(hl, ("q",), me, c)[0]
            do_c = recv_g[c].view(world * s_loc, bsz, hq, d)
            do_c = do_c.permute(1, 2, 0, 3) if plan.order is None else lay.to_kernel_layout(do_c, plan.order)
            grads = attend_backward(plan, c, do_c, ctx.chunks)
            # peak memory: the chunk's dO is dead now; drop it before the exchanges
            del do_c
            recv_g[c] = None
            if dq is None:  # the local-layout results, allocated once the first chunk's inputs are freed
                dq = torch.empty(q_shape, dtype=grad_out.dtype, device=grad_out.device)
                dk = torch.empty(kv_shape, dtype=grad_out.dtype, device=grad_out.device)
                dv = torch.empty(kv_shape, dtype=grad_out.dtype, device=grad_out.device)
            done = st.record(compute)
            if plan.qkv_contiguous:  # one exchange per gradient, each freed once packed
                with st.on_stream(comm):
                    st.wait(comm, done)
                    tr = _transport(plan)
                    for i, (dst, kind) in enumerate(((dq, "q"), (dk, "kv"), (dv, "kv"))):
                        g, grads[i] = grads[i], None
                        send = _send_head_major(g, tr, plan.order)
                        if comm is not None:  # a compute-stream tensor read by the comm stream: guard its reuse
                            g.record_stream(comm)
                        del g
                        splits = lay.seg_splits(hl, (kind,), c, tokens, d)
                        recv = _alloc(sum(splits), grad_out)
                        tr.all_to_all(send, recv, None, splits, table=table_head_to_seq(splits))
                        lay.unpack(recv, (dst,), (kind,), hl, c, lay_)
                        del send, recv
                continue
            with st.on_stream(comm):
                st.wait(comm, done)
                ws = lay.widths(hl, _QKV, me, c)
                tr = _transport(plan)
                flat = tr.send_buffer(world * s_loc * bsz * sum(ws) * d, grad_out)
                send = flat.view(world * s_loc, bsz, sum(ws), d)
                for view, g in zip(lay.columns_sbhd(send, ws), grads):
                    lay.to_send_layout(g, plan.order, view)
                if comm is not None:  # compute-stream tensors read by the comm stream: guard their reuse
                    for g in grads:
                        g.record_stream(comm)
                del grads
                splits = lay.seg_splits(hl, _QKV, c, tokens, d)
                recv = _alloc(sum(splits), grad_out)
                tr.all_to_all(flat, recv, None, splits, table=table_head_to_seq(splits))
                lay.unpack(recv, (dq, dk, dv), _QKV, hl, c, lay_)
        if comm is not None:
            compute.wait_stream(comm)
        return dq, dk, dv, None


_VALIDATED: set = set()


def local_order(placement: str, world: int, s_loc: int, causal: bool,
                kv_valid_len: Optional[int]) -> tuple[Optional[lay.SeqOrder], Optional[int]]:
    """(order, valid) for one call: the piece permutation that puts the gathered sequence in global order
    (None when it already is, or when nothing depends on positions: non-causal without padding), and the
    padding cut (None: no key is padding). Raises SPConfigError for a bad placement or kv_valid_len."""
    seqlen = s_loc * world
    if kv_valid_len is not None and kv_valid_len >= seqlen:
        kv_valid_len = None  # nothing is padding
    if kv_valid_len is not None and kv_valid_len < 1:
        raise SPConfigError(f"kv_valid_len={kv_valid_len} leaves no key to attend: use 1..{seqlen}")
    if not causal and kv_valid_len is None:
        return None, None
    return _seq_order(placement, world, seqlen), kv_valid_len


@lru_cache(maxsize=256)
def _seq_order(placement: str, world: int, seqlen: int) -> Optional[lay.SeqOrder]:
    from .placement import pieces  # noqa: PLC0415
    return lay.seq_order([pieces(placement, p, world, seqlen) for p in range(world)])


def _check_inputs(q, k, v, layout: str, group) -> None:
    if layout not in LAYOUTS:
        raise SPConfigError(f"layout={layout!r} is invalid: choose one of {', '.join(LAYOUTS)}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise SPConfigError(f"q, k, v must be 4-D ({layout}); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise SPConfigError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2]:
        raise SPConfigError(f"q and k/v disagree on batch/sequence ({layout}): {tuple(q.shape)} vs {tuple(k.shape)}")
    if q.shape[3] != k.shape[3]:
        raise SPConfigError(f"head_dim mismatch: q has {q.shape[3]}, k/v have {k.shape[3]}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise SPConfigError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    key = (id(group), tuple(q.shape), tuple(k.shape), layout)
    if key in _VALIDATED:
        return
    check_same_shape_across_ranks(q, group, what="sequence shard (q)")
    _VALIDATED.add(key)


def check_same_shape_across_ranks(x: torch.Tensor, group, what: str) -> None:
    """One all_gather of the shape; raises on every rank if any rank's shape differs."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor(list(x.shape), dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    allv = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(allv, mine, group=group)
    shapes = [tuple(t.tolist()) for t in allv]
    if len(set(shapes)) != 1:
        raise SPConfigError(f"{what} shapes differ across ranks: {shapes}; every rank must hold an equal shard")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, *,
                      head_chunks: "int | str" = 1, causal: bool = False, softmax_scale: Optional[float] = None,
                      layout: str = "bshd", backend: "str | LocalAttention" = "sdpa",
                      comm_stream: Optional["torch.cuda.Stream"] = None,
                      policy=None, placement: str = "contiguous",
                      kv_valid_len: Optional[int] = None, qkv_contiguous: bool = True,
                      transport: "str | object" = "nccl", seq_order: Optional[lay.SeqOrder] = None,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Ulysses (head_chunks=1) or HCMS (head_chunks>1 or "auto") attention over ``group``.

    q: [B, S_loc, H, D] ("bshd") or [S_loc, B, H, D] ("sbhd"), this rank's sequence shard.
    k, v: same with Hkv heads (H % Hkv == 0). Returns the attention output in q's layout and shape.
    placement: which tokens each rank holds ("contiguous", "zigzag", "tasp_zigzag"); it matters
    only for causal masks and for ``kv_valid_len`` (keys at global positions >= kv_valid_len are
    padding and get no attention). The placement's permutation is folded into the copies around the
    exchanges (received q/k/v -> kernel layout in global order; output and gradients -> send buffers in
    rank order), so every placement runs ONE kernel call per chunk (causal or not) at the speed of
    "contiguous". Padding cuts the keys off (non-causal: one call; causal: a causal call for the valid
    queries and a full call for the padded query rows).
    qkv_contiguous (default True): copy each chunk's q/k/v into the kernel's native [B, S, h, D]
    layout and exchange gradients one tensor at a time; False keeps the zero-copy packed q|k|v views
    and one gradient exchange per chunk. Same math, bit for bit; measured on 4 x H200 the default
    needs ~25% less fwd+bwd peak memory at equal speed (tools/results/.../contig_ab_p4.md).
    transport: "nccl" (the group's all_to_all, default), "symm_mem" (copy-engine pulls between barrier
    kernels) or "copy_engine" (copy-engine pulls ordered by stream-memory flags, no kernel), both through
    torch symmetric memory with CUDA tensors and an NCCL group; or a transport object. Same math.
    seq_order (advanced; hybrid meshes): an explicit permutation of the gathered sequence into the order
    ``backend`` expects (a ring backend that knows the runs), applied instead of the placement's.
    dropout_p: attention dropout inside the local attention (torch SDPA's own, under autograd so that the
    backward uses the forward's mask; pass 0 in eval). Each head chunk draws its own mask.
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise SPConfigError(f"dropout_p={dropout_p!r} is invalid: use a probability in [0, 1)")
    _check_inputs(q, k, v, layout, group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    be = get_backend(backend)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    tr = default_transports().get(transport, group, q.device)
    if head_chunks == "auto":
        from .policy import default_policy  # noqa: PLC0415
        head_chunks = (policy or default_policy()).choose(q, k, group, causal=causal, layout=layout,
                                                        scale=scale, backend=be, comm_stream=comm_stream,
                                                        transport=tr)
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int):
        raise SPConfigError(f"head_chunks={head_chunks!r} is invalid: use a positive integer or 'auto'")
    hl = head_layout(q.shape[2], k.shape[2], world, head_chunks)
    if hl.kv_repeat > 1:
        k = k.repeat_interleave(hl.kv_repeat, dim=2)
        v = v.repeat_interleave(hl.kv_repeat, dim=2)
    s_loc = q.shape[1] if layout == "bshd" else q.shape[0]
    order, valid = local_order(placement, world, s_loc, causal, kv_valid_len)
    if seq_order is not None:
        order = seq_order
    # one chunk has nothing to overlap: run on the caller's stream, no side stream and no events (less
    # host work per call, which is what short calls are bound by); same kernels, same order
    stream = None if hl.chunks == 1 else (comm_stream if comm_stream is not None
                                          else st.default_pool().comm_stream(q.device))
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    plan = UlyssesPlan(group, rank, hl, layout, causal, scale, be, stream, need_grad, qkv_contiguous, tr,
                       order, valid, float(dropout_p))
    if world == 1:  # one rank: its placement is global order
        qb, kb, vb = ((t.transpose(1, 2) if layout == "bshd" else t.permute(1, 2, 0, 3)) for t in (q, k, v))
        o = _local_attention(be, qb, kb, vb, causal, scale, valid, float(dropout_p))
        return o.transpose(1, 2) if layout == "bshd" else o.permute(2, 0, 1, 3)
    return _UlyssesFn.apply(q, k, v, plan)
