"""The CUDA suite's dit_sparse worker (tests/cuda_dit_sparse.py) dry-run on 2 CPU gloo ranks (SPX_SUITE_DEVICE=cpu,
math kernel): every case passes; and it can fail: with the SP ranks' pooled tiles 0.1% off (the same on every rank,
so the masks still agree) every fp32 top-k case at SP=2 fails, the window cases still pass. (Pooled tiles left
unsummed over the group give each rank its own top-k mask: the modes refuse that by name before any exchange.) With
the pooled tiles rolled by one tile under SP (a selection SP got wrong, far from any near-tie), the bf16 top-k cases
fail naming the selection, though their SP=1 runs replay it."""
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


def _rolled_under_sp(real):
    def pool(x, idx, n, group=None, run=None):
        out = real(x, idx, n, group, run)
        return out if group is None else out.roll(1, dims=2)
    return pool


def test_dit_sparse_worker_fails_when_sp_selection_is_wrong(on_cpu, monkeypatch):
    from training.video_dit import model
    monkeypatch.setattr(model, "pool_tiles", _rolled_under_sp(model.pool_tiles))
    merged = merge_ranks(run_ranks(cuda_dit_sparse.dit_sparse_family, 2, timeout=600))
    topk16 = [m for m in merged if "topk" in m["case"] and m["case"].split()[2] == "bf16"]
    assert topk16 and not any(m["ok"] for m in topk16), [(m["case"], m["why"]) for m in topk16]
    assert all("top-k selection differs" in m["why"] for m in topk16), [m["why"] for m in topk16]


def test_selection_change_counts_rows_and_their_gaps():
    import torch
    own = cuda_dit_sparse.Selections()
    own.masks = [torch.tensor([[[True, False, True], [True, True, False]]])]
    own.gaps = [torch.tensor([[0.5, 1e-4]], dtype=torch.float64)]
    same = cuda_dit_sparse.selection_change([own.masks[0].clone()], own)
    assert same == {"rows": 2, "changed": 0, "changed_max_gap": 0.0}
    flipped = own.masks[0].clone()
    flipped[0, 1] = torch.tensor([True, False, True])          # the near-tied row
    near = cuda_dit_sparse.selection_change([flipped], own)
    assert near["changed"] == 1 and near["changed_max_gap"] == 1e-4 < cuda_dit_sparse.NEAR_TIE
    flipped[0, 0] = torch.tensor([False, True, True])          # a row 0.5 apart
    far = cuda_dit_sparse.selection_change([flipped], own)
    assert far["changed"] == 2 and far["changed_max_gap"] == 0.5 > cuda_dit_sparse.NEAR_TIE
    assert cuda_dit_sparse.selection_change([], own)["rows"] == -1
