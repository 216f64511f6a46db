"""#45's benchmarks on CPU: tools/bench_block_sparse.py --smoke (rows, skip counts, sparsities, useful-work counts
against the masks) and tools/bench_train_step.py's block-sparse variants (K / window from the grid, flags that both
entry points' parse() accept, the sparse-aware FLOP count)."""
from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch

from megatron_sp_ext.attention import block_sparse
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.placement import positions
from tools import bench_block_sparse as bbs
from tools import bench_train_step as bts
from training.video_dit.config import preset
from training.video_dit.sparse import window_tile_mask


def test_smoke_rows_counts_and_sparsity(tmp_path):
    bbs.main(["--smoke", "--out", str(tmp_path)])
    with open(os.path.join(tmp_path, "bench_block_sparse.json")) as f:
        doc = json.load(f)
    meta, rows = doc["meta"], doc["rows"]
    assert meta["torch"] == torch.__version__ and meta["device"] == "cpu" and "command" in meta and "utc" in meta
    s, h, d, bs = 512, 2, 16, 64
    n_tiles = s // bs
    targets = (0.5, 0.8, 0.9)
    kinds = {(r["kind"], r.get("layout"), r.get("mask"), r.get("target_sparsity"), r["p"]) for r in rows}
    for p in (1, 8):
        assert ("dense", "ulysses", None, None, p) in kinds
    for p in (4, 8):
        assert ("dense", "ring_step", None, None, p) in kinds
    for mask, t in itertools.product(("random", "window"), targets):
        for p in (1, 8):
            assert ("ulysses", None, mask, t, p) in kinds
        for p in (4, 8):
            assert ("ring", None, mask, t, p) in kinds
    for r in rows:
        assert "error" not in r, r
        if r["kind"] != "ring":
            assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_tflops"] > 0, r
    # sparsity: random keeps round((1 - s) * nT) tiles per query tile; window: the achievable sparsity nearest s
    achievable = sorted({round(1 - float(window_tile_mask((8, 8, 8), (4, 4, 4), w).float().mean()), 4)
                         for w in itertools.product(range(2), repeat=3)})
    for r in (r for r in rows if r["kind"] == "ulysses"):
        t = r["target_sparsity"]
        if r["mask"] == "random":
            assert r["keep_tiles"] == max(1, round((1 - t) * n_tiles))
            assert abs(r["sparsity"] - t) <= 0.5 / n_tiles + 1e-9
        else:
            assert r["sparsity"] == min(achievable, key=lambda a: abs(a - t))
        hp = math.ceil(h / r["p"])
        assert r["useful_pairs"] == pytest.approx(hp * s * s * (1 - r["sparsity"]))
    # ring: steps_run + steps_skipped == P on every rank, bytes add up, the timed ranks ran the plan's steps, and
    # the run steps' useful pairs are all of that rank's selected pairs (skipped steps had nothing to compute)
    kv_bytes = lambda p: 2 * h * (s // p) * d * 4  # noqa: E731  (fp32 on CPU)
    for r in (r for r in rows if r["kind"] == "ring"):
        p = r["p"]
        assert len(r["counts_per_rank"]) == p
        for c in r["counts_per_rank"]:
            assert c["steps_run"] + c["steps_skipped"] == p and c["steps_run"] >= 1
            assert c["bytes_sent"] + c["bytes_skipped"] == (p - 1) * kv_bytes(p)
            assert c["dkv_bytes_sent"] + c["dkv_bytes_skipped"] == (p - 1) * kv_bytes(p)
        assert "no communication" in r["note"]
        busiest = max(c["steps_run"] for c in r["counts_per_rank"])
        assert r["counts_per_rank"][r["busiest_rank"]]["steps_run"] == busiest
        assert set(r["ranks"]) == {"0", str(r["busiest_rank"])}
        ulysses = next(u for u in rows if u["kind"] == "ulysses" and u["mask"] == r["mask"]
                       and u["target_sparsity"] == r["target_sparsity"] and u["p"] == 1)
        for rank, per in r["ranks"].items():
            assert len(per["run_steps"]) == r["counts_per_rank"][int(rank)]["steps_run"]
            assert per["run_steps_fwd_ms"] > 0
            # rank's queries are s/p of the sequence; for contiguous placement under a window/random mask the
            # pairs of its queries against every key equal the sum over the steps that ran
            q_pos = positions("contiguous", int(rank), p, s)
            assert per["useful_pairs"] == pytest.approx(_pairs_of(r, ulysses, q_pos, s, h))
        if r["mask"] == "window" and r["sparsity"] == 0.875:
            # window 0 on a 2x2x2 tile grid: every query tile attends only itself
            assert all(c["steps_run"] == 1 for c in r["counts_per_rank"])
    assert "kernel time of the steps that run" in doc["table"]


def _pairs_of(ring_row: dict, ulysses_row: dict, q_pos: torch.Tensor, s: int, h: int) -> float:
    """Selected pairs of the queries at q_pos against all keys, rebuilt from the row's mask definition."""
    args = bbs.parse(["--smoke"])
    for bm, meta in bbs.masks_for(s, h, args):
        if meta["mask"] == ring_row["mask"] and meta["target_sparsity"] == ring_row["target_sparsity"]:
            tm = block_sparse.token_mask(bm, q_pos, torch.arange(s), 64)
            return float(tm.sum() * (h if bm.shape[0] == 1 else 1))
    raise AssertionError(ulysses_row)


def test_window_for_sparsity_is_nearest_and_grid_for_fits():
    grid, tile = (16, 16, 32), (4, 4, 4)
    for target in (0.5, 0.8, 0.9):
        w = bbs.window_for_sparsity(grid, tile, target)
        got = 1 - float(window_tile_mask(grid, tile, w).float().mean())
        offs = {x: abs(1 - float(window_tile_mask(grid, tile, x).float().mean()) - target)
                for x in itertools.product(range(4), range(4), range(8))}
        close = [x for x, o in offs.items() if o <= 0.02]
        assert close and abs(got - target) <= 0.02 + 1e-9
        assert max(w) - min(w) == min(max(x) - min(x) for x in close)
    # nothing within tol: the nearest
    w = bbs.window_for_sparsity((8, 8, 8), (4, 4, 4), 0.8)
    assert 1 - float(window_tile_mask((8, 8, 8), (4, 4, 4), w).float().mean()) == 0.75
    for s in (512, 32768, 131072):
        g = bbs.grid_for(s, (4, 4, 4))
        assert math.prod(g) == s and all(x % 4 == 0 for x in g)
    assert bbs.grid_for(32768, (4, 4, 4)) == (32, 32, 32) and bbs.grid_for(131072, (4, 4, 4)) == (32, 64, 64)


def test_selected_pairs_matches_token_mask():
    bm = bbs.random_topk_mask(3, 5, 0.6, seed=1)
    q_pos, k_pos = torch.tensor([0, 3, 64, 200, 319]), torch.arange(0, 320, 7)
    want = float(block_sparse.token_mask(bm, q_pos, k_pos, 64).sum())
    assert bbs.selected_pairs(bm, q_pos, k_pos, 64, 3) == want
    assert (bm.sum(-1) == 2).all()


REST = ["--model", "tiny", "--frames", "8", "--latent-size", "32x32", "--train-iters", "1"]


@pytest.mark.parametrize("entry_name", ["megatron", "deepspeed"])
def test_train_step_sparse_variants_parse(entry_name):
    from training import pretrain_video_dit, train_deepspeed
    from training.video_dit.cli import sparse_spec
    entry = pretrain_video_dit if entry_name == "megatron" else train_deepspeed
    n_tiles = 2 * 4 * 4  # grid 8x16x16 after the (1, 2, 2) patch, tiles 4,4,4
    for name, (kind, target) in bts.SPARSE_VARIANTS.items():
        if kind == "custom":   # the user's own selection (tests/test_bench_train_step.py)
            continue
        flags, info = bts.sparse_variant_flags(name, REST, "4,4,4", entry)
        spec = sparse_spec(entry.parse([*REST, *flags]))
        assert info["grid"] == [8, 16, 16] and info["n_tiles"] == n_tiles and info["flags"] == flags
        if kind == "topk":
            assert spec.topk == max(1, round((1 - target) * n_tiles)) == info["topk"] and spec.window is None
            assert info["sparsity"] == 1 - spec.topk / n_tiles
        else:
            assert spec.window == tuple(info["window"]) and spec.topk is None
            assert info["sparsity"] == pytest.approx(
                1 - float(window_tile_mask((8, 16, 16), (4, 4, 4), spec.window).float().mean()))
        assert abs(info["sparsity"] - target) < 0.1
    with pytest.raises(SPConfigError, match="--sparse-tile"):   # any grid runs (#53); a tile must be 3 sizes > 0
        bts.sparse_variant_flags("sparse_topk80", REST, "0,4,4", entry)
    with pytest.raises(SystemExit, match="one --frames"):
        bts.sparse_variant_flags("sparse_topk80", [*REST, "--frames", "4,8"], "4,4,4", entry)


def test_sparse_flops_per_token():
    cfg = preset("wan-1.3b", 4)
    s = 32768
    dense = cfg.flops_per_token(s, cfg.text_len)
    assert bts.sparse_flops_per_token(cfg, s, cfg.text_len, 0.0, 512, topk=False) == dense
    self_attn = 3 * 4 * s * cfg.dim * cfg.layers
    assert bts.sparse_flops_per_token(cfg, s, cfg.text_len, 0.9, 512, topk=False) == pytest.approx(
        dense - 0.9 * self_attn)
    assert bts.sparse_flops_per_token(cfg, s, cfg.text_len, 0.9, 512, topk=True) > \
        bts.sparse_flops_per_token(cfg, s, cfg.text_len, 0.9, 512, topk=False)


def test_topk_mask_keeps_k_tiles_and_prefers_near_ones():
    grid, tile = (16, 32, 32), (4, 4, 4)
    bm = bbs.topk_mask(3, grid, tile, 0.9, seed=0)
    coords = bbs.tile_coords(grid, tile).double()
    n = coords.shape[0]
    assert bm.shape == (3, n, n) and (bm.sum(-1) == round(0.1 * n)).all()
    assert not torch.equal(bm[0], bm[1])                       # per head
    dist = torch.cdist(coords, coords)
    near_topk = float((dist[None] * bm).sum() / bm.sum())
    rnd = bbs.random_topk_mask(3, n, 0.9, seed=0)
    near_random = float((dist[None] * rnd).sum() / rnd.sum())
    assert near_topk < 0.8 * near_random, (near_topk, near_random)   # local, as VSA's picks are


def test_budget_then_resume_completes_the_table(tmp_path):
    argv = ["--smoke", "--block-size", "64,128", "--sparsities", "0.5", "--ulysses-p", "1", "--ring-p", "4",
            "--out", str(tmp_path)]
    cut = bbs.main([*argv, "--masks", "random,topk,window", "--budget-s", "0"])
    assert cut["left"] and not cut["rows"]                     # past the budget no row starts; all are listed
    part = bbs.main([*argv, "--masks", "random", "--resume"])  # a part of the table ...
    full = bbs.main([*argv, "--masks", "random,topk,window", "--resume"])   # ... and the rest, keeping it
    keys = [bbs.row_key(r) for r in full["rows"]]
    assert not full["left"] and len(keys) == len(set(keys))
    assert keys[:len(part["rows"])] == [bbs.row_key(r) for r in part["rows"]]
    assert full["rows"][0]["utc"] == part["rows"][0]["utc"]   # kept, not rerun
    assert sorted(map(list, keys)) == sorted(cut["left"])      # what the budget left is what the table holds
    kinds = {(r["kind"], r.get("mask"), r.get("block_size")) for r in full["rows"]}
    for mask in ("random", "topk", "window"):
        for bs in (64, 128):
            assert ("ulysses", mask, bs) in kinds and ("ring", mask, bs) in kinds
    assert len(full["runs"]) == 3
    again = bbs.main([*argv, "--masks", "random,topk,window", "--resume"])   # nothing left: the same rows
    assert [bbs.row_key(r) for r in again["rows"]] == keys


def test_tile_per_block_size_is_checked():
    args = bbs.parse(["--block-size", "64,128", "--tile", "4,4,4/4,4,8"])
    assert bbs.tile_for(128, args) == (4, 4, 8)
    with pytest.raises(SystemExit, match="one per block size"):
        bbs.tile_for(64, bbs.parse(["--block-size", "64,128", "--tile", "4,4,4"]))
    with pytest.raises(SystemExit, match="holds 32 tokens"):
        bbs.tile_for(64, bbs.parse(["--block-size", "64", "--tile", "2,4,4"]))


def test_math_rows_too_big_are_recorded_without_building_masks(tmp_path, monkeypatch):
    def no_masks(*a, **k):
        raise AssertionError("masks built for rows that are all skipped")
    monkeypatch.setattr(bbs, "masks_for", no_masks)
    doc = bbs.main(["--smoke", "--masks", "random,topk,window", "--ulysses-kernels", "math", "--ring-p", "",
                    "--math-max-scores", "1", "--out", str(tmp_path)])
    sparse = [r for r in doc["rows"] if r["kind"] == "ulysses"]
    assert len(sparse) == 3 * 3 * 2 and all("h*S^2 > --math-max-scores" in r["skipped"] for r in sparse)


def test_table_mode_on_the_cpu(tmp_path):
    """--table's grid of rows (smoke sizes): both tile sizes, three masks, four sparsities, no ring rows."""
    doc = bbs.main(["--table", "--smoke", "--out", str(tmp_path)])
    sparse = {(r["mask"], r["block_size"], r["target_sparsity"]) for r in doc["rows"] if r["kind"] == "ulysses"}
    assert sparse == set(itertools.product(("random", "topk", "window"), (64, 128), (0.5, 0.8, 0.9, 0.95)))
    assert not [r for r in doc["rows"] if r["kind"] == "ring"] and not doc["left"]
    assert doc["meta"]["long_ms"] == 400.0 and doc["meta"]["block_sizes"] == [64, 128]


def test_table_parts_merge_into_one_table(tmp_path):
    """Parts of a table run as separate jobs (one per GPU) join into one JSON: every row once, the dense rows both
    jobs timed kept once with the second timing as a cross-check, and the Ulysses rows' ratio to dense FA4."""
    argv = ["--smoke", "--block-size", "64", "--sparsities", "0.5", "--ulysses-p", "1", "--ring-p", ""]
    a = bbs.main([*argv, "--masks", "random", "--out", str(tmp_path / "a")])
    b = bbs.main([*argv, "--masks", "window", "--out", str(tmp_path / "b")])
    assert all(r["gpu"] == "cpu" for r in a["rows"] + b["rows"]) and a["meta"]["gpu"] == "cpu"
    # the second job as if on another GPU: its dense row is then a cross-check of the first's
    path_b = tmp_path / "b" / "bench_block_sparse.json"
    doc_b = json.load(open(path_b))
    for r in doc_b["rows"]:
        r["gpu"] = "other #1"
    path_b.write_text(json.dumps(doc_b))
    merged = bbs.main(["--out", str(tmp_path / "t"), "--merge", str(tmp_path / "a"), str(tmp_path / "b")])
    keys = [bbs.row_key(r) for r in merged["rows"]]
    assert len(keys) == len(set(keys))
    assert {r.get("mask") for r in merged["rows"] if r["kind"] == "ulysses"} == {"random", "window"}
    dense_a = [r for r in a["rows"] if r["kind"] == "dense"]
    assert len(merged["cross_checks"]) == len(dense_a) >= 1
    cc = merged["cross_checks"][0]
    assert cc["kept"][0] == "cpu" and cc["other"][0] == "other #1" and cc["ratio"] > 0
    assert len(merged["runs"]) == 2 and not merged["left"]
    assert json.load(open(tmp_path / "t" / "bench_block_sparse.json"))["rows"] == merged["rows"]


def test_dense_fa4_ratio_prefers_the_same_gpu():
    rows = [{"kind": "dense", "layout": "ulysses", "kernel": "fa4", "s": 8, "h": 2, "p": 1, "fwd_bwd_tflops": 500.0,
             "gpu": "g #0"},
            {"kind": "dense", "layout": "ulysses", "kernel": "fa4", "s": 8, "h": 2, "p": 1, "fwd_bwd_tflops": 400.0,
             "gpu": "g #1"},
            {"kind": "ulysses", "kernel": "fa4", "s": 8, "h": 2, "p": 1, "fwd_bwd_tflops": 320.0, "gpu": "g #1"},
            {"kind": "ulysses", "kernel": "flex", "s": 8, "h": 2, "p": 1, "fwd_bwd_tflops": 100.0, "gpu": "g #2"},
            {"kind": "ulysses", "kernel": "flex", "s": 16, "h": 2, "p": 1, "fwd_bwd_tflops": 100.0, "gpu": "g #2"}]
    assert bbs.dense_fa4_ratio(rows[2], rows) == 0.8        # its own GPU's dense FA4
    assert bbs.dense_fa4_ratio(rows[3], rows) in (0.2, 0.25)  # no dense FA4 on its GPU: another's
    assert bbs.dense_fa4_ratio(rows[4], rows) is None       # no dense FA4 of its size
    assert bbs.dense_fa4_ratio(rows[0], rows) is None
    assert "| 320.000 | 0.800 |" in bbs.table(rows)


def test_resume_on_another_gpu_retimes_only_the_dense_floors(tmp_path):
    """--resume --retime-dense on another GPU: the dense rows are timed again there (the old ones kept, the ratios of
    new rows then use this GPU's), the block-sparse rows already in the JSON are not rerun."""
    argv = ["--smoke", "--block-size", "64", "--sparsities", "0.5", "--masks", "random", "--ulysses-p", "1",
            "--ring-p", "", "--out", str(tmp_path)]
    first = bbs.main(argv)
    path = tmp_path / "bench_block_sparse.json"
    doc = json.load(open(path))
    for r in doc["rows"]:
        r["gpu"] = "other #0 1234abcd"
    path.write_text(json.dumps(doc))
    same = bbs.main([*argv, "--resume"])                      # without the flag nothing is rerun
    assert [bbs.row_key(r) for r in same["rows"]] == [bbs.row_key(r) for r in first["rows"]]
    again = bbs.main([*argv, "--resume", "--retime-dense"])
    dense = [r for r in again["rows"] if r["kind"] == "dense"]
    assert sorted(r["gpu"] for r in dense) == ["cpu", "other #0 1234abcd"]
    sparse = [r for r in again["rows"] if r["kind"] != "dense"]
    assert len(sparse) == len([r for r in first["rows"] if r["kind"] != "dense"])
    assert all(r["gpu"] == "other #0 1234abcd" for r in sparse)   # kept, not rerun
    third = bbs.main([*argv, "--resume", "--retime-dense"])   # on the same GPU again: nothing new
    assert len(third["rows"]) == len(again["rows"])


def test_table_rows_of_cudnn_block_sparse_beside_the_others_on_the_cpu(tmp_path, monkeypatch):
    """#69's table on the CPU stand-in of cuDNN's block sparsity (tests/fake_cudnn_block_sparse.py): --table
    --table-kernels cudnn_block_sparse,math at #69's sparsities times it at 64- and 128-token tiles, every mask, with
    its metadata's build time; a kernel that does not run here is named with its reason, an unknown one refused."""
    from tests import fake_cudnn_block_sparse as fake_bsa
    fake = fake_bsa.install(monkeypatch)
    doc = bbs.main(["--table", "--smoke", "--table-kernels", "cudnn_block_sparse,math,fa4", "--table-sparsities",
                    "0.8,0.9,0.95", "--out", str(tmp_path)])
    rows = [r for r in doc["rows"] if r["kind"] == "ulysses" and r["kernel"] == "cudnn_block_sparse"]
    assert {(r["mask"], r["block_size"], r["target_sparsity"]) for r in rows} == \
        set(itertools.product(("random", "topk", "window"), (64, 128), (0.8, 0.9, 0.95)))
    assert all(r["fwd_bwd_ms"] > 0 and r["mask_build_ms"] >= 0 and r["fwd_bwd_tflops"] > 0 for r in rows)
    assert {c[1] for c in fake.calls} == {64, 128}
    assert doc["meta"]["ulysses_kernels"] == ["cudnn_block_sparse", "math"]
    assert "not installed" in doc["meta"]["ulysses_kernels_not_here"]["fa4"]
    assert "| ulysses | cudnn_block_sparse | random |" in doc["table"]
    with pytest.raises(SystemExit, match="unknown cudnn "):   # a dense kernel: no block sparsity
        bbs.main(["--table", "--smoke", "--table-kernels", "cudnn", "--out", str(tmp_path / "x")])
