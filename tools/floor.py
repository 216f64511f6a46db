"""The kernel floor of a benchmark row: one rank's share of the attention as ONE local kernel call.

A rank of a P-way sequence-parallel job computes the attention of H/P heads (ceil: the busiest rank)
over the full sequence L; the fastest that can run on one GPU is one
``F.scaled_dot_product_attention`` call at that shape (cuDNN on Hopper). Every attention benchmark
times it in the same job (same GPUs, same clocks) and reports each mode's ratio to it.

    fl = floor_ms(group, heads=40, seqlen=32768, head_dim=128, causal=False)   # {"fwd": ms, "fwd_bwd": ms, ...}
    add_ratios(entry, fl)   # entry["floor_fwd_ms"], entry["ratio_fwd"], ... from entry["fwd_ms"], entry["fwd_bwd_ms"]
"""
from __future__ import annotations

import math
from typing import Optional

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


def add_ratios(entry: dict, floor: dict) -> dict:
    """Adds floor_fwd_ms / floor_fwd_bwd_ms and ratio_fwd / ratio_fwd_bwd (time / floor) to ``entry``."""
    entry["floor_fwd_ms"], entry["floor_fwd_bwd_ms"] = floor["fwd"], floor["fwd_bwd"]
    if "fwd_ms" in entry:
        entry["ratio_fwd"] = entry["fwd_ms"] / floor["fwd"]
    if "fwd_bwd_ms" in entry:
        entry["ratio_fwd_bwd"] = entry["fwd_bwd_ms"] / floor["fwd_bwd"]
    return entry
