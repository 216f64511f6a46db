"""Wan's rotary embedding (diffusers' ``WanAttnProcessor``: pairs interleaved, cos/sin tables in float32) as ONE
kernel per direction on CUDA, bit for bit diffusers' eager ops.

    out_bshd = wan_rotary(x_bshd, freqs_cos, freqs_sin, fused=True)     # x [B, S, H, D], freqs [1, S, 1, D]

diffusers' eager form runs ~8 elementwise kernels forward (float32 halves of x, strided writes) and ~10 backward per
tensor; the fused kernels read x (or dO) once and write once. Bit-identical because they do the same roundings in
the same order: forward y_even = r(fl(x_e * cos_e) - fl(x_o * sin_o)), y_odd = r(fl(x_e * sin_o) + fl(x_o * cos_e))
(fl: a float32 product, r: the cast to x's dtype; FMA contraction off); backward, as autograd does it (each use's
gradient cast to x's dtype, then the two summed in x's dtype): dx_e = r(r(g_e * cos_e) + r(g_o * sin_o)),
dx_o = r(r(g_o * cos_e) - r(g_e * sin_o)). ``fused=True`` falls back to the eager ops wherever the kernel does not
apply (no CUDA, no triton, x not float16/bfloat16/float32, tables not float32 [1, S, 1, D], tables that need grad).
tests/gpu/test_cuda.py::test_wan_rope_fused_bitwise checks the equality on the GPU; the CPU suite runs the eager form
against diffusers'.
"""
from __future__ import annotations

from typing import Optional

import torch

try:   # the GPU image has triton; a CPU install need not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (the CPU suite)
    triton = None

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 512   # elements of one token's H x D row per program


def wan_rotary_eager(x_bshd: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """diffusers' WanAttnProcessor RoPE, op for op: x [B, S, H, D], cos/sin [1, S, 1, D] (pairs interleaved)."""
    x1, x2 = x_bshd.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x_bshd)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x_bshd)


def fused_applies(x_bshd: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> Optional[str]:
    """None where the fused kernels run this call; else why not (the eager ops run)."""
    if triton is None:
        return "triton is not installed"
    if x_bshd.device.type != "cuda":
        return f"x is on {x_bshd.device.type}"
    if x_bshd.dtype not in FUSED_DTYPES:
        return f"x is {x_bshd.dtype}"
    b, s, h, d = x_bshd.shape if x_bshd.dim() == 4 else (0, 0, 0, 1)
    for name, t in (("freqs_cos", freqs_cos), ("freqs_sin", freqs_sin)):
        if t.dtype != torch.float32 or tuple(t.shape) != (1, s, 1, d) or d % 2 or t.requires_grad:
            return f"{name} is {t.dtype} {tuple(t.shape)} (requires_grad={t.requires_grad}) for x {tuple(x_bshd.shape)}"
        if t.device != x_bshd.device:
            return f"{name} is on {t.device}"
    return None


if triton is not None:
    @triton.jit
    def _rope_fwd(x_ptr, cos_ptr, sin_ptr, out_ptr, S, HD, D: tl.constexpr, BLOCK: tl.constexpr, RND: tl.constexpr):
        row = tl.program_id(0)   # token (b, s) of the contiguous [B*S, H*D] view
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)   # element of the row: head j // D, channel j % D
        m = j < HD
        base = row.to(tl.int64) * HD
        d = j % D
        tab = (row % S).to(tl.int64) * D
        x = tl.load(x_ptr + base + j, mask=m, other=0.0).to(tl.float32)
        xp = tl.load(x_ptr + base + (j ^ 1), mask=m, other=0.0).to(tl.float32)   # the pair's other element
        c = tl.load(cos_ptr + tab + (d & ~1), mask=m, other=0.0)   # cos of the pair (its even channel)
        sn = tl.load(sin_ptr + tab + (d | 1), mask=m, other=0.0)   # sin of the pair (its odd channel)
        xc = x * c
        ps = xp * sn
        y = tl.where((d & 1) == 0, xc - ps, ps + xc)
        tl.store(out_ptr + base + j, y.to(out_ptr.dtype.element_ty, fp_downcast_rounding=RND), mask=m)

    @triton.jit
    def _rope_bwd(g_ptr, cos_ptr, sin_ptr, dx_ptr, S, HD, D: tl.constexpr, BLOCK: tl.constexpr, RND: tl.constexpr):
        row = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = j < HD
        base = row.to(tl.int64) * HD
        d = j % D
        tab = (row % S).to(tl.int64) * D
        g = tl.load(g_ptr + base + j, mask=m, other=0.0).to(tl.float32)
        gp = tl.load(g_ptr + base + (j ^ 1), mask=m, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + tab + (d & ~1), mask=m, other=0.0)
        sn = tl.load(sin_ptr + tab + (d | 1), mask=m, other=0.0)
        dt = dx_ptr.dtype.element_ty
        gc = (g * c).to(dt, fp_downcast_rounding=RND).to(tl.float32)    # this element's own use (x * cos), cast
        gs = (gp * sn).to(dt, fp_downcast_rounding=RND).to(tl.float32)  # its use in the pair's other output (* sin)
        dx = tl.where((d & 1) == 0, gc + gs, gc - gs)
        tl.store(dx_ptr + base + j, dx.to(dt, fp_downcast_rounding=RND), mask=m)


def _launch(kernel, x_bshd: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    x_bshd = x_bshd.contiguous()
    b, s, h, d = x_bshd.shape
    out = torch.empty_like(x_bshd)
    if x_bshd.numel():
        grid = (b * s, triton.cdiv(h * d, BLOCK))
        args = (x_bshd, freqs_cos.contiguous(), freqs_sin.contiguous(), out, s, h * d)
        rnd = None if x_bshd.dtype == torch.float32 else "rtne"   # torch's casts round to nearest even
        if x_bshd.device.type == "cuda":
            with torch.cuda.device(x_bshd.device):
                kernel[grid](*args, D=d, BLOCK=BLOCK, RND=rnd, enable_fp_fusion=False)
        else:   # triton's interpreter (TRITON_INTERPRET=1): the CPU check of the indexing (its bfloat16 cast
            # truncates: only float32 / float16 are bit-exact there)
            kernel[grid](*args, D=d, BLOCK=BLOCK, RND=rnd)
    return out


class FusedWanRotary(torch.autograd.Function):
    """The fused forward and backward (module docstring); only the tables are saved (as the eager ops save)."""

    @staticmethod
    def forward(ctx, x_bshd: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(freqs_cos, freqs_sin)
        return _launch(_rope_fwd, x_bshd, freqs_cos, freqs_sin)

    @staticmethod
    def backward(ctx, g_bshd: torch.Tensor):
        freqs_cos, freqs_sin = ctx.saved_tensors
        return _launch(_rope_bwd, g_bshd, freqs_cos, freqs_sin), None, None


def wan_rotary(x_bshd: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
               fused: bool = True) -> torch.Tensor:
    """Wan's RoPE on x [B, S, H, D] with tables [1, S, 1, D]: the fused kernels where ``fused`` and they apply
    (``fused_applies``), else diffusers' eager ops; the same bits either way."""
    if fused and fused_applies(x_bshd, freqs_cos, freqs_sin) is None:
        return FusedWanRotary.apply(x_bshd, freqs_cos, freqs_sin)
    return wan_rotary_eager(x_bshd, freqs_cos, freqs_sin)
