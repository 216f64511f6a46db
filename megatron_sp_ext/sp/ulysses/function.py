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

Saved state: with ``AutoBackend``s ("auto" and the fixed fused kernels) each chunk's attention runs the fused
kernel's own forward and backward (with log-sum-exp) and its (q, k, v, out, lse) sit in autograd's saved tensors
(``hold``), so activation checkpointing drops them and recomputes the call once (key padding included); other
backends keep an inner autograd graph per chunk (``attend``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ...attention import block_sparse, tiles
from ...attention.backends import LocalAttention
from ...comm import streams as st
from ...comm.transport import default_transports, table_head_to_seq
from ...config import DEFAULT_PLACEMENT
from ...errors import SPConfigError
from ..heads import head_layout
from . import layout as lay
from .attend import attend_backward, local_attention
from .engine import (alloc, attend_and_send, by_piece, exchange_all_chunks, send_head_major, send_pieces,
                     sends_in_place, transport_of)
from ..placement import PackedSamples
from ..problem import AttentionProblem, BoundProblem, problem_from_keywords, seq_batch
from .plan import UlyssesPlan, local_order, varlen_order
from .policy import ChunkPolicy, default_policy

_QKV = ("q", "kv", "kv")


class _UlyssesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: UlyssesPlan):
        hl, world = plan.heads, plan.heads.world
        me, lay_ = plan.rank, plan.seq_layout
        s_loc, bsz = seq_batch(q.shape, lay_)
        d = q.shape[-1]
        tokens = s_loc * bsz
        compute, comm = st.current(q.device), plan.comm_stream
        out = torch.empty_like(q)
        in_order = by_piece(plan, bsz, q.device)  # the exchange lands q|k|v in global order (B == 1, engine.by_piece)
        recv_in, ev_in = exchange_all_chunks((q, k, v), _QKV, plan, tokens, d, compute, comm, land_global=in_order)
        order = None if in_order else plan.order

        def views(c):
            st.wait(compute, ev_in[c])
            ws = lay.widths(hl, _QKV, me, c)
            buf, recv_in[c] = recv_in[c].view(world * s_loc, bsz, sum(ws), d), None
            if plan.qkv_contiguous or order is not None:
                # [B, S, h, D]-backed copies in global order (the kernel's native layout; a permutation the
                # exchange did not carry rides on this copy); the buffer is freed with this frame
                return [lay.to_kernel_layout(t, order) for t in lay.columns_sbhd(buf, ws)]
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
        s_loc, bsz = seq_batch(q_shape, lay_)
        d = q_shape[-1]
        tokens = s_loc * bsz
        compute, comm = st.current(grad_out.device), plan.comm_stream
        in_order = by_piece(plan, bsz, grad_out.device)  # dO lands in global order: already the kernel's layout (B == 1)
        recv_g, ev_in = exchange_all_chunks((grad_out,), ("q",), plan, tokens, d, compute, comm, land_global=in_order)
        dq = dk = dv = None
        for c in range(C):
            st.wait(compute, ev_in[c])
            hq = lay.widths(hl, ("q",), me, c)[0]
            do_c = recv_g[c].view(world * s_loc, bsz, hq, d)
            do_c = do_c.permute(1, 2, 0, 3) if plan.order is None or in_order else \
                lay.to_kernel_layout(do_c, plan.order)
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
                    tr = transport_of(plan)
                    for i, (dst, kind) in enumerate(((dq, "q"), (dk, "kv"), (dv, "kv"))):
                        g, grads[i] = grads[i], None
                        if comm is not None:  # a compute-stream tensor read by the comm stream: guard its reuse
                            g.record_stream(comm)
                        splits = lay.seg_splits(hl, (kind,), c, tokens, d)
                        if sends_in_place(g, tr, plan.order, splits):  # the placement rides on the exchange
                            recv = alloc(sum(splits), grad_out)
                            send_pieces(g, tr, plan.order, recv, splits)
                            del g
                        else:
                            send = send_head_major(g, tr, plan.order)
                            del g  # freed once packed (peak memory)
                            recv = alloc(sum(splits), grad_out)
                            tr.all_to_all(send, recv, None, splits, table=table_head_to_seq(splits))
                            del send
                        lay.unpack(recv, (dst,), (kind,), hl, c, lay_)
                        del recv
                continue
            with st.on_stream(comm):
                st.wait(comm, done)
                ws = lay.widths(hl, _QKV, me, c)
                tr = transport_of(plan)
                flat = tr.send_buffer(world * s_loc * bsz * sum(ws) * d, grad_out)
                send = flat.view(world * s_loc, bsz, sum(ws), d)
                for view, g in zip(lay.columns_sbhd(send, ws), grads):
                    lay.to_send_layout(g, plan.order, view)
                if comm is not None:  # compute-stream tensors read by the comm stream: guard their reuse
                    for g in grads:
                        g.record_stream(comm)
                del grads
                splits = lay.seg_splits(hl, _QKV, c, tokens, d)
                recv = alloc(sum(splits), grad_out)
                tr.all_to_all(flat, recv, None, splits, table=table_head_to_seq(splits))
                lay.unpack(recv, (dq, dk, dv), _QKV, hl, c, lay_)
        if comm is not None:
            compute.wait_stream(comm)
        ctx.plan = ctx.chunks = None  # nothing of the call (its group, transport) outlives its gradients
        return dq, dk, dv, None


# the Ulysses call's options beside the problem (keywords of ulysses_attention) and their defaults
OPTIONS = {"comm_stream": None, "policy": None, "qkv_contiguous": True, "transport": "nccl",
           "varlen_kernel": "per_sample"}


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                      problem: Optional[AttentionProblem] = None, *, head_chunks: "int | str" = 1,
                      backend: "str | LocalAttention" = "auto", **keywords) -> torch.Tensor:
    """Ulysses (head_chunks=1) or HCMS (head_chunks>1 or "auto") attention over ``group``.

    problem: the ``AttentionProblem`` (causal, placement, kv_valid_len, cu_seqlens, block_mask + tile, dropout_p,
    softmax_scale, layout), built once by the caller; or its settings as keywords (``causal=True``, ...; one problem
    per call, ``block_size`` for ``tile``). Options as keywords: comm_stream, policy, qkv_contiguous, transport,
    varlen_kernel (``OPTIONS``, defaults there).

    q: [B, S_loc, H, D] ("bshd") or [S_loc, B, H, D] ("sbhd"), this rank's sequence shard.
    k, v: same with Hkv heads (H % Hkv == 0). Returns the attention output in q's layout and shape.
    placement: which tokens each rank holds ("contiguous", "zigzag", "tasp_zigzag"); it matters
    only for causal masks and for ``kv_valid_len`` (keys at global positions >= kv_valid_len are
    padding and get no attention). The placement's permutation rides on the exchanges themselves for B == 1
    (one list all-to-all per piece slot, each piece landing at or read from its global position:
    ``engine.by_piece``), else on the copies around them (received q/k/v -> kernel layout in global order;
    output and gradients -> send buffers in rank order), so every placement runs ONE kernel call per chunk
    (causal or not) at the speed of "contiguous". Padding cuts the keys off (non-causal: one call; causal: a causal call for the valid
    queries and a full call for the padded query rows).
    qkv_contiguous (default True): copy each chunk's q/k/v into the kernel's native [B, S, h, D]
    layout and exchange gradients one tensor at a time; False keeps the zero-copy packed q|k|v views
    and one gradient exchange per chunk. Same math, bit for bit; measured on 4 x H200 the default
    needs ~25% less fwd+bwd peak memory at equal speed (results/.../contig_ab_p4.md).
    transport: "nccl" (the group's all_to_all, default), "symm_mem" (copy-engine pulls between barrier
    kernels) or "copy_engine" (copy-engine pulls ordered by stream-memory flags, no kernel), both through
    torch symmetric memory with CUDA tensors and an NCCL group; or a transport object. Same math.
    seq_order (advanced; hybrid meshes): an explicit permutation of the gathered sequence into the order
    ``backend`` expects (a ring backend that knows the runs), applied instead of the placement's.
    dropout_p: attention dropout inside the local attention (torch SDPA's own, under autograd so that the
    backward uses the forward's mask; pass 0 in eval). Each head chunk draws its own mask.
    cu_seqlens: packed variable-length samples (B=1): 1-D int tensor [n_samples + 1] of the samples' cumulative
    lengths (same on every rank); q/k/v are this rank's per-sample shards (``shard_sequence`` with the same
    cu_seqlens and a "contiguous" or "zigzag" placement). Each sample attends only within itself (causal or
    not): after the exchange the local attention runs once per sample over its global range. A sample whose
    length does not divide by P ("contiguous") or 2P ("zigzag") is padded at its tail by ``shard_sequence``;
    its padding rows form a segment of their own (never attended by, nor attending, real tokens). Also a
    ``PackedSamples`` (real and padded cumulative lengths, e.g. Megatron's cu_seqlens_q / _q_padded). Not
    combined with kv_valid_len or seq_order.
    varlen_kernel: with cu_seqlens, the local method (``attention.varlen``): "per_sample" (one kernel call per
    sample), "grouped" (equal lengths in one batched call), "flash_varlen" (torch's varlen kernel, CUDA
    fp16/bf16) or "auto" (timed once per sample-length key). Same math up to kernel rounding.
    block_mask: block-sparse attention (attention/block_sparse.py): bool [H or 1, T, T], T = ceil(S / block_size),
    query tiles x key tiles over the FULL sequence in global token order, the same on every rank (H indexes query
    heads; 1 broadcasts); only selected tile pairs attend, AND causal, AND kv_valid_len; query rows with no
    selected key give zeros. After the exchange each chunk attends in global order with its heads' mask rows, on
    the "math" block kernel (backend="math", or off CUDA) or flex_attention (CUDA; other ``AutoBackend``s
    name no kernel for it; a caller's callable, flash_attn or te backend is refused); head_chunks="auto" picks C by
    the dense call's calibration. Not combined with cu_seqlens, dropout_p or seq_order. The mask is compared across
    ranks with the problem's agreement, once per problem (``AttentionProblem.with_mask(agreed=True)``: not at all).
    """
    problem, opts = problem_from_keywords("ulysses_attention", problem, keywords, tuple(OPTIONS))
    opts = {**OPTIONS, **opts}
    pr = problem.bind(q, k, v, group, what="ulysses_attention", mode="ulysses", backend=backend,
                      varlen_kernel=opts["varlen_kernel"])
    return run_ulysses(q, k, v, group, pr, head_chunks, opts)


def one_rank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pr: BoundProblem) -> torch.Tensor:
    """The one-rank path of every mode (the factory's and the functional API's): the whole sequence on this rank
    (its placement is global order), the bound problem's local kernel, key padding, packed samples, block mask."""
    qb, kb, vb = pr.to_kernel(q, k, v)
    valid = pr.kv_valid_len
    if pr.block_mask is not None:
        ts = tiles.problem_slice(pr, qb.device)
        kernel = pr.backend.tile_kernel(qb, ts, pr.causal, lse=False)
        return pr.from_kernel(kernel.attention(qb, kb, vb, pr.causal, pr.scale, ts))
    segments = pr.segments
    return pr.from_kernel(local_attention(pr.backend, qb, kb, vb, pr.causal, pr.scale, valid, pr.dropout_p, segments,
                                          pr.varlen_kernel))


def run_ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, pr: BoundProblem,
                head_chunks: "int | str", opts: dict) -> torch.Tensor:
    """Ulysses / HCMS of a bound problem ``pr`` (``ulysses_attention``'s body); ``opts``: ``OPTIONS`` filled."""
    causal, layout, placement = pr.causal, pr.layout, pr.placement
    comm_stream, policy, transport = opts["comm_stream"], opts["policy"], opts["transport"]
    be, world = pr.backend, pr.world
    block_mask = pr.mask_on(q.device)
    if world == 1:
        return one_rank_attention(q, k, v, pr)
    tile_setting = "math"
    if block_mask is not None:
        tile_setting = "ring" if pr.own_positions else be.tile_kernel(q, None, causal, lse=False).setting
    tr = default_transports().get(transport, group, q.device)
    if head_chunks == "auto":
        # with a block mask too: the policy calibrates the dense call of this shape (the exchanges it balances are
        # the same; the chunk count never changes the result)
        head_chunks = (policy or default_policy()).chunks_for(q, k, group, causal=causal, layout=layout,
                                                        scale=pr.scale, backend=be, comm_stream=comm_stream,
                                                        transport=tr, attention=ulysses_attention)
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int):
        raise SPConfigError(f"head_chunks={head_chunks!r} is invalid: use a positive integer or 'auto'")
    hl = head_layout(q.shape[2], k.shape[2], world, head_chunks)
    if hl.kv_repeat > 1:
        k = k.repeat_interleave(hl.kv_repeat, dim=2)
        v = v.repeat_interleave(hl.kv_repeat, dim=2)
    if pr.packed is not None:
        order, valid = varlen_order(placement, world, pr.packed.layout), None
    else:  # a block mask is stated in global order: the gathered sequence must be put in it (as for causal)
        order, valid = local_order(placement, world, pr.s_loc, causal or block_mask is not None, pr.kv_valid_len)
    if pr.seq_order is not None:
        order = pr.seq_order
    # one chunk has nothing to overlap: run on the caller's stream, no side stream and no events (less
    # host work per call, which is what short calls are bound by); same kernels, same order
    stream = None if hl.chunks == 1 else (comm_stream if comm_stream is not None
                                          else st.default_pool().comm_stream(q.device))
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    plan = UlyssesPlan(group, pr.rank, hl, layout, causal, pr.scale, be, stream, need_grad, opts["qkv_contiguous"],
                       tr, order, valid, pr.dropout_p, pr.segments, pr.varlen_kernel,
                       None if block_mask is None else tiles.problem_slice(pr, q.device),
                       tile_setting)
    return _UlyssesFn.apply(q, k, v, plan)
