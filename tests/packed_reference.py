"""The packed-samples (cu_seqlens) reference pieces every packed test shares, built independently of the library:
which global positions a rank holds (each sample placed on its own), a sharder for ``tests.sp_check.run_case`` and
the block-diagonal attention mask."""
from __future__ import annotations

import torch


def positions(cu, placement: str, rank: int, world: int) -> list:
    """Global positions ``rank`` holds of the packed sequence ``cu`` ("contiguous": one piece of each sample;
    "zigzag": pieces rank and 2P-1-rank of 2P per sample)."""
    out = []
    for a, b in zip(cu, cu[1:]):
        n = b - a
        if placement == "contiguous":
            c = n // world
            out += list(range(a + rank * c, a + (rank + 1) * c))
        else:
            c = n // (2 * world)
            for j in (rank, 2 * world - 1 - rank):
                out += list(range(a + j * c, a + (j + 1) * c))
    return out


def sharder(cu, placement: str):
    """shard(x_bshd, rank, world): this rank's per-sample pieces of the full x."""
    def shard(x_bshd: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        return x_bshd.index_select(1, torch.tensor(positions(cu, placement, rank, world), device=x_bshd.device))
    return shard


def block_mask(cu, causal: bool) -> torch.Tensor:
    """[S, S] bool: query i may attend key j (same sample; causal: j <= i)."""
    s = cu[-1]
    m = torch.zeros(s, s, dtype=torch.bool)
    for a, b in zip(cu, cu[1:]):
        m[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril() if causal else True
    return m
