"""Torus attention: the Ulysses exchange broken into stages overlapped with attention.

Over the mesh's Ulysses group (size T, this rank t), with ring/TASP attention over the Ring group
inside every Q x K|V pair's attention (positions from the SP-group placement, so masks stay exact):
  Pull Q  (k = 0..T-1): attend Q_{t-k,t} x KV_{t,t} (stationary) while Q_{t-k-1,t} arrives; the last
                        stage ships KV for the first Pull KV stage instead.
  Pull KV (k = 1..T-1): attend Q_{others,t} x KV_{t-k,t} while KV_{t-k-1,t} arrives.
  Push O:               send the finished O_{l,t} (l != t) to their owners while attending
                        Q_{t,t} x KV_{others,t}; then receive O_{t,j} from every j.
Partial results merge by log-sum-exp. Backward (ours; the paper is inference-only) mirrors it:
dO exchange overlapped with the own pair's (Q_{t,t} x KV_{t,t}) gradients, dK|dV of chunk j shipped home as soon as
it is complete (overlapping the next chunk), dQ shipped last. X_{l,j}: tokens of Ulysses rank l,
head group j. Two-sided (send/recv) exchanges. Packed samples (``cu_seqlens``): every pair's ring backend
attends within each sample (runs in the per-sample placement). Block masks: every pair's ring is the ring
(``RingBackend``, this rank's head group's mask rows), with its skips.

Why a Function of its own (``_TorusFn``) beside the ring's: its stages interleave Ulysses exchanges of Q, K|V, O and
their gradients with the pairs' attention in an order no single ring call has (the backward ships dO first, then
each pair's dK|dV home as it completes, dQ last), and each pair's ring runs in log-sum-exp form
(``RingBackend.forward_lse`` / ``backward_lse`` from the final out/lse) inside it; the ring's own Function would
differentiate one ring call, not the stage schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist

from ...config import DEFAULT_PLACEMENT
from ...attention.lse import acc_dtype, merge_into
from ...comm import p2p
from ...comm.p2p import wait_handles
from ...topology.mesh import SPMesh
from ..heads import HeadLayout, head_layout
from ..problem import AttentionProblem, problem_from_keywords, to_bshd
from .hybrid import rank_runs
from .ring import RingBackend


@dataclass(frozen=True)
class Stage:
    """One stage of a Torus rank's schedule: the pair it attends (``q_owners`` x ``kv_owners``: Ulysses indices of
    the ranks whose query / key tokens; empty: no attention) while ``moves`` ("q", "kv", "o", "do", "dkv", "dq"; ""
    for none) travels to ``dst`` and arrives from ``src`` (Ulysses indices, paired in order). ``after``: the transfer
    starts once the stage's attention is done (a finished dK|dV shipped home), else before it."""

    q_owners: tuple
    kv_owners: tuple
    moves: str = ""
    dst: tuple = ()
    src: tuple = ()
    after: bool = False


@dataclass(frozen=True)
class TorusSchedule:
    """Rank ``t``'s stages over a Ulysses group of ``T``: ``forward`` (Pull Q x T, Pull KV x T-1, Push O) and
    ``backward`` (dO with the own pair's gradients, Q_others x KV_t, each KV_j's pair with its dK|dV shipped home,
    dQ home). ``_TorusFn`` runs these stages; the speed plan (megatron_sp_ext/speed_plan) times them."""

    T: int
    t: int
    others: tuple
    forward: tuple
    backward: tuple


@lru_cache(maxsize=256)
def torus_schedule(T: int, t: int) -> TorusSchedule:
    """The stages of Ulysses rank ``t`` of ``T`` (module docstring)."""
    others = tuple((t - k) % T for k in range(1, T))
    fwd = []
    for k in range(T):   # Pull Q: Q_{t-k} x KV_t, the next Q chunk in flight; the last stage ships KV instead
        if k < T - 1:
            fwd.append(Stage(((t - k) % T,), (t,), "q", ((t + k + 1) % T,), ((t - k - 1) % T,)))
        else:
            fwd.append(Stage(((t - k) % T,), (t,), *(("kv", ((t + 1) % T,), ((t - 1) % T,)) if T > 1 else ())))
    for k in range(1, T):   # Pull KV: Q_others x KV_{t-k}, the next KV chunk in flight
        nxt = ("kv", ((t + k + 1) % T,), ((t - k - 1) % T,)) if k < T - 1 else ()
        fwd.append(Stage(others, ((t - k) % T,), *nxt))
    bwd = []
    if T > 1:
        fwd.append(Stage((t,), others, "o", others, others))   # Push O: Q_t x KV_others, finished O's go home
        bwd.append(Stage((t,), (t,) + others, "do", others, others))
        bwd.append(Stage(others, (t,)))
        bwd += [Stage(others, (j,), "dkv", (j,), ((t + i + 1) % T,), after=True) for i, j in enumerate(others)]
        bwd.append(Stage((), (), "dq", others, others))
    else:
        bwd.append(Stage((t,), (t,)))
    return TorusSchedule(T, t, others, tuple(fwd), tuple(bwd))


def _acc(t: torch.Tensor) -> torch.Tensor:
    """t in its accumulator dtype (fp32, or fp64 for fp64)."""
    return t.to(acc_dtype(t))


class _Ctx:
    """Static plan of one call: head groups, peers, and ring backends per (q tokens, kv tokens)."""

    def __init__(self, mesh: SPMesh, hl: HeadLayout, placement: str, seqlen: int, variant: str, inner, scale,
                 kv_valid_len=None, packed=None, problem=None):
        self.mesh, self.hl, self.scale = mesh, hl, scale
        self.T, self.t = mesh.ulysses_size, mesh.ulysses_index
        self.group = mesh.ulysses_group
        # ulysses index -> rank in the Ulysses group (new_group orders a group's ranks by global rank)
        self.peers = [dist.get_group_rank(self.group, dist.get_global_rank(mesh.group, g))
                      for g in mesh.ulysses_members()] if self.group is not None else [0]
        layout_cu, cu = (None, None) if packed is None else (packed.layout, packed.segments)
        runs = lambda j, l: rank_runs(placement, mesh.grid[j][l], mesh.world, seqlen, layout_cu)  # noqa: E731
        self.runs = runs
        self.stages = torus_schedule(self.T, self.t)   # what every stage attends and moves
        self.others = list(self.stages.others)
        self._be: dict = {}

        def ring_runs(ls) -> tuple:  # per ring rank j: the runs of the Ulysses ranks ``ls`` of its row
            return tuple(tuple(r for l in ls for r in runs(j, l)) for j in range(mesh.ring_size))
        # every block's ring: this rank's head group's mask rows (block_mask: the ring's skips per block); the
        # closure holds no ``self`` (a cycle through it kept the mesh's groups alive past destroy_process_group)
        heads = slice(*hl.q_range(mesh.ulysses_index, 0))
        self._mk = lambda q_ls, kv_ls: RingBackend(  # noqa: E731
            mesh.ring_group, variant, ring_runs(q_ls)[mesh.ring_index], ring_runs(kv_ls), inner, kv_valid_len, cu,
            problem=problem, seq_len=seqlen, q_runs_of=ring_runs(q_ls), heads=heads)

    def be(self, q_ls, kv_ls) -> RingBackend:
        key = (tuple(q_ls), tuple(kv_ls))
        if key not in self._be:
            self._be[key] = self._mk(q_ls, kv_ls)
        return self._be[key]

    def heads(self, j: int, kind: str):
        a, b = self.hl.q_range(j, 0) if kind == "q" else self.hl.kv_range(j, 0)
        return a, b


def _p2p(sends, recvs, c: "_Ctx"):
    """Start sends [(ulysses index, tensor)] and receives into [(ulysses index, buffer)] on the Ulysses group
    (``comm.p2p``: its emulated link where it spans emulated machines); handles for ``_wait``."""
    return p2p.start([("send", t, c.peers[p]) for p, t in sends] + [("recv", t, c.peers[p]) for p, t in recvs],
                     c.group)


def _wait(works):
    wait_handles(works)


def _bh(x_bshd):
    return x_bshd.transpose(1, 2)


def _cat_seq(xs):
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim=2)


class _TorusFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, c: _Ctx):
        T, t = c.T, c.t
        qa, qb = c.heads(t, "q")
        ka, kb = c.heads(t, "kv")
        own_q, own_k, own_v = _bh(q[:, :, qa:qb]), _bh(k[:, :, ka:kb]), _bh(v[:, :, ka:kb])
        qs = {t: own_q}
        ks, vs = {t: own_k}, {t: own_v}
        sl = q.shape[1]
        # -- Pull Q: attend Q_{l,t} x KV_{t,t}, next Q chunk in flight
        acc, lse = {}, {}
        for k_ in range(T):
            stage = c.stages.forward[k_]
            l = stage.q_owners[0]
            if stage.moves == "q":
                dst, src = stage.dst[0], stage.src[0]
                a, b = c.heads(dst, "q")
                buf = torch.empty(q.shape[0], sl, qb - qa, q.shape[3], dtype=q.dtype, device=q.device)
                work = _p2p([(dst, q[:, :, a:b].contiguous())], [(src, buf)], c)
                incoming = (src, buf)
            elif stage.moves == "kv":  # last Pull Q stage ships KV for the first Pull KV stage
                dst, src = stage.dst[0], stage.src[0]
                a, b = c.heads(dst, "kv")
                kbuf = torch.empty(k.shape[0], sl, kb - ka, k.shape[3], dtype=k.dtype, device=k.device)
                vbuf = torch.empty_like(kbuf)
                work = _p2p([(dst, k[:, :, a:b].contiguous()), (dst, v[:, :, a:b].contiguous())],
                            [(src, kbuf), (src, vbuf)], c)
                incoming = None
            else:
                work, incoming = [], None
            o, l_ = c.be([l], [t]).forward_lse(qs[l], own_k, own_v, causal=c.causal, softmax_scale=c.scale)
            acc[l], lse[l] = _acc(o), l_
            _wait(work)
            if incoming is not None:
                qs[incoming[0]] = _bh(incoming[1])
        # -- Pull KV: attend Q_{others,t} x KV_{j,t}
        if T > 1:
            ks[(t - 1) % T], vs[(t - 1) % T] = _bh(kbuf), _bh(vbuf)
            q_oth = _cat_seq([qs[l] for l in c.others])
            acc_o = _cat_seq([acc[l] for l in c.others]).contiguous()
            lse_o = _cat_seq([lse[l].unsqueeze(-1) for l in c.others]).squeeze(-1).contiguous()
            for k_ in range(1, T):
                stage = c.stages.forward[T - 1 + k_]
                j = stage.kv_owners[0]
                if stage.moves:
                    dst, src = stage.dst[0], stage.src[0]
                    a, b = c.heads(dst, "kv")
                    kbuf = torch.empty_like(ks[j].transpose(1, 2))
                    vbuf = torch.empty_like(kbuf)
                    work = _p2p([(dst, k[:, :, a:b].contiguous()), (dst, v[:, :, a:b].contiguous())],
                                [(src, kbuf), (src, vbuf)], c)
                else:
                    work = []
                o, l_ = c.be(c.others, [j]).forward_lse(q_oth, ks[j], vs[j], causal=c.causal, softmax_scale=c.scale)
                merge_into(acc_o, lse_o, o, l_)
                _wait(work)
                if stage.moves:
                    ks[src], vs[src] = _bh(kbuf), _bh(vbuf)
            out_o = acc_o.to(q.dtype)
            # -- Push O: ship finished O_{l,t}, attend Q_{t,t} x KV_{others,t}, receive O_{t,j}
            recv_o = {j: torch.empty(q.shape[0], sl, c.heads(j, "q")[1] - c.heads(j, "q")[0], q.shape[3],
                                     dtype=q.dtype, device=q.device) for j in c.others}
            sends = [(l, out_o[:, :, i * sl:(i + 1) * sl].transpose(1, 2).contiguous()) for i, l in enumerate(c.others)]
            work = _p2p(sends, list(recv_o.items()), c)
            k_oth, v_oth = _cat_seq([ks[j] for j in c.others]), _cat_seq([vs[j] for j in c.others])
            o, l_ = c.be([t], c.others).forward_lse(own_q, k_oth, v_oth, causal=c.causal, softmax_scale=c.scale)
            merge_into(acc[t], lse[t], o, l_)
            _wait(work)
        out = torch.empty_like(q)
        out[:, :, qa:qb] = acc[t].to(q.dtype).transpose(1, 2)
        for j in c.others:
            a, b = c.heads(j, "q")
            out[:, :, a:b] = recv_o[j]
        ctx.c = c
        saved = [own_q, own_k, own_v, acc[t].to(q.dtype), lse[t]]
        if T > 1:
            saved += [q_oth, k_oth, v_oth, out_o, lse_o]
        ctx.save_for_backward(*saved)
        ctx.shapes = (q.shape, k.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        c: _Ctx = ctx.c
        T, t = c.T, c.t
        saved = ctx.saved_tensors
        own_q, own_k, own_v, own_o, own_lse = saved[:5]
        q_shape, k_shape = ctx.shapes
        sl = q_shape[1]
        dout = dout.contiguous()
        qa, qb = c.heads(t, "q")
        ka, kb = c.heads(t, "kv")
        dq = torch.empty(q_shape, dtype=dout.dtype, device=dout.device)
        dk = torch.empty(k_shape, dtype=dout.dtype, device=dout.device)
        dv = torch.empty_like(dk)
        if T == 1:
            g = c.be([t], [t]).backward_lse(_bh(dout[:, :, qa:qb]), own_q, own_k, own_v, own_o, own_lse,
                                            causal=c.causal, softmax_scale=c.scale)
            for dst, x in zip((dq, dk, dv), g):
                dst.copy_(x.transpose(1, 2))
            return dq, dk, dv, None
        q_oth, k_oth, v_oth, out_o, lse_o = saved[5:]
        # 1. dO_{l,t} for every l (reverse Push O), overlapped with the own pair's gradients
        d_oth = {l: torch.empty(dout.shape[0], sl, qb - qa, dout.shape[3], dtype=dout.dtype, device=dout.device)
                 for l in c.others}
        sends = [(j, dout[:, :, c.heads(j, "q")[0]:c.heads(j, "q")[1]].contiguous()) for j in c.others]
        work = _p2p(sends, list(d_oth.items()), c)
        do_own = _bh(dout[:, :, qa:qb])
        k_all, v_all = torch.cat([own_k, k_oth], dim=2), torch.cat([own_v, v_oth], dim=2)
        gq_own, gk_all, gv_all = c.be([t], [t] + c.others).backward_lse(
            do_own, own_q, k_all, v_all, own_o, own_lse, causal=c.causal, softmax_scale=c.scale)
        gk_all, gv_all = _acc(gk_all), _acc(gv_all)
        _wait(work)
        do_oth = _cat_seq([_bh(d_oth[l]) for l in c.others])
        # 2. Q_{others} x KV_t (stays here), then each KV_j shipped home once complete (reverse Pull KV)
        gq_oth, gk, gv = c.be(c.others, [t]).backward_lse(do_oth, q_oth, own_k, own_v, out_o, lse_o,
                                                          causal=c.causal, softmax_scale=c.scale)
        gq_oth = _acc(gq_oth)
        gk_all[:, :, :sl] += _acc(gk)
        gv_all[:, :, :sl] += _acc(gv)
        dk[:, :, ka:kb] = gk_all[:, :, :sl].transpose(1, 2)
        dv[:, :, ka:kb] = gv_all[:, :, :sl].transpose(1, 2)
        pending, inbox = [], {}
        for i, j in enumerate(c.others):
            kj = k_oth[:, :, i * sl:(i + 1) * sl]
            vj = v_oth[:, :, i * sl:(i + 1) * sl]
            g_q, g_k, g_v = c.be(c.others, [j]).backward_lse(do_oth, q_oth, kj, vj, out_o, lse_o,
                                                             causal=c.causal, softmax_scale=c.scale)
            gq_oth += _acc(g_q)
            sk = (gk_all[:, :, (i + 1) * sl:(i + 2) * sl] + _acc(g_k)).to(dout.dtype).transpose(1, 2).contiguous()
            sv = (gv_all[:, :, (i + 1) * sl:(i + 2) * sl] + _acc(g_v)).to(dout.dtype).transpose(1, 2).contiguous()
            stage = c.stages.backward[2 + i]
            src = stage.src[0]  # rank whose round i ships our tokens' kv grads of its head group
            a, b = c.heads(src, "kv")
            rk = torch.empty(dout.shape[0], sl, b - a, dout.shape[3], dtype=dout.dtype, device=dout.device)
            rv = torch.empty_like(rk)
            pending.append((_p2p([(stage.dst[0], sk), (stage.dst[0], sv)], [(src, rk), (src, rv)], c), sk, sv))
            inbox[src] = (rk, rv)
        # 3. dQ_{l,t} home (reverse Pull Q); receive dQ_{t,j}
        rq = {j: torch.empty(dout.shape[0], sl, c.heads(j, "q")[1] - c.heads(j, "q")[0], dout.shape[3],
                             dtype=dout.dtype, device=dout.device) for j in c.others}
        gq_oth = gq_oth.to(dout.dtype)
        sends = [(l, gq_oth[:, :, i * sl:(i + 1) * sl].transpose(1, 2).contiguous()) for i, l in enumerate(c.others)]
        work = _p2p(sends, list(rq.items()), c)
        dq[:, :, qa:qb] = gq_own.transpose(1, 2)
        for w, _, _ in pending:
            _wait(w)
        _wait(work)
        for j in c.others:
            a, b = c.heads(j, "q")
            dq[:, :, a:b] = rq[j]
            a, b = c.heads(j, "kv")
            dk[:, :, a:b], dv[:, :, a:b] = inbox[j]
        return dq, dk, dv, None


def torus_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh,
                    problem: Optional[AttentionProblem] = None, *, ring_variant: str = "ring",
                    backend: str = "auto", **keywords) -> torch.Tensor:
    """Torus attention over ``mesh`` (see module docstring). problem: the ``AttentionProblem`` built once by the
    caller, or its settings as keywords (one problem per call). Shapes, placement, kv_valid_len and cu_seqlens
    (packed samples, attention within each sample) as hybrid_attention. block_mask / tile: block-sparse attention as
    ``ulysses_attention``'s; every pair's ring is the ring under the mask (``RingBackend`` with this rank's head
    group's mask rows: its calls, steps and K|V hops skipped per pair; ring_variant "ring" or "tasp"); the stages'
    exchanges all run. Not with cu_seqlens."""
    problem, _ = problem_from_keywords("torus_attention", problem, keywords)
    pr = problem.bind(q, k, v, mesh.group, what="torus_attention", mode="torus", backend=backend,
                      variant=("ring_variant", ring_variant),
                      p2p=(mesh.ulysses_group, mesh.ring_group))  # its stages and its ring are point to point
    causal, layout, placement = pr.causal, pr.layout, pr.placement
    q, k, v = (to_bshd(x, layout) for x in (q, k, v))
    hl = head_layout(q.shape[2], k.shape[2], mesh.ulysses_size, 1)
    if hl.kv_repeat > 1:
        k, v = k.repeat_interleave(hl.kv_repeat, dim=2), v.repeat_interleave(hl.kv_repeat, dim=2)
    c = _Ctx(mesh, hl, placement, pr.seqlen, ring_variant, pr.backend, pr.scale, pr.kv_valid_len, pr.packed, problem)
    c.causal = causal
    return to_bshd(_TorusFn.apply(q, k, v, c), layout)
