r"""Seconds per clip of Wan's data preparation (training/wan_diffusers/prepare.py) with real-sized random-weight
encoders, and the sampling time of the trainer's validation videos (training/wan_diffusers/validate.py).

    python tools/bench_wan_prepare.py --out results/wan_prepare/h200.json                  # one GPU: both parts
    torchrun --nproc-per-node 2 tools/bench_wan_prepare.py --part sample --out results/wan_prepare/sample_sp2.json

prepare part (one process): a generated video (--src-frames frames of --src-size pixels, smooth moving colour plus
noise, written as mp4 with imageio-ffmpeg) copied --clips times into a folder with captions, then ``prepare.run``
(DataLoader decoding, resize + crop to --bucket, VAE, umT5, files, index) per variant, after a one-clip warm-up run:
seconds_per_clip = the timed run's encode loop / clips. Beside it the parts, each the median of --repeats
synchronized calls: read_s (decode + resize, one CPU process), vae_s (the clip's latents), text_s (umT5, 512 tokens),
cond_s and clip_s (I2V: the first-frame condition, the CLIP embedding), and the peak GPU memory. Variants (--variants):
wan2.1 (Wan 2.1's VAE: z 16, 8x), wan2.1-i2v (+ cond latent + CLIP ViT-H/14, 257 tokens), wan2.2 (Wan 2.2 TI2V-5B's
VAE: z 48, 16x, residual, 2x2 patches), wan2.2-ti2v (+ cond latent). Random weights of the real configs: umT5-XXL
(24 layers, 4096 wide, 64 heads, 5.7B parameters), the VAEs, CLIP ViT-H/14; the tokenizer is a word-level stand-in
(umT5 always runs 512 padded tokens, so its cost does not depend on it). bfloat16 (the command's default on CUDA).

sample part (every rank): Wan 2.1 1.3B (diffusers' config, random init, fp32 weights, bf16 autocast as the trainer
holds it) parallelized over all ranks (``megatron_sp_ext.diffusers.parallelize``, --mode) when more than one, the
Wan 2.1 VAE (random) decoding on rank 0, --prompts random prompt embeddings [512, 4096]; one warm-up video of 2 steps,
then ``Validator.run``: sample_s (all --sample-steps denoising steps with guidance, i.e. 2 forwards per step) and
decode_s per video, and the mp4 + png written.

--dry-run: tiny stand-ins on CPU (a 9-frame 40x56 clip to 32x64, z 4 VAEs, a 1-layer umT5, 2 sampling steps) for
the tests.
Rows carry machine, date, commit, command.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.benchlib import join_torchrun, run_meta, write_json  # noqa: E402
from training.video_dit.faults import on_rank0  # noqa: E402
from training.wan_diffusers import encoders as E  # noqa: E402
from training.wan_diffusers import media, prepare  # noqa: E402

WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12, patch_size=2,
                 scale_factor_spatial=16, is_residual=True, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
VAES = {"wan2.1": {}, "wan2.2": WAN22_VAE}   # AutoencoderKLWan keywords beside its defaults (Wan 2.1's VAE)
VARIANTS = {"wan2.1": ("wan2.1", False), "wan2.1-i2v": ("wan2.1", True), "wan2.2": ("wan2.2", False),
            "wan2.2-ti2v": ("wan2.2", True)}   # name -> (VAE, I2V); CLIP only with Wan 2.1 (Wan 2.2 has none)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu")
CLIP_H14 = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                image_size=224, patch_size=14, hidden_act="gelu")
DRY = {"vae": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, latents_mean=[0.0] * 4,
                   latents_std=[1.0] * 4),
       "vae22": dict(base_dim=8, decoder_base_dim=16, z_dim=6, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                     is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16,
                     latents_mean=[0.0] * 6, latents_std=[1.0] * 6),
       "umt5": dict(vocab_size=1003, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                    relative_attention_num_buckets=8),
       "clip": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                    patch_size=8),
       "wan": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                   text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=64)}   # WanTransformer3DModel
WORDS = [f"w{i}" for i in range(1000)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the result JSON")
    p.add_argument("--part", default="both", choices=["both", "prepare", "sample"])
    p.add_argument("--variants", default="wan2.1,wan2.1-i2v,wan2.2,wan2.2-ti2v", help="prepare variants (comma list)")
    p.add_argument("--src-frames", type=int, default=81)
    p.add_argument("--src-size", default="480x854", help="the generated video's HxW (480p 16:9)")
    p.add_argument("--bucket", default="480x832", help="prepare's --buckets (one); 480x832 fits both VAEs")
    p.add_argument("--clips", type=int, default=3, help="clips in the timed prepare run")
    p.add_argument("--repeats", type=int, default=3, help="calls per part timing (median)")
    p.add_argument("--vae-tiling", action="store_true", help="prepare's --vae-tiling")
    p.add_argument("--prompts", type=int, default=2, help="validation videos timed")
    p.add_argument("--sample-steps", type=int, default=30)
    p.add_argument("--sample-frames", type=int, default=81)
    p.add_argument("--sample-size", default="480x832")
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--mode", default="auto", help="parallelize's mode when the sample part runs on several ranks")
    p.add_argument("--work-dir", default=None, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (videos, latent files, validation mp4s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny CPU stand-ins (tests)")
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``repeats`` synchronized calls of ``fn``."""
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_video(folder: str, frames: int, size: tuple, clips: int, seed: int) -> str:
    """``folder``/clip_<i>.mp4 (``clips`` links to one generated video) with captions; returns the folder."""
    import imageio.v2 as imageio  # noqa: PLC0415
    os.makedirs(folder, exist_ok=True)
    h, w = size
    g = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    first = os.path.join(folder, "clip_0.mp4")
    with imageio.get_writer(first, "ffmpeg", fps=16, macro_block_size=1, quality=8) as wr:
        for f in range(frames):
            img = np.stack([(40 * c + 0.5 * xx + 0.7 * yy + 6.0 * f * (c + 1)) % 256 for c in range(3)], -1)
            wr.append_data(np.clip(img + g.normal(0, 6, img.shape), 0, 255).astype(np.uint8))
    for i in range(clips):
        path = os.path.join(folder, f"clip_{i}.mp4")
        if i:
            os.link(first, path)
        with open(os.path.join(folder, f"clip_{i}.txt"), "w") as f:
            f.write(" ".join(WORDS[(37 * i + k) % len(WORDS)] for k in range(60)))
    return folder


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def random_vae(name: str, dry: bool, device, dtype, seed: int):
    from diffusers import AutoencoderKLWan  # noqa: PLC0415
    torch.manual_seed(seed)
    kw = (DRY["vae22"] if name == "wan2.2" else DRY["vae"]) if dry else VAES[name]
    with torch.device(device):
        return AutoencoderKLWan(**kw).to(dtype).eval()


def random_text(dry: bool, device, dtype, seed: int, num_layers: Optional[int] = None):
    """A WanPipeline holding a random umT5 encoder (XXL, or the dry stand-in; ``num_layers``: fewer blocks of the
    same width) and the word-level tokenizer."""
    from diffusers import WanPipeline  # noqa: PLC0415
    from transformers import UMT5Config, UMT5EncoderModel  # noqa: PLC0415
    torch.manual_seed(seed)
    cfg = dict(DRY["umt5"] if dry else UMT5_XXL)
    if num_layers is not None:
        cfg["num_layers"] = num_layers
    with torch.device(device):
        te = UMT5EncoderModel(UMT5Config(**cfg)).to(dtype).eval()
    return WanPipeline(tokenizer=tokenizer(), text_encoder=te, vae=None, scheduler=None)


def random_clip(dry: bool, device, seed: int):
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel  # noqa: PLC0415
    torch.manual_seed(seed)
    cfg = DRY["clip"] if dry else CLIP_H14
    with torch.device(device):
        model = CLIPVisionModel(CLIPVisionConfig(**cfg)).float().eval()
    side = cfg["image_size"]
    return model, CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def _mem(device) -> Optional[float]:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def bench_prepare(args, work: str, device, dtype) -> list:
    """One row per variant (module docstring)."""
    size = media.parse_sizes(args.src_size, "--src-size")[0]
    videos = make_video(os.path.join(work, "videos"), args.src_frames, size, args.clips, args.seed)
    warm = make_video(os.path.join(work, "warm"), args.src_frames, size, 1, args.seed)
    text = random_text(args.dry_run, device, dtype, args.seed)
    rows = []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
        vae_name, i2v = VARIANTS[name]
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        vae = random_vae(vae_name, args.dry_run, device, dtype, args.seed)
        pipe = os.path.join(work, f"pipe_{vae_name}")
        vae.save_config(os.path.join(pipe, "vae"))   # what prepare.run reads of the pipeline directory
        image_encoder = processor = None
        if i2v and vae_name == "wan2.1":
            image_encoder, processor = random_clip(args.dry_run, device, args.seed)
        settings = E.EncoderSettings(pipe, device, dtype, i2v=i2v, vae_tiling=args.vae_tiling,
                                     max_sequence_length=512)
        if args.vae_tiling:
            vae.enable_tiling()
        enc = E.WanEncoders(settings, vae, dict(vae.config), text, image_encoder, processor)
        flags = ["--pipeline", pipe, "--frames", str(args.src_frames), "--buckets", args.bucket,
                 "--log-level", "WARNING"] + (["--i2v"] if i2v else []) + (["--vae-tiling"] if args.vae_tiling else [])
        prepare.run(prepare.parse(["--input", warm, "--output", os.path.join(work, f"warm_{name}"), *flags]), enc=enc)
        summary = prepare.run(prepare.parse(["--input", videos, "--output", os.path.join(work, f"out_{name}"),
                                             *flags]), enc=enc)
        item = media.discover(videos)[0]
        buckets = media.Buckets((args.src_frames,), media.parse_sizes(args.bucket))
        clip = media.read_clip(item, buckets)
        frames = torch.from_numpy(clip.frames_fhwc)
        row = {"variant": name, "vae": E.vae_identity(dict(vae.config)), "i2v": i2v, "clips": summary["written"],
               "frames": int(frames.shape[0]), "size": list(frames.shape[1:3]),
               "latent_shape": list(enc.latent(frames).shape), "dtype": str(dtype).replace("torch.", ""),
               "seconds_per_clip": round(summary["seconds"] / max(1, summary["written"]), 3),
               "read_s": round(timed(lambda: media.read_clip(item, buckets), device, args.repeats), 3),
               "vae_s": round(timed(lambda: enc.latent(frames), device, args.repeats), 3),
               "text_s": round(timed(lambda: enc.text(item.caption), device, args.repeats), 3)}
        if i2v:
            row["cond_s"] = round(timed(lambda: enc.cond_latent(frames), device, args.repeats), 3)
        if image_encoder is not None:
            row["clip_s"] = round(timed(lambda: enc.image_embeds(clip.frames_fhwc[0]), device, args.repeats), 3)
        row["peak_mem_gib"] = _mem(device)
        print(f"[bench_wan_prepare] {row}", flush=True)
        rows.append(row)
        enc = vae = image_encoder = None   # freed before the next variant builds its own
    return rows


def bench_sample(args, work: str, device, rank: int, world: int) -> dict:
    """The validation videos' sampling time (module docstring); rank 0's row."""
    from diffusers import UniPCMultistepScheduler, WanTransformer3DModel  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415
    from training.wan_diffusers import validate as V  # noqa: PLC0415
    from training.wan_diffusers.model import preset_kwargs  # noqa: PLC0415
    pipe = os.path.join(work, "pipe_sample")
    text_dim = 16 if args.dry_run else 4096

    def write_inputs() -> None:   # rank 0; the others wait in on_rank0's broadcast (the barrier it was)
        vae = random_vae("wan2.1", args.dry_run, "cpu", torch.float32, args.seed)
        vae.save_pretrained(os.path.join(pipe, "vae"), safe_serialization=True)
        UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                num_train_timesteps=1000).save_pretrained(os.path.join(pipe, "scheduler"))
        g = torch.Generator().manual_seed(args.seed)
        embeds = torch.randn(args.prompts, 512, text_dim, generator=g)
        save_file({"prompt_embeds": embeds, "negative_embeds": torch.randn(1, 512, text_dim, generator=g)},
                  os.path.join(work, "prompts.safetensors"),
                  metadata={"format": E.PROMPTS_FORMAT, "prompts": json.dumps(
                      [f"random prompt {i}" for i in range(args.prompts)]), "negative_prompt": "", "pipeline": pipe})
    on_rank0("bench_sample: writing the VAE, scheduler and prompts", write_inputs)
    kw = dict(DRY["wan"]) if args.dry_run else preset_kwargs("wan-1.3b")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = WanTransformer3DModel(**kw).float()
    if world > 1:
        from megatron_sp_ext.diffusers import parallelize  # noqa: PLC0415
        parallelize(model, dist.group.WORLD, mode=args.mode)
    h, w = media.parse_sizes(args.sample_size, "--sample-size")[0]
    autocast = torch.bfloat16 if device.type == "cuda" else None

    def settings(out: str, steps: int) -> "V.ValidationSettings":
        return V.ValidationSettings(os.path.join(work, "prompts.safetensors"), pipe, out, sampling=V.Sampling(
            steps=steps, guidance=args.guidance, seed=args.seed, frames=args.sample_frames, height=h, width=w))
    warm = V.Validator(settings(os.path.join(work, "val_warm"), 2), model, device, rank=rank, sp_size=world,
                       autocast=autocast)
    warm.prompts = warm.prompts[:1]
    warm.run(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    v = V.Validator(settings(os.path.join(work, "val"), args.sample_steps), model, device, rank=rank, sp_size=world,
                    autocast=autocast)
    res = v.run(1)
    row = {"sp": world, "mode": args.mode if world > 1 else None, "model": "tiny" if args.dry_run else "wan-1.3b",
           "frames": args.sample_frames, "size": [h, w], "steps": args.sample_steps, "guidance": args.guidance,
           "tokens": int(np.prod(res["latents"][0].shape[2:])) // 4, "videos": res["rows"],
           "sample_s": [r["sample_s"] for r in res["rows"]], "decode_s": [r["decode_s"] for r in res["rows"]],
           "peak_mem_gib": _mem(device)}
    if rank == 0:
        print(f"[bench_wan_prepare] sample {row['sample_s']} s, decode {row['decode_s']} s", flush=True)
    return row


def main(argv: Optional[list] = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        args.src_frames, args.src_size, args.bucket = 9, "40x56", "32x64"
        args.sample_steps, args.sample_frames, args.sample_size = 2, 5, "32x32"
    rank, world, device, own_pg = join_torchrun(use_cuda=not args.dry_run)
    cuda = device.type == "cuda"
    if world > 1 and args.part != "sample":
        raise SystemExit("--part prepare/both runs on one process (prepare shares over ranks by itself): under "
                         "torchrun give --part sample")
    dtype = torch.bfloat16 if cuda else torch.float32
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_wan_prepare_")
    if world > 1:
        box = [work]
        dist.broadcast_object_list(box, src=0)
        work = box[0]
    doc = {"meta": run_meta(world=world, dry_run=args.dry_run)}
    try:
        if args.part in ("both", "prepare"):
            doc["prepare"] = bench_prepare(args, work, device, dtype)
        if args.part in ("both", "sample"):
            doc["sample"] = bench_sample(args, work, device, rank, world)
        if rank == 0:
            write_json(args.out, doc)
            print(f"[bench_wan_prepare] wrote {args.out}", flush=True)
    finally:
        if world > 1:
            dist.barrier()
        if rank == 0 and not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
        if own_pg:
            dist.destroy_process_group()
    return doc


if __name__ == "__main__":
    main()
