"""Which rows of a packed sequence each rank holds under a dynamic-SP plan.

Rank r holds, per sample i on it (sample order), rows [(r - start_i) * c_i, (r - start_i + 1) * c_i) of sample i
padded at its tail to d_i * c_i rows (c_i = ceil(n_i / d_i)); padding rows are zeros.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .plan import DynamicPlan


def local_rows(plan: DynamicPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, pos): int64 [S_loc] each: the row of the full packed sequence each local row holds (-1: padding), and
    its position within its own sample (padding rows: 0)."""
    cu = plan.cu_seqlens
    src, pos = [], []
    for i, first, rows in plan.pieces(rank):
        j = torch.arange(first, first + rows)
        real = j < plan.lengths[i]
        src.append(torch.where(real, cu[i] + j, -1))
        pos.append(torch.where(real, j, 0))
    return torch.cat(src), torch.cat(pos)


def shard_dynamic(x: torch.Tensor, plan: DynamicPlan, rank: int, seq_dim: int = 1) -> torch.Tensor:
    """The full packed sequence ``x`` (``plan.cu_seqlens[-1]`` rows along ``seq_dim``) -> ``rank``'s rows (a new
    tensor; zeros on padding rows)."""
    src, _ = local_rows(plan, rank)
    x = x.movedim(seq_dim, 0)
    out = x.new_zeros((src.shape[0], *x.shape[1:]))
    real = src >= 0
    out[real] = x[src[real].to(x.device)]
    return out.movedim(0, seq_dim).contiguous()


def unshard_dynamic(x: torch.Tensor, plan: DynamicPlan, group: dist.ProcessGroup, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_dynamic`` over ``group`` (not autograd): every rank gets the full sequence. A row held by
    several ranks (none is: each real row has one owner) would take the last rank's value."""
    world = dist.get_world_size(group)
    srcs = [local_rows(plan, r)[0] for r in range(world)]
    most = max(s.shape[0] for s in srcs)
    x = x.movedim(seq_dim, 0)
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    out = x.new_zeros((plan.cu_seqlens[-1], *x.shape[1:]))
    for src, part in zip(srcs, parts):
        real = src >= 0
        out[src[real].to(x.device)] = part[:src.shape[0]][real]
    return out.movedim(0, seq_dim)
