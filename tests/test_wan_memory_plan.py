"""The diffusers Wan entry's memory plan (training/wan_diffusers/memory_plan.py): its arithmetic on a known case,
the committed per-token terms re-derived from diffusers' own model, --validate on the committed one-H200 peaks,
the entry's --plan-memory, and bad input named by flag."""
import re

import pytest

from training.wan_diffusers import kept_bytes, memory_plan as mp
from training.wan_diffusers.memory_plan import GIB, PlanInput, plan

TOKENS_720P = 75600


def test_grid_tokens_are_the_entrys():
    assert mp.tokens_of("wan-1.3b", "720p", None, None) == TOKENS_720P       # 21 x 90 x 160 -> 21 x 45 x 80
    assert mp.tokens_of("wan-14b", None, 21, "60x104") == 32760


def test_known_case_arithmetic():
    full = plan(PlanInput("wan-1.3b", TOKENS_720P, recompute="full"))
    sel = plan(PlanInput("wan-1.3b", TOKENS_720P, recompute="selective"))
    pr = mp.count_params("wan-1.3b", None, 0, False)
    assert 1.40e9 < pr.numel < 1.45e9                                         # Wan 2.1 1.3B: 1.42B parameters
    assert full.weights_gib == pytest.approx(4 * pr.numel / GIB)
    assert full.optimizer_gib == pytest.approx(8 * pr.numel / GIB)
    parts = [full.weights_gib, full.gradients_gib, full.optimizer_gib, full.autocast_copies_gib, full.unsharded_gib,
             full.kept_activations_gib, full.block_backward_gib, full.exchange_gib, full.workspace_gib]
    assert full.total_gib == pytest.approx(sum(parts))
    # both peak in the top block's backward: 29 blocks below it keep their input (full) or + q, k, v, out, lse
    assert full.peak_phase == sel.peak_phase == "backward of block 29"
    dim, heads = 1536, 12
    assert sel.kept_activations_gib - full.kept_activations_gib == \
        pytest.approx(29 * (8 * dim + 4 * heads) * TOKENS_720P / GIB)
    keep8 = plan(PlanInput("wan-1.3b", TOKENS_720P, recompute="keep8"))
    assert keep8.kept_activations_gib - full.kept_activations_gib == \
        pytest.approx(8 * (8 * dim + 4 * heads) * TOKENS_720P / GIB)
    sp2 = plan(PlanInput("wan-1.3b", TOKENS_720P, sp=2, recompute="full"))
    assert sp2.exchange_gib == pytest.approx(8 * dim * TOKENS_720P / 2 / GIB)


def test_committed_terms_rederive_from_diffusers():
    """A diffusers (or torch) change that moves what a block keeps fails here: re-run
    python -m training.wan_diffusers.kept_bytes and commit its table into memory_plan.DERIVED."""
    assert kept_bytes.derive_all() == mp.DERIVED


def test_validate_on_committed_peaks(capsys):
    rc = mp.main(["--validate"])
    out = capsys.readouterr().out
    m = re.search(r"^(\d+) rows, median \|error\| ([\d.]+)%, max ([\d.]+)%$", out, re.M)
    assert m, out
    print(m.group(0))
    assert int(m.group(1)) >= 10 and float(m.group(3)) <= 100 * mp.MAX_VALIDATION_ERROR
    assert rc == 0


def test_entry_plan_memory_prints_and_exits_0(capsys):
    from training import train_wan_diffusers as entry
    from training.video_dit.faults import run_entry
    rc = run_entry(entry.main, entry.WHAT, ["--plan-memory", "--bf16", "--model", "wan-14b", "--frames", "21",
                                            "--latent-size", "60x104", "--lora-rank", "32",
                                            "--recompute-granularity", "full"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "wan-14b (40 blocks), 32,760 tokens" in out and re.search(r"total +[\d.]+ GiB of 139: fits", out), out


@pytest.mark.parametrize("argv,flag", [(["--grid", "999p"], "--grid"), (["--grid", "720p", "--sp", "0"], "--sp"),
                                       (["--grid", "720p", "--recompute", "keepx"], "--recompute")])
def test_bad_input_named(capsys, argv, flag):
    assert mp.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "Traceback" not in err[0], err


def test_entry_plans_a_pretrained_directory_by_its_config(tmp_path, capsys):
    """--init DIR (the recipe's case: a downloaded Wan transformer) plans the preset of its config.json's widths; a
    config of other widths, or none, is one message naming --init."""
    import json

    from diffusers import WanTransformer3DModel

    from training import train_wan_diffusers as entry
    from training.video_dit.faults import run_entry
    from training.wan_diffusers.model import WAN_PRESETS
    with torch_meta():
        WanTransformer3DModel(**WAN_PRESETS["wan-1.3b"]).save_config(str(tmp_path / "wan"))   # diffusers' own config
    argv = ["--plan-memory", "--bf16", "--frames", "21", "--latent-size", "90x160", "--recompute-granularity", "full"]
    assert run_entry(entry.main, entry.WHAT, argv + ["--init", str(tmp_path / "wan")]) == 0
    out = capsys.readouterr().out
    assert "wan-1.3b (30 blocks), 75,600 tokens" in out, out
    cfg = json.loads((tmp_path / "wan" / "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(dict(cfg, ffn_dim=1234)))
    for d in ("other", "missing"):
        assert run_entry(entry.main, entry.WHAT, argv + ["--init", str(tmp_path / d)]) != 0
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and "--init" in err[0] and "Traceback" not in err[0], err


def torch_meta():
    import torch
    return torch.device("meta")
