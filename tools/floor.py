"""The kernel floor of a benchmark row: one rank's share of the attention as ONE local kernel call.

A rank of a P-way sequence-parallel job computes the attention of H/P heads (ceil: the busiest rank)
over the full sequence L; the fastest that can run on one GPU is one
``F.scaled_dot_product_attention`` call at that shape (cuDNN on Hopper). Every attention benchmark
times it in the same job (same GPUs, same clocks) and reports each mode's ratio to it.

    fl = floor_ms(group, heads=40, seqlen=32768, head_dim=128, causal=False)   # {"fwd": ms, "fwd_bwd": ms, ...}
    add_ratios(entry, fl)   # entry["floor_fwd_ms"], entry["ratio_fwd"], ... from entry["fwd_ms"], entry["fwd_bwd_ms"]
    fa4 = kernel_floor_ms(group, "fa4", 40, 32768, 128, False)   # the same floor through FlashAttention-4
    add_ratios(entry, fa4, tag="fa4")                            # entry["ratio_fa4_fwd_bwd"], ...
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tools.benchlib import median_ms


def floor_ms(group: Optional[dist.ProcessGroup], heads: int, seqlen: int, head_dim: int = 128, causal: bool = False,
             iters: int = 5, warmup: int = 2, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Floor of a row with ``heads`` total heads over ``seqlen`` tokens on the ranks of ``group`` (None = one GPU):
    fwd and fwd+bwd ms (median of ``iters``, max over ranks) of one SDPA call at [1, ceil(H/P), L, D]."""
    world = dist.get_world_size(group) if group is not None else 1
    h = math.ceil(heads / world)
    q, k, v = (torch.randn(1, h, seqlen, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    with torch.no_grad():
        fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), iters, warmup, group)

    def fb():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(do)
        q.grad = k.grad = v.grad = None
    fwd_bwd = median_ms(fb, iters, warmup, group)
    del q, k, v, do
    return {"fwd": fwd, "fwd_bwd": fwd_bwd, "heads_per_rank": h, "seqlen": seqlen, "causal": causal,
            "kernel": "F.scaled_dot_product_attention"}


def kernel_floor_ms(group: Optional[dist.ProcessGroup], kernel: str, heads: int, seqlen: int, head_dim: int = 128,
                    causal: bool = False, iters: int = 5, warmup: int = 2, dtype: torch.dtype = torch.bfloat16,
                    profile: Optional[Callable[[Callable[[], object]], dict]] = None) -> dict:
    """The floor of ``floor_ms`` through one kernel of the registry (e.g. FlashAttention-4): one plain call of
    [1, ceil(H/P), L, D] with its backward. {"error": why} when the kernel is not installed or fails here.
    ``profile``: called with the fwd+bwd callable after the timing; its result is the entry's "profile"."""
    from megatron_sp_ext.attention import kernels  # noqa: PLC0415
    k_impl = kernels.get(kernel)
    if not k_impl.installed():
        return {"error": f"{k_impl.label} is not installed", "kernel": kernel}
    world = dist.get_world_size(group) if group is not None else 1
    h = math.ceil(heads / world)
    try:
        q, k, v = (torch.randn(1, h, seqlen, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        do, scale = torch.randn_like(q), head_dim ** -0.5
        with torch.no_grad():
            fwd = median_ms(lambda: k_impl.attention(q, k, v, causal, scale), iters, warmup, group)

        def fb():
            k_impl.attention(q, k, v, causal, scale).backward(do)
            q.grad = k.grad = v.grad = None
        fwd_bwd = median_ms(fb, iters, warmup, group)
    except Exception as e:  # noqa: BLE001 - a floor that cannot run here is reported in the row, not fatal
        return {"error": f"{type(e).__name__}: {e}", "kernel": kernel}
    extra = {"profile": profile(fb)} if profile is not None else {}   # its own failures are in its result
    return {"fwd": fwd, "fwd_bwd": fwd_bwd, "heads_per_rank": h, "seqlen": seqlen, "causal": causal,
            "kernel": k_impl.label, **extra}


def add_ratios(entry: dict, floor: dict, tag: str = "") -> dict:
    """Adds floor_fwd_ms / floor_fwd_bwd_ms and ratio_fwd / ratio_fwd_bwd (time / floor) to ``entry``; with ``tag``
    (a second floor, e.g. "fa4") floor_<tag>_fwd_ms ... ratio_<tag>_fwd_bwd. A floor without times adds nothing."""
    if "fwd" not in floor:
        return entry
    t = f"{tag}_" if tag else ""
    entry[f"floor_{t}fwd_ms"], entry[f"floor_{t}fwd_bwd_ms"] = floor["fwd"], floor["fwd_bwd"]
    if "fwd_ms" in entry:
        entry[f"ratio_{t}fwd"] = entry["fwd_ms"] / floor["fwd"]
    if "fwd_bwd_ms" in entry:
        entry[f"ratio_{t}fwd_bwd"] = entry["fwd_bwd_ms"] / floor["fwd_bwd"]
    return entry
