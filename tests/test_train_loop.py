"""The training loop's speed and health features on CPU (gloo), both entry points: activation
checkpointing and the background data path give bit-identical losses to the plain path; the
non-finite guard stops at the step with the NaN sample file named (checkpoint untouched), skips with
--skip-nonfinite-steps, catches an Inf planted in a gradient; metrics read back every N steps equal
per-step ones; TensorBoard files read back with tensorboard's own reader."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.harness import RankFailure, run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--model", "tiny", "--train-iters", "4", "--frames", "4,3", "--latent-size", "6x10", "--quiet"]


def _allow_workers():
    """harness ranks are daemonic processes, which multiprocessing forbids to start DataLoader workers;
    under torchrun (as users run) they are not. Lift the flag in this rank (test only)."""
    import multiprocessing
    multiprocessing.current_process()._config["daemon"] = False


def _mg(rank, world, extra=()):
    from training import pretrain_video_dit
    _allow_workers()
    argv = [*BASE, "--context-parallel-size", "2", "--cp-comm-type", "hcms", "--hcms-head-chunks", "2", *extra]
    return pretrain_video_dit.main(argv)


def _ds(rank, world, extra=()):
    from training import train_deepspeed
    _allow_workers()
    argv = ["--deepspeed-config", os.path.join(ROOT, "configs", "deepspeed", "cpu_tiny_hcms.json"), *BASE, *extra]
    cfg = {"sequence_parallel_size": 2, "zero_optimization": {"stage": 1},
           "sequence_parallel_ext": {"mode": "hcms", "head_chunks": 2}}
    return train_deepspeed.main(argv, config=cfg)


def _losses(fn, extra=()):
    return run_ranks(lambda r, w: fn(r, w, extra)["losses"], 2)[0]


RECOMPUTE = [("--recompute-granularity", "full"), ("--recompute-granularity", "full", "--recompute-num-layers", "1"),
             ("--recompute-granularity", "selective", "--recompute-modules", "core_attn"),
             ("--recompute-granularity", "selective", "--recompute-modules", "mlp"),
             ("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"),
             ("--recompute-granularity", "selective", "--recompute-modules", "outside_core_attn")]


def test_recompute_bit_identical_megatron():
    plain = _losses(_mg)
    for flags in RECOMPUTE:
        assert _losses(_mg, flags) == plain, flags
    # the fused async block form under selective recompute as well
    asy = _losses(_mg, ("--sp-async-qkv", "on"))
    assert _losses(_mg, ("--sp-async-qkv", "on", "--recompute-granularity", "selective")) == asy


def test_recompute_bit_identical_deepspeed():
    plain = _losses(_ds)
    for flags in (RECOMPUTE[0], RECOMPUTE[4]):
        assert _losses(_ds, flags) == plain, flags


@pytest.mark.parametrize("fn", [_mg, _ds], ids=["megatron", "deepspeed"])
def test_prefetch_workers_bit_identical(fn):
    plain = _losses(fn, ("--num-workers", "0"))
    assert all(x == x for x in plain) and len(plain) == 4
    assert _losses(fn, ("--num-workers", "2")) == plain


def test_step_batches_equal_prepare():
    """The DataLoader path (2 workers, pinned off on CPU) yields exactly engine.prepare's inputs."""
    from training.video_dit import preset
    from training.video_dit.data import SyntheticVideoLatents
    from training.video_dit.engine import flow_matching_batch, prepare
    from training.video_dit.pipeline import StepBatches, step_inputs
    cfg = preset("tiny")
    data = SyntheticVideoLatents(cfg.in_channels, [4, 3], 6, 10, cfg.text_len, cfg.text_dim, seed=3)
    sb = StepBatches(data, start=2, stop=7, seed=9, dp_rank=1, dp_world=2, micro_batch=1, patch=cfg.patch,
                     sp_rank=1, sp_world=4)
    got = list(step_inputs(sb, "cpu", num_workers=2))
    assert [g[0] for g in got] == [2, 3, 4, 5, 6] and [g[2] for g in got] == [[5], [7], [9], [11], [13]]
    for step, inp, _ in got:
        ref = prepare(flow_matching_batch(data, step, 9, 1, 2, 1, cfg.patch), 1, 4, "cpu")
        for k in ("x", "target", "valid", "t", "text", "token_ids"):
            assert torch.equal(getattr(inp, k), getattr(ref, k)), (step, k)
        assert (inp.grid, inp.n_valid, inp.n_pad) == (ref.grid, ref.n_valid, ref.n_pad)


def test_gc_timer_counts_collections_inside_its_block():
    """telemetry.GcTimer: a forced collection inside the block is counted, the callback leaves with the block."""
    import gc
    from training.video_dit.telemetry import GcTimer
    n = len(gc.callbacks)
    with GcTimer() as g:
        junk = [[i] for i in range(200_000)]
        gc.collect()
        assert g.take() > 0 and g.take() == 0.0
    del junk
    assert len(gc.callbacks) == n


def test_manual_gc_turns_the_collector_off_and_collects_at_its_interval(monkeypatch):
    """manual_gc.ManualGc (--manual-gc / --manual-gc-interval): the automatic collector is off inside the block
    and back on after it; a full collection after every interval-th step (0: none); off, it changes nothing."""
    import gc
    from training.video_dit.manual_gc import ManualGc
    assert gc.isenabled()
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))
    with ManualGc(True, 3) as m:
        assert not gc.isenabled() and len(calls) == 1     # one collection on entry, the survivors frozen
        assert gc.get_freeze_count() > 0
        for step in range(7):
            m.step_done(step)
    assert gc.isenabled() and len(calls) == 1 + 2         # after steps 2 and 5
    assert gc.get_freeze_count() == 0
    with ManualGc(True, 0) as m:
        for step in range(5):
            m.step_done(step)
    assert len(calls) == 4 and gc.isenabled()
    with ManualGc(False, 0) as m:
        assert gc.isenabled()
        m.step_done(0)
    assert len(calls) == 4
    with pytest.raises(ValueError, match="--manual-gc-interval=-1"):
        ManualGc(True, -1)


def test_default_workers_scale_with_the_ranks_share_of_cpus(monkeypatch):
    """--num-workers default: half the rank's CPUs, 2 to 8, on CUDA (LOCAL_WORLD_SIZE ranks share the host); 0 on
    CPU; a given value is kept."""
    import argparse
    from training.video_dit.loop import default_workers, resolve_workers
    assert [default_workers(16, 1), default_workers(16, 4), default_workers(128, 8), default_workers(32, 8),
            default_workers(2, 1)] == [8, 2, 8, 2, 2]
    args = argparse.Namespace(num_workers=None)
    assert resolve_workers(args, "cpu") == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_workers(args, "cuda") == 3
    assert resolve_workers(argparse.Namespace(num_workers=5), "cuda") == 5


@pytest.mark.parametrize("flags, says", [
    (("--manual-gc-interval", "-1", "--manual-gc"), "--manual-gc-interval=-1: must be >= 0"),
    (("--manual-gc-interval", "5"), "--manual-gc-interval=5 is set without --manual-gc"),
    (("--num-workers", "-2"), "--num-workers=-2: must be >= 0")])
def test_gc_and_worker_flags_refused_by_name(flags, says):
    """Bad --manual-gc-interval / --num-workers: one line naming the flag, exit 2, no traceback."""
    r = subprocess.run([sys.executable, "-m", "training.pretrain_video_dit", *BASE, *flags], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_manual_gc_bit_identical():
    """--manual-gc (collector off, a collection every 2 steps) trains exactly the plain run's losses."""
    plain = _losses(_mg)
    assert _losses(_mg, ("--manual-gc", "--manual-gc-interval", "2")) == plain


def test_device_batches_prefetch_one_ahead_and_count_the_wait():
    """pipeline.DeviceBatches: the batches unchanged and in order; ``prefetch()`` takes the next one from the
    loader once (a second call is a no-op) and ``next`` then returns it without reading further; the host ms a
    slow loader made the consumer wait are counted where the wait happened (in prefetch), then reset."""
    import time
    from training.video_dit import preset
    from training.video_dit.data import SyntheticVideoLatents
    from training.video_dit.pipeline import DeviceBatches, StepBatches
    cfg = preset("tiny")
    data = SyntheticVideoLatents(cfg.in_channels, [4], 6, 10, cfg.text_len, cfg.text_dim, seed=3)
    sb = StepBatches(data, start=0, stop=3, seed=9, dp_rank=0, dp_world=1, micro_batch=1, patch=cfg.patch,
                     sp_rank=0, sp_world=1)
    read = []

    def slow():
        for i in range(len(sb)):
            read.append(i)
            if i == 1:
                time.sleep(0.05)
            yield sb[i]
    d = DeviceBatches(slow(), "cpu")
    step, inp, ids = next(d)
    assert (step, ids, read) == (0, [0], [0]) and d.take_wait_ms() < 45
    d.prefetch()
    d.prefetch()
    assert read == [0, 1] and d.take_wait_ms() >= 45 and d.take_wait_ms() == 0.0
    step, inp, ids = next(d)
    assert (step, read) == (1, [0, 1]) and torch.equal(inp.x, sb[1]["x"])
    assert [s for s, _, _ in d] == [2] and d.take_wait_ms() < 45


def test_sample_position_follows_a_global_batch_change():
    """A checkpoint taken after 4 samples at global batch 2 (step 2), resumed at global batch 1: steps 2, 3
    read samples 4, 5 (none repeated, none skipped); unchanged global batch: no offset."""
    from training.video_dit import preset
    from training.video_dit.data import SyntheticVideoLatents
    from training.video_dit.engine import flow_matching_batch, prepare
    from training.video_dit.pipeline import StepBatches, consumed_samples, resume_base, step_inputs
    cfg = preset("tiny")
    data = SyntheticVideoLatents(cfg.in_channels, [4, 3], 6, 10, cfg.text_len, cfg.text_dim, seed=3)
    assert resume_base(None, 0, 2) == (0, None)
    assert resume_base({"step": 2, "consumed_samples": 4, "global_batch": 2}, 2, 2) == (0, None)
    assert resume_base({"step": 2}, 2, 1) == (0, None)  # a checkpoint that does not say: step x global batch
    base, note = resume_base({"step": 2, "consumed_samples": 4, "global_batch": 2}, 2, 1)
    assert base == 2 and "sample stream at sample 4" in note
    sb = StepBatches(data, start=2, stop=4, seed=9, dp_rank=0, dp_world=1, micro_batch=1, patch=cfg.patch,
                     sp_rank=0, sp_world=2, base=base)
    got = list(step_inputs(sb, "cpu"))
    assert [g[2] for g in got] == [[4], [5]]
    ref = prepare(flow_matching_batch(data, 4, 9, 0, 1, 1, cfg.patch), 0, 2, "cpu")  # sample 4 read as step 4
    assert torch.equal(got[0][1].x, ref.x) and torch.equal(got[0][1].target, ref.target)
    assert consumed_samples(4, base, 1) == 6


def test_log_interval_rows_equal_per_step(tmp_path):
    one = run_ranks(lambda r, w: _mg(r, w, ("--log-dir", str(tmp_path / "a")))["rows"], 2)[0]
    three = run_ranks(lambda r, w: _mg(r, w, ("--log-dir", str(tmp_path / "b"), "--log-interval", "3",
                                              "--no-check-for-nan-in-loss-and-grad"))["rows"], 2)[0]
    assert [r["step"] for r in three] == [0, 1, 2, 3]
    for a, b in zip(one, three):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                     rel=1e-6)
        assert b["lr"] == pytest.approx(2e-3) and b["skipped_steps"] == 0 and b["tokens_per_s"] > 0
    rows = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["loss"] for r in rows] == [r["loss"] for r in three]


def _nan_data(tmp_path, bad: int = 3) -> str:
    from training.video_dit.make_latents import main as make
    out = str(tmp_path / "lat")
    make(["--out", out, "--num", "6", "--frames", "4", "--size", "6x10"])
    f = os.path.join(out, f"sample_{bad:06d}.pt")
    d = torch.load(f, weights_only=True)
    d["latent"][0, 1, 2, 3] = float("nan")
    torch.save(d, f)
    return out


def test_nan_sample_stops_megatron_checkpoint_untouched(tmp_path):
    data, ck = _nan_data(tmp_path), str(tmp_path / "ck")
    flags = ("--data-path", data, "--frames", "4", "--save", ck, "--save-interval", "2", "--train-iters", "6")
    with pytest.raises(RankFailure) as e:
        run_ranks(lambda r, w: _mg(r, w, flags), 2)
    msg = str(e.value)
    assert "NonFiniteError" in msg and "step 3" in msg and "sample_000003.pt" in msg and "rank(s) [0, 1]" in msg
    from training.video_dit.checkpoint import load_model_tensors, read_run, resolve
    assert read_run(resolve(ck), {})["step"] == 2
    model = load_model_tensors(ck)
    assert len(model) > 10 and all(torch.isfinite(v).all() for v in model.values())


def test_nan_sample_skip_megatron(tmp_path):
    data = _nan_data(tmp_path)
    res = run_ranks(lambda r, w: _mg(r, w, ("--data-path", data, "--frames", "4", "--train-iters", "6",
                                            "--skip-nonfinite-steps", "1")), 2)[0]
    losses, rows = res["losses"], res["rows"]
    assert losses[3] != losses[3] and all(x == x for i, x in enumerate(losses) if i != 3)
    assert [r["skipped_steps"] for r in rows] == [0, 0, 0, 1, 1, 1]
    with pytest.raises(RankFailure, match="already skipped 1 step"):  # a second bad step is one too many
        data2 = _nan_data(tmp_path / "two", bad=1)
        d = torch.load(os.path.join(data2, "sample_000001.pt"), weights_only=True)
        torch.save(d, os.path.join(data2, "sample_000004.pt"))
        run_ranks(lambda r, w: _mg(r, w, ("--data-path", data2, "--frames", "4", "--train-iters", "6",
                                          "--skip-nonfinite-steps", "1")), 2)


def test_inf_grad_hook_caught_megatron():
    with pytest.raises(RankFailure) as e:
        run_ranks(lambda r, w: _mg(r, w, ("--debug-inf-grad-step", "2")), 2)
    assert "step 2: gradient norm non-finite on rank(s) [0, 1]" in str(e.value)
    res = run_ranks(lambda r, w: _mg(r, w, ("--debug-inf-grad-step", "2", "--skip-nonfinite-steps", "1")), 2)[0]
    assert [r["skipped_steps"] for r in res["rows"]] == [0, 0, 1, 1]
    assert all(x == x and abs(x) != float("inf") for x in res["losses"])

    # the same guard with FSDP2 (the norm is a DTensor reduction over the data x context shards)
    with pytest.raises(RankFailure) as e:
        run_ranks(lambda r, w: _mg(r, w, ("--debug-inf-grad-step", "2", "--use-torch-fsdp2")), 2)
    assert "step 2: gradient norm non-finite on rank(s) [0, 1]" in str(e.value)
    res = run_ranks(lambda r, w: _mg(r, w, ("--debug-inf-grad-step", "2", "--skip-nonfinite-steps", "1",
                                            "--use-torch-fsdp2")), 2)[0]
    assert [r["skipped_steps"] for r in res["rows"]] == [0, 0, 1, 1]


def test_nan_sample_deepspeed(tmp_path):
    data, ck = _nan_data(tmp_path), str(tmp_path / "ck")
    flags = ("--data-path", data, "--frames", "4", "--save", ck, "--save-interval", "2", "--train-iters", "6")
    with pytest.raises(RankFailure) as e:
        run_ranks(lambda r, w: _ds(r, w, flags), 2)
    assert "step 3" in str(e.value) and "sample_000003.pt" in str(e.value)
    assert open(os.path.join(ck, "latest")).read().strip() == "iter_0000002"
    assert sorted(x for x in os.listdir(ck) if x.startswith("iter_")) == ["iter_0000002"]
    res = run_ranks(lambda r, w: _ds(r, w, ("--data-path", data, "--frames", "4", "--train-iters", "6",
                                            "--skip-nonfinite-steps", "1")), 2)[0]
    assert [r["skipped_steps"] for r in res["rows"]] == [0, 0, 0, 1, 1, 1] and res["losses"][5] == res["losses"][5]


def test_inf_grad_hook_caught_deepspeed():
    with pytest.raises(RankFailure) as e:
        run_ranks(lambda r, w: _ds(r, w, ("--debug-inf-grad-step", "1")), 2)
    assert "step 1: gradient norm non-finite" in str(e.value)


def test_tensorboard_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = str(tmp_path / "tb")
    res = run_ranks(lambda r, w: _mg(r, w, ("--tensorboard-dir", tb, "--log-interval", "2")), 2)[0]
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for t in ("train/loss", "train/grad_norm", "train/lr", "train/step_time_s", "train/tokens_per_s",
              "train/skipped_steps"):
        assert t in tags, tags
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in got] == [0, 1, 2, 3]
    assert [v for _, v in got] == pytest.approx(res["losses"], rel=1e-6)


def test_entry_exit_code_and_message(tmp_path):
    """As a user runs it (torchrun): non-zero exit, the step and file in the error."""
    data = _nan_data(tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29561",
           os.path.join(ROOT, "training", "pretrain_video_dit.py"), *BASE, "--context-parallel-size", "2",
           "--cp-comm-type", "ulysses", "--data-path", data, "--frames", "4", "--train-iters", "5"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode != 0
    assert "NonFiniteError" in p.stderr and "step 3" in p.stderr and "sample_000003.pt" in p.stderr


def test_loss_spike_warning(caplog):
    from training.video_dit.guard import SpikeDetector
    det = SpikeDetector(factor=3.0, window=20, min_history=5)
    flags = [det.update(i, v, [f"s{i}"]) for i, v in enumerate([1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 3.5, 1.0, float("nan")])]
    assert flags == [False] * 6 + [True, False, False] and det.spikes == [6]
    assert "loss spike at step 6" in caplog.text and "s6" in caplog.text


def test_bad_flags_name_the_flag():
    from training.video_dit import VideoDiT, preset
    m = VideoDiT(preset("tiny"))
    with pytest.raises(ValueError, match="--recompute-num-layers=5"):
        m.set_recompute("full", num_layers=5)
    with pytest.raises(ValueError, match="--recompute-modules"):
        m.set_recompute("selective", ("attn",))
    from training.video_dit.guard import StepGuard
    with pytest.raises(ValueError, match="--skip-nonfinite-steps=-1"):
        StepGuard(True, -1, 0, 1, 1)


@pytest.mark.parametrize("fn", [_mg, _ds], ids=["megatron", "deepspeed"])
def test_timing_rows_and_bare_steps(tmp_path, fn):
    """--timing: per-step fwd+bwd / optimizer spans in the rows, timing.json with the bare steps and ratios."""
    log = str(tmp_path / "log")
    res = run_ranks(lambda r, w: fn(r, w, ("--timing", "--timing-bare-steps", "2", "--log-dir", log)), 2)[0]
    assert all(r["model_fwd_bwd_ms"] > 0 and r["optimizer_ms"] > 0 and r["data_wait_ms"] >= 0 for r in res["rows"])
    t = json.load(open(os.path.join(log, "timing.json")))
    assert t["bare_step_ms"] == pytest.approx(res["timing"]["bare_step_ms"]) and t["bare_step_ms"] > 0
    assert len(t["bare_step_ms_all"]) == 2
    assert t["entry_over_bare"] == pytest.approx(t["entry_step_ms"] / t["bare_step_ms"])
    assert t["entry_over_model_and_opt"] > 0 and t["rows_used"] == 2
    assert t["data_wait_ms"] == sorted(r["data_wait_ms"] for r in res["rows"][-2:])[1]
    assert all(r["gc_ms"] >= 0 for r in res["rows"]) and t["gc_ms"] == pytest.approx(
        sum(r["gc_ms"] for r in res["rows"][-2:]) / 2)
    assert t["alloc_retries"] is None and "alloc_retries" not in res["rows"][0]   # CPU: no caching allocator


def test_timing_counts_allocator_retries_over_the_timed_rows(tmp_path):
    """timing.json's alloc_retries: the CUDA allocator's retries during the rows the medians use (the counter in
    the rows is cumulative), alloc_retries_total all of them."""
    from types import SimpleNamespace

    from training.video_dit.loop import _write_timing
    rows = [{"step": i, "step_time_s": 1.0, "alloc_retries": r} for i, r in enumerate((3, 5, 7, 9, 12, 12, 14, 20))]
    log = SimpleNamespace(rows=rows, timing={"bare_step_ms": 1000.0}, log_dir=str(tmp_path))
    _write_timing(log, 0, 1)
    t = json.load(open(os.path.join(str(tmp_path), "timing.json")))
    assert t["alloc_retries"] == 20 - 5 and t["alloc_retries_total"] == 20 and t["rows_used"] == 6   # from row 1's
    for r in rows[:2]:
        r["alloc_retries"] = None     # no counter before the timed rows: they count from 0
    log = SimpleNamespace(rows=rows, timing={"bare_step_ms": 1000.0}, log_dir=str(tmp_path))
    _write_timing(log, 0, 1)
    t = json.load(open(os.path.join(str(tmp_path), "timing.json")))
    assert t["rows_used"] == 6 and t["alloc_retries"] == 20


def test_megatron_only_flags_rejected_on_torch_ddp():
    with pytest.raises(RankFailure, match="--use-distributed-optimizer.*CUDA"):
        run_ranks(lambda r, w: _mg(r, w, ("--use-distributed-optimizer",)), 2)


def test_profile_writes_trace_and_tables(tmp_path):
    log = str(tmp_path / "log")
    run_ranks(lambda r, w: _mg(r, w, ("--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                                      "--log-dir", log)), 2)
    assert os.path.exists(os.path.join(log, "profile_rank0.json")) and not os.path.exists(
        os.path.join(log, "profile_rank1.json"))
    table = open(os.path.join(log, "profile_rank0.txt")).read()
    assert "steps [1, 3) on rank 0" in table and "aten::" in table
    json.load(open(os.path.join(log, "profile_rank0.json")))
