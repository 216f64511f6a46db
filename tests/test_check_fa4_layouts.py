"""tests/gpu/check_fa4_layouts.py (a GPU diagnostic) on the CPU stand-in of FlashAttention-4 (tests/fake_fa4.py): every
row is computed and right, and a kernel that got the head-major ``out`` wrong would be caught."""
from __future__ import annotations

import json

import torch

from tests import fake_fa4
from tests.gpu import check_fa4_layouts


def test_rows_right_on_the_stand_in(monkeypatch, tmp_path):
    fake_fa4.install(monkeypatch)
    rc = check_fa4_layouts.main(["--out", str(tmp_path), "--device", "cpu", "--head-dims", "8,16",
                                 "--seqlens", "45,64"])
    res = json.loads((tmp_path / "check_fa4_layouts.json").read_text())
    assert rc == 0 and len(res["rows"]) == 8 and all(r["ok"] for r in res["rows"])
    row = res["rows"][0]
    assert set(check_fa4_layouts.ORDERS) <= set(row) and all("dq" in row[o] for o in check_fa4_layouts.ORDERS)
    assert "dq" in row["varlen_per_sample"] and "dq" in row["varlen_grouped"]


def test_a_misread_out_is_caught(monkeypatch):
    fake = fake_fa4.install(monkeypatch)
    real_bwd = fake._flash_attn_bwd

    def misreading_bwd(q, k, v, out, dout, lse, *a, **kw):   # reads a head-major out as if it were bshd
        if out.dim() == 4 and out.stride(1) < out.stride(2):
            out = out.transpose(1, 2).contiguous().view(out.shape)
        return real_bwd(q, k, v, out, dout, lse, *a, **kw)
    iface = __import__("flash_attn.cute.interface", fromlist=["_flash_attn_bwd"])
    monkeypatch.setattr(iface, "_flash_attn_bwd", misreading_bwd)
    row = check_fa4_layouts.check_case(8, 45, 4, 2, torch.device("cpu"), torch.bfloat16)
    assert row["own"]["dq"] <= 2e-2 and row["out_head_major"]["dq"] > 2e-2 and not row["ok"]
