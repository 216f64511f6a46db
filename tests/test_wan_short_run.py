"""tools/wan_short_run.py in its CPU dry mode: the recipe's phases (pipeline folder, videos, prepare, LoRA training
with a mid-run and a final validation) write the JSON with every phase's seconds, the commands, the training step
and each validation video's sampling / decoding seconds, and leave the videos, frame strips and plots under --out;
--time-limit stops the run with the JSON written (timed_out) and exit status 124."""
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("imageio_ffmpeg", reason="the run writes its clips and validation videos with imageio's ffmpeg")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "wan_short_run.py")


def _run(out, *extra):
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, TOOL, "--dry-run", "--out", str(out), *extra], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_dry_run_writes_the_json_videos_and_timings(tmp_path):
    out = tmp_path / "out"
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "wan_short_run.json").read_text())
    assert doc["complete"] and doc["timed_out"] is None and doc["sp"] == 1
    assert {"date", "device", "command", "commit"} <= set(doc["meta"]) and doc["meta"]["dry_run"]
    for phase in ("pipeline", "videos", "prepare", "train", "total"):
        assert doc["seconds"][phase] > 0, phase
    assert doc["commands"]["prepare"].startswith("python -m training.wan_diffusers.prepare --pipeline ")
    assert "--prompts" in doc["commands"]["prepare"]
    train = doc["commands"]["train"]
    assert train.startswith("python training/train_wan_diffusers.py --init ") and "--lora-rank 32" in train
    assert "--validation-every 1" in train and "--context-parallel-size" not in train
    assert doc["prepare"]["clips"] == 2 and doc["prepare"]["seconds_per_clip"] > 0
    assert doc["pipeline"]["text_encoder"]["umt5_xxl"] is False and doc["pipeline"]["transformer"]["preset"] == "dry"
    assert doc["train"]["steps"] == 2 and doc["train"]["step_ms_median"] > 0 and len(doc["train"]["losses"]) == 2
    rows = doc["validation"]
    assert [(r["step"], r["i"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]   # mid-run and final
    for r in rows:
        assert isinstance(r["sample_s"], float) and r["sample_s"] > 0 and r["decode_s"] > 0
        assert (r["frames"], r["height"], r["width"], r["steps"]) == (5, 32, 32, 2)
        assert (out / r["mp4"]).is_file() and (out / r["png"]).is_file()
    run = out / "run"
    assert (run / "validation" / "index.jsonl").is_file() and (run / "loss.png").is_file()
    assert (run / "validation" / "step_000002" / "loss.png").is_file()
    assert not doc["files"]["left_out"] and not doc["files"]["shrunk"]
    assert "validation/step_000001/0.mp4" in doc["files"]["copied"]
    assert not [f for f in os.listdir(out) if f not in ("wan_short_run.json", "run")]   # no pipeline / LoRA


def test_size_limits_shrink_or_leave_out_and_say_so(tmp_path):
    """A video / strip above --max-file-mb is copied at half its sides where that fits; other large files and those
    past --max-out-mb stay out; every one is named."""
    import imageio.v2 as imageio
    import numpy as np
    from PIL import Image
    from tools.wan_short_run import copy_small
    src, step = tmp_path / "src", tmp_path / "src" / "validation" / "step_000001"
    step.mkdir(parents=True)
    (src / "metrics.jsonl").write_text("{}\n")
    (src / "big.bin").write_bytes(b"x" * 2_000_000)   # above every budget below
    noise = np.random.default_rng(0).integers(0, 256, (9, 96, 128, 3), dtype=np.uint8)
    with imageio.get_writer(str(step / "0.mp4"), "ffmpeg", fps=8, macro_block_size=1) as w:
        for f in noise:
            w.append_data(f)
    Image.fromarray(np.concatenate(list(noise[:4]), axis=1)).save(step / "0.png")
    sizes = {n: (step / n).stat().st_size for n in ("0.mp4", "0.png")}
    limit = min(sizes.values()) * 0.9 / 2**20        # both too large; noise at an eighth of its area fits
    got = copy_small(str(src), str(tmp_path / "dst"), max_file_mb=limit, max_out_mb=10)
    assert got["copied"] == ["metrics.jsonl", "validation/step_000001/0.mp4", "validation/step_000001/0.png"]
    assert "--max-file-mb" in got["left_out"]["big.bin"]
    shrunk = {rel: tuple(int(x) for x in how.split(" of ")[0].split("x")) for rel, how in got["shrunk"].items()}
    assert got["shrunk"]["validation/step_000001/0.mp4"].endswith(" of 96x128")
    assert got["shrunk"]["validation/step_000001/0.png"].endswith(" of 96x512")
    out = tmp_path / "dst" / "validation" / "step_000001"
    frames = imageio.mimread(str(out / "0.mp4"))
    h, w = shrunk["validation/step_000001/0.mp4"]
    assert len(frames) == 9 and frames[0].shape == (h, w, 3) and h < 96
    h, w = shrunk["validation/step_000001/0.png"]
    assert Image.open(out / "0.png").size == (w, h) and h < 96
    assert all((out / n).stat().st_size <= limit * 2**20 for n in ("0.mp4", "0.png"))
    got = copy_small(str(src), str(tmp_path / "dst2"), max_file_mb=10, max_out_mb=(sizes["0.mp4"] + 100) / 2**20)
    assert got["copied"] == ["metrics.jsonl", "validation/step_000001/0.mp4"] and not got["shrunk"]
    assert "--max-out-mb" in got["left_out"]["big.bin"] and "--max-out-mb" in \
        got["left_out"]["validation/step_000001/0.png"]
    assert not (tmp_path / "dst2" / "validation" / "step_000001" / "0.png").exists()


def test_time_limit_writes_the_json_and_exits_124(tmp_path):
    out = tmp_path / "out"
    proc = _run(out, "--time-limit", "16")   # fires 15 s early: 1 s after the imports (the dry pipeline takes ~2 s)
    assert proc.returncode == 124, proc.stderr[-3000:]
    doc = json.loads((out / "wan_short_run.json").read_text())
    assert doc["timed_out"] in ("pipeline", "videos", "prepare") and not doc["complete"]
    assert "train" not in doc["seconds"] and doc["validation"] == []
    assert f"--time-limit 16s reached in phase {doc['timed_out']}" in proc.stdout
    work = re.search(r"work dir (\S+),", proc.stdout).group(1)
    assert not os.path.exists(work)   # the temporary work dir (the pipeline: ~15 GB at real size) removed


def test_fused_and_kept_attention_reach_the_trainer_and_validation(tmp_path):
    """--fused-elementwise on --recompute-granularity selective: the trainer runs its steps with every block
    compiled and the attention kept, then samples its validation videos through the same compiled blocks."""
    out = tmp_path / "out"
    proc = _run(out, "--fused-elementwise", "on", "--recompute-granularity", "selective")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "wan_short_run.json").read_text())
    train = doc["commands"]["train"]
    assert "--fused-elementwise on" in train and "--recompute-granularity selective" in train
    assert "recompute=selective fused_elementwise=on" in proc.stdout + proc.stderr   # the trainer's own settings line
    assert doc["complete"] and doc["train"]["steps"] == 2 and len(doc["validation"]) == 4
    assert all(r["sample_s"] > 0 and (out / r["mp4"]).is_file() for r in doc["validation"])


def _phase_on_two_ranks(rank, world):
    """on_rank0 (training/video_dit/faults.py, as wan_short_run calls it) with a phase that fails on rank 0: every
    rank returns what it raised (none waits)."""
    import time

    sys.path.insert(0, ROOT)
    from tools import wan_short_run as W

    t0 = time.perf_counter()
    ok = W.on_rank0("phase videos", lambda: ("videos", "prompts.txt"))
    assert ok == ("videos", "prompts.txt")   # the result reaches every rank

    def fail():
        raise ImportError("The `FFMPEG` plugin is not installed.")
    try:
        W.on_rank0("phase videos", fail)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.perf_counter() - t0
    return None, "", time.perf_counter() - t0


def test_a_failure_in_a_rank0_phase_ends_every_rank():
    """2 x H200, 2026-11-29: rank 0 failed in phase videos (no imageio-ffmpeg) and rank 1 waited in the broadcast
    until the job's limit. Now rank 0 re-raises its own error and the other ranks raise PeerFailed naming it."""
    from tests.harness import run_ranks
    got = run_ranks(_phase_on_two_ranks, 2, timeout=60)
    assert got[0][0] == "ImportError" and "FFMPEG" in got[0][1]
    assert got[1][0] == "PeerFailed"
    assert got[1][1] == "rank 0 failed in phase videos: ImportError: The `FFMPEG` plugin is not installed."
    assert max(r[2] for r in got) < 30


def test_missing_imageio_ffmpeg_is_refused_before_any_work(tmp_path, monkeypatch):
    import importlib.util

    sys.path.insert(0, ROOT)
    from megatron_sp_ext.errors import SPConfigError
    from tools import wan_short_run as W

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "imageio_ffmpeg" else real(n, *a))
    with pytest.raises(SPConfigError, match=r"not installed here: imageio-ffmpeg \(pip install \"\.\[diffusers\]\""):
        W.main(["--dry-run", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()   # refused before the JSON or the pipeline
