"""Async Ulysses self-attention layer: projections overlapped with their exchanges.

    y = out_proj( UlyssesAttention( prep_q(x Wq^T), prep_k(x Wk^T), x Wv^T ) )

The layers' autograd Function (skeleton.py) around an explicit schedule (CUDA: compute stream +
communication stream joined by events; CPU: the same code in program order):
  forward   q GEMM -> prep (QK-norm, RoPE) -> start HCMS chunk 0 of q's seq->head exchange ->
            k GEMM (overlaps it) -> chunk 0 of k -> v GEMM -> chunk 0 of v, then chunks 1.. of q, k, v
            in chunk-major order, so chunk c's attention waits only for chunk c of q, k and v (1/C of
            the input bytes for the first one); its output exchange starts as soon as it is done;
            out projection last.
  backward  dO = dy W_o -> start dO's exchange -> dW_o = dy^T O (overlaps it); per chunk attention
            backward, then dv, dk, dq exchanged home (events per tensor); each branch waits only
            for its own gradient: dW_v, dx_v while dk/dq still travel, then k (prep backward), q.
Same math as the plain layer (fused QKV GEMM -> prep -> ulysses_attention -> out GEMM); per-branch
GEMMs round differently from the fused one, so equality holds to fp rounding, not bit for bit.
Shapes: x [B, S_local, dim]; q heads H, kv heads Hkv (GQA), head_dim D; weights as nn.Linear.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...attention.backends import LocalAttention, get_backend
from ...comm import streams as st
from ...comm.transport import default_transports, table_head_to_seq, table_seq_to_head
from ..checks import valid_kv_len
from ..heads import HeadLayout, head_layout
from ..placement import pieces
from ..problem import AttentionProblem
from ..ring import RingBackend
from ..ulysses import alloc as _alloc, attend_backward
from ..ulysses import exchange_all_chunks as _exchange_all_chunks, send_head_major as _send_head_major
from ..ulysses import layout as lay, transport_of as _transport
from .call import LayerRun, LayerWeights, agree_layer, check_layer, layer_call
from .skeleton import LayerForm, apply_layer, attend_all, prep_backward, prep_forward

# prep(branch, y [B, S, n*D], weight) -> [B, S, n, D]; weight is the branch's QK-norm weight or None
Prep = Callable[[str, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


@dataclass
class AsyncPlan:
    group: dist.ProcessGroup
    rank: int
    heads: HeadLayout
    seq_layout: str           # always "bshd" here
    scale: float
    backend: LocalAttention
    comm_stream: Optional["torch.cuda.Stream"]
    dims: tuple               # (H, Hkv, D)
    prep: Prep
    transport: Optional[object] = None
    causal: bool = False      # causal mask at global positions (placement decides which tokens are here)
    # the rest of ulysses.AttendPlan: padding and placement ride on the RingBackend (make_async_plan)
    need_grad: bool = True
    kv_valid_len: Optional[int] = None
    order: Optional[lay.SeqOrder] = None
    dropout_p: float = 0.0


def _mm(a, b):
    """Every GEMM of the layer goes through here (one place to trace the schedule)."""
    return torch.matmul(a, b)


def _linear(x, w, b):
    y = _mm(x, w.t())
    return y + b if b is not None else y


def project_and_exchange(x, w_qkv, b_qkv, nq_w, nk_w, plan: AsyncPlan, *, fused: bool = False):
    """The pre-attention part: x [B, S_local, dim] -> head-sharded q, k, v chunks in flight.

    fused=False (the async layer): per-branch GEMM, prep, then that branch's exchange starts while
    the next branch's GEMM runs. fused=True (the plain layer's order): one fused QKV GEMM, prep of
    q and k, then one exchange of q|k|v per chunk (keys "qkv"). Returns (recv, events, saved_prep):
    recv[name][c] is chunk c's flat
    buffer, events[name][c] fires when it has arrived (None on CPU); saved_prep holds what the QK-norm
    / RoPE backward needs. Used by the layer's forward and by tools/bench_block.py.
    """
    h, hkv, d = plan.dims
    hl = plan.heads
    bsz, s_loc, _ = x.shape
    tokens = s_loc * bsz
    compute, comm = st.current(x.device), plan.comm_stream
    sizes = (h * d, hkv * d, hkv * d)
    if fused:
        ys = torch.split(_linear(x, w_qkv, b_qkv), sizes, dim=-1)
    else:
        ws = torch.split(w_qkv, sizes, dim=0)
        bs = torch.split(b_qkv, sizes, dim=0) if b_qkv is not None else (None, None, None)
    saved_prep, recv, events, prepared = {}, {}, {}, {}
    for i, (name, nw, kind) in enumerate((("q", nq_w, "q"), ("k", nk_w, "kv"), ("v", None, "kv"))):
        y = ys[i] if fused else _linear(x, ws[i], bs[i])                # this branch's GEMM
        if name == "v":
            y4 = y.reshape(bsz, s_loc, hkv, d)
        else:                                                        # QK-norm + RoPE, kept for backward
            y4, saved_prep[name] = prep_forward(lambda y_, w_, name=name: plan.prep(name, y_, w_), y, nw)
        if kind == "kv" and hl.kv_repeat > 1:
            y4 = y4.repeat_interleave(hl.kv_repeat, dim=2)
        prepared[name] = y4
        if not fused:  # chunk 0 now (the next branch's GEMM hides it), later chunks once all are projected
            recv[name], events[name] = [None] * hl.chunks, [None] * hl.chunks
            _exchange_chunk(y4, kind, plan, 0, tokens, d, compute, comm, recv[name], events[name])
    if not fused:  # chunk-major: chunk c's q, k, v arrive together, so attention c starts after 1/C of the bytes
        for c in range(1, hl.chunks):
            for name, kind in (("q", "q"), ("k", "kv"), ("v", "kv")):
                _exchange_chunk(prepared[name], kind, plan, c, tokens, d, compute, comm, recv[name], events[name])
    if fused:  # plain Ulysses' exchange: q|k|v of a chunk side by side in one collective
        recv["qkv"], events["qkv"] = _exchange_all_chunks((prepared["q"], prepared["k"], prepared["v"]),
                                                          ("q", "kv", "kv"), plan, tokens, d, compute, comm)
    return recv, events, saved_prep


def _exchange_chunk(part, kind: str, plan, c: int, tokens: int, d: int, compute, comm, recv: list,
                    events: list) -> None:
    """Start HCMS chunk c's seq->head exchange of one branch ``part`` [B, S_local, n, D] on ``comm``
    (after the compute stream's work so far); recv[c] / events[c] get its buffer and arrival event."""
    hl, like = plan.heads, part
    tr = _transport(plan)
    splits = lay.seg_splits(hl, (kind,), c, tokens, d)
    recv[c] = _alloc(hl.world * tokens * lay.widths(hl, (kind,), plan.rank, c)[0] * d, like)  # on compute (its reader)
    ready = st.record(compute)
    with st.on_stream(comm):
        st.wait(comm, ready)
        buf = tr.send_buffer(sum(splits), like)
        splits = lay.pack((part,), (kind,), hl, c, plan.seq_layout, buf)
        w = tr.all_to_all(buf, recv[c], splits, None, async_op=True, table=table_seq_to_head(splits))
        if w is not None:
            w.wait()
        if comm is not None:  # a compute-stream tensor read by the comm stream: guard its reuse
            part.record_stream(comm)
        events[c] = st.record(comm)
        del buf


def out_proj_backward(dy, w_o, o_flat, plan, has_bias: bool, tokens: int, d: int, compute, comm):
    """dO = dy W_o, its exchange started, then dW_o = dy^T O (overlaps it).

    dy [B, S_local, dim], o_flat [B, S_local, H*D]. Returns (recv, events, dW_o, db_o): recv[c] /
    events[c] are chunk c's head-sharded dO buffer and its arrival event.
    """
    h, _, _ = plan.dims
    bsz, s_loc = dy.shape[:2]
    dy = dy.contiguous()
    d_o = _mm(dy, w_o).view(bsz, s_loc, h, d)
    recv_g, ev_g = _exchange_all_chunks((d_o,), ("q",), plan, tokens, d, compute, comm)
    dy2 = dy.reshape(-1, dy.shape[-1])
    d_w_o = _mm(dy2.t(), o_flat.reshape(-1, o_flat.shape[-1]))
    return recv_g, ev_g, d_w_o, (dy2.sum(0) if has_bias else None)


def attention_backward(chunks: list, c: int, recv_g, ev_g, plan, s_loc: int, bsz: int, d: int, compute):
    """Chunk c's attention backward once its dO has arrived: (dq, dk, dv) head-sharded [B, n, S, D]."""
    st.wait(compute, ev_g[c])
    n = lay.widths(plan.heads, ("q",), plan.rank, c)[0]
    do_c = recv_g[c].view(plan.heads.world * s_loc, bsz, n, d).permute(1, 2, 0, 3)
    recv_g[c] = None  # dO and the chunk's saved tensors die with this frame (peak memory)
    return attend_backward(plan, c, do_c, chunks)


def _forward(x, w_qkv, b_qkv, w_o, b_o, nq_w, nk_w, plan: AsyncPlan):
    h, hkv, d = plan.dims
    hl, world = plan.heads, plan.heads.world
    bsz, s_loc, _ = x.shape
    compute, comm = st.current(x.device), plan.comm_stream
    recv, events, saved_prep = project_and_exchange(x, w_qkv, b_qkv, nq_w, nk_w, plan)

    def views(c):
        vs = []
        for name, kind in (("q", "q"), ("k", "kv"), ("v", "kv")):
            st.wait(compute, events[name][c])
            n = lay.widths(hl, (kind,), plan.rank, c)[0]
            t = recv[name][c].view(world * s_loc, bsz, n, d).permute(1, 2, 0, 3)
            vs.append(t.transpose(1, 2).contiguous().transpose(1, 2))
            recv[name][c] = None
        return vs
    chunks, o_flat = attend_all(views, plan, x, s_loc, compute, comm)
    y = _linear(o_flat, w_o, b_o)
    return y, (x, w_qkv, w_o, o_flat), (chunks, saved_prep, (b_qkv is not None, b_o is not None))


def _backward(saved, state, dy, plan: AsyncPlan):
    x, w_qkv, w_o, o_flat = saved
    chunks, saved_prep, has = state
    h, hkv, d = plan.dims
    hl, C = plan.heads, plan.heads.chunks
    bsz, s_loc, dim = x.shape
    tokens = s_loc * bsz
    compute, comm = st.current(x.device), plan.comm_stream
    recv_g, ev_g, d_w_o, d_b_o = out_proj_backward(dy, w_o, o_flat, plan, has[1], tokens, d, compute, comm)
    hkv_rep = hkv * hl.kv_repeat
    grads, last = None, {}
    for c in range(C):
        g3 = attention_backward(chunks, c, recv_g, ev_g, plan, s_loc, bsz, d, compute)
        if grads is None:  # allocated once the first chunk's attention inputs are freed (peak memory)
            grads = {"q": torch.empty(bsz, s_loc, h, d, dtype=dy.dtype, device=dy.device),
                     "k": torch.empty(bsz, s_loc, hkv_rep, d, dtype=dy.dtype, device=dy.device),
                     "v": torch.empty(bsz, s_loc, hkv_rep, d, dtype=dy.dtype, device=dy.device)}
        done = st.record(compute)
        with st.on_stream(comm):
            st.wait(comm, done)
            tr = _transport(plan)
            for i, name, kind in ((2, "v", "kv"), (1, "k", "kv"), (0, "q", "q")):
                g, g3[i] = g3[i], None
                send = _send_head_major(g, tr)
                if comm is not None:  # a compute-stream tensor read by the comm stream: guard its reuse
                    g.record_stream(comm)
                del g  # each gradient is freed once packed
                splits = lay.seg_splits(hl, (kind,), c, tokens, d)
                r = _alloc(sum(splits), dy)
                tr.all_to_all(send, r, None, splits, table=table_head_to_seq(splits))
                lay.unpack(r, (grads[name],), (kind,), hl, c, "bshd")
                last[name] = st.record(comm)
                del send, r
    # branch backward: each waits only for its own gradient (v first: it has no prep)
    x2 = x.reshape(-1, dim)
    sizes = (h * d, hkv * d, hkv * d)
    offs = {"q": 0, "k": sizes[0], "v": sizes[0] + sizes[1]}
    ws = torch.split(w_qkv, sizes, dim=0)
    d_w_qkv = torch.empty(w_qkv.shape, dtype=dy.dtype, device=dy.device)
    d_b_qkv = torch.empty(w_qkv.shape[0], dtype=dy.dtype, device=dy.device) if has[0] else None
    dx, d_norm = torch.zeros_like(x2), {"q": None, "k": None}
    for name, w in (("v", ws[2]), ("k", ws[1]), ("q", ws[0])):
        st.wait(compute, last.get(name))
        g, grads[name] = grads[name], None
        if name != "q" and hl.kv_repeat > 1:  # replicated kv heads: sum their gradients back
            g = g.view(bsz, s_loc, hkv, hl.kv_repeat, d).sum(3)
        if name in saved_prep:  # QK-norm + RoPE backward; its graph is freed right after
            g2, d_norm[name] = prep_backward(saved_prep.pop(name), g)
        else:
            g2 = g.reshape(bsz, s_loc, -1)
        del g
        g2 = g2.reshape(-1, g2.shape[-1])
        d_w_qkv.narrow(0, offs[name], g2.shape[1]).copy_(_mm(g2.t(), x2))
        if d_b_qkv is not None:
            d_b_qkv.narrow(0, offs[name], g2.shape[1]).copy_(g2.sum(0))
        dx.add_(_mm(g2, w))
        del g2
    return dx.view_as(x), d_w_qkv, d_b_qkv, d_w_o, d_b_o, d_norm["q"], d_norm["k"]


ASYNC_QKV = LayerForm("async_qkv", _forward, _backward)


def async_ulysses_self_attention(x: torch.Tensor, weights: LayerWeights, group: dist.ProcessGroup,
                                 problem: Optional[AttentionProblem] = None, *, num_heads: int, num_kv_heads: int,
                                 prep: Prep, run: Optional[LayerRun] = None, **keywords) -> torch.Tensor:
    """The async layer on this rank's tokens x [B, S_local, dim]; returns [B, S_local, dim].

    weights: ``LayerWeights`` (w_qkv [(H + 2 Hkv) * D, dim], q rows then k then v; w_o [dim, H * D]; nn.Linear
    layout; the QK-norm weights prep receives). problem: the ``AttentionProblem`` (causal, placement: which tokens
    this rank holds, kv_valid_len: padded keys, softmax_scale; masked exactly as in ulysses_attention), built once
    by the caller and agreed across ``group`` on its first call (one collective every rank reaches); or its
    settings as keywords (``causal=True``, ...). run: ``LayerRun`` (head_chunks, backend, comm_stream, transport:
    "nccl", "symm_mem" or "copy_engine"), or its settings as keywords. prep(branch, y, norm_weight) maps a branch's
    [B, S, n*D] projection to [B, S, n, D] (QK-norm and RoPE at this rank's global positions); it is applied to q
    and k, never to v.
    """
    what = "async_ulysses_self_attention"
    problem, run = layer_call(what, problem, run, keywords)
    agree_layer(what, problem, x, (group,), lambda: (run.refuse(what, ("fused", "rs_pieces")), check_layer(
        what, problem, x, num_heads, num_kv_heads, run, dist.get_world_size(group))))
    plan = make_async_plan(group, problem, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=weights.head_dim(num_heads), prep=prep, seq_local=x.shape[1], device=x.device,
                           run=run)
    return apply_layer(ASYNC_QKV, x, weights, plan)


def make_async_plan(group: dist.ProcessGroup, problem: AttentionProblem, *, num_heads: int, num_kv_heads: int,
                    head_dim: int, prep: Prep, seq_local: int, device: torch.device,
                    run: Optional[LayerRun] = None) -> AsyncPlan:
    """The AsyncPlan of one layer call of ``problem`` (arguments as in async_ulysses_self_attention; ``run``
    default ``LayerRun()``). Runs this rank's checks only (SPConfigError naming the setting): the layer agrees the
    problem across ranks before it builds the plan."""
    run = run or LayerRun()
    world, d = dist.get_world_size(group), head_dim
    hl = head_layout(num_heads, num_kv_heads, world, run.head_chunks)
    be = get_backend(run.backend)
    kv_valid_len = valid_kv_len(problem.kv_valid_len, seq_local * world)
    placement, causal = problem.placement, problem.causal
    if kv_valid_len is not None or (causal and placement != "contiguous"):
        runs = tuple(r for p in range(world) for r in pieces(placement, p, world, seq_local * world))
        be = RingBackend(None, "ring", runs, (runs,), be, kv_valid_len)
    scale = problem.softmax_scale if problem.softmax_scale is not None else 1.0 / math.sqrt(d)
    stream = run.comm_stream if run.comm_stream is not None else st.default_pool().comm_stream(device)
    tr = default_transports().get(run.transport, group, device)
    return AsyncPlan(group, dist.get_rank(group), hl, "bshd", scale, be, stream, (num_heads, num_kv_heads, d), prep, tr,
                     causal)
