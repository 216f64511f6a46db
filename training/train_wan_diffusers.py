r"""Train diffusers' WanTransformer3DModel (Wan 2.1 T2V / I2V, Wan 2.2 TI2V-5B and one A14B expert) with
megatron_sp_ext's sequence parallelism (``megatron_sp_ext.diffusers.parallelize``), FSDP2 beside it, and Wan's
flow-matching objective: full fine-tuning, or LoRA (--lora-rank R: diffusers' adapter API, peft).

    torchrun --nproc-per-node 2 training/train_wan_diffusers.py --init random --model wan-1.3b \
        --context-parallel-size 2 --cp-comm-type auto --use-torch-fsdp2 --bf16 --recompute-granularity full \
        --frames 21 --latent-size 60x104 --train-iters 100 --save ck --save-interval 50 --log-dir runs/wan \
        --save-pretrained runs/wan/final

Model: ``--init PATH`` (a local directory in diffusers' layout, from_pretrained: config.json + safetensors, or a Wan
pipeline directory with transformer/, and for Wan 2.2 A14B's low-noise expert transformer_2/) or ``--init random
--model PRESET`` (training/wan_diffusers/model.py: wan-1.3b, wan-14b, wan2.1-i2v-14b, wan2.2-ti2v-5b, wan2.2-a14b,
wan2.2-i2v-a14b and tiny CPU versions; --num-layers shortens them). The task (--task t2v|i2v|ti2v, default: the
preset's or the pipeline's) and the expert (--expert high|low, on its side of the pipeline's boundary_ratio):
training/wan_diffusers/task.py. Weights stay fp32 (a LoRA run with --bf16 on one GPU without FSDP2 keeps its frozen
base in bf16, its adapters fp32); --bf16 runs the step under bf16 autocast (CUDA, refused on the CPU; with FSDP2 its bf16
compute weights). --recompute-granularity full turns on diffusers' gradient checkpointing (per block); selective recomputes
every block but its self-attention (megatron_sp_ext.diffusers.keep_attention_checkpointing). LoRA (--lora-rank,
--lora-alpha, --lora-target-modules): only the adapters train and go into checkpoints; --save-lora DIR writes them
for WanPipeline.load_lora_weights (training/wan_diffusers/lora.py). --fused-elementwise on (or auto: on CUDA without FSDP2;
default off) compiles each block so its elementwise work runs fused (megatron_sp_ext.diffusers.fuse_elementwise).
Data: --data-path (latent files, "latent" [C, F, H, W] and "text" [L, 4096], with "cond_latent" / "image_embeds"
for I2V and TI2V) or synthetic latents of --frames x --latent-size. Objective: training/wan_diffusers/flow.py
(x_t = (1 - t) x0 + t eps, target eps - x0, Wan's timestep shift --timestep-shift). Gradients over SP ranks:
training/wan_diffusers/loop.py.
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
from training.video_dit.fused import FUSED_CHOICES, resolve_fused  # noqa: E402
from training.video_dit.loop import TorchOps, resolve_workers  # noqa: E402
from training.video_dit.sharding import FsdpOps, full_parameters, shard_model  # noqa: E402
from training.wan_diffusers import lora as wan_lora  # noqa: E402
from training.wan_diffusers import model as wan  # noqa: E402
from training.wan_diffusers import task as wan_task  # noqa: E402
from training.wan_diffusers import validate  # noqa: E402
from training.wan_diffusers.loop import Layout, StepForm, StepHooks, train_steps  # noqa: E402

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
    model_flag = next(a for a in p._actions if a.dest == "model")
    model_flag.choices = list(wan.WAN_PRESETS)
    model_flag.help = "with --init random: the preset (training/wan_diffusers/model.py)"
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
    g.add_argument("--task", choices=list(wan_task.TASKS), default=None,
                   help="t2v, i2v (Wan 2.1 I2V / Wan 2.2 I2V A14B: mask + cond_latent channels, CLIP image_embeds "
                        "where the model has an image branch) or ti2v (Wan 2.2 TI2V-5B: the first latent frame is "
                        "the clean cond_latent, per-token timesteps, left out of the loss); default: the preset's or "
                        "the --init pipeline's")
    g.add_argument("--expert", choices=list(wan_task.EXPERTS), default=None,
                   help="Wan 2.2 A14B: train the high-noise expert (transformer/, timesteps >= boundary_ratio x "
                        "1000) or the low-noise one (transformer_2/, below)")
    g.add_argument("--boundary-ratio", type=float, default=None,
                   help="with --expert: the boundary between the experts (default: the pipeline's / preset's "
                        "boundary_ratio; 0.875 for Wan 2.2 T2V A14B, 0.9 for I2V A14B)")
    g = p.add_argument_group("LoRA (diffusers' adapter API, peft)")
    g.add_argument("--lora-rank", type=int, default=0,
                   help="R > 0: train LoRA adapters of rank R on --lora-target-modules, the base frozen (0: full "
                        "fine-tuning)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (the update scales by alpha / rank; "
                   "default: the rank)")
    g.add_argument("--lora-target-modules", default=None,
                   help=f"comma list of module names to adapt (default: {','.join(wan_lora.DEFAULT_TARGETS)}: the "
                        f"self- and cross-attention's and the FFN's linears)")
    g.add_argument("--save-lora", default=None, metavar="DIR",
                   help="after training, write the adapters for WanPipeline.load_lora_weights(DIR) "
                        "(pytorch_lora_weights.safetensors with its LoraConfig)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--context-parallel-size", type=int, default=1, help="sequence-parallel (context) ranks per group")
    g.add_argument("--cp-comm-type", default="auto", choices=list(MODES),
                   help="megatron_sp_ext's sequence-parallel mode of every self-attention")
    g.add_argument("--hcms-head-chunks", type=_chunks, default=1, help="HCMS head chunks (int or 'auto')")
    g.add_argument("--sp-attention-backend", default="auto", choices=list(BACKENDS), help="local attention kernel")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="torch FSDP2 (fully_shard per transformer block + root) over all data x context ranks: "
                        "fp32 main weights, bf16 compute with --bf16 (reduce in fp32)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: diffusers' gradient checkpointing (enable_gradient_checkpointing: every block); "
                        "selective: every block recomputed but its self-attention, whose output (and log-sum-exp) "
                        "is kept (megatron_sp_ext.diffusers.keep_attention_checkpointing)")
    g.add_argument("--fused-elementwise", choices=list(FUSED_CHOICES), default="off",
                   help="compile each block (diffusers' compile_repeated_blocks, Inductor) so its elementwise work "
                        "(norms, AdaLN modulation, gated residuals, QK-norm, RoPE, GELU, casts) runs fused around "
                        "the GEMMs and the attention (megatron_sp_ext.diffusers.fuse_elementwise); auto = on CUDA "
                        "without --use-torch-fsdp2; default off (diffusers' own eager numerics)")
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
    g.add_argument("--plan-memory", action="store_true",
                   help="print the per-GPU memory plan of these flags (training/wan_diffusers/memory_plan.py: "
                        "--model, or the preset of --init DIR's config.json, the largest --frames x --latent-size, --context-parallel-size, "
                        "--recompute-granularity, --lora-rank, --use-torch-fsdp2, WORLD_SIZE ranks) and exit "
                        "without building the model")
    validate.add_args(p)
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
    if args.lora_rank < 0:
        p.error(f"--lora-rank={args.lora_rank}: must be >= 0 (0: full fine-tuning)")
    if not args.lora_rank:
        for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-target-modules", args.lora_target_modules),
                            ("--save-lora", args.save_lora)):
            if value is not None:
                p.error(f"{flag} applies to LoRA runs: add --lora-rank R (R > 0)")
    else:
        if args.lora_alpha is not None and args.lora_alpha <= 0:
            p.error(f"--lora-alpha={args.lora_alpha}: must be > 0")
        if args.save_pretrained:
            p.error(f"--save-pretrained writes a whole transformer; a LoRA run (--lora-rank {args.lora_rank}) writes "
                    f"its adapters with --save-lora DIR (WanPipeline.load_lora_weights reads them)")
        try:
            args.lora_target_modules = wan_lora.parse_targets(args.lora_target_modules) \
                if args.lora_target_modules is not None else wan_lora.DEFAULT_TARGETS
        except SPConfigError as e:
            p.error(str(e))
    if args.fused_elementwise == "on" and args.use_torch_fsdp2:
        p.error("--fused-elementwise on with --use-torch-fsdp2: compiling blocks that FSDP2 shards (its hooks inside "
                "the compiled call) is not supported here; use --fused-elementwise off or auto (off with FSDP2)")
    if modes.head_chunks_of(args.cp_comm_type, args.hcms_head_chunks) != args.hcms_head_chunks:
        p.error(f"--hcms-head-chunks={args.hcms_head_chunks} is HCMS's: use --cp-comm-type hcms (or auto)")
    try:
        validate.settings_from_args(args)
    except SPConfigError as e:
        p.error(str(e))
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


def main(argv: Optional[list] = None, return_params: bool = False, grads_at: Optional[int] = None,
         dtype: Optional[torch.dtype] = None) -> dict:
    """Train; returns losses, plot, rows (and with ``return_params`` "params": name -> full fp32 tensor; with
    ``grads_at`` = a step, "grads": that step's reduced full gradients; ``dtype``: the model and its batches in
    this dtype, e.g. float64; collective, for tests)."""
    args = parse(argv)
    if args.plan_memory:
        print_memory_plan(args)
        return {}
    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own_pg = _init_process_group(device, args.distributed_timeout_minutes)
    setup_logging(args.log_level, dist.get_rank())
    try:
        with report_failures(WHAT):
            check_bf16_device(args, device)
            return _train(args, device, return_params, grads_at, dtype)
    finally:
        if own_pg:
            dist.destroy_process_group()


def print_memory_plan(args: argparse.Namespace) -> None:
    """--plan-memory: the memory plan (training/wan_diffusers/memory_plan.py) of the parsed flags, printed on rank 0;
    SPConfigError naming the flag it cannot plan."""
    from training.wan_diffusers import memory_plan  # noqa: PLC0415
    model = args.model if args.init == "random" else memory_plan.preset_of_config(args.init)
    if not args.bf16:
        raise SPConfigError("--plan-memory plans the GPU run, bf16 autocast (a LoRA base in bf16): add --bf16")
    frames, sizes = frames_and_sizes(args)
    tokens = max(memory_plan.grid_tokens(model, f, h, w) for f in frames for (h, w) in sizes)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    plan = memory_plan.plan(memory_plan.PlanInput(
        model, tokens, sp=args.context_parallel_size, recompute=args.recompute_granularity or "none",
        lora_rank=args.lora_rank, layers=args.num_layers, fsdp2=args.use_torch_fsdp2, gpus=world))
    if int(os.environ.get("RANK", "0") or 0) == 0:
        memory_plan.print_plan(plan)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _check_tokens(args, cfg, sp: int, task) -> None:
    frames, sizes = frames_and_sizes(args)
    pt, ph, pw = cfg.patch
    for f in frames:
        if task.task == "ti2v" and f < 2:
            raise SPConfigError(f"--frames {f}: --task ti2v conditions on the first latent frame and learns the "
                                f"others: give at least 2 latent frames")
        for h, w in sizes:
            if f % pt or h % ph or w % pw:
                raise SPConfigError(f"--frames {f} --latent-size {h}x{w}: not a multiple of the patch {cfg.patch}")
            n = (f // pt) * (h // ph) * (w // pw)
            if n % sp:
                raise SPConfigError(f"--frames {f} --latent-size {h}x{w}: {n} tokens do not divide by "
                                    f"--context-parallel-size={sp} (the model's split needs equal shards)")


def _check_data_tokens(args, dataset, cfg, sp: int, task) -> None:
    """--data-path: every clip's token count (latent [C, T, H, W] / the patch, from the file headers) divides by
    ``sp``; a TI2V clip has at least 2 latent frames."""
    pt, ph, pw = cfg.patch
    for i in range(len(dataset)):
        (_, t, h, w), _ = dataset.shape_of(i)
        if task.task == "ti2v" and t < 2:
            raise SPConfigError(f"--data-path {args.data_path}: {dataset.files[i]} has {t} latent frame(s); --task "
                                f"ti2v conditions on the first and learns the others: it needs at least 2")
        n = (t // pt) * (h // ph) * (w // pw)
        if n % sp:
            raise SPConfigError(f"--data-path {args.data_path}: {dataset.files[i]} (latent T x H x W = {t}x{h}x{w}) "
                                f"has {n} tokens, which do not divide by --context-parallel-size={sp} (the model's "
                                f"split needs equal shards)")


def _data_reasons(task) -> dict:
    """{tensor: why this run needs it} for the data loader's refusal by file name."""
    why = {"ti2v": "--task ti2v conditions on (the first frame's latent; --task t2v trains without it)",
           "i2v": "--task i2v conditions on (the first frame's latent beside the mask)"}
    out = {"cond_latent": why.get(task.task, "")}
    if "image_embeds" in task.data_keys():
        out["image_embeds"] = "this I2V model's CLIP image branch reads (encoder_hidden_states_image)"
    return {k: v for k, v in out.items() if k in task.data_keys()}


def _build_model(args, device):
    """(model, preset name or "pretrained", task) of --init / --model and --task / --expert."""
    sub = "transformer_2" if args.expert == "low" else "transformer"
    if args.init == "random":
        model = wan.random_model(wan.preset_kwargs(args.model, args.num_layers), args.seed, device)
        preset, known, pipeline = args.model, wan.PRESET_TASKS[args.model], {}
    else:
        model = wan.load_model(args.init, device, sub)
        preset, known, pipeline = ckpt.PRETRAINED, None, wan.pipeline_config(args.init)
    task = wan_task.resolve(args.task, args.expert, args.boundary_ratio, known, pipeline, model.config)
    return model, preset, task


def _train(args, device, return_params: bool, grads_at: Optional[int], dtype: Optional[torch.dtype] = None) -> dict:
    sp = args.context_parallel_size
    lay, sp_group = make_layout(sp, device)
    model, preset, task = _build_model(args, device)
    if dtype is not None:
        model = model.to(dtype)
    text_len = args.text_len or wan.TEXT_LEN.get(preset, 512)
    cfg = wan.dit_config(model.config, text_len)
    dataset = build_dataset(args, cfg, require=_data_reasons(task))
    if args.data_path:
        _check_data_tokens(args, dataset, cfg, sp, task)
    else:
        _check_tokens(args, cfg, sp, task)
        if task.data_keys():
            dataset = wan_task.SyntheticConditions(dataset, task, wan.IMAGE_TOKENS.get(preset, 257),
                                                   model.config.image_dim, args.seed)
    lora = None
    if args.lora_rank:   # before parallelize: the sparse plan's gates, attached there, stay trainable
        lora = wan_lora.LoraSettings(args.lora_rank, args.lora_alpha or float(args.lora_rank),
                                     tuple(args.lora_target_modules))
        adapted = wan_lora.add_lora(model, lora, args.seed + 1)
        if dtype is not None:
            model = model.to(dtype)
        if args.bf16 and device.type == "cuda" and not args.use_torch_fsdp2:
            wan_lora.base_to_bf16(model)
        if not args.quiet:
            logger.info(f"LoRA rank {lora.rank} alpha {lora.alpha:g} on {adapted} linears "
                        f"({','.join(lora.targets)}): {sum(p.numel() for p in model.parameters() if p.requires_grad):,}"
                        f" trainable parameters")
    if args.recompute_granularity == "full":
        model.enable_gradient_checkpointing()
    plan = sparse_plan(args)
    handle = None
    # dense SP=1 runs diffusers' own model as it is (the reference); keeping the attention needs our processors
    if sp > 1 or plan is not None or args.recompute_granularity == "selective":
        from megatron_sp_ext.diffusers import keep_attention_checkpointing, parallelize  # noqa: PLC0415
        sp_cfg = SPConfig(mode=args.cp_comm_type,
                          head_chunks=modes.head_chunks_of(args.cp_comm_type, args.hcms_head_chunks),
                          backend=args.sp_attention_backend, source="megatron")
        handle = parallelize(model, sp_group, config=sp_cfg, sparse=plan)
        if args.recompute_granularity == "selective":
            keep_attention_checkpointing(handle)
        if dtype is not None:   # the sparse plan's gates
            model = model.to(dtype)
    gates = plan is not None and any(".sparse_gate." in n for n, _ in model.named_parameters())
    if gates and args.init != "random":   # a top-k model saved by --save-pretrained carries its gates beside it
        root, sub = wan.pretrained_dir(args.init, "transformer_2" if args.expert == "low" else "transformer")
        folder = os.path.join(root, sub or "")
        if wan.gate_names(folder):
            plan.load_gates(model, folder)
        else:
            logger.info(f"--init {args.init} has no sparse gates: they start at zero (the model's fine block-sparse "
                        f"attention alone)")
    fused_backend = None if args.use_torch_fsdp2 else resolve_fused(args.fused_elementwise, device)
    if fused_backend is not None:   # after parallelize, checkpointing and LoRA (any order works)
        from megatron_sp_ext.diffusers import fuse_elementwise  # noqa: PLC0415
        fuse_elementwise(model, fused_backend)
    world_group = dist.group.WORLD if lay.world > 1 else None
    if args.use_torch_fsdp2:
        model = shard_model(model, dist.group.WORLD, device, bf16=args.bf16 and device.type == "cuda")
    opt = torch.optim.AdamW(wan_lora.trainable(model), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                            foreach=True if args.use_torch_fsdp2 else None,
                            fused=(device.type == "cuda" and not args.use_torch_fsdp2) or None)
    ops = FsdpOps(model, opt, args.clip_grad) if args.use_torch_fsdp2 else TorchOps(model, opt, world_group,
                                                                                   args.clip_grad)
    run_id = {**wan.identity(model.config, preset, sparse_gates=gates), "task": task.describe(),
              "lora": wan_lora.lora_identity(lora)}
    start, loaded = 0, None
    if args.load:
        loaded = ckpt.load(args.load, model, opt, run_id, trainable_only=lora is not None)
        start = ckpt.check_resume_step(loaded, args.train_iters)
        if lay.rank == 0 and not args.quiet:
            print(f"[{WHAT}] resumed from {loaded['path']} (step {start})", flush=True)
    if not args.quiet:
        logger.info(f"Wan ({'random ' + args.model if args.init == 'random' else args.init}) task={task.task}"
                    + (f" expert={task.expert} (t {'>=' if task.expert == 'high' else '<'} {task.boundary:g})"
                       if task.expert else "") + f" {'LoRA' if lora else 'full'} layers={cfg.layers} "
                    f"SP={sp} DP={lay.dp_world} cp_comm_type={args.cp_comm_type} "
                    f"{'fsdp2' if args.use_torch_fsdp2 else 'all-reduce'} recompute={args.recompute_granularity} "
                    f"fused_elementwise={'on' if fused_backend is not None else 'off'} "
                    f"bf16={args.bf16 and device.type == 'cuda'} device={device}"
                    + (f" sparse={sparse_spec(args)}" if plan is not None else ""))
    metrics = MetricsLog(args.log_dir, args.train_iters, lay.rank == 0, cfg, device, start, show=not args.quiet,
                         group=dist.group.WORLD if dist.is_initialized() else None)
    form = StepForm(torch.bfloat16 if (args.bf16 and device.type == "cuda") else None, task, dtype)
    global_batch = lay.dp_world * args.micro_batch_size

    def save(step: int) -> None:
        out = ckpt.save(args.save, step, model, opt, {**run_id, "consumed_samples": step * global_batch,
                                                       "global_batch": global_batch, "init": args.init,
                                                       "layout": {"context_parallel_size": sp,
                                                                  "cp_comm_type": args.cp_comm_type}},
                        args.keep_last, trainable_only=lora is not None)
        if lay.rank == 0 and not args.quiet:
            print(f"[{WHAT}] saved {out['path']} in {out['seconds']:.2f}s", flush=True)

    grads = {}

    def on_grads(step: int) -> None:
        if step == grads_at:
            grads.update({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})

    validator = validate.from_args(args, model, device, rank=lay.rank, sp_size=sp, autocast=form.autocast)
    hooks = StepHooks(save=save, on_grads=on_grads if grads_at is not None else None, after_step=validator)
    losses = train_steps(args, ops, model, dataset, cfg, lay, device, metrics, start=start, form=form, hooks=hooks,
                         workers=resolve_workers(args, device))
    if validator is not None:
        validator.final(args.train_iters)
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
    if args.save_lora:
        wrote = wan_lora.save_lora(model, args.save_lora, lay.rank)
        if lay.rank == 0 and not args.quiet:
            how = "pipe.load_lora_weights(DIR" + (", load_into_transformer_2=True)" if task.expert == "low" else ")")
            logger.info(f"saved {wrote['adapters']} LoRA tensors to {args.save_lora} ({how} reads them)"
                        + (f"; the sparse plan's {len(wrote['extra'])} gates beside them" if wrote["extra"] else ""))
    out = {"losses": losses, "plot": plot, "rows": metrics.rows}
    if return_params:
        out["params"] = full_parameters(model)
    if grads_at is not None:
        out["grads"] = grads
    return out


if __name__ == "__main__":
    sys.exit(run_entry(main, WHAT))
