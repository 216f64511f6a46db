"""The aligned sub-groups of dynamic SP, created once per job.

For an SP group of P ranks and every allowed size d (divisors of P from ``min_size``): the P/d groups of ranks
[j*d, (j+1)*d) in SP-rank order. ``torch.distributed.new_group`` must be called by every process of the job, in the
same order, for every group: so each rank first learns every SP group of the job (one all_gather_object over the
default group) and then all ranks create the sub-groups of all SP groups (data-parallel replicas included).
Size 1 is no group (the sample runs locally), size P is the SP group itself.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .plan import divisors


class DynamicGroups:
    """``groups[(start, size)]``: the process group of SP ranks [start, start + size) containing this rank (None
    for size 1). Collective: every process of the job constructs it, with its own SP group."""

    def __init__(self, group: dist.ProcessGroup, min_size: int = 1) -> None:
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sizes = tuple(d for d in divisors(self.world) if d >= min_size)
        mine = tuple(dist.get_process_group_ranks(group))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        self.groups: dict[tuple[int, int], Optional[dist.ProcessGroup]] = {}
        for ranks in sorted(set(every)):  # the same order on every process
            for d in self.sizes:
                if d in (1, self.world):
                    continue
                for s in range(0, self.world, d):
                    pg = dist.new_group(list(ranks[s:s + d]))
                    if ranks == mine and s <= self.rank < s + d:
                        self.groups[(s, d)] = pg
        for d in self.sizes:
            s = self.rank // d * d
            if d == 1:
                self.groups[(s, 1)] = None
            elif d == self.world:
                self.groups[(0, d)] = group

    def get(self, start: int, size: int) -> Optional[dist.ProcessGroup]:
        return self.groups[(start, size)]
