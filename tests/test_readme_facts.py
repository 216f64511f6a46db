"""What a new user needs from the README's first section (issue #51 item 7): that `make test` builds a second
environment, how long both commands take, which figures the demo writes and what its samples show; and the README
stays within its size budget. (The demo's outputs themselves: tests/test_sparse_tile_advice.py runs the demo.)"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BUDGET = 15_000  # bytes


def _first_section() -> str:
    with open(README) as f:
        text = f.read()
    return " ".join(text[text.index("## Two commands"):text.index("## Tested versions")].split())


def test_readme_within_budget():
    assert os.path.getsize(README) <= BUDGET


def test_two_commands_say_what_they_build_and_take():
    sec = _first_section()
    assert ".venv-current" in sec, "make test's second environment is not named"
    demo = re.search(r"make demo .*?\(([^)]*\d+:\d\d[^)]*)\)", sec)
    test = re.search(r"make test .*?~\d+ min", sec)
    assert demo and test, "the two commands' durations are missing"
    assert "~2 min" in sec, "the environment build time is missing"


def test_demo_outputs_and_what_samples_show():
    sec = _first_section()
    for name in ("samples.png", "loss.png", "step_time.png", "metrics.jsonl"):
        assert name in sec, name
    assert re.search(r"after 100 steps the colours are right, the stripes still noisy", sec)


def test_dynamic_sp_line_is_a_command_the_entry_takes():
    """The README's dynamic-SP flags, N made a number, parse in the megatron-core entry (they once lacked the
    --max-tokens-per-step N that --pack-samples requires)."""
    import pytest
    pytest.importorskip("megatron.core")
    from training import pretrain_video_dit
    with open(README) as f:
        text = " ".join(f.read().split())
    spans = [s for s in re.findall(r"`([^`]*)`", text) if "--dynamic-context-parallel" in s and "--pack-samples" in s]
    assert spans, "the README's dynamic-SP command is missing"
    for span in spans:
        args = pretrain_video_dit.parse([("4096" if w == "N" else w) for w in span.split()])
        assert args.dynamic_context_parallel and args.pack_samples and args.max_tokens_per_step == 4096


def test_readme_states_what_gpus_disk_and_megatron_lm_need():
    """#83 item 8: the Megatron-LM route needs a Megatron-LM checkout and GPUs; the GPUs tested and FA4's head-dim
    range (as fa4.head_dim_ok checks it); the disk `make test` needs for `.venv-current`."""
    import torch
    from megatron_sp_ext.attention.kernels import fa4
    with open(README) as f:
        text = " ".join(f.read().split())
    assert "Megatron-LM's own `pretrain_gpt.py` (core_v0.16.1 to main; needs a Megatron-LM checkout and GPUs, not CPU" \
        in text
    assert "GPUs: Hopper tested (H100, H200)" in text
    lo = fa4.MIN_HEAD_DIM
    assert f"runs bf16/fp16 head dims {lo}-256, multiples of 8 (Blackwell: {lo}-128, 256; refused below {lo}" in text
    cpu = torch.device("cpu")   # head_dim_ok's Hopper rule off Blackwell
    assert [fa4.head_dim_ok(d, cpu) for d in (lo - 8, lo, lo + 4, lo + 8, 256, 264)] == \
        [False, True, False, True, True, False]
    assert "make test # .venv, then .venv-current (~9 GB free disk" in text
