"""The inputs of a context-parallel benchmark row and its full-sequence reference, shared by both sides of one job.

tools/bench_cp.py (our modes) and tools/bench_cp_te.py (Transformer Engine's CP, in its own processes) build the
SAME full tensors from one seed (``full_inputs``) and check every mode's output and q/k/v gradients, gathered to the
full sequence, against ONE full-sequence attention call on one GPU (``full_reference``; bf16, all heads), norm-wise
(``rel_errs``). The reference runs PyTorch's own flash kernel (``SDPBackend.FLASH_ATTENTION``), not cuDNN: importing
TE changes which cuDNN kernel torch's SDPA picks, and a kernel that cannot run raises instead of falling back to the
L x L math kernel.

    q, k, v, do = full_inputs(seqlen=32768, heads=40, head_dim=128)          # each [1, L, H, D] bf16, cuda
    ref = full_reference(q, k, v, do, causal=True)                          # [out, dq, dk, dv], each [1, L, H, D]
    errs = rel_errs(got, ref)                                               # {"out": ..., "dq": ..., ...}
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

TOL = 2e-2   # norm-wise relative error allowed against the reference (bf16 rounding of two different kernels)
NAMES = ("out", "dq", "dk", "dv")
SEED = 1234


def full_inputs(seqlen: int, heads: int, head_dim: int, seed: int = SEED, device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> list:
    """[q, k, v, dout], each [1, seqlen, heads, head_dim] (bshd), drawn from one generator seeded ``seed``: the same
    tensors in every process of the job (and on every rank)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(1, seqlen, heads, head_dim, device=device, dtype=dtype, generator=g) for _ in range(4)]


def full_reference(q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor, do_bshd: torch.Tensor,
                   causal: bool) -> list:
    """One attention call over the whole sequence (all heads, this GPU): [out, dq, dk, dv], each [B, L, H, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q_bshd, k_bshd, v_bshd))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o.backward(do_bshd.transpose(1, 2))
    return [t.transpose(1, 2).contiguous() for t in (o.detach(), q.grad, k.grad, v.grad)]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float32."""
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def rel_errs(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> dict:
    """{"out", "dq", "dk", "dv"} -> norm-wise relative error of ``got`` against ``ref`` (same order)."""
    if len(got) != len(NAMES) or len(ref) != len(NAMES):
        raise ValueError(f"rel_errs takes [out, dq, dk, dv] twice, got {len(got)} and {len(ref)} tensors")
    return {n: rel_err(a, b) for n, a, b in zip(NAMES, got, ref)}


def within(errs: dict, tol: float = TOL) -> bool:
    """Every error of ``errs`` below ``tol``."""
    return all(e < tol for e in errs.values())
