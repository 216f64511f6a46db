"""training/video_dit/memory_plan.py: the activation constant fitted on the "fit" peaks only, the plan within 10% of
every "validate" peak it never saw (issue #52's full-recompute peaks among them), --validate failing when one is off,
and its parts add up."""
import json

import pytest

from training.video_dit import memory_plan as mp


def test_plan_within_tolerance_of_validation_peaks():
    rows = mp.validate()
    val = [r for r in rows if r["role"] == "validate"]
    assert len(val) >= 3 and len([r for r in rows if r["role"] == "fit"]) == 5
    for r in val:
        assert abs(r["error"]) <= mp.MAX_VALIDATION_ERROR, r


def test_full_recompute_issue_points():
    """#52's 1 x H100 peaks (plan was 47.6 / 65.9 / 41.1 GiB: +11.5%, +12.7%, +8.0%): the block input kept per
    layer is the bf16 residual stream and the autocast copies of one recomputed block, not fp32 and all blocks."""
    for layers, tokens, peak in ((4, 32760, 42.7), (6, 32760, 58.5), (2, 75600, 38.1)):
        p = mp.plan("wan-14b", tokens, 1, 1, "none", "full", layers, modulation="linear")  # the model of then
        assert abs(p.total_gib / peak - 1) <= 0.05, (layers, tokens, p.total_gib, peak)


def _write(tmp_path, points):
    path = tmp_path / "peaks.json"
    path.write_text(json.dumps({"points": points}))
    return str(path)


def test_fit_uses_only_fit_points(tmp_path):
    pts = mp.load_points()
    c = mp.fit_act_bytes(pts)
    moved = [{**p, "peak_gib": p["peak_gib"] * (3.0 if p["role"] == "validate" else 1.0)} for p in pts]
    assert mp.fit_act_bytes(moved) == c  # validation points never move the constant
    fit_moved = [{**p, "peak_gib": p["peak_gib"] * (1.1 if p["role"] == "fit" else 1.0)} for p in pts]
    assert mp.fit_act_bytes(fit_moved) > c
    with pytest.raises(ValueError, match="fit"):
        mp.fit_act_bytes([p for p in pts if p["role"] == "validate"])


def test_validate_exit_code(tmp_path, capsys):
    pts = mp.load_points()
    assert mp.main(["--validate", "--peaks", _write(tmp_path, pts)]) == 0
    off = pts + [{**pts[-1], "layers": 3, "peak_gib": pts[-1]["peak_gib"] * 2, "role": "validate"}]
    assert mp.main(["--validate", "--peaks", _write(tmp_path, off)]) == 1
    assert "FAIL" in capsys.readouterr().err


def test_merge_adds_validation_points(tmp_path):
    path = _write(tmp_path, mp.load_points())
    gpu = tmp_path / "gpu.json"
    new = {"model": "wan-14b", "modulation": "wan", "layers": 3, "tokens": 32760, "sp": 1, "gpus": 1, "sharding": "fsdp",
           "recompute": "full", "peak_gib": 40.0, "device": "1 x H100"}
    gpu.write_text(json.dumps({"points": [new, {**new, "layers": 16, "peak_gib": None}]}))
    assert mp.merge(str(gpu), path) == 1
    assert mp.merge(str(gpu), path) == 1  # again: replaced, not duplicated
    pts = mp.load_points(path)
    added = [p for p in pts if p["sharding"] == "fsdp" and p["layers"] == 3]
    assert len(added) == 1 and added[0]["role"] == "validate" and len(pts) == len(mp.load_points()) + 1


def test_merge_refuses_points_without_modulation(tmp_path, capsys):
    """A measured-peaks file written before --modulation existed: one message naming the key, nothing merged."""
    path = _write(tmp_path, mp.load_points())
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"points": [{"model": "wan-14b", "layers": 3, "tokens": 32760, "sp": 1, "gpus": 1,
                                           "sharding": "fsdp", "recompute": "full", "peak_gib": 40.0}]}))
    with pytest.raises(SystemExit):
        mp.main(["--merge", str(old), "--peaks", path])
    err = capsys.readouterr().err
    assert "without the model's modulation" in err and '"modulation": "linear"' in err, err
    assert len(mp.load_points(path)) == len(mp.load_points())


@pytest.mark.parametrize("sharding", mp.SHARDINGS)
@pytest.mark.parametrize("recompute", mp.RECOMPUTES)
def test_parts_add_up(sharding, recompute):
    p = mp.plan("wan-14b", 75600, 8, 8, sharding, recompute)
    parts = (p.parameters_gib + p.gradients_gib + p.optimizer_gib + p.autocast_copies_gib + p.unsharded_blocks_gib
             + p.activations_gib + p.exchange_gib + p.workspace_gib + p.optimizer_temp_gib)
    assert p.total_gib == pytest.approx(parts, rel=1e-12)
    assert p.fits == (p.total_gib <= p.gpu_gib)


def test_sharding_and_recompute_only_lower_memory():
    full = mp.plan("wan-14b", 75600, 8, 8, "none", "none")
    fsdp = mp.plan("wan-14b", 75600, 8, 8, "fsdp", "full")
    assert fsdp.parameters_gib == pytest.approx(full.parameters_gib / 8)
    assert fsdp.activations_gib < full.activations_gib and fsdp.total_gib < full.total_gib


def test_bad_input_names_the_flag():
    with pytest.raises(ValueError, match="--sharding"):
        mp.plan("wan-14b", 1000, 1, 1, "zero2")
    with pytest.raises(ValueError, match="--gpus"):
        mp.plan("wan-14b", 1000, 3, 8)


def test_measure_peaks_configs_parse_and_grids(monkeypatch):
    """tools/measure_peaks.py's entry flags are the entry's own and give 32,760 / 75,600 tokens; the 16-layer runs
    are planned not to fit one 80 GB GPU (recorded as skipped there)."""
    pytest.importorskip("megatron.core")
    from tools import measure_peaks as mpk
    from tools.bench_train_step import token_grid
    from training import pretrain_video_dit as entry
    for world in (1, 2, 4):
        monkeypatch.setenv("WORLD_SIZE", str(world))   # the entry checks --context-parallel-size against it
        for sharding, recompute, layers, tokens in mpk.configs_for(world):
            args = entry.parse(mpk.entry_argv(sharding, recompute, layers, tokens, "/tmp/x", world))
            g = token_grid(args)
            assert g[0] * g[1] * g[2] == tokens and args.num_layers == layers
            assert args.use_torch_fsdp2 == (sharding == "fsdp") and args.context_parallel_size == world
            rc, offload = mpk.split_recompute(recompute)
            assert (args.recompute_granularity or "none") == rc and args.cpu_offloading == offload
            assert rc != "selective" or args.recompute_modules == ["outside_core_attn"]
            planned = mp.plan("wan-14b", tokens, world, world, sharding, rc, layers, offload=offload).total_gib
            if layers == 16:
                assert planned > 80
            if world == 4:  # every 4-rank configuration fits an H100 by the plan
                assert planned < 78, (sharding, recompute, layers, tokens, planned)


def test_two_rank_fsdp2_point_within_tolerance():
    """#67: FSDP2 at 2 ranks (CP=2, wan-14b 4 blocks, 32,760 tokens, full recompute) peaked at 23.0 GiB against
    a plan of 28.2 (+23%): gradient shards exist only for the blocks whose backward is done, one block is
    unsharded at 4 B/param (not two at 6), and foreach AdamW's temporary makes the optimizer step a phase of its
    own. Both phases are reported; the 1- and 2-rank FSDP2 full-recompute validation points stay within 5% (every
    point, 4 ranks and selective recompute included, within --validate's 10%: the 4-rank FSDP2 full-recompute
    point at 32,760 tokens is -5.3%; test_every_validation_point_within_ten_percent)."""
    p2 = mp.plan("wan-14b", 32760, 2, 2, "fsdp", "full", 4, modulation="linear")  # measured on the model of then
    assert abs(p2.total_gib / 23.0 - 1) <= 0.05 and p2.peak_phase == "backward of block 0", p2
    six = mp.plan("wan-14b", 32760, 1, 1, "fsdp", "full", 6, modulation="linear")   # 59.3 GiB: the optimizer step
    assert six.peak_phase == "optimizer step" and six.optimizer_temp_gib == pytest.approx(six.parameters_gib)
    rows = [r for r in mp.validate() if r["role"] == "validate"]
    assert {r["gpus"] for r in rows} >= {1, 2}
    for r in rows:
        if r["sharding"] == "fsdp" and r["recompute"] == "full" and r["gpus"] <= 2:
            assert abs(r["error"]) <= 0.05, r


def test_validate_requires_rank_counts(tmp_path, capsys):
    """--require-ranks 1,2,4 fails (naming the rank count) while no 4-rank point is measured (the file's points of
    1 and 2 ranks); a 4-rank point at the plan passes; one 20% off fails, naming it."""
    pts = [pt for pt in mp.load_points() if pt["gpus"] <= 2]
    path = _write(tmp_path, pts)
    assert mp.main(["--validate", "--peaks", path, "--require-ranks", "1,2"]) == 0
    assert mp.main(["--validate", "--peaks", path, "--require-ranks", "1,2,4"]) == 1
    assert "no validate point at 4 ranks" in capsys.readouterr().err
    four = {"model": "wan-14b", "modulation": "wan", "layers": 4, "tokens": 75600, "sp": 4, "gpus": 4, "sharding": "fsdp",
            "recompute": "selective", "role": "validate", "device": "test"}
    at_plan = mp.plan("wan-14b", 75600, 4, 4, "fsdp", "selective", 4).total_gib
    assert mp.main(["--validate", "--peaks", _write(tmp_path, pts + [{**four, "peak_gib": at_plan}]),
                    "--require-ranks", "1,2,4"]) == 0
    assert mp.main(["--validate", "--peaks", _write(tmp_path, pts + [{**four, "peak_gib": at_plan / 1.2}])]) == 1
    assert "SP=4 GPUs=4 fsdp recompute=selective" in capsys.readouterr().err


def test_recompute_choices_order_and_offload():
    """Selective (the core's q, k, v, out kept) lies between full and none; offloading lowers it (and puts the
    core's tensors on the host); --offload with full is refused by name."""
    for sharding in ("none", "fsdp"):
        none, full, sel, off = (mp.plan("wan-14b", 75600, 2, 2, sharding, rc, 4, offload=o)
                                for rc, o in (("none", False), ("full", False), ("selective", False),
                                              ("selective", True)))
        assert full.total_gib < off.total_gib < sel.total_gib < none.total_gib, (full, off, sel, none)
        assert off.host_offload_gib > 0 and sel.host_offload_gib == 0
    d, local = 5120, 75600 / 2
    sel = mp.plan("wan-14b", 75600, 2, 2, "none", "selective", 4)
    assert sel.activations_per_layer_recompute_gib == pytest.approx((12 * d + 4 * 40) * local / mp.GIB)
    with pytest.raises(ValueError, match="--offload"):
        mp.plan("wan-14b", 75600, 2, 2, "none", "full", 4, offload=True)
    with pytest.raises(ValueError, match="--recompute"):
        mp.plan("wan-14b", 75600, 2, 2, "none", "core_attn", 4)


def test_every_validation_point_within_ten_percent():
    """#67: every measured validation point of memory_peaks.json (1, 2 and 4 ranks; FSDP2 and megatron DDP; full,
    selective, none; never fitted) within 10% of its plan, and points at each of 1, 2 and 4 ranks."""
    rows = [r for r in mp.validate() if r["role"] == "validate"]
    assert {r["gpus"] for r in rows} >= {1, 2, 4}
    assert {r["recompute"] for r in rows} >= {"full", "selective", "none"}
    bad = [r for r in rows if abs(r["error"]) > mp.MAX_VALIDATION_ERROR]
    assert not bad, bad


@pytest.mark.parametrize("sharding", ("none", "fsdp"))
@pytest.mark.parametrize("recompute,offload", (("full", False), ("selective", False), ("selective", True)))
def test_recompute_num_layers_between_none_and_all(sharding, recompute, offload):
    """--recompute-num-layers N: N = every block is the plan without it, N = 0 the plan without recompute (without
    offloading), and the total falls as N grows (with offloading the host's share falls: a block without recompute
    offloads all it keeps); parts add up; out of range or with no recompute refused."""
    base = ("wan-14b", 32760, 4, 4, sharding)
    every = mp.plan(*base, recompute, offload=offload)
    assert mp.plan(*base, recompute, offload=offload, recompute_layers=40).total_gib == every.total_gib
    if not offload:
        assert mp.plan(*base, recompute, recompute_layers=0).total_gib == \
            pytest.approx(mp.plan(*base, "none").total_gib)
    plans = [mp.plan(*base, recompute, offload=offload, recompute_layers=n) for n in range(0, 41, 5)]
    totals = [q.host_offload_gib if offload else q.total_gib for q in plans]
    assert all(a >= b for a, b in zip(totals, totals[1:])) and totals[0] > totals[-1], totals
    p = mp.plan(*base, recompute, offload=offload, recompute_layers=10)
    assert p.recompute_layers == 10
    parts = (p.parameters_gib + p.gradients_gib + p.optimizer_gib + p.autocast_copies_gib + p.unsharded_blocks_gib
             + p.activations_gib + p.exchange_gib + p.workspace_gib + p.optimizer_temp_gib)
    assert p.total_gib == pytest.approx(parts, rel=1e-12)
    if sharding == "none" and not offload:   # the end of the forward: every kept tensor and every block's copies
        assert p.peak_phase == "end of the forward" and p.autocast_copies_gib == pytest.approx(
            mp.plan(*base, "none").autocast_copies_gib)
    for bad, why in ((41, "has 40 layers"), (-1, "has 40 layers")):
        with pytest.raises(ValueError, match=why):
            mp.plan(*base, recompute, offload=offload, recompute_layers=bad)
    with pytest.raises(ValueError, match="needs a recompute choice"):
        mp.plan(*base, "none", recompute_layers=3)


def test_fewest_recomputed_layers(capsys):
    """The fewest first blocks to recompute whose plan fits the GPU less the 10% validated error: its plan fits,
    one block fewer does not; 'auto' on the command line prints the flag; a case that cannot fit is refused."""
    args = ("wan-14b", 75600, 4, 4, "fsdp", "selective")
    n = mp.fewest_recomputed_layers(*args)
    assert 0 < n < 40
    # the per-block Linear's model (before 2026-11-29) needs more; Wan's at 32,760 tokens fits without any
    assert mp.fewest_recomputed_layers(*args, modulation="linear") > n
    assert mp.fewest_recomputed_layers("wan-14b", 32760, 4, 4, "fsdp", "selective") == 0
    limit = mp.H200_USABLE_GIB * (1 - mp.MAX_VALIDATION_ERROR)
    assert mp.plan(*args, recompute_layers=n).total_gib <= limit < mp.plan(*args, recompute_layers=n - 1).total_gib
    assert mp.fewest_recomputed_layers("wan-14b", 300000, 1, 1, "none", "full") is None
    assert mp.main(["--model", "wan-14b", "--tokens", "75600", "--sp", "4", "--gpus", "4", "--sharding", "fsdp",
                    "--recompute", "selective", "--recompute-num-layers", "auto"]) == 0
    out = capsys.readouterr().out
    assert f"--recompute-num-layers {n}" in out and f"(first {n} of 40)" in out
    with pytest.raises(SystemExit):
        mp.main(["--tokens", "300000", "--sp", "1", "--gpus", "1", "--sharding", "none", "--recompute-num-layers",
                 "auto"])
    assert "does not fit" in capsys.readouterr().err
    for bad, why in ((["--recompute", "selective", "--offload", "--recompute-num-layers", "auto"], "with --offload"),
                     (["--table", "--recompute-num-layers", "3"], "with --table"),
                     (["--validate", "--recompute-num-layers", "3"], "with --validate"),
                     (["--recompute-num-layers", "x"], "a block count or auto")):
        with pytest.raises(SystemExit):
            mp.main(bad)
        assert why in capsys.readouterr().err, bad
