"""tools/bench_wan_prepare.py in its CPU dry mode (tiny stand-ins of the VAEs, umT5, CLIP and Wan): the prepare rows
of every variant (seconds per clip and the parts, latent shapes of the Wan 2.1 and 2.2 VAEs) and the sampling rows
at SP=1 and SP=2 (gloo), with machine, date, commit and command."""
import json

import pytest

pytest.importorskip("imageio_ffmpeg", reason="the benchmark writes its video with imageio's ffmpeg plugin")

import torch  # noqa: E402,F401
from diffusers import WanTransformer3DModel  # noqa: E402,F401  (imported before the harness forks)

import megatron_sp_ext.diffusers  # noqa: E402,F401
from tests.harness import run_ranks  # noqa: E402
from tools import bench_wan_prepare as bench  # noqa: E402


def test_dry_run_prepare_and_sample_rows(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--dry-run", "--out", str(out), "--clips", "2", "--repeats", "1"])
    doc = json.loads(out.read_text())
    assert doc["meta"]["dry_run"] and {"date", "device", "command", "commit"} <= set(doc["meta"])
    rows = {r["variant"]: r for r in doc["prepare"]}
    assert sorted(rows) == ["wan2.1", "wan2.1-i2v", "wan2.2", "wan2.2-ti2v"]
    assert rows["wan2.1"]["latent_shape"] == [4, 3, 4, 8] and rows["wan2.2"]["latent_shape"] == [6, 3, 2, 4]
    for r in rows.values():
        assert r["clips"] == 2 and r["seconds_per_clip"] > 0 and r["vae_s"] > 0 and r["text_s"] > 0
    assert "clip_s" in rows["wan2.1-i2v"] and "clip_s" not in rows["wan2.2-ti2v"] and "cond_s" in rows["wan2.2-ti2v"]
    s = doc["sample"]
    assert s["sp"] == 1 and len(s["sample_s"]) == 2 and s["tokens"] == 8 and all(v["mp4"] for v in s["videos"])


def _sample(rank, world, argv):
    return bench.main(list(argv)).get("sample")


def test_dry_run_sample_sp2(tmp_path):
    out = tmp_path / "sp2.json"
    rows = run_ranks(_sample, 2, ["--dry-run", "--part", "sample", "--mode", "ring", "--out", str(out)], timeout=240)
    doc = json.loads(out.read_text())
    assert doc["sample"]["sp"] == 2 and doc["sample"]["mode"] == "ring" and len(doc["sample"]["sample_s"]) == 2
    assert rows[1]["videos"] == []   # rank 0 writes
