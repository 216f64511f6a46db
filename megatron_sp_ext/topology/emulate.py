"""Emulated machines on one box: GPUs grouped into machines of ``SPX_EMULATED_MACHINE_SIZE`` ranks.

With the variable set (e.g. 2 on a 4-GPU box: machines {0,1} and {2,3}; global ranks are cut into
consecutive runs), topology detection (``detect_topology``, ``--sp-nodes`` left unset) sees those
machines as machines, and ``link_transport`` names the exchange transport of a process group: the
host-staged one (comm/host_staged.py: GPU -> pinned host memory -> GPU, NIC-class bandwidth) when the
group spans emulated machines, the fast one (NVLink) when it stays inside one. So only the
inter-"machine" traffic is throttled, and the choice is per process group.
"""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from ..errors import SPConfigError

MACHINE_SIZE_ENV = "SPX_EMULATED_MACHINE_SIZE"


def emulated_machine_size() -> Optional[int]:
    """The emulated machine size (ranks per machine) from the environment, or None when unset."""
    raw = os.environ.get(MACHINE_SIZE_ENV, "").strip()
    if not raw:
        return None
    try:
        m = int(raw)
    except ValueError:
        m = 0
    if m < 1:
        raise SPConfigError(f"{MACHINE_SIZE_ENV}={raw!r} is invalid: give the number of GPUs per emulated machine "
                            f"(a positive integer that divides the world size)")
    world = dist.get_world_size() if dist.is_initialized() else None
    if world is not None and world % m != 0:
        raise SPConfigError(f"{MACHINE_SIZE_ENV}={m} does not divide the world size {world}: use a divisor of {world}")
    return m


def machines_of(group: Optional[dist.ProcessGroup], machine_size: int) -> tuple[int, ...]:
    """Emulated machine index of each rank of ``group`` (from its global rank)."""
    world = dist.get_world_size(group)
    return tuple(dist.get_global_rank(group, r) // machine_size if group is not None else r // machine_size
                 for r in range(world))


def spans_machines(group: Optional[dist.ProcessGroup], machine_size: Optional[int] = None) -> bool:
    """Whether ``group`` has ranks on more than one emulated machine (False when none is emulated)."""
    m = machine_size if machine_size is not None else emulated_machine_size()
    return m is not None and len(set(machines_of(group, m))) > 1


def link_transport(group: Optional[dist.ProcessGroup], fast: str = "nccl",
                   machine_size: Optional[int] = None) -> str:
    """The transport name for ``group``'s exchanges: "host_staged" across emulated machines, else ``fast``."""
    return "host_staged" if spans_machines(group, machine_size) else fast
