"""The benchmarks' yardsticks compute the same attention as ours: tools/bench_attention.minimal_ulysses (the
minimal DeepSpeed-style Ulysses of issue 16's comparison) against the float64 reference, output and every
input gradient, causal and not, on 2 and 4 gloo ranks; and it equals our plain Ulysses."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from tests.harness import run_ranks
from tests.reference import rel_err
from tests.sp_check import run_case
from tools.bench_attention import minimal_ulysses


def _minimal(rank, world):
    group = dist.group.WORLD
    for causal in (False, True):
        for (b, sl, h, d) in ((1, 6, 8, 16), (2, 3, 4 * world, 8)):
            kw = dict(b=b, s=sl * world, h=h, hkv=h, d=d, dtype=torch.float32, causal=causal, seed=7 + h)
            got = run_case(lambda q, k, v: minimal_ulysses(q, k, v, group, causal), rank, world, **kw)
            ours = run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, group, causal=causal), rank, world, **kw)
            for a, o in zip(got, ours):
                assert rel_err(a, o) < 1e-5
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_minimal_ulysses_matches_reference(world):
    run_ranks(_minimal, world)
