"""--deterministic-mode (training/video_dit/deterministic.py): refused by name with a kernel whose backward is not
deterministic; with math it turns torch's deterministic algorithms on in the entry's process, and two runs give
the same bits."""
from __future__ import annotations

import json

import pytest
import torch

from tests.harness import run_ranks
from training.video_dit import deterministic

BASE = ["--model", "tiny", "--frames", "2", "--latent-size", "8x8", "--train-iters", "3", "--quiet",
        "--num-workers", "0", "--seed", "5"]


def test_refused_by_name_without_a_deterministic_kernel():
    msg = deterministic.why_not(True, "auto")
    assert "--deterministic-mode" in msg and "--sp-attention-backend auto" in msg and "math" in msg
    assert deterministic.why_not(True, "math") is None and deterministic.why_not(False, "fa4") is None


def test_the_deterministic_kernels_come_from_the_registry():
    """Which kernels the mode takes is the registry's "deterministic" capability, not a list of names here: math
    for dense and block-sparse calls, FA4 for dense calls only."""
    from megatron_sp_ext.attention import kernels
    assert deterministic.DETERMINISTIC_KERNELS == ("fa4", "math") and deterministic.DETERMINISTIC_SPARSE_KERNELS == (
        "math",)
    assert kernels.get("fa4").caps.deterministic == "dense" and kernels.get("math").caps.deterministic == "all"
    assert all(kernels.get(n).caps.deterministic == "none" for n in kernels.ORDER if n not in ("fa4", "math"))


def test_fa4_is_deterministic_for_dense_attention_only():
    """FA4 runs its deterministic backward under torch's switch (tests/test_fa4.py): allowed for dense attention;
    block-sparse calls need the math tile kernel, whatever the dense kernel, refused naming the flag."""
    assert deterministic.why_not(True, "fa4") is None
    assert deterministic.why_not(True, "math", "tiles", "math") is None
    assert deterministic.why_not(True, "fa4", "tiles", "math") is None
    msg = deterministic.why_not(True, "fa4", "tiles", "auto")
    assert "--sparse-attention tiles" in msg and "--sparse-attention-kernel auto" in msg and \
        "--sparse-attention-kernel math" in msg
    assert "--sparse-attention-kernel fa4" in deterministic.why_not(True, "math", "tiles", "fa4")
    assert deterministic.why_not(False, "fa4", "tiles", "auto") is None


def test_timing_based_choices_are_refused_by_name(capsys):
    """auto picks the mode (and --sp-async-qkv auto the layer form) by timing: a rerun may sum in another order."""
    msg = deterministic.why_not(True, "math", mode=["auto"])
    assert "--cp-comm-type auto" in msg and "hcms equals ulysses" in msg
    assert "--sp-async-qkv auto" in deterministic.why_not(True, "fa4", mode="hcms", async_qkv="auto")
    assert deterministic.why_not(True, "fa4", mode=["hcms"], async_qkv="off") is None
    from training.pretrain_video_dit import parse
    with pytest.raises(SystemExit):
        parse([*BASE, "--deterministic-mode", "--sp-attention-backend", "math"])   # --cp-comm-type defaults to auto
    err = capsys.readouterr().err
    assert "--deterministic-mode with --cp-comm-type auto" in err and "Traceback" not in err


def test_entry_refuses_it_with_auto(capsys):
    from training.pretrain_video_dit import parse
    with pytest.raises(SystemExit):
        parse([*BASE, "--deterministic-mode"])
    err = capsys.readouterr().err
    assert "--deterministic-mode with --sp-attention-backend auto" in err and "Traceback" not in err


def _run(rank, world, log_dir):
    from training.pretrain_video_dit import main
    out = main([*BASE, "--context-parallel-size", "2", "--cp-comm-type", "hcms", "--deterministic-mode",
                "--sp-attention-backend", "math",
                "--log-dir", log_dir])
    return torch.are_deterministic_algorithms_enabled(), out["losses"]


def test_entry_runs_deterministic_and_reruns_bit_for_bit(tmp_path):
    a = run_ranks(_run, 2, str(tmp_path / "a"))
    b = run_ranks(_run, 2, str(tmp_path / "b"))
    assert all(on for on, _ in a + b)
    assert [losses for _, losses in a] == [losses for _, losses in b]
    rows = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert len(rows) == 3 and all(r["loss"] == r["loss"] for r in rows)


def test_deepspeed_entry_checks_its_json_kernel_and_mode():
    """The DeepSpeed entry has no --sp-attention-backend / --cp-comm-type: --deterministic-mode is checked against
    sequence_parallel_ext.backend / .mode (named in the message with the file), after the config loads; a math or
    fa4 kernel with a fixed mode runs (before 2026-11-28 it was refused naming a flag the entry does not have)."""
    import argparse

    from megatron_sp_ext.errors import SPConfigError
    from training.train_deepspeed import check_deterministic, parse
    args = parse(["--model", "tiny", "--deterministic-mode"])   # parses: no Megatron flag to check here
    block = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(SPConfigError, match=r"sequence_parallel_ext\.backend auto.*give sequence_parallel_ext"
                                            r"\.backend fa4 or math"):
        check_deterministic(args, {**block, "sequence_parallel_ext": {"mode": "ulysses"}})
    args.deepspeed_config = "ds.json"
    with pytest.raises(SPConfigError, match=r"sequence_parallel_ext\.mode auto.*\(in ds\.json\)"):
        check_deterministic(args, {**block, "sequence_parallel_ext": {"mode": "auto", "backend": "fa4"}})
    for backend in ("math", "fa4"):
        check_deterministic(args, {**block, "sequence_parallel_ext": {"mode": "hcms", "backend": backend}})
    check_deterministic(argparse.Namespace(deterministic_mode=False), block)   # off: nothing read
