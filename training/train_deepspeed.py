"""Train the video DiT with DeepSpeed; sequence parallelism comes from the JSON config:

    "sequence_parallel_size": 4,
    "sequence_parallel_ext": {"mode": "hcms", "head_chunks": 2}

    torchrun --nproc-per-node 4 training/train_deepspeed.py --deepspeed-config configs/deepspeed/cpu_tiny_hcms.json
    torchrun --nproc-per-node 4 training/train_deepspeed.py --context-parallel-size 4   (built-in ZeRO-1 config)

Without --deepspeed-config the run uses ``default_config`` (AdamW at --lr, ZeRO-1, no sequence_parallel_ext
block: every SP setting at its default); --context-parallel-size sets "sequence_parallel_size" in either.

megatron_sp_ext.deepspeed.initialize validates the block, builds the SP groups and mpu, lets the
DiT opt in (configure_sequence_parallel -> training.video_dit.parallel.parallelize over the SP group, the same
call and attention core as the Megatron entry) and calls deepspeed.initialize.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.video_dit import VideoDiT  # noqa: E402
from training.video_dit import deterministic  # noqa: E402
from training.video_dit import ds_checkpoint as ds_ckpt  # noqa: E402
from training.video_dit.checkpoint import check_resume_step, describe  # noqa: E402
from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from training.video_dit.cli import (EntryParser, add_common_args, build_dataset, check_common_args,  # noqa: E402
                                    check_shapes, model_config, parallel_size_problem, pick_device, sparse_spec)
from training.video_dit.faults import report_failures, run_entry, timeout_of  # noqa: E402
from training.video_dit.fused import resolve_fused, resolve_packed  # noqa: E402
from training.video_dit.dynamic import DynamicSP  # noqa: E402
from training.video_dit.parallel import DiTParallelConfig, parallelize  # noqa: E402
from training.video_dit.engine import MetricsLog, attention_kernel_line  # noqa: E402
from training.video_dit.logs import captured_stdout, quiet_known_warnings, setup_logging  # noqa: E402
from training.video_dit.loop import DeepSpeedOps, RunContext, add_train_args, train_loop  # noqa: E402
from training.video_dit.packing import first_sample, make_pack_plan  # noqa: E402
from training.video_dit.pipeline import consumed_samples, resume_base  # noqa: E402
from training.video_dit.sample import write_demo_samples  # noqa: E402

logger = logging.getLogger("video_dit")


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = EntryParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, hide=("--bf16",))   # precision is the JSON's ("bf16": {"enabled": true}): refused below
    p.add_argument("--deepspeed-config", default=None,
                   help="DeepSpeed JSON (with sequence_parallel_ext); default: ZeRO-1 AdamW at --lr, SP defaults")
    p.add_argument("--context-parallel-size", "--sequence-parallel-size", type=int, default=None,
                   help="sets the JSON's \"sequence_parallel_size\" (default: the JSON's, else 1)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_train_args(p)
    args = p.parse_args(argv)
    if args.bf16:   # shared with the other entries, where it is autocast; here DeepSpeed's JSON sets the precision
        p.error('--bf16: the DeepSpeed entry takes its precision from the DeepSpeed config: set "bf16": {"enabled": '
                'true} in --deepspeed-config (it ran fp32 under this flag before)')
    check_common_args(p, args)
    return args


def default_config(args: argparse.Namespace) -> dict:
    """The DeepSpeed config used without --deepspeed-config: ZeRO-1, AdamW at --lr, no SP block."""
    return {"train_micro_batch_size_per_gpu": args.micro_batch_size, "gradient_accumulation_steps": 1,
            "gradient_clipping": args.clip_grad, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.weight_decay,
                                                      "torch_adam": True}}}


def load_config(args: argparse.Namespace, config: Optional[dict] = None) -> dict:
    """The run's DeepSpeed config: --deepspeed-config (or ``default_config``), ``config`` over it, then
    --context-parallel-size. Raises SPConfigError naming the file and key when it cannot work here."""
    where = f"--deepspeed-config={args.deepspeed_config!r}" if args.deepspeed_config else "the built-in config"
    if args.deepspeed_config:
        try:
            with open(args.deepspeed_config) as f:
                ds_cfg = json.load(f)
        except OSError as e:
            raise SPConfigError(f"{where}: cannot read it ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise SPConfigError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(ds_cfg, dict):
            raise SPConfigError(f"{where}: holds a {type(ds_cfg).__name__}, expected a JSON object")
    else:
        ds_cfg = default_config(args)
    if config:
        ds_cfg.update(config)
    if args.context_parallel_size is not None:
        ds_cfg["sequence_parallel_size"] = args.context_parallel_size
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1)
    problem = parallel_size_problem("sequence_parallel_size", ds_cfg.get("sequence_parallel_size", 1), world)
    if problem:
        flag = " (from --context-parallel-size)" if args.context_parallel_size is not None else ""
        raise SPConfigError(f"{where}: {problem}{flag}")
    return ds_cfg


def check_deterministic(args: argparse.Namespace, ds_cfg: dict) -> None:
    """--deterministic-mode against the JSON's kernel and mode (sequence_parallel_ext.backend / .mode; the tiles run
    on the same kernel): SPConfigError naming the key where a rerun could differ (training/video_dit/deterministic)."""
    if not args.deterministic_mode:
        return
    from megatron_sp_ext.deepspeed.initialize import sp_config_from_deepspeed  # noqa: PLC0415
    sp_cfg, _ = sp_config_from_deepspeed(ds_cfg)
    key = {k: f"sequence_parallel_ext.{k}" for k in ("backend", "mode")}
    refusal = deterministic.why_not(True, sp_cfg.backend, getattr(args, "sparse_attention", "none"), sp_cfg.backend,
                                    sp_cfg.mode, names={"backend": key["backend"], "sparse_kernel": key["backend"],
                                                        "mode": key["mode"]})
    if refusal:
        raise SPConfigError(refusal + (f" (in {args.deepspeed_config})" if args.deepspeed_config else ""))


def main(argv: Optional[list] = None, config: Optional[dict] = None) -> dict:
    """``config`` (a dict) overrides --deepspeed-config (tests)."""
    quiet_known_warnings()  # before DeepSpeed is imported
    args = parse(argv)
    if args.deterministic_mode:   # before the first CUDA / NCCL call
        deterministic.enable()
    device = pick_device()
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds_cfg = load_config(args, config)
    check_deterministic(args, ds_cfg)
    import deepspeed  # noqa: PLC0415

    own_pg = not dist.is_initialized()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with captured_stdout("deepspeed.init_distributed"):  # its CPU shm-op build prints one line per rank
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                                   timeout=timeout_of(args.distributed_timeout_minutes))
    setup_logging(args.log_level, dist.get_rank())
    try:
        with report_failures("train_deepspeed"):
            engine, cfg = _build(args, ds_cfg, device)
            return _train(args, engine, cfg, device, ds_cfg)
    finally:
        if own_pg:
            dist.destroy_process_group()


def _build(args, ds_cfg: dict, device):
    """The model and the DeepSpeed engine (sequence parallelism from the JSON block)."""
    from megatron_sp_ext.deepspeed import initialize  # noqa: PLC0415
    from megatron_sp_ext.deepspeed.initialize import sp_config_from_deepspeed  # noqa: PLC0415
    cfg = model_config(args)
    check_shapes(args, cfg)
    ds_cfg.setdefault("train_micro_batch_size_per_gpu", args.micro_batch_size)
    if args.check_for_nan_in_loss_and_grad and ds_cfg.get("bf16", {}).get("enabled"):
        ds_cfg["bf16"].setdefault("check_grad_overflow", True)  # the guard relies on DeepSpeed's skip of such steps
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise on the device (minutes on the CPU at 14B)
        model = VideoDiT(cfg)
    sparse = sparse_spec(args)
    fused_backend = resolve_fused(args.fused_elementwise, device)
    packed_qkv = resolve_packed(args.ulysses_packed_qkv, fused_backend, packed_samples=args.pack_samples,
                                sparse=sparse is not None)

    def opt_in(make_attention) -> None:
        """megatron_sp_ext.deepspeed's opt-in protocol: called once it has validated the JSON block and built the SP
        groups, before deepspeed.initialize builds the optimizer (top-k sparse attention adds the coarse branch's
        gates). The DiT's attention is ``parallelize``'s (the factory's ``make_attention`` is not used)."""
        from deepspeed.utils import groups  # noqa: PLC0415 - the mpu initialize just installed
        sp_cfg, _ = sp_config_from_deepspeed(ds_cfg)
        if sp_cfg.dynamic and not args.pack_samples:  # sub-groups run packed steps only (_dynamic refuses it)
            sp_cfg = dataclasses.replace(sp_cfg, dynamic=False)
        mpu = groups.mpu
        group = mpu.get_sequence_parallel_group() if mpu.get_sequence_parallel_world_size() > 1 else None
        parallelize(model, group, DiTParallelConfig(
            sp=sp_cfg, sparse=sparse, recompute_granularity=args.recompute_granularity,
            recompute_modules=args.recompute_modules, recompute_num_layers=args.recompute_num_layers,
            cpu_offloading=args.cpu_offloading, cpu_offloading_num_layers=args.cpu_offloading_num_layers,
            fused_backend=fused_backend, packed_qkv=packed_qkv))
    model.configure_sequence_parallel = opt_in
    try:
        engine, _, _, _ = initialize(model=model, config=ds_cfg, num_heads=cfg.heads)
    finally:
        del model.configure_sequence_parallel
    return engine, cfg


def _dynamic(args, engine, ds_cfg: dict, cfg, sp_group, sp_world: int):
    """``"dynamic": true`` in sequence_parallel_ext: each packed sample on its own sub-group of the SP ranks (the
    DiT's dynamic core, installed by ``parallelize``); the packer's settings, None when off or on one rank."""
    from megatron_sp_ext.deepspeed.initialize import sp_config_from_deepspeed  # noqa: PLC0415 - after DeepSpeed
    sp_cfg, _ = sp_config_from_deepspeed(ds_cfg)
    if not sp_cfg.dynamic:
        return None
    if not args.pack_samples:
        raise SPConfigError(f"{sp_cfg.name('dynamic')}=true places each sample of a packed step on its own ranks: "
                            f"add --pack-samples with --max-tokens-per-step N")
    if sp_world == 1:
        return None
    return DynamicSP(sp_world, cfg, mode=sp_cfg.mode)


def _train(args, engine, cfg, device, ds_cfg: dict) -> dict:
    from deepspeed.utils import groups  # noqa: PLC0415
    mpu = groups.mpu
    sp_group = mpu.get_sequence_parallel_group()
    sp_world, sp_rank = mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_world, dp_rank = world // sp_world, rank // sp_world
    start, loaded = 0, None
    if args.load:
        loaded = ds_ckpt.load(engine, args.load, _ckpt_identity(args))
        start = check_resume_step(loaded, args.train_iters)
        if rank == 0 and not args.quiet:
            print(f"[train_deepspeed] resumed from {loaded['path']} (step {start}) in {loaded['seconds']:.2f}s",
                  flush=True)
    global_batch = dp_world * args.micro_batch_size
    base, note = (0, None) if args.pack_samples else resume_base(loaded, start, global_batch)
    if note and rank == 0:
        logger.warning(note)
    dataset = build_dataset(args, cfg)
    plan = make_pack_plan(args, dataset, cfg, sp_world, first_sample(loaded, start, global_batch), start)
    dynamic = _dynamic(args, engine, ds_cfg, cfg, sp_group, sp_world)
    block = engine.config.get("sequence_parallel_ext", {}) if isinstance(engine.config, dict) else {}
    if not args.quiet:
        logger.info(f"model={args.model} layers={cfg.layers} SP={sp_world} DP={dp_world} "
                    f"zero={engine.zero_optimization_stage()} sequence_parallel_ext={block} device={device}"
                    + (f" pack_samples max_tokens_per_step={args.max_tokens_per_step}" if plan else ""))
    bf16 = engine.bfloat16_enabled()
    if rank == 0 and not args.quiet:  # before the progress bar starts, not inside it
        key = "sequence_parallel_ext.backend" + (f" in {args.deepspeed_config}" if args.deepspeed_config else "")
        logger.info(attention_kernel_line(block.get("backend", "auto"), key, device,
                                          torch.bfloat16 if bf16 else torch.float32, cfg.head_dim,
                                          tile_setting="auto" if sparse_spec(args) is not None else None))
    log = MetricsLog(args.log_dir, args.train_iters, rank == 0, cfg, device, start, show=not args.quiet,
                     group=dist.group.WORLD if dist.is_initialized() else None)

    def cast_inputs(inp):
        if bf16:
            inp.x, inp.text, inp.t = inp.x.bfloat16(), inp.text.bfloat16(), inp.t.bfloat16()
    ctx = RunContext(sp_rank, sp_world, dp_rank, dp_world, rank, world)
    position = lambda s: {"consumed_samples": plan.consumed_samples(s, dp_world) if plan else  # noqa: E731
                          consumed_samples(s, base, global_batch), "global_batch": global_batch}
    losses = train_loop(args, DeepSpeedOps(engine), dataset, cfg, ctx, device, log, start=start, sample_base=base,
                        cast_inputs=cast_inputs, save=lambda s: _save(args, engine, s, rank, position(s)),
                        pack_plan=plan, dynamic=dynamic)
    # the last step is saved unless the interval saved it, or no step ran (the loaded checkpoint is the end)
    interval_saved = bool(args.save_interval) and args.train_iters % args.save_interval == 0
    if args.save and start < args.train_iters and not interval_saved:
        _save(args, engine, args.train_iters, rank, position(args.train_iters))
    plot = log.close(f"video DiT ({args.model}), DeepSpeed SP={sp_world}")
    if not args.quiet and losses:
        logger.info(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; plot: {plot}")
    if args.sample_steps:
        write_demo_samples(engine.module, dataset, steps=args.sample_steps, seed=args.seed,
                           group=sp_group if sp_world > 1 else None, device=device, log_dir=args.log_dir)
    return {"losses": losses, "plot": plot, "rows": log.rows, "timing": getattr(log, "timing", None)}


def _ckpt_identity(args) -> dict:
    gates = getattr(args, "sparse_topk", None) is not None  # --sparse-topk adds the coarse branch's gates
    return {"entry": "deepspeed", **describe(model_config(args), args.model, sparse_gates=gates)}


def _save(args, engine, step, rank, position: dict):
    """Engine checkpoint in the atomic layout (training/video_dit/ds_checkpoint.py); ``position``: the data
    position (consumed_samples, global_batch)."""
    out = ds_ckpt.save(engine, args.save, step, {**_ckpt_identity(args), **position}, args.keep_last)
    if rank == 0 and not args.quiet:
        print(f"[train_deepspeed] saved {out['path']} in {out['seconds']:.2f}s", flush=True)


if __name__ == "__main__":
    sys.exit(run_entry(main, "train_deepspeed"))
