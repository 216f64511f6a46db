"""tools/bench_sp_block_sparse.py --smoke at 2 gloo ranks (#55 item 2): every row, the plan's counters for every rank,
finite times, useful work that adds up to the mask, and the ring-vs-Ulysses check inside the job small."""
from __future__ import annotations

import itertools
import json
import math
import os

import pytest

from tests.harness import run_ranks
from tools import bench_sp_block_sparse as bsp

WORLD = 2


def _smoke(rank: int, world: int, out: str) -> dict:
    return bsp.main(["--smoke", "--out", out])


def test_smoke_two_ranks(tmp_path):
    docs = run_ranks(_smoke, WORLD, str(tmp_path), timeout=120)
    with open(os.path.join(tmp_path, bsp.OUT_NAME)) as f:
        doc = json.load(f)
    assert [r["row"] for r in docs[1]["rows"]] == [r["row"] for r in doc["rows"]]   # every rank ran every row
    meta, rows = doc["meta"], doc["rows"]
    assert meta["world"] == WORLD and meta["link"] == "gloo" and meta["device"] == "cpu"
    assert meta["dtype"] == "torch.bfloat16" and "torch" in meta and "date" in meta and "commit" in meta
    args = bsp.parse(["--smoke"])
    seqlens = [int(x) for x in args.seqlens.split(",")]
    targets = [float(x) for x in args.sparsities.split(",")]
    h, d, bs = args.heads, args.head_dim, args.block_size
    got = {(r["s"], r["row"], r.get("mask"), r.get("target_sparsity")) for r in rows}
    want = {(s, name, None, None) for s in seqlens for name in ("dense_ulysses", "dense_ring")}
    want |= {(s, name, mask, t) for s, name, mask, t in
             itertools.product(seqlens, ("sparse_ulysses", "sparse_ring"), ("window", "random"), targets)}
    assert got == want and len(rows) == len(want)
    for r in rows:
        assert "error" not in r, r
        assert math.isfinite(r["fwd_bwd_ms"]) and r["fwd_bwd_ms"] > 0, r
        assert len(r["ms_per_rank"]) == WORLD and r["fwd_bwd_ms"] == pytest.approx(max(r["ms_per_rank"]), abs=1e-3)
        assert r["first_call_s"] >= 0 and all(x > 0 for x in r["useful_tflops_per_rank"])
        # useful work: every rank's selected pairs add up to the mask's (S^2 H (1 - sparsity))
        s = r["s"]
        assert sum(r["useful_pairs_per_rank"]) == pytest.approx(s * s * h * (1 - r["sparsity"]))
        if r["row"].startswith("sparse"):
            assert r["work_vs_dense"] == pytest.approx(1 - r["sparsity"], abs=1e-4) and r["time_vs_dense"] > 0
        if not r["row"].endswith("ring"):
            continue
        # the plan's counters on every rank: steps add up to P, bytes to one rank's K|V per hop (bf16)
        kv_bytes = 2 * (s // WORLD) * h * d * 2
        assert len(r["counts_per_rank"]) == WORLD
        for c in r["counts_per_rank"]:
            assert c["steps_run"] + c["steps_skipped"] == WORLD and c["steps_run"] >= 1
            assert c["bytes_sent"] + c["bytes_skipped"] == (WORLD - 1) * kv_bytes
            assert c["dkv_bytes_sent"] + c["dkv_bytes_skipped"] == (WORLD - 1) * kv_bytes
            if r["row"] == "dense_ring":
                assert c["steps_skipped"] == 0 and c["bytes_skipped"] == 0
        if r["row"] == "sparse_ring":
            assert r["steps_skipped"] == sum(c["steps_skipped"] for c in r["counts_per_rank"])
            assert r["kv_bytes_skipped"] == sum(c["bytes_skipped"] for c in r["counts_per_rank"])
            if r["mask"] == "window" and not any(r["window"]):
                # each tile attends only itself: no rank needs another's K|V
                assert r["steps_skipped"] == WORLD * (WORLD - 1) and r["kv_bytes_skipped"] == WORLD * kv_bytes
        assert r["ok"] and r["max_rel_err"] < 2e-2, r
    assert any(r.get("steps_skipped") for r in rows)   # the smoke run does exercise skipping
    sanity = doc["sanity"]
    assert sanity["ok"] and sanity["unchecked_ring_rows"] == 0 and sanity["max_rel_err"] < 2e-2
    assert len(sanity["checks"]) == len(seqlens) * (1 + 2 * len(targets))
    assert sanity["smallest_config"]["s"] == min(seqlens) and sanity["smallest_config"]["row"] == "sparse_ring"
    falls = doc["falls_with_work"]   # CPU times carry no claim: only the series' shape is checked
    assert {(f["s"], f["family"], f["mask"]) for f in falls} == set(
        itertools.product(seqlens, ("ulysses", "ring"), ("random", "window")))
    assert all(len(f["fwd_bwd_ms"]) == 1 + len(targets) and f["falls"] in (True, False) for f in falls)
    assert "sparse_ring" in doc["table"] and doc["job_s"] > 0
