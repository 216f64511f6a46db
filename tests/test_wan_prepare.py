"""training/wan_diffusers/prepare.py: videos + captions -> the Wan trainer's latent files, on tiny random pipelines the
test writes (tests/wan_pipeline_dir.py) and videos it writes (mp4, webm, a folder of png frames).

Held-out references are diffusers' own code paths on the same components: VideoProcessor.preprocess_video (pixels),
WanPipeline.encode_prompt (text), WanImageToVideoPipeline.prepare_latents (the I2V condition; with
expand_timesteps, Wan 2.2 TI2V's first-frame latent) and encode_image (CLIP), and the VAE's posterior mode
normalized by hand from its config."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megatron_sp_ext.errors import SPConfigError
from tests import wan_pipeline_dir as W
from tests.harness import run_ranks
from training.wan_diffusers import media, prepare

pytest.importorskip("imageio_ffmpeg", reason="prepare reads videos with imageio's ffmpeg plugin ([diffusers] extra)")

L = 16   # umT5 tokens per caption in these tests (512 in Wan)
FRAMES, BUCKETS = "5,9", "32x48,48x32,32x32"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny pipelines (t2v, i2v, ti2v) and an input folder: an mp4 (12 frames, 40x56), a webm in a subfolder (10
    frames, 56x40), a png frame folder (7 frames, 32x32), each with its caption beside it."""
    root = tmp_path_factory.mktemp("wan_prepare")
    pipes = {k: W.write_pipeline(root / f"pipe_{k}", k) for k in ("t2v", "i2v", "ti2v")}
    vids = root / "videos"
    W.write_video(vids / "a.mp4", W.random_frames(12, 40, 56, 1))
    (vids / "a.txt").write_text("a red cat runs on the beach")
    W.write_video(vids / "sub" / "b.webm", W.random_frames(10, 56, 40, 2))
    (vids / "sub" / "b.txt").write_text("a dog jumps in rain")
    W.write_frame_folder(vids / "c", W.random_frames(7, 32, 32, 3))
    (vids / "c.txt").write_text("blue car at night")
    return {"root": root, "pipes": pipes, "videos": str(vids)}


def _args(pipe, videos, out, *extra):
    return ["--pipeline", pipe, "--input", videos, "--output", str(out), "--frames", FRAMES, "--buckets", BUCKETS,
            "--max-sequence-length", str(L), "--log-level", "WARNING", *extra]


def _files(out) -> dict:
    return {f: load_file(os.path.join(out, f)) for f in sorted(os.listdir(out)) if f.endswith(".safetensors")}


def _index(out) -> list:
    with open(os.path.join(out, "index.jsonl")) as f:
        return [json.loads(line) for line in f]


def _clip(world, source, sizes=BUCKETS):
    item = next(it for it in media.discover(world["videos"]) if it.source == source)
    return media.read_clip(item, media.Buckets((5, 9), media.parse_sizes(sizes))).frames_fhwc


def test_t2v_files_match_diffusers_encode_paths(world, tmp_path):
    from diffusers import AutoencoderKLWan, WanPipeline
    from diffusers.video_processor import VideoProcessor
    from PIL import Image
    out = tmp_path / "out"
    summary = prepare.main(_args(world["pipes"]["t2v"], world["videos"], out))
    assert (summary["written"], summary["skipped"], summary["index"]) == (3, 0, 3)
    rows = {r["source"]: r for r in _index(out)}
    # mp4 40x56 (aspect 1.4) -> 32x48 (1.5), 12 frames -> 9; webm 56x40 -> 48x32, 10 -> 9; png folder 7 -> 5, 32x32
    expect = {"a.mp4": (9, 32, 48), os.path.join("sub", "b.webm"): (9, 48, 32), "c": (5, 32, 32)}
    assert sorted(rows) == sorted(expect)
    vae = AutoencoderKLWan.from_pretrained(world["pipes"]["t2v"], subfolder="vae")
    pipe = WanPipeline.from_pretrained(world["pipes"]["t2v"], vae=vae)
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    for source, (f, h, w) in expect.items():
        r = rows[source]
        t = load_file(out / r["file"])
        with safe_open(out / r["file"], "pt") as st:
            meta = st.metadata()
        assert sorted(t) == ["latent", "text"]
        assert list(t["latent"].shape) == r["latent_shape"] == [4, (f - 1) // 4 + 1, h // 8, w // 8]
        assert t["latent"].dtype == torch.float32 and t["text"].dtype == torch.float32
        assert (meta["source"], meta["frames"], meta["height"], meta["width"]) == (source, str(f), str(h), str(w))
        assert meta["format"] == "wan-latents-v1" and meta["vae"].startswith("AutoencoderKLWan z_dim=4")
        assert meta["caption"] == r["caption"] and not r["has_cond"] and not r["has_image_embeds"]
        frames = _clip(world, source)
        # pixels: diffusers' VideoProcessor on the same (already bucket-sized) frames
        ref_px = VideoProcessor(vae_scale_factor=8).preprocess_video([Image.fromarray(x) for x in frames], h, w)
        from training.wan_diffusers.encoders import pixels
        ours_px = pixels(torch.from_numpy(frames), torch.device("cpu"), torch.float32)
        assert torch.equal(ours_px, ref_px)
        with torch.no_grad():
            z = vae.encode(ref_px).latent_dist.mode()[0]
            ref_text, _ = pipe.encode_prompt(r["caption"], do_classifier_free_guidance=False, max_sequence_length=L)
        torch.testing.assert_close(t["latent"], (z - mean) / std, rtol=1e-5, atol=1e-6)
        assert torch.equal(t["text"], ref_text[0].float())
        n = r["text_tokens"]   # real tokens kept, zeros after them
        assert t["text"].shape == (L, 16) and t["text"][:n].abs().sum(-1).min() > 0 and not t["text"][n:].any()
    from training.video_dit.data import LatentShardDataset   # the trainer's reader takes the folder as it is
    ds = LatentShardDataset(str(out), channels=4, text_dim=16, patch=(1, 2, 2))
    assert len(ds) == 3 and ds[0]["latent"].shape[0] == 4


def test_i2v_condition_and_clip_embedding_match_the_pipeline(world, tmp_path):
    from diffusers import WanImageToVideoPipeline
    from PIL import Image
    out = tmp_path / "out"
    prepare.main(_args(world["pipes"]["i2v"], world["videos"], out, "--i2v"))
    pipe = WanImageToVideoPipeline.from_pretrained(world["pipes"]["i2v"])
    for r in _index(out):
        t = load_file(out / r["file"])
        assert r["has_cond"] and r["has_image_embeds"] and t["cond_latent"].shape == t["latent"].shape
        f, h, w = r["frames"], r["height"], r["width"]
        frames = _clip(world, r["source"])
        image = pipe.video_processor.preprocess(Image.fromarray(frames[0]), height=h, width=w)
        with torch.no_grad():
            _, cond = pipe.prepare_latents(image, 1, 4, h, w, f, torch.float32, torch.device("cpu"),
                                           torch.Generator().manual_seed(0))
            embeds = pipe.encode_image(Image.fromarray(frames[0]), torch.device("cpu"))
        mask_channels = pipe.vae_scale_factor_temporal   # [mask (4 channels), latent_condition]
        torch.testing.assert_close(t["cond_latent"], cond[0, mask_channels:], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t["image_embeds"], embeds[0], rtol=1e-5, atol=1e-6)
        assert t["image_embeds"].shape == (17, 16)
        assert not torch.allclose(t["cond_latent"], t["latent"], atol=1e-3)   # only the first frame is given


def test_wan22_ti2v_vae_16x_and_first_frame_latent(world, tmp_path):
    """The Wan 2.2 TI2V-shaped VAE (residual, 2x2 pixel patches, z_dim 6 here, 48 in Wan): latents at 16x; the
    pipeline with expand_timesteps encodes the first frame alone, and that equals cond_latent[:, :1] (Wan's VAE is
    causal: the first latent frame sees the first pixel frame only)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image
    out = tmp_path / "out"
    with pytest.raises(media.VideoInputError, match=r"--buckets: 32x48, 48x32 not multiples of 32"):
        prepare.run(prepare.parse(_args(world["pipes"]["ti2v"], world["videos"], out, "--i2v")))
    args = _args(world["pipes"]["ti2v"], world["videos"], out, "--i2v")
    args[args.index("--buckets") + 1] = "32x64,64x32,32x32"
    prepare.main(args)
    t2v = WanPipeline.from_pretrained(world["pipes"]["ti2v"])   # Wan 2.2 TI2V's I2V mode: expand_timesteps
    pipe = WanImageToVideoPipeline(t2v.tokenizer, t2v.text_encoder, t2v.vae, t2v.scheduler,
                                   transformer=t2v.transformer, expand_timesteps=True)
    for r in _index(out):
        t = load_file(out / r["file"])
        f, h, w = r["frames"], r["height"], r["width"]
        assert list(t["latent"].shape) == [6, (f - 1) // 4 + 1, h // 16, w // 16] and "image_embeds" not in t
        frames = _clip(world, r["source"], "32x64,64x32,32x32")
        image = pipe.video_processor.preprocess(Image.fromarray(frames[0]), height=h, width=w)
        with torch.no_grad():
            _, first, _ = pipe.prepare_latents(image, 1, 6, h, w, f, torch.float32, torch.device("cpu"),
                                               torch.Generator().manual_seed(0))
        torch.testing.assert_close(t["cond_latent"][:, :1], first[0], rtol=1e-5, atol=1e-5)


def test_resume_skips_done_files_and_refuses_other_settings(world, tmp_path):
    out = tmp_path / "out"
    args = _args(world["pipes"]["t2v"], world["videos"], out)
    prepare.main(args)
    first = {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out) if f.endswith(".safetensors")}
    before = _files(out)
    gone = sorted(first)[1]
    os.remove(out / gone)                            # one file lost (its row stays in the index)
    summary = prepare.main(args)
    assert (summary["written"], summary["already"]) == (1, 2)
    for f, t in first.items():
        if f != gone:
            assert os.stat(out / f).st_mtime_ns == t   # not rewritten
    after = _files(out)
    assert sorted(after) == sorted(before) and all(torch.equal(after[f][k], before[f][k])
                                                   for f in after for k in after[f])
    assert [r["source"] for r in _index(out)] == sorted(r["source"] for r in _index(out)) and len(_index(out)) == 3
    assert not [f for f in os.listdir(out) if f.startswith("index.part-")]
    assert prepare.main(args)["written"] == 0
    with pytest.raises(SPConfigError, match=r"prepared with other settings \(frames: \[5, 9\] then, \[5\] now\)"):
        prepare.main(_args(world["pipes"]["t2v"], world["videos"], out)[:6] + ["--frames", "5", "--buckets",
                                                                               BUCKETS, "--max-sequence-length",
                                                                               str(L)])


def _share(rank, world_size, args):
    return prepare.run(prepare.parse(args), rank, world_size)


@pytest.mark.parametrize("how", ["torchrun", "shard"])
def test_two_shares_write_what_one_process_writes(world, tmp_path, how):
    one, two = tmp_path / "one", tmp_path / "two"
    prepare.main(_args(world["pipes"]["t2v"], world["videos"], one))
    if how == "torchrun":   # two ranks at once: every 2nd video each, both merging under the lock
        results = run_ranks(_share, 2, _args(world["pipes"]["t2v"], world["videos"], two), timeout=300)
        assert sorted(r["written"] for r in results) == [1, 2]
    else:                   # --shard 1/2 then 0/2 as two separate commands
        assert prepare.main(_args(world["pipes"]["t2v"], world["videos"], two, "--shard", "1/2"))["written"] == 1
        assert prepare.main(_args(world["pipes"]["t2v"], world["videos"], two, "--shard", "0/2"))["written"] == 2
    a, b = _files(one), _files(two)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])
    assert _index(one) == _index(two)
    assert not [f for f in os.listdir(two) if f.startswith("index.part-")]


def test_bad_inputs_are_named(world, tmp_path, capsys):
    vids = tmp_path / "videos"
    shutil.copytree(world["videos"], vids)
    (vids / "broken.mp4").write_bytes(b"not a video at all")
    (vids / "broken.txt").write_text("a bird")
    W.write_video(vids / "short.mp4", W.random_frames(3, 32, 32, 4))
    (vids / "short.txt").write_text("a small bird")
    out = tmp_path / "out"
    args = _args(world["pipes"]["t2v"], str(vids), out)
    with pytest.raises(media.VideoInputError, match=r"broken\.mp4: unreadable video"):
        prepare.main(args)
    assert prepare.run_command(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("[prepare] error: ") and "broken.mp4: unreadable video" in err[-1]
    os.remove(vids / "broken.mp4")
    with pytest.raises(media.VideoInputError, match=r"short\.mp4: 3 frame\(s\), fewer than the smallest --frames "
                                                    r"bucket 5.*--skip-bad-inputs"):
        prepare.main(args)
    (vids / "broken.mp4").write_bytes(b"not a video at all")
    summary = prepare.main(args + ["--skip-bad-inputs", "--num-workers", "1"])   # errors through a worker too
    assert (summary["skipped"], summary["index"]) == (2, 3)
    skipped = [json.loads(line) for line in open(out / "skipped.jsonl")]
    assert [s["source"] for s in skipped] == ["broken.mp4", "short.mp4"]
    assert "unreadable video" in skipped[0]["skipped"] and "fewer than the smallest" in skipped[1]["skipped"]
    os.remove(vids / "short.txt")
    with pytest.raises(media.VideoInputError, match=r"short\.mp4: no caption: expected .*short\.txt"):
        media.discover(str(vids))
    lst = tmp_path / "list.csv"
    lst.write_text("path,caption\na.mp4,a red cat\nmissing.mp4,a dog\n")
    with pytest.raises(media.VideoInputError, match=r"--captions .*list\.csv line 3: .*missing\.mp4 is neither"):
        media.discover(str(vids), str(lst))
    jl = tmp_path / "list.jsonl"
    jl.write_text(json.dumps({"video": "c", "text": "blue car"}) + "\n" + json.dumps({"path": "a.mp4"}) + "\n")
    with pytest.raises(media.VideoInputError, match=r"list\.jsonl line 2: no caption"):
        media.discover(str(vids), str(jl))
    jl.write_text(json.dumps({"video": "c", "text": "blue car"}) + "\n")
    assert [(i.source, i.caption, i.kind) for i in media.discover(str(vids), str(jl))] == [("c", "blue car", "frames")]
    with pytest.raises(media.VideoInputError, match=r"--frames 5,8: \[8\] not of the form 4n\+1"):
        media.check_buckets(media.Buckets((5, 8), ((32, 32),)), 4, 16)
    for bad in (["--shard", "2/2"], ["--frames", "x"], ["--buckets", "32by48"]):
        with pytest.raises(SystemExit):
            prepare.parse(_args(world["pipes"]["t2v"], str(vids), out)[:-2] + bad)
    with pytest.raises(SPConfigError, match=r"--pipeline .*nowhere: no such directory"):
        prepare.main(["--pipeline", str(tmp_path / "nowhere"), "--input", str(vids), "--output", str(out)])


def test_buckets_and_resize_crop():
    b = media.Buckets((33, 81, 49), ((480, 832), (832, 480), (624, 624)))
    assert b.size_for(1080, 1920) == (480, 832) and b.size_for(1920, 1080) == (832, 480)
    assert b.size_for(1000, 1100) == (624, 624) and b.frames_for(60) == 49 and b.frames_for(32) is None
    frame = np.zeros((40, 80, 3), np.uint8)
    frame[:, 30:50] = 255                              # a white bar in the middle
    crop = media.resize_crop(frame, 32, 32)            # cover: 40x80 -> 32x64, then the middle 32 columns
    assert crop.shape == (32, 32, 3) and crop[:, 16].min() == 255 and crop[:, 0].max() == 0


def test_validation_prompts_file(world, tmp_path):
    from diffusers import WanPipeline
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat runs\n\na dog jumps on the beach\n")
    out = prepare.main(["--pipeline", world["pipes"]["t2v"], "--output", str(tmp_path / "o"), "--prompts",
                        str(prompts), "--negative-prompt", "rain", "--max-sequence-length", str(L)])["prompts"]
    t = load_file(out)
    with safe_open(out, "pt") as st:
        meta = st.metadata()
    assert json.loads(meta["prompts"]) == ["a cat runs", "a dog jumps on the beach"]
    assert meta["format"] == "wan-prompts-v1" and meta["negative_prompt"] == "rain"
    pipe = WanPipeline.from_pretrained(world["pipes"]["t2v"])
    with torch.no_grad():
        ref, neg = pipe.encode_prompt(["a cat runs", "a dog jumps on the beach"], "rain", max_sequence_length=L)
    assert torch.equal(t["prompt_embeds"], ref.float()) and torch.equal(t["negative_embeds"], neg[:1].float())
