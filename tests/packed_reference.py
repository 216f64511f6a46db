"""The packed-samples (cu_seqlens) reference pieces every packed test shares, built independently of the library:
which global positions a rank holds (each sample placed on its own, padded to the placement's divisor), a sharder
for ``tests.sp_check.run_case`` and the block-diagonal attention mask."""
from __future__ import annotations

import torch


def positions(cu, placement: str, rank: int, world: int) -> list:
    """Global positions ``rank`` holds of the packed sequence ``cu`` ("contiguous": one piece of each sample;
    "zigzag": pieces rank and 2P-1-rank of 2P per sample). A sample whose length does not divide by P (2P) is
    first padded at its tail to the next multiple: its padding rows are -1."""
    out = []
    div = world if placement == "contiguous" else 2 * world
    for a, b in zip(cu, cu[1:]):
        n = b - a
        padded = -(-n // div) * div
        at = [a + j if j < n else -1 for j in range(padded)]
        if placement == "contiguous":
            c = padded // world
            out += at[rank * c:(rank + 1) * c]
        else:
            c = padded // (2 * world)
            for j in (rank, 2 * world - 1 - rank):
                out += at[j * c:(j + 1) * c]
    return out


def sharder(cu, placement: str):
    """shard(x_bshd, rank, world): this rank's per-sample pieces of the full x (padding rows: zeros)."""
    def shard(x_bshd: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        s = x_bshd.shape[1]
        idx = [s if p < 0 else p for p in positions(cu, placement, rank, world)]
        x_pad = torch.cat([x_bshd, x_bshd.new_zeros(x_bshd.shape[0], 1, *x_bshd.shape[2:])], dim=1)
        return x_pad.index_select(1, torch.tensor(idx, device=x_bshd.device))
    return shard


def block_mask(cu, causal: bool) -> torch.Tensor:
    """[S, S] bool: query i may attend key j (same sample; causal: j <= i)."""
    s = cu[-1]
    m = torch.zeros(s, s, dtype=torch.bool)
    for a, b in zip(cu, cu[1:]):
        m[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril() if causal else True
    return m


def ragged(world: int) -> list:
    """Cumulative lengths of samples that do not divide by P nor 2P (and an empty one): every sample padded."""
    cu = [0]
    for n in (2 * world + 1, 3, 0, 4 * world - 1, 1):
        cu.append(cu[-1] + n)
    return cu
