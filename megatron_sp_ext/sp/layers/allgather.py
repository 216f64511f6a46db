"""Self-attention layer whose QKV exchange is a sequence all-gather fused with the QKV GEMM.

    x_full = all_gather_seq(x)                         [B, S, dim]   (S = P * S_local, rank order)
    q|k|v  = x_full W_r^T                               this rank's Ulysses heads only
    o      = attention(prep(q), prep(k), v)             per HCMS chunk, output exchanged head->seq
    y      = out_proj(o)

Plain Ulysses computes every head for its own tokens and exchanges q, k and v (3 x S_local x dim
per rank, of which (P-1)/P leaves); here each rank gathers x (S_local x dim from each peer) and
computes its heads for all tokens: the same FLOPs, P/3 of the bytes, and on CUDA the gather runs
inside ``torch.ops.symm_mem.fused_all_gather_matmul`` (pipelined with the GEMM over peers' shards).
Backward: dx = reduce_scatter_seq(dY_r W_r) through ``fused_matmul_reduce_scatter``, dW_r from a
re-gathered x (gathered on the communication stream during the q/k prep backward and the dx GEMM;
x_full is not kept between forward and backward). Where the fused ops are missing (CPU/gloo, other torch builds)
the same math runs as all-gather -> GEMM and GEMM -> reduce-scatter. Which one runs follows the
transport ("symm_mem": the fused ops; "nccl": NCCL collectives), or ``fused=`` explicitly.

QK-norm over all heads (Wan) needs the sum of squares over every rank's heads: ``prep`` receives a
``HeadShard`` whose ``sum_sq`` all-reduces it (autograd-aware); RoPE must use the GLOBAL positions of
the gathered sequence (``HeadShard.gather_tokens`` gathers per-token tables). Parameter gradients
are each rank's share (its heads' rows, zeros elsewhere; x's full contribution): summed over the
context-parallel group, as data-parallel gradient reduction does, they equal the plain layer's.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...comm import streams as st
from ...comm.autograd_reduce import all_reduce_sum
from ...comm.transport import symm_mem_unavailable_reason
from ...errors import SPConfigError
from ..problem import AttentionProblem
from .async_qkv import AsyncPlan, attention_backward, make_async_plan, out_proj_backward
from .call import LayerRun, LayerWeights, agree_layer, check_layer, layer_call
from .skeleton import LayerForm, apply_layer, attend_all, prep_backward, prep_forward, start_gather

# prep(branch, y [B, S, n*D], norm_weight (full, or None), shard) -> [B, S, n, D]
PrepFull = Callable[[str, torch.Tensor, Optional[torch.Tensor], "HeadShard"], torch.Tensor]


def _mm(a, b):
    """Every GEMM of this layer goes through here (one place to trace the schedule)."""
    return torch.matmul(a, b)


@dataclass(frozen=True)
class HeadShard:
    """This rank's heads in the all-gather layer (global indices) and the cross-rank helpers prep needs.

    q_heads: global q heads held here. kv_heads: the ORIGINAL kv head of each local kv head (GQA with
    fewer kv heads than ranks replicates them). kv_owner: per local kv head, whether this copy counts
    in cross-rank sums (exactly one copy of every kv head does).
    """

    group: dist.ProcessGroup
    q_heads: tuple
    kv_heads: tuple
    kv_owner: tuple
    device: torch.device = torch.device("cpu")   # where the index tensors below live (built once, cached)

    def sum_sq(self, y4: torch.Tensor, branch: str) -> torch.Tensor:
        """Sum of squares over ALL ranks' heads of ``branch`` ("q" or "k"), per token: y4 [B, S, n, D]
        (this rank's heads) -> [B, S, 1, 1] in float32 (float64 for float64 input), differentiable."""
        sq = y4.to(torch.promote_types(y4.dtype, torch.float32)).pow(2).sum(-1)
        if branch != "q" and not all(self.kv_owner):
            sq = sq * _device_const(self.kv_owner, sq.dtype, self.device)
        return all_reduce_sum(sq.sum(-1, keepdim=True), self.group)[..., None]

    def gather_tokens(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """A per-token table of this rank's tokens (no grad) -> the gathered sequence's, rank order."""
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def norm_weight(self, w: torch.Tensor, branch: str, head_dim: int) -> torch.Tensor:
        """The rows of a full QK-norm weight ([n_heads * D]) for this rank's heads: [n_local, D]."""
        heads = self.q_heads if branch == "q" else self.kv_heads
        return w.view(-1, head_dim).index_select(0, _device_const(heads, torch.long, w.device))


@dataclass
class GatherPlan(AsyncPlan):
    rows: Optional[torch.Tensor] = None      # rows of w_qkv this rank computes (q | k | v)
    shard: Optional[HeadShard] = None
    widths: tuple = ()                        # (h_r * D, kv_r * D, kv_r * D)
    fused: bool = False                       # torch.ops.symm_mem fused ops on this group


@lru_cache(maxsize=64)
def _shard_heads(hl, rank: int) -> tuple:
    qa = hl.q_offsets[rank]
    q_heads = tuple(range(qa, qa + hl.q_counts[rank]))
    ka = hl.kv_offsets[rank]
    rep = tuple(range(ka, ka + hl.kv_counts[rank]))          # replicated kv indices
    return q_heads, tuple(j // hl.kv_repeat for j in rep), tuple(j % hl.kv_repeat == 0 for j in rep)


@lru_cache(maxsize=64)
def _rows(num_heads: int, num_kv: int, d: int, q_heads: tuple, kv_heads: tuple, device: torch.device) -> torch.Tensor:
    """Rows of w_qkv (q | k | v) for this rank's heads, as an index tensor on ``device`` (built once)."""
    ar = list(range(d))
    rows = [g * d + i for g in q_heads for i in ar]
    rows += [(num_heads + j) * d + i for j in kv_heads for i in ar]
    rows += [(num_heads + num_kv + j) * d + i for j in kv_heads for i in ar]
    return torch.tensor(rows, device=device)


@lru_cache(maxsize=256)
def _device_const(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor built once per device: per-call host->device copies would stall the
    CPU until the GPU caught up (they synchronise) and expose every later kernel launch. (dtype is
    part of the key: (0, 1) and (False, True) hash alike.)"""
    return torch.tensor(values, dtype=dtype, device=device)


def fused_ops_unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
    """Why torch's fused all-gather/reduce-scatter matmuls cannot run here (None when they can)."""
    why = symm_mem_unavailable_reason(group, device)
    if why is not None:
        return why.replace("it needs", "they need")
    import torch.distributed._symmetric_memory as symm  # noqa: PLC0415
    ops = getattr(torch.ops, "symm_mem", None)
    for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        if ops is None or not hasattr(ops, name):
            return f"this torch build has no torch.ops.symm_mem.{name}"
    if not symm.is_symm_mem_enabled_for_group(group.group_name) and hasattr(symm, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group.group_name)
    return None


def _seq_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S_local, ...] -> [B, P * S_local, ...] in rank order (a view when B == 1)."""
    world = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()
    out = xs.new_empty(world * xs.shape[0], *xs.shape[1:])
    dist.all_gather_into_tensor(out, xs, group=group)
    return out.transpose(0, 1)


def _seq_reduce_scatter(part: torch.Tensor, group) -> torch.Tensor:
    """[B, S, n] partial sums -> [B, S_local, n]: summed over ranks, this rank's tokens."""
    world = dist.get_world_size(group)
    ps = part.transpose(0, 1).contiguous()
    out = ps.new_empty(ps.shape[0] // world, *ps.shape[1:])
    dist.reduce_scatter_tensor(out, ps, group=group)
    return out.transpose(0, 1)


def _gather_matmul(x: torch.Tensor, w_r: torch.Tensor, plan: GatherPlan) -> torch.Tensor:
    """x [B, S_local, dim] -> all_gather_seq(x) @ w_r^T  [B, S, n]."""
    if plan.fused:
        op = torch.ops.symm_mem.fused_all_gather_matmul
        kw = {"return_A": False} if "return_A" in str(op.default._schema) else {}
        _, outs = op(x.contiguous(), [w_r.t()], 1, plan.group.group_name, **kw)
        return outs[0]
    return _mm(_seq_gather(x, plan.group), w_r.t())


def _matmul_reduce_scatter(g: torch.Tensor, w_r: torch.Tensor, plan: GatherPlan) -> torch.Tensor:
    """g [B, S, n] @ w_r [n, dim], summed over ranks, this rank's tokens: [B, S_local, dim]."""
    if plan.fused:
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(g.contiguous(), w_r, "sum", 1, plan.group.group_name)
    return _seq_reduce_scatter(_mm(g, w_r), plan.group)


def project_gathered(x, w_qkv, b_qkv, nq_w, nk_w, plan: GatherPlan):
    """The pre-attention part: x [B, S_local, dim] -> this rank's heads over the whole sequence.

    Returns (w_r, four, saved_prep): w_r the rows of w_qkv used, four[name] the prepared [B, S, n, D]
    q, k, v, saved_prep what the QK-norm / RoPE backward needs. Used by the layer's forward and by
    tools/bench_block.py.
    """
    d = plan.dims[2]
    bsz, s_full = x.shape[0], x.shape[1] * plan.heads.world
    w_r = w_qkv.index_select(0, plan.rows)                   # [(h_r + 2 kv_r) D, dim]
    y = _gather_matmul(x, w_r, plan)                          # [B, S, (h_r + 2 kv_r) D]
    if b_qkv is not None:
        y = y + b_qkv.index_select(0, plan.rows)
    yq, yk, yv = torch.split(y, plan.widths, dim=-1)
    saved_prep, four = {}, {"v": yv.reshape(bsz, s_full, -1, d)}
    for name, yb, nw in (("q", yq, nq_w), ("k", yk, nk_w)):   # QK-norm + RoPE, graph kept for backward
        # a copy, not a view: a view would keep the whole q|k|v GEMM output alive until backward
        four[name], saved_prep[name] = prep_forward(lambda y_, w_, name=name: plan.prep(name, y_, w_, plan.shard),
                                                    yb.detach().clone(), nw)
    return w_r, four, saved_prep


def _forward(x, w_qkv, b_qkv, w_o, b_o, nq_w, nk_w, plan: GatherPlan):
    h, _, d = plan.dims
    hl, me = plan.heads, plan.rank
    bsz, s_loc, _ = x.shape
    compute, comm = st.current(x.device), plan.comm_stream
    w_r, four, saved_prep = project_gathered(x, w_qkv, b_qkv, nq_w, nk_w, plan)

    def views(c):
        (qa, qn), (ka, kn) = hl.q_chunks[me][c], hl.kv_chunks[me][c]
        return [t.contiguous().transpose(1, 2) for t in
                (four["q"][:, :, qa:qa + qn], four["k"][:, :, ka:ka + kn], four["v"][:, :, ka:ka + kn])]
    chunks, o_flat = attend_all(views, plan, x, s_loc, compute, comm)
    y_out = o_flat @ w_o.t()
    if b_o is not None:
        y_out = y_out + b_o
    meta = (b_qkv is not None, b_o is not None, w_qkv.shape, w_qkv.dtype)
    return y_out, (x, w_r, w_o, o_flat), (chunks, saved_prep, meta)


def _backward(saved, state, dy, plan: GatherPlan):
    x, w_r, w_o, o_flat = saved
    chunks, saved_prep, (has_b_qkv, has_b_o, w_shape, w_dtype) = state
    _, _, d = plan.dims
    hl, me = plan.heads, plan.rank
    bsz, s_loc, dim = x.shape
    tokens, s_full = s_loc * bsz, s_loc * hl.world
    compute, comm = st.current(x.device), plan.comm_stream
    recv_g, ev_g, d_w_o, d_b_o = out_proj_backward(dy, w_o, o_flat, plan, has_b_o, tokens, d, compute, comm)
    wq, wk, wv = plan.widths
    g_all = g4 = None
    for c in range(hl.chunks):
        (qa, qn), (ka, kn) = hl.q_chunks[me][c], hl.kv_chunks[me][c]
        g3 = attention_backward(chunks, c, recv_g, ev_g, plan, s_loc, bsz, d, compute)
        if g_all is None:  # allocated once the first chunk's attention inputs are freed (peak memory)
            g_all = torch.empty(bsz, s_full, wq + wk + wv, dtype=dy.dtype, device=dy.device)
            g4 = {"q": torch.empty(bsz, s_full, wq // d, d, dtype=dy.dtype, device=dy.device),
                  "k": torch.empty(bsz, s_full, wk // d, d, dtype=dy.dtype, device=dy.device),
                  "v": g_all[..., wq + wk:].view(bsz, s_full, wv // d, d)}
        for i, (name, a, n) in enumerate((("q", qa, qn), ("k", ka, kn), ("v", ka, kn))):
            g4[name][:, :, a:a + n].copy_(g3[i].transpose(1, 2))
            g3[i] = None
    # x is needed again only for dW: gather it on the comm stream while the q/k prep backward and the
    # dx GEMM run (x_full is not kept from the forward: P x the layer's input)
    get_x_full = start_gather(x, plan.group, compute, comm)
    d_norm = {}
    for name, off in (("q", 0), ("k", wq)):  # prep backward; each graph is freed right after
        g_y, d_norm[name] = prep_backward(saved_prep.pop(name), g4.pop(name))
        g_all[..., off:off + g_y.shape[-1]].copy_(g_y)
        del g_y
    dx = _matmul_reduce_scatter(g_all, w_r, plan)
    x_full = get_x_full()
    g2 = g_all.reshape(-1, g_all.shape[-1])
    d_w_r = _mm(g2.t(), x_full.reshape(-1, dim))
    d_w_qkv = torch.zeros(w_shape, dtype=w_dtype, device=dy.device).index_add_(0, plan.rows, d_w_r.to(w_dtype))
    d_b_qkv = None
    if has_b_qkv:
        d_b_qkv = torch.zeros(w_shape[0], dtype=w_dtype, device=dy.device).index_add_(
            0, plan.rows, g2.sum(0).to(w_dtype))
    return dx.reshape(x.shape), d_w_qkv, d_b_qkv, d_w_o, d_b_o, d_norm["q"], d_norm["k"]


ALLGATHER = LayerForm("allgather", _forward, _backward)


def make_gather_plan(group: dist.ProcessGroup, problem: AttentionProblem, *, num_heads: int, num_kv_heads: int,
                     head_dim: int, prep: PrepFull, seq_local: int, device: torch.device,
                     run: Optional[LayerRun] = None) -> GatherPlan:
    """The GatherPlan of one layer call (arguments as in make_async_plan). ``run.fused``: True (torch's fused
    symm_mem all-gather/reduce-scatter matmuls; an error where they cannot run), False (NCCL all-gather -> GEMM,
    GEMM -> reduce-scatter) or None (follow the transport: fused with "symm_mem")."""
    run = run or LayerRun()
    base = make_async_plan(group, problem, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           prep=prep, seq_local=seq_local, device=device, run=run)
    hl = base.heads
    q_heads, kv_heads, kv_owner = _shard_heads(hl, base.rank)
    rows = _rows(num_heads, num_kv_heads, head_dim, q_heads, kv_heads, torch.device(device))
    fused = run.fused
    if fused is None:
        fused = getattr(base.transport, "name", "nccl") == "symm_mem"
    why = fused_ops_unavailable_reason(group, device) if fused else None
    if why is not None:
        raise SPConfigError(f"the all-gather layer's fused symm_mem matmuls (transport 'symm_mem' or fused=True) "
                            f"cannot run here: {why}; use transport 'nccl' / fused=False")
    d = head_dim
    return GatherPlan(**{f.name: getattr(base, f.name) for f in fields(AsyncPlan)}, rows=rows,
                      shard=HeadShard(group, q_heads, kv_heads, kv_owner, torch.device(device)),
                      widths=(len(q_heads) * d, len(kv_heads) * d, len(kv_heads) * d),
                      fused=bool(fused))


def allgather_self_attention(x: torch.Tensor, weights: LayerWeights, group: dist.ProcessGroup,
                             problem: Optional[AttentionProblem] = None, *, num_heads: int, num_kv_heads: int,
                             prep: PrepFull, run: Optional[LayerRun] = None, **keywords) -> torch.Tensor:
    """The all-gather QKV layer on this rank's tokens x [B, S_local, dim]; returns [B, S_local, dim].

    weights, problem (or its settings as keywords: causal, placement, kv_valid_len, softmax_scale) and run (or
    its settings as keywords: head_chunks, backend, comm_stream, transport, fused) as in
    ``async_ulysses_self_attention``; ``prep(branch, y [B, S, n D], norm_weight, shard)`` maps this rank's heads of
    a branch over the WHOLE gathered sequence to [B, S, n, D] (use ``shard.sum_sq`` for norms over all heads,
    ``shard.norm_weight`` for the local rows of a norm weight, global positions for RoPE). transport "nccl": NCCL
    all-gather -> GEMM (and GEMM -> reduce-scatter in backward) and NCCL output exchange; "symm_mem": torch's fused
    symm_mem matmuls and the copy-engine output exchange (``fused`` overrides the QKV side). Parameter gradients
    are this rank's share: sum them over ``group`` (as DP/CP gradient reduction does).
    """
    what = "allgather_self_attention"
    problem, run = layer_call(what, problem, run, keywords)
    agree_layer(what, problem, x, (group,), lambda: (run.refuse(what, ("rs_pieces",)), check_layer(
        what, problem, x, num_heads, num_kv_heads, run, dist.get_world_size(group))))
    plan = make_gather_plan(group, problem, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=weights.head_dim(num_heads), prep=prep, seq_local=x.shape[1], device=x.device,
                            run=run)
    return apply_layer(ALLGATHER, x, weights, plan)
