"""Wan's encoders from a local pipeline directory (diffusers' layout), and what prepare computes with them.

    enc = load_encoders(EncoderSettings(pipeline="Wan2.1-T2V-1.3B-Diffusers", device=cuda, dtype=torch.bfloat16,
                                        i2v=False))
    latent_cfhw = enc.latent(frames_fhwc)           # float32 [C, F', h, w], normalized as WanPipeline does
    text_ld, n = enc.text("a cat")                  # float32 [L, D], n real tokens (the rest zeros)
    cond_cfhw = enc.cond_latent(frames_fhwc)        # I2V: first frame + zero frames, encoded and normalized
    image_nd = enc.image_embeds(frames_fhwc[0])     # Wan 2.1 I2V: CLIP's penultimate hidden state [N, D]

Directory: vae/ (AutoencoderKLWan: Wan 2.1's z_dim 16 / 8x, Wan 2.2 TI2V's z_dim 48 / 16x), text_encoder/
(UMT5EncoderModel) + tokenizer/, and for I2V image_encoder/ (CLIPVisionModel) + image_processor/ when the pipeline
has them (Wan 2.1 I2V; Wan 2.2 has none). Safetensors only.

The math is diffusers' own: pixels x / 255 * 2 - 1 (VideoProcessor.preprocess_video); the VAE posterior's mode
(``retrieve_latents(..., sample_mode="argmax")`` as WanImageToVideoPipeline / WanVideoToVideoPipeline encode);
normalized (z - latents_mean) * (1 / latents_std) per channel in float32; the text through
``WanPipeline.encode_prompt`` (its prompt cleaning, padding to max_sequence_length, zeros past the real tokens); the
I2V condition as ``WanImageToVideoPipeline.prepare_latents`` builds it (cat[first frame, zeros] -> VAE -> normalize);
the image embedding as ``encode_image`` (CLIP image processor -> hidden_states[-2]).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from megatron_sp_ext.errors import SPConfigError

LATENTS_FORMAT = "wan-latents-v1"   # a prepared sample (the trainer's data contract)
PROMPTS_FORMAT = "wan-prompts-v1"   # a validation prompts file (prepare --prompts; validate.read_prompts_file)


@dataclass(frozen=True)
class EncoderSettings:
    """pipeline: the local Wan pipeline directory; device / dtype: where and in what the VAE and umT5 run (the
    CLIP image encoder runs in float32, as Wan's I2V examples load it); i2v: also the I2V condition (and the image
    embedding where the pipeline has an image encoder); text / video: load umT5 + tokenizer / the VAE;
    max_sequence_length: umT5 tokens per caption (Wan: 512); vae_tiling: diffusers' tiled VAE encode (memory)."""

    pipeline: str
    device: torch.device
    dtype: torch.dtype
    i2v: bool = False
    text: bool = True
    video: bool = True
    max_sequence_length: int = 512
    vae_tiling: bool = False


def component_class(pipeline: str, sub: str) -> Optional[str]:
    """The class named by ``pipeline``/``sub``/config.json (a model) or None when there is no such component."""
    for name in ("config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = os.path.join(pipeline, sub, name)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError) as e:
                raise SPConfigError(f"--pipeline {pipeline}: {path} is unreadable ({e})") from None
            return doc.get("_class_name") or doc.get("architectures", [None])[0] or doc.get("image_processor_type") \
                or doc.get("tokenizer_class") or name
    return None


def vae_config(pipeline: str) -> dict:
    """``pipeline``/vae/config.json (an AutoencoderKLWan's); SPConfigError naming --pipeline otherwise."""
    path = os.path.join(pipeline, "vae", "config.json")
    if not os.path.isdir(pipeline):
        raise SPConfigError(f"--pipeline {pipeline}: no such directory (a Wan pipeline in diffusers' layout: vae/, "
                            f"text_encoder/, tokenizer/, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers downloaded)")
    if not os.path.isfile(path):
        raise SPConfigError(f"--pipeline {pipeline}: no vae/config.json (a Wan pipeline in diffusers' layout)")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("_class_name") != "AutoencoderKLWan":
        raise SPConfigError(f"--pipeline {pipeline}: vae/ holds a {cfg.get('_class_name')!r}, not Wan's "
                            f"AutoencoderKLWan")
    return cfg


def vae_identity(cfg: dict) -> str:
    """'AutoencoderKLWan z_dim=16 spatial=8 temporal=4' (the safetensors' "vae" metadata)."""
    return (f"AutoencoderKLWan z_dim={cfg.get('z_dim', 16)} spatial={cfg.get('scale_factor_spatial', 8)} "
            f"temporal={cfg.get('scale_factor_temporal', 4)}")


def latent_stats(cfg: dict) -> tuple:
    """(mean [C, 1, 1, 1], 1 / std [C, 1, 1, 1]) float32, from the VAE's config as the pipelines build them."""
    z = cfg.get("z_dim", 16)
    mean = torch.tensor(cfg["latents_mean"]).view(z, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg["latents_std"]).view(z, 1, 1, 1)
    return mean, inv_std


def normalize(z_cfhw: torch.Tensor, cfg: dict) -> torch.Tensor:
    """VAE latents -> the transformer's latents: (z - latents_mean) * (1 / latents_std) in float32."""
    mean, inv_std = latent_stats(cfg)
    return (z_cfhw.float() - mean.to(z_cfhw.device)) * inv_std.to(z_cfhw.device)


def denormalize(x_bcfhw: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The inverse: x / (1 / latents_std) + latents_mean in ``x``'s dtype, op for op as WanPipeline decodes."""
    z = cfg.get("z_dim", 16)
    mean = torch.tensor(cfg["latents_mean"]).view(1, z, 1, 1, 1).to(x_bcfhw)
    inv_std = 1.0 / torch.tensor(cfg["latents_std"]).view(1, z, 1, 1, 1).to(x_bcfhw)
    return x_bcfhw / inv_std + mean


def pixels(frames_fhwc: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> [1, 3, F, H, W] in [-1, 1] (x / 255 * 2 - 1 in float32, as diffusers' VideoProcessor),
    then ``dtype`` on ``device``."""
    x = frames_fhwc.to(device).float() / 255.0 * 2.0 - 1.0
    return x.permute(3, 0, 1, 2)[None].to(dtype)


@dataclass
class WanEncoders:
    """The loaded components (None where not needed or absent) and the VAE's config."""

    settings: EncoderSettings
    vae: Any
    vae_cfg: dict
    text_pipe: Any
    image_encoder: Any
    image_processor: Any

    @torch.no_grad()
    def encode_video(self, video_bcfhw: torch.Tensor) -> torch.Tensor:
        """The VAE posterior's mode of [1, 3, F, H, W] pixels, normalized: float32 [C, F', H / s, W / s] (CPU)."""
        z = self.vae.encode(video_bcfhw.to(self.vae.dtype)).latent_dist.mode()
        return normalize(z[0], self.vae_cfg).cpu()

    def latent(self, frames_fhwc: torch.Tensor) -> torch.Tensor:
        """uint8 [F, H, W, 3] -> normalized latents float32 [C, (F - 1) // 4 + 1, H / s, W / s]."""
        s = self.settings
        return self.encode_video(pixels(frames_fhwc, s.device, s.dtype))

    def cond_latent(self, frames_fhwc: torch.Tensor) -> torch.Tensor:
        """The I2V condition: the first frame followed by F - 1 zero frames (zeros in [-1, 1] pixels, i.e. grey),
        encoded and normalized: float32 [C, F', h, w]."""
        s = self.settings
        first = pixels(frames_fhwc[:1], s.device, s.dtype)
        video = torch.cat([first, first.new_zeros(1, 3, frames_fhwc.shape[0] - 1, *first.shape[3:])], dim=2)
        return self.encode_video(video)

    @torch.no_grad()
    def text(self, caption: str) -> tuple:
        """(float32 [L, D] umT5 last hidden state as WanPipeline.encode_prompt returns it, real token count)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean  # noqa: PLC0415
        s = self.settings
        emb, _ = self.text_pipe.encode_prompt(caption, do_classifier_free_guidance=False,
                                              max_sequence_length=s.max_sequence_length, device=s.device)
        tokens = self.text_pipe.tokenizer(prompt_clean(caption), truncation=True, add_special_tokens=True,
                                          max_length=s.max_sequence_length).input_ids
        return emb[0].float().cpu(), len(tokens)

    @torch.no_grad()
    def image_embeds(self, frame_hwc: np.ndarray) -> torch.Tensor:
        """CLIP's penultimate hidden state of one uint8 [H, W, 3] frame: float32 [N_img, D_img] (encode_image)."""
        from PIL import Image  # noqa: PLC0415
        inputs = self.image_processor(images=Image.fromarray(np.asarray(frame_hwc)), return_tensors="pt")
        inputs = inputs.to(self.settings.device)
        out = self.image_encoder(**inputs, output_hidden_states=True)
        return out.hidden_states[-2][0].float().cpu()


def _load(what: str, pipeline: str, fn):
    try:
        return fn()
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        lines = str(e).strip().splitlines()
        raise SPConfigError(f"--pipeline {pipeline}: could not load {what} "
                            f"({lines[0][:300] if lines else type(e).__name__})") from None


def load_encoders(s: EncoderSettings) -> WanEncoders:
    """Load what ``s`` asks for from ``s.pipeline`` (SPConfigError naming --pipeline and the part otherwise)."""
    from diffusers import AutoencoderKLWan, WanPipeline  # noqa: PLC0415
    cfg = vae_config(s.pipeline)
    vae = text_pipe = image_encoder = image_processor = None
    if s.video:
        vae = _load("vae/", s.pipeline, lambda: AutoencoderKLWan.from_pretrained(
            s.pipeline, subfolder="vae", torch_dtype=s.dtype, use_safetensors=True)).to(s.device).eval()
        if s.vae_tiling:
            vae.enable_tiling()
    if s.text:
        from transformers import AutoTokenizer, UMT5EncoderModel  # noqa: PLC0415
        for sub in ("text_encoder", "tokenizer"):
            if component_class(s.pipeline, sub) is None:
                raise SPConfigError(f"--pipeline {s.pipeline}: no {sub}/ (umT5 and its tokenizer encode the captions)")
        tokenizer = _load("tokenizer/", s.pipeline, lambda: AutoTokenizer.from_pretrained(
            s.pipeline, subfolder="tokenizer"))
        encoder = _load("text_encoder/", s.pipeline, lambda: UMT5EncoderModel.from_pretrained(
            s.pipeline, subfolder="text_encoder", dtype=s.dtype, use_safetensors=True)).to(s.device).eval()
        text_pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=None, scheduler=None)
    if s.i2v and s.video and component_class(s.pipeline, "image_encoder") is not None:
        from transformers import CLIPImageProcessor, CLIPVisionModel  # noqa: PLC0415
        if component_class(s.pipeline, "image_processor") is None:
            raise SPConfigError(f"--pipeline {s.pipeline}: image_encoder/ without image_processor/ (CLIP's "
                                f"preprocessing)")
        image_encoder = _load("image_encoder/", s.pipeline, lambda: CLIPVisionModel.from_pretrained(
            s.pipeline, subfolder="image_encoder", dtype=torch.float32, use_safetensors=True)).to(s.device).eval()
        image_processor = _load("image_processor/", s.pipeline, lambda: CLIPImageProcessor.from_pretrained(
            s.pipeline, subfolder="image_processor"))
    return WanEncoders(s, vae, cfg, text_pipe, image_encoder, image_processor)


def spatial_multiple(pipeline: str, cfg: dict) -> int:
    """Pixels per latent token side: the VAE's spatial factor x the transformer's patch (transformer/config.json's
    patch_size[1], 2 for every Wan model when the directory has no transformer)."""
    patch = 2
    path = os.path.join(pipeline, "transformer", "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            patch = int(json.load(f).get("patch_size", [1, 2, 2])[1])
    return int(cfg.get("scale_factor_spatial", 8)) * patch
