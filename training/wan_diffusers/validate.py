r"""Validation videos while training: every N steps and at the end, the trained transformer samples the prompts of a
prompts file with diffusers' ``WanPipeline``, every SP rank taking part.

    python -m training.wan_diffusers.prepare --pipeline DIR --output data/ --prompts prompts.txt   # once
    train_wan_diffusers.py ... --log-dir runs/x --validation-prompts data/validation/prompts.safetensors \
        --validation-every 100 --validation-steps 30 --validation-size 480x832 --validation-frames 81

Written by rank 0 under ``<log-dir>/validation/step_<N>/``: ``<i>.mp4`` (diffusers' export_to_video),
``<i>.png`` (a strip of up to 8 frames), ``prompts.txt`` and the training telemetry's plots so far (loss.png,
step_time.png); ``<log-dir>/validation/index.jsonl`` one row per video (step, prompt, files, seconds).

The prompts are umT5 embeddings written by prepare ``--prompts`` (the same encode path as the training captions):
the trainer never holds umT5-XXL (5.7B parameters, 11 GB in bf16) and every rank reads the same tensors. The VAE
(``--validation-pipeline DIR``/vae, default: the pipeline the prompts were encoded with) is loaded on rank 0 only,
which decodes; the scheduler is the pipeline's UniPC (or flow-matching Euler) at ``--validation-flow-shift``.

SP: the transformer runs as the trainer holds it (parallelized by ``megatron_sp_ext.diffusers.parallelize``, FSDP2
shards and LoRA adapters included): every rank calls the pipeline with the same inputs and the same seed, so each
gets the same full noise prediction (the model's gathered output), the same scheduler steps and the same latents;
rank 0 decodes them. Text-to-video only (WanPipeline): an I2V transformer (image conditioning channels) is refused
by name.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from megatron_sp_ext.errors import SPConfigError

from training.video_dit.faults import on_rank0
from training.wan_diffusers import encoders as E

logger = logging.getLogger("video_dit")
SCHEDULERS = ("unipc", "euler")


@dataclass(frozen=True)
class Sampling:
    """How each video is sampled: denoising steps, guidance scale (<= 1: no negative pass), seed (prompt i: seed +
    i), frames (4n+1), height x width (pixels), fps of the mp4, scheduler ("unipc" or "euler") and its flow shift
    (None: the pipeline's)."""

    steps: int = 30
    guidance: float = 5.0
    seed: int = 42
    frames: int = 81
    height: int = 480
    width: int = 832
    fps: int = 16
    scheduler: str = "unipc"
    flow_shift: Optional[float] = None


@dataclass(frozen=True)
class ValidationSettings:
    """prompts: the prompts file (prepare --prompts); pipeline: the Wan pipeline directory of the VAE and the
    scheduler; out_dir: where step_<N>/ folders go; log_dir: the run's metrics (plots); every: steps between
    validations (0: only at the end); sampling: the Sampling."""

    prompts: str
    pipeline: str
    out_dir: str
    log_dir: Optional[str] = None
    every: int = 0
    sampling: Sampling = Sampling()


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation videos (training/wan_diffusers/validate.py)")
    g.add_argument("--validation-prompts", default=None, metavar="FILE",
                   help="prompt embeddings written by `python -m training.wan_diffusers.prepare --prompts TXT`: "
                        "sample them every --validation-every steps and at the end (needs --log-dir)")
    g.add_argument("--validation-pipeline", default=None, metavar="DIR",
                   help="Wan pipeline directory whose vae/ decodes and scheduler/ samples (default: the one the "
                        "prompts were encoded with)")
    g.add_argument("--validation-every", type=int, default=0,
                   help="steps between validations (default 0: only at the end)")
    g.add_argument("--validation-steps", type=int, default=30, help="denoising steps per video (default 30)")
    g.add_argument("--validation-guidance", type=float, default=5.0,
                   help="classifier-free guidance scale (default 5.0; <= 1: no negative pass)")
    g.add_argument("--validation-seed", type=int, default=42, help="noise seed (default 42; prompt i uses seed + i)")
    g.add_argument("--validation-frames", type=int, default=81, help="frames per video, 4n+1 (default 81)")
    g.add_argument("--validation-size", default="480x832", help="video HxW in pixels (default 480x832)")
    g.add_argument("--validation-fps", type=int, default=16, help="frame rate of the written mp4 (default 16)")
    g.add_argument("--validation-scheduler", default="unipc", choices=SCHEDULERS,
                   help="unipc (default: the Wan pipelines' UniPCMultistepScheduler) or euler "
                        "(FlowMatchEulerDiscreteScheduler)")
    g.add_argument("--validation-flow-shift", type=float, default=None,
                   help="the scheduler's flow shift (default: the pipeline's; Wan: 3.0 at 480p, 5.0 at 720p)")


def read_prompts_file(path: str, flag: str = "--validation-prompts") -> dict:
    """{"prompt_embeds" [N, L, D], "negative_embeds" [1, L, D], "prompts", "negative_prompt", "pipeline"} of a
    prompts file; SPConfigError naming ``flag`` when it is not one."""
    from safetensors import safe_open  # noqa: PLC0415
    if not os.path.isfile(path):
        raise SPConfigError(f"{flag} {path}: no such file (write it with `python -m training.wan_diffusers.prepare "
                            f"--pipeline DIR --output DIR --prompts prompts.txt`)")
    try:
        with safe_open(path, framework="pt") as st:
            meta = st.metadata() or {}
            tensors = {k: st.get_tensor(k) for k in st.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types on a bad file
        raise SPConfigError(f"{flag} {path}: not a safetensors file ({str(e).splitlines()[0][:200]})") from None
    if meta.get("format") != E.PROMPTS_FORMAT or set(tensors) != {"prompt_embeds", "negative_embeds"}:
        raise SPConfigError(f"{flag} {path}: not a prompts file of prepare --prompts (format {meta.get('format')!r}, "
                            f"tensors {sorted(tensors)})")
    return {**tensors, "prompts": json.loads(meta.get("prompts", "[]")),
            "negative_prompt": meta.get("negative_prompt", ""), "pipeline": meta.get("pipeline")}


def settings_from_args(args: argparse.Namespace) -> Optional[ValidationSettings]:
    """The flags' ValidationSettings (None without --validation-prompts); SPConfigError naming the flag."""
    if args.validation_prompts is None:
        given = [f for f, v in (("--validation-pipeline", args.validation_pipeline),
                                ("--validation-every", args.validation_every)) if v]
        if given:
            raise SPConfigError(f"{', '.join(given)} without --validation-prompts: give the prompts file too")
        return None
    if not getattr(args, "log_dir", None):
        raise SPConfigError("--validation-prompts needs --log-dir (the videos go to <log-dir>/validation/)")
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", args.validation_size)
    if not m:
        raise SPConfigError(f"--validation-size {args.validation_size!r}: expected HxW pixels (e.g. 480x832)")
    for flag, n, least in (("--validation-every", args.validation_every, 0),
                           ("--validation-steps", args.validation_steps, 1),
                           ("--validation-frames", args.validation_frames, 1),
                           ("--validation-fps", args.validation_fps, 1)):
        if n < least:
            raise SPConfigError(f"{flag}={n}: must be >= {least}")
    if args.validation_flow_shift is not None and args.validation_flow_shift <= 0:
        raise SPConfigError(f"--validation-flow-shift={args.validation_flow_shift}: must be > 0")
    prompts = read_prompts_file(args.validation_prompts)
    pipeline = args.validation_pipeline or prompts["pipeline"]
    if not pipeline:
        raise SPConfigError(f"--validation-prompts {args.validation_prompts} names no pipeline: give "
                            f"--validation-pipeline DIR")
    sampling = Sampling(args.validation_steps, args.validation_guidance, args.validation_seed, args.validation_frames,
                        int(m.group(1)), int(m.group(2)), args.validation_fps, args.validation_scheduler,
                        args.validation_flow_shift)
    return ValidationSettings(args.validation_prompts, pipeline, os.path.join(args.log_dir, "validation"),
                              args.log_dir, args.validation_every, sampling)


def make_scheduler(pipeline: str, s: Sampling) -> Any:
    """``pipeline``'s scheduler config as UniPC (Wan's) or flow-matching Euler, at ``s.flow_shift``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler  # noqa: PLC0415
    path = os.path.join(pipeline, "scheduler", "scheduler_config.json")
    config = {}
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
    if s.scheduler == "unipc":
        over = {"flow_shift": s.flow_shift} if s.flow_shift is not None else {}
        if config.get("_class_name") == "UniPCMultistepScheduler":
            return UniPCMultistepScheduler.from_config(config, **over)
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                       flow_shift=s.flow_shift or config.get("flow_shift", 3.0))
    shift = s.flow_shift if s.flow_shift is not None else config.get("flow_shift", config.get("shift", 3.0))
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000), shift=shift)


def check_model(v: ValidationSettings, model: torch.nn.Module, vae_cfg: dict, text_dim: int, sp_size: int) -> None:
    """What WanPipeline can sample with this model (T2V; text width; frames, size and tokens); SPConfigError naming
    the flag otherwise."""
    c, s = model.config, v.sampling
    z, temporal, spatial = vae_cfg.get("z_dim", 16), vae_cfg.get("scale_factor_temporal", 4), \
        vae_cfg.get("scale_factor_spatial", 8)
    if c.in_channels != z or c.get("image_dim") is not None:
        raise SPConfigError(f"--validation-prompts: the model takes in_channels={c.in_channels}"
                            f"{', image embeddings' if c.get('image_dim') is not None else ''} (an image-to-video "
                            f"model); validation samples text-to-video (WanPipeline, {z} latent channels): drop "
                            f"--validation-prompts")
    if c.text_dim != text_dim:
        raise SPConfigError(f"--validation-prompts {v.prompts}: embeddings {text_dim} wide, the model's text_dim is "
                            f"{c.text_dim} (another text encoder?)")
    if (s.frames - 1) % temporal:
        raise SPConfigError(f"--validation-frames {s.frames}: must be {temporal}n+1 (e.g. 81, 49, 33)")
    ph, pw = c.patch_size[1], c.patch_size[2]
    if s.height % (spatial * ph) or s.width % (spatial * pw):
        raise SPConfigError(f"--validation-size {s.height}x{s.width}: must be multiples of {spatial * ph}x"
                            f"{spatial * pw} (the VAE's {spatial}x times the {ph}x{pw} patch)")
    tokens = ((s.frames - 1) // temporal + 1) // c.patch_size[0] * (s.height // spatial // ph) * (
        s.width // spatial // pw)
    if tokens % sp_size:
        raise SPConfigError(f"--validation-frames {s.frames} --validation-size {s.height}x{s.width}: {tokens} tokens "
                            f"do not divide by --context-parallel-size={sp_size}")


def frame_strip(frames_fhwc: np.ndarray, count: int = 8) -> np.ndarray:
    """Up to ``count`` evenly spaced frames side by side: uint8 [H, n * W, 3] (frames float in [0, 1] or uint8)."""
    idx = np.unique(np.linspace(0, len(frames_fhwc) - 1, min(count, len(frames_fhwc))).round().astype(int))
    picked = frames_fhwc[idx]
    if picked.dtype != np.uint8:
        picked = (np.clip(picked, 0, 1) * 255).round().astype(np.uint8)
    return np.concatenate(list(picked), axis=1)


class Validator:
    """Samples the prompts with the model on every rank; rank 0 decodes and writes. Call ``validator(step,
    telemetry)`` after each step (the loop's after_step: it runs when ``step`` is a multiple of ``every``) and
    ``final(step)`` at the end."""

    def __init__(self, s: ValidationSettings, model: torch.nn.Module, device: torch.device, *, rank: int,
                 sp_size: int, autocast: Optional[torch.dtype] = None) -> None:
        self.s, self.model, self.device, self.rank, self.autocast = s, model, torch.device(device), rank, autocast
        import importlib.util  # noqa: PLC0415
        if importlib.util.find_spec("imageio") is None or importlib.util.find_spec("imageio_ffmpeg") is None:
            raise SPConfigError("--validation-prompts: the videos are written with imageio and imageio-ffmpeg, not "
                                "installed here (pip install 'megatron_sp_ext[diffusers]')")
        p = read_prompts_file(s.prompts)
        self.prompts = p["prompts"]
        self.embeds, self.negative = p["prompt_embeds"], p["negative_embeds"]
        self.vae_cfg = E.vae_config(s.pipeline)
        check_model(s, model, self.vae_cfg, self.embeds.shape[-1], sp_size)
        self.scheduler = make_scheduler(s.pipeline, s.sampling)
        self.vae = None

        def load_vae() -> None:   # only rank 0 decodes; its failure ends every rank (on_rank0)
            from diffusers import AutoencoderKLWan  # noqa: PLC0415
            self.vae = AutoencoderKLWan.from_pretrained(s.pipeline, subfolder="vae", use_safetensors=True,
                                                        torch_dtype=torch.float32).to(self.device).eval()
        on_rank0(f"--validation-prompts: loading the VAE of {s.pipeline}", load_vae)
        self.done: set = set()

    def __call__(self, step: int, telemetry: Any = None) -> Optional[dict]:
        if not self.s.every or step % self.s.every:
            return None
        with telemetry.paused() if telemetry is not None else contextlib.nullcontext():
            return self.run(step)

    def final(self, step: int) -> Optional[dict]:
        """The end-of-training videos (unless step ``step`` was just validated)."""
        return None if step in self.done else self.run(step)

    def pipeline(self) -> Any:
        """diffusers' WanPipeline around the trained transformer (no text encoder: the prompts come embedded; no
        VAE: rank 0 decodes the latents itself)."""
        from diffusers import WanPipeline  # noqa: PLC0415
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=self.scheduler,
                           transformer=self.model)
        pipe.vae_scale_factor_temporal = int(self.vae_cfg.get("scale_factor_temporal", 4))
        pipe.vae_scale_factor_spatial = int(self.vae_cfg.get("scale_factor_spatial", 8))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def sample(self, i: int) -> torch.Tensor:
        """Prompt ``i``'s denoised latents [1, C, F', h, w] (the scheduler's dtype: float32, or float64 with a float64
        model), the same on every rank (collective under SP)."""
        s, pipe = self.s.sampling, self.pipeline()
        guided = s.guidance > 1.0
        cast = (torch.autocast(self.device.type, dtype=self.autocast) if self.autocast is not None
                else contextlib.nullcontext())
        with cast:
            out = pipe(prompt_embeds=self.embeds[i:i + 1].to(self.device),
                       negative_prompt_embeds=self.negative.to(self.device) if guided else None,
                       height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=s.steps,
                       guidance_scale=s.guidance, generator=torch.Generator(self.device).manual_seed(s.seed + i),
                       output_type="latent", return_dict=False)[0]
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents -> frames float32 [F, H, W, 3] in [0, 1], as WanPipeline decodes (rank 0)."""
        from diffusers.video_processor import VideoProcessor  # noqa: PLC0415
        x = E.denormalize(latents.to(self.device, self.vae.dtype), self.vae_cfg)
        video = self.vae.decode(x, return_dict=False)[0]
        return VideoProcessor(vae_scale_factor=self.vae_cfg.get("scale_factor_spatial", 8)).postprocess_video(
            video, output_type="np")[0]

    def run(self, step: int) -> dict:
        """Sample every prompt (all ranks); rank 0 writes step_<step>/. Returns {"dir", "latents", "rows"}."""
        was_training = self.model.training
        self.model.eval()
        folder = os.path.join(self.s.out_dir, f"step_{step:06d}")
        rows, latents = [], []
        try:
            for i, prompt in enumerate(self.prompts):
                t0 = time.perf_counter()
                lat = self.sample(i)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                sample_s = time.perf_counter() - t0
                latents.append(lat.cpu())
                # rank 0 decodes and writes while the others wait for its row: a failure there (ffmpeg, the disk)
                # ends every rank here rather than leaving them in the next prompt's sampling
                row = on_rank0(f"validation step {step}: writing video {i}",
                               lambda: self._write(folder, step, i, prompt, lat, sample_s))
                if self.rank == 0:
                    rows.append(row)
        finally:
            self.model.train(was_training)
        on_rank0(f"validation step {step}: writing {folder}", lambda: self._write_step(folder, step, rows))
        self.done.add(step)
        return {"dir": folder, "latents": latents, "rows": rows}

    def _write(self, folder: str, step: int, i: int, prompt: str, lat: torch.Tensor, sample_s: float) -> dict:
        from diffusers.utils import export_to_video  # noqa: PLC0415
        from PIL import Image  # noqa: PLC0415
        os.makedirs(folder, exist_ok=True)
        t0 = time.perf_counter()
        frames = self.decode(lat)
        decode_s = time.perf_counter() - t0
        mp4, png = os.path.join(folder, f"{i}.mp4"), os.path.join(folder, f"{i}.png")
        s = self.s.sampling
        export_to_video(list(frames), mp4, fps=s.fps)
        Image.fromarray(frame_strip(frames)).save(png)
        logger.info(f"validation step {step}: {mp4} ({sample_s:.1f}s sampling, {decode_s:.1f}s decoding)")
        return {"step": step, "i": i, "prompt": prompt, "mp4": mp4, "png": png, "sample_s": round(sample_s, 3),
                "decode_s": round(decode_s, 3), "frames": s.frames, "height": s.height, "width": s.width,
                "steps": s.steps, "guidance": s.guidance, "seed": s.seed + i}

    def _write_step(self, folder: str, step: int, rows: list) -> None:
        from training.video_dit.engine import plot_metrics  # noqa: PLC0415
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "prompts.txt"), "w", encoding="utf-8") as f:
            f.writelines(f"{r['i']}\t{r['prompt']}\n" for r in rows)
        if self.s.log_dir:
            plot_metrics(self.s.log_dir, f"validation at step {step}", out_dir=folder)
        with open(os.path.join(self.s.out_dir, "index.jsonl"), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def from_args(args: argparse.Namespace, model: torch.nn.Module, device: torch.device, *, rank: int, sp_size: int,
              autocast: Optional[torch.dtype] = None) -> Optional[Validator]:
    """The trainer's validator of the flags (None without --validation-prompts)."""
    s = settings_from_args(args)
    return None if s is None else Validator(s, model, device, rank=rank, sp_size=sp_size, autocast=autocast)
