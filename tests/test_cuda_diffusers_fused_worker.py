"""The CUDA suite's fuse_elementwise worker (tests/gpu/cuda_diffusers_fused.py) dry-run on CPU gloo ranks
(SPX_SUITE_DEVICE=cpu: the tiny float64-test model, backend "aot_eager"): every case passes at P=2 and each compiled
graphs; and it can fail: with fuse_elementwise made a no-op every case is refused (it ran eagerly)."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")

from diffusers import WanTransformer3DModel  # noqa: E402,F401 - imported before forking

from tests.gpu import cuda_diffusers, cuda_diffusers_fused  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.gpu.suite_judge import merge_ranks  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(cuda_diffusers, "DEV", "cpu")


def test_fused_worker_on_cpu_passes(on_cpu):
    merged = merge_ranks(run_ranks(cuda_diffusers_fused.diffusers_fused_family, 2, timeout=600))
    assert len(merged) == 8 and all(m["ok"] for m in merged), [(m["case"], m["why"]) for m in merged]
    assert all(m["graphs"] >= 1 for m in merged)


def _one_case_uncompiled(rank, world):
    import torch
    from megatron_sp_ext import diffusers as spx_diffusers
    from megatron_sp_ext.diffusers import fused

    class Noop:
        def remove(self):
            pass
    spx_diffusers.fuse_elementwise = fused.fuse_elementwise = lambda model, backend: Noop()
    fam = cuda_diffusers_fused.FusedFamily(rank, world)
    fam.fused_case("t2v", "ulysses", torch.float32, sparse=False)
    return fam.records


def test_fused_worker_refuses_an_eager_run(on_cpu):
    merged = merge_ranks(run_ranks(_one_case_uncompiled, 2, timeout=300))
    assert len(merged) == 1 and not merged[0]["ok"] and "compiled no graph" in merged[0]["why"], merged
