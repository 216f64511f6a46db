"""--sparse-tile advice over EVERY token grid of a run (issue #51 item 3): a tile that does not cut one of the
grids (--frames x --latent-size) is refused naming the sizes that cut all of them, and every tile built from that
advice runs; the README's sparse command runs as written on the demo's CPU setup (a few steps)."""
import argparse
import itertools
import os
import random
import re
import shlex
import subprocess
import sys

import pytest

from megatron_sp_ext.errors import SPConfigError
from training.video_dit import preset
from training.video_dit.cli import check_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = preset("tiny")   # patch (1, 2, 2)


def _args(frames: str, latent_size: str, tile: str) -> argparse.Namespace:
    return argparse.Namespace(frames=frames, latent_size=latent_size, sparse_attention="tiles", sparse_tile=tile,
                              sparse_topk=2, sparse_window=None)


def _advice(msg: str) -> list:
    """The T, H, W value sets of the refusal."""
    sets = re.search(r"use T in \{([\d, ]+)\}, H in \{([\d, ]+)\}, W in \{([\d, ]+)\}", msg)
    assert sets is not None, msg
    return [[int(x) for x in s.split(",")] for s in sets.groups()]


def _follow(frames: str, latent_size: str, tile: str) -> list:
    """Refused: every tile the advice allows passes check_shapes. Returns the advice."""
    with pytest.raises(SPConfigError, match="--sparse-tile=") as e:
        check_shapes(_args(frames, latent_size, tile), CFG)
    advice = _advice(str(e.value))
    for t, h, w in itertools.product(*advice):
        check_shapes(_args(frames, latent_size, f"{t},{h},{w}"), CFG)
    return advice


def test_demo_grids_advice_cuts_both():
    """make demo: --frames 4,5 --latent-size 6x10 (grids 4x3x5, 5x3x5). The old advice said T in {1, 2, 4}."""
    with pytest.raises(SPConfigError) as e:
        check_shapes(_args("4,5", "6x10", "4,4,4"), CFG)
    msg = str(e.value)
    assert "T in {1}, H in {1, 3}, W in {1, 5}" in msg and "4x3x5, 5x3x5" in msg, msg
    assert _follow("4,5", "6x10", "4,4,4") == [[1], [1, 3], [1, 5]]


def test_advice_over_random_runs():
    """Random --frames / --latent-size lists: the tile runs, or every tile the advice names runs (never advice
    that fails on another grid), and the advice names every tile that would run (nothing left out)."""
    rng = random.Random(51)
    for _ in range(60):
        frames = ",".join(str(rng.randint(1, 12)) for _ in range(rng.randint(1, 3)))
        sizes = ",".join(f"{2 * rng.randint(1, 8)}x{2 * rng.randint(1, 8)}" for _ in range(rng.randint(1, 2)))
        tile = ",".join(str(rng.randint(1, 4)) for _ in range(3))
        try:
            check_shapes(_args(frames, sizes, tile), CFG)
            continue
        except SPConfigError:
            pass
        advice = _follow(frames, sizes, tile)
        grids = [(f, h // 2, w // 2) for f in map(int, frames.split(","))
                 for h, w in (map(int, s.split("x")) for s in sizes.split(","))]
        for axis, values in enumerate(advice):
            fits = [d for d in range(1, 25) if all(g[axis] % d == 0 for g in grids)]
            assert values == fits, (frames, sizes, axis, values, fits)


def _readme_sparse_command() -> list:
    """The README's sparse demo command (a ```bash line running the demo's launch script with tiles)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [ln.split("#")[0].strip() for ln in f]
    cmds = [ln for ln in lines if ln.startswith("bash configs/launch/dit_megatron_cpu.sh") and "--sparse-attention" in ln]
    assert len(cmds) == 1, f"README.md has no (or more than one) sparse demo command: {cmds}"
    return shlex.split(cmds[0])


def test_readme_sparse_command_runs_as_written(tmp_path):
    """As written, on the demo's 4 gloo ranks and grids, 3 steps and 2 sampling steps (the README runs 100)."""
    cmd = _readme_sparse_command()
    env = {**os.environ, "PYTHON": sys.executable, "ITERS": "3", "SAMPLE_STEPS": "2", "LOG_DIR": str(tmp_path),
           "PYTHONPATH": ROOT}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-3000:]}"
    assert "over 3 steps" in out, out[-3000:]
    for name in ("samples.png", "loss.png", "step_time.png", "metrics.jsonl"):   # what the README lists
        assert (tmp_path / name).exists(), name
