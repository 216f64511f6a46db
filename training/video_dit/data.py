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
    """Deterministic, visibly learnable samples: coloured stripes moving across the frame.

    Sample i belongs to one of ``NUM_PROMPTS`` "prompts" (``prompt_of(i)``); the prompt fixes the
    stripes' colour (channels 0-2 read as RGB, channel 3 their intensity, further channels zero), their
    orientation and the direction they move in (right, left, down, up; ``SPEED`` latent pixels per
    frame, period ``PERIOD``). The phase varies per sample. The text embedding is the prompt's fixed
    embedding plus a little noise, so a text-conditioned model can learn all three; the tiny demo
    model learns the colour within a minute, the stripes take longer. ``frames`` cycles through the
    given frame counts. Values lie in ~[-0.1, 1.6] (0.03 noise).
    """

    NUM_PROMPTS = 4
    COLOURS = ((1.5, 0.0, 0.0), (0.0, 1.5, 0.0), (0.2, 0.4, 1.5), (1.5, 1.5, 0.0))  # red, green, blue, yellow
    DIRECTIONS = ((0.0, 1.0), (0.0, -1.0), (1.0, 0.0), (-1.0, 0.0))  # (dy, dx): right, left, down, up
    PERIOD, SPEED = 5.0, 1.0

    def __init__(self, channels: int, frames: Sequence[int], height: int, width: int, text_len: int,
                 text_dim: int, seed: int = 0) -> None:
        self.c, self.frames, self.h, self.w = channels, list(frames), height, width
        self.text_len, self.text_dim, self.seed = text_len, text_dim, seed
        self.prompts = torch.randn(self.NUM_PROMPTS, text_len, text_dim,
                                   generator=torch.Generator().manual_seed(20261123))

    def prompt_of(self, i: int) -> int:
        """The prompt (0..NUM_PROMPTS-1) of sample i; frame counts and prompts vary independently."""
        return (i // len(self.frames)) % self.NUM_PROMPTS

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        t, k = self.frames[i % len(self.frames)], self.prompt_of(i)
        text = self.prompts[k] + 0.1 * torch.randn(self.text_len, self.text_dim, generator=g)
        dy, dx = self.DIRECTIONS[k]
        phase = float(torch.rand(1, generator=g)) * 2 * math.pi
        tt = torch.arange(t, dtype=torch.float32)[:, None, None]
        yy = torch.arange(self.h, dtype=torch.float32)[None, :, None]
        xx = torch.arange(self.w, dtype=torch.float32)[None, None, :]
        coord = yy * abs(dy) + xx * abs(dx) - (dy + dx) * self.SPEED * tt  # [T, H, W]
        wave = 0.5 + 0.5 * torch.cos(2 * math.pi * coord / self.PERIOD + phase)
        colour = torch.zeros(self.c)
        colour[:min(3, self.c)] = torch.tensor(self.COLOURS[k])[:min(3, self.c)]
        if self.c > 3:
            colour[3] = 1.0
        latent = colour[:, None, None, None] * wave[None] + 0.03 * torch.randn(self.c, t, self.h, self.w, generator=g)
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
