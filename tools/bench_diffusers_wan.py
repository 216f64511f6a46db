r"""Training-step benchmark of diffusers' WanTransformer3DModel under sequence parallelism: diffusers' OWN context
parallelism against megatron_sp_ext's (``megatron_sp_ext.diffusers.parallelize``), one torchrun job, one rank per GPU.

    torchrun --nproc-per-node 2 tools/bench_diffusers_wan.py --grid 480p \
        --variants diffusers-ulysses,diffusers-ring,ours-auto,ours-ulysses,ours-hcms,ours-ring,ours-auto-window90 \
        --out results/diffusers_wan/480p.json

Each variant builds the same model (--model, default wan-1.3b at full depth; weights fp32 from --seed), bf16
autocast, diffusers' gradient checkpointing (every block; ``--recompute none``: off for every variant of the job,
the one way diffusers' ring CP runs: its ring backward unpacks its saved tensors once per ring step, which torch's
checkpoint refuses), then times --steps training steps after --warmup ones on
one fixed synthetic batch (Wan's flow-matching loss, training/wan_diffusers/flow.py; AdamW; gradients all-reduced
over the ranks with the SP sum, training/wan_diffusers/loop.py): step_ms = median over steps of CUDA-event time,
max over ranks. MFU = model FLOPs (DiTConfig.flops_per_token: Wan's block, recomputation not counted) / (step time x
world x 989 TFLOP/s); peak_mem_gib = max over ranks of torch.cuda.max_memory_allocated over the variant's whole
run (its build, warmup steps with auto's first-call trials, timed steps); peak_steady_gib = the same over the timed
steps alone (the peak reset after the warmup).

--targets: issue 86's targets on one GPU, one job: ``TARGET_CASES`` (wan-1.3b at full depth, 720p x 81 frames:
stock diffusers' checkpointed step vs ours with full checkpointing, with the attention kept, with top-k90 64-token
tiles; LoRA rank 32 of wan-14b at 480p and 720p, bf16 base weights and fp32 adapters, stock diffusers + peft vs ours;
the fastest rows again with every block compiled, @fused=on, and stock compiled beside them),
each case's rows and every target's ratio to the case's stock step in one JSON (``--targets-case NAME`` runs one case;
``--dry-run`` the same cases on the tiny model). A variant that runs out of GPU memory is recorded as such (one-rank
jobs), the next one built afresh.

Variants (comma list): ``stock``: diffusers' model as it is, no sequence parallelism (one-rank jobs): diffusers'
own attention. ``diffusers-ulysses`` / ``diffusers-ring``: model.enable_parallelism(config=
ContextParallelConfig(ulysses_degree=P | ring_degree=P)) with model.set_attention_backend(B), B = --diffusers-backend
or, with "auto", the first of _native_cudnn, flash, native whose step runs (each refusal recorded); name one as
``diffusers-ring@native``. ``ours-<mode>`` (auto, ulysses, hcms, ring, tasp, usp, ...): parallelize(model, group,
mode=<mode>). A sparse variant adds ``-window90`` / ``-topk90`` (the window nearest 0.9 sparsity / K = 10% of the
tiles of the grid, --sparse-tile) or explicit ``-window=t.h.w`` / ``-topk=K``: each variant carries its own sparse
settings, dense and sparse in one job. Options after ``@`` (several allowed): ``@rope=R`` (ours), ``@recompute=R``
(stock and ours; R: full, none, or for ours keep / keepN: every block recomputed but its self-attention, in all blocks
or the first N: megatron_sp_ext.diffusers.keep_attention_checkpointing; default --recompute), ``@lora=R`` (stock and
ours: diffusers' add_adapter of a rank-R LoRA on Wan's attention and FFN linears, alpha R, only the adapters
trained; on CUDA the frozen base weights in bf16, the adapters fp32), ``@fused=on`` (stock and ours: every block
compiled, megatron_sp_ext.diffusers.fuse_elementwise, Inductor; on the CPU stand-in "aot_eager"; a fresh compile per
variant, paid in its warmup: row's fused_backend; warmup_ms: every row's warmup steps, this rank's times).
--curves N: instead of timing, N training steps (fresh synthetic samples each step, same seed and data for both) of
ours-auto and diffusers' CP (the first diffusers variant of --variants, default diffusers-ulysses, on its first
backend that runs), bf16, losses to <out>_curves.json and <out>_curves.png.
--dry-run: CPU stand-in (tiny config, gloo, a 4x8x8 latent, 2 steps); diffusers' own CP is skipped there with its
reason (it needs an accelerator). Rows carry machine, date, commit and the command.
--ranks-share-gpu: every rank on GPU 0 over gloo (a one-GPU machine): our variants' peaks and their attribution
per rank, no speed (rows carry timing_note, MFU None); diffusers' CP is skipped there with its reason.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import sys
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sp_ext import modes  # noqa: E402
from megatron_sp_ext.config import MODES, SPConfig  # noqa: E402
from megatron_sp_ext.diffusers.parallelize import ROPE_CHOICES  # noqa: E402
from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from tools.benchlib import AutoDecisions, init_world, plot_or_skip, run_meta, write_json  # noqa: E402
from training.video_dit.faults import on_rank0  # noqa: E402
from training.video_dit.loop import TorchOps  # noqa: E402
from training.video_dit.telemetry import peak_flops  # noqa: E402
from training.wan_diffusers import model as wan  # noqa: E402
from training.wan_diffusers.flow import WanStepBatches, flow_loss, shift_timestep  # noqa: E402

SHARED_GPU_NOTE = ("--ranks-share-gpu: every rank on one GPU over gloo, exchanges through host memory: step_ms is "
                   "not the method's speed; peak memory per rank is")
SHARED_GPU_DIFFUSERS = ("not with --ranks-share-gpu: diffusers' CP gathers proj_out through torch's functional "
                        "collectives, which crashed (SIGSEGV in wait_tensor) over gloo with CUDA tensors on "
                        "2026-11-28 (torch 2.11); run it one rank per GPU")
DRY_GRID = (4, 8, 8)
DIFFUSERS_BACKENDS = ("_native_cudnn", "flash", "native")   # "auto" tries them in this order
DEFAULT_VARIANTS = "diffusers-ulysses,diffusers-ring,ours-auto,ours-ulysses,ours-hcms,ours-ring"
STOCK_ONE_RANK = ("stock diffusers has no sequence parallelism: every rank would train the whole sequence; time it in "
                  "a one-rank job")
NO_ACCELERATOR = ("diffusers' context parallelism needs an accelerator: enable_parallelism builds its mesh over "
                  "torch.accelerator.device_count() devices, and this run has none (CPU)")


RECOMPUTE_CHOICES = ("full", "none")   # --recompute; a variant's @recompute= also takes keep / keepN (ours)


def _options(name: str, text: str, allowed: tuple) -> dict:
    """``@k=v@k=v`` options of variant ``name`` -> {k: v}; SPConfigError naming --variants for anything else."""
    out = {}
    for item in [t for t in text.split("@") if t] if text else []:
        key, eq, value = item.partition("=")
        if not eq or key not in allowed or key in out:
            raise SPConfigError(f"--variants {name!r}: options are @k=v with k one of {', '.join(allowed)} (each once)")
        out[key] = value
    return out


def _recompute(name: str, value: Optional[str], ours: bool) -> Optional[str]:
    if value is None:
        return None
    keep = ours and (value == "keep" or (value.startswith("keep") and value[4:].isdigit()))
    if value not in RECOMPUTE_CHOICES and not keep:
        raise SPConfigError(f"--variants {name!r}: @recompute= takes full or none"
                            + (", keep or keepN (the attention kept in the first N blocks)" if ours else ""))
    return value


def _lora(name: str, value: Optional[str]) -> Optional[int]:
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise SPConfigError(f"--variants {name!r}: @lora= takes a rank >= 1")
    return int(value)


FUSED_CHOICES = ("on", "off")   # a variant's @fused=


def _fused(name: str, value: Optional[str]) -> bool:
    if value is not None and value not in FUSED_CHOICES:
        raise SPConfigError(f"--variants {name!r}: @fused= takes on or off")
    return value == "on"


def parse_variant(name: str) -> dict:
    """``stock[@recompute=R][@lora=R][@fused=F]``, ``diffusers-<ulysses|ring>[@backend]`` or
    ``ours-<mode>[-window90|-topk90|-window=t.h.w|-topk=K][@rope=R][@recompute=R][@lora=R][@fused=F]`` -> a dict
    (impl, mode, backend, sparse, rope, recompute, lora, fused). SPConfigError naming --variants otherwise."""
    impl, _, rest = name.partition("-")
    if name == "stock" or name.startswith("stock@"):
        opts = _options(name, name[len("stock"):], ("recompute", "lora", "fused"))
        return {"name": name, "impl": "stock", "mode": None, "backend": None, "sparse": None,
                "recompute": _recompute(name, opts.get("recompute"), False), "lora": _lora(name, opts.get("lora")),
                "fused": _fused(name, opts.get("fused"))}
    if impl == "diffusers":
        mode, _, backend = rest.partition("@")
        if mode not in ("ulysses", "ring") or (backend and backend not in DIFFUSERS_BACKENDS):
            raise SPConfigError(f"--variants {name!r}: diffusers' variants are diffusers-ulysses and diffusers-ring, "
                                f"optionally @backend ({', '.join(DIFFUSERS_BACKENDS)})")
        return {"name": name, "impl": impl, "mode": mode, "backend": backend or "auto", "sparse": None,
                "recompute": None, "lora": None, "fused": False}
    if impl == "ours":
        rest, at, option = rest.partition("@")
        opts = _options(name, at + option, ("rope", "recompute", "lora", "fused"))
        rope = opts.get("rope")
        if rope is not None and rope not in ROPE_CHOICES:
            raise SPConfigError(f"--variants {name!r}: ours- variants take @rope=R, R one of {', '.join(ROPE_CHOICES)}")
        mode, _, sparse = rest.partition("-")
        if mode not in MODES:
            raise SPConfigError(f"--variants {name!r}: ours-<mode> takes a mode of {', '.join(MODES)}")
        spec = None
        if sparse:
            kind, _, value = sparse.partition("=")
            if sparse in ("window90", "topk90"):
                spec = {"kind": sparse[:-2], "target": 0.9}
            elif kind == "window" and len(value.split(".")) == 3 and all(v.isdigit() for v in value.split(".")):
                spec = {"kind": "window", "window": tuple(int(v) for v in value.split("."))}
            elif kind == "topk" and value.isdigit() and int(value) > 0:
                spec = {"kind": "topk", "topk": int(value)}
            else:
                raise SPConfigError(f"--variants {name!r}: a sparse suffix is -window90, -topk90, -window=t.h.w or "
                                    f"-topk=K")
        return {"name": name, "impl": impl, "mode": mode, "backend": None, "sparse": spec, "rope": rope or "fused",
                "recompute": _recompute(name, opts.get("recompute"), True), "lora": _lora(name, opts.get("lora")),
                "fused": _fused(name, opts.get("fused"))}
    raise SPConfigError(f"--variants {name!r}: a variant is stock, or starts with diffusers- or ours- (e.g. "
                        f"{DEFAULT_VARIANTS})")


def sparse_settings(spec: Optional[dict], grid: tuple, tile: tuple) -> Optional[dict]:
    """The tile, top-k K or window of a sparse variant on ``grid`` (tokens after the patch), and its sparsity."""
    if spec is None:
        return None
    from training.video_dit.sparse import num_tiles_of, window_tile_mask  # noqa: PLC0415
    n_tiles = num_tiles_of(grid, tile)
    out = {"tile": list(tile), "n_tiles": n_tiles}
    if spec["kind"] == "topk":
        k = spec.get("topk") or max(1, round((1.0 - spec["target"]) * n_tiles))
        out.update(topk=k, window=None, sparsity=1.0 - k / n_tiles)
    else:
        w = spec.get("window")
        if w is None:
            from tools.bench_block_sparse import window_for_sparsity  # noqa: PLC0415
            w = window_for_sparsity(grid, tile, spec["target"])
        out.update(topk=None, window=list(w), sparsity=1.0 - float(window_tile_mask(grid, tile, tuple(w)).float()
                                                                     .mean()))
    return out


def make_plan(settings: dict):
    from megatron_sp_ext.diffusers.sparse import BlockSparsePlan  # noqa: PLC0415
    return BlockSparsePlan(tuple(settings["tile"]), topk=settings["topk"],
                           window=tuple(settings["window"]) if settings["window"] else None)


def fixed_batch(cfg, grid_latent: tuple, seed: int, device) -> dict:
    """One synthetic flow-matching batch (B=1) on ``device``: x_t, target, t, text [1, text_len, text_dim]."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid_latent
    x0 = torch.randn(1, cfg.in_channels, f, h, w, generator=g)
    eps = torch.randn(x0.shape, generator=g)
    t = shift_timestep(torch.sigmoid(torch.randn(1, generator=g)), 5.0)
    text = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g)
    return {"x": ((1 - t) * x0 + t * eps).to(device), "target": (eps - x0).to(device), "t": t.to(device),
            "text": text.to(device)}


class Setup:
    """One variant's model, optimizer and step on this rank (built fresh from the same seed)."""

    def __init__(self, args, variant: dict, world: int, device, grid_tokens: tuple, backend: Optional[str]) -> None:
        kw = wan.preset_kwargs(args.model, args.num_layers)
        self.model = wan.random_model(kw, args.seed, device)
        self.cfg = wan.dit_config(self.model.config, args.text_len)
        cuda = torch.device(device).type == "cuda"
        if variant.get("lora"):
            from training.wan_diffusers.lora import LoraSettings, add_lora, base_to_bf16  # noqa: PLC0415
            add_lora(self.model, LoraSettings(variant["lora"], float(variant["lora"])), args.seed + 1)
            if cuda:   # bf16 base weights (diffusers' fp32 modules kept), fp32 adapters
                base_to_bf16(self.model)
        recompute = variant.get("recompute") or args.recompute
        if recompute == "full":
            self.model.enable_gradient_checkpointing()
        self.handle, self.backend, self.closed = None, backend, False
        if variant["impl"] == "diffusers":
            from diffusers import ContextParallelConfig  # noqa: PLC0415
            self.model.set_attention_backend(backend)
            degree = {"ulysses_degree": world} if variant["mode"] == "ulysses" else {"ring_degree": world}
            self.model.enable_parallelism(config=ContextParallelConfig(**degree))
        elif variant["impl"] == "ours":
            from megatron_sp_ext.diffusers import keep_attention_checkpointing, parallelize  # noqa: PLC0415
            plan = make_plan(variant["sparse_settings"]) if variant.get("sparse_settings") else None
            chunks = modes.head_chunks_of(variant["mode"], args.hcms_head_chunks)
            cfg = SPConfig(mode=variant["mode"], head_chunks=chunks, backend=args.sp_attention_backend)
            self.handle = parallelize(self.model, dist.group.WORLD if world > 1 else None, config=cfg, sparse=plan,
                                      rope=variant["rope"])
            if recompute.startswith("keep"):   # keepN: the first N blocks (at most the model's)
                keep_attention_checkpointing(self.handle, min(int(recompute[4:]), kw["num_layers"])
                                             if recompute[4:] else None)
        self.fused = None   # @fused=on: every block compiled (a fresh compile cache per variant: its warmup pays)
        if variant.get("fused"):
            from megatron_sp_ext.diffusers import fuse_elementwise  # noqa: PLC0415
            torch.compiler.reset()
            self.fused = fuse_elementwise(self.model, fused_backend(device))
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=args.lr,
                                     betas=(0.9, 0.95), fused=cuda or None)
        self.ops = TorchOps(self.model, self.opt, dist.group.WORLD if world > 1 else None, clip=1.0)
        self.world = world
        self.autocast = torch.bfloat16 if cuda else None

    def step(self, batch: dict) -> torch.Tensor:
        self.ops.zero_grad()
        loss = flow_loss(self.model, batch, self.autocast)
        self.ops.backward(loss * self.world)   # SUM over SP ranks under the average (wan_diffusers/loop.py)
        self.ops.grads_ready()
        self.ops.update()
        return loss.detach()

    def close(self) -> None:
        """Idempotent: hooks and compiled layers removed, the model and optimizer freed."""
        if self.closed:
            return
        self.closed = True
        if self.fused is not None:
            self.fused.remove()
        if self.handle is not None:
            self.handle.remove()
        del self.model, self.opt, self.ops
        if self.fused is not None:   # Dynamo's caches and guards hold the compiled layers (and their tensors)
            torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def fused_backend(device) -> str:
    """@fused=on's compile backend: Inductor on CUDA; on the CPU stand-in (--dry-run) "aot_eager", the same graphs
    unfused (no C++ compile; the row says which)."""
    return "inductor" if torch.device(device).type == "cuda" else "aot_eager"


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _all_ok(ok: bool, device) -> bool:
    """True when every rank's ``ok`` is (one all-reduce MIN): a variant fails or runs on all ranks together."""
    t = torch.tensor([1.0 if ok else 0.0], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() > 0)


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def build(args, variant: dict, world: int, device, grid: tuple, batch: Optional[dict]) -> tuple:
    """(Setup, tried): the variant built (diffusers "auto": the first backend whose step runs), or (None, tried)
    with each backend's refusal. ``tried``: [{"backend", "error"}] of diffusers' backends that did not run. Our
    variants are built without a catch: their failure is an error of this package and ends the run."""
    if variant["impl"] in ("ours", "stock"):
        return Setup(args, variant, world, device, grid, variant["backend"]), []
    backends = list(DIFFUSERS_BACKENDS) if variant["backend"] == "auto" else [variant["backend"]]
    tried = []
    for backend in backends:
        setup, err = None, None
        try:
            setup = Setup(args, variant, world, device, grid, backend)
            if batch is not None:
                setup.step(batch)   # the backend must run forward AND backward here
        except Exception as e:  # noqa: BLE001 - diffusers' backend probed: recorded, the next one tried
            err = _first_line(e)
            if args.dry_run or os.environ.get("SPX_TRACEBACK"):
                traceback.print_exc()
        if _all_ok(err is None, device):
            if batch is not None:   # the probe trained one step: start again from the seed, so that the timed
                # steps (and first_loss, read beside ours) begin from the same weights as our variants
                setup.close()
                _free(device)
                setup = Setup(args, variant, world, device, grid, backend)
            return setup, tried
        tried.append({"backend": backend, "error": err or "failed on another rank"})
        if setup is not None:
            setup.close()
        _free(device)
    return None, tried


def skip_reason(variant: dict, cuda: bool, ranks_share_gpu: bool, world: int = 1) -> Optional[str]:
    """Why ``variant`` is not timed in this job (None: it is): diffusers' CP needs an accelerator and one rank per
    GPU; a variant whose sparse settings failed carries its own reason."""
    if variant["impl"] == "diffusers" and not cuda:
        return NO_ACCELERATOR
    if variant["impl"] == "diffusers" and ranks_share_gpu:
        return SHARED_GPU_DIFFUSERS
    if variant["impl"] == "stock" and world > 1:
        return STOCK_ONE_RANK
    return variant.get("skip")


def time_variant(args, variant: dict, world: int, device, grid: tuple, batch: dict) -> dict:
    with AutoDecisions() as decisions:
        try:
            row = _time_variant(args, variant, world, device, grid, batch)
        except torch.OutOfMemoryError as e:   # one rank: recorded, the next variant built afresh
            if world > 1:   # the other ranks may be inside a collective: a desynchronised job, end it
                raise
            row = {"variant": variant["name"], "impl": variant["impl"], "mode": variant["mode"],
                   "skipped": f"out of GPU memory ({_first_line(e)[:200]})"}
    _free(device)
    if variant["impl"] == "ours":
        row["auto_decisions"] = decisions.messages
    return row


def _time_variant(args, variant: dict, world: int, device, grid: tuple, batch: dict) -> dict:
    cuda = torch.device(device).type == "cuda"
    _free(device)
    setup, tried = build(args, variant, world, device, grid, batch)
    row = {"variant": variant["name"], "impl": variant["impl"], "mode": variant["mode"],
           "sparse": variant.get("sparse_settings")}
    if tried:
        row["backends_refused"] = tried
    if setup is None:
        row["skipped"] = "no backend ran: " + "; ".join(f"{t['backend']}: {t['error']}" for t in tried)
        return row
    row["backend"] = setup.backend if variant["impl"] == "diffusers" else args.sp_attention_backend
    if setup.fused is not None:
        row["fused_backend"] = setup.fused.backend
    try:   # closed on every exit: a step that ran out of memory must not leave its model, hooks and compiled
        return _timed(args, variant, world, device, grid, batch, setup, row)   # code to the next variant
    finally:
        setup.close()


def _timed(args, variant: dict, world: int, device, grid: tuple, batch: dict, setup: "Setup", row: dict) -> dict:
    """The built variant's warmup, timed steps, peaks and options (--memory-peak, --profile-steps) into ``row``."""
    cuda = torch.device(device).type == "cuda"
    times, losses, warmup_ms = [], [], []
    for i in range(args.warmup + args.steps):
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
        t0 = time.perf_counter()
        losses.append(setup.step(batch))
        if cuda:
            ev[1].record()
            ev[1].synchronize()
            ms = ev[0].elapsed_time(ev[1])
        else:
            ms = 1e3 * (time.perf_counter() - t0)
        (times if i >= args.warmup else warmup_ms).append(ms)
        if cuda and i == args.warmup - 1:   # the steady peak: the timed steps alone (no first-step trials)
            job_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
    t = torch.tensor(times, device=device)
    steady = torch.cuda.max_memory_allocated(device) if cuda else 0
    job = max(steady, job_peak) if cuda and args.warmup > 0 else steady
    peak = torch.tensor([job / 2**30, steady / 2**30], device=device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    ms = sorted(t.tolist())
    step_ms = ms[len(ms) // 2]
    tokens = grid[0] * grid[1] * grid[2]
    flops = setup.cfg.flops_per_token(tokens, setup.cfg.text_len) * tokens
    pk = peak_flops(device)
    row.update(step_ms=step_ms, step_ms_all=ms, tokens=tokens, model_tflop_per_step=flops / 1e12,
               mfu=flops / (step_ms / 1e3) / (pk * world) if pk else None,
               peak_mem_gib=float(peak[0].item()) if cuda else None,
               peak_steady_gib=float(peak[1].item()) if cuda else None,
               first_loss=float(losses[0].float().item()), last_loss=float(losses[-1].float().item()),
               warmup_ms=warmup_ms)
    if variant.get("sparse_settings"):
        row["mfu_note"] = "dense-equivalent: the FLOPs of dense attention over the same step time"
    if args.memory_peak:
        if cuda:
            from tools.memory_peak import peak_report  # noqa: PLC0415
            try:
                row["memory_peak"] = peak_report(lambda: setup.step(batch), torch.device(device))
            except Exception as e:  # noqa: BLE001 - the recorded step's failure is reported in its row; the timed
                # steps above stand, and the next variant builds its own model
                row["memory_peak"] = {"error": f"{type(e).__name__}: {e}"}
        else:
            row["memory_peak"] = {"skipped": "--memory-peak needs CUDA (the caching allocator's history)"}
    if args.profile_steps:
        row["profile"] = (profile_steps(setup, batch, args.profile_steps, setup.cfg.text_len, args.out,
                                        variant["name"]) if cuda else {"skipped": "--profile-steps needs CUDA"})
    return row


def profile_steps(setup: "Setup", batch: dict, steps: int, text_len: int, out: str, name: str) -> Optional[dict]:
    """--profile-steps N: N more steps under torch.profiler (after the timed ones); rank 0's GPU kernel time by
    category per step (tools/profile_train_step.categorize_trace: attention, GEMM, elementwise, exchange, optimizer,
    idle) with its top kernels and top non-attention/GEMM operators; the trace itself is deleted (hundreds of MB)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    from tools.profile_train_step import categorize_trace  # noqa: PLC0415
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            setup.step(batch)
        torch.cuda.synchronize()

    def categorize() -> dict:   # rank 0; a failure here ends every rank (the others would be in the next variant)
        path = f"{os.path.splitext(out)[0]}_{name.replace('@', '_').replace('=', '-')}_trace.json"
        prof.export_chrome_trace(path)
        try:
            return categorize_trace(path, steps, text_len)
        finally:
            os.remove(path)
    cats = on_rank0(f"--profile-steps: rank 0's trace of {name}", categorize)
    return cats if not dist.is_initialized() or dist.get_rank() == 0 else None


def curves(args, variants: list, world: int, device, grid_latent: tuple) -> dict:
    """--curves N: N steps of each variant on the same sample stream (training/wan_diffusers/flow.py batches of
    synthetic latents from --seed); returns {variant: losses or {"skipped": reason}}."""
    from training.video_dit.data import SyntheticVideoLatents  # noqa: PLC0415
    out = {}
    for variant in variants:
        _free(device)
        kw = wan.preset_kwargs(args.model, args.num_layers)
        cfg = wan.dit_config(kw, args.text_len)
        data = SyntheticVideoLatents(cfg.in_channels, [grid_latent[0]], grid_latent[1], grid_latent[2],
                                     cfg.text_len, cfg.text_dim, seed=args.seed)
        batches = WanStepBatches(data, start=0, stop=args.curves, seed=args.seed, dp_rank=0, dp_world=1,
                                 micro_batch=1, shift=5.0)
        first = {k: v.to(device) for k, v in batches[0].items() if isinstance(v, torch.Tensor)}
        setup, tried = build(args, variant, world, device, grid_latent, first)
        if setup is None:
            out[variant["name"]] = {"skipped": "; ".join(f"{t['backend']}: {t['error']}" for t in tried)}
            continue
        if variant["impl"] == "diffusers":   # the probe step trained once: start again from the seed
            setup.close()
            variant = {**variant, "backend": setup.backend}
            setup, _ = build(args, variant, world, device, grid_latent, None)
        losses = []
        for i in range(args.curves):
            b = {k: v.to(device) for k, v in batches[i].items() if isinstance(v, torch.Tensor)}
            losses.append(float(setup.step(b).float().item()))
        out[variant["name"]] = {"losses": losses, "backend": setup.backend or args.sp_attention_backend}
        setup.close()
    return out


def main(argv: Optional[list] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default="480p", choices=list(wan.GRIDS), help="Wan's latent grid (480p: 21x60x104, "
                   "32,760 tokens; 720p: 21x90x160, 75,600 tokens)")
    p.add_argument("--model", default="wan-1.3b", choices=list(wan.WAN_PRESETS))
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's depth (default: full)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--sparse-tile", default="4,4,8", help="tile T,H,W of the sparse variants (tokens after the patch)")
    p.add_argument("--hcms-head-chunks", default="auto", help="head chunks of ours-hcms / ours-auto")
    p.add_argument("--sp-attention-backend", default="auto", help="our local attention kernel")
    p.add_argument("--recompute", default="full", choices=("full", "none"),
                   help="full: diffusers' gradient checkpointing on every block (default); none: off for every "
                        "variant (diffusers' ring CP fails under checkpointing)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (after --warmup; default 8, "
                   "3 with --targets)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, 1 with --targets)")
    p.add_argument("--targets", action="store_true", help="issue 86's targets on one GPU (TARGET_CASES: wan-1.3b "
                   "720p dense / attention kept / top-k90 64-token tiles vs stock; wan-14b LoRA at 480p and 720p vs "
                   "stock + peft), ratios to stock in one JSON; --model/--grid/--variants/--sparse-tile are the cases'")
    p.add_argument("--targets-case", default=None, choices=list(TARGET_CASES), help="with --targets: this case only")
    p.add_argument("--profile-steps", type=int, default=0, help="N: after timing, N steps of each variant under "
                   "torch.profiler, rank 0's kernel time by category in the row's 'profile' (CUDA only)")
    p.add_argument("--memory-peak", action="store_true", help="after timing, one more step of each variant under "
                   "the allocator's history: what is alive at that step's peak on this rank, grouped by the code that "
                   "allocated it (tools/memory_peak.py), in the row's 'memory_peak' (CUDA only)")
    p.add_argument("--curves", type=int, default=0, help="N: loss curves of ours-auto and diffusers' CP instead")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--text-len", type=int, default=None, help="text tokens (default 512; 8 in --dry-run)")
    p.add_argument("--ranks-share-gpu", action="store_true", help="every rank on GPU 0 over gloo (a one-GPU "
                   "machine): per-rank peaks and their attribution are valid, step times and MFU are not (every "
                   "exchange crosses host memory), so rows carry timing_note and no MFU")
    p.add_argument("--dry-run", action="store_true", help="CPU stand-in: tiny model, gloo, a 4x8x8 latent, 2 steps")
    p.add_argument("--out", default="results/diffusers_wan/bench.json")
    args = p.parse_args(argv)
    if args.targets_case and not args.targets:
        p.error("--targets-case names one of --targets' cases: add --targets")
    args.steps = args.steps if args.steps is not None else (3 if args.targets else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.targets else 3)
    try:
        variants = [parse_variant(v.strip()) for v in args.variants.split(",") if v.strip()]
        if args.hcms_head_chunks != "auto":
            args.hcms_head_chunks = int(args.hcms_head_chunks)
    except (SPConfigError, ValueError) as e:
        p.error(str(e) if isinstance(e, SPConfigError) else f"--hcms-head-chunks={args.hcms_head_chunks!r}: an "
                f"integer or auto")
    own_pg = not dist.is_initialized()
    if own_pg:
        if "WORLD_SIZE" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        rank, world, device = init_world(share_gpu=args.ranks_share_gpu)
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if args.dry_run:
        args.model, args.steps, args.warmup = "tiny", min(args.steps, 2), min(args.warmup, 1)
        args.curves = min(args.curves, 2)
        args.text_len = args.text_len or 8
    args.text_len = args.text_len or wan.TEXT_LEN.get(args.model, 512)
    try:
        if args.targets:
            if world > 1:
                raise SPConfigError(f"--targets times stock diffusers beside ours on one GPU: run it as one process "
                                    f"(this job has {world} ranks)")
            return run_targets(args, rank, world, device)
        return _run(args, variants, rank, world, device)
    finally:
        if own_pg:
            dist.destroy_process_group()


# issue 86's targets (one H200): per case the model, grid, sparse tile, variants (the first: the case's stock step) and
# (label, the variants of which the fastest counts, the least speed-up over stock)
TARGET_CASES = {   # each case's fused rows (@fused=on) after its eager ones; stock compiled the same way beside
    "wan-1.3b-720p": {
        "model": "wan-1.3b", "grid": "720p", "tile": "4,4,4",
        "variants": "stock,ours-auto,ours-auto@recompute=keep,ours-auto-topk90,ours-auto-topk90@recompute=keep,"
                    "stock@fused=on,ours-auto@recompute=keep@fused=on,ours-auto-topk90@recompute=keep@fused=on",
        "targets": [("attention kept >= 1.35x stock diffusers' checkpointed step",
                     ["ours-auto@recompute=keep", "ours-auto@recompute=keep@fused=on"], 1.35),
                    ("top-k90 64-token tiles >= 3.5x stock", ["ours-auto-topk90", "ours-auto-topk90@recompute=keep",
                                                              "ours-auto-topk90@recompute=keep@fused=on"], 3.5)]},
    "wan-14b-lora-480p": {
        "model": "wan-14b", "grid": "480p", "tile": "4,4,4",
        "variants": "stock@lora=32,ours-auto@lora=32,ours-auto@lora=32@recompute=keep,stock@lora=32@fused=on,"
                    "ours-auto@lora=32@recompute=keep@fused=on",
        "targets": [("LoRA >= 1.3x stock diffusers + peft", ["ours-auto@lora=32", "ours-auto@lora=32@recompute=keep",
                                                              "ours-auto@lora=32@recompute=keep@fused=on"], 1.3)]},
    "wan-14b-lora-720p": {   # measured 2026-11-29 (1 x H200): all 40 blocks kept, or 16, run out of memory; 8: 112 GiB
        "model": "wan-14b", "grid": "720p", "tile": "4,4,4",
        "variants": "stock@lora=32,ours-auto@lora=32,ours-auto@lora=32@recompute=keep8,"
                    "ours-auto@lora=32@recompute=keep12,ours-auto@lora=32@recompute=keep8@fused=on",
        "targets": [("LoRA >= 1.3x stock diffusers + peft", ["ours-auto@lora=32", "ours-auto@lora=32@recompute=keep8",
                                                              "ours-auto@lora=32@recompute=keep12",
                                                              "ours-auto@lora=32@recompute=keep8@fused=on"], 1.3)]},
}


def target_verdicts(case: dict, rows: list) -> list:
    """Each target of ``case``: the stock step, the fastest of its variants, their ratio and whether it is met."""
    ms = {r["variant"]: r.get("step_ms") for r in rows}
    stock = ms.get(case["variants"].split(",")[0])
    out = []
    for label, names, least in case["targets"]:
        timed = [(ms[n], n) for n in names if ms.get(n)]
        best = min(timed) if timed else None
        ratio = stock / best[0] if stock and best else None
        out.append({"target": label, "least": least, "stock_ms": stock, "best_variant": best[1] if best else None,
                    "best_ms": best[0] if best else None, "speedup": ratio,
                    "met": None if ratio is None else ratio >= least})
    return out


def run_targets(args, rank: int, world: int, device) -> dict:
    """--targets: every case of TARGET_CASES (or --targets-case) in this job, one JSON at --out."""
    import copy  # noqa: PLC0415
    cases, doc = {}, {"targets": []}
    for name, case in TARGET_CASES.items():
        if args.targets_case and name != args.targets_case:
            continue
        a = copy.copy(args)
        a.model = "tiny" if args.dry_run else case["model"]
        a.grid, a.sparse_tile, a.variants, a.num_layers = case["grid"], case["tile"], case["variants"], None
        a.out = f"{os.path.splitext(args.out)[0]}_{name}.json"   # the case's rows, written as they come
        a.text_len = 8 if args.dry_run else wan.TEXT_LEN.get(a.model, 512)
        variants = [parse_variant(v) for v in case["variants"].split(",")]
        result = _run(a, variants, rank, world, device)
        cases[name] = result
        doc.setdefault("meta", {**result["meta"], "targets_cases": []})["targets_cases"].append(name)
        for verdict in target_verdicts(case, result["rows"]):
            doc["targets"].append({"case": name, **verdict})
            if rank == 0:
                print(json.dumps({"case": name, **verdict}), flush=True)
    doc["cases"] = cases
    if rank == 0:
        write_json(args.out, doc)
    return doc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, variants: list, rank: int, world: int, device) -> dict:
    cuda = torch.device(device).type == "cuda"
    kw = wan.preset_kwargs(args.model, args.num_layers)
    grid_latent = DRY_GRID if args.dry_run else wan.GRIDS[args.grid]
    pt, ph, pw = kw["patch_size"]
    grid = (grid_latent[0] // pt, grid_latent[1] // ph, grid_latent[2] // pw)
    tile = tuple(int(x) for x in args.sparse_tile.split(","))
    if args.dry_run:
        tile = (1, 2, 2)
    gpus = f"{world} ranks on 1" if args.ranks_share_gpu else str(world)
    meta = run_meta(machine=f"{platform.node()}: {gpus} x {torch.cuda.get_device_name(0) if cuda else 'CPU'}",
                    torch=torch.__version__, diffusers=_diffusers_version(), world=world, model=args.model,
                    layers=kw["num_layers"], grid_latent=list(grid_latent), grid_tokens=list(grid),
                    tokens=grid[0] * grid[1] * grid[2], recompute=args.recompute, dry_run=args.dry_run,
                    ranks_share_gpu=args.ranks_share_gpu)
    for v in variants:
        try:
            v["sparse_settings"] = sparse_settings(v["sparse"], grid, tile)
        except SPConfigError as e:
            v["sparse_settings"], v["skip"] = None, f"sparse settings: {e}"
    cfg = wan.dit_config(kw, args.text_len)
    rows: list = []
    if args.curves:
        ours = next((v for v in variants if v["impl"] == "ours" and v["mode"] == "auto" and not v["sparse"]),
                    parse_variant("ours-auto"))
        theirs = [v for v in variants if v["impl"] == "diffusers"] or [parse_variant("diffusers-ulysses")]
        chosen = [ours] + ([] if not cuda else theirs[:1])
        result = curves(args, chosen, world, device, grid_latent)
        if not cuda:
            result[theirs[0]["name"]] = {"skipped": NO_ACCELERATOR}
        doc = {"meta": meta, "curves": result, "steps": args.curves}
        if rank == 0:
            stem = os.path.splitext(args.out)[0]
            write_json(stem + "_curves.json", doc)
            plot_or_skip(stem + "_curves.png", lambda plt: _draw_curves(plt, result, meta), who="bench_diffusers_wan")
            print(json.dumps({k: v.get("losses", v)[-1:] if "losses" in v else v for k, v in result.items()}),
                  flush=True)
        return doc
    batch = fixed_batch(cfg, grid_latent, args.seed, device)
    for v in variants:
        why = skip_reason(v, cuda, args.ranks_share_gpu, world)
        if why:
            row = {"variant": v["name"], "impl": v["impl"], "mode": v["mode"], "skipped": why}
        else:
            row = time_variant(args, v, world, device, grid, batch)
        row.update(machine=meta["machine"], date=meta["date"], commit=meta["commit"], command=meta["command"],
                   recompute=v.get("recompute") or args.recompute, lora_rank=v.get("lora"))
        if v.get("lora") and row.get("mfu") is not None:
            row["mfu_note"] = ("LoRA: the frozen base weights get no gradient; MFU counts full training's FLOPs "
                               "(a third more than run)")
        if args.ranks_share_gpu and "step_ms" in row:
            row.update(mfu=None, timing_note=SHARED_GPU_NOTE)
        rows.append(row)
        if args.out:   # after every variant: what a job stopped at its limit leaves stands (rank 0; its failure
            # ends every rank rather than leaving the others in the next variant's collectives)
            on_rank0(f"writing {args.out}", lambda: write_json(args.out, {"meta": meta, "rows": rows, "partial": True}))
        if rank == 0:
            print(json.dumps({k: row.get(k) for k in ("variant", "backend", "step_ms", "mfu", "peak_mem_gib",
                                                      "peak_steady_gib", "first_loss", "skipped")}), flush=True)
    doc = {"meta": meta, "rows": rows}
    if args.out:   # --targets: the next case follows
        on_rank0(f"writing {args.out}", lambda: write_json(args.out, doc))
    return doc


def _diffusers_version() -> Optional[str]:
    try:
        import diffusers  # noqa: PLC0415
        return diffusers.__version__
    except ImportError:
        return None


def _draw_curves(plt, result: dict, meta: dict):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in result.items():
        if "losses" in r:
            ax.plot(range(len(r["losses"])), r["losses"], marker=".", label=f"{name} ({r['backend']})")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss (bf16)" if "CPU" not in meta["machine"] else "flow-matching loss")
    ax.set_title(f"{meta['model']} x{meta['layers']}, {meta['tokens']} tokens, SP={meta['world']}")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
