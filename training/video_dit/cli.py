"""Flags shared by both entry points, and dataset construction from them."""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

import torch

from megatron_sp_ext.errors import SPConfigError

from .checkpoint import add_checkpoint_args
from .config import PRESETS
from .data import LatentFileError, LatentShardDataset, SyntheticVideoLatents
from .faults import job_rank
from .logs import add_log_level_arg


class EntryParser(argparse.ArgumentParser):
    """The entry points' parser: a bad flag is one line on rank 0 (every rank exits 2), not the usage
    text on every rank."""

    def error(self, message: str) -> NoReturn:
        if job_rank() == 0:
            print(f"{self.prog}: error: {message} (--help lists the flags)", file=sys.stderr, flush=True)
        sys.exit(2)


def check_parallel_size(p: argparse.ArgumentParser, flag: str, size: int) -> None:
    """``flag`` (a sequence/context-parallel size) must divide the world size: p.error names the valid ones."""
    import torch.distributed as dist  # noqa: PLC0415
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1)
    message = parallel_size_problem(flag, size, world)
    if message:
        p.error(message)


def parallel_size_problem(name: str, size: object, world: int) -> str:
    """Why ``name``=``size`` cannot split ``world`` ranks ("" when it can)."""
    valid = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return f"{name}={size!r} is invalid: use a positive integer that divides the world size {world} ({valid})"
    if world % size:
        return (f"{name}={size} does not divide the world size {world} (the number of ranks): "
                f"use one of {valid}")
    return ""


def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("video DiT")
    g.add_argument("--model", default="tiny", choices=list(PRESETS), help="model preset")
    g.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    g.add_argument("--frames", default="4", help="comma list of latent frame counts, cycled per sample")
    g.add_argument("--latent-size", default="8x8", help="latent HxW (before the 2x2 patch)")
    g.add_argument("--data-path", default=None, help="directory of latent shards (tools/make_latents.py); "
                   "default: synthetic latents")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--train-iters", type=int, default=30)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--load", default=None, help="resume from this checkpoint directory")
    g.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: only at the end)")
    g.add_argument("--log-dir", default=None, help="metrics.jsonl and loss.png go here")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    g.add_argument("--quiet", action="store_true", help="no progress bar / summary")
    g.add_argument("--sample-steps", type=int, default=0,
                   help="after training, sample one clip per prompt with this many flow-matching Euler steps "
                        "(same sequence-parallel attention) and write samples.png beside loss.png (0: off)")
    add_log_level_arg(g)
    add_checkpoint_args(p)
    return p


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parse-time checks of the common flags (p.error names the flag)."""
    if args.sample_steps < 0:
        p.error(f"--sample-steps={args.sample_steps}: must be >= 0 (0 turns sampling off)")
    if args.sample_steps and not args.log_dir:
        p.error("--sample-steps needs --log-dir (samples.png is written there, beside loss.png)")


def frames_and_size(args) -> tuple[list, int, int]:
    try:
        frames = [int(x) for x in str(args.frames).split(",")]
    except ValueError:
        raise SPConfigError(f"--frames={args.frames!r}: expected a comma list of whole numbers, e.g. 4 or 4,8") from None
    try:
        h, w = (int(x) for x in args.latent_size.lower().split("x"))
    except ValueError:
        raise SPConfigError(f"--latent-size={args.latent_size!r}: expected HxW, e.g. 8x8") from None
    return frames, h, w


def build_dataset(args, cfg):
    if args.data_path:
        try:
            return LatentShardDataset(args.data_path, channels=cfg.in_channels, text_dim=cfg.text_dim,
                                      patch=cfg.patch, micro_batch=args.micro_batch_size)
        except FileNotFoundError as e:  # --data-path names no directory / no latent files: the user's setting
            raise LatentFileError(str(e)) from None
    frames, h, w = frames_and_size(args)
    return SyntheticVideoLatents(cfg.in_channels, frames, h, w, cfg.text_len, cfg.text_dim, seed=args.seed)


def pick_device() -> torch.device:
    import os  # noqa: PLC0415
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
