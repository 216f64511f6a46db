"""``TileRun``: pool_tiles / coarse_attention by reshapes, and ``gated_spread``, (the DiT's top-k path) equal the index route over
``tile_index`` in float64, output and input gradients, for shards that start mid-tile, end in SP padding, are all
padding, or cover a shorter last tile; and ``sparse_step`` hands the DiT a run that matches its ``tile_index``."""
from __future__ import annotations

import pytest
import torch

from training.video_dit.sparse import (SparseSpec, TileRun, coarse_attention, gated_spread, num_tiles_of, pool_tiles,
                                       row_major_ids, sparse_step, spread_tiles, tile_counts, tile_order)

BS = 8


def _index(first: int, seq_local: int, n_tokens: int, num_tiles: int) -> torch.Tensor:
    pos = torch.arange(seq_local) + first
    return torch.where(pos < n_tokens, pos // BS, torch.full_like(pos, num_tiles))


@pytest.mark.parametrize("first,seq_local,n_tokens", [(0, 61, 61), (0, 64, 61), (5, 20, 61), (24, 30, 61),
                                                      (40, 32, 61), (64, 8, 61), (16, 16, 64)])
def test_run_matches_index_route(first, seq_local, n_tokens):
    num_tiles = -(-n_tokens // BS)
    tile_index = _index(first, seq_local, n_tokens, num_tiles)
    run = TileRun(first, n_tokens, BS)
    gen = torch.Generator().manual_seed(first * 131 + seq_local)
    x = torch.randn(2, seq_local, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, num_tiles, 4, generator=gen, dtype=torch.float64)
    ref = pool_tiles(x, tile_index, num_tiles)
    got = pool_tiles(x, tile_index, num_tiles, run=run)
    # a shard sees only its own tokens: the index route's counts are the local ones, the run's the grid's; both
    # agree on every tile the shard holds whole, and the SP sum divides by the grid's counts (checked below)
    whole = torch.bincount(tile_index[tile_index < num_tiles], minlength=num_tiles) == tile_counts(num_tiles, n_tokens, BS)
    held = torch.bincount(tile_index[tile_index < num_tiles], minlength=num_tiles) > 0
    assert torch.allclose(got[:, :, whole & held], ref[:, :, whole & held], rtol=0, atol=1e-12)
    assert torch.count_nonzero(got[:, :, ~held]) == 0
    g_ref, = torch.autograd.grad((ref[:, :, whole & held] * w[:, :, whole & held]).sum(), x)
    g_got, = torch.autograd.grad((got[:, :, whole & held] * w[:, :, whole & held]).sum(), x)
    assert torch.allclose(g_got, g_ref, rtol=0, atol=1e-12)
    q, k, v = (torch.randn(2, 3, num_tiles, 4, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    c_ref = coarse_attention(q, k, v, tile_index)
    c_got = coarse_attention(q, k, v, tile_index, run)
    assert c_got.shape == c_ref.shape == (2, seq_local, 3, 4)
    assert torch.allclose(c_got, c_ref, rtol=0, atol=1e-12)
    dy = torch.randn(c_ref.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(c_ref, (q, k, v), dy), torch.autograd.grad(c_got, (q, k, v), dy)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_shards_sum_to_the_whole_sequence():
    """The SP ranks' pooled sums (what the group all-reduce adds) over the grid's counts = pooling the whole grid."""
    n_tokens, num_tiles, world = 61, 8, 4
    seq_local = -(-n_tokens // world)   # 16: the last shard ends in 3 padding tokens
    x_full = torch.randn(1, world * seq_local, 2, 4, dtype=torch.float64)
    ref = pool_tiles(x_full[:, :n_tokens], _index(0, n_tokens, n_tokens, num_tiles), num_tiles)
    counts = tile_counts(num_tiles, n_tokens, BS).double()
    total = torch.zeros_like(ref)
    for r in range(world):
        part = pool_tiles(x_full[:, r * seq_local:(r + 1) * seq_local], None, num_tiles,
                          run=TileRun(r * seq_local, n_tokens, BS))
        total += part * counts[None, None, :, None]   # back to sums
    assert torch.allclose(total / counts[None, None, :, None], ref, rtol=0, atol=1e-12)


def test_sparse_step_run_matches_its_tile_index():
    grid, spec = (3, 5, 6), SparseSpec(tile=(1, 2, 4), topk=2)
    n = grid[0] * grid[1] * grid[2]
    perm, _ = tile_order(grid, spec.tile)
    positions = torch.arange(40, 40 + 30)   # a shard of tile order that ends in padding (n = 90)
    step = sparse_step(spec, row_major_ids(positions, perm), grid, None, torch.device("cpu"))
    assert step.run == TileRun(40, n, spec.block_size)
    num_tiles = num_tiles_of(grid, spec.tile)
    assert torch.equal(step.tile_index, _index_for(step.run, positions.numel(), num_tiles))


def _index_for(run: TileRun, seq_local: int, num_tiles: int) -> torch.Tensor:
    pos = torch.arange(seq_local) + run.first_position
    return torch.where(pos < run.n_tokens, pos // run.block_size, torch.full_like(pos, num_tiles))


@pytest.mark.parametrize("first,seq_local,n_tokens", [(0, 61, 61), (5, 20, 61), (40, 32, 61), (64, 8, 61)])
@pytest.mark.parametrize("use_run", [True, False])
def test_gated_spread_equals_the_plain_product(first, seq_local, n_tokens, use_run):
    """gated_spread (keeps gate and the tiles, rebuilds the spread in the backward) == gate * spread_tiles, output
    and both gradients, float64, on the run and on the index route."""
    num_tiles = -(-n_tokens // BS)
    tile_index = _index(first, seq_local, n_tokens, num_tiles)
    run = TileRun(first, n_tokens, BS) if use_run else None
    gen = torch.Generator().manual_seed(7 + first)
    gate = torch.randn(2, seq_local, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    tiles = torch.randn(2, 3, num_tiles, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, seq_local, 3, 4, generator=gen, dtype=torch.float64)
    ref = gate * spread_tiles(tiles, tile_index, run)
    got = gated_spread(gate, tiles, tile_index, run)
    assert torch.equal(got, ref)
    for a, b in zip(torch.autograd.grad(ref, (gate, tiles), dy), torch.autograd.grad(got, (gate, tiles), dy)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda g, t: gated_spread(g, t, tile_index, run), (gate, tiles))
