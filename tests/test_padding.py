"""Key padding (kv_valid_len): padded keys get no attention, in every algorithm (gloo, CPU)."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.sp.placement import pieces
from tests.harness import run_ranks
from tests.sp_check import run_case


def _padded(rank, world, algo):
    g = dist.group.WORLD
    s = 4 * world * 3
    valid = s - 5  # the last 5 tokens are padding
    mask = torch.zeros(s, s, dtype=torch.bool)
    mask[:, :valid] = True
    n = 0
    for causal in (False, True):
        m = mask & torch.ones(s, s, dtype=torch.bool).tril() if causal else mask
        pl = "zigzag" if causal else "contiguous"

        def shard(x, r, w, pl=pl):
            return torch.cat([x[:, a:a + k] for a, k in pieces(pl, r, w, x.shape[1])], dim=1)
        if algo == "ulysses":
            fn = lambda q, k, v: spx.ulysses_attention(q, k, v, g, head_chunks=2, causal=causal, placement=pl,  # noqa
                                                       kv_valid_len=valid)
        elif algo in ("ring", "tasp"):
            fn = lambda q, k, v: spx.ring_attention(q, k, v, g, variant=algo, causal=causal, placement=pl,  # noqa
                                                    kv_valid_len=valid)
        else:
            mesh = spx.build_sp_mesh(g, num_heads=8, placement="tas", ulysses_size=2, nodes=2)
            f = spx.hybrid_attention if algo == "hybrid" else spx.torus_attention
            fn = lambda q, k, v: f(q, k, v, mesh, causal=causal, placement=pl, kv_valid_len=valid)  # noqa
        # padded query rows are never compared: their outputs are don't-care, their grads must be 0
        out, dq, dk, dv = run_case(fn, rank, world, b=1, s=s, h=8, hkv=8, d=16, dtype=torch.float32, causal=causal,
                                   shard=shard, mask=m, seed=n, compare_rows=valid)
        n += 1
    return n


@pytest.mark.parametrize("algo", ["ulysses", "ring", "tasp", "hybrid", "torus"])
def test_padding_is_masked(algo):
    run_ranks(_padded, 4, algo)
