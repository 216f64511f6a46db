"""Attention of one HCMS chunk on head-sharded q/k/v, forward and backward, and what it keeps in between.

``attend`` runs the local kernel on global-order [B, h_c, S, D] q/k/v (keys at positions >= kv_valid_len cut
off; dropout through the registry's dropout kernel, torch's SDPA). With ``AutoBackend``s' fused kernels
(``explicit_kernels``) it calls the kernel's forward with log-sum-exp and keeps (q, k, v, out, lse) in autograd's
saved tensors (``hold``), so activation checkpointing drops them; otherwise it keeps an inner autograd graph. ``attend_backward`` gives the chunk's
(dq, dk, dv) from either. Packed samples (the plan's ``cu_seqlens``): every step runs once per sample over
the sample's global range (a block-diagonal mask), outputs / lse / gradients concatenated in sample order, by
the plan's ``varlen_kernel`` method (attention/varlen.py: "per_sample" by default, one call per sample;
"grouped", "flash_varlen" or "auto").
"""
from __future__ import annotations

from typing import Optional

import torch

from ...attention import block_sparse, kernels, tiles, varlen
from ...attention.backends import AutoBackend, LocalAttention
from .plan import AttendPlan


def _cu_of(plan: AttendPlan) -> Optional[tuple[int, ...]]:
    # only UlyssesPlan carries packed samples; the other Ulysses-family plans never have any
    return getattr(plan, "cu_seqlens", None)


def _varlen_method(plan: AttendPlan, q, k, v, cu: tuple[int, ...]) -> str:
    """The packed-samples method of the explicit-kernel path (``varlen.method_for``; "auto" decided over the plan's
    group, the same on every rank, and cached per key, so the backward gets the forward's choice)."""
    return varlen.method_for(getattr(plan, "varlen_kernel", "per_sample"), plan.backend, q, k, v, cu,
                             causal=plan.causal, scale=plan.scale, need_grad=plan.need_grad, explicit=True,
                             across=varlen.CallGroup(plan.group, plan.heads))


def local_attention(be: LocalAttention, q, k, v, causal: bool, scale: float, valid: Optional[int],
                     dropout_p: float = 0.0, cu_seqlens: Optional[tuple[int, ...]] = None,
                     varlen_kernel: str = "per_sample", group=None, group_heads=None):
    """The local kernel on global-order bhsd q/k/v; keys at positions >= ``valid`` are padding: they are
    cut off (one call; causal: a causal call for the valid queries and a full one for the padded rows).
    dropout_p > 0: the registry's dropout kernel (torch's SDPA with its own dropout, ``kernels.dropout_kernel``)
    instead of ``be`` (under autograd, so the backward reuses the forward's mask). cu_seqlens (packed samples, no padding): attention within each sample by the
    ``varlen_kernel`` method (varlen.py; "per_sample": one call per sample over its range; "auto" decided over
    ``group``, the ranks that make this call together, its heads named by ``group_heads``: ``varlen.method_for``)."""
    if dropout_p > 0.0:
        setting = be.kernel_setting if isinstance(be, AutoBackend) else "auto"
        be = _Dropout(kernels.dropout_kernel(setting, getattr(be, "setting", "backend"), dropout_p), dropout_p)
        # "auto" would time calls that draw dropout masks (moving the RNG stream): one call per sample instead
        varlen_kernel = "per_sample" if varlen_kernel == "auto" else varlen_kernel
    if cu_seqlens is not None:
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        method = varlen.method_for(varlen_kernel, be, q, k, v, cu_seqlens, causal=causal, scale=scale,
                                   need_grad=need_grad, explicit=False, across=varlen.CallGroup(group, group_heads))
        return varlen.attention(method, be, q, k, v, cu_seqlens, causal=causal, scale=scale)
    if valid is None:
        return be(q, k, v, causal=causal, softmax_scale=scale)
    kv = (k[:, :, :valid], v[:, :, :valid])
    if not causal:
        return be(q, *kv, causal=False, softmax_scale=scale)
    head = be(q[:, :, :valid], *kv, causal=True, softmax_scale=scale)
    tail = be(q[:, :, valid:], *kv, causal=False, softmax_scale=scale)
    return torch.cat([head, tail], dim=2)


class _Dropout(LocalAttention):
    """The dropout kernel's calls [B, H, S, D] (GQA allowed; ``kernels.dropout_kernel``: torch's SDPA with its own
    dropout); differentiable, no log-sum-exp."""

    name = "dropout"

    def __init__(self, kernel: kernels.Kernel, dropout_p: float) -> None:
        self.kernel, self.dropout_p = kernel, dropout_p

    def __call__(self, q, k, v, *, causal, softmax_scale):
        return self.kernel.dropout_attention(q, k, v, causal, softmax_scale, self.dropout_p)


def explicit_kernels(plan: AttendPlan, like: torch.Tensor) -> bool:
    """Whether a call runs the kernels' own forward/backward (with log-sum-exp) and keeps each chunk's
    (q, k, v, out, lse) in autograd's saved tensors (``hold``) instead of an inner autograd graph per chunk:
    ``AutoBackend``s whose log-sum-exp kernel for ``like``'s device and dtype is a fused one (cuDNN or
    flash; not the math fallback, e.g. fp32 on CUDA), gradients wanted. Saved tensors go through autograd's
    saved-tensor hooks, so activation checkpointing drops them and recomputes the call once; an inner graph
    kept on ``ctx`` stayed alive under checkpointing (no memory saved) and was recomputed once per chunk."""
    if not (plan.need_grad and isinstance(plan.backend, AutoBackend)):
        return False
    if plan.dropout_p > 0.0:  # the kernels' explicit forward/backward carry no dropout mask
        return False
    return plan.backend.kernel_for(like) != kernels.FALLBACK


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


def _tile_mask_of(plan: AttendPlan) -> Optional[tiles.TileSlice]:
    # only UlyssesPlan carries a block mask (its whole-sequence slice); the other Ulysses-family plans never have one
    return getattr(plan, "tiles", None)


def attend(plan: AttendPlan, qc, kc, vc, explicit: bool, chunk: int = 0):
    """Chunk attention on head-sharded bhsd q/k/v. explicit: kernel forward with log-sum-exp, (q, k, v, out,
    lse) held (``hold``); else the backend under autograd (the inner graph) when gradients are wanted.
    With a block mask (``plan.tiles``): ``attend_block_sparse`` for chunk ``chunk``'s heads.
    Returns (out, what ``attend_backward`` needs or None)."""
    if _tile_mask_of(plan) is not None:
        return attend_block_sparse(plan, qc, kc, vc, chunk)
    if explicit:
        oc, lse = _forward_lse(plan, qc, kc, vc)
        return oc, hold(qc, kc, vc, oc, lse)
    need_grad = plan.need_grad  # the layer Functions' plans: always
    if need_grad:
        qc, kc, vc = (t.detach().requires_grad_() for t in (qc, kc, vc))
    with torch.set_grad_enabled(need_grad):
        oc = local_attention(plan.backend, qc, kc, vc, plan.causal, plan.scale, plan.kv_valid_len,
                              plan.dropout_p, _cu_of(plan), getattr(plan, "varlen_kernel", "per_sample"),
                              plan.group, plan.heads)
    return oc, ((qc, kc, vc, oc) if need_grad else None)


def attend_backward(plan: AttendPlan, c: int, do_c, chunks: list) -> list:
    """Chunk c's (dq, dk, dv), head-sharded bhsd, from what ``attend`` kept in chunks[c] (dropped here: the
    chunk's saved tensors are freed as soon as its gradients exist)."""
    kept, chunks[c] = chunks[c], None
    if isinstance(kept, tuple):  # the inner autograd graph
        qc, kc, vc, oc = kept
        del kept
        return list(torch.autograd.grad(oc, (qc, kc, vc), do_c))
    if _tile_mask_of(plan) is not None:  # a block-sparse kernel's forward with lse: its backward from out/lse
        qc, kc, vc, oc, lse = kept.grad_fn.saved_tensors
        del kept
        kern, ts = _tile_kernel(plan, qc, c)
        return list(kern.backward(do_c, qc, kc, vc, oc, lse, plan.scale, plan.causal, ts))
    qc, kc, vc, oc, lse = kept.grad_fn.saved_tensors
    del kept
    return _backward_lse(plan, do_c, qc, kc, vc, oc, lse)


def _tile_kernel(plan: AttendPlan, qc: torch.Tensor, chunk: int):
    """(kernel, tile slice) of chunk ``chunk``'s block-sparse call: the mask's rows of this rank's chunk heads over
    the global order (the plan's whole-sequence slice, which lives on the problem: a mask shared by the layers of a
    step is converted once, a layer's own top-k mask once per layer), the kernel the backend picks for it
    (``LocalAttention.tile_kernel``). No host sync: the choice reads host positions, the metadata is device work."""
    ts = plan.tiles.with_heads(slice(*plan.heads.q_range(plan.rank, chunk)))
    return plan.backend.tile_kernel(qc, ts, plan.causal, lse=False), ts


def attend_block_sparse(plan: AttendPlan, qc, kc, vc, chunk: int):
    """Chunk ``chunk``'s attention under the plan's block mask: q/k/v bhsd [B, h_c, S, D] in GLOBAL order (the
    plan's order puts them there), the mask's rows of this rank's chunk heads (one row broadcasts), AND causal, AND
    kv_valid_len. A kernel with log-sum-exp (FA4's block sparsity, math) runs its forward and holds (q, k, v, out,
    lse) for ``attend_backward``; one without (flex) keeps the inner graph; a ``BlockSparseBackend`` (a hybrid
    mesh's ring, in the order it knows) keeps the inner graph too."""
    if isinstance(plan.backend, block_sparse.BlockSparseBackend):  # it applies the mask over its own positions
        heads = slice(*plan.heads.q_range(plan.rank, chunk))
        if plan.need_grad:
            qc, kc, vc = (t.detach().requires_grad_() for t in (qc, kc, vc))
        with torch.set_grad_enabled(plan.need_grad):
            oc = plan.backend.attend(qc, kc, vc, heads=heads, causal=plan.causal, softmax_scale=plan.scale)
        return oc, ((qc, kc, vc, oc) if plan.need_grad else None)
    kern, ts = _tile_kernel(plan, qc, chunk)
    if kern.caps.lse:
        oc, lse = kern.forward(qc, kc, vc, plan.scale, plan.causal, ts)
        return oc, (hold(qc, kc, vc, oc, lse) if plan.need_grad else None)
    if plan.need_grad:
        qc, kc, vc = (t.detach().requires_grad_() for t in (qc, kc, vc))
    with torch.set_grad_enabled(plan.need_grad):
        oc = kern.attention(qc, kc, vc, plan.causal, plan.scale, ts)
    return oc, ((qc, kc, vc, oc) if plan.need_grad else None)


def _forward_lse(plan: AttendPlan, q, k, v):
    """``local_attention``'s calls through the backend's kernels with log-sum-exp: (out, lse) over global-order
    bhsd q/k/v; keys at positions >= kv_valid_len are cut off (causal: a causal call for the valid queries
    and a full one for the padded rows, their outputs and lse side by side)."""
    be, valid, scale, cu = plan.backend, plan.kv_valid_len, plan.scale, _cu_of(plan)
    if cu is not None:  # packed samples: by the plan's varlen method ("per_sample": one call per sample)
        return varlen.forward_lse(_varlen_method(plan, q, k, v, cu), be, q, k, v, cu, causal=plan.causal,
                                  scale=scale)
    if valid is None:
        return be.forward_lse(q, k, v, causal=plan.causal, softmax_scale=scale)
    kv = (k[:, :, :valid], v[:, :, :valid])
    if not plan.causal:
        return be.forward_lse(q, *kv, causal=False, softmax_scale=scale)
    head = be.forward_lse(q[:, :, :valid], *kv, causal=True, softmax_scale=scale)
    tail = be.forward_lse(q[:, :, valid:], *kv, causal=False, softmax_scale=scale)
    return torch.cat([head[0], tail[0]], dim=2), torch.cat([head[1], tail[1]], dim=2)


def _backward_lse(plan: AttendPlan, do, q, k, v, out, lse) -> list:
    """The gradients of ``_forward_lse``: [dq, dk, dv] (padded keys get zero gradients)."""
    be, valid, scale, cu = plan.backend, plan.kv_valid_len, plan.scale, _cu_of(plan)
    if cu is not None:  # packed samples: the forward's method
        return varlen.backward_lse(_varlen_method(plan, q, k, v, cu), be, do, q, k, v, out, lse, cu,
                                   causal=plan.causal, scale=scale)
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
