"""--sparse-attention tiles (issue #45, the DiT side): the tile order, the window / top-k block masks, the coarse
branch, the one-device block-sparse reference, the DiT's sparse step at SP=1 (runs, all-true mask = dense),
the flag refusals, and the sparse step at SP=2/4 equal to SP=1 (both entry points; these need ``block_mask=`` in
megatron_sp_ext's SPAttention)."""
import inspect
import itertools
import os

import pytest
import torch
import torch.distributed as dist

from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.factory import SPAttention
from tests.reference import rel_err
from training.video_dit import VideoDiT, preset
from training.video_dit.data import SyntheticVideoLatents
from training.video_dit.engine import flow_matching_batch, local_loss, make_core, prepare
from training.video_dit.model import patchify, unpatchify
from training.video_dit.sparse import (SparseSpec, block_sparse_attention, check_tile_grid, coarse_attention,
                                       pad_block_mask, pool_tiles, row_major_ids, tile_order, tile_positions,
                                       token_mask, topk_block_mask, window_block_mask)

CFG = preset("tiny")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP_TAKES_BLOCK_MASK = "block_mask" in inspect.signature(SPAttention.__call__).parameters
NEEDS_SP_MASK = pytest.mark.skipif(not SP_TAKES_BLOCK_MASK, reason="megatron_sp_ext's SPAttention.__call__ has no "
                                   "block_mask parameter yet (issue #45's attention side, branch i45): the DiT's "
                                   "sparse step cannot run at SP>1 without it")


# ---- tile order -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grid,tile", [((4, 4, 4), (2, 2, 2)), ((2, 6, 4), (1, 3, 2)), ((3, 2, 5), (3, 2, 5)),
                                       ((2, 2, 2), (1, 1, 1))])
def test_tile_order_round_trips_and_tiles_are_contiguous(grid, tile):
    perm, inv = tile_order(grid, tile)
    n = grid[0] * grid[1] * grid[2]
    assert sorted(perm.tolist()) == list(range(n))
    assert torch.equal(perm[inv], torch.arange(n)) and torch.equal(inv[perm], torch.arange(n))
    block = tile[0] * tile[1] * tile[2]
    t_n, h_n, w_n = grid
    coords = [(i // (h_n * w_n), (i // w_n) % h_n, i % w_n) for i in perm.tolist()]
    tiles_seen = []
    for j in range(n // block):  # block j: the tokens of one tile, in (t, h, w) order
        members = coords[j * block:(j + 1) * block]
        tile_ids = {(t // tile[0], h // tile[1], w // tile[2]) for t, h, w in members}
        assert len(tile_ids) == 1, (j, members)
        assert members == sorted(members)
        tiles_seen.append(tile_ids.pop())
    assert tiles_seen == sorted(tiles_seen)  # tiles in (t, h, w) order
    # a latent survives patchify -> tile order -> row-major -> unpatchify
    lat = torch.randn(1, 2, t_n, 2 * h_n, 2 * w_n)
    tokens = patchify(lat, (1, 2, 2))
    assert torch.equal(unpatchify(tokens[:, perm][:, inv], (1, 2, 2), 2, grid), lat)


def test_row_major_ids_and_tile_positions_keep_padding():
    grid, tile = (2, 4, 4), (1, 2, 2)
    perm, inv = tile_order(grid, tile)
    positions = torch.arange(28, 36)  # the last shard of 36 padded positions: 32..35 are padding
    ids = row_major_ids(positions, perm)
    assert torch.equal(ids[:4], perm[28:32]) and torch.equal(ids[4:], positions[4:])
    assert torch.equal(tile_positions(ids, grid, tile), positions)


def test_tiles_that_do_not_divide_the_grid_are_refused_by_flag_with_valid_values():
    with pytest.raises(SPConfigError) as e:
        check_tile_grid((4, 6, 10), (4, 4, 4))
    msg = str(e.value)
    assert "--sparse-tile=4,4,4" in msg and "H in {1, 2, 3, 6}" in msg and "W in {1, 2, 5, 10}" in msg
    check_tile_grid((4, 6, 10), (2, 3, 5))


# ---- masks ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grid,tile,window", [((4, 4, 6), (2, 2, 2), (0, 0, 0)), ((4, 4, 6), (1, 2, 2), (1, 0, 1)),
                                              ((6, 2, 4), (2, 1, 2), (1, 1, 0)), ((2, 2, 2), (1, 1, 1), (5, 5, 5))])
def test_window_mask_matches_token_distance_definition(grid, tile, window):
    """Brute force over token pairs in row-major order: token (t, h, w) sees token (t', h', w') iff their tiles
    are at most the window apart on each axis; compared through the tile order."""
    mask = window_block_mask(grid, tile, window)
    assert mask.shape[0] == 1 and mask.dtype == torch.bool
    perm, inv = tile_order(grid, tile)
    block = tile[0] * tile[1] * tile[2]
    n = perm.numel()
    got = token_mask(mask, block, n)[0][inv][:, inv]  # row-major x row-major
    t_n, h_n, w_n = grid
    coord = [(i // (h_n * w_n), (i // w_n) % h_n, i % w_n) for i in range(n)]
    want = torch.tensor([[all(abs(a // s - b // s) <= r for a, b, s, r in zip(coord[i], coord[j], tile, window))
                          for j in range(n)] for i in range(n)])
    assert torch.equal(got, want)


def test_topk_mask_counts_and_picks_the_highest_scores():
    torch.manual_seed(0)
    q_tiles, k_tiles = torch.randn(3, 10, 8), torch.randn(3, 10, 8)
    for k in (1, 4, 10, 15):
        mask = topk_block_mask(q_tiles, k_tiles, k)
        assert mask.shape == (3, 10, 10) and mask.dtype == torch.bool
        assert (mask.sum(-1) == min(k, 10)).all()
        scores = q_tiles @ k_tiles.transpose(-1, -2)
        worst_kept = scores.masked_fill(~mask, float("inf")).amin(-1)
        best_dropped = scores.masked_fill(mask, float("-inf")).amax(-1)
        assert (worst_kept >= best_dropped).all()


def test_pad_block_mask():
    mask = torch.ones(2, 3, 3, dtype=torch.bool)
    padded = pad_block_mask(mask, 5)
    assert padded.shape == (2, 5, 5) and padded[:, :3, :3].all() and not padded[:, 3:].any() and not padded[:, :, 3:].any()


# ---- coarse branch and the one-device block-sparse reference ---------------------------------------------------

def test_pool_tiles_and_coarse_branch_shapes_values_and_gradients():
    torch.manual_seed(1)
    b, s, h, d, block = 2, 12, 3, 4, 4  # 3 tiles of 4 tokens + 2 padding tokens
    x = torch.randn(b, s + 2, h, d, requires_grad=True)
    tile_index = torch.arange(s + 2) // block
    pooled = pool_tiles(x, tile_index, 3)
    assert pooled.shape == (b, h, 3, d)
    assert torch.allclose(pooled, x[:, :s].detach().view(b, 3, block, h, d).mean(2).transpose(1, 2), atol=1e-6)
    q, k, v = (torch.randn(b, s + 2, h, d, requires_grad=True) for _ in range(3))
    out = coarse_attention(pool_tiles(q, tile_index, 3), pool_tiles(k, tile_index, 3), pool_tiles(v, tile_index, 3),
                           tile_index)
    assert out.shape == (b, s + 2, h, d)
    assert (out[:, s:] == 0).all()  # padding tokens
    assert torch.equal(out[:, 0], out[:, 3]) and not torch.equal(out[:, 3], out[:, 4])  # one value per tile
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad[:, :s].abs().sum() > 0 and (t.grad[:, s:] == 0).all()


def test_block_sparse_reference_equals_masked_dense_and_zero_rows():
    torch.manual_seed(2)
    b, s, h, d, block = 1, 10, 2, 4, 4  # 3 blocks, the last one partial
    q, k, v = (torch.randn(b, s, h, d, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[[1, 0, 1], [0, 1, 0], [0, 0, 0]], [[1, 1, 1], [1, 1, 1], [1, 1, 1]]], dtype=torch.bool)
    out = block_sparse_attention(q, k, v, mask, block)
    for head in range(h):
        for i in range(s):
            keys = [j for j in range(s) if mask[head, i // block, j // block]]
            if not keys:
                assert (out[0, i, head] == 0).all()
                continue
            w = torch.softmax(q[0, i, head] @ k[0, keys, head].T / d ** 0.5, -1)
            assert torch.allclose(out[0, i, head], w @ v[0, keys, head], atol=1e-6)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    dense = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    full = block_sparse_attention(q, k, v, torch.ones(1, 3, 3, dtype=torch.bool), block)
    assert torch.allclose(full, dense, atol=1e-6)
    with pytest.raises(SPConfigError, match=r"expected \[H or 1, 3, 3\]"):
        block_sparse_attention(q, k, v, torch.ones(1, 2, 2, dtype=torch.bool), block)
