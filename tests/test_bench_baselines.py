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


def _bench_modes(rank, world):
    from tools.bench_attention import build_modes
    group = dist.group.WORLD
    names = ["minimal", "ulysses", "hcms2", "prepacked", "hcms2_prepacked", "ring", "tasp", "usp", "tas", "torus",
             "mesh_auto"]
    modes = build_modes(names, group, causal=False, nodes=2)  # 2 simulated machines: tas and torus need them
    assert set(modes) == set(names)
    g = torch.Generator().manual_seed(3 + rank)
    q, k, v = (torch.randn(1, 4, 8, 16, generator=g) for _ in range(3))
    ref = spx.ulysses_attention(q, k, v, group)
    for name, fn in modes.items():
        assert rel_err(fn(q, k, v), ref) < 1e-5, name
    assert modes["mesh_auto"].mesh_of(8).world == world
    # prepacked: its gradients (left in the send layout) map back to plain Ulysses' q/k/v gradients
    go = torch.randn(1, 4, 8, 16, generator=g)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    spx.ulysses_attention(qg, kg, vg, group).backward(go)
    for name in ("prepacked", "hcms2_prepacked"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        modes[name](*leaves).backward(go)
        for got, want in zip(modes[name].qkv_grads(*leaves), (qg.grad, kg.grad, vg.grad)):
            assert rel_err(got, want) < 1e-5, name
    # the benchmark's full-sequence check: the shards gathered in rank order, one call over the whole sequence
    from tools.bench_attention import gather_sequence
    from tools.full_reference import full_reference, rel_errs, within
    full = [gather_sequence(t, group) for t in (q, k, v, go)]
    assert full[0].shape == (1, 4 * world, 8, 16) and torch.equal(full[0][:, 4 * rank:4 * rank + 4], q)
    ref_full = full_reference(*full, causal=False)
    out = spx.ulysses_attention(qg.detach(), kg.detach(), vg.detach(), group)
    errs = rel_errs([gather_sequence(t, group) for t in (out, qg.grad, kg.grad, vg.grad)], ref_full)
    assert within(errs, 1e-5), errs
    wrong = rel_errs([gather_sequence(t, group) for t in (out, kg.grad, qg.grad, vg.grad)], ref_full)
    assert not within(wrong, 1e-2), wrong   # a swapped gradient is caught
    return True


def test_bench_attention_modes_compute_the_same_attention():
    """Every mode the attention benchmark times (as built by its own mode table) gives our Ulysses' output."""
    run_ranks(_bench_modes, 4)
