"""The attention-kernel line a run prints names the kernel that runs the SELF-attention (issue #51 item 6: a sparse
run said "FlashAttention-2 (torch SDPA)" while the block-sparse kernel ran it) and the setting that changes it;
dense runs keep their line."""
import pytest
import torch

from training.video_dit.engine import attention_kernel_line

CPU = torch.device("cpu")


def test_dense_line_unchanged():
    assert attention_kernel_line("auto", "--sp-attention-backend", CPU, torch.float32, 16) == \
        "attention kernel: FlashAttention-2 (torch SDPA) on cpu/float32; change with --sp-attention-backend"


def test_sparse_line_names_the_block_sparse_kernel_and_its_setting():
    line = attention_kernel_line("auto", "--sp-attention-backend", CPU, torch.float32, 16, tile_setting="math",
                                 tile_setting_name="--sparse-attention-kernel")
    self_part, cross_part = line.split("; cross-attention")
    assert "self-attention: block-sparse math" in self_part and "change with --sparse-attention-kernel" in self_part
    assert "FlashAttention-2 (torch SDPA)" in cross_part and "--sp-attention-backend" in cross_part, line
    # an entry without a kernel setting (DeepSpeed's): no "change with" for the self-attention, the pick explained
    line = attention_kernel_line("auto", "sequence_parallel_ext.backend", CPU, torch.float32, 16, tile_setting="auto")
    self_part, cross_part = line.split("; cross-attention")
    assert "change with" not in self_part and "picked per call for the device and dtype" in self_part, line
    assert "change with sequence_parallel_ext.backend" in cross_part, line


@pytest.mark.parametrize("entry", ["megatron", "deepspeed"])
def test_sparse_run_prints_the_block_sparse_kernel(entry):
    """Both entry points, one rank on CPU, one sparse step: the line names the block-sparse math kernel."""
    pytest.importorskip("megatron.core" if entry == "megatron" else "deepspeed")
    from tests.test_user_errors import DS, MG, launch  # noqa: PLC0415 - the entry points run as commands
    args = ["--model", "tiny", "--frames", "4", "--latent-size", "8x8", "--train-iters", "1",
            "--sparse-attention", "tiles", "--sparse-tile", "1,2,2", "--sparse-topk", "2"]
    script = MG if entry == "megatron" else DS
    codes, out = launch(script, args + (["--context-parallel-size", "1"] if entry == "megatron" else []), world=1)
    assert codes == [0], out[-3000:]
    line = next((ln for ln in out.splitlines() if "attention kernel:" in ln), "")
    assert "self-attention: block-sparse math" in line and "FlashAttention-2" not in line.split(";")[0], out[-3000:]
    # every flag the line names is one of this entry's flags, and each "change with" names a setting of this entry
    # that chooses a kernel (the DeepSpeed entry's said "change with --sparse-attention", which only turns tiles on)
    import re
    flags = set(re.findall(r"(--[a-z][a-z0-9-]+)", line))
    entry_flags = set(re.findall(r"(--[a-z][a-z0-9-]+)", _help(entry)))
    assert flags <= entry_flags, (flags - entry_flags, line)
    kernel_settings = {"megatron": {"--sparse-attention-kernel", "--sp-attention-backend"},
                       "deepspeed": {"sequence_parallel_ext.backend"}}[entry]
    named = set(re.findall(r"change with ([^\s;,]+)", line))
    assert named and named <= kernel_settings, (named, line)


def _help(entry: str) -> str:
    import contextlib
    import io
    if entry == "megatron":
        from training.pretrain_video_dit import parse
    else:
        from training.train_deepspeed import parse
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse(["--help"])
    return out.getvalue()


def test_sparse_tile_help_says_any_size_runs():
    """--sparse-tile's help: edge blocks are compacted (it once said the tile must divide the token grid)."""
    text = " ".join(_help("deepspeed").split())
    assert "must divide the token grid" not in text and "edge blocks are compacted" in text, text
