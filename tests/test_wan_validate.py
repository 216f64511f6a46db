"""training/wan_diffusers/validate.py: validation videos with diffusers' WanPipeline around the trained transformer,
every SP rank taking part through megatron_sp_ext.diffusers.parallelize (gloo), on a tiny random pipeline the test
writes (tests/wan_pipeline_dir.py).

Tolerances: WanPipeline keeps its latents in float32 (prepare_latents) and its schedulers step in float32, so even a
float64 transformer's samples are float32-rounded each step. SP=2 (the ring mode: its blockwise softmax merge rounds
differently from one kernel) is held to 1e-5 absolute on latents of magnitude ~3 in a float32 model (observed ~1e-6)
and to 1e-6 in a float64 model (observed 0: the float64 differences vanish in the float32 rounding); a different seed
differs by ~3, so the checks can fail."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("imageio_ffmpeg", reason="the validation videos are written with imageio's ffmpeg plugin")

import torch.distributed as dist  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402,F401  (imported once before the harness forks)

import megatron_sp_ext.diffusers  # noqa: E402,F401
from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from tests import wan_pipeline_dir as W  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from training.wan_diffusers import prepare, validate as V  # noqa: E402

L = 16


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_validate")
    pipe = W.write_pipeline(root / "pipe", "t2v")
    i2v = W.write_pipeline(root / "pipe_i2v", "i2v")
    (root / "prompts.txt").write_text("a red cat runs\na dog jumps on the beach\n")
    prompts = prepare.main(["--pipeline", pipe, "--output", str(root / "data"), "--prompts", str(root / "prompts.txt"),
                            "--negative-prompt", "rain", "--max-sequence-length", str(L), "--log-level", "WARNING"])
    return {"root": root, "pipe": pipe, "i2v": i2v, "prompts": prompts["prompts"]}


def _settings(world, out, **over):
    log_dir = over.pop("log_dir", None)
    kw = dict(steps=2, guidance=3.0, seed=7, frames=5, height=32, width=32, fps=8)
    kw.update(over)
    return V.ValidationSettings(world["prompts"], world["pipe"], str(out), log_dir, sampling=V.Sampling(**kw))


def _model(world, dtype):
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel.from_pretrained(world["pipe"], subfolder="transformer").to(dtype)


def _sample(rank, size, world, out, dtype, seed, log_dir=None):
    from megatron_sp_ext.diffusers.processor import SPWanSelfAttnProcessor
    model = _model(world, dtype)
    if size > 1:
        megatron_sp_ext.diffusers.parallelize(model, dist.group.WORLD, mode="ring")
        assert all(isinstance(b.attn1.processor, SPWanSelfAttnProcessor) for b in model.blocks)
    model.train()
    v = V.Validator(_settings(world, out, seed=seed, log_dir=log_dir), model, torch.device("cpu"), rank=rank,
                    sp_size=size)
    assert v(1) is None                     # every=0: only the final call samples
    res = v.final(3)
    assert v.final(3) is None and model.training   # once per step; the training mode restored
    return [lat.double().numpy() for lat in res["latents"]], res["rows"]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-6)])
def test_sp2_samples_equal_sp1_and_rank0_writes_the_videos(world, tmp_path, dtype, tol):
    log = tmp_path / "log"
    log.mkdir()
    (log / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "step_time_s": 0.1}) + "\n"
                                               for s in (1, 2, 3)))
    ref, _ = run_ranks(_sample, 1, world, str(tmp_path / "sp1"), dtype, 7, timeout=240)[0]
    got = run_ranks(_sample, 2, world, str(tmp_path / "sp2"), dtype, 7, str(log), timeout=240)
    other, _ = run_ranks(_sample, 1, world, str(tmp_path / "seed8"), dtype, 8, timeout=240)[0]
    for i in range(2):
        assert ref[i].shape == (1, 4, 2, 4, 4)
        for r in range(2):
            err = float(abs(got[r][0][i] - ref[i]).max())
            assert err <= tol, f"prompt {i}: SP=2 rank {r} differs from SP=1 by {err}"
        assert float(abs(other[i] - ref[i]).max()) > 0.5     # the seed matters: the check can fail
    rows = got[0][1]
    assert got[1][1] == [] and [r["prompt"] for r in rows] == ["a red cat runs", "a dog jumps on the beach"]
    folder = tmp_path / "sp2" / "step_000003"
    import imageio.v2 as imageio
    from PIL import Image
    for i in range(2):
        frames = imageio.mimread(str(folder / f"{i}.mp4"))
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
        assert Image.open(folder / f"{i}.png").size == (5 * 32, 32)   # 5 frames side by side
    assert (folder / "prompts.txt").read_text().splitlines() == ["0\ta red cat runs", "1\ta dog jumps on the beach"]
    assert (folder / "loss.png").is_file() and (folder / "step_time.png").is_file()
    index = [json.loads(line) for line in open(tmp_path / "sp2" / "index.jsonl")]
    assert [(r["step"], r["i"]) for r in index] == [(3, 0), (3, 1)] and index[0]["mp4"] == str(folder / "0.mp4")


def test_split_sampling_equals_the_whole_diffusers_pipeline(world, tmp_path):
    """Rank-0 decoding of the pipeline's latents (the split path) gives what one WanPipeline call with its VAE
    gives (diffusers' own decode and postprocessing)."""
    from diffusers import WanPipeline
    model = _model(world, torch.float32)
    s = _settings(world, tmp_path)
    v = V.Validator(s, model, torch.device("cpu"), rank=0, sp_size=1)
    ours = v.decode(v.sample(1))
    p = V.read_prompts_file(world["prompts"])
    pipe = WanPipeline.from_pretrained(world["pipe"], transformer=model)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt_embeds=p["prompt_embeds"][1:2], negative_prompt_embeds=p["negative_embeds"], height=32, width=32,
               num_frames=5, num_inference_steps=2, guidance_scale=3.0, generator=torch.Generator().manual_seed(8),
               output_type="np").frames[0]
    assert ours.shape == ref.shape == (5, 32, 32, 3)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
    euler = V.Validator(_settings(world, tmp_path, scheduler="euler", flow_shift=5.0), model, torch.device("cpu"),
                        rank=0, sp_size=1)
    assert type(euler.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and euler.scheduler.config.shift == 5.0
    assert v.scheduler.config.flow_shift == 3.0 and type(v.scheduler).__name__ == "UniPCMultistepScheduler"


def test_bad_validation_settings_are_named(world, tmp_path):
    from diffusers import WanTransformer3DModel
    model = _model(world, torch.float32)
    for over, msg in ((dict(frames=6), r"--validation-frames 6: must be 4n\+1"),
                      (dict(height=40), r"--validation-size 40x32: must be multiples of 16x16")):
        with pytest.raises(SPConfigError, match=msg):
            V.Validator(_settings(world, tmp_path, **over), model, torch.device("cpu"), rank=0, sp_size=1)
    with pytest.raises(SPConfigError, match=r"8 tokens do not divide by --context-parallel-size=3"):
        V.Validator(_settings(world, tmp_path), model, torch.device("cpu"), rank=0, sp_size=3)
    i2v = WanTransformer3DModel.from_pretrained(world["i2v"], subfolder="transformer")
    with pytest.raises(SPConfigError, match=r"in_channels=12, image embeddings \(an image-to-video model\)"):
        V.Validator(_settings(world, tmp_path), i2v, torch.device("cpu"), rank=0, sp_size=1)
    wide = WanTransformer3DModel(**{**dict(model.config), "text_dim": 32})
    with pytest.raises(SPConfigError, match=r"embeddings 16 wide, the model's text_dim is 32"):
        V.Validator(_settings(world, tmp_path), wide, torch.device("cpu"), rank=0, sp_size=1)
    import importlib.util
    real = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as mp:   # checked on every rank before sampling: none waits on a failed writer
        mp.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else real(name, *a))
        with pytest.raises(SPConfigError, match=r"imageio and imageio-ffmpeg, not installed here"):
            V.Validator(_settings(world, tmp_path), model, torch.device("cpu"), rank=1, sp_size=1)
    (tmp_path / "x.safetensors").write_bytes(b"junk")
    with pytest.raises(SPConfigError, match=r"--validation-prompts .*x\.safetensors: not a safetensors file"):
        V.read_prompts_file(str(tmp_path / "x.safetensors"))
    from training import train_wan_diffusers as entry
    for argv, msg in ((["--validation-prompts", world["prompts"]], "needs --log-dir"),
                      (["--validation-every", "5"], "--validation-every without --validation-prompts"),
                      (["--validation-prompts", world["prompts"], "--log-dir", str(tmp_path), "--validation-size",
                        "480"], "--validation-size '480': expected HxW")):
        with pytest.raises(SystemExit):
            entry.parse(["--model", "tiny", *argv])
        with pytest.raises(SPConfigError, match=msg):
            V.settings_from_args(entry.build_parser().parse_args(["--model", "tiny", *argv]))


def _train(rank, size, argv):
    from training import train_wan_diffusers as entry
    return entry.main(list(argv))["losses"]


def test_trainer_writes_validation_videos_every_n_steps_under_sp2(world, tmp_path):
    """prepare -> train_wan_diffusers (--init the pipeline's transformer, SP=2) with --validation-every 2 over 3
    steps: videos at steps 2 and 3 (the end), none twice."""
    videos = tmp_path / "videos"
    W.write_video(videos / "a.mp4", W.random_frames(9, 32, 32, 1))
    (videos / "a.txt").write_text("a red cat runs")
    data = tmp_path / "data"
    prepare.main(["--pipeline", world["pipe"], "--input", str(videos), "--output", str(data), "--frames", "5",
                  "--buckets", "32x32", "--max-sequence-length", str(L), "--log-level", "WARNING"])
    log = tmp_path / "log"
    argv = ["--init", world["pipe"], "--data-path", str(data), "--train-iters", "3", "--quiet", "--log-dir", str(log),
            "--context-parallel-size", "2", "--cp-comm-type", "ulysses", "--validation-prompts", world["prompts"],
            "--validation-every", "2", "--validation-steps", "2", "--validation-frames", "5", "--validation-size",
            "32x32"]
    losses = run_ranks(_train, 2, argv, timeout=300)
    assert len(losses[0]) == 3
    val = log / "validation"
    assert sorted(os.listdir(val)) == ["index.jsonl", "step_000002", "step_000003"]
    for step in ("step_000002", "step_000003"):
        assert sorted(os.listdir(val / step)) == ["0.mp4", "0.png", "1.mp4", "1.png", "loss.png", "prompts.txt",
                                                   "step_time.png"]
    rows = [json.loads(line) for line in open(log / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
