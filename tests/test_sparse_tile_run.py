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


def test_sparse_step_cache_builds_once_per_shape(monkeypatch):
    """The DiT's ``SparseStepCache``: the same step for equal token ids passed as new tensors (what each training
    step's batch brings), the same loss and gradients as building it every forward, and a rebuild when the grid and
    its ids, the spec or the device change (``sparse_step`` counted)."""
    from training.video_dit import VideoDiT, preset, sparse as sparse_mod
    from training.video_dit.sparse import SparseStepCache
    cfg = preset("tiny")
    grid, spec = (2, 4, 4), SparseSpec((1, 2, 2), window=(1, 1, 1))
    perm, _ = tile_order(grid, spec.tile)
    built = []
    real = sparse_mod.sparse_step
    monkeypatch.setattr(sparse_mod, "sparse_step", lambda *a, **k: built.append(1) or real(*a, **k))
    cache, cpu = SparseStepCache(), torch.device("cpu")
    first = cache.get(spec, perm.clone(), grid, None, cpu)
    assert cache.get(spec, perm.clone(), grid, None, cpu) is first and len(built) == 1
    want = real(spec, perm, grid, None, cpu)
    assert torch.equal(first.tile_index, want.tile_index) and first.run == want.run and \
        (first.num_tiles, first.num_padded_tiles) == (want.num_tiles, want.num_padded_tiles) and \
        torch.equal(first.window_mask, want.window_mask)
    grid2 = (4, 2, 4)   # another grid (and its ids): rebuilt, and matches its own step
    perm2, _ = tile_order(grid2, spec.tile)
    assert torch.equal(cache.get(spec, perm2.clone(), grid2, None, cpu).window_mask,
                       real(spec, perm2, grid2, None, cpu).window_mask)
    cache.get(spec, perm.clone(), grid, None, cpu)
    cache.get(SparseSpec((1, 2, 2), window=(0, 1, 1)), perm.clone(), grid, None, cpu)
    assert len(built) == 4
    cache.get(SparseSpec((1, 2, 2), window=(0, 1, 1)), perm.clone(), grid, None, "meta")
    assert len(built) == 5

    def loss_and_grads(model):
        torch.manual_seed(1)
        x, t = torch.randn(1, 32, cfg.patch_volume), torch.rand(1)
        text = torch.randn(1, cfg.text_len, cfg.text_dim)
        model.zero_grad()
        out = model(x, t, text, perm.clone(), grid)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.manual_seed(0)
    model = VideoDiT(cfg)
    model.set_sparse_attention(spec)
    with torch.no_grad():
        for _, p in model.modulation_parameters():
            p.copy_(0.2 * torch.randn(p.shape))
    built.clear()
    runs = [loss_and_grads(model) for _ in range(3)]
    assert len(built) == 1   # one build for three forwards
    model.sparse_cache = SparseStepCache()
    for out, grads in runs:   # bitwise the same as a fresh build
        ref_out, ref_grads = loss_and_grads(model)
        assert torch.equal(out, ref_out) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
        model.sparse_cache = SparseStepCache()
