"""Sampling from the DiT (training/video_dit/sample.py): under SP=2 and SP=4 (HCMS and ring attention,
padded token counts) the Euler-sampled latents equal SP=1 sampling with the same seed (fp32), the
attention really matters for the result (negative control), and the frame-strip PNG is written."""
import os

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks
from training.video_dit import VideoDiT, preset
from training.video_dit.data import SyntheticVideoLatents
from training.video_dit.engine import make_core
from training.video_dit.sample import pick_prompts, sample_latents, save_frame_strip, write_demo_samples

CFG = preset("tiny")


def sample_model(group, mode, **kw):
    torch.manual_seed(3)
    model = VideoDiT(CFG)
    # AdaLN-zero starts every block as the identity; open the gates so that attention shapes the output
    for _, p in model.modulation_parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.set_attention_core(make_core(mode, group, num_heads=CFG.heads, **kw))
    return model


def rank_local_model():
    """The SP=1 model with its own reference core (``model.local_core``): run on a rank's shard, it attends to
    the rank's tokens only (padding past the shard ignored): the negative control of SP sampling."""
    from training.video_dit.model import local_core
    model = sample_model(None, "ulysses")
    model.set_attention_core(local_core)
    return model


def _sample_sp_vs_sp1(rank, world, frames, mode, kw):
    data = SyntheticVideoLatents(CFG.in_channels, [frames], 6, 10, CFG.text_len, CFG.text_dim, seed=1)
    idx = pick_prompts(data, 2)
    text = torch.stack([data[i]["text"] for i in idx])
    shape = (CFG.in_channels, frames, 6, 10)
    ref = sample_latents(sample_model(None, "ulysses"), text, shape, steps=4, seed=11)
    out = sample_latents(sample_model(dist.group.WORLD, mode, **kw), text, shape, steps=4, seed=11,
                         group=dist.group.WORLD)
    assert out.shape == (2, *shape) and torch.isfinite(out).all()
    err = (out - ref).abs().max().item()
    assert err < 1e-5, f"{mode} SP={world}: max |SP - SP1| = {err}"
    # negative control: each rank attending only to its own tokens must change the sample (the model's own
    # reference core: the factory's one-rank path refuses the global kv_valid_len a shard is given)
    local = rank_local_model()
    local_out = sample_latents(local, text, shape, steps=4, seed=11, group=dist.group.WORLD)
    gap = (local_out - ref).abs().max().item()
    assert gap > 1e-3, f"attention does not influence the sample (gap {gap})"
    return err


@pytest.mark.parametrize("world,frames,mode,kw", [
    (2, 4, "ulysses", {}),
    (4, 3, "hcms", {"head_chunks": 2}),  # 3 frames x 3 x 5 patches = 45 tokens: padded to 48
    (4, 4, "ring", {}),
])
def test_sp_sampling_equals_sp1(world, frames, mode, kw):
    errs = run_ranks(_sample_sp_vs_sp1, world, frames, mode, kw)
    assert len(errs) == world


def _demo_png(rank, world, log_dir):
    data = SyntheticVideoLatents(CFG.in_channels, [4, 5], 6, 10, CFG.text_len, CFG.text_dim, seed=1)
    path = write_demo_samples(sample_model(dist.group.WORLD, "hcms", head_chunks=2), data, steps=3, seed=5,
                              group=dist.group.WORLD, device="cpu", log_dir=log_dir)
    return path


def test_demo_samples_png_written_by_rank0(tmp_path):
    paths = run_ranks(_demo_png, 4, str(tmp_path))
    assert paths[0] == os.path.join(str(tmp_path), "samples.png") and all(p is None for p in paths[1:])
    import matplotlib.image as mpimg
    img = mpimg.imread(paths[0])
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_prompts_are_distinct_and_same_shape():
    data = SyntheticVideoLatents(4, [4, 5], 6, 10, 8, 32, seed=0)
    idx = pick_prompts(data, 4)
    assert sorted(data.prompt_of(i) for i in idx) == [0, 1, 2, 3]
    assert len({data[i]["latent"].shape for i in idx}) == 1


def test_frame_strip_shapes(tmp_path):
    truth = torch.rand(2, 4, 3, 6, 10)
    path = save_frame_strip(str(tmp_path / "s.png"), truth, truth.flip(0))
    assert os.path.getsize(path) > 1000
