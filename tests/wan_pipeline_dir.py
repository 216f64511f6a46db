"""Tiny random Wan pipelines written in diffusers' layout by the tests themselves (no downloads), and short videos.

    root = write_pipeline(tmp_path / "pipe", "t2v")     # or "i2v" (CLIP image encoder), "ti2v" (Wan 2.2-shaped VAE)
    write_video(tmp_path / "a.mp4", frames_fhwc)        # uint8 [F, H, W, 3] -> mp4 (imageio + ffmpeg)

Components: a word-level tokenizer built with the ``tokenizers`` library (wrapped in transformers'
PreTrainedTokenizerFast, ``</s>`` appended as umT5's is), a 1-layer UMT5EncoderModel (d_model 16), an AutoencoderKLWan
(Wan 2.1-shaped: z_dim 4, 8x spatial; "ti2v": Wan 2.2-shaped: residual, patch 2, z_dim 6, 16x spatial), a tiny
WanTransformer3DModel, UniPC with Wan's flow settings; "i2v" adds a CLIPVisionModel (32 px, 8 px patches: 17 tokens)
and its CLIPImageProcessor. Saved with WanPipeline / WanImageToVideoPipeline.save_pretrained (safetensors).
"""
from __future__ import annotations

import os

import numpy as np
import torch

WORDS = ("a cat dog runs jumps on the beach red blue green car in rain snow at night small big bird flies over "
         "sea city street").split()
TEXT_DIM = 16
Z = {"t2v": 4, "i2v": 4, "ti2v": 6}


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def vae(kind: str = "t2v", seed: int = 0):
    from diffusers import AutoencoderKLWan  # noqa: PLC0415
    torch.manual_seed(seed)
    z = Z[kind]
    g = torch.Generator().manual_seed(seed + 1)
    mean = (torch.randn(z, generator=g) * 0.3).tolist()
    std = (torch.rand(z, generator=g) + 0.5).tolist()
    if kind == "ti2v":   # Wan 2.2 TI2V-5B's shape: residual blocks, 2x2 pixel patches (12 channels), 16x spatial
        return AutoencoderKLWan(base_dim=8, decoder_base_dim=16, z_dim=z, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                                scale_factor_spatial=16, latents_mean=mean, latents_std=std)
    return AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 2, 4, 4], num_res_blocks=1, latents_mean=mean,
                            latents_std=std)


def transformer(kind: str = "t2v", seed: int = 0):
    from diffusers import WanTransformer3DModel  # noqa: PLC0415
    torch.manual_seed(seed)
    z = Z[kind]
    extra = dict(image_dim=16, added_kv_proj_dim=16) if kind == "i2v" else {}
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                  in_channels=2 * z + 4 if kind == "i2v" else z, out_channels=z, text_dim=TEXT_DIM,
                                  freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=64, **extra)
    with torch.no_grad():   # waken the zero-initialised output projections so samples depend on every weight
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def write_pipeline(root, kind: str = "t2v", seed: int = 0) -> str:
    """A tiny random Wan pipeline of ``kind`` saved to ``root`` (diffusers' layout); returns root as str."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline  # noqa: PLC0415
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config,  # noqa: PLC0415
                              UMT5EncoderModel)
    torch.manual_seed(seed)
    tok = tokenizer()
    text = UMT5EncoderModel(UMT5Config(vocab_size=len(WORDS) + 3, d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1,
                                       num_heads=2, relative_attention_num_buckets=8))
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                    num_train_timesteps=1000)
    parts = dict(tokenizer=tok, text_encoder=text, vae=vae(kind, seed), scheduler=sched,
                 transformer=transformer(kind, seed))
    if kind == "i2v":
        enc = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=32, patch_size=8))
        proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        pipe = WanImageToVideoPipeline(image_encoder=enc, image_processor=proc, **parts)
    else:
        pipe = WanPipeline(expand_timesteps=kind == "ti2v", **parts)
    pipe.save_pretrained(str(root), safe_serialization=True)
    return str(root)


def random_frames(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [F, H, W, 3]: smooth colour gradients moving over time plus noise (compresses like video)."""
    g = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    base = g.uniform(0, 255, 3)
    for f in range(frames):
        img = np.stack([(base[c] + 2.0 * xx + 3.0 * yy * (c + 1) + 9.0 * f) % 256 for c in range(3)], -1)
        out.append(np.clip(img + g.normal(0, 4, img.shape), 0, 255).astype(np.uint8))
    return np.stack(out)


def write_video(path, frames_fhwc: np.ndarray, fps: int = 16) -> str:
    """``frames_fhwc`` (uint8 [F, H, W, 3]) -> a video file at ``path`` (mp4 / webm by its extension)."""
    import imageio.v2 as imageio  # noqa: PLC0415
    path = str(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    kw = {"codec": "libvpx-vp9"} if path.endswith(".webm") else {}
    with imageio.get_writer(path, "ffmpeg", fps=fps, macro_block_size=1, **kw) as w:
        for frame in frames_fhwc:
            w.append_data(frame)
    return path


def write_frame_folder(path, frames_fhwc: np.ndarray) -> str:
    from PIL import Image  # noqa: PLC0415
    path = str(path)
    os.makedirs(path, exist_ok=True)
    for i, frame in enumerate(frames_fhwc):
        Image.fromarray(frame).save(os.path.join(path, f"frame_{i}.png"))
    return path
