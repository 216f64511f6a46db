"""Fused attention kernels that also return the log-sum-exp, and their backward given FINAL out/lse.

One block call: q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (bhsd, any strides with stride(-1) == 1),
``causal`` = top-left aligned (used with Sq == Sk only). Forward returns (out [B, H, Sq, D] in q's
dtype, lse fp32 [B, H, Sq]); backward takes the merged out/lse of the rows, which makes every block's
gradient exact (the kernels recompute P = exp(S * scale - lse) and D = rowsum(dO * O)).

Kernels, fastest first on Hopper (``KERNELS``):
  "fa4"        FlashAttention-4 (pip ``flash-attn-4``; ``fa4``): Hopper/Blackwell, bf16/fp16, GQA without expanding
               k/v; 1.12-1.17x cuDNN's fwd+bwd on an H200 at our shapes (2026-11-24)
  "cudnn"      torch.ops.aten._scaled_dot_product_cudnn_attention (what F.scaled_dot_product_attention
               picks on Hopper; returns lse [B, H, Sq, 1] or [B, H, Sq] depending on the build)
  "flash"      torch.ops.aten._scaled_dot_product_flash_attention (FlashAttention-2; on CPU its CPU op)
  "math"       blockwise.math_forward/backward (fp32 or fp64 reference; any device, any dtype)
The memory-efficient kernel is not offered: on an H100 (torch 2.11) its backward was wrong when fed merged
out/lse with strided k/v (dq/dk errors 0.1-3.9 and NaN; tools/results/2026-11-23_h100_early), which is
exactly how ring steps call it.
Blocks with one query or one key row run on "math" whatever the kernel: on an H100 (torch 2.11, CUDA 13) cuDNN's
1 x 1 block crashed the process (segfault) and flash's returned garbage (error 1e24), while 2 x 2 and 1 x 5 were
right (tools/results/2026-11-24_h100_packed_padding/tiny_blocks.txt). Packed samples make such blocks: a
one-token sample, or a sample's one padding row.
Availability is a schema check plus a tiny probe call per (kernel, device, dtype), cached.
GQA: k/v are expanded to q's heads for cuDNN and flash and dk/dv summed back; FA4 takes them as they are.
A kernel may also refuse a head dim (FA4: ``fa4.head_dim_ok``): ``available(..., head_dim=)`` says so.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from . import blockwise, fa4
from .lse import merge

log = logging.getLogger("megatron_sp_ext")

KERNELS = ("fa4", "cudnn", "flash", "math")

# argument names of the schemas this module calls (torch 2.11 and 2.13 agree; a different build is refused)
_CUDNN_FWD_ARGS = ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                   "return_debug_mask", "scale")
_CUDNN_BWD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
                   "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale")


def _schema_args(op_name: str) -> Optional[tuple]:
    op = getattr(torch.ops.aten, op_name, None)
    if op is None:
        return None
    try:
        return tuple(a.name for a in op.default._schema.arguments)
    except (AttributeError, RuntimeError):
        return None


def schema_ok(kernel: str) -> bool:
    """Whether this torch build has ``kernel``'s ops with the argument lists this module passes."""
    if kernel == "cudnn":
        return (_schema_args("_scaled_dot_product_cudnn_attention") == _CUDNN_FWD_ARGS
                and _schema_args("_scaled_dot_product_cudnn_attention_backward") == _CUDNN_BWD_ARGS)
    if kernel == "fa4":
        return fa4.installed() and fa4.schema_ok()
    return kernel in ("flash", "math")


def _dtype_ok(kernel: str, device_type: str, dtype: torch.dtype) -> bool:
    if kernel == "math":
        return True
    if kernel == "fa4":
        return True   # fa4.why_not decides (device, dtype, head dim): see available
    if device_type == "cuda":  # fp32 stays on math (exact, as before): the fused fp32 paths are not the point
        return dtype in (torch.float16, torch.bfloat16)
    # CPU: torch's CPU flash op only (fp64 goes to math, the reference precision)
    return kernel == "flash" and dtype in (torch.float32, torch.bfloat16, torch.float16)


_PROBED: dict = {}


def why_not(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> str:
    """Why ``kernel`` does not run for (device, dtype, head_dim) here, in a user's words ("" if it runs)."""
    if available(kernel, device, dtype, head_dim):
        return ""
    if kernel == "fa4":
        return fa4.why_not(device, dtype, head_dim) or "its probe call against the math kernel failed here"
    return f"it does not run on {torch.device(device).type} with {dtype}"


def available(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> bool:
    """Whether ``kernel`` runs here for ``dtype`` (schema, dtype, and one tiny probe call, cached) and, when given,
    ``head_dim``."""
    device = torch.device(device)
    if kernel not in KERNELS or not schema_ok(kernel) or not _dtype_ok(kernel, device.type, dtype):
        return False
    if kernel == "cudnn" and not torch.backends.cudnn.is_available():
        return False
    if kernel == "fa4" and (fa4.why_not(device, dtype) is not None
                            or (head_dim is not None and not fa4.head_dim_ok(head_dim, device))):
        return False
    key = (kernel, str(device), dtype)
    if key not in _PROBED:
        # a kernel this build/device lacks; FA4 (a separate package, compiled at its first call) may also fail by
        # assertions or its DSL's own errors: any failure of its probe means "not here"
        failures = Exception if kernel == "fa4" else (RuntimeError, NotImplementedError, TypeError)
        try:
            ok = _probe(kernel, device, dtype)
        except failures as e:  # noqa: BLE001 - see above
            log.info("megatron_sp_ext: attention kernel %s unavailable on %s/%s: %s", kernel, device, dtype, e)
            ok = False
        _PROBED[key] = ok
    return _PROBED[key]


def _probe(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel used as a ring uses it, on a tiny case (40 rows: not a multiple of any tile), against math:
    a causal block and a full block of keys merged by log-sum-exp, then each block's backward fed the MERGED
    out/lse (a kernel that only handles a lone block must not pass)."""
    g = torch.Generator().manual_seed(0)
    q, k0, v0, k1, v1, do = (torch.randn(1, 2, 40, 64, generator=g).to(device=device, dtype=dtype) for _ in range(6))
    blocks = ((k0, v0, True), (k1, v1, False))
    parts = [forward(kernel, q, k, v, 0.125, c) for k, v, c in blocks]
    o, lse = merge([p[0] for p in parts], [p[1] for p in parts])
    o = o.to(dtype)
    grads = [backward(kernel, do, q, k, v, o, lse, 0.125, c) for k, v, c in blocks]
    ref = [blockwise.math_forward(q.float(), k.float(), v.float(), 0.125, "causal" if c else None)
           for k, v, c in blocks]
    o_m, lse_m = merge([r[0] for r in ref], [r[1] for r in ref])
    grads_m = [blockwise.math_backward(do.float(), q.float(), k.float(), v.float(), o_m, lse_m, 0.125,
                                       "causal" if c else None) for k, v, c in blocks]
    close = lambda a, b: bool((a.float() - b.float()).abs().max() <= 3e-2 * (1 + b.float().abs().max()))  # noqa: E731
    return (close(o, o_m) and close(lse, lse_m)
            and all(close(a, b) for gk, gm in zip(grads, grads_m) for a, b in zip(gk, gm)))


def best(device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> str:
    """The first of ``KERNELS`` available for (device, dtype, head_dim)."""
    for k in KERNELS:
        if available(k, device, dtype, head_dim):
            return k
    return "math"


def _expand(k, v, heads):
    return blockwise.expand_kv(k, v, heads)


_AUX: dict = {}


def _cudnn_aux(device, dtype):
    """(philox_seed, philox_offset, lse_ndim) of a dropout-free cuDNN forward (data-independent)."""
    key = (str(device), dtype)
    if key not in _AUX:
        x = torch.zeros(1, 1, 64, 64, device=device, dtype=dtype)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
        _AUX[key] = (res[6], res[7], res[1].dim())
    return _AUX[key]


_PACK_ONLY: set = set()


def _strided_or_packed(op, tensors, rest, scale):
    """Run ``op`` on the (possibly strided) views; if this build's cuDNN refuses their strides, on packed
    copies instead (the same kernel and math; remembered per stride pattern, logged once)."""
    key = (getattr(op, "__name__", "op"), tuple(t.stride() for t in tensors), tuple(t.shape for t in tensors))
    if key not in _PACK_ONLY:
        try:
            return op(*tensors, *rest, scale=scale)
        except RuntimeError as e:
            log.info("megatron_sp_ext: cuDNN attention refused strided views (%s); packing them", e)
            _PACK_ONLY.add(key)
    return op(*(t.contiguous() for t in tensors), *rest, scale=scale)


def _strides_without_ones(t: torch.Tensor) -> tuple:
    """t's strides over its dimensions of size > 1 (a size-1 dimension's stride addresses nothing)."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


def in_layout_of(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (same shape as ``like``) in the memory layout ``torch.empty_like(like)`` has: ``t`` itself when its
    strides already match over the dimensions of size > 1, else a copy in that layout."""
    want = torch.empty_like(like, device="meta")
    if t.shape == like.shape and _strides_without_ones(t) == _strides_without_ones(want):
        return t
    out = torch.empty_strided(like.shape, want.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def one_row_block(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a block (q [B, H, Sq, D], k [B, Hkv, Sk, D]) has one query or one key row: the fused kernels are not
    trusted with it (see the module docstring); it runs on "math"."""
    return q.shape[2] == 1 or k.shape[2] == 1


def _for_block(kernel: str, q, k) -> str:
    """``kernel``, or "math" for a one-row block."""
    return "math" if one_row_block(q, k) else kernel


def forward(kernel: str, q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (out in q.dtype, lse fp32 [B, H, Sq]) with ``kernel`` (see module docstring)."""
    kernel = _for_block(kernel, q, k)
    if kernel == "math":
        o, lse = blockwise.math_forward(q, k, v, scale, "causal" if causal else None)
        return o, lse
    if kernel == "flash":
        return blockwise.fused_forward(q, k, v, scale, causal)
    if kernel == "fa4":
        return fa4.forward(q, k, v, scale, causal)
    b, h, sq, _ = q.shape
    k, v, _ = _expand(k, v, h)
    if kernel == "cudnn":
        res = _strided_or_packed(torch.ops.aten._scaled_dot_product_cudnn_attention, (q, k, v),
                                 (None, True, 0.0, causal, False), scale)
        return res[0], res[1].reshape(b, h, sq)
    raise ValueError(f"unknown kernel {kernel!r}")


def backward(kernel: str, do, q, k, v, out, lse, scale: float, causal: bool):
    """Block gradients (dq, dk, dv) given the FINAL out (q dtype) and lse (fp32 [B, H, Sq]) of the rows."""
    kernel = _for_block(kernel, q, k)
    if kernel == "math":
        return blockwise.math_backward(do, q, k, v, out, lse, scale, "causal" if causal else None)
    if kernel == "flash":
        return blockwise.fused_backward(do, q, k, v, out, lse, scale, causal)
    if kernel == "fa4":
        return fa4.backward(do, q, k, v, out, lse, scale, causal)
    b, h, sq, _ = q.shape
    ke, ve, rep = _expand(k, v, h)
    lse = lse.float()
    if kernel == "cudnn":
        seed, offset, lse_dim = _cudnn_aux(q.device, q.dtype)
        # torch caches one cuDNN backward graph per (shapes, q/k/v strides, causal, ...): O's and dO's strides
        # are baked into the graph but are not in its key. Fed in q's layout (the layout cuDNN's forward
        # gives O), they are a function of the key, so a cached graph never reads them with other strides.
        out, do = in_layout_of(out, q), in_layout_of(do, q)
        lse_in = (lse.unsqueeze(-1) if lse_dim == 4 else lse).contiguous()
        dq, dk, dv = _strided_or_packed(
            lambda do_, q_, k_, v_, out_, *rest, scale: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do_, q_, k_, v_, out_, *rest, scale=scale),
            (do, q, ke, ve, out), (lse_in, seed, offset, None, None, None, sq, ke.shape[2], 0.0, causal), scale)
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    return dq, blockwise.fold_kv_grad(dk, rep), blockwise.fold_kv_grad(dv, rep)
