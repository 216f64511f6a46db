"""Checkpoints a long run can trust (CPU, gloo): exact resume on the same layout and across layouts
(SP size, cp_comm_type) for both entry points; a save killed mid-write leaves the previous
checkpoint loadable; truncated, foreign, empty and pickle-carrying checkpoints are refused with one
clear error; bad latent files are refused before the first step; a rank killed mid-step ends the
whole torchrun job within the collective timeout with the rank named."""
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.harness import RankFailure, run_ranks  # noqa: E402
from training.video_dit.checkpoint import iter_name, list_checkpoints, read_run, resolve  # noqa: E402
from training.video_dit.faults import ROLL_CALL_SECONDS  # noqa: E402
from training.video_dit.safe_load import CheckpointError, check_weights_only, read_dcp_metadata  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ("--model", "tiny", "--frames", "4,3", "--latent-size", "6x10", "--quiet")


def _mg(rank, world, cp, mode, steps, extra=()):
    from training import pretrain_video_dit
    chunks = ("--hcms-head-chunks", "2") if mode == "hcms" else ()
    return pretrain_video_dit.main(["--context-parallel-size", str(cp), "--cp-comm-type", mode, *chunks,
                                    "--train-iters", str(steps), *COMMON, *extra])["losses"]


def _ds(rank, world, sp, mode, steps, extra=(), zero=1):
    from training import train_deepspeed
    block = {"mode": mode, **({"head_chunks": 2} if mode == "hcms" else {})}
    cfg = {"sequence_parallel_size": sp, "zero_optimization": {"stage": zero}, "sequence_parallel_ext": block}
    argv = ["--deepspeed-config", os.path.join(ROOT, "configs", "deepspeed", "cpu_tiny_hcms.json"),
            "--train-iters", str(steps), *COMMON, *extra]
    return train_deepspeed.main(argv, config=cfg)["losses"]


def _close(got, want, tol=1e-5):
    assert len(got) == len(want), (got, want)
    for a, b in zip(got, want):
        assert abs(a - b) <= tol * max(abs(b), 1e-12), f"{got} vs {want}"


# ------------------------------------------------------------------ resume, same and other layouts

ASYNC = ("--sp-async-qkv", "on")  # another block form: the async Ulysses block


@pytest.mark.parametrize("a,b", [((4, "hcms"), (2, "ulysses")), ((2, "ulysses"), (4, "hcms")),
                                 ((4, "ulysses"), (4, "hcms")), ((2, "ulysses"), (2, "hcms", ASYNC)),
                                 ((4, "hcms", ASYNC), (2, "ulysses"))])
def test_megatron_resume_across_layouts(tmp_path, a, b):
    ck = str(tmp_path / "ck")
    fa, fb = (a[2] if len(a) > 2 else ()), (b[2] if len(b) > 2 else ())
    straight = run_ranks(_mg, a[0], a[0], a[1], 6, fa)[0]
    first = run_ranks(_mg, a[0], a[0], a[1], 4, (*fa, "--save", ck, "--save-interval", "2", "--keep-last", "1"))[0]
    assert [os.path.basename(p) for p in list_checkpoints(ck)] == ["iter_0000004"]  # --keep-last 1 pruned 2
    rest = run_ranks(_mg, b[0], b[0], b[1], 6, (*fb, "--load", ck))[0]
    _close(first + rest, straight)
    run = read_run(resolve(ck), {})
    assert run["world"] == a[0] and run["optimizer_impl"] == "torch"
    assert sum(f.endswith(".distcp") for f in run["files"]) == a[0]  # every rank wrote its own shard


def test_megatron_resume_across_dp_sizes(tmp_path):
    """DP=2 x CP=2 (one sample per DP rank) -> DP=1 x CP=2 (two samples per micro-batch): the same global batch,
    so the resumed run continues the uninterrupted one (samples and their noise are keyed by global index)."""
    ck = str(tmp_path / "ck")
    same = ("--frames", "4")  # one latent shape: a micro-batch of two needs equal shapes
    straight = run_ranks(_mg, 4, 2, "hcms", 6, same)[0]
    first = run_ranks(_mg, 4, 2, "hcms", 4, (*same, "--save", ck, "--save-interval", "4"))[0]
    rest = run_ranks(_mg, 2, 2, "ulysses", 6, (*same, "--micro-batch-size", "2", "--load", ck))[0]
    _close(first + rest, straight)
    assert read_run(resolve(ck), {})["world"] == 4
    # the global batch changes (2 -> 1): the data position follows the samples consumed, not the step
    ck2 = str(tmp_path / "ck2")
    run_ranks(_mg, 4, 2, "hcms", 2, (*same, "--save", ck2))
    assert {k: read_run(resolve(ck2), {})[k] for k in ("step", "consumed_samples", "global_batch")} == \
        {"step": 2, "consumed_samples": 4, "global_batch": 2}
    run_ranks(_mg, 2, 2, "ulysses", 4, (*same, "--load", ck2, "--save", ck2))
    assert {k: read_run(resolve(ck2), {})[k] for k in ("step", "consumed_samples", "global_batch")} == \
        {"step": 4, "consumed_samples": 6, "global_batch": 1}


@pytest.mark.parametrize("a,b,zero", [((2, "ulysses"), (4, "hcms"), 0), ((4, "hcms"), (2, "ulysses"), 0),
                                      ((4, "ulysses"), (4, "hcms"), 1)])
def test_deepspeed_resume_across_layouts(tmp_path, a, b, zero):
    ck = str(tmp_path / "ck")
    straight = run_ranks(_ds, a[0], a[0], a[1], 6, zero=zero)[0]
    first = run_ranks(_ds, a[0], a[0], a[1], 4, ("--save", ck), zero=zero)[0]
    rest = run_ranks(_ds, b[0], b[0], b[1], 6, ("--load", ck), zero=zero)[0]
    _close(first + rest, straight)
    run = read_run(resolve(ck), {"entry": "deepspeed"})
    assert (run["step"], run["world"], run["zero_stage"]) == (4, a[0], zero)


@pytest.mark.parametrize("a,b", [((2, "ulysses"), (4, "hcms")), ((4, "hcms"), (2, "ulysses"))])
def test_deepspeed_zero1_resume_other_world_via_universal(tmp_path, a, b):
    """ZeRO-1 optimizer state partitioned over 2 (4) ranks resumes on 4 (2) through DeepSpeed's
    universal checkpoint."""
    ck = str(tmp_path / "ck")
    straight = run_ranks(_ds, a[0], a[0], a[1], 6)[0]
    first = run_ranks(_ds, a[0], a[0], a[1], 4, ("--save", ck))[0]
    rest = run_ranks(_ds, b[0], b[0], b[1], 6, ("--load", ck))[0]
    _close(first + rest, straight)
    assert os.path.isfile(os.path.join(resolve(ck), "universal", "converted"))


def test_deepspeed_failed_universal_conversion_is_one_clear_error(tmp_path):
    """The conversion runs on rank 0 only: when it fails (here its work directory cannot be created),
    every rank raises the same error naming the checkpoint instead of waiting at a barrier."""
    ck = str(tmp_path / "ck")
    run_ranks(_ds, 2, 2, "ulysses", 2, ("--save", ck))
    (tmp_path / "ck" / "iter_0000002" / "universal.partial").write_text("in the way")
    t0 = time.time()
    with pytest.raises(RankFailure, match=r"iter_0000002: converting the ZeRO checkpoint to DeepSpeed's universal "
                                          r"form .* failed on rank 0: (FileExists|NotADirectory)Error"):
        run_ranks(_ds, 4, 4, "ulysses", 3, ("--load", ck))
    assert time.time() - t0 < 60  # not a collective timeout


# ------------------------------------------------------------------ a save killed mid-write

def _killed_mid_save(rank, world, ck):
    """Train 4 steps saving every 2; the save at step 4 is SIGKILLed after the DCP shard was written."""
    import training.video_dit.checkpoint as ckpt
    real = ckpt.save_rng

    def dying(step_dir, r):
        if step_dir.endswith("iter_0000004.partial"):
            with open(os.path.join(step_dir, "half_written"), "wb") as f:
                f.write(b"\0" * 100)
            os.kill(os.getpid(), signal.SIGKILL)
        real(step_dir, r)
    ckpt.save_rng = dying
    return _mg(rank, world, 1, "ulysses", 4, ("--save", ck, "--save-interval", "2"))


def test_kill_during_checkpoint_write_keeps_previous(tmp_path):
    ck = str(tmp_path / "ck")
    straight = run_ranks(_mg, 1, 1, "ulysses", 5)[0]
    with pytest.raises(RankFailure, match="code -9"):
        run_ranks(_killed_mid_save, 1, ck)
    assert os.path.isdir(os.path.join(ck, "iter_0000004.partial"))  # the interrupted write is there...
    assert resolve(ck).endswith("iter_0000002")                      # ...and latest still names step 2
    rest = run_ranks(_mg, 1, 1, "ulysses", 5, ("--load", ck, "--save", ck))[0]
    _close(rest, straight[2:], tol=0)  # same layout: bit-identical
    assert not os.path.exists(os.path.join(ck, "iter_0000004.partial"))  # the next save cleaned it up


# ------------------------------------------------------------------ refused checkpoints

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ck = str(tmp_path_factory.mktemp("saved") / "ck")
    run_ranks(_mg, 2, 2, "ulysses", 2, ("--save", ck))
    return ck


def _copy(src, tmp_path):
    import shutil
    dst = str(tmp_path / "ck")
    shutil.copytree(src, dst)
    return dst


def _retamper(step_dir, rel):
    """What a tamperer who knows the format does: make run.json's size and CRC agree with the changed file."""
    from training.video_dit.checkpoint import _crc32
    path = os.path.join(step_dir, "run.json")
    run = json.load(open(path))
    run["files"][rel] = os.path.getsize(os.path.join(step_dir, rel))
    run["crc32"][rel] = _crc32(os.path.join(step_dir, rel))
    json.dump(run, open(path, "w"))


def test_truncated_checkpoint_clear_error(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    shard = os.path.join(resolve(ck), "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: \d+ bytes, \d+ when saved: truncated"):
        read_run(resolve(ck), {})
    with pytest.raises(RankFailure, match="truncated"):  # and through the entry point, on every rank
        run_ranks(_mg, 2, 2, "ulysses", 3, ("--load", ck))


def test_corrupt_metadata_clear_error(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    meta = os.path.join(resolve(ck), ".metadata")
    data = open(meta, "rb").read()
    with open(meta, "wb") as f:  # same size (passes the size check), garbage inside
        f.write(bytes(b ^ 0x5A for b in data))
    with pytest.raises(RankFailure, match=r"\.metadata: its bytes changed since the save \(CRC-32"):
        run_ranks(_mg, 1, 1, "ulysses", 3, ("--load", ck))
    _retamper(resolve(ck), ".metadata")  # checksums made to agree: the allowlisted reader still refuses it
    with pytest.raises(RankFailure, match=r"\.metadata: not a valid torch\.distributed\.checkpoint metadata"):
        run_ranks(_mg, 1, 1, "ulysses", 3, ("--load", ck))


def test_flipped_tensor_byte_is_caught_by_checksum(saved, tmp_path):
    """A shard whose tensor bytes changed but whose size did not (bit rot, a bad copy) used to load
    silently with different weights; every rank checks its share of the files against run.json."""
    ck = _copy(saved, tmp_path)
    shard = os.path.join(resolve(ck), "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(16)
        b = f.read(1)
        f.seek(16)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(RankFailure, match=r"__1_0\.distcp: its bytes changed since the save \(CRC-32"):
        run_ranks(_mg, 2, 2, "ulysses", 3, ("--load", ck))
    from training.video_dit.checkpoint import load_model_tensors
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: its bytes changed since the save"):
        load_model_tensors(ck)


class _Evil:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['SPX_PWNED'], 'w').write('ran')",))


def test_pickled_object_in_checkpoint_is_refused(saved, tmp_path, monkeypatch):
    marker = str(tmp_path / "pwned")
    monkeypatch.setenv("SPX_PWNED", marker)
    ck = _copy(saved, tmp_path)
    step_dir = resolve(ck)
    meta = os.path.join(step_dir, ".metadata")
    with open(meta, "wb") as f:
        pickle.dump(_Evil(), f)
    _retamper(step_dir, ".metadata")  # a tamperer keeps run.json consistent
    with pytest.raises(CheckpointError, match="refused global builtins.exec"):
        read_dcp_metadata(meta)
    with pytest.raises(RankFailure, match="refused global builtins.exec"):
        run_ranks(_mg, 1, 1, "ulysses", 3, ("--load", ck))
    assert not os.path.exists(marker)
    evil_pt = str(tmp_path / "optim_states.pt")  # the DeepSpeed gate: torch.save files
    torch.save({"state": _Evil()}, evil_pt)
    with pytest.raises(CheckpointError, match="refused - holds a pickled object"):
        check_weights_only(evil_pt)
    assert not os.path.exists(marker)


def _save_with_payload_then_load(rank, world, root, marker):
    """A checkpoint written through our own save whose optimizer param group carries a pickled object
    (DCP stores non-tensor items as pickles inside the shard files, not in .metadata); then loaded."""
    from training.video_dit import checkpoint as ckpt
    os.environ["SPX_PWNED"] = marker
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    opt.param_groups[0]["weight_decay"] = _Evil()
    ckpt.save(root, 1, model, opt, {"entry": "t"}, 3)
    model2 = torch.nn.Linear(3, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    try:
        ckpt.load(root, model2, opt2, {"entry": "t"})
    except CheckpointError as e:
        return str(e)
    return None


def test_pickled_object_in_shard_byte_item_is_refused(tmp_path):
    """The payload sits in a .distcp shard (a param-group value), past the .metadata allowlist: the
    load must refuse that item with a clear error and never run it."""
    marker = str(tmp_path / "pwned")
    root = str(tmp_path / "ck")
    err = run_ranks(_save_with_payload_then_load, 1, root, marker)[0]
    assert err is not None and "refused - item" in err and "optimizer.param_groups" in err, err
    assert resolve(root) in err
    assert not os.path.exists(marker), "the pickled payload ran during the load"
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from training.video_dit.safe_load import safe_byte_items
    original = DefaultLoadPlanner.load_bytes
    with safe_byte_items():
        assert DefaultLoadPlanner.load_bytes is not original
    assert DefaultLoadPlanner.load_bytes is original  # the guard is undone after the load


def test_deepspeed_pickled_object_is_refused(tmp_path, monkeypatch):
    marker = str(tmp_path / "pwned")
    monkeypatch.setenv("SPX_PWNED", marker)
    ck = str(tmp_path / "ck")
    run_ranks(_ds, 1, 1, "ulysses", 1, ("--save", ck))
    step_dir = resolve(ck)
    (model_file,) = [f for f in os.listdir(step_dir) if f.endswith("model_states.pt")]
    path = os.path.join(step_dir, model_file)
    sd = torch.load(path, weights_only=True)
    sd["evil"] = _Evil()
    torch.save(sd, path)
    _retamper(step_dir, model_file)
    with pytest.raises(RankFailure, match="model_states.pt: refused - holds a pickled object"):
        run_ranks(_ds, 1, 1, "ulysses", 2, ("--load", ck))
    assert not os.path.exists(marker)


def test_empty_missing_foreign_load_dirs(tmp_path, saved):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="the directory is empty, nothing to resume from"):
        resolve(str(empty))
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve(str(tmp_path / "nope"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a checkpoint written by this trainer"):
        resolve(str(foreign))
    bad_latest = tmp_path / "bad_latest"
    bad_latest.mkdir()
    (bad_latest / "latest").write_text("../../etc")
    with pytest.raises(CheckpointError, match="expected a checkpoint name"):
        resolve(str(bad_latest))
    # latest naming a directory that is gone (#83 item 7: it said "incomplete (no run.json)")
    gone = tmp_path / "gone"
    shutil.copytree(saved, gone)
    (gone / "latest").write_text(iter_name(9) + "\n")
    with pytest.raises(CheckpointError) as e:
        resolve(str(gone))
    assert (f"{gone / 'latest'} names iter_0000009, but {gone / 'iter_0000009'} does not exist" in str(e.value)
            and f"--load {gone / os.path.basename(resolve(saved))}" in str(e.value)
            and "no run.json" not in str(e.value)), str(e.value)
    for d in os.listdir(gone):
        if d != "latest":
            shutil.rmtree(gone / d)
    with pytest.raises(CheckpointError, match="no complete checkpoint is left there: drop --load"):
        resolve(str(gone))
    with pytest.raises(CheckpointError, match=r"written by the 'megatron-core' entry point \(training/pretrain_video_dit"
                                              r"\.py\); this is 'deepspeed'"):
        read_run(resolve(saved), {"entry": "deepspeed"})
    with pytest.raises(RankFailure, match="the directory is empty"):  # never a silent fresh start
        run_ranks(_mg, 1, 1, "ulysses", 2, ("--load", str(empty)))


def test_identity_mismatch_names_the_field_and_the_flag(saved):
    """Another model or optimizer: the error lists only the differing fields and the flag to set."""
    from training.video_dit import preset
    from training.video_dit.checkpoint import describe
    other = describe(preset("tiny", 3), "tiny")
    with pytest.raises(CheckpointError) as e:
        read_run(resolve(saved), other)
    msg = str(e.value)
    assert "another model (layers: 2 saved, 3 now)" in msg, msg
    assert "--model tiny --num-layers 2" in msg, msg
    with pytest.raises(CheckpointError, match=r"saved by the 'torch' optimizer, this run uses 'megatron'; resume "
                                              r"with --ddp-impl torch"):
        read_run(resolve(saved), {"optimizer_impl": "megatron"})
    # the saved run is dense (a checkpoint without the key reads as "no gates"): a --sparse-topk run is refused by
    # name, a --sparse-window run (same parameters) is not
    same = describe(preset("tiny", 2), "tiny")
    read_run(resolve(saved), {**same, "sparse_gates": False})
    with pytest.raises(CheckpointError, match=r"saved without the top-k sparse attention's gates .* resume with the "
                                              r"same kind of run \(--sparse-topk with --sparse-topk"):
        read_run(resolve(saved), {**same, "sparse_gates": True})


def _names(ck):
    return [os.path.basename(p) for p in list_checkpoints(ck)]


@pytest.mark.parametrize("entry", ["megatron", "deepspeed"])
def test_resume_past_train_iters_is_refused(tmp_path, entry):
    """A checkpoint at step 4 resumed with --train-iters 2 is refused (it would relabel step-4 weights as
    step 2 and move ``latest`` back); with --train-iters 4 nothing runs and nothing is re-saved."""
    fn = _mg if entry == "megatron" else _ds
    ck = str(tmp_path / "ck")
    run_ranks(fn, 1, 1, "ulysses", 4, ("--save", ck))
    assert _names(ck) == ["iter_0000004"]
    with pytest.raises(RankFailure, match=r"saved at step 4, past --train-iters=2; set --train-iters to 4 or more"):
        run_ranks(fn, 1, 1, "ulysses", 2, ("--load", ck, "--save", ck))
    assert _names(ck) == ["iter_0000004"] and open(os.path.join(ck, "latest")).read().strip() == "iter_0000004"
    mtime = os.path.getmtime(os.path.join(resolve(ck), "run.json"))
    assert run_ranks(fn, 1, 1, "ulysses", 4, ("--load", ck, "--save", ck))[0] == []
    assert _names(ck) == ["iter_0000004"] and os.path.getmtime(os.path.join(resolve(ck), "run.json")) == mtime


def test_resave_interrupted_between_renames_resumes_from_stale(saved, tmp_path):
    """commit_save re-saving the step ``latest`` names moves the old copy to .stale, then the new one
    in: a crash between the two renames must still resume, from the complete .stale copy."""
    ck = _copy(saved, tmp_path)
    step_dir = resolve(ck)
    os.rename(step_dir, step_dir + ".stale")
    assert resolve(ck) == step_dir + ".stale"
    want = run_ranks(_mg, 2, 2, "ulysses", 4, ("--load", saved))[0]
    got = run_ranks(_mg, 2, 2, "ulysses", 4, ("--load", ck))[0]
    assert got == want and len(got) == 2, (got, want)


def test_keep_last_never_prunes_latest_and_rejects_negative(tmp_path):
    from training.video_dit.checkpoint import iter_name, prune
    root = tmp_path / "ck"
    for step in (1, 2, 3, 4):
        d = root / iter_name(step)
        d.mkdir(parents=True)
        (d / "run.json").write_text("{}")
    (root / "latest").write_text(iter_name(1))  # e.g. a resume from an older step
    prune(str(root), 2)
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000003", "iter_0000004", "latest"]
    with pytest.raises(RankFailure, match="argument --keep-last: '-1': expected a whole number >= 0"):
        run_ranks(_mg, 1, 1, "ulysses", 2, ("--keep-last", "-1"))


# ------------------------------------------------------------------ bad data

def _write(path, latent, text, fmt):
    from training.video_dit.data import write_sample
    write_sample(path, latent, text, fmt)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_bad_latent_files_fail_up_front(tmp_path, fmt):
    from training.video_dit.config import preset
    from training.video_dit.data import LatentFileError, LatentShardDataset
    cfg = preset("tiny")
    kw = dict(channels=cfg.in_channels, text_dim=cfg.text_dim, patch=cfg.patch)
    good_l, good_t = torch.randn(4, 3, 6, 10), torch.randn(8, 32)
    cases = {"wrong_text_width": (good_l, torch.randn(8, 48), "text embeddings are 48 wide, the model takes 32"),
             "wrong_channels": (torch.randn(3, 3, 6, 10), good_t, "latent has 3 channels, the model takes 4"),
             "wrong_rank": (torch.randn(4, 6, 10), good_t, r"'latent' is torch.float32 \[4, 6, 10\], expected"),
             "odd_height": (torch.randn(4, 3, 5, 10), good_t, "latent height H=5 is not a multiple of the patch size 2"),
             "zero_frames": (torch.randn(4, 0, 6, 10), good_t, r"latent is empty \(\[4, 0, 6, 10\] as \[C, T, H, W\]\)")}
    for name, (lat, txt, msg) in cases.items():
        d = tmp_path / name
        d.mkdir()
        _write(str(d / f"a.{fmt}"), good_l, good_t, fmt)
        _write(str(d / f"b.{fmt}"), lat, txt, fmt)
        with pytest.raises(LatentFileError, match=rf"b\.{fmt}: {msg}"):
            LatentShardDataset(str(d), **kw)
    d = tmp_path / "truncated"
    d.mkdir()
    _write(str(d / f"a.{fmt}"), good_l, good_t, fmt)
    raw = open(d / f"a.{fmt}", "rb").read()
    (d / f"a.{fmt}").write_bytes(raw[: len(raw) // 3])
    with pytest.raises(LatentFileError, match=rf"a\.{fmt}: unreadable latent file"):
        LatentShardDataset(str(d), **kw)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        LatentShardDataset(str(tmp_path / "missing"), **kw)
    assert len(LatentShardDataset(str(tmp_path / "wrong_text_width"))) == 2  # without a model: names only
    d = tmp_path / "two_shapes"  # valid one by one; a micro-batch of 2 needs one shape
    d.mkdir()
    _write(str(d / f"a.{fmt}"), good_l, good_t, fmt)
    _write(str(d / f"b.{fmt}"), good_l, torch.randn(5, 32), fmt)
    assert len(LatentShardDataset(str(d), **kw)) == 2
    with pytest.raises(LatentFileError, match=rf"b\.{fmt}: latent \[4, 3, 6, 10\], text L=5; .*a\.{fmt}: latent "
                                              rf"\[4, 3, 6, 10\], text L=8: --micro-batch-size=2 needs"):
        LatentShardDataset(str(d), **kw, micro_batch=2)


def test_legacy_torch_save_latent_is_read(tmp_path):
    """A latent written by torch.save's legacy (non-zip) format cannot be memory-mapped: its header is read whole."""
    from training.video_dit.config import preset
    from training.video_dit.data import LatentShardDataset
    cfg = preset("tiny")
    latent, text = torch.randn(4, 2, 6, 10), torch.randn(8, 32)
    torch.save({"latent": latent, "text": text}, str(tmp_path / "a.pt"), _use_new_zipfile_serialization=False)
    ds = LatentShardDataset(str(tmp_path), channels=cfg.in_channels, text_dim=cfg.text_dim, patch=cfg.patch)
    assert torch.equal(ds[0]["latent"], latent) and torch.equal(ds[0]["text"], text)


def test_micro_batch_shape_mismatch_names_the_samples():
    """Past the up-front check (synthetic data, or files beyond check_up_to) the step names its samples."""
    from training.video_dit.engine import flow_matching_batch

    class Two:
        files = ["/data/a.pt", "/data/b.pt"]

        def __getitem__(self, i):
            return {"latent": torch.zeros(4, 2 + 2 * (i % 2), 6, 10), "text": torch.zeros(8, 32)}
    with pytest.raises(ValueError, match=r"--micro-batch-size=2: .*/data/a\.pt: latent \[4, 2, 6, 10\], text \[8, 32\]; "
                                         r"/data/b\.pt: latent \[4, 4, 6, 10\]"):
        flow_matching_batch(Two(), 0, 0, 0, 1, 2, (1, 2, 2))


def test_bad_latent_dir_fails_before_first_step(tmp_path):
    d = tmp_path / "lat"
    d.mkdir()
    _write(str(d / "a.pt"), torch.randn(4, 3, 6, 10), torch.randn(8, 7), "pt")
    with pytest.raises(RankFailure, match=r"a\.pt: text embeddings are 7 wide"):
        run_ranks(_mg, 1, 1, "ulysses", 2, ("--data-path", str(d)))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no latents here")
    with pytest.raises(RankFailure, match=r"--data-path=.*empty' holds no \.pt or \.safetensors latent files"):
        run_ranks(_mg, 1, 1, "ulysses", 2, ("--data-path", str(empty)))
    with pytest.raises(RankFailure, match=r"--data-path=.*nope' is not a directory"):
        run_ranks(_mg, 1, 1, "ulysses", 2, ("--data-path", str(tmp_path / "nope")))


# ------------------------------------------------------------------ a rank dies mid-step

KILLER = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
from training.video_dit import model as m
calls = [0]
real = m.VideoDiT.forward
def forward(self, *a, **k):
    calls[0] += 1
    if os.environ["RANK"] == "2" and calls[0] == 3:
        import time
        with open(os.environ["SPX_KILL_STAMP"], "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), getattr(signal, os.environ.get("SPX_KILL_SIGNAL", "SIGKILL")))
    return real(self, *a, **k)
m.VideoDiT.forward = forward
from training import pretrain_video_dit
pretrain_video_dit.main(sys.argv[1:])
"""


def test_killed_rank_ends_job_within_timeout(tmp_path):
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    timeout_min = 0.5
    stamp = str(tmp_path / "killed_at")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "SPX_KILL_STAMP": stamp}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--monitor-interval", "0.5",
           str(script), "--context-parallel-size", "4", "--cp-comm-type", "ulysses", "--train-iters", "50",
           *COMMON, "--distributed-timeout-minutes", str(timeout_min), "--save", str(tmp_path / "ck"),
           "--save-interval", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rank: 2" in out and "Signal 9 (SIGKILL)" in out, out[-3000:]  # torchrun names the dead rank
    # the whole job ended within the timeout + a margin of the death (start-up not counted)
    assert ended - float(open(stamp).read()) < timeout_min * 60 + 20, out[-3000:]
    left = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, str(script))]
    assert not left, f"worker processes left behind: {left}"
    ck = str(tmp_path / "ck")
    step_dir = resolve(ck)  # what was saved before the death is complete and loadable
    read_run(step_dir, {})
    finished = [n for n in os.listdir(ck) if n.startswith("iter_") and "." not in n]
    assert finished and all(os.path.isfile(os.path.join(ck, n, "run.json")) for n in finished), finished


def _cmdline_has(pid: str, needle: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return needle.encode() in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_killed_rank_without_launcher_bounded_by_timeout(tmp_path, sig):
    """No launcher agent to stop the others (srun, a bare script): the survivors' own collectives must
    end them within --distributed-timeout-minutes (plus the roll call and a margin), each printing its
    rank and naming rank 2 as the one that did not report. SIGSTOP is a hung rank: its sockets stay
    open, so only the timeout - carried by every group, megatron-core's CP group included - ends the wait."""
    import socket
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout_min = 0.25
    procs = []
    stamp = str(tmp_path / "killed_at")
    for r in range(4):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "RANK": str(r),
               "SPX_KILL_STAMP": stamp, "SPX_KILL_SIGNAL": sig,
               "LOCAL_RANK": str(r), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(script), "--context-parallel-size", "4", "--cp-comm-type",
                                       "ulysses", "--train-iters", "50", *COMMON, "--distributed-timeout-minutes",
                                       str(timeout_min)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    import threading
    outs, ended = [""] * 4, [None] * 4

    def wait(r):
        out, err = procs[r].communicate(timeout=240)
        outs[r], ended[r] = out + err, time.time()
    threads = [threading.Thread(target=wait, args=(r,)) for r in (0, 1, 3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        procs[2].communicate(timeout=30)
    if sig == "SIGKILL":
        assert procs[2].returncode == -signal.SIGKILL
    for r in (0, 1, 3):
        assert procs[r].returncode != 0, outs[r][-2000:]
        assert f"[rank {r}] pretrain_video_dit failed" in outs[r], outs[r][-2000:]
        assert "rank(s) 2 did not report" in outs[r], outs[r][-2000:]
    killed_at = float(open(stamp).read())
    waits = [ended[r] - killed_at for r in (0, 1, 3)]
    # within the timeout of the death, + the roll call, + a margin
    assert max(waits) < timeout_min * 60 + ROLL_CALL_SECONDS + 20, waits


def test_fresh_adam_state_loads_and_continues_exactly():
    """init_adam_state: a fresh torch AdamW (what megatron-core runs without TE/Apex, whose state_dict()
    asserts before the first step) gets a state a load can fill; after loading a trained optimizer's
    state it continues bit for bit, and an optimizer that has state is left alone."""
    from training.video_dit.checkpoint import init_adam_state
    torch.manual_seed(0)
    w0 = torch.randn(5, 3)

    def step(p, opt, seed):
        g = torch.Generator().manual_seed(seed)
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()

    p_a = torch.nn.Parameter(w0.clone())
    opt_a = torch.optim.AdamW([p_a], lr=0.1, weight_decay=0.1)
    for s in range(3):
        step(p_a, opt_a, s)
    saved = {k: v for k, v in opt_a.state_dict().items()}
    saved = {"state": {i: {n: t.clone() for n, t in st.items()} for i, st in saved["state"].items()},
             "param_groups": saved["param_groups"]}
    p_b = torch.nn.Parameter(p_a.detach().clone())
    opt_b = torch.optim.AdamW([p_b], lr=0.1, weight_decay=0.1)
    init_adam_state(opt_b)
    st_b = opt_b.state[p_b]
    assert [s["step"].item() for s in opt_b.state.values()] == [0.0]  # what megatron-core's state_dict reads
    assert torch.count_nonzero(st_b["exp_avg"]) == 0 and torch.count_nonzero(st_b["exp_avg_sq"]) == 0
    opt_b.load_state_dict(saved)
    step(p_a, opt_a, 9)
    step(p_b, opt_b, 9)
    assert torch.equal(p_a, p_b)
    before = {n: t.clone() for n, t in opt_a.state[p_a].items()}
    init_adam_state(opt_a)  # has state: untouched
    assert all(torch.equal(before[n], opt_a.state[p_a][n]) for n in before)
