"""Training data: a synthetic latent + text source (default) and on-disk latent shards.

On-disk format (written by tools/make_latents.py): a directory of ``*.pt`` (torch.save) or
``*.safetensors`` files, one sample each, holding
    "latent": float tensor [C, T, H, W]  (VAE latents; T may differ between samples)
    "text":   float tensor [L, D_text]   (text-encoder embeddings)
Samples are read in sorted file order; sample i of the run is file i mod n.
"""
from __future__ import annotations

import glob
import math
import os
from typing import Sequence

import torch


class SyntheticVideoLatents:
    """Deterministic learnable samples: smooth space-time waves whose phase and frequency are set by
    the text embedding, plus a little noise. ``frames`` cycles through the given frame counts."""

    def __init__(self, channels: int, frames: Sequence[int], height: int, width: int, text_len: int,
                 text_dim: int, seed: int = 0) -> None:
        self.c, self.frames, self.h, self.w = channels, list(frames), height, width
        self.text_len, self.text_dim, self.seed = text_len, text_dim, seed

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        t = self.frames[i % len(self.frames)]
        text = torch.randn(self.text_len, self.text_dim, generator=g)
        code = text[0, :4].tanh()
        ft, fy, fx = (torch.linspace(0, 1, n) for n in (t, self.h, self.w))
        grid = (ft[:, None, None] * (1 + code[0]) + fy[None, :, None] * (2 + code[1]) +
                fx[None, None, :] * (2 + code[2])) * math.pi
        chans = torch.stack([torch.sin(grid * (k + 1) + code[3] * k) for k in range(self.c)])
        latent = chans + 0.05 * torch.randn(self.c, t, self.h, self.w, generator=g)
        return {"latent": latent.float(), "text": text.float()}


class LatentShardDataset:
    """Samples from a directory of .pt / .safetensors files (see module docstring)."""

    def __init__(self, path: str) -> None:
        self.files = sorted(glob.glob(os.path.join(path, "*.pt")) + glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            raise FileNotFoundError(f"--data-path={path!r} holds no .pt or .safetensors latent files")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        f = self.files[i % len(self.files)]
        if f.endswith(".safetensors"):
            from safetensors.torch import load_file  # noqa: PLC0415
            d = load_file(f)
        else:
            d = torch.load(f, map_location="cpu", weights_only=True)
        for key in ("latent", "text"):
            if key not in d:
                raise KeyError(f"{f}: missing tensor {key!r} (expected 'latent' [C,T,H,W] and 'text' [L,D])")
        return {"latent": d["latent"].float(), "text": d["text"].float()}


def write_sample(path: str, latent: torch.Tensor, text: torch.Tensor, fmt: str = "pt") -> None:
    """Write one sample in the on-disk format."""
    tensors = {"latent": latent.contiguous(), "text": text.contiguous()}
    if fmt == "safetensors":
        from safetensors.torch import save_file  # noqa: PLC0415
        save_file(tensors, path)
    else:
        torch.save(tensors, path)
