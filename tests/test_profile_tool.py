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
