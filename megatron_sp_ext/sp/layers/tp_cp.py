"""Self-attention layer where tensor parallelism (with TP sequence parallelism) meets our CP (Ulysses/HCMS).

Megatron's layout (NeMo's Wan-14B run: TP2 + --sequence-parallel, CP4), per rank (t, p) of TP size T, CP size P:

    x_tp  [B, S_tp, dim]      this TP rank's slice of the CP rank's tokens (S_cp = T * S_tp, S = P * S_cp)
    x_cp  = all_gather_TP(x_tp)                      [B, S_cp, dim]
    q|k|v = x_cp W_t^T                               this TP shard's heads H_t = H / T (column-parallel)
    Ulysses over CP: seq -> head exchange, attention of H_t / P heads over S, head -> seq exchange
    y_tp  = reduce_scatter_TP(o_cp W_o,t^T) + b_o    row-parallel, [B, S_tp, dim]

form="pipelined" keeps that dataflow and overlaps it. Forward: the TP all-gather of x runs on the
communication stream while this rank's own shard goes through HCMS chunk 0's QKV GEMM (on CUDA with
symmetric memory: one ``torch.ops.symm_mem.fused_all_gather_matmul``); each HCMS chunk's GEMM computes
only that chunk's heads (for every CP peer), its q/k prep (per-head norm, RoPE) follows, and the
chunk's CP exchange starts at once (chunk c+1's GEMM hides it); chunk c's attention waits for chunk c
only and its output exchange starts as soon as it is done; the output GEMM is cut into ``rs_pieces``
token pieces, each piece reduce-scattered over TP while the next piece's GEMM runs (CUDA + symm_mem:
``fused_matmul_reduce_scatter``). Backward mirrors it: TP all-gather of dy pipelined with dO = dy W_o,
dO's CP exchanges per chunk, dW_o overlapping them; per chunk attention backward and its dq|dk|dv
exchange home; prep backward; dx by GEMM + pipelined TP reduce-scatter; dW from x re-gathered on the
communication stream.

form="mixed" (MixedComm for training) fuses the two groups' collectives on both sides. Input: the QKV
GEMM acts per token, so it commutes with moving tokens: the CP seq -> head exchange of q|k|v equals a CP
all-gather of x followed by the GEMM of this CP rank's heads only. After that move the TP all-gather and
the CP all-gather are adjacent with no compute between, and become ONE all-gather over the TP x CP group
(pipelined with the GEMM as above); in backward the CP exchange home + TP reduce-scatter of dx become ONE
reduce-scatter over TP x CP. Output: the output GEMM sums over heads, so this rank's heads (over all S
tokens) give a partial sum o_mine W_o[:, mine]^T [B, S, dim]; the CP head -> seq exchange then becomes a
CP reduce-scatter, adjacent to the TP reduce-scatter: ONE reduce-scatter over TP x CP (pipelined with the
GEMM in token pieces); in backward the TP all-gather of dy and the CP exchange of dO become ONE all-gather
of dy over TP x CP followed by dO = dy_all W_o[:, mine] for this rank's heads. No all-to-all at all: the
attention layer is Megatron's TP-SP pattern over T * P ranks. Same FLOPs; the price is bytes: x and y
(dim per token) cross all T * P ranks instead of q|k|v / o of H_t heads crossing P. form="mixed_in" fuses
the input side only (the output side is the pipelined form's). Which wins depends on the shape and the
machine: the layer policy times them against Megatron's own path (never on CPU).

Heads: ``num_heads`` / ``num_kv_heads`` are THIS TP shard's (Megatron's per-partition counts); w_qkv
is the shard's [(H_t + 2 Hkv_t) D, dim] rows q | k | v, w_o its [dim, H_t D] columns, b_o the full
(replicated) bias. ``prep`` must act per head (any subset of heads may be passed): Megatron's per-head
q/k layernorm and RoPE; a norm over all heads (Wan's) would need a TP reduction and is not supported.
Parameter gradients are this rank's share: sum w_qkv / w_o grads over CP (and DP), then they are this
TP shard's; b_o and norm weights: sum over TP and CP (what Megatron's grad reductions do).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ...comm import streams as st
from ...comm.transport import table_head_to_seq, table_seq_to_head
from ...errors import SPConfigError
from ..heads import HeadLayout
from ..ulysses import attend_backward, explicit_kernels
from ..ulysses.attend import attend
from .allgather import fused_ops_unavailable_reason
from ..problem import AttentionProblem
from .async_qkv import AsyncPlan, attention_backward, make_async_plan
from .call import LayerRun, LayerWeights, agree_layer, check_layer, layer_call
from .skeleton import LayerForm, apply_layer, attend_all, prep_backward, prep_forward, start_gather

# prep(branch, y [B, S', n, D], norm_weight or None, cp_gathered) -> [B, S', n, D]; per head. S' = S_cp (this CP
# rank's tokens, its local order) when cp_gathered is False, S = P * S_cp (every CP rank's tokens, CP rank order)
# when True (the mixed forms).
PrepTpCp = Callable[[str, torch.Tensor, Optional[torch.Tensor], bool], torch.Tensor]
TP_CP_FORMS = ("pipelined", "mixed", "mixed_in")  # mixed_in: input side fused only


@dataclass(frozen=True)
class ChunkMap:
    """One HCMS chunk's projection: the rows of w_qkv its GEMM computes and where each peer's heads sit.

    rows: q rows (peer-major), then k rows, then v rows of the chunk's DISTINCT kv heads. widths: (nq, nk, nk)
    heads of the GEMM output. kv_index: for each replicated kv head (GQA, peer-major) its position among the
    distinct ones. slots[i] = (q_off, q_n, kv_off, kv_n) of peer i in the chunk's q / replicated kv tensors.
    """

    rows: tuple
    widths: tuple
    kv_index: tuple
    slots: tuple


@lru_cache(maxsize=64)
def chunk_maps(hl: HeadLayout, head_dim: int, peers: tuple) -> tuple:
    """The ChunkMap of every HCMS chunk of ``hl`` (Ulysses over CP of one TP shard's heads) for ``peers``
    (every CP rank: the pipelined form; this rank only: the mixed forms)."""
    h, hkv, d = hl.num_heads, hl.kv_heads, head_dim
    out = []
    for c in range(hl.chunks):
        q_heads, kv_rep, slots = [], [], []
        for p in peers:
            (qa, qb), (ka, kb) = hl.q_range(p, c), hl.kv_range(p, c)
            slots.append((len(q_heads), qb - qa, len(kv_rep), kb - ka))
            q_heads += range(qa, qb)
            kv_rep += range(ka, kb)
        kv = sorted({j // hl.kv_repeat for j in kv_rep})
        rows = [g * d + i for g in q_heads for i in range(d)]
        rows += [(h + j) * d + i for j in kv for i in range(d)]
        rows += [(h + hkv + j) * d + i for j in kv for i in range(d)]
        out.append(ChunkMap(tuple(rows), (len(q_heads), len(kv), len(kv)),
                            tuple(kv.index(j // hl.kv_repeat) for j in kv_rep), tuple(slots)))
    return tuple(out)


@lru_cache(maxsize=256)
def _index(values: tuple, device: torch.device) -> torch.Tensor:
    """A constant index tensor built once per device (no per-call host->device copy)."""
    return torch.tensor(values, dtype=torch.long, device=device)


@dataclass
class TpCpPlan(AsyncPlan):
    """AsyncPlan of the CP part (group = CP group, heads = this TP shard's over P) plus the TP side."""

    tp_group: Optional[dist.ProcessGroup] = None
    tcp_group: Optional[dist.ProcessGroup] = None   # TP x CP, CP-major rank order (mixed form)
    form: str = "pipelined"
    fused: bool = False                             # torch.ops.symm_mem fused all-gather / reduce-scatter matmuls
    maps: tuple = ()
    rs_pieces: int = 1                              # token pieces of the pipelined reduce-scatters
    o_cols: tuple = ()                              # w_o columns of this rank's heads, chunk order (form "mixed")

    @property
    def gather_in(self) -> bool:
        """The input side is one all-gather over TP x CP (forms "mixed", "mixed_in")."""
        return self.form in ("mixed", "mixed_in")

    @property
    def fuse_out(self) -> bool:
        """The output side is one reduce-scatter over TP x CP (form "mixed")."""
        return self.form == "mixed"


def _gather_matmul(x: torch.Tensor, w: torch.Tensor, group, plan: TpCpPlan, compute, comm):
    """x [B, s, dim] (this rank's tokens) -> (x_all [B, G s, dim], x_all @ w^T [B, G s, n]), G = group size,
    rank order. The all-gather runs on ``comm`` while this rank's own tokens are multiplied."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    bsz, s, dim = x.shape
    xs = x.transpose(0, 1).contiguous()                               # [s, B, dim]
    if world == 1:
        return x, torch.matmul(x, w.t())
    if plan.fused:
        op = torch.ops.symm_mem.fused_all_gather_matmul
        a_all, outs = op(xs, [w.t()], 0, group.group_name, return_A=True)
        return a_all.transpose(0, 1), outs[0].transpose(0, 1)
    ready = st.record(compute)
    with st.on_stream(comm):
        st.wait(comm, ready)
        full = xs.new_empty(world * s, bsz, dim)
        work = dist.all_gather_into_tensor(full, xs, group=group, async_op=True)
        work.wait()
        gathered = st.record(comm)
        if comm is not None:
            full.record_stream(compute)
            xs.record_stream(comm)
    y = torch.empty(world * s, bsz, w.shape[0], dtype=x.dtype, device=x.device)
    y[me * s:(me + 1) * s] = torch.matmul(xs, w.t())                   # own tokens: overlaps the gather
    st.wait(compute, gathered)
    for a, b in ((0, me * s), ((me + 1) * s, world * s)):
        if b > a:
            y[a:b] = torch.matmul(full[a:b], w.t())
    return full.transpose(0, 1), y.transpose(0, 1)


def _matmul_reduce_scatter(a: torch.Tensor, w: torch.Tensor, group, plan: TpCpPlan, compute, comm) -> torch.Tensor:
    """a [B, S, n] @ w [n, dim], summed over ``group``, this rank's tokens: [B, S / G, dim]. Cut into
    plan.rs_pieces token pieces: piece k's reduce-scatter runs on ``comm`` while piece k+1's GEMM runs."""
    world = dist.get_world_size(group)
    bsz, s_all, n = a.shape
    if world == 1:
        return torch.matmul(a, w)
    s = s_all // world
    if plan.fused:
        out = torch.ops.symm_mem.fused_matmul_reduce_scatter(a.transpose(0, 1).contiguous(), w, "sum", 0,
                                                              group.group_name)
        return out.transpose(0, 1)
    k = plan.rs_pieces if s % plan.rs_pieces == 0 else 1
    a5 = a.reshape(bsz, world, k, s // k, n)
    out = torch.empty(k, s // k, bsz, w.shape[1], dtype=a.dtype, device=a.device)
    works = []
    for i in range(k):
        part = torch.matmul(a5[:, :, i], w).permute(1, 2, 0, 3).contiguous()   # [G, s/k, B, dim]
        ready = st.record(compute)
        with st.on_stream(comm):
            st.wait(comm, ready)
            works.append(dist.reduce_scatter_tensor(out[i], part.view(world * (s // k), bsz, -1), group=group,
                                                    async_op=True))
            if comm is not None:
                part.record_stream(comm)
    with st.on_stream(comm):
        for wk in works:
            wk.wait()
        done = st.record(comm)
    st.wait(compute, done)
    return out.view(s, bsz, -1).transpose(0, 1)


def _to_heads(parts: Sequence[torch.Tensor], slots: Sequence[Sequence[tuple]], my_width: int, plan: TpCpPlan,
              compute, comm):
    """Start the seq -> head exchange of one chunk over CP. parts[i] [B, S_cp, n_i, D]; slots[i][p] = (offset, n)
    of peer p's heads in parts[i]. Returns (recv, event): recv [P * S_cp * B * my_width * D] (peer-major
    segments [S_cp, B, my_width, D], my heads of parts side by side), event fires when it has arrived."""
    like = parts[0]
    bsz, s, _, d = like.shape
    world, tr = plan.heads.world, plan.transport
    splits = [s * bsz * sum(sl[p][1] for sl in slots) * d for p in range(world)]
    recv = torch.empty(world * s * bsz * my_width * d, dtype=like.dtype, device=like.device)
    ready = st.record(compute)
    with st.on_stream(comm):
        st.wait(comm, ready)
        buf = tr.send_buffer(sum(splits), like)
        off = 0
        for p in range(world):
            seg = buf[off:off + splits[p]].view(s, bsz, -1, d)
            col = 0
            for t, sl in zip(parts, slots):
                a, n = sl[p]
                seg[:, :, col:col + n].copy_(t[:, :, a:a + n].transpose(0, 1))
                col += n
            off += splits[p]
        work = tr.all_to_all(buf, recv, splits, None, async_op=True, table=table_seq_to_head(splits))
        if work is not None:
            work.wait()
        if comm is not None:
            for t in parts:
                t.record_stream(comm)
        event = st.record(comm)
        del buf
    return recv, event


def _to_seq(grads_bhsd: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], slots: Sequence[Sequence[tuple]],
            plan: TpCpPlan, compute, comm):
    """The inverse of ``_to_heads``: my heads' [B, n_i, S, D] results (rank order) -> every peer's slots of
    outs[i] [B, S_cp, N_i, D]. Returns the event that fires when outs are written."""
    bsz, _, s_all, d = grads_bhsd[0].shape
    world, tr = plan.heads.world, plan.transport
    s = s_all // world
    width = sum(g.shape[1] for g in grads_bhsd)
    recv_splits = [s * bsz * sum(sl[p][1] for sl in slots) * d for p in range(world)]
    done = st.record(compute)
    with st.on_stream(comm):
        st.wait(comm, done)
        send = tr.send_buffer(s_all * bsz * width * d, grads_bhsd[0])
        sv, col = send.view(s_all, bsz, width, d), 0
        for g in grads_bhsd:
            sv[:, :, col:col + g.shape[1]].copy_(g.permute(2, 0, 1, 3))
            col += g.shape[1]
            if comm is not None:
                g.record_stream(comm)
        recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
        tr.all_to_all(send, recv, None, recv_splits, table=table_head_to_seq(recv_splits))
        off = 0
        for p in range(world):
            seg, col = recv[off:off + recv_splits[p]].view(s, bsz, -1, d), 0
            for t, sl in zip(outs, slots):
                a, n = sl[p]
                t[:, :, a:a + n].copy_(seg[:, :, col:col + n].transpose(0, 1))
                col += n
            off += recv_splits[p]
        del send, recv
        return st.record(comm)


def _qkv_slots(m: ChunkMap):
    return ([(qa, qn) for qa, qn, _, _ in m.slots], [(ka, kn) for _, _, ka, kn in m.slots])


def _forward(x, w_qkv, b_qkv, w_o, b_o, nq_w, nk_w, plan: TpCpPlan):
    _, _, d = plan.dims
    hl = plan.heads
    mixed = plan.gather_in
    bsz = x.shape[0]
    compute, comm = st.current(x.device), plan.comm_stream
    gather_group = plan.tcp_group if mixed else plan.tp_group
    w0 = w_qkv.index_select(0, _index(plan.maps[0].rows, x.device))
    x_all, y0 = _gather_matmul(x, w0, gather_group, plan, compute, comm)    # [B, S', dim], chunk 0's GEMM
    s_x = x_all.shape[1]                                                    # S' (S_cp, or S when mixed)
    s_cp = s_x // hl.world if mixed else s_x
    saved_prep, ready = {}, []
    for c, m in enumerate(plan.maps):
        rows = _index(m.rows, x.device)
        y = y0 if c == 0 else torch.matmul(x_all, w_qkv.index_select(0, rows).t())
        if b_qkv is not None:
            y = y + b_qkv.index_select(0, rows)
        nq, nk, _ = m.widths
        yq, yk, yv = torch.split(y, (nq * d, nk * d, nk * d), dim=-1)
        four = {"v": yv.reshape(bsz, s_x, nk, d)}
        for name, yb, nw, n in (("q", yq, nq_w, nq), ("k", yk, nk_w, nk)):   # per-head norm + RoPE, kept
            four[name], saved_prep[(c, name)] = prep_forward(
                lambda y_, w_, name=name: plan.prep(name, y_, w_, mixed),
                yb.detach().reshape(bsz, s_x, n, d).clone(), nw)
        if m.kv_index != tuple(range(nk)):                                  # GQA: replicate kv heads
            idx = _index(m.kv_index, x.device)
            four["k"], four["v"] = four["k"].index_select(2, idx), four["v"].index_select(2, idx)
        if mixed:  # this rank's heads over the whole sequence already: nothing to exchange
            ready.append([t.contiguous().transpose(1, 2) for t in (four["q"], four["k"], four["v"])])
        else:      # chunk c's exchange starts now; chunk c+1's GEMM hides it
            qs, ks = _qkv_slots(m)
            me = m.slots[plan.rank]
            ready.append(_to_heads((four["q"], four["k"], four["v"]), (qs, ks, ks), me[1] + 2 * me[3],
                                   plan, compute, comm))
        del y, yq, yk, yv, four

    def views(c):
        if mixed:
            vs, ready[c] = ready[c], None
            return vs
        (recv, ev), ready[c] = ready[c], None
        st.wait(compute, ev)
        _, qn, _, kn = plan.maps[c].slots[plan.rank]
        buf = recv.view(hl.world * s_cp, bsz, qn + 2 * kn, d)
        return [t.permute(1, 2, 0, 3).transpose(1, 2).contiguous().transpose(1, 2)
                for t in torch.split(buf, (qn, kn, kn), dim=2)]
    if plan.fuse_out:  # this rank's heads over all S tokens: partial output GEMM, ONE reduce-scatter over TP x CP
        chunks, o_parts, explicit = [], [], None
        for c in range(hl.chunks):
            qc, kc, vc = views(c)
            explicit = explicit_kernels(plan, qc) if explicit is None else explicit
            oc, kept = attend(plan, qc, kc, vc, explicit)                  # [B, n_c, S, D]
            chunks.append(kept)
            o_parts.append(oc.detach().transpose(1, 2))
        o_flat = torch.cat(o_parts, dim=2).reshape(bsz, s_x, -1)        # [B, S, W D], my W heads
        del o_parts
        w_o_mine = w_o.index_select(1, _index(plan.o_cols, x.device))   # [dim, W D]
        y_out = _matmul_reduce_scatter(o_flat, w_o_mine.t(), plan.tcp_group, plan, compute, comm)
    else:
        chunks, o_flat = attend_all(views, plan, x, s_cp, compute, comm)
        y_out = _matmul_reduce_scatter(o_flat, w_o.t(), plan.tp_group, plan, compute, comm)
    if b_o is not None:
        y_out = y_out + b_o
    return y_out, (x, w_qkv, w_o, o_flat), (chunks, saved_prep, (b_qkv is not None, b_o is not None))


def _backward(saved, state, dy, plan: TpCpPlan):
    x, w_qkv, w_o, o_flat = saved
    chunks, saved_prep, has = state
    h, _, d = plan.dims
    hl, mixed = plan.heads, plan.gather_in
    bsz, s_tp, dim = x.shape
    dev = dy.device
    compute, comm = st.current(dev), plan.comm_stream
    dy = dy.contiguous()
    d_b_o = dy.sum((0, 1)) if has[1] else None
    if plan.fuse_out:  # ONE all-gather of dy over TP x CP; dO of my heads over all S tokens, no exchange
        cols = _index(plan.o_cols, dev)
        dy_all, d_o = _gather_matmul(dy, w_o.index_select(1, cols).t(), plan.tcp_group, plan, compute, comm)
        s_cp = dy_all.shape[1] // hl.world
        d_w_o = torch.zeros_like(w_o).index_add_(
            1, cols, torch.matmul(dy_all.reshape(-1, dim).t(), o_flat.reshape(-1, o_flat.shape[-1])))
        del dy_all
        do_chunks, off = [], 0
        for c in range(hl.chunks):
            n = hl.q_chunks[plan.rank][c][1]
            do_chunks.append(d_o[:, :, off * d:(off + n) * d].reshape(bsz, -1, n, d).transpose(1, 2))
            off += n
        del d_o
    else:
        # dO = all_gather_TP(dy) W_o (own tokens first), its CP exchange per chunk, dW_o while it travels
        dy_cp, d_o = _gather_matmul(dy, w_o.t(), plan.tp_group, plan, compute, comm)
        s_cp = dy_cp.shape[1]
        d_o4 = d_o.reshape(bsz, s_cp, h, d)
        recv_g, ev_g = [], []
        for c in range(hl.chunks):
            slots = [(hl.q_range(p, c)[0], hl.q_range(p, c)[1] - hl.q_range(p, c)[0]) for p in range(hl.world)]
            r, e = _to_heads((d_o4,), (slots,), hl.q_chunks[plan.rank][c][1], plan, compute, comm)
            recv_g.append(r)
            ev_g.append(e)
        d_w_o = torch.matmul(dy_cp.reshape(-1, dim).t(), o_flat.reshape(-1, o_flat.shape[-1]))
        del dy_cp, d_o, d_o4
    # x again, for dW only: re-gathered on the comm stream while attention backward runs
    get_x_all = start_gather(x, plan.tcp_group if mixed else plan.tp_group, compute, comm)
    s_x = s_cp * hl.world if mixed else s_cp
    per_chunk, events = [], []
    for c, m in enumerate(plan.maps):
        if plan.fuse_out:
            do_c, do_chunks[c] = do_chunks[c], None
            g3 = attend_backward(plan, c, do_c, chunks)
            del do_c
        else:
            g3 = attention_backward(chunks, c, recv_g, ev_g, plan, s_cp, bsz, d, compute)
        nq, _, _ = m.widths
        nrep = len(m.kv_index)
        if mixed:
            per_chunk.append([g.transpose(1, 2) for g in g3])
            events.append(None)
        else:
            outs = [torch.empty(bsz, s_x, n, d, dtype=dy.dtype, device=dev) for n in (nq, nrep, nrep)]
            qs, ks = _qkv_slots(m)
            events.append(_to_seq(g3, outs, (qs, ks, ks), plan, compute, comm))
            per_chunk.append(outs)
        del g3
    d_y_parts, d_norm = [], {"q": None, "k": None}
    for c, m in enumerate(plan.maps):
        st.wait(compute, events[c])
        gq, gk, gv = per_chunk[c]
        per_chunk[c] = None
        nq, nk, _ = m.widths
        if m.kv_index != tuple(range(nk)):  # replicated kv heads: sum their gradients back
            idx = _index(m.kv_index, dev)
            gk = gk.new_zeros(bsz, s_x, nk, d).index_add_(2, idx, gk)
            gv = gv.new_zeros(bsz, s_x, nk, d).index_add_(2, idx, gv)
        g = {"v": gv.reshape(bsz, s_x, -1)}
        for name, gb in (("q", gq), ("k", gk)):
            g_y, d_w = prep_backward(saved_prep.pop((c, name)), gb)
            g[name] = g_y.reshape(bsz, s_x, -1)
            if d_w is not None:
                d_norm[name] = d_w if d_norm[name] is None else d_norm[name] + d_w
        d_y_parts.append(torch.cat((g["q"], g["k"], g["v"]), dim=-1))
    rows = _index(tuple(r for m in plan.maps for r in m.rows), dev)
    d_y = torch.cat(d_y_parts, dim=-1) if len(d_y_parts) > 1 else d_y_parts[0]   # [B, S', R]
    del d_y_parts
    dx = _matmul_reduce_scatter(d_y, w_qkv.index_select(0, rows), plan.tcp_group if mixed else plan.tp_group,
                                plan, compute, comm)
    x_all = get_x_all()
    d_y2 = d_y.reshape(-1, d_y.shape[-1])
    d_w_qkv = torch.zeros_like(w_qkv).index_add_(0, rows, torch.matmul(d_y2.t(), x_all.reshape(-1, dim)))
    d_b_qkv = torch.zeros(w_qkv.shape[0], dtype=w_qkv.dtype, device=dev).index_add_(0, rows, d_y2.sum(0)) \
        if has[0] else None
    return dx.reshape(x.shape), d_w_qkv, d_b_qkv, d_w_o, d_b_o, d_norm["q"], d_norm["k"]


TP_CP = LayerForm("tp_cp", _forward, _backward)


@dataclass(frozen=True)
class TpCpGroups:
    """The TP x CP layer's process groups: ``tp`` (tensor parallel: this rank's TP group), ``cp`` (context parallel:
    Ulysses over it), ``tcp`` (TP x CP in CP-major order, Megatron's tensor-and-context-parallel group; needed by
    the mixed forms, and the one group the layer's problem is agreed over when given)."""

    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    tcp: Optional[dist.ProcessGroup] = None

    def agreement(self) -> tuple:
        """The groups whose agreements reach every rank of TP x CP: the TP x CP group, or without it CP then TP."""
        return (self.tcp,) if self.tcp is not None else (self.cp, self.tp)


def check_tp_cp_groups(tp_group: dist.ProcessGroup, cp_group: dist.ProcessGroup,
                       tcp_group: Optional[dist.ProcessGroup]) -> None:
    """Raise SPConfigError unless ``tcp_group`` is the TP x CP group in CP-major order (rank = p T + t), the
    order in which its all-gather delivers every CP rank's tokens, each in CP-local order."""
    t, p = dist.get_rank(tp_group), dist.get_rank(cp_group)
    tw, pw = dist.get_world_size(tp_group), dist.get_world_size(cp_group)
    if tcp_group is None:
        raise SPConfigError("form='mixed' / 'mixed_in' needs the TP x CP group: TpCpGroups(tp, cp, tcp=the "
                            "tensor-and-context-parallel group)")
    if dist.get_world_size(tcp_group) != tw * pw or dist.get_rank(tcp_group) != p * tw + t:
        raise SPConfigError(f"the TP x CP group (TpCpGroups.tcp) must be TP x CP in CP-major order: rank "
                            f"{dist.get_rank(tcp_group)} of {dist.get_world_size(tcp_group)}, expected {p * tw + t} "
                            f"of {tw * pw}")


def check_form(form: str, groups: TpCpGroups) -> None:
    """The TP x CP form's own checks (this rank): a known form, and the TP x CP group the mixed forms need."""
    if form not in TP_CP_FORMS:
        raise SPConfigError(f"form={form!r} is invalid: choose one of {', '.join(TP_CP_FORMS)}")
    if form in ("mixed", "mixed_in"):
        check_tp_cp_groups(groups.tp, groups.cp, groups.tcp)


def make_tp_cp_plan(groups: TpCpGroups, problem: AttentionProblem, *, num_heads: int, num_kv_heads: int,
                    head_dim: int, prep: PrepTpCp, seq_local: int, device: torch.device, form: str = "pipelined",
                    run: Optional[LayerRun] = None) -> TpCpPlan:
    """The TpCpPlan of one layer call (arguments as in tp_cp_self_attention; seq_local = S_tp)."""
    run = run or LayerRun()
    check_form(form, groups)
    tp_group, tcp_group = groups.tp, groups.tcp
    tw = dist.get_world_size(tp_group)
    base = make_async_plan(groups.cp, problem, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           prep=prep, seq_local=seq_local * tw, device=device, run=run)
    fused = run.fused
    if fused is None:
        fused = getattr(base.transport, "name", "nccl") == "symm_mem"
    if fused:
        for g in {id(tp_group): tp_group, id(tcp_group): tcp_group}.values():
            why = fused_ops_unavailable_reason(g, device) if g is not None else None
            if why is not None:
                raise SPConfigError(f"the TP x CP layer's fused symm_mem matmuls (transport 'symm_mem' or "
                                    f"fused=True) cannot run here: {why}; use transport 'nccl' / fused=False")
    gather_in = form in ("mixed", "mixed_in")
    peers = (base.rank,) if gather_in else tuple(range(base.heads.world))
    hl = base.heads
    o_cols = tuple(g * head_dim + i for c in range(hl.chunks) for g in range(*hl.q_range(base.rank, c))
                   for i in range(head_dim)) if form == "mixed" else ()
    return TpCpPlan(**{f.name: getattr(base, f.name) for f in fields(AsyncPlan)}, tp_group=tp_group,
                    tcp_group=tcp_group, form=form, fused=bool(fused),
                    maps=chunk_maps(base.heads, head_dim, peers), rs_pieces=run.rs_pieces or max(1, tw), o_cols=o_cols)


def tp_cp_self_attention(x: torch.Tensor, weights: LayerWeights, groups: TpCpGroups,
                         problem: Optional[AttentionProblem] = None, *, num_heads: int, num_kv_heads: int,
                         prep: PrepTpCp, form: str = "pipelined", run: Optional[LayerRun] = None,
                         **keywords) -> torch.Tensor:
    """The TP x CP attention layer (see module docstring) on x [B, S_tp, dim]; returns y [B, S_tp, dim].

    x: this rank's tokens under TP sequence parallelism: TP rank t holds tokens [t S_tp, (t+1) S_tp) of its CP
    rank's S_cp = T S_tp tokens (CP placement ``problem.placement``, e.g. Megatron's "zigzag"). weights: this TP
    shard's ``LayerWeights`` (w_qkv [(H_t + 2 Hkv_t) D, dim] q | k | v rows, b_qkv [(H_t + 2 Hkv_t) D], w_o
    [dim, H_t D], b_o [dim] replicated, added once). groups: ``TpCpGroups(tp, cp, tcp)``; the problem is agreed
    over ``tcp`` (or CP then TP without it) on its first call. num_heads, num_kv_heads: this TP shard's H_t,
    Hkv_t. prep(branch, y [B, S', n, D], norm_weight, cp_gathered) -> [B, S', n, D], per head (see PrepTpCp).
    form: "pipelined", "mixed" (both sides fused) or "mixed_in" (input side fused); the mixed forms need
    ``groups.tcp``. problem / run (or their settings as keywords) as in ``async_ulysses_self_attention``;
    ``run.fused``: torch's symm_mem fused all-gather / reduce-scatter matmuls (None: with transport "symm_mem"),
    ``run.rs_pieces``: token pieces of the pipelined reduce-scatters (default T).
    """
    what = "tp_cp_self_attention"
    problem, run = layer_call(what, problem, run, keywords)
    tw = dist.get_world_size(groups.tp)

    def check():
        check_form(form, groups)
        return check_layer(what, problem, x, num_heads, num_kv_heads, run, dist.get_world_size(groups.cp),
                           seq_local=x.shape[1] * tw)
    agree_layer(what, problem, x, groups.agreement(), check)
    plan = make_tp_cp_plan(groups, problem, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=weights.head_dim(num_heads), prep=prep, seq_local=x.shape[1], device=x.device,
                           form=form, run=run)
    return apply_layer(TP_CP, x, weights, plan)
