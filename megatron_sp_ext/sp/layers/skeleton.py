"""The autograd skeleton the layers share (async_qkv, allgather, tp_cp).

    y = apply_layer(FORM, x, weights, plan)          # weights: call.LayerWeights

A layer is two halves (``LayerForm``), both on this rank's tokens x [B, S_local, dim]:
    forward(x, w_qkv, b_qkv, w_o, b_o, nq_w, nk_w, plan) -> (y, tensors to save, state)
    backward(saved tensors, state, dy, plan) -> (dx, d_w_qkv, d_b_qkv, d_w_o, d_b_o, d_nq_w, d_nk_w)
``LayerFn`` is the one autograd Function around them: it saves the tensors, keeps the state (the
attention chunks and q/k prep graphs the backward needs) for exactly one backward, joins the communication
stream into the compute stream after it, and drops the plan and state (nothing of the call outlives its
gradients). ``apply_layer`` runs it under the caller's autocast. The steps the layers share:
``prep_forward`` / ``prep_backward`` (the q/k prep, QK-norm and RoPE, whose graph is kept from the forward to
the backward), ``attend_all`` (every HCMS chunk's attention, outputs exchanged home) and ``start_gather``
(x all-gathered again on the communication stream for the weight gradients).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...comm import streams as st
from ..ulysses import attend_and_send


@dataclass(frozen=True)
class LayerForm:
    """A layer's forward and backward halves (see the module docstring)."""

    name: str
    forward: Callable
    backward: Callable


class LayerFn(torch.autograd.Function):
    """y = form(x, w_qkv, b_qkv, w_o, b_o, nq_w, nk_w) with the layer's own schedule in both directions."""

    @staticmethod
    def forward(ctx, x, w_qkv, b_qkv, w_o, b_o, nq_w, nk_w, plan, form: LayerForm):
        y, saved, state = form.forward(x, w_qkv, b_qkv, w_o, b_o, nq_w, nk_w, plan)
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.state, ctx.form = plan, state, form
        return y

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        grads = ctx.form.backward(ctx.saved_tensors, ctx.state, dy, plan)
        if plan.comm_stream is not None:  # the exchanges' last reads / writes, before the grads are used
            st.current(dy.device).wait_stream(plan.comm_stream)
        ctx.plan = ctx.state = None  # nothing of the call outlives its gradients
        return (*grads, None, None)


def apply_layer(form: LayerForm, x: torch.Tensor, weights, plan) -> torch.Tensor:
    """``LayerFn`` of ``form`` on x and ``weights`` (a ``call.LayerWeights``) under the caller's autocast: what
    autocast would do to each GEMM is done once up front (differentiable casts, so fp32 master weights still get
    their grads), and the Function then runs in one dtype, forward and backward."""
    w_qkv, b_qkv, w_o, b_o, norm_q_weight, norm_k_weight = weights.tensors()
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return LayerFn.apply(x, w_qkv, b_qkv, w_o, b_o, norm_q_weight, norm_k_weight, plan, form)
    dt = torch.get_autocast_dtype(dev)
    x, w_qkv, b_qkv, w_o, b_o = (t.to(dt) if t is not None else None for t in (x, w_qkv, b_qkv, w_o, b_o))
    with torch.autocast(dev, enabled=False):
        return LayerFn.apply(x, w_qkv, b_qkv, w_o, b_o, norm_q_weight, norm_k_weight, plan, form)


def prep_forward(prep: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor], y: torch.Tensor,
                 norm_weight: Optional[torch.Tensor]) -> tuple:
    """``prep(y_leaf, w_leaf)`` with its graph kept for ``prep_backward``: y (a projection, no grad) and the
    norm weight become leaves. Returns (the prepared tensor, detached; saved). Pass a copy of y where a view
    would keep a larger GEMM output alive until the backward."""
    y_leaf = y.detach().requires_grad_()
    w_leaf = norm_weight.detach().requires_grad_() if norm_weight is not None else None
    with torch.enable_grad():
        y4g = prep(y_leaf, w_leaf)
    return y4g.detach(), (y_leaf, w_leaf, y4g)


def prep_backward(saved: tuple, grad: torch.Tensor) -> tuple:
    """The prep's backward from ``prep_forward``'s saved graph (freed with it): (dy, d_norm_weight or None)."""
    y_leaf, w_leaf, y4g = saved
    res = torch.autograd.grad(y4g, (y_leaf,) if w_leaf is None else (y_leaf, w_leaf), grad)
    return res[0], (res[1] if w_leaf is not None else None)


def attend_all(views: Callable, plan, like: torch.Tensor, s_loc: int, compute, comm) -> tuple:
    """Every HCMS chunk's attention (``views(c)``: chunk c's head-sharded q, k, v), each output exchanged home
    as soon as it is done: (chunks kept for the backward, o_flat [B, s_loc, H D] of this rank's tokens)."""
    bsz, d = like.shape[0], plan.dims[2]
    out = torch.empty(bsz, s_loc, plan.heads.num_heads, d, dtype=like.dtype, device=like.device)
    chunks = attend_and_send(views, plan, out, s_loc * bsz, d, compute, comm)
    return chunks, out.view(bsz, s_loc, -1)


def start_gather(x: torch.Tensor, group, compute, comm) -> Callable[[], torch.Tensor]:
    """Start the all-gather of x [B, s, dim] over ``group`` on ``comm`` (after the compute stream's work so far);
    returns get: get() waits for it and gives [B, G s, dim] in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return lambda: x
    xs = x.transpose(0, 1).contiguous()
    ready = st.record(compute)
    with st.on_stream(comm):
        st.wait(comm, ready)
        full = xs.new_empty(world * xs.shape[0], *xs.shape[1:])
        work = dist.all_gather_into_tensor(full, xs, group=group, async_op=True)

    def get():
        with st.on_stream(comm):
            work.wait()
            done = st.record(comm)
        st.wait(compute, done)
        if comm is not None:
            full.record_stream(compute)
        return full.transpose(0, 1)
    return get
