"""``auto`` across machines: on a group that spans machines (real ones, ``--sp-nodes`` / ``nodes``, or the emulation's
``SPX_EMULATED_MACHINE_SIZE``), the speed plan ranks auto's candidates and only those it cannot separate are timed;
the pick, its predicted and its measured time are logged once per shape.

    ranker = AutoRanker(margin=0.10)
    kept, report = ranker.narrow(candidates, shape, ranker.cluster(g, cfg.nodes), block_mask)   # name -> step
    pick = report(policy.fastest_for(q, k, g, kept, ...), policy)   # logs once, returns the pick

``shape`` is a ``ShapeInfo``: what the plan needs of one call. ``settings_for`` maps a candidate name (a mode of the
registry) to the ``Setting`` the plan times: the Ulysses-family candidate with its head-chunk setting (an int, or
"auto": the best chunk count the plan finds), the ring variants as themselves. Groups inside one machine: nothing
is narrowed (the plan's NVLink predictions do not separate Ulysses from HCMS there: the policy's timing does).
The cluster the plan assumes: the machines found, NVLink inside (``PRESETS["nvlink_large"]``, the emulation's
measured link ``PRESETS["host_staged"]`` across emulated machines), a ``nic_gbit`` NIC per GPU across real ones.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ... import modes
from ...topology.detect import detect_topology
from ...topology.emulate import emulated_machine_size
from .cluster import PRESETS, Cluster, nic
from .plan import rank_modes, separable
from .rates import package_rates
from .schedules import Problem, Setting

log = logging.getLogger("megatron_sp_ext")


@dataclass(frozen=True)
class ShapeInfo:
    """One call as the plan sees it: the full sequence, heads, kv heads, head dim, causal, batch, the block mask's
    shape and tile (() / 128 without a mask), the head-chunk setting of the Ulysses-family candidate, the device."""

    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    batch: int = 1
    mask_shape: tuple = ()
    tile: int = 128
    chunks: "int | str" = 1
    device: str = ""   # the torch device ("cuda:0"; its CUDA name is read once, when the plan ranks)


def settings_for(name: str, shape: ShapeInfo, world: int) -> list:
    """The plan's settings for candidate ``name``: the Ulysses family with its chunk setting ("auto": every chunk
    count up to 4 that the heads allow), a ring variant as itself."""
    spec = modes.get(name)
    if not spec.heads_per_rank:
        return [Setting(name)]
    if isinstance(shape.chunks, int):
        return [Setting(name, shape.chunks)]
    return [Setting(name, c) for c in range(1, max(1, min(4, shape.heads // world)) + 1)]


def _device_key(device: str) -> str:
    """The rate table's device for a torch device ("cuda:0": its CUDA name; otherwise the table's first)."""
    rates = package_rates()
    name = device
    if device.startswith("cuda"):
        import torch   # noqa: PLC0415
        name = torch.cuda.get_device_name(torch.device(device))
    return next((d for d in rates.devices() if d in name), rates.devices()[0])


class AutoRanker:
    """What ``auto`` asks of the speed plan on groups across machines (module docstring). ``margin``: settings
    predicted within it of the fastest are timed; ``nic_gbit``: the NIC per GPU assumed across real machines."""

    def __init__(self, margin: float = 0.10, nic_gbit: float = 400.0) -> None:
        self.margin, self.nic_gbit = margin, nic_gbit
        self.topologies: dict = {}
        self.rankings: dict = {}
        self.said: set = set()

    def cluster(self, group, nodes: Optional[int]) -> Optional[Cluster]:
        """The cluster of ``group`` (collective the first time when machines are detected by host name), or None
        inside one machine."""
        world = dist.get_world_size(group)
        key = (tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world)), nodes,
               emulated_machine_size())
        if key not in self.topologies:
            self.topologies[key] = detect_topology(group, nodes)
        topo = self.topologies[key]
        if topo.nodes < 2:
            return None
        across = PRESETS["host_staged"] if nodes is None and emulated_machine_size() else nic(self.nic_gbit)
        return Cluster(topo.nodes, topo.per_node, PRESETS["nvlink_large"], across)

    def narrow(self, candidates: dict, shape: ShapeInfo, cluster: Optional[Cluster], block_mask=None) -> tuple:
        """(the candidates to time, ``report(pick, policy=None) -> pick``); ``cluster`` None (one machine): all of
        them. ``block_mask``: the call's mask, whose density is read (one host sync) only when a shape is first
        ranked: auto keys its choice per mask shape and tile size, not per mask."""
        if cluster is None or len(candidates) < 2:
            return candidates, lambda pick, policy=None: pick
        key = (shape, cluster.machines, cluster.per_machine, tuple(candidates))
        if key not in self.rankings:
            cluster = cluster.with_(device=_device_key(shape.device))
            density = 1.0 if block_mask is None else max(1e-3, float(block_mask.float().mean()))
            pb = Problem(shape.tokens, shape.heads, shape.head_dim, shape.causal, density, shape.tile, shape.batch,
                         shape.kv_heads)
            best: dict = {}
            for name in candidates:
                for st, ms in rank_modes(pb, cluster, settings_for(name, shape, cluster.gpus)):
                    if name not in best or ms < best[name][1]:
                        best[name] = (st, ms)
            self.rankings[key] = sorted(best.values(), key=lambda sm: sm[1])
        ranking = self.rankings[key]
        close = {st.mode for st, _ in separable(ranking, self.margin)}
        kept = {n: f for n, f in candidates.items() if n in close} or candidates
        predicted = {st.mode: ms for st, ms in ranking}

        def report(pick: str, policy=None) -> str:
            if key in self.said:
                return pick
            self.said.add(key)
            measured = ""
            cal = next(reversed(policy.cache.values()), None) if policy is not None and policy.cache else None
            if cal is not None and pick in getattr(cal, "measured", {}):
                measured = f", measured {cal.measured[pick]:.2f} ms"
            log.info("megatron_sp_ext: speed plan on %d x %d GPUs: %s; timed %s; auto picked %s: predicted %.2f ms%s",
                     cluster.machines, cluster.per_machine,
                     ", ".join(f"{st.label()} {ms:.2f} ms" for st, ms in ranking), ", ".join(kept),
                     pick, predicted.get(pick, float("nan")), measured)
            return pick
        return kept, report


def shape_of(q_shape: tuple, k_shape: tuple, layout: str, world: int, causal: bool, chunks: "int | str",
             tiles: Optional[dict], device: object) -> ShapeInfo:
    """The ``ShapeInfo`` of a call on this rank's shards (``layout`` "bshd" [B, S_loc, H, D] or "sbhd")."""
    b, s_loc = (q_shape[0], q_shape[1]) if layout == "bshd" else (q_shape[1], q_shape[0])
    mask_shape, tile = ((), 128) if tiles is None else (tuple(tiles["block_mask"].shape), int(tiles["block_size"]))
    return ShapeInfo(s_loc * world, q_shape[2], k_shape[2], q_shape[3], causal, b, mask_shape, tile, chunks,
                     str(device))

