"""SPMesh: the Ulysses x Ring (x Torus) process groups of one sequence-parallel group.

Mesh index i (machine-major order of the group's ranks) maps to a 2D grid:
  usp: Ulysses inside machines (consecutive mesh indices), Ring across: grid[j][u] = order[j*P_u + u]
  tas: Ring inside machines, Ulysses across (StreamFusion):             grid[j][u] = order[u*P_r + j]
Row j of the grid is one Ulysses group (u = 0..P_u-1); column u is one Ring group (j = 0..P_r-1).
Groups are created once, with local synchronisation (only their members call new_group, in the
same order), so the SP group may be a subgroup of a larger world.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .groups import new_subgroup
from .. import modes
from ..config import ARRANGEMENTS
from ..errors import SPConfigError
from .detect import Topology, detect_topology
from .volume import arrangement_for


@dataclass
class SPMesh:
    """group: the whole SP group; grid[j][u]: group rank at ring index j, Ulysses index u; arrangement: "usp" or
    "tas" (how the Ulysses and ring groups lie on machines; ``build_sp_mesh``'s ``arrangement=`` keyword)."""

    group: dist.ProcessGroup
    rank: int
    world: int
    arrangement: str
    ulysses_size: int
    ring_size: int
    topology: Topology
    grid: tuple
    ring_index: int
    ulysses_index: int
    ulysses_group: Optional[dist.ProcessGroup]
    ring_group: Optional[dist.ProcessGroup]

    @property
    def torus_group(self) -> Optional[dist.ProcessGroup]:
        """The group Torus attention stages its exchange over (the Ulysses group)."""
        return self.ulysses_group

    def ulysses_members(self, j: Optional[int] = None) -> tuple:
        return self.grid[self.ring_index if j is None else j]

    def ring_members(self, u: Optional[int] = None) -> tuple:
        u = self.ulysses_index if u is None else u
        return tuple(row[u] for row in self.grid)

    def describe(self) -> str:
        t = self.topology
        return (f"SPMesh(arrangement={self.arrangement}, P={self.world} = Ulysses {self.ulysses_size} x Ring "
                f"{self.ring_size}, machines {t.nodes} x {t.per_node}{' (simulated)' if t.simulated else ''})")


def _new_group(group_ranks, sp_group):
    if len(group_ranks) == 1:
        return None
    ranks = [dist.get_global_rank(sp_group, r) for r in group_ranks]
    return new_subgroup(ranks, sp_group, use_local_synchronization=True)


def mesh_grid(topo: Topology, num_heads: int, arrangement: str = "auto", ulysses_size: Optional[int] = None,
              names: Optional[dict] = None) -> tuple[str, int, int, tuple]:
    """(arrangement, P_u, P_r, grid) of a mesh over the ranks of ``topo`` (module docstring), without process groups:
    ``build_sp_mesh`` builds its groups on it, the speed plan (megatron_sp_ext/speed_plan) reads it. P_u =
    ``ulysses_size`` or gcd(P, H); "auto": the arrangement with the smaller inter-machine volume. Raises SPConfigError
    naming ``names``' spelling of each setting (keys "arrangement", "ulysses_size", "nodes")."""
    nm = {"arrangement": "arrangement", "ulysses_size": "ulysses_size", "nodes": "nodes"}
    nm.update(names or {})
    if arrangement not in ARRANGEMENTS:
        raise SPConfigError(f"{nm['arrangement']}={arrangement!r} is invalid: choose one of {', '.join(ARRANGEMENTS)}")
    world = len(topo.node_of)
    p_u = ulysses_size if ulysses_size is not None else math.gcd(world, num_heads)
    if p_u < 1 or world % p_u != 0:
        raise SPConfigError(f"{nm['ulysses_size']}={p_u} does not divide the sequence-parallel size {world}: "
                            f"use a divisor of {world}")
    if num_heads % p_u != 0:
        raise SPConfigError(f"{nm['ulysses_size']}={p_u} does not divide the number of heads {num_heads}: "
                            f"use a common divisor of {world} and {num_heads} (largest: {math.gcd(world, num_heads)})")
    p_r = world // p_u
    if arrangement == "auto":
        arrangement = arrangement_for(topo.nodes, topo.per_node, p_u)
    across = modes.get(arrangement).ulysses_across   # Ulysses groups span machines (tas), else inside them (usp)
    if across and topo.nodes == 1:
        within = "/".join(repr(p) for p in ARRANGEMENTS[::-1] if not modes.get(p).ulysses_across)
        raise SPConfigError(f"{nm['arrangement']}={arrangement!r} needs a multi-machine mesh but the group runs on one "
                            f"machine: set {nm['nodes']} to simulate machines, or use {within}")
    order = topo.mesh_order()
    if not across:
        grid = tuple(tuple(order[j * p_u + u] for u in range(p_u)) for j in range(p_r))
    else:
        grid = tuple(tuple(order[u * p_r + j] for u in range(p_u)) for j in range(p_r))
    return arrangement, p_u, p_r, grid


def build_sp_mesh(group: dist.ProcessGroup, *, num_heads: int, arrangement: str = "auto",
                  ulysses_size: Optional[int] = None, nodes: Optional[int] = None,
                  names: Optional[dict] = None, seq_hint: Optional[tuple] = None,
                  placement: Optional[str] = None) -> SPMesh:
    """Build (collectively) the mesh of ``group``. See module docstring.

    arrangement: "usp", "tas" or "auto" (P_u = ulysses_size or gcd(P, H); the arrangement with the smaller
    inter-machine volume); ``placement``: its older name, still taken. ``names`` maps setting -> how the user
    spelled it (errors).
    """
    nm = {"arrangement": "arrangement", "ulysses_size": "ulysses_size", "nodes": "nodes", "num_heads": "num_heads"}
    if placement is not None:   # the older keyword
        if arrangement not in ("auto", placement):
            raise SPConfigError(f"arrangement={arrangement!r} and its older name placement={placement!r} are both "
                                f"set: give one of them")
        arrangement, nm["arrangement"] = placement, "placement"
    nm.update(names or {})
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    topo = detect_topology(group, nodes, nm["nodes"])
    arrangement, p_u, p_r, grid = mesh_grid(topo, num_heads, arrangement, ulysses_size, nm)
    ring_index, ulysses_index = next((j, u) for j in range(p_r) for u in range(p_u) if grid[j][u] == rank)
    u_group = _new_group(grid[ring_index], group)
    r_group = _new_group(tuple(row[ulysses_index] for row in grid), group)
    return SPMesh(group, rank, world, arrangement, p_u, p_r, topo, grid, ring_index, ulysses_index, u_group, r_group)


def mesh_from_hierarchical_groups(group: dist.ProcessGroup, inner: dist.ProcessGroup,
                                  outer: dist.ProcessGroup) -> SPMesh:
    """A "usp" SPMesh over groups that already exist (no new communicators).

    ``inner``: this rank's group of consecutive SP ranks (Ulysses), ``outer``: the strided one (Ring),
    as Megatron-core builds them for ``hierarchical_context_parallel_sizes=[P_u, P_r]``.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    p_u, p_r = dist.get_world_size(inner), dist.get_world_size(outer)
    if p_u * p_r != world:
        raise SPConfigError(f"hierarchical context-parallel sizes {p_u} x {p_r} do not multiply to the CP size {world}")
    grid = tuple(tuple(j * p_u + u for u in range(p_u)) for j in range(p_r))
    ring_index, ulysses_index = rank // p_u, rank % p_u
    to_group = {dist.get_global_rank(group, r): r for r in range(world)}
    mine_u = sorted(to_group[dist.get_global_rank(inner, i)] for i in range(p_u))
    mine_r = sorted(to_group[dist.get_global_rank(outer, i)] for i in range(p_r))
    if mine_u != list(grid[ring_index]) or mine_r != [row[ulysses_index] for row in grid]:
        raise SPConfigError("the hierarchical context-parallel groups are not laid out as Megatron-core builds them "
                            f"(Ulysses group {mine_u}, ring group {mine_r}); use --sp-arrangement/--sp-nodes instead")
    topo = Topology(1, world, tuple(0 for _ in range(world)))
    return SPMesh(group, rank, world, "usp", p_u, p_r, topo, grid, ring_index, ulysses_index,
                  inner if p_u > 1 else None, outer if p_r > 1 else None)
