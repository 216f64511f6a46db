"""The GPU diagnostics of 2026-11-26 on the CPU (their flow, their records, and that they can report a failure):
tests/gpu/check_fa4_tiles.py --dit on the FA4 stand-in, tests/gpu/check_sdpa_calls.py,
tests/gpu/check_cudnn_dit_scale.py and tests/gpu/check_cudnn_do_layout.py with --device cpu."""
from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch

from tests import fake_fa4


def test_check_fa4_tiles_dit_cases_on_the_stand_in(monkeypatch):
    fake_fa4.install(monkeypatch, dtypes=(torch.bfloat16,))
    from tests.gpu import check_fa4_tiles
    rows = check_fa4_tiles.check(argparse.Namespace(dit=True, cases="0,5,10,15"), torch.device("cpu"))
    assert [(r["d"], r["h"], r["s"], r["bshd"]) for r in rows] == [(64, 8, 1024, True), (64, 4, 1024, False),
                                                                   (128, 8, 540, True), (128, 4, 540, False)]
    assert all("error" not in r and max(r[x] for x in ("out", "dq", "dk", "dv")) < 5e-3 for r in rows), rows


def test_check_fa4_tiles_reports_a_wrong_kernel(monkeypatch):
    fake = fake_fa4.install(monkeypatch, dtypes=(torch.bfloat16,))
    real = fake._flash_attn_bwd

    def wrong_bwd(*a, **kw):   # dq scaled: the check must see it
        out = list(real(*a, **kw))
        out[0] = out[0] * 1.1
        return tuple(out)
    monkeypatch.setattr(sys.modules["flash_attn.cute.interface"], "_flash_attn_bwd", wrong_bwd)
    from tests.gpu import check_fa4_tiles
    rows = check_fa4_tiles.check(argparse.Namespace(dit=True, cases="0"), torch.device("cpu"))
    assert rows[0]["dq"] > 5e-2 and rows[0]["dk"] < 5e-3


@pytest.fixture
def world_of_one(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setenv("SPX_SUITE_DEVICE", "cpu")
    from tests.gpu import cuda_dit_dynamic, cuda_dit_sparse
    monkeypatch.setattr(cuda_dit_dynamic, "DEV", "cpu")
    monkeypatch.setattr(cuda_dit_sparse, "DEV", "cpu")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29700 + os.getpid() % 200))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_check_sdpa_calls_records_and_replays_every_call(world_of_one, tmp_path, monkeypatch):
    from tests.gpu import check_sdpa_calls
    monkeypatch.setattr(sys, "argv", ["check_sdpa_calls", "--out", str(tmp_path), "--device", "cpu",
                                      "--steps", "sparse"])
    check_sdpa_calls.main()
    res = json.loads((tmp_path / "sdpa_calls.json").read_text())["steps"]["sparse"]
    assert 0 < res["step_bf16_vs_fp32"] < 2e-2 and 0 < res["step_bf16_coarse_in_bf16_vs_fp32"] < 2e-2
    # the cross-attention calls (bf16, q over the whole sequence) are replayed with their incoming gradient
    cross = [c for c in res["calls"] if c["q"][0][2] == 1024]
    assert cross and all(c["has_dout"] and c["out"] < 1e-2 and c["dv"] < 1e-2 for c in cross), cross


def test_check_cudnn_dit_scale_divides_the_scale_back(world_of_one, tmp_path, monkeypatch):
    from tests.gpu import check_cudnn_dit_scale
    monkeypatch.setattr(sys, "argv", ["check_cudnn_dit_scale", "--out", str(tmp_path), "--device", "cpu",
                                      "--kernels", "math", "--scales", "1,1e4"])
    check_cudnn_dit_scale.main()
    rows = json.loads((tmp_path / "cudnn_dit_scale.json").read_text())["rows"]
    assert [r["loss_scale"] for r in rows] == [1.0, 1e4]
    assert all(r["non_finite_params"] == 0 and r["grads_normwise_err"] < 2e-2 for r in rows), rows
    assert abs(rows[0]["loss"] - rows[1]["loss"]) < 1e-3 * abs(rows[0]["loss"])


def test_check_cudnn_do_layout_flow_on_the_stand_in(tmp_path):
    """tests/gpu/check_cudnn_do_layout.py --device cpu: both fresh processes run, and the record tells the hook's
    calls (right) from the calls without it (the second call's gradients wrong), as it must on the GPU."""
    from tests.gpu import check_cudnn_do_layout
    res = check_cudnn_do_layout.main(["--out", str(tmp_path), "--device", "cpu"])
    with open(os.path.join(tmp_path, "cudnn_do_layout.json")) as f:
        assert json.load(f) == res
    hook, no_hook = res["runs"]
    assert hook["hook"] and not no_hook["hook"] and "error" not in hook and "error" not in no_hook, res
    assert max(max(c.values()) for k, c in hook.items() if k != "hook") < 1e-6
    assert max(no_hook["first_call_dO_transposed"].values()) < 1e-6
    assert min(v for n, v in no_hook["second_call_dO_contiguous"].items() if n != "out") > 1e-2
