"""Errors the user causes end a job with ONE message naming the setting or file (what would be valid),
a non-zero exit and no traceback, on both entry points (run as commands, 2 gloo ranks on CPU, without a
launcher agent: torchrun's own ChildFailedError report is the launcher's). SPX_TRACEBACK=1 shows the
tracebacks. Also: the defaults run with only the parallel size given; q/k/v whose dtype differs across
ranks is one clear SPConfigError on every rank."""
import json
import os
import pickle
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--model", "tiny", "--frames", "4", "--latent-size", "6x10", "--quiet", "--train-iters", "1")
MG = "training/pretrain_video_dit.py"
DS = "training/train_deepspeed.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, args, world: int = 2, env=None, timeout: float = 240) -> tuple[list, str]:
    """Run ``script args`` on ``world`` ranks as separate processes (RANK/WORLD_SIZE/MASTER_* as a launcher
    sets them); returns (exit codes, every rank's stdout + stderr)."""
    base = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_port()), **(env or {})}
    base.pop("SPX_TRACEBACK", None) if not (env and "SPX_TRACEBACK" in env) else None
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=ROOT,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], "".join(outs)


def _ds_config(tmp_path, **over) -> str:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 1}, "sequence_parallel_size": 2,
           "sequence_parallel_ext": {"mode": "ulysses"}, **over}
    path = tmp_path / f"ds_{len(os.listdir(tmp_path))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def assert_one_message(rcs, out, needle: str, code=None):
    assert all(rc != 0 for rc in rcs), (rcs, out[-3000:])
    if code is not None:
        assert all(rc == code for rc in rcs), (rcs, out[-3000:])
    assert "Traceback" not in out, out[-3000:]
    assert out.count(needle) == 1, (needle, out[-3000:])
    assert "usage:" not in out, out[-3000:]


# ------------------------------------------------------------------ bad flags and parallel sizes

@pytest.mark.parametrize("script,extra", [(MG, ()), (DS, ("--deepspeed-config", "configs/deepspeed/cpu_tiny_hcms.json"))])
def test_bad_flag_one_line(script, extra):
    rcs, out = launch(script, [*extra, "--train-iters", "x"])
    assert_one_message(rcs, out, "argument --train-iters: invalid int value: 'x'", code=2)
    rcs, out = launch(script, [*extra, "--no-such-flag"])
    assert_one_message(rcs, out, "unrecognized arguments: --no-such-flag", code=2)


def test_cp_size_not_dividing_world_names_the_flag():
    rcs, out = launch(MG, ["--context-parallel-size", "3", *TINY])
    assert_one_message(rcs, out, "--context-parallel-size=3 does not divide the world size 2", code=2)
    assert "use one of 1, 2" in out


SLOW_RANK0 = """
import os, runpy, sys, time
if os.environ.get("RANK") == "0":   # rank 0 reaches the error last
    time.sleep(3)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_parse_error_printed_by_rank0_under_torchrun_when_it_is_slowest(tmp_path):
    """#83 item 7: under torchrun a rank exiting first made the agent stop rank 0 before it printed the command
    line's error (seen in 1 of 3 runs; here rank 0 is made the slowest): the other ranks now wait for it."""
    wrapper = tmp_path / "slow_rank0.py"
    wrapper.write_text(SLOW_RANK0)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(_port()), str(wrapper), MG, "--context-parallel-size", "3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    line = "pretrain_video_dit.py: error: --context-parallel-size=3"
    printed = [ln for ln in out.splitlines() if ln.startswith(line)]
    assert r.returncode != 0 and len(printed) == 1, out[-3000:]


def _announce_order(rank, world):
    """A user error on every rank, the lowest rank slow to print it: when each rank leaves report_failures."""
    import time
    from training.video_dit import faults
    real, decided = faults._lowest_with, []

    def slow(*args, **kwargs):
        lowest = real(*args, **kwargs)
        if lowest:
            time.sleep(1.0)
            decided.append(time.monotonic())
        return lowest
    faults._lowest_with = slow
    try:
        with faults.report_failures("test"):
            raise SPConfigError("a bad setting")
    except SPConfigError as e:
        return e.spx_announced, time.monotonic(), decided


def test_runtime_user_error_ranks_leave_after_the_printing_rank():
    """The ranks that do not print a user error leave (and exit, which makes torchrun stop the others) only after
    the rank that prints it has printed."""
    (a0, _, decided), (a1, left1, _) = run_ranks(_announce_order, 2)
    assert a0 and not a1 and left1 > decided[0], (a0, a1, left1, decided)


def test_bf16_on_cpu_is_refused_by_name():
    """--bf16 is the bf16 autocast of a CUDA run: on the CPU one message names it (it once ran fp32 in silence)."""
    rcs, out = launch(MG, ["--context-parallel-size", "2", *TINY, "--bf16"])
    assert_one_message(rcs, out, "--bf16 (bf16 autocast) runs on CUDA devices; this run is on the cpu", code=1)


def test_sp_size_not_dividing_world_names_the_key(tmp_path):
    cfg = _ds_config(tmp_path, sequence_parallel_size=3)
    rcs, out = launch(DS, ["--deepspeed-config", cfg, *TINY])
    assert_one_message(rcs, out, "sequence_parallel_size=3 does not divide the world size 2")
    assert cfg in out and "use one of 1, 2" in out


def test_bad_deepspeed_json_value_names_the_key(tmp_path):
    cfg = _ds_config(tmp_path, sequence_parallel_ext={"mode": "bogus"})
    rcs, out = launch(DS, ["--deepspeed-config", cfg, *TINY])
    assert_one_message(rcs, out, "bogus")
    assert "mode" in out


def test_unreadable_deepspeed_json_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rcs, out = launch(DS, ["--deepspeed-config", str(bad), *TINY])
    assert_one_message(rcs, out, f"--deepspeed-config={str(bad)!r}")


# ------------------------------------------------------------------ bad data and checkpoints

def _bad_latents(tmp_path) -> str:
    d = tmp_path / "lat"
    d.mkdir()
    torch.save({"latent": torch.randn(4, 4, 6, 10), "text": torch.randn(8, 7)}, str(d / "a.pt"))
    return str(d)


@pytest.mark.parametrize("script", [MG, DS])
def test_bad_latent_file_one_message(tmp_path, script):
    extra = ["--context-parallel-size", "2"] if script == MG else ["--deepspeed-config", _ds_config(tmp_path)]
    rcs, out = launch(script, [*extra, *TINY, "--data-path", _bad_latents(tmp_path)])
    assert_one_message(rcs, out, "a.pt: text embeddings are 7 wide")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One 1-step checkpoint per entry point (2 ranks)."""
    root = tmp_path_factory.mktemp("ck")
    out = {}
    for script in (MG, DS):
        ck = str(root / os.path.basename(script).split(".")[0])
        extra = ["--context-parallel-size", "2"] if script == MG else ["--deepspeed-config", _ds_config(root)]
        rcs, text = launch(script, [*extra, *TINY, "--save", ck])
        assert rcs == [0, 0], text[-3000:]
        out[script] = (ck, extra)
    return out


def _copy(src, dst) -> str:
    import shutil
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.parametrize("script", [MG, DS])
def test_truncated_checkpoint_one_message(checkpoints, tmp_path, script):
    from training.video_dit.checkpoint import resolve
    src, extra = checkpoints[script]
    ck = _copy(src, tmp_path / "ck")
    step_dir = resolve(ck)
    name = max((f for f in os.listdir(step_dir) if f != "run.json"), key=lambda f: os.path.getsize(os.path.join(step_dir, f)))
    path = os.path.join(step_dir, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    rcs, out = launch(script, [*extra, *TINY, "--train-iters", "2", "--load", ck])
    assert_one_message(rcs, out, f"{name}: ")
    assert "truncated" in out


class _Evil:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['SPX_PWNED'], 'w').write('ran')",))


@pytest.mark.parametrize("script", [MG, DS])
def test_pickled_object_in_checkpoint_one_message(checkpoints, tmp_path, script):
    from training.video_dit.checkpoint import _crc32, resolve
    src, extra = checkpoints[script]
    ck = _copy(src, tmp_path / "ck")
    step_dir = resolve(ck)
    if script == MG:
        name = ".metadata"
        with open(os.path.join(step_dir, name), "wb") as f:
            pickle.dump(_Evil(), f)
    else:
        name = next(f for f in os.listdir(step_dir) if f.endswith("model_states.pt"))
        sd = torch.load(os.path.join(step_dir, name), weights_only=True)
        sd["evil"] = _Evil()
        torch.save(sd, os.path.join(step_dir, name))
    run_json = os.path.join(step_dir, "run.json")
    run = json.load(open(run_json))  # a tamperer keeps run.json consistent
    run["files"][name] = os.path.getsize(os.path.join(step_dir, name))
    run["crc32"][name] = _crc32(os.path.join(step_dir, name))
    json.dump(run, open(run_json, "w"))
    marker = str(tmp_path / "pwned")
    rcs, out = launch(script, [*extra, *TINY, "--train-iters", "2", "--load", ck], env={"SPX_PWNED": marker})
    assert_one_message(rcs, out, f"{name}: ")
    assert "refused" in out and not os.path.exists(marker)


def test_traceback_shown_on_request(tmp_path):
    rcs, out = launch(MG, ["--context-parallel-size", "2", *TINY, "--data-path", _bad_latents(tmp_path)],
                      env={"SPX_TRACEBACK": "1"})
    assert all(rc != 0 for rc in rcs) and "Traceback" in out and "text embeddings are 7 wide" in out, out[-3000:]


# ------------------------------------------------------------------ defaults

def test_megatron_entry_runs_with_only_the_cp_size():
    rcs, out = launch(MG, ["--context-parallel-size", "2", "--train-iters", "1", "--quiet"])
    assert rcs == [0, 0], out[-3000:]


def test_deepspeed_entry_runs_with_only_the_sp_size():
    rcs, out = launch(DS, ["--context-parallel-size", "2", "--train-iters", "1", "--quiet"])
    assert rcs == [0, 0], out[-3000:]


# ------------------------------------------------------------------ dtype across ranks

def _mixed_dtypes(rank, world):
    from megatron_sp_ext import ulysses_attention
    dtype = torch.float32 if rank == 0 else torch.bfloat16
    q = torch.randn(1, 4, 2, 8, dtype=dtype)
    try:
        ulysses_attention(q, q, q, dist.group.WORLD)
    except SPConfigError as e:
        return str(e)
    return None


def test_dtype_differing_across_ranks_is_one_clear_error():
    msgs = run_ranks(_mixed_dtypes, 2)
    for m in msgs:
        assert m is not None and "dtypes differ across ranks" in m, msgs
        assert "rank 0: torch.float32" in m and "rank 1: torch.bfloat16" in m, m
