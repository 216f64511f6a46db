"""tools/profile_train_step.py's kernel categories and its reading of a torch.profiler Chrome trace (no GPU)."""
import json

from tools.profile_train_step import categorize_trace, category, ceiling_ms


def test_category_by_kernel_and_operator():
    cudnn = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0"
    assert category(cudnn, "aten::_scaled_dot_product_cudnn_attention", [[1, 40, 32760, 128]] * 3) == "attention"
    assert category(cudnn, "aten::_scaled_dot_product_cudnn_attention",
                    [[1, 40, 32760, 128], [1, 40, 512, 128], [1, 40, 512, 128]]) == "cross-attention"
    assert category("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", "aten::mm", []) == "GEMM"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32", "", []) == "GEMM"
    assert category("ncclDevKernel_AllToAll_RING_LL", "nccl:all_to_all", []) == "exchange"
    assert category("multi_tensor_apply_kernel", "aten::_fused_adamw_", []) == "optimizer"
    assert category("triton_poi_fused_add_mul_0", "Torch-Compiled Region", []) == "elementwise"
    # an Inductor kernel is its own launching "operator": a fused RoPE/norm region is not the optimizer
    assert category("triton_red_fused__to_copy_add_cos_mean", "triton_red_fused__to_copy_add_cos_mean", []) \
        == "elementwise"
    assert category("vectorized_elementwise_kernel", "aten::_scaled_dot_product_cudnn_attention", []) == "elementwise"


def test_trace_categories_idle_and_ceiling(tmp_path):
    ev = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10, "args": {"External id": 1}},
          {"cat": "cpu_op", "name": "aten::_scaled_dot_product_cudnn_attention", "ts": 0, "dur": 10,
           "args": {"External id": 2, "Input Dims": [[1, 8, 1024, 64], [1, 8, 512, 64], [1, 8, 512, 64]]}},
          {"cat": "kernel", "name": "nvjet_x", "ts": 100, "dur": 1000, "args": {"External id": 1}},
          {"cat": "kernel", "name": "cudnn_sdpa", "ts": 1100, "dur": 500, "args": {"External id": 2}},
          {"cat": "kernel", "name": "triton_poi", "ts": 2100, "dur": 400, "args": {"External id": 9}}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    got = categorize_trace(str(path), steps=1)
    ms = got["ms_per_step"]
    assert ms["GEMM"] == 1.0 and ms["cross-attention"] == 0.5 and ms["elementwise"] == 0.4
    assert abs(ms["idle"] - 0.5) < 1e-9 and abs(got["window_ms_per_step"] - 2.4) < 1e-9
    c = ceiling_ms("wan-1.3b", 4, 32760, 32760, 600.0, 790.0, world=2)
    c1 = ceiling_ms("wan-1.3b", 4, 32760, 32760, 600.0, 790.0)
    assert abs(c["GEMM"] * 2 - c1["GEMM"]) < 1e-9 and c1["attention"] > c1["cross-attention"] > 0


def test_exposed_exchange_is_the_part_no_other_kernel_covers(tmp_path):
    from tools.profile_train_step import busy, exposed
    assert exposed([(0, 10)], [(2, 4), (6, 7)]) == 7          # 0-2, 4-6, 7-10
    assert exposed([(0, 10), (5, 12)], [(11, 20)]) == 11      # union 0-12, covered 11-12
    assert exposed([(0, 4)], []) == 4 and exposed([(1, 3)], [(0, 5)]) == 0
    assert exposed([(0, 2), (8, 9)], [(1, 8.5)]) == 1.5       # 0-1 and 8.5-9
    assert busy([(0, 2), (1, 3), (5, 6)]) == 4
    ev = [{"cat": "kernel", "name": "ncclDevKernel_AllToAll", "ts": 0, "dur": 1000, "args": {}},
          {"cat": "kernel", "name": "flash_fwd_kernel", "ts": 400, "dur": 2000, "args": {}},
          {"cat": "kernel", "name": "ncclDevKernel_AllToAll", "ts": 2600, "dur": 500, "args": {}}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    got = categorize_trace(str(path), steps=2)
    assert abs(got["exchange_exposed_ms_per_step"] - 0.45) < 1e-9   # (400 + 500) us over 2 calls
    assert abs(got["exchange_beside_ms_per_step"] - 0.3) < 1e-9     # 400-1000 us beside the flash kernel
    assert abs(got["ms_per_step"]["exchange"] - 0.75) < 1e-9 and abs(got["ms_per_step"]["idle"] - 0.1) < 1e-9


def test_profile_calls_on_cpu_says_why_it_has_no_kernels(tmp_path):
    """tools/profile_calls.py on a CPU (no process group): the fn runs reps + 1 times, no GPU kernels is said, not
    raised; bench_cp's --profile-modes filter and its markdown lines."""
    import argparse

    from tools.bench_cp import profile_lines, profiled
    from tools.profile_calls import profile_calls
    calls = []
    got = profile_calls(lambda: calls.append(1), 3)
    assert len(calls) == 4 and got["reps"] == 3 and "no GPU kernels" in got["rank0"]["error"]
    assert "max_over_ranks" not in got
    a = argparse.Namespace(profile_reps=0, profile_modes="")
    assert not profiled(a, "ulysses")
    a.profile_reps = 2
    assert profiled(a, "ulysses") and profiled(a, "floor_fa4")
    a.profile_modes = "hcms,floor_fa4"
    assert profiled(a, "floor_fa4") and profiled(a, "hcms") and not profiled(a, "ulysses")
    prof = {"reps": 2, "window_ms_max": 10.0, "exchange_exposed_ms_max": 1.5,
            "max_over_ranks": {"attention": 7.0, "exchange": 2.0, "elementwise": 1.0, "GEMM": 0.0, "idle": 0.5}}
    rows = [{"L": 32768, "causal": False, "floor_fa4": {"fwd": 1, "profile": prof},
             "modes": {"ulysses": {"profile": prof}, "ring": {"fwd_ms": 1.0}}}]
    lines = profile_lines(rows)
    assert len(lines) == 7 and lines[-2].startswith("| 32K | no | FA4 floor | fwd+bwd | 10.00 | 7.00 | 2.00 | 1.50 |")
    assert lines[-1].startswith("| 32K | no | ulysses | fwd+bwd |") and profile_lines([{**rows[0], "floor_fa4": {},
                                                                                       "modes": {}}]) == []
    # --profile-calls fwd: the forward alone beside the fwd+bwd line of the same mode, its beside time shown
    fwd = {**prof, "exchange_exposed_ms_max": 24.5, "exchange_beside_ms_min": 0.2}
    rows[0]["modes"]["ring"]["profile_fwd"] = fwd
    lines = profile_lines(rows)
    assert lines[-1].startswith("| 32K | no | ring | fwd | 10.00 | 7.00 | 2.00 | 24.50 | 0.20 |")


def test_bench_cp_profile_calls_setting():
    """bench_cp's --profile-calls: fwd and/or fwd_bwd; anything else is one message naming the flag."""
    import argparse

    import pytest

    from megatron_sp_ext.errors import SPConfigError
    from tools.bench_cp import profile_calls_of
    assert profile_calls_of(argparse.Namespace(profile_calls="fwd_bwd")) == ("fwd_bwd",)
    assert profile_calls_of(argparse.Namespace(profile_calls="fwd, fwd_bwd")) == ("fwd", "fwd_bwd")
    for bad in ("bwd", "", "fwd,all"):
        with pytest.raises(SPConfigError, match="--profile-calls"):
            profile_calls_of(argparse.Namespace(profile_calls=bad))


def test_bench_cp_views_mode_keeps_the_contiguous_placement():
    """bench_cp's "ulysses_views" calls ulysses_attention without a placement: its shards must be contiguous too."""
    from tools.bench_cp import placement_of
    assert placement_of("ulysses_views", True) == placement_of("ulysses", True) == "contiguous"
    assert placement_of("ring", True) == "zigzag" and placement_of("ring", False) == "contiguous"


def _profile_with_a_bad_trace_dir(rank, world):
    import torch.distributed as dist

    from tools.profile_calls import profile_calls
    got = profile_calls(lambda: None, 2, dist.group.WORLD, trace_dir="/dev/null/traces", tag="t")
    t = __import__("torch").ones(1)
    dist.all_reduce(t)            # the ranks' collectives are still in step
    assert t.item() == world
    assert set(got["failed_ranks"]) == set(range(world))   # rank 0: the folder; others: no GPU kernels (CPU)
    assert "NotADirectoryError" in got["failed_ranks"][0] or "FileExistsError" in got["failed_ranks"][0]
    return True


def test_profile_calls_keeps_ranks_in_step_when_one_fails():
    """A failure while writing or reading rank 0's trace (a folder that cannot be made) is that rank's error in the
    result: every rank still reaches the gather and the next collective (2 gloo ranks)."""
    from tests.harness import run_ranks
    run_ranks(_profile_with_a_bad_trace_dir, 2)
