"""One SP step's loss and gradients as SP=1 computes them: the local loss (each rank's share of the mean) times
the SP size backpropagated, then the loss summed and every parameter gradient averaged over the SP group."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def loss_and_grads(model: torch.nn.Module, loss_r: torch.Tensor, group: Optional[dist.ProcessGroup]):
    """(loss as a float, [grad of each parameter]) of this rank's local loss ``loss_r`` over ``group`` (None: one
    rank)."""
    sp = dist.get_world_size(group) if group is not None else 1
    (loss_r * sp).backward()
    loss = loss_r.detach().clone()
    grads = [p.grad.clone() for p in model.parameters()]
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads:
            dist.all_reduce(g, group=group)
            g /= sp
    return loss.item(), grads
