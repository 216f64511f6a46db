"""Sequence-parallel process groups and an mpu object DeepSpeed's ``utils.groups`` accepts.

Layout (as DeepSpeed's own ``parallel_state_sp``): SP groups are consecutive runs of
``sp_size`` ranks; gradients and ZeRO shards span sequence x data parallel ranks (the whole
world here). DeepSpeed's uneven-heads Ulysses path reads the SP rank through ``groups.mpu``:
without one every rank believes it is rank 0 and gloo deadlocks, so ``install()`` sets it.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ..topology.groups import new_subgroup
from ..errors import SPConfigError


@dataclass
class SequenceParallelMPU:
    """The methods DeepSpeed calls on an SP mpu (names as deepspeed.runtime.sequence_parallel).

    data_group (ranks sharing an SP rank) is kept for callers; it is not exposed to DeepSpeed.
    """

    sp_group: dist.ProcessGroup
    seq_data_group: dist.ProcessGroup
    data_group: dist.ProcessGroup

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:  # marks this as an SP mpu
        if sequence_parallel_size != self.get_sequence_parallel_world_size():
            raise SPConfigError(f"sequence_parallel_size={sequence_parallel_size} differs from the groups built "
                                f"({self.get_sequence_parallel_world_size()})")

    def get_sequence_parallel_group(self):
        return self.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return dist.get_world_size(self.sp_group)

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self.sp_group)

    def get_sequence_data_parallel_group(self):
        return self.seq_data_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.seq_data_group)

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.seq_data_group)

    # No get_data_parallel_group(): DeepSpeed's SP mpu has none, and ZeRO-3 would reduce gradients
    # over it (the ranks sharing an SP rank) instead of over all sequence x data ranks.

    def get_tensor_model_parallel_world_size(self) -> int:
        """No tensor parallelism: every rank holds full parameters. DeepSpeed records this as the
        checkpoint's tp_degree and reads it when loading a universal checkpoint (resharding)."""
        return 1

    # DeepSpeed aliases model parallel to sequence parallel for SP mpus
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank

    def install(self) -> "SequenceParallelMPU":
        """Make DeepSpeed's ``utils.groups`` use this mpu (also before deepspeed.initialize)."""
        from deepspeed.utils import groups  # noqa: PLC0415
        groups.mpu = self
        return self


def build_sequence_parallel_groups(sp_size: int, *, timeout: Optional[datetime.timedelta] = None
                                   ) -> SequenceParallelMPU:
    """Create the groups collectively (every rank of the world calls this, same order). ``timeout``:
    their collective timeout (default: the world group's, e.g. DeepSpeed's ``init_distributed(timeout=)``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if sp_size < 1 or world % sp_size != 0:
        raise SPConfigError(f"sequence_parallel_size={sp_size} does not divide the world size {world}: "
                            f"use a divisor of {world}")
    sp_group = data_group = None
    for i in range(world // sp_size):
        ranks = list(range(i * sp_size, (i + 1) * sp_size))
        g = new_subgroup(ranks, timeout=timeout)
        if rank in ranks:
            sp_group = g
    for j in range(sp_size):
        ranks = list(range(j, world, sp_size))
        g = new_subgroup(ranks, timeout=timeout)
        if rank in ranks:
            data_group = g
    seq_data_group = new_subgroup(range(world), timeout=timeout)
    return SequenceParallelMPU(sp_group, seq_data_group, data_group)
