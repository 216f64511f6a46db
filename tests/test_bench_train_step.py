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


def test_plan_beside_peak_matches_memory_plan():
    pytest.importorskip("megatron.core")
    from tools import memory_plan as mp
    from training import pretrain_video_dit as entry
    rest = ["--model", "wan-14b", "--num-layers", "4", "--frames", "21", "--latent-size", "60x104", "--bf16",
            "--recompute-granularity", "full"]
    got = bts.plan_beside_peak(entry.parse(rest), ["--use-torch-fsdp2"], 1)
    assert got["plan_settings"] == {"model": "wan-14b", "layers": 4, "tokens": 32760, "sp": 1, "gpus": 1,
                                    "sharding": "fsdp", "recompute": "full"}
    assert got["plan_gib"] == pytest.approx(mp.plan("wan-14b", 32760, 1, 1, "fsdp", "full", 4).total_gib)
    assert bts.plan_beside_peak(entry.parse(rest), [], 1)["plan_settings"]["sharding"] == "none"
    no_bf16 = bts.plan_beside_peak(entry.parse([a for a in rest if a != "--bf16"]), [], 1)
    assert no_bf16["plan_gib"] is None and "--bf16" in no_bf16["plan_skipped"]


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
        if not a["agrees"]:
            assert v in out["step_agreement_flagged"] and f"WARNING {v}" in r.stdout
    assert "fsdp2_overhead" in res and "fsdp2_overhead_bare" in res
