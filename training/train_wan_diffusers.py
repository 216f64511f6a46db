r"""Train diffusers' WanTransformer3DModel (Wan 2.1) with megatron_sp_ext's sequence parallelism
(``megatron_sp_ext.diffusers.parallelize``), FSDP2 beside it, and Wan's flow-matching objective.

    torchrun --nproc-per-node 2 training/train_wan_diffusers.py --init random --model wan-1.3b \
        --context-parallel-size 2 --cp-comm-type auto --use-torch-fsdp2 --bf16 --recompute-granularity full \
        --frames 21 --latent-size 60x104 --train-iters 100 --save ck --save-interval 50 --log-dir runs/wan \
        --save-pretrained runs/wan/final

Model: ``--init PATH`` (a local directory in diffusers' layout, from_pretrained: config.json + safetensors, or a Wan
pipeline directory with transformer/) or ``--init random --model wan-1.3b|wan-14b|tiny`` (diffusers' Wan2.1 configs;
--num-layers shortens them). Weights stay fp32; --bf16 runs the step under bf16 autocast (CUDA, refused on the CPU;
with FSDP2 its bf16 compute weights). --recompute-granularity full turns on diffusers' gradient checkpointing (per
block).
Data: --data-path (latent files, "latent" [C, F, H, W] and "text" [L, 4096]: training/video_dit/make_latents.py) or
synthetic latents of --frames x --latent-size. Objective: training/wan_diffusers/flow.py (x_t = (1 - t) x0 + t eps, target
eps - x0, Wan's timestep shift --timestep-shift). Gradients over SP ranks: training/wan_diffusers/loop.py.
Checkpoints (--save / --load / --save-interval / --keep-last): torch.distributed.checkpoint, atomic, resharding across
SP, DP and FSDP sizes (training/video_dit/checkpoint.py). --save-pretrained DIR writes the trained transformer in
diffusers' layout (WanTransformer3DModel.from_pretrained(DIR) reads it). Metrics, loss.png, the non-finite guard and
the loss-spike warning are the video DiT entry's.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sp_ext import modes  # noqa: E402
from megatron_sp_ext.config import BACKENDS, MODES, SPConfig, parse_head_chunks  # noqa: E402
from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from training.video_dit import checkpoint as ckpt  # noqa: E402
from training.video_dit.cli import (EntryParser, add_common_args, build_dataset, check_bf16_device,  # noqa: E402
                                    check_common_args, check_parallel_size, frames_and_sizes, pick_device, sparse_spec)
from training.video_dit.engine import MetricsLog  # noqa: E402
from training.video_dit.faults import report_failures, run_entry, timeout_of  # noqa: E402
from training.video_dit.logs import quiet_known_warnings, setup_logging  # noqa: E402
from training.video_dit.loop import TorchOps, resolve_workers  # noqa: E402
from training.video_dit.sharding import FsdpOps, full_parameters, shard_model  # noqa: E402
from training.wan_diffusers import model as wan  # noqa: E402
from training.wan_diffusers.loop import Layout, train_steps  # noqa: E402

logger = logging.getLogger("video_dit")
WHAT = "train_wan_diffusers"


def _chunks(value: str):
    try:
        return parse_head_chunks(value, "--hcms-head-chunks")
    except SPConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# the shared video DiT flags this entry refuses by name (parse): --help leaves them out
VIDEO_DIT_ONLY = ("--modulation", "--pack-samples", "--max-tokens-per-step", "--sample-steps")


def build_parser() -> EntryParser:
    p = EntryParser(prog="train_wan_diffusers.py", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, hide=VIDEO_DIT_ONLY)
    g = p.add_argument_group("Wan (diffusers)")
    g.add_argument("--init", default="random",
                   help="'random' (diffusers' initialisation of --model's config, seeded by --seed) or a local "
                        "directory in diffusers' layout (WanTransformer3DModel.from_pretrained)")
    g.add_argument("--save-pretrained", default=None, metavar="DIR",
                   help="after training, write the transformer in diffusers' layout to DIR "
                        "(WanTransformer3DModel.from_pretrained reads it; with accelerate: pip install '.[diffusers]')")
    g.add_argument("--timestep-shift", type=float, default=5.0,
                   help="Wan's flow-matching timestep shift s: t = s u / (1 + (s - 1) u) (1.0: none)")
    g.add_argument("--text-len", type=int, default=None,
                   help="synthetic text embeddings per prompt (default: 512, umT5's length; 8 for --model tiny)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--context-parallel-size", type=int, default=1, help="sequence-parallel (context) ranks per group")
    g.add_argument("--cp-comm-type", default="auto", choices=list(MODES),
                   help="megatron_sp_ext's sequence-parallel mode of every self-attention")
    g.add_argument("--hcms-head-chunks", type=_chunks, default=1, help="HCMS head chunks (int or 'auto')")
    g.add_argument("--sp-attention-backend", default="auto", choices=list(BACKENDS), help="local attention kernel")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="torch FSDP2 (fully_shard per transformer block + root) over all data x context ranks: "
                        "fp32 main weights, bf16 compute with --bf16 (reduce in fp32)")
    g.add_argument("--recompute-granularity", choices=["full"], default=None,
                   help="full: diffusers' gradient checkpointing (enable_gradient_checkpointing: every block)")
    g = p.add_argument_group("training loop")
    g.add_argument("--log-interval", type=int, default=1, help="read metrics back every N steps")
    g.add_argument("--tensorboard-dir", default=None, help="also write TensorBoard event files here (rank 0)")
    g.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader worker processes per rank (default: 2-8 on CUDA, 0 on CPU)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="turn off the per-step finite check of loss and gradient norm")
    g.add_argument("--skip-nonfinite-steps", type=int, default=0,
                   help="skip (do not apply) up to N steps whose loss/grad norm is NaN/Inf; stop at the N+1st")
    g.add_argument("--loss-spike-factor", type=float, default=3.0,
                   help="warn when a loss exceeds this x the running median (0: off)")
    g.add_argument("--timing", action="store_true", help="model_fwd_bwd_ms / optimizer_ms in metrics.jsonl")
    return p


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    quiet_known_warnings()
    p = build_parser()
    args = p.parse_args(argv)
    for flag, on in (("--pack-samples", args.pack_samples), ("--max-tokens-per-step", args.max_tokens_per_step),
                     ("--sample-steps", args.sample_steps)):
        if on:
            p.error(f"{flag} is a video DiT entry option (training/pretrain_video_dit.py); this entry trains one clip "
                    f"per micro-sample and samples nothing: drop {flag}")
    if args.modulation != "wan":
        p.error(f"--modulation={args.modulation} is the video DiT entries' (training/pretrain_video_dit.py, "
                f"train_deepspeed.py): diffusers' WanTransformer3DModel has Wan's own AdaLN; drop --modulation")
    check_parallel_size(p, "--context-parallel-size", args.context_parallel_size)
    check_common_args(p, args)
    if args.init != "random":
        if args.num_layers is not None:
            p.error(f"--num-layers={args.num_layers} applies to --init random (the layers of --init {args.init} are "
                    f"its config.json's)")
    if args.timestep_shift <= 0:
        p.error(f"--timestep-shift={args.timestep_shift}: must be > 0 (1.0: no shift; Wan 2.1 uses 5.0)")
    if args.text_len is not None and args.text_len < 1:
        p.error(f"--text-len={args.text_len}: must be >= 1")
    for flag, n, least in (("--log-interval", args.log_interval, 1), ("--train-iters", args.train_iters, 0),
                           ("--micro-batch-size", args.micro_batch_size, 1), ("--save-interval", args.save_interval, 0),
                           ("--skip-nonfinite-steps", args.skip_nonfinite_steps, 0)):
        if n < least:
            p.error(f"{flag}={n}: must be >= {least}")
    if args.num_workers is not None and args.num_workers < 0:
        p.error(f"--num-workers={args.num_workers}: must be >= 0")
    if args.sparse_topk is not None and args.micro_batch_size > 1:
        p.error(f"--sparse-topk={args.sparse_topk} with --micro-batch-size={args.micro_batch_size}: the top-k plan "
                f"takes one mask per forward (batch 1): use --micro-batch-size 1")
    if modes.head_chunks_of(args.cp_comm_type, args.hcms_head_chunks) != args.hcms_head_chunks:
        p.error(f"--hcms-head-chunks={args.hcms_head_chunks} is HCMS's: use --cp-comm-type hcms (or auto)")
    return args


def _init_process_group(device: torch.device, minutes: float) -> bool:
    """Initialise the default group (torchrun's env://; a lone process gets a one-rank group). True when it did."""
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout_of(minutes))
    return True


def make_layout(sp: int, device: torch.device):
    """(Layout, SP group or None) for ``sp`` context ranks per group: groups of consecutive ranks (Megatron's order
    at TP=1), data-parallel replicas across them."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // sp
    group = None
    if sp > 1:
        mesh = init_device_mesh(device.type, (dp, sp), mesh_dim_names=("dp", "sp"))
        group = mesh.get_group("sp")
    return Layout(rank % sp, sp, rank // sp, dp, rank, world), group


def sparse_plan(args):
    """The block-sparse plan of --sparse-attention tiles (megatron_sp_ext.diffusers.sparse), None when dense."""
    spec = sparse_spec(args)
    if spec is None:
        return None
    from megatron_sp_ext.diffusers.sparse import BlockSparsePlan  # noqa: PLC0415
    return BlockSparsePlan(tuple(spec.tile), window=tuple(spec.window) if spec.window is not None else None,
                           topk=spec.topk)


def main(argv: Optional[list] = None, return_params: bool = False, grads_at: Optional[int] = None) -> dict:
    """Train; returns losses, plot, rows (and with ``return_params`` "params": name -> full fp32 tensor; with
    ``grads_at`` = a step, "grads": that step's reduced full gradients; collective, for tests)."""
    args = parse(argv)
    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own_pg = _init_process_group(device, args.distributed_timeout_minutes)
    setup_logging(args.log_level, dist.get_rank())
    try:
        with report_failures(WHAT):
            check_bf16_device(args, device)
            return _train(args, device, return_params, grads_at)
    finally:
        if own_pg:
            dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _check_tokens(args, cfg, sp: int) -> None:
    frames, sizes = frames_and_sizes(args)
    pt, ph, pw = cfg.patch
    for f in frames:
        for h, w in sizes:
            if f % pt or h % ph or w % pw:
                raise SPConfigError(f"--frames {f} --latent-size {h}x{w}: not a multiple of the patch {cfg.patch}")
            n = (f // pt) * (h // ph) * (w // pw)
            if n % sp:
                raise SPConfigError(f"--frames {f} --latent-size {h}x{w}: {n} tokens do not divide by "
                                    f"--context-parallel-size={sp} (the model's split needs equal shards)")


def _check_data_tokens(args, dataset, cfg, sp: int) -> None:
    """--data-path: every clip's token count (latent [C, T, H, W] / the patch, from the file headers) divides by
    ``sp``."""
    pt, ph, pw = cfg.patch
    for i in range(len(dataset)):
        (_, t, h, w), _ = dataset.shape_of(i)
        n = (t // pt) * (h // ph) * (w // pw)
        if n % sp:
            raise SPConfigError(f"--data-path {args.data_path}: {dataset.files[i]} (latent T x H x W = {t}x{h}x{w}) "
                                f"has {n} tokens, which do not divide by --context-parallel-size={sp} (the model's "
                                f"split needs equal shards)")


def _train(args, device, return_params: bool, grads_at: Optional[int]) -> dict:
    sp = args.context_parallel_size
    lay, sp_group = make_layout(sp, device)
    if args.init == "random":
        model = wan.random_model(wan.preset_kwargs(args.model, args.num_layers), args.seed, device)
        preset = args.model
    else:
        model = wan.load_model(args.init, device)
        preset = ckpt.PRETRAINED
    text_len = args.text_len or wan.TEXT_LEN.get(preset, 512)
    cfg = wan.dit_config(model.config, text_len)
    dataset = build_dataset(args, cfg)
    if args.data_path:
        _check_data_tokens(args, dataset, cfg, sp)
    else:
        _check_tokens(args, cfg, sp)
    if args.recompute_granularity == "full":
        model.enable_gradient_checkpointing()
    plan = sparse_plan(args)
    handle = None
    if sp > 1 or plan is not None:   # dense SP=1 runs diffusers' own model as it is (the reference)
        from megatron_sp_ext.diffusers import parallelize  # noqa: PLC0415
        sp_cfg = SPConfig(mode=args.cp_comm_type,
                          head_chunks=modes.head_chunks_of(args.cp_comm_type, args.hcms_head_chunks),
                          backend=args.sp_attention_backend, source="megatron")
        handle = parallelize(model, sp_group, config=sp_cfg, sparse=plan)
    gates = plan is not None and any(".sparse_gate." in n for n, _ in model.named_parameters())
    if gates and args.init != "random":   # a top-k model saved by --save-pretrained carries its gates beside it
        root, sub = wan.pretrained_dir(args.init)
        folder = os.path.join(root, sub or "")
        if wan.gate_names(folder):
            plan.load_gates(model, folder)
        else:
            logger.info(f"--init {args.init} has no sparse gates: they start at zero (the model's fine block-sparse "
                        f"attention alone)")
    world_group = dist.group.WORLD if lay.world > 1 else None
    if args.use_torch_fsdp2:
        model = shard_model(model, dist.group.WORLD, device, bf16=args.bf16 and device.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                            foreach=True if args.use_torch_fsdp2 else None,
                            fused=(device.type == "cuda" and not args.use_torch_fsdp2) or None)
    ops = FsdpOps(model, opt, args.clip_grad) if args.use_torch_fsdp2 else TorchOps(model, opt, world_group,
                                                                                   args.clip_grad)
    run_id = wan.identity(model.config, preset, sparse_gates=gates)
    start, loaded = 0, None
    if args.load:
        loaded = ckpt.load(args.load, model, opt, run_id)
        start = ckpt.check_resume_step(loaded, args.train_iters)
        if lay.rank == 0 and not args.quiet:
            print(f"[{WHAT}] resumed from {loaded['path']} (step {start})", flush=True)
    if not args.quiet:
        logger.info(f"Wan ({'random ' + args.model if args.init == 'random' else args.init}) layers={cfg.layers} "
                    f"SP={sp} DP={lay.dp_world} cp_comm_type={args.cp_comm_type} "
                    f"{'fsdp2' if args.use_torch_fsdp2 else 'all-reduce'} recompute={args.recompute_granularity} "
                    f"bf16={args.bf16 and device.type == 'cuda'} device={device}"
                    + (f" sparse={sparse_spec(args)}" if plan is not None else ""))
    metrics = MetricsLog(args.log_dir, args.train_iters, lay.rank == 0, cfg, device, start, show=not args.quiet)
    autocast = torch.bfloat16 if (args.bf16 and device.type == "cuda") else None
    global_batch = lay.dp_world * args.micro_batch_size

    def save(step: int) -> None:
        out = ckpt.save(args.save, step, model, opt, {**run_id, "consumed_samples": step * global_batch,
                                                       "global_batch": global_batch, "init": args.init,
                                                       "layout": {"context_parallel_size": sp,
                                                                  "cp_comm_type": args.cp_comm_type}},
                        args.keep_last)
        if lay.rank == 0 and not args.quiet:
            print(f"[{WHAT}] saved {out['path']} in {out['seconds']:.2f}s", flush=True)

    grads = {}

    def on_grads(step: int) -> None:
        if step == grads_at:
            grads.update({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})

    losses = train_steps(args, ops, model, dataset, cfg, lay, device, metrics, start=start, autocast=autocast,
                         save=save, workers=resolve_workers(args, device),
                         on_grads=on_grads if grads_at is not None else None)
    interval_saved = bool(args.save_interval) and args.train_iters % args.save_interval == 0
    if args.save and start < args.train_iters and not interval_saved:
        save(args.train_iters)
    plot = metrics.close(f"Wan ({preset}), SP={sp} {args.cp_comm_type}")
    if not args.quiet and losses:
        logger.info(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; "
                    f"metrics: {args.log_dir}/metrics.jsonl; plot: {plot}")
    if args.save_pretrained:
        extra = wan.save_pretrained(model, args.save_pretrained, lay.rank)
        if lay.rank == 0 and not args.quiet:
            logger.info(f"saved the transformer in diffusers' layout to {args.save_pretrained}"
                        + (f" (the sparse plan's {len(extra)} extra tensors in megatron_sp_ext_extra.safetensors)"
                           if extra else ""))
    out = {"losses": losses, "plot": plot, "rows": metrics.rows}
    if return_params:
        out["params"] = full_parameters(model)
    if grads_at is not None:
        out["grads"] = grads
    return out


if __name__ == "__main__":
    sys.exit(run_entry(main, WHAT))
