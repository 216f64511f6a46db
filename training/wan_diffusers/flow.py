"""Wan's flow-matching objective on whole latents, and the step batches that feed it.

x_t = (1 - t) x0 + t eps, the model predicts the velocity eps - x0 (loss: mean squared error over every latent value).
t is Wan's shifted timestep: u ~ logit-normal(0, 1) (the video DiT's draw, engine.sample_noise, with the same
per-sample seeding), t = s u / (1 + (s - 1) u) with s = --timestep-shift (Wan 2.1 uses 5.0; 1.0 = no shift); the
transformer reads t * 1000 (diffusers' FlowMatchEulerDiscreteScheduler timesteps). A two-expert run (Wan 2.2 A14B)
maps t onto its expert's range, and the conditioned tasks (I2V, TI2V) build their inputs and loss mask from the
sample's "cond_latent" / "image_embeds": training/wan_diffusers/task.py.

Unlike the video DiT's batches (pipeline.StepBatches: patchified tokens cut per SP rank on the host), every SP rank
gets the WHOLE latent [B, C, F, H, W]: the model's own ``_cp_plan`` split points shard it (megatron_sp_ext.diffusers).
Batches are a pure function of (step, DP rank), so a resumed run reads what an uninterrupted one would.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

from training.video_dit.engine import describe_samples, sample_noise
from training.video_dit.pipeline import sample_index

from .task import WanTask, model_inputs


def shift_timestep(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's (SD3's) timestep shift of u in [0, 1]: s u / (1 + (s - 1) u); shift 1.0 returns u unchanged."""
    if shift == 1.0:
        return u
    return shift * u / (1 + (shift - 1) * u)


CONDITIONS = {"cond_latent": "cond", "image_embeds": "image"}   # a sample's optional tensors -> the batch's keys


class WanStepBatches(Dataset):
    """Item i: the batch of step ``start + i`` on DP rank ``dp_rank`` (host tensors): x [B, C, F, H, W] (x_t),
    target [B, C, F, H, W] (eps - x0), t [B] in [0, 1] (the expert's range with ``task.expert``), text [B, L, D],
    and what ``task`` conditions on: cond [B, C, F, H, W] (cond_latent), image [B, N, D_img] (image_embeds); step,
    sample_ids."""

    def __init__(self, dataset, *, start: int, stop: int, seed: int, dp_rank: int, dp_world: int, micro_batch: int,
                 shift: float, task: WanTask = WanTask()) -> None:
        self.dataset, self.start, self.stop, self.seed, self.shift = dataset, start, stop, seed, shift
        self.dp_rank, self.dp_world, self.micro, self.task = dp_rank, dp_world, micro_batch, task

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getitem__(self, i: int) -> dict:
        step = self.start + i
        xs, tgts, ts, texts, ids = [], [], [], [], []
        conds: dict = {key: [] for key in self.task.data_keys()}
        for m in range(self.micro):
            index = sample_index(step, self.dp_rank, self.dp_world, self.micro, m)
            sample = self.dataset[index]
            x0 = sample["latent"][None]
            eps, u = sample_noise(x0.shape, self.seed, index)
            t = self.task.timestep(shift_timestep(u, self.shift))
            xs.append((1 - t) * x0 + t * eps)
            tgts.append(eps - x0)
            ts.append(t)
            texts.append(sample["text"][None])
            for key, parts in conds.items():
                parts.append(sample[key][None])
            ids.append(index)
        if len({x.shape for x in xs}) != 1 or len({tx.shape for tx in texts}) != 1 or \
                any(len({c.shape for c in parts}) != 1 for parts in conds.values()):
            raise ValueError(f"--micro-batch-size={self.micro}: the samples of one micro-batch must have equal latent "
                             f"and text shapes ({describe_samples(self.dataset, ids)}); use --micro-batch-size 1")
        return {"x": torch.cat(xs), "target": torch.cat(tgts), "t": torch.cat(ts), "text": torch.cat(texts),
                **{CONDITIONS[key]: torch.cat(parts) for key, parts in conds.items()},
                "step": step, "sample_ids": ids}


def _keep(item):
    return item


def step_batches(batches: WanStepBatches, device: torch.device, num_workers: int = 0,
                 dtype: Optional[torch.dtype] = None):
    """Iterate (step, batch on ``device``, sample_ids), read ahead by ``num_workers`` DataLoader processes (pinned
    host memory on CUDA); ``dtype``: the floating tensors cast to it (float64 test runs; None: as read)."""
    cuda = torch.device(device).type == "cuda"
    loader = DataLoader(batches, batch_size=None, shuffle=False, num_workers=num_workers, collate_fn=_keep,
                        pin_memory=cuda, prefetch_factor=2 if num_workers > 0 else None)
    keys = ("x", "target", "t", "text", *CONDITIONS.values())
    for h in loader:
        yield h["step"], {k: h[k].to(device, dtype=dtype, non_blocking=cuda) for k in keys if k in h}, \
            h["sample_ids"]


def flow_loss(model: torch.nn.Module, batch: dict, autocast_dtype: Optional[torch.dtype] = None,
              task: WanTask = WanTask()) -> torch.Tensor:
    """Mean squared velocity error of the model's prediction (every SP rank computes it on the gathered output; the
    same value on each): over the whole latent, or for TI2V over every frame but the conditioned first. ``batch``:
    x, target [B, C, F, H, W], t [B], text [B, L, D] and ``task``'s conditions (task.model_inputs)."""
    x = batch["x"]
    inputs, keep = model_inputs(task, batch, tuple(model.config.patch_size))
    with torch.autocast(device_type=x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        pred = model(**inputs, return_dict=False)[0]
    acc = torch.promote_types(pred.dtype, torch.float32)   # float32, or float64 in float64 runs
    err = (pred.to(acc) - batch["target"].to(acc)).pow(2)
    if keep is None:
        return err.mean()
    return (err * keep.to(acc)).sum() / (keep.to(acc).sum() * err[:, :, :1].numel())
