"""tools/bench_diffusers_wan.py in its CPU dry mode (tiny Wan, gloo, 2 ranks, 2 steps): our variants time and report
their rows (machine, date, commit, command), diffusers' own context parallelism is skipped with its stated reason,
variant names are checked, and --curves writes its JSON and plot."""
import json
import os

import pytest

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")

import torch  # noqa: E402
import torch.distributed.checkpoint.state_dict  # noqa: E402,F401  (imported before the harness forks)
from diffusers import WanTransformer3DModel  # noqa: E402,F401
import megatron_sp_ext.diffusers  # noqa: E402,F401
import megatron_sp_ext.diffusers.sparse  # noqa: E402,F401
from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tools import bench_diffusers_wan as bench  # noqa: E402


def _bench(rank, world, argv):
    return bench.main(list(argv))


def test_dry_run_rows(tmp_path):
    out = str(tmp_path / "bench.json")
    run_ranks(_bench, 2, ["--dry-run", "--variants", "diffusers-ulysses,ours-auto,ours-ring,ours-ulysses-topk90,"
                          "ours-auto@rope=eager", "--profile-steps", "1", "--out", out], timeout=120)
    with open(out) as f:
        doc = json.load(f)
    rows = {r["variant"]: r for r in doc["rows"]}
    assert doc["meta"]["tokens"] == 64 and doc["meta"]["world"] == 2
    assert "accelerator" in rows["diffusers-ulysses"]["skipped"]
    assert rows["ours-ulysses-topk90"]["sparse"]["topk"] == 2   # 10% of the 16 tiles of 1x2x2 on the 4x4x4 grid
    for name in ("ours-auto", "ours-ring", "ours-ulysses-topk90", "ours-auto@rope=eager"):
        r = rows[name]
        assert "skipped" not in r, r
        assert r["profile"] == {"skipped": "--profile-steps needs CUDA"}
        assert r["step_ms"] > 0 and len(r["step_ms_all"]) == 2 and r["first_loss"] > 0 and r["mfu"] is None
    for r in rows.values():
        assert r["machine"] and r["date"] and "command" in r and "commit" in r


def _checkpointing_seen(rank, world, argv):
    """The bench's rows, and whether each variant's model had diffusers' gradient checkpointing on."""
    seen = []
    real = bench.Setup.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        seen.append(bool(self.model.gradient_checkpointing))
    bench.Setup.__init__ = spy
    try:
        return bench.main(list(argv)), seen
    finally:
        bench.Setup.__init__ = real


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_recompute_setting_reaches_every_variant(tmp_path, recompute):
    """--recompute none turns diffusers' gradient checkpointing off for every variant (full, the default, on),
    recorded in the meta; the rows still train."""
    out = str(tmp_path / "bench.json")
    args = ["--dry-run", "--variants", "ours-auto,ours-ring", "--out", out]
    doc, seen = run_ranks(_checkpointing_seen, 2, args + ([] if recompute == "full" else ["--recompute", "none"]),
                          timeout=120)[0]
    assert doc["meta"]["recompute"] == recompute
    assert seen and all(s == (recompute == "full") for s in seen), seen
    assert all(r["step_ms"] > 0 and r["first_loss"] > 0 and r["recompute"] == recompute for r in doc["rows"])


def test_curves_dry(tmp_path):
    out = str(tmp_path / "c.json")
    run_ranks(_bench, 2, ["--dry-run", "--curves", "2", "--out", out], timeout=120)
    with open(str(tmp_path / "c_curves.json")) as f:
        doc = json.load(f)
    assert len(doc["curves"]["ours-auto"]["losses"]) == 2
    assert "accelerator" in doc["curves"]["diffusers-ulysses"]["skipped"]
    assert os.path.isfile(str(tmp_path / "c_curves.png"))


@pytest.mark.parametrize("name", ["diffusers-hcms", "ours-bogus", "ours-auto-window=1.2", "theirs-auto",
                                  "diffusers-ring@sage", "ours-auto@rope=triton", "ours-auto@eager"])
def test_bad_variant_names(name):
    with pytest.raises(SPConfigError, match="--variants"):
        bench.parse_variant(name)


def test_variant_grammar_and_sparse_settings():
    v = bench.parse_variant("ours-auto-topk90")
    s = bench.sparse_settings(v["sparse"], (21, 30, 52), (4, 4, 8))
    assert s["topk"] == max(1, round(0.1 * s["n_tiles"])) and abs(s["sparsity"] - 0.9) < 0.01
    w = bench.sparse_settings(bench.parse_variant("ours-hcms-window90")["sparse"], (21, 30, 52), (4, 4, 8))
    assert abs(w["sparsity"] - 0.9) < 0.03 and len(w["window"]) == 3
    assert bench.parse_variant("diffusers-ring@native")["backend"] == "native"
    assert bench.parse_variant("ours-auto")["rope"] == "fused"
    assert bench.parse_variant("ours-hcms-window90@rope=eager")["rope"] == "eager"
    assert bench.parse_variant("ours-hcms-window90@rope=eager")["sparse"] == {"kind": "window", "target": 0.9}


def test_bad_variant_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--dry-run", "--variants", "ours-auto,ours-bogus"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--variants 'ours-bogus'" in err[-1], err


def test_diffusers_probe_step_does_not_train_the_timed_model(monkeypatch):
    """diffusers' backend is probed with one training step; the variant then timed starts again from the seed (its
    first_loss reads beside ours from the same weights)."""
    made = []

    class FakeSetup:
        def __init__(self, args, variant, world, device, grid, backend):
            self.backend, self.steps, self.closed = backend, 0, False
            made.append(self)

        def step(self, batch):
            self.steps += 1

        def close(self):
            self.closed = True

    monkeypatch.setattr(bench, "Setup", FakeSetup)
    monkeypatch.setattr(bench, "_all_ok", lambda ok, device: ok)
    args = type("A", (), {"dry_run": False})()
    setup, tried = bench.build(args, {"impl": "diffusers", "backend": "flash"}, 1, "cpu", (1, 2, 2), {"x": 0})
    assert tried == [] and len(made) == 2 and made[0].steps == 1 and made[0].closed
    assert setup is made[1] and setup.steps == 0 and not setup.closed and setup.backend == "flash"


def test_ranks_share_gpu_rows_say_times_are_not_speed(tmp_path):
    """--ranks-share-gpu (P ranks on one GPU over gloo): the rows keep their peaks' fields but carry the timing note
    and no MFU; the meta records the setting."""
    out = str(tmp_path / "bench.json")
    run_ranks(_bench, 2, ["--dry-run", "--variants", "ours-auto", "--ranks-share-gpu", "--out", out], timeout=120)
    with open(out) as f:
        doc = json.load(f)
    assert doc["meta"]["ranks_share_gpu"] is True and ": 2 ranks on 1 x CPU" in doc["meta"]["machine"]
    (row,) = doc["rows"]
    theirs, ours = bench.parse_variant("diffusers-ulysses"), bench.parse_variant("ours-auto")
    assert bench.skip_reason(theirs, True, True) == bench.SHARED_GPU_DIFFUSERS   # refused by name, not a crash
    assert bench.skip_reason(theirs, True, False) is None and bench.skip_reason(ours, True, True) is None
    assert bench.skip_reason(theirs, False, False) == bench.NO_ACCELERATOR
    assert row["mfu"] is None and "not the method's speed" in row["timing_note"] and row["first_loss"] > 0


def test_init_world_share_gpu_puts_every_rank_on_gpu0_over_gloo(monkeypatch):
    """benchlib.init_world(share_gpu=True) on a CUDA machine: GPU 0 whatever LOCAL_RANK says, gloo, no device_id
    (NCCL's eager init is not asked of gloo); without it: GPU LOCAL_RANK over NCCL with device_id."""
    from tools import benchlib
    calls = {}
    monkeypatch.setattr(benchlib.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(benchlib.torch.cuda, "set_device", lambda d: calls.setdefault("set", []).append(str(d)))
    monkeypatch.setattr(benchlib.dist, "init_process_group", lambda b, **kw: calls.setdefault("init", []).append(
        (b, sorted(kw))))
    monkeypatch.setattr(benchlib.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(benchlib.dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert benchlib.init_world(share_gpu=True)[2] == torch.device("cuda", 0)
    assert benchlib.init_world()[2] == torch.device("cuda", 1)
    assert calls["set"] == ["cuda:0", "cuda:1"]
    assert calls["init"] == [("gloo", ["timeout"]), ("nccl", ["device_id", "timeout"])]
    with pytest.raises(ValueError, match="share_gpu runs gloo"):
        benchlib.init_world("nccl", share_gpu=True)


def test_variant_options_stock_lora_recompute():
    v = bench.parse_variant("ours-auto-topk90@recompute=keep@lora=8")
    assert (v["impl"], v["sparse"], v["recompute"], v["lora"], v["rope"]) == ("ours", {"kind": "topk", "target": 0.9},
                                                                             "keep", 8, "fused")
    assert bench.parse_variant("ours-auto@recompute=keep20")["recompute"] == "keep20"
    s = bench.parse_variant("stock@lora=32@recompute=none")
    assert (s["impl"], s["lora"], s["recompute"]) == ("stock", 32, "none")
    assert bench.skip_reason(bench.parse_variant("stock"), True, False, 2) == bench.STOCK_ONE_RANK
    for bad in ("stock@recompute=keep", "ours-auto@lora=0", "ours-auto@recompute=keepx", "ours-auto@lora=4@lora=4",
                "stock@rope=eager"):
        with pytest.raises(SPConfigError, match="--variants"):
            bench.parse_variant(bad)


def test_fused_variants_dry(tmp_path):
    """@fused=on on stock and ours (one rank, CPU stand-in: "aot_eager"): their rows say so and start from the loss of
    the same variant without it (the same seed and batch; the compiled blocks compute the same math)."""
    out = str(tmp_path / "fused.json")
    names = ["stock", "stock@fused=on", "ours-auto-topk90@recompute=keep", "ours-auto-topk90@recompute=keep@fused=on"]
    run_ranks(_bench, 1, ["--dry-run", "--variants", ",".join(names), "--warmup", "1", "--out", out], timeout=240)
    with open(out) as f:
        rows = {r["variant"]: r for r in json.load(f)["rows"]}
    for eager, fused in ((names[0], names[1]), (names[2], names[3])):
        assert "fused_backend" not in rows[eager] and rows[fused]["fused_backend"] == "aot_eager", rows[fused]
        assert len(rows[fused]["warmup_ms"]) == 1 and len(rows[fused]["step_ms_all"]) == 2
        assert abs(rows[fused]["first_loss"] - rows[eager]["first_loss"]) <= 1e-5 * rows[eager]["first_loss"]
        assert abs(rows[fused]["last_loss"] - rows[eager]["last_loss"]) <= 1e-4 * rows[eager]["last_loss"]
    assert bench.parse_variant("ours-auto@fused=on@recompute=keep")["fused"] is True
    assert bench.parse_variant("stock@fused=off")["fused"] is False and bench.parse_variant("stock")["fused"] is False
    for bad in ("stock@fused=yes", "ours-auto@fused"):
        with pytest.raises(SPConfigError, match="--variants"):
            bench.parse_variant(bad)


def _targets(rank, world, argv):
    """The rows, and per Setup built: (variant, gradient checkpointing, kept-attention processors, trainable
    parameters are all LoRA's)."""
    seen = []
    real = bench.Setup.__init__

    def spy(self, args, variant, *a, **kw):
        real(self, args, variant, *a, **kw)
        kept = [p.kept is not None for p in self.handle.processors] if self.handle is not None else []
        trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        seen.append((variant["name"], bool(self.model.gradient_checkpointing), kept,
                     bool(trainable) and all("lora_" in n for n in trainable)))
    bench.Setup.__init__ = spy
    try:
        return bench.main(list(argv)), seen
    finally:
        bench.Setup.__init__ = real


def test_targets_dry_run(tmp_path):
    """--targets --dry-run: every case's variants on the tiny model in one job (stock first, as diffusers builds it;
    ours with full checkpointing, the attention kept in all / the first N blocks, top-k tiles; LoRA variants train
    the adapters alone), each target's speed-up over the case's stock step, one JSON; stock and ours start from the
    same weights (the same first loss)."""
    out = str(tmp_path / "t.json")
    doc, seen = run_ranks(_targets, 1, ["--targets", "--dry-run", "--out", out], timeout=300)[0]
    with open(out) as f:
        assert json.load(f)["targets"] == doc["targets"]
    assert set(doc["cases"]) == set(bench.TARGET_CASES) and len(doc["targets"]) == 4
    for t in doc["targets"]:
        assert t["stock_ms"] > 0 and t["best_ms"] > 0 and abs(t["speedup"] - t["stock_ms"] / t["best_ms"]) < 1e-9
        assert t["met"] == (t["speedup"] >= t["least"])
    by = {name: (ckpt, kept, lora) for name, ckpt, kept, lora in seen}
    assert by["stock"] == (True, [], False) and by["ours-auto"] == (True, [False, False], False)
    assert by["ours-auto@recompute=keep"] == (True, [True, True], False)
    assert by["stock@lora=32"] == (True, [], True) and by["ours-auto@lora=32@recompute=keep12"][1:] == ([True, True],
                                                                                                        True)
    for case in doc["cases"].values():
        rows = case["rows"]
        assert all("skipped" not in r and r["step_ms"] > 0 for r in rows), rows
        dense = [r["first_loss"] for r in rows if not r["sparse"]]
        assert max(dense) - min(dense) <= 1e-6 * abs(dense[0]), dense
    for name in bench.TARGET_CASES:   # each case's rows in a file of its own, written as they came
        with open(str(tmp_path / f"t_{name}.json")) as f:
            assert [r["variant"] for r in json.load(f)["rows"]] == [r["variant"] for r in doc["cases"][name]["rows"]]
    lora_rows = doc["cases"]["wan-14b-lora-480p"]["rows"]
    assert all(r["lora_rank"] == 32 for r in lora_rows) and lora_rows[2]["recompute"] == "keep"


def test_out_of_memory_is_a_row_in_one_rank_jobs(monkeypatch):
    """A variant that runs out of GPU memory in a one-rank job is recorded as such (the next one still runs); with
    more ranks the error ends the job (the others may wait in a collective)."""
    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
    monkeypatch.setattr(bench, "_time_variant", oom)
    row = bench.time_variant(None, bench.parse_variant("ours-auto@recompute=keep"), 1, "cpu", (1, 2, 2), {})
    assert row["skipped"].startswith("out of GPU memory") and "3.00 GiB" in row["skipped"]
    with pytest.raises(torch.OutOfMemoryError):
        bench.time_variant(None, bench.parse_variant("ours-auto"), 2, "cpu", (1, 2, 2), {})


def _oom_in_step(rank, world, argv):
    """bench.main with the fused variant's steps running out of memory; (doc, per close: (fused, layers removed,
    model freed))."""
    closed = []
    real_step, real_close = bench.Setup.step, bench.Setup.close

    def step(self, batch):
        if self.fused is not None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.95 GiB")
        return real_step(self, batch)

    def close(self):
        real_close(self)
        fused = self.fused is not None
        closed.append((fused, fused and self.fused.removed, not hasattr(self, "model")))
    bench.Setup.step, bench.Setup.close = step, close
    try:
        return bench.main(list(argv)), closed
    finally:
        bench.Setup.step, bench.Setup.close = real_step, real_close


def test_out_of_memory_mid_step_closes_the_variant(tmp_path):
    """A variant that runs out of memory inside a step is closed before the next is built (its compiled layers and
    hooks removed, its model freed: on the GPU a leaked 14B model made the next variant run out too), and the next
    variant runs."""
    out = str(tmp_path / "oom.json")
    doc, closed = run_ranks(_oom_in_step, 1, ["--dry-run", "--variants", "ours-auto@fused=on,ours-auto",
                                              "--warmup", "1", "--steps", "1", "--out", out], timeout=240)[0]
    rows = {r["variant"]: r for r in doc["rows"]}
    assert rows["ours-auto@fused=on"]["skipped"].startswith("out of GPU memory"), rows
    assert rows["ours-auto"]["step_ms"] > 0 and "skipped" not in rows["ours-auto"]
    assert closed[0] == (True, True, True) and closed[-1] == (False, False, True), closed
