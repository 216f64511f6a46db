"""How the ranks of a process group sit on machines: N machines x M GPUs each.

Detection order: the user's ``nodes`` (also the way to simulate several machines on one, e.g.
4 GPUs as 2 x 2; ranks are then split into N consecutive runs), else emulated machines
(``SPX_EMULATED_MACHINE_SIZE``, topology/emulate.py: global ranks cut into machines of that size),
else the hostnames of the group's ranks (one all_gather_object), else LOCAL_WORLD_SIZE.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ..errors import SPConfigError
from .emulate import MACHINE_SIZE_ENV, emulated_machine_size, machines_of


@dataclass(frozen=True)
class Topology:
    """nodes: N; per_node: M; node_of[r]: machine index of group rank r; simulated: from ``nodes``."""

    nodes: int
    per_node: int
    node_of: tuple[int, ...]
    simulated: bool = False

    def mesh_order(self) -> list[int]:
        """Group ranks sorted machine-major (stable within a machine)."""
        return sorted(range(len(self.node_of)), key=lambda r: (self.node_of[r], r))


def simulated_topology(world: int, nodes: int, setting: str = "nodes") -> Topology:
    if nodes < 1 or world % nodes != 0:
        raise SPConfigError(f"{setting}={nodes} does not divide the sequence-parallel size {world}: "
                            f"use a divisor of {world}")
    m = world // nodes
    return Topology(nodes, m, tuple(r // m for r in range(world)), simulated=True)


def emulated_topology(group: Optional[dist.ProcessGroup], machine_size: int) -> Topology:
    """The machines of ``group`` when global ranks are cut into emulated machines of ``machine_size``."""
    node_of = machines_of(group, machine_size)
    order: dict = {}
    node_of = tuple(order.setdefault(n, len(order)) for n in node_of)
    counts = [node_of.count(i) for i in range(len(order))]
    if list(node_of) != sorted(node_of) or len(set(counts)) != 1:
        raise SPConfigError(f"{MACHINE_SIZE_ENV}={machine_size}: the group's ranks sit unevenly or out of order on "
                            f"the emulated machines (machines by rank: {list(node_of)}); use a machine size that "
                            f"cuts the group into equal consecutive runs")
    return Topology(len(order), counts[0], node_of, simulated=True)


def detect_topology(group: Optional[dist.ProcessGroup], nodes: Optional[int] = None,
                    setting: str = "nodes") -> Topology:
    """Topology of ``group`` (collective when ``nodes`` is None: every rank must call it)."""
    world = dist.get_world_size(group)
    if nodes is not None:
        return simulated_topology(world, nodes, setting)
    m = emulated_machine_size()
    if m is not None:
        return emulated_topology(group, m)
    names = [None] * world
    dist.all_gather_object(names, socket.gethostname(), group=group)
    order: dict = {}
    node_of = tuple(order.setdefault(n, len(order)) for n in names)
    counts = [node_of.count(i) for i in range(len(order))]
    if list(node_of) != sorted(node_of):
        raise SPConfigError(f"the group's ranks are not machine-contiguous (machines by rank: {list(node_of)}); "
                            f"launch node by node (torchrun does) or set {setting} explicitly")
    if len(set(counts)) != 1:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local and world % int(local) == 0:
            return simulated_topology(world, world // int(local), setting)
        raise SPConfigError(f"machines hold unequal numbers of ranks ({counts}); set {setting} explicitly")
    return Topology(len(order), counts[0], node_of)
