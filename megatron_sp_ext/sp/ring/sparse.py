"""Skip counters of the ring under a block mask, for benchmarks: ``sparse_ring_plan(...).counts(rank)``.

The ring itself (``ring``: ``RingPlan`` with a block mask, the one autograd Function) skips what the mask leaves out
(``skips``); this module only evaluates the same tables for a (mask, world, placement) without a process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...errors import SPConfigError
from ..placement import pieces
from .ring import VARIANTS, RingSpec, build_ring_plan
from .skips import SkipTables, TileSpec, counts


@dataclass(frozen=True)
class SparseRingPlan:
    """The skip tables of one block-sparse ring call (identical on every rank) and the bytes of one rank's slots
    (k and v; 0 when unknown)."""

    tables: SkipTables
    slot_bytes: tuple

    @property
    def world(self) -> int:
        return self.tables.world

    @property
    def slots(self) -> int:
        return self.tables.slots

    def origin(self, slot: int, rank: int, step: int) -> int:
        """The rank whose slot ``slot`` ``rank`` holds at ``step``."""
        for _ in range(step):
            rank = self.tables.prv[slot][rank]
        return rank

    def runs(self, slot: int, rank: int, step: int) -> bool:
        """Whether ``rank`` calls a kernel on slot ``slot`` at ``step``."""
        return self.tables.runs(slot, rank, step)

    def sends(self, slot: int, rank: int, step: int) -> bool:
        """Whether ``rank`` sends its held slot ``slot`` on after ``step`` (step < P - 1)."""
        return self.tables.sends(slot, rank, step)

    def counts(self, rank: int) -> dict:
        """Per-rank counters of one forward (K|V hops) and backward (dK|dV partials sent home; its K|V hops repeat
        the forward's), over (step, slot) pairs (the ring: one slot, so steps): steps_run, steps_skipped,
        bytes_sent, bytes_skipped, dkv_bytes_sent, dkv_bytes_skipped."""
        return counts(self.tables, rank, self.slot_bytes)


def sparse_ring_plan(block_mask: torch.Tensor, *, world: int, seq_len: int, tile: Optional[int] = None,
                     placement: str, causal: bool, kv_valid_len: Optional[int] = None, kv_bytes: int = 0,
                     variant: str = "ring", block_size: Optional[int] = None) -> SparseRingPlan:
    """The ``SparseRingPlan`` of ``block_mask`` ([H or 1, T, T], bool; tiles of ``tile`` tokens, ``block_size`` its
    older name) for ``variant`` over ``world`` ranks holding a ``seq_len`` sequence in ``placement``; kv_bytes: one
    rank's K|V bytes (split over the slots). The tables are host decisions: the mask is read on the host."""
    if variant not in VARIANTS:
        raise SPConfigError(f"variant={variant!r} is invalid: choose one of {', '.join(VARIANTS)}")
    if (tile is None) == (block_size is None):
        raise SPConfigError("sparse_ring_plan: give tile= (tokens per mask tile), or its older name block_size=, "
                            "not both")
    tile = tile if tile is not None else block_size
    runs = tuple(pieces(placement, o, world, seq_len) for o in range(world))
    s_loc = seq_len // world
    valid = kv_valid_len if kv_valid_len is not None and kv_valid_len < seq_len else None
    spec = RingSpec.of(variant=variant, s_loc=s_loc, q_runs=runs[0], kv_runs=runs, causal=causal, scale=1.0,
                       backend=None, balanced_slots=placement == "tasp_zigzag", kv_valid_len=valid, tile=tile,
                       q_runs_of=runs)
    plan = build_ring_plan(None, 0, world, spec, TileSpec(block_mask.cpu(), tile, slice(None)))
    slot_bytes = tuple(kv_bytes * n // s_loc if s_loc else 0 for n in plan.slot_len)
    return SparseRingPlan(plan.skips(), slot_bytes)
