"""The DiT's --sparse-topk path calls no deprecated API (issue #51 item 4: every run printed torch's FutureWarning
``torch.distributed.nn.functional.all_reduce is deprecated`` per rank): the pooled tiles' differentiable sum over
the SP group runs with every warning an error, exactly (float64: the gathered single-device pooling, output and
gradient), and the top-k sparse step at SP=2 still equals SP=1."""
import warnings

import torch
import torch.distributed as dist

from tests.harness import run_ranks
from training.video_dit.sparse import pool_tiles

B, H, D, TILES = 2, 3, 4, 5


def _pool_exact(rank, world):
    torch.manual_seed(0)
    s = 2 * TILES            # 10 tokens, 2 per tile, split over the ranks; the last rank gets 2 padding rows
    x_full = torch.randn(B, s, H, D, dtype=torch.float64)
    tile_full = torch.arange(s) // 2
    w = torch.randn(world, B, H, TILES, D, dtype=torch.float64)   # rank r's loss: (pooled * w[r]).sum()
    ref_x = x_full.clone().requires_grad_()
    (pool_tiles(ref_x, tile_full, TILES)[None] * w).sum().backward()   # the sum of the ranks' losses
    per = -(-s // world)
    rows = slice(rank * per, min((rank + 1) * per, s))
    pad = per - (rows.stop - rows.start)
    x = torch.cat([x_full[:, rows], torch.zeros(B, pad, H, D, dtype=torch.float64)], 1).requires_grad_()
    tile = torch.cat([tile_full[rows], torch.full((pad,), TILES)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = pool_tiles(x, tile, TILES, group=dist.group.WORLD)
        (out * w[rank]).sum().backward()
    assert torch.allclose(out, pool_tiles(x_full, tile_full, TILES), rtol=0, atol=1e-14)
    assert torch.allclose(x.grad[:, :rows.stop - rows.start], ref_x.grad[:, rows], rtol=0, atol=1e-14)
    assert not x.grad[:, rows.stop - rows.start:].any()
    return True


def test_pooled_tiles_sum_is_exact_without_warnings():
    run_ranks(_pool_exact, 2)
    run_ranks(_pool_exact, 3)


def _topk_step(rank, world):
    from tests.test_sparse_dit import SP_CASES, _sp_equals_sp1  # noqa: PLC0415 - the SP=1 comparison, reused
    topk = [case for case in SP_CASES if case[0].topk is not None]
    assert topk
    SP_CASES[:] = topk
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return _sp_equals_sp1(rank, world, [("ulysses", {})])


def test_topk_step_sp2_runs_with_warnings_as_errors():
    run_ranks(_topk_step, 2)
