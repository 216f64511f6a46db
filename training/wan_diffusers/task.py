"""What a Wan transformer is trained to do: the task (text-to-video, image-to-video, Wan 2.2 TI2V), the conditioning
its inputs carry, and for Wan 2.2 A14B the expert (high- or low-noise) with its timestep range.

    t2v:  hidden_states = x_t [B, C, F, H, W]; one timestep per sample; loss over every latent value.
    i2v:  Wan 2.1 I2V and Wan 2.2 I2V A14B (diffusers' WanImageToVideoPipeline without expand_timesteps):
          hidden_states = cat[x_t, mask [B, 4, F, H, W], cond_latent [B, C, F, H, W]] along channels (in_channels
          2 C + 4), the mask built as the pipeline builds it (``i2v_mask``: 1 on the first latent frame, 0 after);
          Wan 2.1's CLIP image embeddings go in as encoder_hidden_states_image; loss over every latent value.
    ti2v: Wan 2.2 TI2V-5B (the pipeline's expand_timesteps path): the first latent frame of x_t replaced by the
          clean condition (cond_latent[:, :, :1]), per-token timesteps [B, S] (0 on the first frame's tokens, t
          elsewhere); the loss leaves the conditioned frame out.
Experts (A14B, ``expert``): the pipeline runs ``transformer`` (high) where its timestep t * 1000 >= boundary_ratio *
1000 and ``transformer_2`` (low) below; each is trained on its own range: the drawn (shifted) t in [0, 1] is mapped
linearly onto [boundary, 1] (high) or [0, boundary) (low), keeping the shift's shape within the range.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_sp_ext.errors import SPConfigError

TASKS = ("t2v", "i2v", "ti2v")
EXPERTS = ("high", "low")
I2V_MASK_CHANNELS = 4            # WanImageToVideoPipeline: the first-frame mask, vae_scale_factor_temporal channels
VAE_TEMPORAL = 4                 # Wan 2.1 and 2.2 VAEs: 4 frames per latent frame after the first
NUM_TRAIN_TIMESTEPS = 1000       # diffusers' scheduler: the model's timestep is t * 1000


@dataclass(frozen=True)
class WanTask:
    """task: one of TASKS; expert: "high" / "low" (a two-expert pipeline) or None; boundary: the pipeline's
    boundary_ratio (with an expert); image: the model takes CLIP image embeddings (config image_dim)."""

    task: str = "t2v"
    expert: Optional[str] = None
    boundary: Optional[float] = None
    image: bool = False

    def data_keys(self) -> tuple:
        """The tensors every sample file must hold beside "latent" and "text"."""
        if self.task == "t2v":
            return ()
        return ("cond_latent", "image_embeds") if self.image else ("cond_latent",)

    def timestep(self, t: torch.Tensor) -> torch.Tensor:
        """The expert's share of a drawn t in [0, 1] (unchanged without an expert)."""
        if self.expert == "high":
            return self.boundary + (1.0 - self.boundary) * t
        if self.expert == "low":
            return self.boundary * t
        return t

    def describe(self) -> dict:
        return {"task": self.task, "expert": self.expert, "boundary": self.boundary}


def resolve(task: Optional[str], expert: Optional[str], boundary: Optional[float], preset: Optional[tuple],
            pipeline: dict, config) -> WanTask:
    """The run's WanTask from --task / --expert / --boundary-ratio (None: not given), the preset's (task, boundary)
    (random init) or the --init pipeline's model_index.json, checked against the model ``config``."""
    c = dict(config)
    inferred, ratio = "t2v", None
    if preset is not None:
        inferred, ratio = preset
    elif pipeline:
        ratio = pipeline.get("boundary_ratio")
        if pipeline.get("expand_timesteps"):
            inferred = "ti2v"
        elif c["in_channels"] == 2 * c["out_channels"] + I2V_MASK_CHANNELS:
            inferred = "i2v"
    elif c["in_channels"] == 2 * c["out_channels"] + I2V_MASK_CHANNELS:
        inferred = "i2v"
    task = task or inferred
    if task not in TASKS:
        raise SPConfigError(f"--task={task!r}: choose one of {', '.join(TASKS)}")
    want_in = 2 * c["out_channels"] + I2V_MASK_CHANNELS if task == "i2v" else c["out_channels"]
    if c["in_channels"] != want_in:
        what = "noisy + 4 mask + condition" if task == "i2v" else "the latent alone"
        raise SPConfigError(f"--task {task}: the model takes {c['in_channels']} input channels for "
                            f"{c['out_channels']} latent channels; {task} needs {want_in} ({what})")
    if c.get("image_dim") and task != "i2v":
        raise SPConfigError(f"--task {task}: the model has a CLIP image branch (image_dim {c['image_dim']}): it is "
                            f"an I2V model, train it with --task i2v")
    two_experts = ratio is not None            # the preset's or the pipeline's boundary_ratio
    ratio = boundary if boundary is not None else ratio
    if expert is None:
        if two_experts:
            raise SPConfigError(f"the model is one of two experts (boundary_ratio {ratio:g}): give --expert high (the "
                                f"high-noise 'transformer', t >= {ratio:g} x 1000) or --expert low ('transformer_2')")
        if boundary is not None:
            raise SPConfigError(f"--boundary-ratio={boundary} applies with --expert high|low; drop it or add --expert")
        return WanTask(task, None, None, bool(c.get("image_dim")))
    if expert not in EXPERTS:
        raise SPConfigError(f"--expert={expert!r}: choose high or low")
    if ratio is None:
        raise SPConfigError(f"--expert {expert}: the model has no boundary between two experts (a Wan 2.2 A14B "
                            f"pipeline's boundary_ratio); give --boundary-ratio, or drop --expert")
    if not 0.0 < ratio < 1.0:
        raise SPConfigError(f"--boundary-ratio={ratio}: must lie strictly between 0 and 1")
    return WanTask(task, expert, ratio, bool(c.get("image_dim")))


def i2v_mask(batch: int, frames: int, height: int, width: int, *, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """The first-frame mask [B, 4, F, H, W] of diffusers' WanImageToVideoPipeline.prepare_latents for a latent of F
    frames ((F - 1) * 4 + 1 video frames): the video frames' mask (1 on the first), the first repeated 4 times,
    regrouped 4 per latent frame, channels first."""
    video_frames = (frames - 1) * VAE_TEMPORAL + 1
    mask = torch.ones(batch, 1, video_frames, height, width, dtype=dtype, device=device)
    mask[:, :, 1:] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=VAE_TEMPORAL)
    mask = torch.cat([first, mask[:, :, 1:]], dim=2)
    return mask.view(batch, -1, VAE_TEMPORAL, height, width).transpose(1, 2)


def model_inputs(task: WanTask, batch: dict, patch: tuple) -> tuple[dict, Optional[torch.Tensor]]:
    """(the transformer's keyword inputs, the loss mask or None) of a step batch: x [B, C, F, H, W] (x_t), t [B] in
    [0, 1], text [B, L, D], and per task cond [B, C, F, H, W] (cond_latent), image [B, N, D_img]. The loss mask
    [1, 1, F, 1, 1] (ti2v: 0 on the conditioned first frame) weights the squared error."""
    x = batch["x"]
    t = batch["t"].to(x.dtype) * NUM_TRAIN_TIMESTEPS
    kw = {"encoder_hidden_states": batch["text"]}
    keep = None
    if task.task == "i2v":
        b, _, f, h, w = x.shape
        kw["hidden_states"] = torch.cat([x, i2v_mask(b, f, h, w, dtype=x.dtype, device=x.device),
                                         batch["cond"].to(x.dtype)], dim=1)
        kw["timestep"] = t
        if task.image:
            kw["encoder_hidden_states_image"] = batch["image"]
    elif task.task == "ti2v":
        _, _, f, h, w = x.shape
        keep = torch.ones(1, 1, f, h, w, dtype=x.dtype, device=x.device)   # the pipeline's first_frame_mask
        keep[:, :, 0] = 0
        kw["hidden_states"] = (1 - keep) * batch["cond"][:, :, :1].to(x.dtype) + keep * x
        per_token = keep[0, 0][:, ::patch[1], ::patch[2]][::patch[0]].flatten()   # [S]: 0 on the first frame
        kw["timestep"] = per_token[None] * t[:, None]
        keep = keep[:, :, :, :1, :1]
    else:
        kw["hidden_states"] = x
        kw["timestep"] = t
    return kw, keep


class SyntheticConditions:
    """The synthetic source (video_dit.data.SyntheticVideoLatents) with what ``task`` conditions on: "cond_latent" =
    the sample's first latent frame followed by zero frames (the shape of prepare's cond_latent) and "image_embeds"
    = a fixed random [image_tokens, image_dim] per sample (seeded by ``seed`` and the index). Other attributes are
    the source's."""

    def __init__(self, source, task: WanTask, image_tokens: int, image_dim: Optional[int], seed: int) -> None:
        self.source, self.task, self.seed = source, task, seed
        self.image_tokens, self.image_dim = image_tokens, image_dim

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def __getitem__(self, i: int) -> dict:
        sample = dict(self.source[i])
        keys = self.task.data_keys()
        if "cond_latent" in keys:
            cond = torch.zeros_like(sample["latent"])
            cond[:, :1] = sample["latent"][:, :1]
            sample["cond_latent"] = cond
        if "image_embeds" in keys:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i + 7)
            sample["image_embeds"] = torch.randn(self.image_tokens, self.image_dim, generator=g)
        return sample
