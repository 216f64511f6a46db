"""A differentiable sum over a process group (what ``torch.distributed.nn.functional.all_reduce`` did before
torch deprecated it; ``torch.distributed._functional_collectives.all_reduce`` has no backward).

    y = all_reduce_sum(x, group)   # every rank: y = sum over the group's ranks of x (same shape, dtype)

Backward: each rank's y feeds its own loss, so dL/dx on every rank is the sum of the ranks' dL/dy, itself an
``all_reduce_sum`` (differentiable again), as torch's deprecated function computes it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        return _AllReduceSum.apply(grad_y, ctx.group), None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x [any shape] -> the sum of every rank's x over ``group`` (a new tensor; x is left unmodified), with a
    backward that sums the ranks' gradients."""
    return _AllReduceSum.apply(x, group)
