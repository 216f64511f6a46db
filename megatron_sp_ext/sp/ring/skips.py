"""What a ring under a block mask leaves out: per (slot, rank, step) the kernel calls that select anything, and the
K|V hops some later rank on the slot's cycle still needs.

The tables are computed once per plan (``ring.RingPlan.skips``), on the host, from a copy of the mask reduced over
the plan's heads, and identically on every rank (every rank builds every rank's calls), so the point-to-point
schedule agrees on both ends of every hop without any exchange:
  keep[i][r][s]   indices (into ``RingPlan.slot_calls(s, r)[i]``) of rank r's calls on slot i at step s whose
                  ``TileSlice`` selects any (query, key) pair (tiles AND causal AND kv_valid_len, any head);
                  empty: that (step, slot) is not run.
  sends[i][r][s]  (s < P - 1) rank r forwards its held slot i after step s: some later holder runs it.
Backward: dK|dV partials go home for the (step >= 1, slot) pairs that ran, nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class TileSpec:
    """A plan's block mask: bool [H or 1, T, T] (global tiles, the plan's own host copy: the skip tables are host
    decisions, made once per plan), tokens per tile, and the global query heads the ring's q carries (the mask's
    rows)."""

    block_mask: torch.Tensor
    tile: int
    heads: slice

    def selection_mask(self) -> torch.Tensor:
        """[1, T, T] on the host: any of the plan's heads selects the tile pair (what the skip tables need)."""
        rows = self.block_mask if self.block_mask.shape[0] == 1 else self.block_mask[self.heads]
        return rows.any(0, keepdim=True).cpu()


@dataclass(frozen=True)
class SkipTables:
    """keep[i][r][s] (kept call indices) and forwards[i][r][s] (the module docstring's sends) of one plan; nxt/prv
    per slot."""

    world: int
    nxt: tuple
    prv: tuple
    keep: tuple
    forwards: tuple

    @property
    def slots(self) -> int:
        return len(self.keep)

    def runs(self, slot: int, rank: int, step: int) -> bool:
        return bool(self.keep[slot][rank][step])

    def sends(self, slot: int, rank: int, step: int) -> bool:
        return step < self.world - 1 and self.forwards[slot][rank][step]

    def receives(self, slot: int, rank: int, step: int) -> bool:
        return self.sends(slot, self.prv[slot][rank], step)


def skip_tables(world: int, nxt: Sequence, prv: Sequence,
                selected: Callable[[int, int], list]) -> SkipTables:
    """The tables from ``selected(step, rank)`` -> per slot, the kept call indices of ``rank`` at ``step``."""
    m = len(nxt)
    keep = [[[()] * world for _ in range(world)] for _ in range(m)]
    for r in range(world):
        for s in range(world):
            for i, kept in enumerate(selected(s, r)):
                keep[i][r][s] = tuple(kept)
    sends = [[[False] * max(world - 1, 0) for _ in range(world)] for _ in range(m)]
    for i in range(m):
        for r in range(world):
            # the K|V block r holds at step s next sits on nxt[r] at s+1, nxt[nxt[r]] at s+2, ...
            for s in range(world - 1):
                h, later = r, False
                for t in range(s + 1, world):
                    h = nxt[i][h]
                    later = later or bool(keep[i][h][t])
                sends[i][r][s] = later
    freeze = lambda x: tuple(freeze(y) for y in x) if isinstance(x, list) else x  # noqa: E731
    return SkipTables(world, tuple(map(tuple, nxt)), tuple(map(tuple, prv)), freeze(keep), freeze(sends))


def counts(tables: SkipTables, rank: int, slot_bytes: Sequence[int]) -> dict:
    """Per-rank counters of one forward (K|V hops) and backward (dK|dV partials sent home; its K|V hops repeat the
    forward's) over (step, slot) pairs: steps_run, steps_skipped, bytes_sent, bytes_skipped, dkv_bytes_sent,
    dkv_bytes_skipped."""
    p, m = tables.world, tables.slots
    run = sum(tables.runs(i, rank, s) for i in range(m) for s in range(p))
    hops = [(i, s) for i in range(m) for s in range(p - 1)]
    sent = sum(slot_bytes[i] for i, s in hops if tables.sends(i, rank, s))
    dkv = sum(slot_bytes[i] for i in range(m) for s in range(1, p) if tables.runs(i, rank, s))
    total = sum(slot_bytes[i] for i, _ in hops)
    return {"steps_run": run, "steps_skipped": p * m - run, "bytes_sent": sent, "bytes_skipped": total - sent,
            "dkv_bytes_sent": dkv, "dkv_bytes_skipped": total - dkv}
