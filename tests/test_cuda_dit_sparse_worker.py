"""The CUDA suite's dit_sparse worker (tests/cuda_dit_sparse.py) dry-run on 2 CPU gloo ranks (SPX_SUITE_DEVICE=cpu,
math kernel): every case passes; and it can fail: with the SP ranks' pooled tiles 0.1% off (the same on every rank,
so the masks still agree) every fp32 top-k case at SP=2 fails, the window cases still pass. (Pooled tiles left
unsummed over the group give each rank its own top-k mask: the modes refuse that by name before any exchange.)"""
from __future__ import annotations

import pytest

from tests import cuda_dit_sparse
from tests.harness import run_ranks
from tests.suite_judge import merge_ranks


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(cuda_dit_sparse, "DEV", "cpu")


def test_dit_sparse_worker_on_cpu_passes(on_cpu):
    merged = merge_ranks(run_ranks(cuda_dit_sparse.dit_sparse_family, 2, timeout=600))
    assert len(merged) == 18 and all(m["ok"] for m in merged), [(m["case"], m["why"]) for m in merged]


def _off_under_sp(real):
    def pool(x, idx, n, group=None, run=None):
        out = real(x, idx, n, group, run)
        return out if group is None else out * 1.001
    return pool


def test_dit_sparse_worker_fails_when_sp_pooling_is_off(on_cpu, monkeypatch):
    from training.video_dit import model
    monkeypatch.setattr(model, "pool_tiles", _off_under_sp(model.pool_tiles))
    merged = merge_ranks(run_ranks(cuda_dit_sparse.dit_sparse_family, 2, timeout=600))
    topk = [m for m in merged if "topk" in m["case"] and m["case"].split()[2] == "fp32"]
    window = [m for m in merged if "window" in m["case"]]
    assert topk and not any(m["ok"] for m in topk), [(m["case"], m["errs"]) for m in topk]
    assert window and all(m["ok"] for m in window)
