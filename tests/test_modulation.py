"""--modulation (config.MODULATIONS): "wan", the default, is Wan 2.1's AdaLN (one time projection shared by every
block plus a learned table per block; the head adds its table to the time embedding), so the wan-1.3b / wan-14b
presets have exactly the parameters of diffusers' WanTransformer3DModel; "linear" keeps a Linear per block (the
model before 2026-11-29). Both start every block as the identity, train through the entry, and a checkpoint of one
is refused by the other with the flag named."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from training.video_dit import VideoDiT
from training.video_dit.config import MODULATIONS, preset
from training.video_dit.model import timestep_embedding


def _count(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in VideoDiT(cfg).parameters())


@pytest.mark.parametrize("name,heads,ffn,layers", [("wan-1.3b", 12, 8960, 30), ("wan-14b", 40, 13824, 40)])
def test_wan_presets_have_diffusers_parameter_count(name, heads, ffn, layers):
    diffusers = pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")
    with torch.device("meta"):
        ref = diffusers.WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=128, ffn_dim=ffn,
                                              num_layers=layers)
    want = sum(p.numel() for p in ref.parameters())
    assert _count(preset(name)) == want
    # the per-block Linear of "linear": 6 d^2 + 6 d per block, less the shared projection, plus the head's Linear
    d = preset(name).dim
    extra = layers * (6 * d * d + 6 * d) - layers * 6 * d - (6 * d * d + 6 * d) + (2 * d * d + 2 * d) - 2 * d
    assert _count(preset(name, modulation="linear")) == want + extra


def test_wan_modulation_structure_and_rows():
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = VideoDiT(cfg)
    assert not hasattr(model, "mod_out") and tuple(model.time_proj.weight.shape) == (6 * cfg.dim, cfg.dim)
    for blk in model.blocks:
        assert not hasattr(blk, "modulation") and tuple(blk.scale_shift_table.shape) == (6 * cfg.dim,)
    with torch.no_grad():
        for _, p in model.modulation_parameters():
            p.normal_(0.0, 0.5)
    t = torch.tensor([0.3, 0.7])
    t_emb = model.time_embed(timestep_embedding(t, cfg.freq_dim))
    t_proj = model.time_proj(F.silu(t_emb))
    for blk in model.blocks:  # each block: the shared projection plus its own table
        torch.testing.assert_close(blk.modulation_rows(t_proj), t_proj + blk.scale_shift_table, rtol=0, atol=0)
    head = model.head_modulation(t_emb)
    torch.testing.assert_close(head, torch.cat([t_emb, t_emb], -1) + model.scale_shift_table, rtol=0, atol=0)
    m64 = model.double()   # a float64 model sums in float64 (no fp32 rounding on the way)
    t64 = m64.time_proj(F.silu(m64.time_embed(timestep_embedding(t, cfg.freq_dim).double())))
    rows64 = m64.blocks[0].modulation_rows(t64)
    assert rows64.dtype == torch.float64 and torch.equal(rows64, t64 + m64.blocks[0].scale_shift_table)
    names = {n for n, _ in model.modulation_parameters()}
    assert names == {"time_proj.weight", "time_proj.bias", "scale_shift_table",
                     *(f"blocks.{i}.scale_shift_table" for i in range(cfg.layers))}


@pytest.mark.parametrize("modulation", list(MODULATIONS))
def test_gates_start_closed(modulation):
    """AdaLN-zero in both: every modulation parameter starts at 0, so each block's gated self-attention and FFN add
    nothing at init: the block is its input plus the (ungated, as in Wan) cross-attention."""
    cfg = preset("tiny", modulation=modulation)
    torch.manual_seed(1)
    model = VideoDiT(cfg)
    assert all(float(p.detach().abs().max()) == 0.0 for _, p in model.modulation_parameters())
    t_emb = model.time_embed(timestep_embedding(torch.tensor([0.4]), cfg.freq_dim))
    t_blocks = t_emb if modulation == "linear" else model.time_proj(F.silu(t_emb))
    grid = (2, 2, 2)
    x = torch.randn(1, 8, cfg.dim)
    ctx = torch.randn(1, cfg.text_len, cfg.dim)
    angles = model.rope_cache.get(torch.arange(8), grid, cfg.head_dim, x.device)
    for blk in model.blocks:
        with torch.no_grad():
            cross = blk.cross(F.layer_norm(x, (cfg.dim,), blk.norm2.weight, blk.norm2.bias, cfg.eps), ctx)
            assert torch.equal(blk(x, t_blocks, ctx, angles, None), x + cross)


def test_shared_projection_gets_every_blocks_gradient():
    """One backward reaches the shared time projection and every block's own table."""
    cfg = preset("tiny")
    torch.manual_seed(2)
    model = VideoDiT(cfg)
    with torch.no_grad():
        for _, p in model.modulation_parameters():
            p.normal_(0.0, 0.3)
    b, grid = 1, (2, 4, 4)
    s = grid[0] * grid[1] * grid[2]
    patches = torch.randn(b, s, cfg.patch_volume)
    text = torch.randn(b, cfg.text_len, cfg.text_dim)
    ids = torch.arange(s)

    def grad():
        model.zero_grad()
        model(patches, torch.tensor([0.5]), text, ids, grid).square().mean().backward()
        return model.time_proj.weight.grad.clone()

    assert float(grad().abs().max()) > 0
    for blk in model.blocks:
        assert blk.scale_shift_table.grad is not None and float(blk.scale_shift_table.grad.abs().max()) > 0


def test_bad_modulation_names_the_flag():
    with pytest.raises(ValueError, match="--modulation='bogus' is invalid: choose one of wan, linear"):
        preset("tiny", modulation="bogus")


def _entry(rank, world, argv):
    from training import pretrain_video_dit
    return pretrain_video_dit.main(argv)["losses"]


def test_entry_trains_both_and_refuses_the_other_checkpoint(tmp_path):
    pytest.importorskip("megatron.core")
    from tests.harness import run_ranks
    from training.video_dit.checkpoint import read_run, resolve
    from training.video_dit.safe_load import CheckpointError
    common = ["--model", "tiny", "--frames", "4", "--latent-size", "6x10", "--quiet", "--train-iters", "2"]
    ck = str(tmp_path / "ck")
    lin = run_ranks(_entry, 1, [*common, "--modulation", "linear", "--save", ck])[0]
    wan = run_ranks(_entry, 1, common)[0]
    assert len(lin) == len(wan) == 2 and all(map(lambda v: v == v, lin + wan))
    assert read_run(resolve(ck), {})["model"]["modulation"] == "linear"
    with pytest.raises(Exception, match="modulation: 'linear' saved, 'wan' now.*--modulation linear"):
        run_ranks(_entry, 1, [*common, "--train-iters", "3", "--load", ck])
    # a checkpoint written before --modulation existed (no such key) is the per-block Linear's
    run_path = os.path.join(resolve(ck), "run.json")
    with open(run_path) as f:
        run = json.load(f)
    del run["model"]["modulation"]
    with open(run_path, "w") as f:
        json.dump(run, f)
    with pytest.raises(CheckpointError, match="modulation: 'linear' saved, 'wan' now"):
        read_run(resolve(ck), {"model": {**run["model"], "modulation": "wan"}})
    assert read_run(resolve(ck), {"model": {**run["model"], "modulation": "linear"}})
    more = run_ranks(_entry, 1, [*common, "--modulation", "linear", "--train-iters", "3", "--load", ck])[0]
    assert len(more) == 1
