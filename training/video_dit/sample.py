"""Sampling from the trained DiT with its sequence-parallel attention, and the demo's picture.

``sample_latents`` integrates the rectified-flow ODE from noise (t = 1) to data (t = 0) with Euler
steps, x <- x + (t_next - t) * v(x, t, text), no grad. Every rank of the SP group draws the same
full-sequence noise from ``seed``, keeps its own tokens and runs the model on them (the attention
exchanges tokens as in training); the shards are all-gathered at the end. So the result does not
depend on the SP degree (up to the attention's float rounding).
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .engine import shard_tokens
from .model import patchify, unpatchify
from .sparse import row_major_ids, tile_order

log = logging.getLogger("video_dit")


@torch.no_grad()
def sample_latents(model, text: torch.Tensor, shape: Sequence[int], *, steps: int, seed: int,
                   group: Optional[dist.ProcessGroup] = None, device="cpu") -> torch.Tensor:
    """Euler-sample latents [B, C, T, H, W] (float32, on every rank) for text [B, L, D_text].

    shape: (C, T, H, W); steps: Euler steps; group: the SP group the model's attention runs over
    (None: one rank). A model with --sparse-attention tiles (``model.sparse``) samples its tokens in tile order
    (put back in row-major order before unpatchify)."""
    cfg = model.cfg
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    b = text.shape[0]
    noise = torch.randn(b, *shape, generator=torch.Generator().manual_seed(seed))
    full = patchify(noise, cfg.patch)  # [B, N, P]
    n_valid = full.shape[1]
    _, t_len, h, w = shape
    pt, ph, pw = cfg.patch
    grid = (t_len // pt, h // ph, w // pw)
    spec = getattr(model, "sparse", None)
    order, inv = tile_order(grid, spec.tile) if spec is not None else (None, None)
    if order is not None:
        full = full[:, order]
    x, positions, n_pad = shard_tokens(full, n_valid, rank, world)
    ids = positions if order is None else row_major_ids(positions, order)
    dtype = next(model.parameters()).dtype
    x, text = x.to(device), text.to(device=device, dtype=dtype)
    kv_valid_len = n_valid if n_pad > n_valid else None
    ts = torch.linspace(1.0, 0.0, steps + 1)
    for i in range(steps):
        t = torch.full((b,), float(ts[i]), device=device, dtype=dtype)
        v = model(x.to(dtype), t, text, ids, grid, kv_valid_len=kv_valid_len).float()
        x = x + float(ts[i + 1] - ts[i]) * v
    if world > 1:
        shards = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(shards, x.contiguous(), group=group)
        out = torch.empty(b, n_pad, x.shape[2], dtype=x.dtype, device=x.device)
        for r, shard in enumerate(shards):
            out[:, shard_tokens(full, n_valid, r, world)[1]] = shard
        x = out
    x = x[:, :n_valid].cpu()
    return unpatchify(x if inv is None else x[:, inv], cfg.patch, shape[0], grid)


def latent_to_rgb(latent_cthw: torch.Tensor, scale: float = 1.5) -> torch.Tensor:
    """Channels 0-2 of a latent as an RGB image in [0, 1]: [C, T, H, W] -> [T, H, W, 3]."""
    rgb = torch.zeros(3, *latent_cthw.shape[1:])
    rgb[:min(3, latent_cthw.shape[0])] = latent_cthw[:3]
    return (rgb / scale).clamp(0, 1).permute(1, 2, 3, 0)


def save_frame_strip(path: str, truth: torch.Tensor, sample: torch.Tensor, title: str = "") -> str:
    """A PNG with, per prompt, the ground-truth clip above the sampled one, one column per frame.
    truth, sample: [B, C, T, H, W]."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    b, _, t, h, w = sample.shape
    cell = 0.6  # inches per frame row
    fig, axes = plt.subplots(2 * b, t, figsize=(t * cell * w / h + 1.3, 2 * b * cell + 0.6), squeeze=False)
    for i in range(b):
        for row, (clip, name) in enumerate(((truth[i], "truth"), (sample[i], "sample"))):
            frames = latent_to_rgb(clip)
            for j in range(t):
                ax = axes[2 * i + row, j]
                ax.imshow(frames[j].numpy(), interpolation="nearest")
                ax.set_xticks([])
                ax.set_yticks([])
                if j == 0:
                    ax.set_ylabel(f"{i}: {name}", fontsize=7, rotation=0, ha="right", va="center")
                if i == 0 and row == 0:
                    ax.set_title(f"frame {j}", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pick_prompts(dataset, count: int = 4, search: int = 64) -> list:
    """Indices of up to ``count`` samples with the first sample's latent shape (and, for the synthetic
    data, distinct prompts)."""
    first = dataset[0]["latent"].shape
    seen, picked = set(), []
    for i in range(search):
        if dataset[i]["latent"].shape != first:
            continue
        key = dataset.prompt_of(i) if hasattr(dataset, "prompt_of") else i
        if key in seen:
            continue
        seen.add(key)
        picked.append(i)
        if len(picked) == count:
            break
    return picked


def write_demo_samples(model, dataset, *, steps: int, seed: int, group, device, log_dir: str,
                       title: str = "", count: int = 4) -> Optional[str]:
    """Sample one clip per prompt with the model's sequence-parallel attention (every rank of the job
    calls this) and write ``samples.png`` in log_dir beside loss.png (global rank 0). Returns its path
    on the writing rank."""
    idx = pick_prompts(dataset, count)
    items = [dataset[i] for i in idx]
    truth = torch.stack([s["latent"] for s in items])
    text = torch.stack([s["text"] for s in items])
    sample = sample_latents(model, text, tuple(truth.shape[1:]), steps=steps, seed=seed, group=group,
                            device=device)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    os.makedirs(log_dir, exist_ok=True)
    path = save_frame_strip(os.path.join(log_dir, "samples.png"), truth, sample,
                            title or f"per prompt: training clip vs model sample ({steps} Euler steps)")
    err = (sample - truth).pow(2).mean().item()
    log.info("samples (%d prompts, %d Euler steps, mean sq. error vs ground truth %.3f): %s", len(idx), steps,
             err, path)
    return path
