"""The CUDA suite's diffusers worker (tests/gpu/cuda_diffusers.py) dry-run on 2 CPU gloo ranks (SPX_SUITE_DEVICE=cpu,
the tiny test model): every case passes; and it can fail: with the gather's inverse token permutation dropped (the
output left in the plan's tile order) every case with the plan fails."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")

from diffusers import WanTransformer3DModel  # noqa: E402,F401 - imported before forking

from tests.gpu import cuda_diffusers  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.gpu.suite_judge import merge_ranks  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(cuda_diffusers, "DEV", "cpu")


def test_diffusers_worker_on_cpu_passes(on_cpu):
    merged = merge_ranks(run_ranks(cuda_diffusers.diffusers_family, 2, timeout=300))
    assert len(merged) == 17 and all(m["ok"] for m in merged), [(m["case"], m["why"]) for m in merged]


def _two_cases(rank, world):
    """One case with the plan (ring, fp32) and one without (ulysses, fp32), through the worker's own Family."""
    import torch
    fam = cuda_diffusers.Family(rank, world)
    fam.case("t2v", "ring", {}, torch.float32, sparse=True)
    fam.case("t2v", "ulysses", {}, torch.float32, sparse=False)
    return fam.records


def test_diffusers_worker_fails_without_the_inverse_order(on_cpu, monkeypatch):
    from megatron_sp_ext.diffusers import hooks, sequence

    def no_inverse(x, group, seq_dim, ctx):
        return sequence.gather_tokens(x, group, seq_dim, type(ctx)(ctx.grid_thw, ctx.seq_len, None, None))
    merged = merge_ranks(run_ranks(_two_cases, 2, timeout=300))
    assert [m["ok"] for m in merged] == [True, True], [(m["case"], m["why"]) for m in merged]
    monkeypatch.setattr(hooks, "gather_tokens", no_inverse)
    merged = merge_ranks(run_ranks(_two_cases, 2, timeout=300))
    assert [m["ok"] for m in merged] == [False, True], [(m["case"], m["errs"]) for m in merged]
    assert "sparse" in merged[0]["case"] and merged[0]["errs"]["output"] > 0.1, merged[0]


@pytest.mark.parametrize("world", [2, 4])
def test_every_mode_of_both_families_is_valid_at_p(world):
    """Every (mode, settings) of the diffusers families at P=world passes SPConfig's check for the 4-head test model
    (the P=4 family once asked HCMS for 2 chunks of 1 head a rank and was refused on the GPU, 2026-11-27)."""
    from megatron_sp_ext import SPConfig
    from tests.gpu import cuda_diffusers_sparse
    from tests.wan_sp import TINY
    for module in (cuda_diffusers, cuda_diffusers_sparse):
        for mode, settings in module._modes(world):
            SPConfig(mode=mode, **settings).validate_world(world, num_heads=TINY["num_attention_heads"])
