"""The CUDA suite's BlockSparsePlan worker (tests/gpu/cuda_diffusers_sparse.py) dry-run on 2 CPU gloo ranks
(SPX_SUITE_DEVICE=cpu: the tiny float64 test model, tile 2x2x2): every case passes; and it can fail: with the gated
coarse branch dropped from the plan's output every top-k case fails."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")

from diffusers import WanTransformer3DModel  # noqa: E402,F401 - imported before forking

from megatron_sp_ext.diffusers.sparse import BlockSparsePlan  # noqa: E402
from tests.gpu import cuda_diffusers, cuda_diffusers_sparse  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.gpu.suite_judge import merge_ranks  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(cuda_diffusers, "DEV", "cpu")
    monkeypatch.setattr(cuda_diffusers_sparse, "DEV", "cpu")


def test_diffusers_sparse_worker_on_cpu_passes(on_cpu):
    merged = merge_ranks(run_ranks(cuda_diffusers_sparse.diffusers_sparse_family, 2, timeout=300))
    assert len(merged) == 12 and all(m["ok"] for m in merged), [(m["case"], m["why"]) for m in merged]


def _topk_ring(rank, world):
    import torch
    fam = cuda_diffusers_sparse.SparseFamily(rank, world)
    fam.sparse_case("topk", "ring", {}, torch.float32)
    return fam.records


def test_diffusers_sparse_worker_fails_without_the_coarse_branch(on_cpu, monkeypatch):
    real = BlockSparsePlan.__call__
    monkeypatch.setattr(BlockSparsePlan, "__call__", lambda self, *a: (real(self, *a)[0], None))
    merged = merge_ranks(run_ranks(_topk_ring, 2, timeout=120))
    assert len(merged) == 1 and not merged[0]["ok"], merged
