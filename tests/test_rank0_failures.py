"""Work only rank 0 does, failing there, ends every rank at once (training/video_dit/faults.on_rank0): rank 0 raises
its own error, the others PeerFailed naming it, instead of waiting in a collective rank 0 never reaches (2 x H200,
2026-11-29: tools/wan_short_run.py's rank 1 waited until the job's limit). One test per site; each makes rank 0 fail
there (a patch in its forked process only) on 2 gloo ranks. Without on_rank0 the other rank hangs (the harness's
timeout) or returns without an error."""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TIMEOUT = 45   # the harness's; every case here ends in seconds


def _outcome(rank, fn):
    """(exception type name or None, its text, seconds) of ``fn()`` on this rank."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.perf_counter() - t0
    return None, "", time.perf_counter() - t0


def _fail_on_rank0(rank, owner, name, error):
    """``owner.name`` raises ``error`` on rank 0 alone (this forked rank's copy of the module)."""
    if rank == 0:
        def fail(*a, **k):
            raise error
        setattr(owner, name, fail)


def _check(got, error, text, where):
    assert got[0][0] == error and text in got[0][1], got[0]
    assert got[1][0] == "PeerFailed", got[1]
    assert got[1][1].startswith(f"rank 0 failed in {where}") and text in got[1][1], got[1]
    assert max(r[2] for r in got) < 20


# ---------------------------------------------------------------- training/video_dit/checkpoint.py

def _begin_save(rank, world, root):
    from training.video_dit import checkpoint as C
    _fail_on_rank0(rank, C.os, "makedirs", PermissionError(13, "Permission denied", root))
    return _outcome(rank, lambda: C.begin_save(root, 5))


def test_begin_save_failing_on_rank0_ends_every_rank(tmp_path):
    """Rank 0 creates iter_N.partial; the others waited in a barrier after it."""
    root = str(tmp_path / "ck")
    got = run_ranks(_begin_save, 2, root, timeout=TIMEOUT)
    _check(got, "PermissionError", "Permission denied", f"--save {root}: creating")


def _commit_save(rank, world, root):
    from training.video_dit import checkpoint as C
    tmp = C.begin_save(root, 5)
    with open(os.path.join(tmp, f"shard_{rank}.bin"), "wb") as f:
        f.write(bytes([rank]) * 16)
    _fail_on_rank0(rank, C, "prune", OSError(28, "No space left on device"))
    return _outcome(rank, lambda: C.commit_save(root, tmp, 5, {"entry": "test"}, keep_last=1))


def test_commit_save_failing_on_rank0_ends_every_rank(tmp_path):
    """Rank 0 writes run.json, renames, moves latest and prunes; the others waited in the barrier after it."""
    root = str(tmp_path / "ck")
    got = run_ranks(_commit_save, 2, root, timeout=TIMEOUT)
    _check(got, "OSError", "No space left on device", f"--save {root}: publishing")


# ---------------------------------------------------------------- training/video_dit/telemetry.py

def _telemetry(rank, world, tb_dir):
    from training.video_dit.engine import MetricsLog
    from training.video_dit.telemetry import Telemetry
    if rank == 0:
        sys.modules["torch.utils.tensorboard"] = None   # no tensorboard installed, on rank 0 alone
    log = MetricsLog(None, 1, rank == 0, show=False)
    return _outcome(rank, lambda: Telemetry(log, cfg=None, device="cpu", world=world, tensorboard_dir=tb_dir,
                                            writer_rank=rank == 0))


def test_tensorboard_writer_failing_on_rank0_ends_every_rank(tmp_path):
    """--tensorboard-dir: rank 0 alone opens the SummaryWriter; the others went on to the first step's collectives."""
    tb = str(tmp_path / "tb")
    got = run_ranks(_telemetry, 2, tb, timeout=TIMEOUT)
    _check(got, "ModuleNotFoundError", "torch.utils.tensorboard", f"--tensorboard-dir {tb}")


# ---------------------------------------------------------------- training/video_dit/engine.py (MetricsLog)

def _metrics_open(rank, world, log_dir):
    from training.video_dit import engine as E
    _fail_on_rank0(rank, E.os, "makedirs", PermissionError(13, "Permission denied", log_dir))
    return _outcome(rank, lambda: E.MetricsLog(log_dir, 2, rank == 0, show=False, group=dist.group.WORLD))


def test_metrics_log_failing_to_open_on_rank0_ends_every_rank(tmp_path):
    """The entries' MetricsLog: rank 0 alone makes --log-dir and opens metrics.jsonl; the others went on to the first
    step's collectives."""
    log_dir = str(tmp_path / "logs")
    got = run_ranks(_metrics_open, 2, log_dir, timeout=TIMEOUT)
    _check(got, "PermissionError", "Permission denied", f"--log-dir {log_dir}: opening metrics.jsonl")


def _metrics_close(rank, world, log_dir):
    from training.video_dit import engine as E
    log = E.MetricsLog(log_dir, 2, rank == 0, show=False, group=dist.group.WORLD)
    log.write({"step": 1, "loss": 1.0, "step_time_s": 0.1})
    _fail_on_rank0(rank, E, "plot_metrics", OSError(28, "No space left on device"))
    return _outcome(rank, lambda: log.close("t"))


def test_metrics_log_failing_to_plot_on_rank0_ends_every_rank(tmp_path):
    """close(): rank 0 plots loss.png; the others went on to sampling / saving (collectives)."""
    log_dir = str(tmp_path / "logs")
    got = run_ranks(_metrics_close, 2, log_dir, timeout=TIMEOUT)
    _check(got, "OSError", "No space left on device", f"--log-dir {log_dir}: plotting loss.png")


def _metrics_ok(rank, world, log_dir):
    from training.video_dit import engine as E
    log = E.MetricsLog(log_dir, 2, rank == 0, show=False, group=dist.group.WORLD)
    log.write({"step": 1, "loss": 1.0, "step_time_s": 0.1})
    return log.close("t")


def test_metrics_log_over_a_group_writes_once_and_returns_the_plot_everywhere(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot is matplotlib's")
    log_dir = tmp_path / "logs"
    got = run_ranks(_metrics_ok, 2, str(log_dir), timeout=TIMEOUT)
    assert got == [str(log_dir / "loss.png")] * 2 and (log_dir / "loss.png").is_file()
    assert (log_dir / "metrics.jsonl").read_text().count("\n") == 1   # rank 0 alone wrote the row


# ---------------------------------------------------------------- tools/benchlib.py

def _finish_worker(rank, world, path):
    from tools.benchlib import finish_worker
    result = {"ms": 1.0, "bad": object()} if rank == 0 else None   # only rank 0's result is written
    out = _outcome(rank, lambda: finish_worker(rank, path, result))
    assert dist.is_initialized()   # the failure came before the group was destroyed: the harness's barrier runs
    return out


def test_finish_worker_failing_on_rank0_ends_every_rank(tmp_path):
    """bench_block / bench_attention / bench_dit_step end with finish_worker: rank 0 writes the JSON, then a barrier."""
    path = str(tmp_path / "part.json")
    got = run_ranks(_finish_worker, 2, path, timeout=TIMEOUT)
    _check(got, "TypeError", "not JSON serializable", f"writing {path}")


# ---------------------------------------------------------------- tools/bench_wan_prepare.py

def _bench_sample(rank, world, work):
    from tools import bench_wan_prepare as B
    _fail_on_rank0(rank, B, "random_vae", RuntimeError("cannot build the VAE"))
    args = SimpleNamespace(dry_run=True, seed=0, prompts=2)
    return _outcome(rank, lambda: B.bench_sample(args, work, torch.device("cpu"), rank, world))


def test_bench_wan_prepare_inputs_failing_on_rank0_end_every_rank(tmp_path):
    """bench_sample: rank 0 writes the VAE, scheduler and prompts; the others waited in a barrier after them."""
    got = run_ranks(_bench_sample, 2, str(tmp_path), timeout=TIMEOUT)
    _check(got, "RuntimeError", "cannot build the VAE", "bench_sample: writing")


# ---------------------------------------------------------------- tools/bench_diffusers_wan.py

def _bench_diffusers(rank, world, out):
    from tools import bench_diffusers_wan as BD

    def stub(args, v, *a, **k):   # no model: the test is about the JSON written between variants
        return {"variant": v["name"], "impl": v["impl"], "mode": v["mode"], "skipped": "test stub"}
    BD.time_variant = stub
    _fail_on_rank0(rank, BD, "write_json", OSError(28, "No space left on device"))
    return _outcome(rank, lambda: BD.main(["--dry-run", "--variants", "ours-auto,ours-ring", "--out", out]))


def test_bench_diffusers_wan_rows_failing_on_rank0_end_every_rank(tmp_path):
    """After every variant rank 0 rewrites the JSON; the others went on to the next variant's collectives."""
    out = str(tmp_path / "bench.json")
    got = run_ranks(_bench_diffusers, 2, out, timeout=TIMEOUT)
    _check(got, "OSError", "No space left on device", f"writing {out}")


# ---------------------------------------------------------------- training/wan_diffusers/validate.py

@pytest.fixture(scope="module")
def wan_world(tmp_path_factory):
    pytest.importorskip("imageio_ffmpeg", reason="the validation videos are written with imageio's ffmpeg plugin")
    from tests import wan_pipeline_dir as W
    from training.wan_diffusers import prepare
    root = tmp_path_factory.mktemp("rank0_validate")
    pipe = W.write_pipeline(root / "pipe", "t2v")
    (root / "prompts.txt").write_text("a red cat runs\na dog jumps on the beach\n")
    prompts = prepare.main(["--pipeline", pipe, "--output", str(root / "data"), "--prompts", str(root / "prompts.txt"),
                            "--max-sequence-length", "16", "--log-level", "WARNING"])
    return {"pipe": pipe, "prompts": prompts["prompts"]}


def _validate(rank, world, wan_world, out, site):
    import diffusers
    from diffusers import WanTransformer3DModel

    import megatron_sp_ext.diffusers
    from training.wan_diffusers import validate as V
    model = WanTransformer3DModel.from_pretrained(wan_world["pipe"], subfolder="transformer")
    megatron_sp_ext.diffusers.parallelize(model, dist.group.WORLD, mode="ulysses")
    settings = V.ValidationSettings(wan_world["prompts"], wan_world["pipe"], out, sampling=V.Sampling(
        steps=2, guidance=1.0, seed=7, frames=5, height=32, width=32, fps=8))
    owner, name, error = {
        "vae": (diffusers.AutoencoderKLWan, "from_pretrained",
                OSError("vae/diffusion_pytorch_model.safetensors: unreadable")),
        "video": (V.Validator, "_write", ImportError("The `FFMPEG` plugin is not installed.")),
        "step": (V.Validator, "_write_step", OSError(28, "No space left on device"))}[site]
    _fail_on_rank0(rank, owner, name, error)
    return _outcome(rank, lambda: V.Validator(settings, model, torch.device("cpu"), rank=rank, sp_size=world).final(3))


@pytest.mark.parametrize("site, error, text, where", [
    ("vae", "OSError", "unreadable", "--validation-prompts: loading the VAE"),
    ("video", "ImportError", "FFMPEG", "validation step 3: writing video 0"),
    ("step", "OSError", "No space left on device", "validation step 3: writing")])
def test_validation_failing_on_rank0_ends_every_rank(wan_world, tmp_path, site, error, text, where):
    """The trainer's validation: every rank samples (collective under SP), rank 0 loads the VAE, decodes and writes
    each video, then the step's files. Before: a failure there left the others in the next prompt's sampling or the
    next training step."""
    got = run_ranks(_validate, 2, wan_world, str(tmp_path / "val"), site, timeout=TIMEOUT)
    _check(got, error, text, where)


def test_a_peer_failure_prints_nothing_on_the_other_ranks(capsys, monkeypatch):
    """report_failures on a rank with PeerFailed: no message (rank 0 prints its own error); run_entry exits 1."""
    from training.video_dit.faults import PeerFailed, report_failures, run_entry

    def main(argv):
        with report_failures("test"):
            raise PeerFailed("rank 0 failed in x: OSError: y")
    monkeypatch.delenv("RANK", raising=False)
    assert run_entry(main, "test", []) == 1
    assert capsys.readouterr().err == ""
