r"""Train the video DiT with megatron-core: parallel_state groups, Megatron-LM-style flags
(--context-parallel-size, --cp-comm-type, --hcms-head-chunks, --sp-arrangement, ...), Megatron's DDP
and optimizer on GPU.

    torchrun --nproc-per-node 4 training/pretrain_video_dit.py --model tiny \
        --context-parallel-size 4 --cp-comm-type hcms --hcms-head-chunks 2 --train-iters 40 --log-dir runs/demo

Megatron-core's DDP keeps its gradient buffers on CUDA; on CPU (gloo) the same reduction is done
explicitly (all-reduce over data x context ranks, averaged) with torch AdamW: --ddp-impl picks,
"auto" = megatron on CUDA, torch on CPU. The choice is logged at start.
"""
from __future__ import annotations

import argparse
import os
import sys
import logging
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sp_ext import modes  # noqa: E402
from megatron_sp_ext.config import SPConfig  # noqa: E402
from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from training.video_dit import VideoDiT  # noqa: E402
from training.video_dit import checkpoint as ckpt  # noqa: E402
from training.video_dit import deterministic  # noqa: E402
from training.video_dit.cli import (EntryParser, add_common_args, add_sparse_kernel_arg, build_dataset,  # noqa: E402
                                    check_bf16_device, check_common_args, check_parallel_size, check_shapes, check_sparse_kernel,
                                    model_config, pick_device, run_dtype, sparse_spec)
from training.video_dit.sparse import SPARSE_KERNEL_FLAG  # noqa: E402
from training.video_dit.dynamic import DynamicSP  # noqa: E402
from training.video_dit.engine import MetricsLog, attention_kernel_line  # noqa: E402
from training.video_dit.parallel import DiTParallelConfig, parallelize  # noqa: E402
from training.video_dit.faults import report_failures, run_entry, timeout_of  # noqa: E402
from training.video_dit.fused import resolve_fused, resolve_packed  # noqa: E402
from training.video_dit.logs import quiet_known_warnings, setup_logging  # noqa: E402
from training.video_dit.loop import MegatronOps, RunContext, TorchOps, add_train_args, train_loop  # noqa: E402
from training.video_dit.packing import first_sample, make_pack_plan  # noqa: E402
from training.video_dit.pipeline import consumed_samples, resume_base  # noqa: E402
from training.video_dit.sample import write_demo_samples  # noqa: E402
from training.video_dit.sharding import FsdpOps, check_fsdp2_flags, full_parameters, shard_model  # noqa: E402

logger = logging.getLogger("video_dit")


HIGH_PRIORITY_GROUPS = ("cp", "dp", "dp_cp")   # the megatron-core groups this DiT's step communicates over


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    quiet_known_warnings()  # before megatron-core is imported
    from megatron_sp_ext.megatron import add_arguments, validate_args  # noqa: PLC0415
    p = EntryParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    add_sparse_kernel_arg(p)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--ddp-impl", choices=["auto", "megatron", "torch"], default="auto")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="megatron DDP: shard optimizer state over data x context ranks (ZeRO-1 style)")
    p.add_argument("--overlap-grad-reduce", action="store_true", help="megatron DDP: overlap the gradient "
                   "reduce-scatter/all-reduce with the backward")
    p.add_argument("--bf16-params", action="store_true",
                   help="megatron DDP (GPU): keep the model's weights in bf16 with fp32 main weights and Adam state "
                        "in Megatron's optimizer (Megatron-LM's --bf16 meaning; needs --bf16 for the autocast)")
    p.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="megatron DDP: gradient buffers and their reduction in bf16 (default fp32)")
    p.add_argument("--use-torch-fsdp2", action="store_true",
                   help="torch FSDP2 (fully_shard per block + root): shard parameters, gradients and optimizer state "
                        "over data x context ranks; fp32 main weights, bf16 compute with --bf16 (reduce in fp32)")
    p.add_argument("--high-priority-stream-groups", nargs="+", default=None, metavar="GROUP",
                   choices=HIGH_PRIORITY_GROUPS,
                   help="megatron-core groups whose NCCL streams run at high priority (Megatron-LM's flag of the same "
                        f"name; {', '.join(HIGH_PRIORITY_GROUPS)}): their kernels are dispatched before a compute "
                        "kernel that would take every SM first (the sequence-parallel exchanges: cp). CUDA only")
    add_train_args(p)
    add_arguments(p)
    # Megatron-LM's default (p2p) is Transformer Engine's ring, which this DiT does not have: ours picks a mode
    p.set_defaults(cp_comm_type=["auto"])
    args = p.parse_args(argv)
    check_parallel_size(p, "--context-parallel-size", args.context_parallel_size)
    if args.high_priority_stream_groups and not torch.cuda.is_available():
        p.error("--high-priority-stream-groups sets the priority of NCCL's CUDA streams: this machine has no CUDA "
                "(gloo); drop the flag")
    if args.bf16_params and not args.bf16:
        p.error("--bf16-params needs --bf16 (the autocast that feeds bf16 weights)")
    if (args.bf16_params or args.use_distributed_optimizer or args.overlap_grad_reduce or args.grad_reduce_in_bf16) \
            and args.ddp_impl == "torch":
        p.error("--bf16-params / --use-distributed-optimizer / --overlap-grad-reduce / --grad-reduce-in-bf16 are "
                "megatron DDP options: use --ddp-impl megatron or auto on CUDA")
    fsdp_msg = check_fsdp2_flags(args.use_torch_fsdp2, **{
        "--use-distributed-optimizer": args.use_distributed_optimizer, "--bf16-params": args.bf16_params,
        "--overlap-grad-reduce": args.overlap_grad_reduce, "--grad-reduce-in-bf16": args.grad_reduce_in_bf16,
        "--ddp-impl megatron": args.ddp_impl == "megatron"})
    if fsdp_msg:
        p.error(fsdp_msg)
    check_common_args(p, args)
    check_sparse_kernel(p, args)
    cfg = model_config(args)
    args.num_attention_heads, args.tensor_model_parallel_size = cfg.heads, 1
    if len(args.cp_comm_type) != 1:
        p.error("--cp-comm-type: the video DiT takes one value for all layers")
    if args.cp_comm_type[0] in ("p2p", "a2a", "all_gather", "a2a+p2p"):
        p.error(f"--cp-comm-type={args.cp_comm_type[0]}: Transformer Engine's CP needs TE's attention module; "
                f"this DiT uses megatron_sp_ext modes ({', '.join(modes.NAMES)})")
    try:
        validate_args(args)
    except SPConfigError as e:
        p.error(str(e))
    spec = modes.get(args.cp_comm_type[0])   # a mode (validate_args refused anything else)
    a2a_modes = modes.names(all_to_all=True, auto=False)   # the modes whose exchanges the layer forms overlap
    if args.sp_async_qkv in ("on", "allgather") and (not spec.all_to_all or spec.auto
                                                     or args.hcms_head_chunks == "auto"):
        p.error(f"--sp-async-qkv {args.sp_async_qkv} needs --cp-comm-type {modes.listing(a2a_modes)} with an integer "
                f"--hcms-head-chunks (got {args.cp_comm_type[0]}, {args.hcms_head_chunks}); --sp-async-qkv auto picks "
                f"them itself")
    if args.pack_samples and args.sp_async_qkv != "off":
        p.error(f"--sp-async-qkv {args.sp_async_qkv} cannot run --pack-samples (the async / all-gather layer forms "
                f"take one sample per sequence): use --sp-async-qkv off")
    if args.sp_async_qkv != "off" and args.recompute_granularity == "selective" \
            and "outside_core_attn" in args.recompute_modules:
        p.error(f"--sp-async-qkv {args.sp_async_qkv} cannot run --recompute-modules outside_core_attn (the async / "
                f"all-gather block forms fuse the projections with the exchanges: no split around the attention "
                f"core): use --sp-async-qkv off, or --recompute-modules core_attn")
    if args.dynamic_context_parallel and not args.pack_samples:
        p.error("--dynamic-context-parallel places each sample of a packed step on its own ranks: add --pack-samples "
                "with --max-tokens-per-step N")
    if args.sparse_attention != "none" and args.sp_async_qkv != "off":
        p.error(f"--sp-async-qkv {args.sp_async_qkv} cannot run --sparse-attention {args.sparse_attention} (the "
                f"async / all-gather block forms take no block mask): use --sp-async-qkv off")
    if args.sp_async_qkv == "auto" and not spec.all_to_all:
        p.error(f"--sp-async-qkv auto chooses among Ulysses block forms: use --cp-comm-type "
                f"{modes.listing(modes.names(all_to_all=True))} (got {args.cp_comm_type[0]})")
    return args


def _save(args, step, model, opt, rank, position: dict):
    """Sharded atomic checkpoint (training/video_dit/checkpoint.py); ``model``: DDP wrapper or module;
    ``position``: the data position (consumed_samples, global_batch)."""
    layout = {"context_parallel_size": args.context_parallel_size, "cp_comm_type": args.cp_comm_type[0],
              "hcms_head_chunks": args.hcms_head_chunks, "sp_async_qkv": args.sp_async_qkv}  # informational
    out = ckpt.save(args.save, step, model, opt, {**_ckpt_identity(args), "layout": layout, **position},
                    args.keep_last)
    if rank == 0 and not args.quiet:
        print(f"[pretrain_video_dit] saved {out['path']} in {out['seconds']:.2f}s", flush=True)


def _ckpt_identity(args) -> dict:
    gates = getattr(args, "sparse_topk", None) is not None  # --sparse-topk adds the coarse branch's gates
    return {"entry": "megatron-core", **ckpt.describe(model_config(args), args.model, sparse_gates=gates)}


def _sp_config(args, sp_world: int, dynamic: bool) -> SPConfig:
    """The attention's SPConfig of the CP flags (errors name them); on one CP rank only the backend (the local
    attention reads nothing else)."""
    if sp_world == 1:
        return SPConfig(backend=args.sp_attention_backend, source="megatron")
    mode = args.cp_comm_type[0]
    return SPConfig(mode=mode, head_chunks=modes.head_chunks_of(mode, args.hcms_head_chunks),
                    ring_variant=args.sp_ring_variant, arrangement=args.sp_arrangement, ulysses_size=args.sp_ulysses_size,
                    nodes=args.sp_nodes, backend=args.sp_attention_backend, transport=args.sp_transport,
                    async_qkv=args.sp_async_qkv, dynamic=dynamic, source="megatron")


def main(argv: Optional[list] = None, return_params: bool = False) -> dict:
    """Train; returns losses, plot, rows, timing (and "params": name -> full fp32 tensor when
    ``return_params``, gathered on every rank, for tests)."""
    args = parse(argv)
    if args.deterministic_mode:   # before the first CUDA / NCCL call
        deterministic.enable()
    device = pick_device()
    own_pg = not dist.is_initialized()
    if own_pg:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timeout_of(args.distributed_timeout_minutes))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    setup_logging(args.log_level, dist.get_rank())
    try:
        with report_failures("pretrain_video_dit"):
            check_bf16_device(args, device)
            priority = {"high_priority_stream_groups": args.high_priority_stream_groups} \
                if args.high_priority_stream_groups else {}
            ps.initialize_model_parallel(context_parallel_size=args.context_parallel_size,
                                         distributed_timeout_minutes=args.distributed_timeout_minutes, **priority)
            return _train(args, device, ps, return_params)
    finally:
        ps.destroy_model_parallel()
        if own_pg:
            dist.destroy_process_group()


def _train(args, device, ps, return_params: bool = False) -> dict:
    cfg = model_config(args)
    check_shapes(args, cfg)
    cp_group, dp_group = ps.get_context_parallel_group(), ps.get_data_parallel_group()
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    sp_rank, sp_world = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    dp_rank, dp_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise on the device: a 14B model built on the CPU takes minutes
        model = VideoDiT(cfg)
    sparse = sparse_spec(args)
    dynamic = None
    if args.dynamic_context_parallel and sp_world > 1:  # each packed sample on its own sub-group of CP ranks
        dynamic = DynamicSP(sp_world, cfg, args.min_dynamic_context_parallel_size, mode=args.cp_comm_type[0])
    fused_backend = resolve_fused(args.fused_elementwise, device)
    # before DDP and the optimizer: top-k sparse attention adds the coarse branch's gates
    parallelize(model, cp_group if sp_world > 1 else None, DiTParallelConfig(
        sp=_sp_config(args, sp_world, dynamic is not None), sparse=sparse, tile_setting=args.sparse_attention_kernel,
        dynamic_min_size=args.min_dynamic_context_parallel_size, recompute_granularity=args.recompute_granularity,
        recompute_modules=args.recompute_modules, recompute_num_layers=args.recompute_num_layers,
        cpu_offloading=args.cpu_offloading, cpu_offloading_num_layers=args.cpu_offloading_num_layers,
        fused_backend=fused_backend, packed_qkv=resolve_packed(args.ulysses_packed_qkv, fused_backend,
                                                               packed_samples=args.pack_samples,
                                                               sparse=sparse is not None)))
    impl = args.ddp_impl if args.ddp_impl != "auto" else ("megatron" if device.type == "cuda" else "torch")
    if args.use_torch_fsdp2:
        impl = "fsdp2"
    if impl == "torch" and (args.bf16_params or args.use_distributed_optimizer or args.overlap_grad_reduce
                            or args.grad_reduce_in_bf16):
        raise SPConfigError("--bf16-params / --use-distributed-optimizer / --overlap-grad-reduce / --grad-reduce-in-bf16 "
                         f"need megatron's DDP, which needs CUDA (this run uses --ddp-impl torch on {device})")
    if impl == "megatron":
        model, opt = _megatron_ddp(model, cfg, args)
    elif impl == "fsdp2":
        model = shard_model(model, dp_cp_group, device, bf16=args.bf16 and device.type == "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                foreach=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                fused=device.type == "cuda" or None)
    start, loaded = 0, None
    if args.load:
        loaded = ckpt.load(args.load, model, opt, _ckpt_identity(args))
        start = ckpt.check_resume_step(loaded, args.train_iters)
        if rank == 0 and not args.quiet:
            print(f"[pretrain_video_dit] resumed from {loaded['path']} (step {start}) in {loaded['seconds']:.2f}s",
                  flush=True)
    global_batch = dp_world * args.micro_batch_size
    base, note = (0, None) if args.pack_samples else resume_base(loaded, start, global_batch)
    if note and rank == 0:
        logger.warning(note)
    dataset = build_dataset(args, cfg)
    plan = make_pack_plan(args, dataset, cfg, sp_world, first_sample(loaded, start, global_batch), start)
    if not args.quiet:
        logger.info(f"model={args.model} layers={cfg.layers} CP={sp_world} DP={dp_world} "
                    f"cp_comm_type={args.cp_comm_type[0]} head_chunks={args.hcms_head_chunks} "
                    f"async_qkv={args.sp_async_qkv} ddp={impl} dist_opt={args.use_distributed_optimizer} "
                    f"recompute={args.recompute_granularity} device={device}"
                    + (f" sparse_attention=tiles {sparse} kernel={args.sparse_attention_kernel}"
                       if sparse is not None else "")
                    + (f" pack_samples max_tokens_per_step={args.max_tokens_per_step}" if plan else "")
                    + (f" dynamic_context_parallel min_size={args.min_dynamic_context_parallel_size}"
                       if dynamic else ""))
    if rank == 0 and not args.quiet:  # before the progress bar starts, not inside it
        logger.info(attention_kernel_line(args.sp_attention_backend, "--sp-attention-backend", device,
                                          run_dtype(args, device), cfg.head_dim,
                                          tile_setting=args.sparse_attention_kernel if sparse is not None else None,
                                          tile_setting_name=SPARSE_KERNEL_FLAG))
    log = MetricsLog(args.log_dir, args.train_iters, rank == 0, cfg, device, start, show=not args.quiet,
                     group=dist.group.WORLD if dist.is_initialized() else None)
    autocast = torch.bfloat16 if (args.bf16 and device.type == "cuda") else None
    ops = MegatronOps(model, opt) if impl == "megatron" else FsdpOps(model, opt, args.clip_grad) \
        if impl == "fsdp2" else TorchOps(model, opt, dp_cp_group, args.clip_grad)
    ctx = RunContext(sp_rank, sp_world, dp_rank, dp_world, rank, dist.get_world_size())
    position = lambda s: {"consumed_samples": plan.consumed_samples(s, dp_world) if plan else  # noqa: E731
                          consumed_samples(s, base, global_batch), "global_batch": global_batch}
    losses = train_loop(args, ops, dataset, cfg, ctx, device, log, start=start, autocast=autocast, sample_base=base,
                        save=lambda s: _save(args, s, model, opt, rank, position(s)), pack_plan=plan,
                        dynamic=dynamic)
    # the last step is saved unless the interval saved it, or no step ran (the loaded checkpoint is the end)
    interval_saved = bool(args.save_interval) and args.train_iters % args.save_interval == 0
    if args.save and start < args.train_iters and not interval_saved:
        _save(args, args.train_iters, model, opt, rank, position(args.train_iters))
    plot = log.close(f"video DiT ({args.model}), CP={sp_world} {args.cp_comm_type[0]}")
    if not args.quiet and losses:
        logger.info(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; "
                    f"metrics: {args.log_dir}/metrics.jsonl; plot: {plot}")
    if args.sample_steps:  # FSDP2 with --bf16 holds bf16 compute weights and casts no inputs: it needs the autocast
        with torch.autocast(device.type, dtype=autocast, enabled=impl == "fsdp2" and autocast is not None):
            write_demo_samples(model.module if impl == "megatron" else model, dataset, steps=args.sample_steps,
                               seed=args.seed, group=cp_group if sp_world > 1 else None, device=device,
                               log_dir=args.log_dir)
    out = {"losses": losses, "plot": plot, "rows": log.rows, "timing": getattr(log, "timing", None)}
    if return_params:
        out["params"] = full_parameters(model.module if impl == "megatron" else model)
    return out


def _megatron_ddp(model, cfg, args):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: PLC0415
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: PLC0415
    from megatron.core.transformer import TransformerConfig  # noqa: PLC0415
    tcfg = TransformerConfig(num_layers=cfg.layers, hidden_size=cfg.dim, num_attention_heads=cfg.heads,
                             context_parallel_size=args.context_parallel_size, bf16=args.bf16)
    if args.bf16_params:  # Megatron-LM's --bf16: bf16 weights, fp32 main weights + Adam state in the optimizer
        model = model.to(torch.bfloat16)
    ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16, overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                                                 adam_beta1=0.9, adam_beta2=0.95, clip_grad=args.clip_grad,
                                                 bf16=args.bf16_params,
                                                 params_dtype=torch.bfloat16 if args.bf16_params else torch.float32,
                                                 use_distributed_optimizer=args.use_distributed_optimizer), [ddp])
    _fuse_torch_adam(opt)
    return ddp, opt


def _fuse_torch_adam(opt) -> None:
    """Without Transformer Engine / apex, megatron-core steps torch's AdamW with its default (foreach) kernels:
    switch its groups to the fused kernel (set before the first step, when the state is created)."""
    from megatron.core import optimizer as mopt  # noqa: PLC0415
    if not getattr(mopt, "USING_PYTORCH_OPTIMIZER", False):
        return
    for g in opt.param_groups:
        if "fused" in g and all(p.is_cuda and p.is_floating_point() for p in g["params"]):
            g["fused"], g["foreach"] = True, False


if __name__ == "__main__":
    sys.exit(run_entry(main, "pretrain_video_dit"))
