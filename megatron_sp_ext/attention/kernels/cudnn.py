"""cuDNN attention through torch (``aten._scaled_dot_product_cudnn_attention`` / ``_backward``: what
F.scaled_dot_product_attention picks on Hopper): log-sum-exp blocks (lse [B, H, Sq, 1] or [B, H, Sq] depending on
the build) and plain calls through SDPA with the cuDNN backend. GQA: k/v expanded, dk/dv summed back.

torch (2.11 at least) caches one cuDNN backward graph per key (shapes, q/k/v strides, causal, dropout, ...): the
strides of O and dO are baked into the graph but are not in its key, and torch passes dO on as autograd hands it
(only an innermost stride other than 1 is fixed). A later call of the same key whose dO (or O) is laid out
otherwise is read with the first call's strides: right outputs, gradients ~1 off or non-finite. So every call
made here feeds cuDNN one layout per key: q, k, v contiguous (``dense``), O and dO exactly in O's layout, which
torch allocates from q's (``in_layout_of`` on the log-sum-exp route; ``grad_in_own_layout`` on the outputs of the
plain SDPA calls, whose dO would otherwise be whatever the caller's backward produced: a slice of a packed
gradient, a transposed view, or a timing trial's ``out.detach()``). On 1 x H200 (torch 2.11, cuDNN 9.19,
2026-11-26) a packed DiT step's per-sample calls gave gradients ~1 off or non-finite in the step's process, and
right ones replayed alone in a fresh process (tests/gpu/check_sdpa_calls.py; the replays fed dO contiguous, the step
slices of a packed gradient): this cache was the cause. With the hook the same step is 3.6e-3 off fp32 and the
dit_dynamic family passes on cuDNN in bf16 (4 x H200, 2026-11-26; tests/gpu/check_cudnn_do_layout.py: 1.40 off
without the hook, 4.3e-3 with it; tests/test_cudnn_layouts.py has the CUDA case).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Capabilities, Kernel, expand_kv, fold_kv_grad

HALF = (torch.float16, torch.bfloat16)
# argument names of the schemas called here (torch 2.11 and 2.13 agree; a different build is refused)
FWD_ARGS = ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask",
            "scale")
BWD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
            "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale")


def _schema_args(op_name: str):
    op = getattr(torch.ops.aten, op_name, None)
    if op is None:
        return None
    try:
        return tuple(a.name for a in op.default._schema.arguments)
    except (AttributeError, RuntimeError):
        return None


def schema_ok() -> bool:
    """Whether this torch build has the cuDNN ops with the argument lists passed here."""
    return (_schema_args("_scaled_dot_product_cudnn_attention") == FWD_ARGS
            and _schema_args("_scaled_dot_product_cudnn_attention_backward") == BWD_ARGS)


def _strides_without_ones(shape, stride) -> tuple:
    """The strides over the dimensions of size > 1 (a size-1 dimension's stride addresses nothing)."""
    return tuple(st for n, st in zip(shape, stride) if n > 1)


def dense(*ts: torch.Tensor) -> tuple:
    """The tensors as cuDNN gets them: contiguous (a copy of a strided view; see the module docstring)."""
    return tuple(t.contiguous() for t in ts)


def relaid(t: torch.Tensor, stride: tuple) -> torch.Tensor:
    """``t`` with exactly the strides ``stride``: itself when they are its strides, a view when they differ only on
    dimensions of size 1, else a copy in that layout (``stride`` must describe a dense layout of ``t``'s shape)."""
    stride = tuple(stride)
    if tuple(t.stride()) == stride:
        return t
    if _strides_without_ones(t.shape, t.stride()) == _strides_without_ones(t.shape, stride):
        return t.as_strided(t.shape, stride)
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def in_layout_of(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (same shape as ``like``) with exactly the strides ``torch.empty_like(like)`` has (``relaid``)."""
    return relaid(t, torch.empty_like(like, device="meta").stride())


def grad_in_own_layout(out: torch.Tensor) -> torch.Tensor:
    """``out`` (a plain SDPA call's output) with a hook that hands its gradient on with exactly ``out``'s strides,
    so the SDPA backward that follows gets one dO layout per cuDNN graph key (see the module docstring)."""
    if out.requires_grad:
        stride = out.stride()
        out.register_hook(lambda g: relaid(g, stride))
    return out


class CudnnKernel(Kernel):
    name = setting = "cudnn"
    label = "cuDNN (torch SDPA)"
    in_torch_sdpa = True   # "auto"'s plain calls go through torch's SDPA dispatch
    caps = Capabilities(plain=True, lse=True, varlen=None, tiles="none", dropout=True,
                        dtypes={"cuda": HALF})

    def __init__(self) -> None:
        self.aux: dict = {}

    def schema_ok(self) -> bool:
        return schema_ok()

    def why_not_here(self, call):
        if not schema_ok():
            return "this torch build lacks the cuDNN attention ops with the arguments used here"
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available here"
        return None

    def _aux(self, device, dtype):
        """(philox_seed, philox_offset, lse_ndim) of a dropout-free cuDNN forward (data-independent)."""
        key = (str(device), dtype)
        if key not in self.aux:
            x = torch.zeros(1, 1, 64, 64, device=device, dtype=dtype)
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
            self.aux[key] = (res[6], res[7], res[1].dim())
        return self.aux[key]

    def attention(self, q, k, v, causal, scale, tiles=None):
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
        k, v, _ = expand_kv(k, v, q.shape[1])  # autograd sums the copies back
        q, k, v = dense(q, k, v)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return grad_in_own_layout(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale))

    def forward(self, q, k, v, scale, causal, tiles=None):
        b, h, sq, _ = q.shape
        k, v, _ = expand_kv(k, v, h)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(*dense(q, k, v), None, True, 0.0, causal, False,
                                                                 scale=scale)
        return res[0], res[1].reshape(b, h, sq)

    def backward(self, do, q, k, v, out, lse, scale, causal, tiles=None):
        sq = q.shape[2]
        ke, ve, rep = expand_kv(k, v, q.shape[1])
        q, ke, ve = dense(q, ke, ve)
        lse = lse.float()
        seed, offset, lse_dim = self._aux(q.device, q.dtype)
        out, do = in_layout_of(out, q), in_layout_of(do, q)
        lse_in = (lse.unsqueeze(-1) if lse_dim == 4 else lse).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, q, ke, ve, out, lse_in, seed, offset, None, None, None, sq, ke.shape[2], 0.0, causal, scale=scale)
        return dq, fold_kv_grad(dk, rep), fold_kv_grad(dv, rep)
