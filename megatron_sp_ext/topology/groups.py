"""Sub-groups that keep their parent's collective timeout.

``dist.new_group`` without ``timeout=`` takes torch's backend default (30 min on gloo, 10 min on
NCCL), not the timeout the job's default group was created with: a rank that hangs inside an
exchange on such a group would hold the job far longer than the user's ``timeout=`` /
``--distributed-timeout-minutes``. Every group this library makes goes through ``new_subgroup``.
"""
from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch
import torch.distributed as dist


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[datetime.timedelta]:
    """The collective timeout ``group`` (default: the world) was created with; None where this
    torch does not expose it (callers then get torch's default, as before)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        device = torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu")
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def new_subgroup(ranks: Sequence[int], parent: Optional[dist.ProcessGroup] = None, *,
                 timeout: Optional[datetime.timedelta] = None, **kwargs) -> dist.ProcessGroup:
    """``dist.new_group(ranks, ...)`` (global ranks) with ``timeout``, or else ``parent``'s timeout
    (default parent: the world). ``kwargs`` go to ``new_group`` (e.g. use_local_synchronization)."""
    return dist.new_group(list(ranks), timeout=timeout or group_timeout(parent), **kwargs)
