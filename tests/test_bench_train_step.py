"""tools/bench_train_step.py (#51 item 9, #52): a run whose entry and bare steps disagree by more than 2% is flagged
with the --train-iters it needs, the bare step's MFU beside the entry's, the FSDP2 variant and the plan beside the
peak. The logic on made-up timings (the issue's 1 x H100 numbers), and one CPU run of the tool itself."""
import json
import os
import socket
import subprocess
import sys

import pytest

from tools import bench_train_step as bts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timing(entry_ms, bare_ms, mfu=None):
    return {"entry_step_ms": entry_ms, "bare_step_ms": bare_ms, "entry_over_bare": entry_ms / bare_ms, "mfu": mfu}


def test_short_run_is_flagged_with_the_iterations_it_needs():
    # wan-14b 2 layers, --train-iters 10 at --log-interval 10: entry 3,925 ms vs bare 472 ms, mfu 6.5%
    a = bts.step_agreement(_timing(3925.0, 472.0, 0.065), train_iters=10, log_interval=10)
    assert not a["agrees"] and a["warmup_in_median"] and a["train_iters_needed"] == 20
    assert "--train-iters >= 20" in a["note"] and "mfu_bare" in a["note"]
    assert a["mfu_bare"] == pytest.approx(0.065 * 3925.0 / 472.0)  # 54%: the bare step's rate


def test_long_run_agrees():
    a = bts.step_agreement(_timing(472.4, 472.0, 0.54), train_iters=24, log_interval=10)
    assert a["agrees"] and a["note"] is None and not a["warmup_in_median"]
    assert a["mfu_bare"] == pytest.approx(0.54 * 472.4 / 472.0)


@pytest.mark.parametrize("ratio,agrees", [(1.0199, True), (0.9801, True), (1.021, False), (0.979, False)])
def test_two_percent_either_way(ratio, agrees):
    assert bts.step_agreement(_timing(100.0 * ratio, 100.0), 40, 10)["agrees"] is agrees


def test_overhead_past_warmup_is_named_as_such():
    a = bts.step_agreement(_timing(110.0, 100.0), train_iters=40, log_interval=10)
    assert not a["agrees"] and not a["warmup_in_median"] and "+10.0%" in a["note"]
    assert bts.step_agreement(_timing(110.0, 100.0), 40, 10)["mfu_bare"] is None  # no MFU on the CPU


def test_excess_between_steps_named_with_the_data_wait():
    # wan-1.3b 4 layers, window90, FA4, 1 x H100 (2026-11-26): entry 109.6 ms, fwd+bwd 94.5 + optimizer 5.4 ms
    t = dict(_timing(109.6, 99.4), model_fwd_bwd_ms=94.5, optimizer_ms=5.4, data_wait_ms=9.1, gc_ms=0.2)
    a = bts.step_agreement(t, train_iters=30, log_interval=10)
    assert a["between_steps_ms"] == pytest.approx(9.7) and a["data_wait_ms"] == 9.1 and a["gc_ms"] == 0.2
    assert "9.1 ms waiting for the data path" in a["note"] and "--num-workers" in a["note"]
    assert "0.2 ms per step in Python's garbage collector" in a["note"]
    a = bts.step_agreement(dict(t, data_wait_ms=0.3, gc_ms=6.8), train_iters=30, log_interval=10)
    assert "0.3 ms waiting" in a["note"] and "--num-workers" not in a["note"] and "6.8 ms per step" in a["note"]
    assert "--manual-gc moves" in a["note"] and "--manual-gc" not in bts.step_agreement(t, 30, 10)["note"]
    m = bts.step_agreement(dict(t, data_wait_ms=0.3, gc_ms=6.0, manual_gc=True), train_iters=30, log_interval=10)
    assert "--manual-gc-interval collections" in m["note"]   # the advice for a run that already has it on
    ok = bts.step_agreement(dict(t, entry_step_ms=100.2, entry_over_bare=100.2 / 99.4), 30, 10)
    assert ok["agrees"] and ok["note"] is None and ok["between_steps_ms"] == pytest.approx(0.3)


def test_plan_beside_peak_matches_memory_plan():
    pytest.importorskip("megatron.core")
    from training.video_dit import memory_plan as mp
    from training import pretrain_video_dit as entry
    rest = ["--model", "wan-14b", "--num-layers", "4", "--frames", "21", "--latent-size", "60x104", "--bf16",
            "--recompute-granularity", "full"]
    got = bts.plan_beside_peak(entry.parse(rest), ["--use-torch-fsdp2"], 1)
    assert got["plan_settings"] == {"model": "wan-14b", "modulation": "wan", "layers": 4, "tokens": 32760, "sp": 1,
                                    "gpus": 1, "sharding": "fsdp", "recompute": "full", "offload": False,
                                    "recompute_layers": 4}
    assert got["plan_gib"] == pytest.approx(mp.plan("wan-14b", 32760, 1, 1, "fsdp", "full", 4).total_gib)
    assert bts.plan_beside_peak(entry.parse(rest), [], 1)["plan_settings"]["sharding"] == "none"
    no_bf16 = bts.plan_beside_peak(entry.parse([a for a in rest if a != "--bf16"]), [], 1)
    assert no_bf16["plan_gib"] is None and "--bf16" in no_bf16["plan_skipped"]
    # the recompute variants (#67): selective outside_core_attn and its offload are planned, core_attn is not
    sel = bts.plan_beside_peak(entry.parse([*rest, *bts.VARIANTS["recompute_selective_offload"]]), [], 2)
    assert sel["plan_settings"]["recompute"] == "selective" and sel["plan_settings"]["offload"]
    assert sel["plan_gib"] == pytest.approx(mp.plan("wan-14b", 32760, 1, 2, "none", "selective", 4,
                                                    offload=True).total_gib)
    part = bts.plan_beside_peak(entry.parse([*rest, *bts.VARIANTS["recompute_selective"],
                                             "--recompute-num-layers", "1"]), ["--use-torch-fsdp2"], 1)
    assert part["plan_settings"]["recompute_layers"] == 1 and part["plan_gib"] == pytest.approx(
        mp.plan("wan-14b", 32760, 1, 1, "fsdp", "selective", 4, recompute_layers=1).total_gib)
    # the modulation_linear variant is planned as the per-block Linear's model (6.3B more parameters at 40 blocks)
    lin = bts.plan_beside_peak(entry.parse([*rest, *bts.VARIANTS["modulation_linear"]]), ["--use-torch-fsdp2"], 1)
    assert lin["plan_settings"]["modulation"] == "linear" and lin["plan_gib"] == pytest.approx(
        mp.plan("wan-14b", 32760, 1, 1, "fsdp", "full", 4, modulation="linear").total_gib) and \
        lin["plan_gib"] > got["plan_gib"]
    core = bts.plan_beside_peak(entry.parse([*rest, "--recompute-granularity", "selective"]), [], 1)
    assert core["plan_gib"] is None and "core_attn" in core["plan_skipped"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_run_records_agreement_fsdp2_and_plan(tmp_path):
    """The tool end to end on the CPU (one gloo rank): guarded and fsdp2 variants, 3 steps at --log-interval 2
    (fewer than 2 x 2: the medians include the warm-up, so every result says it needs 4)."""
    pytest.importorskip("megatron.core")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "DS_ACCELERATOR": "cpu", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_train_step.py"), "--variants", "guarded,fsdp2",
           "--log-interval", "2", "--out", str(tmp_path), "--", "--model", "tiny", "--frames", "4", "--latent-size",
           "6x10", "--train-iters", "3", "--ddp-impl", "torch", "--num-workers", "0", "--timing-bare-steps", "2"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.load(open(tmp_path / "train_step.json"))
    res = out["results"]
    for v in ("guarded", "fsdp2"):
        a = res[v]["step_agreement"]
        assert a["warmup_in_median"] and a["train_iters_needed"] == 4 and a["train_iters"] == 3
        assert "mfu_bare" in res[v] and res[v]["plan_gib"] is None and "--bf16" in res[v]["plan_skipped"]
        assert len(res[v]["losses"]) == 3 and res[v]["losses"][0] == res[v]["first_step_loss"]
        assert res[v]["loss_curve"]["steps"] == 3
        if not a["agrees"]:
            assert v in out["step_agreement_flagged"] and f"WARNING {v}" in r.stdout
    assert "fsdp2_overhead" in res and "fsdp2_overhead_bare" in res


def test_packed_variants_are_refused_by_name_before_any_run():
    """dynamic_cp at --context-parallel-size 1 (uniform and dynamic SP are then the same run) and the packed
    variants on the DeepSpeed entry (its dynamic SP is a JSON setting) stop the job, naming the flag."""
    pytest.importorskip("megatron.core")
    from training import pretrain_video_dit as entry
    rest = ["--model", "tiny", "--pack-samples", "--max-tokens-per-step", "64"]
    parsed = {v: entry.parse([*rest, *bts.VARIANTS[v]]) for v in ("packed", "dynamic_cp")}
    bts.check_packed_variants(["packed"], "megatron", parsed)  # uniform SP at CP=1 runs
    with pytest.raises(SystemExit, match="--context-parallel-size > 1"):
        bts.check_packed_variants(["packed", "dynamic_cp"], "megatron", parsed)
    with pytest.raises(SystemExit, match="--entry megatron"):
        bts.check_packed_variants(["packed"], "deepspeed", parsed)


def test_cpu_run_dynamic_cp_against_uniform_sp_on_one_mixed_pack(tmp_path):
    """#55 item 3 on the CPU: the tool at 2 gloo ranks, "packed" (uniform SP) and "dynamic_cp" on one mixed pack
    per step (--frames / --latent-size cycle per sample: a 16-frame 32x32 clip of 4,096 tokens, a 3-frame 32x32
    clip of 768, two 8x8 images, a 3-frame 6x10 clip of 45: odd token counts pad under uniform SP; a pack the
    packer's model sees 7% lighter than uniform SP, above the entries' MIN_GAIN). The packer puts the long clip over
    both ranks and the rest whole on one rank each; both variants record the same packs, the speedup keys exist,
    and the first step's loss (same pack, same init, before any update) agrees within fp32 rounding."""
    pytest.importorskip("megatron.core")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           os.path.join(ROOT, "tools", "bench_train_step.py"), "--variants", "packed,dynamic_cp", "--log-interval", "2",
           "--out", str(tmp_path), "--", "--model", "tiny", "--context-parallel-size", "2", "--frames", "16,3,1,1,3",
           "--latent-size", "32x32,32x32,8x8,8x8,6x10", "--pack-samples", "--max-tokens-per-step", "5000",
           "--train-iters", "3", "--ddp-impl", "torch", "--num-workers", "0", "--timing-bare-steps", "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.load(open(tmp_path / "train_step.json"))["results"]
    for v in ("packed", "dynamic_cp"):
        assert res[v]["entry_step_ms"] > 0 and res[v]["bare_step_ms"] > 0
        first = res[v]["pack"]["first_step"]
        assert first["tokens"] == [4096, 768, 16, 16, 45] and first["samples"] == 5 and first["total_tokens"] == 4941
        assert first["latent_thw"][:2] == [[16, 32, 32], [3, 32, 32]]
        assert [s["samples"] for s in res[v]["pack"]["steps"]] == [5, 5, 5]
    assert "sp_sizes" not in res["packed"]["pack"]["first_step"]
    assert res["dynamic_cp"]["pack"]["first_step"]["sp_sizes"] == [2, 1, 1, 1, 1]  # a real mix of placements
    assert "1 sample of 4,096 tokens over 2 ranks" in res["dynamic_cp"]["pack"]["first_step"]["plan"]
    assert res["dynamic_cp_same_pack"] is True
    for key, what in (("dynamic_cp_speedup", "entry_step_ms"), ("dynamic_cp_speedup_bare", "bare_step_ms")):
        assert res[key] == pytest.approx(res["packed"][what] / res["dynamic_cp"][what])
    a, b = res["packed"]["first_step_loss"], res["dynamic_cp"]["first_step_loss"]
    assert a is not None and b == pytest.approx(a, rel=1e-5), (a, b)
    assert res["dynamic_cp_first_loss_rel_diff"] <= 1e-5


def test_memory_preflight_warns_near_the_gpu_limit():
    """The SP=2 step planned at 75.2 of 79 GiB that failed on 2 x H100 (2026-11-25) is warned of; 50 GiB is not;
    a run without a plan is not."""
    from tools.bench_train_step import memory_preflight
    warn = memory_preflight({"plan_gib": 75.2}, gpu_gib=79.1)
    assert warn and "75.2 GiB" in warn and "--recompute-granularity full" in warn
    assert memory_preflight({"plan_gib": 50.0}, gpu_gib=79.1) is None
    assert memory_preflight({"plan_gib": None, "plan_skipped": "several token grids"}, gpu_gib=79.1) is None


SPARSE_REST = ["--model", "tiny", "--frames", "8", "--latent-size", "32x32", "--train-iters", "1"]


def test_sparse_args_reach_the_sparse_variants_only():
    """#69 item 4: --sparse-args (a tile, a kernel) go to the sparse variants; the dense one in the same job runs
    without them and still parses (a sparse-only flag given after "--" made it refuse the job)."""
    pytest.importorskip("megatron.core")
    from training import pretrain_video_dit as entry
    from training.video_dit.cli import sparse_spec
    extra, info = bts.variant_flags(["guarded", "sparse_topk90", "sparse_window80"], SPARSE_REST, None,
                                    "--sparse-tile 4,4,4 --sparse-attention-kernel math", entry)
    assert extra["guarded"] == [] and set(info) == {"sparse_topk90", "sparse_window80"}
    for v in ("sparse_topk90", "sparse_window80"):
        assert extra[v][-2:] == ["--sparse-attention-kernel", "math"] and info[v]["tile"] == [4, 4, 4]
        parsed = entry.parse([*SPARSE_REST, *extra[v]])
        assert parsed.sparse_attention_kernel == "math" and sparse_spec(parsed).tile == (4, 4, 4)
    assert info["sparse_topk90"]["n_tiles"] == 32 and info["sparse_topk90"]["topk"] == 3   # 8x16x16 / 4,4,4
    dense = entry.parse([*SPARSE_REST, *extra["guarded"]])
    assert sparse_spec(dense) is None and dense.sparse_attention_kernel == "auto"
    # the tool's own --sparse-tile sets the tile too; the default is the DiT's 4,4,8
    assert bts.variant_flags(["sparse_topk80"], SPARSE_REST, "4,4,4", "", entry)[1]["sparse_topk80"]["tile"] == \
        [4, 4, 4]
    assert bts.variant_flags(["sparse_topk80"], SPARSE_REST, None, "", entry)[1]["sparse_topk80"]["tile"] == [4, 4, 8]


def test_sparse_custom_takes_the_users_window_or_topk():
    pytest.importorskip("megatron.core")
    from training import pretrain_video_dit as entry
    from training.video_dit.cli import sparse_spec
    from training.video_dit.sparse import window_tile_mask
    extra, info = bts.variant_flags(["guarded", "sparse_custom"], SPARSE_REST, None,
                                    "--sparse-tile 4,4,4 --sparse-window 1,1,1", entry)
    spec = sparse_spec(entry.parse([*SPARSE_REST, *extra["sparse_custom"]]))
    assert spec.window == (1, 1, 1) and spec.topk is None and info["sparse_custom"]["target_sparsity"] is None
    assert info["sparse_custom"]["sparsity"] == pytest.approx(
        1 - float(window_tile_mask((8, 16, 16), (4, 4, 4), (1, 1, 1)).float().mean()))
    extra, info = bts.variant_flags(["sparse_custom"], SPARSE_REST, None, "--sparse-topk 5", entry)
    assert info["sparse_custom"]["topk"] == 5 and info["sparse_custom"]["sparsity"] == pytest.approx(1 - 5 / 16)
    assert sparse_spec(entry.parse([*SPARSE_REST, *extra["sparse_custom"]])).topk == 5


def test_sparse_args_refused_by_name():
    pytest.importorskip("megatron.core")
    from training import pretrain_video_dit as entry
    with pytest.raises(SystemExit, match="sparse_custom"):   # a fixed variant's selection is its own
        bts.variant_flags(["sparse_topk80"], SPARSE_REST, None, "--sparse-window 1,1,1", entry)
    with pytest.raises(SystemExit, match="--sparse-topk K or --sparse-window"):
        bts.variant_flags(["sparse_custom"], SPARSE_REST, None, "--sparse-tile 4,4,4", entry)
    with pytest.raises(SystemExit, match="disagree"):
        bts.variant_flags(["sparse_topk80"], SPARSE_REST, "4,4,8", "--sparse-tile 4,4,4", entry)
    with pytest.raises(SystemExit, match="no sparse_\\* variant"):
        bts.variant_flags(["guarded"], SPARSE_REST, None, "--sparse-tile 4,4,4", entry)
    with pytest.raises(SystemExit, match="not a list of entry flags"):
        bts.variant_flags(["sparse_topk80"], SPARSE_REST, None, "--sparse-tile '4,4", entry)


def test_cpu_run_recompute_variants(tmp_path):
    """The selective-vs-full job of #67 as a CPU dry run (one gloo rank, fp32): recompute_full and
    recompute_selective_offload in one job (the model-level tests cover selective without offload); the same
    first-step loss bit for bit (the recompute never changes the math) and the speedup recorded."""
    pytest.importorskip("megatron.core")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "DS_ACCELERATOR": "cpu", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_train_step.py"), "--variants",
           "recompute_full,recompute_selective_offload", "--log-interval", "1", "--out",
           str(tmp_path), "--", "--model", "tiny", "--frames", "4", "--latent-size", "6x10", "--train-iters", "1",
           "--ddp-impl", "torch", "--num-workers", "0", "--timing-bare-steps", "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.load(open(tmp_path / "train_step.json"))["results"]
    losses = {v: res[v]["first_step_loss"] for v in ("recompute_full", "recompute_selective_offload")}
    assert len(set(losses.values())) == 1 and None not in losses.values(), losses
    for k in ("recompute_selective_offload_speedup", "recompute_selective_offload_speedup_bare"):
        assert res[k] > 0, k


def test_loss_curve_first_against_last_quarter():
    assert bts.loss_curve([]) == {}
    c = bts.loss_curve([4.0, 3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0])
    assert c == {"steps": 8, "first_quarter_mean": 3.5, "last_quarter_mean": 0.5, "fell": True}
    assert not bts.loss_curve([1.0, 2.0])["fell"] and bts.loss_curve([2.0])["steps"] == 1
