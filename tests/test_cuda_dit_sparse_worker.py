"""The CUDA suite's dit_sparse worker (tests/gpu/cuda_dit_sparse.py) dry-run on 2 CPU gloo ranks (SPX_SUITE_DEVICE=cpu,
math kernel) at ``small_sizes()`` on a subset of its 18 cases that covers every path (each grid: top-k, window, the
grid the tile cuts; each mode; fp32's per-parameter and bf16's norm-wise judgement, the bf16 top-k replay and its
selection check); the CUDA suite (tests/gpu/test_cuda.py) runs all 18 / 24 at full size. Every case passes; and it can
fail: with the SP ranks' pooled tiles 0.1% off (the same on every rank,
so the masks still agree) every fp32 top-k case at SP=2 fails, the window cases still pass. (Pooled tiles left
unsummed over the group give each rank its own top-k mask: the modes refuse that by name before any exchange.) With
the pooled tiles rolled by one tile under SP (a selection SP got wrong, far from any near-tie), the bf16 top-k cases
fail naming the selection, though their SP=1 runs replay it."""
from __future__ import annotations

import pytest

from tests.gpu import cuda_dit_sparse
from tests.harness import run_ranks
from tests.gpu.suite_judge import merge_ranks


# (grid, mode, dtype): every grid, every mode of P=2, fp32 and bf16 on top-k (the replay) and bf16 on the window
COVER = [("topk", "ring", "fp32"), ("topk", "hcms", "bf16"), ("window", "ulysses", "bf16"),
         ("topk cut grid", "ulysses", "fp32")]


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(cuda_dit_sparse, "DEV", "cpu")
    for name, value in cuda_dit_sparse.small_sizes().items():
        monkeypatch.setattr(cuda_dit_sparse, name, value)


def _run(only):
    return merge_ranks(run_ranks(cuda_dit_sparse.dit_sparse_family, 2, only, timeout=300))


def test_dit_sparse_worker_on_cpu_passes(on_cpu):
    merged = _run(COVER)
    assert len(merged) == len(COVER) and all(m["ok"] for m in merged), [(m["case"], m["why"]) for m in merged]
    ran = {tuple(m["case"].split(" tile ")[0].split(" ", 3)[1:]) for m in merged}   # (mode[chunks], dtype, grid)
    assert ran == {(mode + ("2" if mode == "hcms" else ""), dtype, grid) for grid, mode, dtype in COVER}, ran
    assert all("selection_rows" in m for m in merged if "bf16 topk" in m["case"])   # the replay's check ran


def test_only_names_cases_of_the_family(on_cpu):
    with pytest.raises(AssertionError, match="only= names no case of this family at P=1"):
        cuda_dit_sparse.dit_sparse_family(0, 1, [("topk", "usp", "fp32")])


def _off_under_sp(real):
    def pool(x, idx, n, group=None, run=None):
        out = real(x, idx, n, group, run)
        return out if group is None else out * 1.001
    return pool


def test_dit_sparse_worker_fails_when_sp_pooling_is_off(on_cpu, monkeypatch):
    from training.video_dit import model
    monkeypatch.setattr(model, "pool_tiles", _off_under_sp(model.pool_tiles))
    merged = _run([("topk", "ring", "fp32"), ("topk cut grid", "ulysses", "fp32"), ("window", "ulysses", "bf16")])
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
    merged = _run([("topk", "hcms", "bf16"), ("topk cut grid", "ulysses", "bf16")])
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
