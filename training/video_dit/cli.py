"""Flags shared by both entry points, and dataset construction from them."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Collection, NoReturn, Optional

import torch

from megatron_sp_ext.elastic_error import record_user_error
from megatron_sp_ext.errors import SPConfigError

from . import deterministic
from .checkpoint import add_checkpoint_args
from .config import MODULATIONS, PRESETS, DiTConfig, preset
from .data import LatentFileError, LatentShardDataset, SyntheticVideoLatents
from .faults import job_rank, launcher_stops_the_others, wait_for_rank0_to_report
from .logs import add_log_level_arg
from .sparse import (DEFAULT_TILE, SPARSE_CHOICES, SPARSE_FLAG, SPARSE_KERNEL_FLAG, TILE_FLAG, TOPK_FLAG, WINDOW_FLAG,
                     SparseSpec, check_tile_grid)


class EntryParser(argparse.ArgumentParser):
    """The entry points' parser: a bad flag is one line on rank 0 (every rank exits 2), not the usage
    text on every rank. Under torchrun the other ranks wait for rank 0 to print it (``wait_for_rank0_to_report``):
    a rank exiting first made torchrun stop rank 0 before its line."""

    def error(self, message: str) -> NoReturn:
        line = f"{self.prog}: error: {message} (--help lists the flags)"
        record_user_error(line)  # torchrun's "Root Cause" shows this line
        if job_rank() == 0:
            print(line, file=sys.stderr, flush=True)
        elif launcher_stops_the_others():   # rank 0 prints it and ends the job, unless the error is this rank's alone
            wait_for_rank0_to_report()
            print(f"[rank {job_rank()}] {line}", file=sys.stderr, flush=True)
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


def model_config(args: argparse.Namespace) -> DiTConfig:
    """The entry's model: --model's preset with --num-layers and --modulation."""
    return preset(args.model, args.num_layers, getattr(args, "modulation", None))


class _HidingGroup:
    """An argument group whose ``add_argument`` leaves the flags in ``hide`` out of --help (and the usage line); they
    still parse, so the entry that refuses them names them in its own message."""

    def __init__(self, group, hide: frozenset) -> None:
        self.group, self.hide, self.hidden = group, hide, set()

    def add_argument(self, *flags: str, **kwargs):
        hidden = self.hide.intersection(flags)
        if hidden:
            kwargs["help"] = argparse.SUPPRESS
            self.hidden |= hidden
        return self.group.add_argument(*flags, **kwargs)


def add_common_args(p: argparse.ArgumentParser, hide: Collection[str] = ()) -> argparse.ArgumentParser:
    """The flags every entry shares. ``hide``: flags of these that an entry refuses (it checks them after parsing
    and names them): parsed, but not listed by --help."""
    g = _HidingGroup(p.add_argument_group("video DiT"), frozenset(hide))
    g.add_argument("--model", default="tiny", choices=list(PRESETS), help="model preset")
    g.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    g.add_argument("--modulation", default="wan", choices=list(MODULATIONS),
                   help="how the timestep reaches the blocks' AdaLN: wan (one shared time projection plus a table "
                        "per block, as Wan 2.1; default) or linear (a Linear per block, DiT-style: this project's "
                        "model before 2026-11-29, 6.3B more parameters at wan-14b's 40 blocks)")
    g.add_argument("--frames", default="4", help="comma list of latent frame counts, cycled per sample")
    g.add_argument("--latent-size", default="8x8", help="latent HxW (before the 2x2 patch); a comma list (e.g. "
                   "60x104,48x84) is cycled per sample independently of --frames")
    g.add_argument("--data-path", default=None, help="directory of latent shards (training/video_dit/make_latents.py); "
                   "default: synthetic latents")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--pack-samples", action="store_true",
                   help="pack clips of different sizes (frames and/or latent HxW) into ONE sequence per step (B=1, "
                        "cu_seqlens) instead of one micro-batch of equal-sized clips; consecutive samples fill the "
                        "step up to --max-tokens-per-step. Loss: mean over the packed samples of each sample's mean "
                        "(= one-sample-at-a-time). Under SP each sample is split on its own (padded to a multiple of "
                        "the SP size, the padding carrying no loss); the attention runs per sample (cu_seqlens) in any "
                        "sequence-parallel mode that takes it, and a mode that does not is refused by name")
    g.add_argument("--max-tokens-per-step", type=int, default=None,
                   help="with --pack-samples: the video-token budget of one packed step (per data-parallel rank)")
    g.add_argument("--train-iters", type=int, default=30)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--load", default=None, help="resume from this checkpoint directory")
    g.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: only at the end)")
    g.add_argument("--log-dir", default=None, help="metrics.jsonl and loss.png go here")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA; refused on the CPU)")
    g.add_argument("--quiet", action="store_true", help="no progress bar / summary")
    g.add_argument("--sample-steps", type=int, default=0,
                   help="after training, sample one clip per prompt with this many flow-matching Euler steps "
                        "(same sequence-parallel attention) and write samples.png beside loss.png (0: off)")
    g.add_argument(SPARSE_FLAG, default="none", choices=list(SPARSE_CHOICES),
                   help="block-sparse self-attention over 3D tiles of the token grid (tiles: the tokens are put in "
                        "tile order, which the sequence is sharded in, so neighbouring tiles share a rank); needs "
                        f"exactly one of {TOPK_FLAG} or {WINDOW_FLAG}; the cross-attention stays dense (none: dense)")
    g.add_argument(TILE_FLAG, default=None, metavar="T,H,W",
                   help=f"with {SPARSE_FLAG} tiles: tokens per tile along frames, rows, columns after patchify "
                        f"(default {','.join(map(str, DEFAULT_TILE))}); any size: where it does not divide the token grid "
                        "the edge blocks are compacted into full tiles (only the last tile is shorter)")
    g.add_argument(TOPK_FLAG, type=int, default=None, metavar="K",
                   help=f"with {SPARSE_FLAG} tiles: Video Sparse Attention, each query tile attends its K key tiles "
                        "of highest pooled score (per head and layer) plus a gated dense coarse branch over the "
                        "pooled tiles")
    g.add_argument(WINDOW_FLAG, default=None, metavar="t,h,w",
                   help=f"with {SPARSE_FLAG} tiles: a fixed local window, each query tile attends the key tiles at "
                        "most t, h, w tiles away along frames, rows, columns")
    add_log_level_arg(g)
    add_checkpoint_args(p)
    if g.hide - g.hidden:
        raise ValueError(f"add_common_args(hide=...): {', '.join(sorted(g.hide - g.hidden))} are not its flags")
    return p


def add_sparse_kernel_arg(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--sparse-attention-kernel (the megatron entry): the kernel of every block-sparse self-attention call, at SP=1
    and in every SP mode; its choices are the registry's (attention/block_sparse.KERNELS: "auto" and each kernel with
    block sparsity that "auto" may pick). The dense attention (the cross-attention, dense runs) keeps
    --sp-attention-backend."""
    from megatron_sp_ext.attention.block_sparse import KERNELS  # noqa: PLC0415
    p.add_argument(SPARSE_KERNEL_FLAG, default="auto", choices=list(KERNELS),
                   help=f"with {SPARSE_FLAG} tiles: the kernel of the block-sparse self-attention (auto: per call the "
                        f"registry's first that runs it, FlashAttention-4's block sparsity, then flex_attention, then "
                        f"math; a named kernel runs every call or the run is refused by name); the cross-attention "
                        f"keeps --sp-attention-backend")
    return p


def sparse_kernel_problem(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> str:
    """Why --sparse-attention-kernel cannot run this run on ``device``/``dtype`` ("" when it can): an unknown kernel,
    a named kernel without --sparse-attention tiles, or one that does not run block-sparse calls there (the registry's
    reason and the kernels that do). A call's own tile slice may still refuse a named kernel later (e.g. FA4 with
    fewer than 16 tokens per tile row group), naming the flag too."""
    from megatron_sp_ext.attention.block_sparse import KERNELS, resolve_kernel  # noqa: PLC0415
    kernel = getattr(args, "sparse_attention_kernel", "auto")
    if kernel not in KERNELS:
        return f"{SPARSE_KERNEL_FLAG}={kernel!r} is invalid: choose one of {', '.join(KERNELS)}"
    if kernel == "auto":
        return ""
    if getattr(args, "sparse_attention", "none") == "none":
        return (f"{SPARSE_KERNEL_FLAG} {kernel} set with {SPARSE_FLAG} none: add {SPARSE_FLAG} tiles (or drop "
                f"{SPARSE_KERNEL_FLAG}; the dense attention's kernel is --sp-attention-backend)")
    try:
        resolve_kernel(kernel, device, dtype, setting=SPARSE_KERNEL_FLAG)
    except SPConfigError as e:
        return str(e)
    return ""


def run_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """The attention's dtype of a run: bf16 under --bf16 on CUDA (the autocast) or with --bf16-params, else fp32."""
    bf16 = (getattr(args, "bf16", False) and device.type == "cuda") or getattr(args, "bf16_params", False)
    return torch.bfloat16 if bf16 else torch.float32


def check_bf16_device(args: argparse.Namespace, device: torch.device) -> None:
    """--bf16 is the bf16 autocast of a CUDA run: on the CPU it is refused (SPConfigError naming the flag), not
    dropped in silence (the run would be fp32 under a flag that says bf16)."""
    if getattr(args, "bf16", False) and device.type != "cuda":
        raise SPConfigError(f"--bf16 (bf16 autocast) runs on CUDA devices; this run is on the {device.type} (no CUDA "
                            f"device visible), where it computes in fp32: drop --bf16")


def check_sparse_kernel(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parse-time check of --sparse-attention-kernel on the device the run will take (p.error names the flag)."""
    device = pick_device()
    message = sparse_kernel_problem(args, device, run_dtype(args, device))
    if message:
        p.error(message)


def _triple(flag: str, text: str, least: int, what: str) -> tuple:
    try:
        parts = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        parts = ()
    if len(parts) != 3 or any(n < least for n in parts):
        raise SPConfigError(f"{flag}={text!r} is invalid: use three {what} whole numbers T,H,W, e.g. "
                            f"{','.join(map(str, DEFAULT_TILE))}")
    return parts


def sparse_spec(args: argparse.Namespace) -> Optional[SparseSpec]:
    """The run's ``SparseSpec`` from --sparse-attention / --sparse-tile / --sparse-topk / --sparse-window (None:
    dense). Raises SPConfigError naming the flag and its valid values."""
    mode = getattr(args, "sparse_attention", "none")
    given = [flag for flag, name in ((TILE_FLAG, "sparse_tile"), (TOPK_FLAG, "sparse_topk"),
                                     (WINDOW_FLAG, "sparse_window")) if getattr(args, name, None) is not None]
    if mode not in SPARSE_CHOICES:
        raise SPConfigError(f"{SPARSE_FLAG}={mode!r} is invalid: choose one of {', '.join(SPARSE_CHOICES)}")
    if mode == "none":
        if given:
            raise SPConfigError(f"{' / '.join(given)} set with {SPARSE_FLAG} none: add {SPARSE_FLAG} tiles (or drop "
                                f"{' / '.join(given)})")
        return None
    topk, window = args.sparse_topk, args.sparse_window
    if (topk is None) == (window is None):
        raise SPConfigError(f"{SPARSE_FLAG} tiles needs exactly one of {TOPK_FLAG} K (key tiles per query tile, a "
                            f"positive whole number) or {WINDOW_FLAG} t,h,w (tiles each way, whole numbers >= 0); "
                            f"got {'both' if topk is not None else 'neither'}")
    tile = _triple(TILE_FLAG, args.sparse_tile, 1, "positive") if args.sparse_tile is not None else DEFAULT_TILE
    if topk is not None and (isinstance(topk, bool) or topk < 1):
        raise SPConfigError(f"{TOPK_FLAG}={topk} is invalid: use a positive whole number of key tiles per query tile")
    return SparseSpec(tile=tile, topk=topk,
                      window=_triple(WINDOW_FLAG, window, 0, "non-negative") if window is not None else None)


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parse-time checks of the common flags (p.error names the flag)."""
    if args.sample_steps < 0:
        p.error(f"--sample-steps={args.sample_steps}: must be >= 0 (0 turns sampling off)")
    if args.sample_steps and not args.log_dir:
        p.error("--sample-steps needs --log-dir (samples.png is written there, beside loss.png)")
    if getattr(args, "num_workers", None) is not None and args.num_workers < 0:
        p.error(f"--num-workers={args.num_workers}: must be >= 0 (0: batches built in the training thread)")
    # the Megatron entry's flags; the DeepSpeed entry (its kernel and mode in the JSON) checks after its config loads
    refusal = hasattr(args, "sp_attention_backend") and deterministic.why_not(
                                    getattr(args, "deterministic_mode", False),
                                    getattr(args, "sp_attention_backend", "auto"),
                                    getattr(args, "sparse_attention", "none"),
                                    getattr(args, "sparse_attention_kernel", "auto"),
                                    getattr(args, "cp_comm_type", None), getattr(args, "sp_async_qkv", "off"))
    if refusal:
        p.error(refusal)
    if getattr(args, "manual_gc_interval", 0) < 0:
        p.error(f"--manual-gc-interval={args.manual_gc_interval}: must be >= 0 (0: no collection between steps)")
    modules = getattr(args, "recompute_modules", None) or []
    if "outside_core_attn" in modules and len(set(modules)) > 1:
        p.error(f"--recompute-modules {' '.join(modules)}: outside_core_attn already recomputes the FFN and keeps "
                f"the attention core; give it alone")
    method = getattr(args, "recompute_method", None)
    if method is not None and getattr(args, "recompute_granularity", None) is None:
        p.error(f"--recompute-method {method} is set without --recompute-granularity: add --recompute-granularity "
                f"full or selective")
    if method == "uniform":
        if getattr(args, "recompute_num_layers", None) not in (None, 1):
            p.error(f"--recompute-method uniform --recompute-num-layers {args.recompute_num_layers}: chunks of "
                    f"several blocks recomputed as one unit are not built here; use --recompute-method uniform "
                    f"--recompute-num-layers 1 (every block, each its own unit) or --recompute-method block "
                    f"--recompute-num-layers N (the first N blocks)")
        args.recompute_num_layers = None   # Megatron-LM's uniform with units of one block: every block
    if method == "block" and getattr(args, "recompute_num_layers", None) is None:
        p.error("--recompute-method block needs --recompute-num-layers N (the first N blocks recompute; as in "
                "Megatron-LM); leave both out to recompute every block")
    if getattr(args, "cpu_offloading", False) and getattr(args, "recompute_granularity", None) == "full" \
            and getattr(args, "recompute_num_layers", None) is None:
        p.error("--cpu-offloading with --recompute-granularity full: the blocks keep only their inputs, held by the "
                "checkpoint, so nothing is left to offload; use --recompute-granularity selective "
                "--recompute-modules outside_core_attn")
    if getattr(args, "recompute_num_layers", None) is not None and getattr(args, "recompute_granularity", None) is None:
        p.error(f"--recompute-num-layers={args.recompute_num_layers} is set without --recompute-granularity: add "
                f"--recompute-granularity full or selective (the first N blocks are recomputed)")
    if getattr(args, "cpu_offloading_num_layers", None) is not None and not getattr(args, "cpu_offloading", False):
        p.error(f"--cpu-offloading-num-layers={args.cpu_offloading_num_layers} is set without --cpu-offloading: "
                f"add --cpu-offloading")
    if getattr(args, "manual_gc_interval", 0) and not getattr(args, "manual_gc", False):
        p.error(f"--manual-gc-interval={args.manual_gc_interval} is set without --manual-gc: add --manual-gc (the "
                f"interval applies only when Python's automatic collector is off)")
    if args.max_tokens_per_step is not None and not args.pack_samples:
        p.error("--max-tokens-per-step is the budget of a packed step: add --pack-samples")
    if args.pack_samples:
        if args.max_tokens_per_step is None or args.max_tokens_per_step < 1:
            p.error(f"--pack-samples needs --max-tokens-per-step N (a positive video-token budget per step; got "
                    f"{args.max_tokens_per_step})")
        if args.micro_batch_size != 1:
            p.error(f"--pack-samples packs one sequence per step (B=1): use --micro-batch-size 1 (got "
                    f"{args.micro_batch_size}); --max-tokens-per-step sets how many clips join it")
        if getattr(args, "ulysses_packed_qkv", "off") == "on":
            p.error("--ulysses-packed-qkv on cannot run --pack-samples (the packed q|k|v exchange takes one sample "
                    "per sequence): use --ulysses-packed-qkv off or auto (auto turns it off for packed samples)")
    try:
        spec = sparse_spec(args)
    except SPConfigError as e:
        p.error(str(e))
    if spec is not None:
        if args.pack_samples:
            p.error(f"{SPARSE_FLAG} tiles cannot run --pack-samples (one block mask per sequence): drop one of them")
        if getattr(args, "ulysses_packed_qkv", "off") == "on":
            p.error(f"--ulysses-packed-qkv on cannot run {SPARSE_FLAG} tiles (the block-sparse attention takes q, k, v "
                    f"on the plain path): use --ulysses-packed-qkv off or auto (auto turns it off)")


def frames_and_sizes(args) -> tuple[list, list]:
    """(--frames as ints, --latent-size as [(H, W), ...])."""
    try:
        frames = [int(x) for x in str(args.frames).split(",")]
    except ValueError:
        raise SPConfigError(f"--frames={args.frames!r}: expected a comma list of whole numbers, e.g. 4 or 4,8") from None
    try:
        sizes = [tuple(int(x) for x in hw.lower().split("x")) for hw in args.latent_size.split(",")]
        if any(len(hw) != 2 for hw in sizes):
            raise ValueError
    except ValueError:
        raise SPConfigError(f"--latent-size={args.latent_size!r}: expected HxW or a comma list of them, e.g. 8x8 "
                            f"or 8x8,6x10") from None
    if any(n < 1 for n in frames) or any(n < 1 for hw in sizes for n in hw):
        raise SPConfigError(f"--frames={args.frames!r} --latent-size={args.latent_size!r}: sizes must be positive")
    return frames, sizes


def frames_and_size(args) -> tuple[list, int, int]:
    """(--frames, H, W of the first --latent-size)."""
    frames, sizes = frames_and_sizes(args)
    return frames, sizes[0][0], sizes[0][1]


def check_shapes(args, cfg) -> None:
    """--frames / --latent-size must cut into the model's patches, and with --sparse-attention tiles the tile must be
    three positive sizes (SPConfigError naming them). Any tile runs on every grid of the run: blocks the grid cuts are
    compacted after the whole ones (training/video_dit/sparse.py, #53), so no grid needs advice or padding."""
    from .engine import check_divisible  # noqa: PLC0415
    frames, sizes = frames_and_sizes(args)
    try:
        check_divisible(cfg, frames, 0, 0, sizes)
    except ValueError as e:
        raise SPConfigError(f"--frames/--latent-size: {e}") from None
    spec = sparse_spec(args)
    if spec is not None:
        pt, ph, pw = cfg.patch
        for f in frames:
            for h, w in sizes:
                check_tile_grid((f // pt, h // ph, w // pw), spec.tile)


def build_dataset(args, cfg, require: Optional[dict] = None):
    """--data-path's files (``require``: {tensor: why the run needs it} beyond latent and text) or the synthetic
    source of --frames x --latent-size."""
    if args.data_path:
        try:
            return LatentShardDataset(args.data_path, channels=cfg.in_channels, text_dim=cfg.text_dim,
                                      patch=cfg.patch, micro_batch=args.micro_batch_size, require=require)
        except FileNotFoundError as e:  # --data-path names no directory / no latent files: the user's setting
            raise LatentFileError(str(e)) from None
    frames, sizes = frames_and_sizes(args)
    (h, w) = sizes[0]
    return SyntheticVideoLatents(cfg.in_channels, frames, h, w, cfg.text_len, cfg.text_dim, seed=args.seed,
                                 sizes=sizes if len(sizes) > 1 else None)


def pick_device() -> torch.device:
    import os  # noqa: PLC0415
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
