"""The training step loop shared by both entry points, and its flags.

Per step: inputs from the background data path (pipeline.step_inputs; the next step's batch is fetched and
copied to the device once this step's backward is queued), forward+backward, the
framework's gradient reduction and clip (which yields the gradient norm), the non-finite guard (one
small all-reduce, guard.StepGuard), the update (or a counted skip), and device-side metrics read
back every --log-interval steps (telemetry.Telemetry). A framework adapter (TorchOps, MegatronOps,
DeepSpeedOps) supplies the four framework-specific calls; checkpoint writing stays in the entry
point (``save(step)`` callback) and runs only after the guard has passed and the metrics are flushed.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .cli import sparse_spec
from .dynamic import PlanLog
from .engine import describe_samples, local_loss
from .guard import NonFiniteError, SpikeDetector, StepGuard
from .manual_gc import ManualGc
from .model import RECOMPUTE_MODULES
from .pipeline import StepBatches, step_inputs
from .profiling import StepProfiler
from .telemetry import GcTimer, Telemetry

log = logging.getLogger("video_dit")


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Speed, memory and run-health flags (names as in Megatron-LM where it has one)."""
    g = p.add_argument_group("training loop")
    g.add_argument("--log-interval", type=int, default=1,
                   help="read metrics back from the device every N steps (no other per-step host sync when the "
                        "non-finite check is off)")
    g.add_argument("--tensorboard-dir", default=None, help="also write TensorBoard event files here (rank 0)")
    g.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader worker processes preparing batches ahead (default on CUDA: half this rank's "
                        "share of the host's CPUs, 2 to 8; on CPU 0 = in the training thread). A synthetic "
                        "wan-1.3b 32K batch costs 70-300 ms of one CPU core")
    g.add_argument("--manual-gc", action="store_true",
                   help="as in Megatron-LM: Python's automatic garbage collector off during the step loop, a full "
                        "collection every --manual-gc-interval steps instead (the same step on every rank)")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every N steps (0: no collection between steps)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="activation checkpointing: full blocks, or selective (--recompute-modules)")
    g.add_argument("--recompute-modules", nargs="+", default=["core_attn"], choices=list(RECOMPUTE_MODULES),
                   help="with --recompute-granularity selective: the attention core (core_attn) and/or the FFN "
                        "(mlp), Megatron-LM's names; or outside_core_attn alone (ours): everything of each block "
                        "but the self-attention core, whose q, k, v, output and log-sum-exp are kept, so the "
                        "backward never reruns the attention kernel (docs/full_depth_sharding.md)")
    g.add_argument("--recompute-method", choices=["block", "uniform"], default=None,
                   help="as in Megatron-LM: block = the first --recompute-num-layers blocks recompute (the default "
                        "here); uniform = every block, each its own recompute unit (--recompute-num-layers 1 or "
                        "none; Megatron-LM's chunks of N > 1 blocks are not built: refused)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="recompute only the first N blocks (full or selective; default: all); the others keep "
                        "every activation. Megatron-LM applies it to full only; here selective too: a memory "
                        "setting (python -m training.video_dit.memory_plan --recompute-num-layers auto: the fewest "
                        "that fit); on 4 x H200 it was not faster (docs/full_depth_sharding.md)")
    g.add_argument("--cpu-offloading", action="store_true",
                   help="as in Megatron-LM: activation offloading to pinned host memory; the tensors each block "
                        "saves for the backward outside its recomputed regions (with --recompute-modules "
                        "outside_core_attn: the attention core's q, k, v, output, log-sum-exp). Not with "
                        "--recompute-granularity full (its blocks keep only their inputs)")
    g.add_argument("--cpu-offloading-num-layers", type=int, default=None,
                   help="with --cpu-offloading: offload only the first N blocks (default: all)")
    g.add_argument("--fused-elementwise", choices=["auto", "on", "off"], default="auto",
                   help="fuse the blocks' elementwise work (AdaLN modulation, gated residuals, QK-norm + RoPE) with "
                        "torch.compile: auto = on CUDA only (training/video_dit/fused.py)")
    g.add_argument("--ulysses-packed-qkv", choices=["auto", "on", "off"], default="auto",
                   help="Ulysses / HCMS (any --hcms-head-chunks): write q|k|v straight into the exchange's send "
                        "layout and read the received buffers in place (megatron_sp_ext.sp.ulysses.packed); auto = on "
                        "when --fused-elementwise compiles (the layout change then rides in the QK-norm/RoPE "
                        "kernel). Same math; heads must divide by the SP size, else the plain path runs")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="as in Megatron-LM: deterministic execution (torch's deterministic algorithms, "
                        "CUBLAS_WORKSPACE_CONFIG, NCCL_ALGO=Ring), so a rerun of a step gives the same bits; needs "
                        "--sp-attention-backend math (training/video_dit/deterministic.py)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="turn off the per-step finite check of loss and gradient norm")
    g.add_argument("--skip-nonfinite-steps", type=int, default=0,
                   help="skip (do not apply) up to N steps whose loss/grad norm is NaN/Inf; stop at the N+1st")
    g.add_argument("--loss-spike-factor", type=float, default=3.0,
                   help="warn when a loss exceeds this x the running median (0: off)")
    g.add_argument("--timing", action="store_true",
                   help="time the model's fwd+bwd and the optimizer step with CUDA events in the same run "
                        "(model_fwd_bwd_ms, optimizer_ms in metrics.jsonl)")
    g.add_argument("--timing-bare-steps", type=int, default=10,
                   help="with --timing: after the run, N more steps of the same model and optimizer on the last "
                        "batch with nothing else (no data path, guard, metrics), timed with CUDA events "
                        "(timing.json: bare_step_ms); they update the weights, so use it in benchmark runs")
    g.add_argument("--profile", action="store_true", help="torch.profiler over steps [--profile-step-start, "
                   "--profile-step-end) on --profile-ranks: profile_rank{r}.json/.txt in --log-dir")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--debug-inf-grad-step", type=int, default=None, help=argparse.SUPPRESS)  # test hook
    return p


def default_workers(cpus: int, local_ranks: int) -> int:
    """DataLoader workers per rank on CUDA: half of the rank's share of ``cpus`` (the rest: the training thread,
    the pin-memory thread, the launcher), at least 2 and at most 8."""
    return min(8, max(2, cpus // max(1, local_ranks) // 2))


def resolve_workers(args, device) -> int:
    """--num-workers, or on CUDA ``default_workers`` over this process's CPU affinity and torchrun's
    LOCAL_WORLD_SIZE; 0 on CPU."""
    n = args.num_workers
    if n is None:
        if torch.device(device).type != "cuda":
            return 0
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return default_workers(cpus, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if n < 0:
        raise ValueError(f"--num-workers={n}: must be >= 0")
    return n


@dataclass
class RunContext:
    """Where this rank sits: SP (context) and DP coordinates and the all-ranks group of the guard."""
    sp_rank: int
    sp_world: int
    dp_rank: int
    dp_world: int
    rank: int
    world: int
    group: Optional[object] = None


class TorchOps:
    """torch AdamW (fused on CUDA) with the gradient average over data x context ranks done explicitly."""

    def __init__(self, model, opt, dp_cp_group, clip: float) -> None:
        self.model, self.opt, self.group, self.clip = model, opt, dp_cp_group, clip

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss):
        loss.backward()

    def grads_ready(self) -> torch.Tensor:
        world = dist.get_world_size(self.group) if self.group is not None else 1
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        if world > 1:  # one flat all-reduce per dtype instead of one per parameter
            for dt in {g.dtype for g in grads}:
                part = [g for g in grads if g.dtype == dt]
                flat = torch.cat([g.reshape(-1) for g in part])
                dist.all_reduce(flat, group=self.group)
                flat /= world
                torch._foreach_copy_(part, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in part]), part)])
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, norm, foreach=True)
        return norm

    def update(self):
        self.opt.step()
        return None

    def discard(self):
        self.opt.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])


class MegatronOps:
    """megatron-core DDP + optimizer (GPU): finish_grad_sync, then a norm over the (local shard of) main_grad
    for the guard; the optimizer clips and reports the global norm itself."""

    def __init__(self, ddp, opt) -> None:
        self.model, self.opt = ddp, opt

    def zero_grad(self):
        self.model.zero_grad_buffer()
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss):
        loss.backward()

    def grads_ready(self) -> torch.Tensor:
        self.model.finish_grad_sync()
        grads = [p.main_grad for p in self.model.module.parameters() if getattr(p, "main_grad", None) is not None]
        return torch.nn.utils.get_total_norm(grads, foreach=True)

    def update(self):
        _, grad_norm, _ = self.opt.step()
        return grad_norm

    def discard(self):
        self.zero_grad()

    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])


class DeepSpeedOps:
    """DeepSpeed engine: reduction, clip and the gradient overflow check happen inside engine.step(); a step
    whose gradients are non-finite is skipped by DeepSpeed (engine.skipped_steps), which the guard reads."""

    def __init__(self, engine) -> None:
        self.model = engine
        self.engine = engine

    def zero_grad(self):
        pass  # engine.step() clears the gradients

    def backward(self, loss):
        self.engine.backward(loss)

    def grads_ready(self):
        return None

    def update(self):
        before = self.engine.skipped_steps
        self.engine.step()
        self.ds_skipped = self.engine.skipped_steps > before
        return self.engine.get_global_grad_norm()

    def discard(self):
        self.update()  # DeepSpeed skips the non-finite update itself and clears its gradient buffers

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])


def _plant_inf_hook(model, step, at_step, rank):
    """Test hook (--debug-inf-grad-step): rank 0 adds +inf to one parameter's gradient at that step."""
    if at_step is None or step != at_step or rank != 0:
        return None
    p = next(p for p in model.parameters() if p.requires_grad)
    if not hasattr(p, "device_mesh"):
        return p.register_hook(lambda g: g + float("inf"))

    # FSDP2: the forward runs on the all-gathered parameter, never on this DTensor shard, so a hook on the shard
    # would not fire; poison the gradient of the model's output on this rank instead
    def poison_output(module, inputs, out):
        out.register_hook(lambda g: g + float("inf"))
    return model.register_forward_hook(poison_output)


def train_loop(args, ops, dataset, cfg, ctx: RunContext, device, log_metrics, *, start: int, autocast=None,
               save: Optional[Callable[[int], None]] = None, cast_inputs=None, sample_base: int = 0,
               pack_plan=None, dynamic=None) -> list:
    """Run steps [start, args.train_iters); returns the mean sample loss per step (None if not read back).
    ``sample_base``: the data position's offset after a resume (pipeline.sample_base); ``pack_plan``: a
    packing.PackPlan (--pack-samples: one packed sequence of mixed-size clips per step); ``dynamic``: a
    dynamic.DynamicSP (--dynamic-context-parallel: each pack's samples over their own sub-groups; the first plan is
    logged in words)."""
    guard = StepGuard(args.check_for_nan_in_loss_and_grad, args.skip_nonfinite_steps, ctx.rank, ctx.world,
                      ctx.dp_world, ctx.group)
    spikes = SpikeDetector(args.loss_spike_factor)
    tel = Telemetry(log_metrics, cfg=cfg, device=device, world=ctx.world, interval=args.log_interval,
                    timing=args.timing, tensorboard_dir=args.tensorboard_dir, writer_rank=ctx.rank == 0,
                    group=ctx.group)
    sparse = sparse_spec(args)  # --sparse-attention tiles: the batches in tile order
    batches = StepBatches(dataset, start=start, stop=args.train_iters, seed=args.seed, dp_rank=ctx.dp_rank,
                          dp_world=ctx.dp_world, micro_batch=args.micro_batch_size, patch=cfg.patch,
                          sp_rank=ctx.sp_rank, sp_world=ctx.sp_world, base=sample_base, pack_plan=pack_plan,
                          tile=sparse.tile if sparse is not None else None, dynamic=dynamic)
    plan_log = PlanLog(ctx.rank == 0 and not getattr(args, "quiet", False), getattr(dynamic, "cost", None))
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # this run's peak (benchmarks run the entry more than once)
        torch.cuda.reset_accumulated_memory_stats(device)   # and its own allocator retries (telemetry's alloc_retries)
    prof = StepProfiler(args.profile, args.profile_step_start, args.profile_step_end, args.profile_ranks, ctx.rank,
                        args.log_dir, device)
    losses: list = []
    workers = resolve_workers(args, device)
    if ctx.rank == 0:
        log.info("data path: %d DataLoader worker(s) per rank%s", workers,
                 "" if args.num_workers is not None else " (--num-workers default)")
    manual_gc = ManualGc(getattr(args, "manual_gc", False), getattr(args, "manual_gc_interval", 0))
    with GcTimer() as gc_timer, manual_gc:   # host time in the collector, per step (gc_ms)
        data = step_inputs(batches, device, workers)
        for step, inp, ids in data:
            data_wait_ms = data.take_wait_ms()   # this batch's wait (taken while the previous step ran, mostly)
            prof.step(step)
            plan_log.see(inp.pack.dynamic if inp.pack is not None else None)
            if cast_inputs is not None:
                cast_inputs(inp)
            ev = tel.events()
            hook = _plant_inf_hook(ops.model, step, args.debug_inf_grad_step, ctx.rank)
            if ev:
                ev.mark(0)
            ops.zero_grad()
            loss_r = local_loss(ops.model, inp, autocast)
            ops.backward(loss_r * ctx.sp_world)
            data.prefetch()   # the next batch's host wait and device copy while the GPU runs this backward
            if ev:
                ev.mark(1)
            if hook is not None:
                hook.remove()
            grad_norm = ops.grads_ready()
            vec = guard.reduce(loss_r, grad_norm)
            loss = vec[0]
            apply = True
            if guard.enabled:
                verdict = guard.read(vec)
                loss = verdict.loss
                if isinstance(ops, DeepSpeedOps):  # gradients: DeepSpeed's own overflow check inside step()
                    if not verdict.ok:
                        apply = guard.decide(verdict, step, describe_samples(dataset, ids))
                    out = ops.update()
                    if ops.ds_skipped and verdict.ok:
                        verdict.ok, verdict.grad_ranks = False, list(range(ctx.world))
                        apply = guard.decide(verdict, step, describe_samples(dataset, ids))
                    elif not ops.ds_skipped and (not verdict.ok or (out is not None and not math.isfinite(out))):
                        raise NonFiniteError(f"step {step}: non-finite loss or gradient norm ({out}) and DeepSpeed "
                                             f"applied the update (its gradient overflow check is off for this "
                                             f"configuration: use ZeRO 1-3 with bf16.check_grad_overflow true); "
                                             f"samples: {describe_samples(dataset, ids)}")
                else:
                    apply = guard.decide(verdict, step, describe_samples(dataset, ids))
                    out = ops.update() if apply else ops.discard()
                if loss is not None and apply:
                    spikes.update(step, loss, describe_samples(dataset, ids))
            else:
                out = ops.update()
            if ev:
                ev.mark(2)
            manual_gc.step_done(step)
            gn = out if out is not None else grad_norm
            losses.append(loss)
            extra = {"tokens": inp.n_valid, "padded_tokens": inp.n_pad - inp.n_valid, "data_wait_ms": data_wait_ms,
                     "gc_ms": gc_timer.take()}
            seqlen = inp.n_valid  # the length a token attends over (MFU); packed: its own sample's, averaged
            if inp.pack is not None:
                extra["samples"], seqlen = inp.pack.num_samples, inp.pack.attention_seqlen
            tel.record(step, loss, gn, ops.lr(), inp.n_valid * args.micro_batch_size * ctx.dp_world, seqlen,
                       len(guard.skipped), ev, extra)
            if save is not None and args.save and args.save_interval and (step + 1) % args.save_interval == 0:
                tel.flush()
                save(step + 1)
    prof.close()
    tel.close()
    if args.timing and args.timing_bare_steps > 0 and losses:
        log_metrics.timing = bare_steps(ops, inp, args.timing_bare_steps, autocast, ctx)
        log_metrics.timing.update(num_workers=workers, manual_gc=manual_gc.enabled,
                                  manual_gc_interval=manual_gc.interval)
        _write_timing(log_metrics, ctx.rank, args.log_interval)
    if guard.skipped and ctx.rank == 0:
        log.warning("skipped %d non-finite step(s): %s", len(guard.skipped), guard.skipped)
    rows = log_metrics.rows
    return [r["loss"] for r in rows[-len(losses):]] if losses else []


def bare_steps(ops, inp, n: int, autocast, ctx: RunContext) -> dict:
    """n training steps of ``ops`` on one fixed batch with nothing around them, each timed with CUDA events
    (perf_counter on CPU); median over ranks' max. What the step costs without the loop's own work."""
    cuda = inp.x.device.type == "cuda"
    times = []
    for _ in range(n):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        if cuda:
            ev[0].record()
        t0 = time.perf_counter()
        ops.zero_grad()
        loss_r = local_loss(ops.model, inp, autocast)
        ops.backward(loss_r * ctx.sp_world)
        ops.grads_ready()
        ops.update()
        if cuda:
            ev[1].record()
            ev[1].synchronize()
            times.append(ev[0].elapsed_time(ev[1]))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times, device=inp.x.device)
    if ctx.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    ms = sorted(t.tolist())
    return {"bare_step_ms": ms[len(ms) // 2], "bare_step_ms_all": ms, "bare_steps": n}


def _write_timing(log_metrics, rank: int, interval: int) -> None:
    """timing.json beside metrics.jsonl: the bare step and the medians of the run's own rows past the warm-up
    (the first log interval, at least 2 steps and a quarter of the run)."""
    skip = max(interval, 2, len(log_metrics.rows) // 4)
    rows = log_metrics.rows[skip:] or log_metrics.rows

    def med(key):
        v = sorted(r[key] for r in rows if r.get(key) is not None)
        return v[len(v) // 2] if v else None
    t = log_metrics.timing
    t.update(entry_step_ms=1e3 * med("step_time_s"), model_fwd_bwd_ms=med("model_fwd_bwd_ms"),
             optimizer_ms=med("optimizer_ms"), mfu=med("mfu"), peak_mem_gib=med("peak_mem_gib"),
             tokens_per_s=med("tokens_per_s"), data_wait_ms=med("data_wait_ms"), rows_used=len(rows))
    # the allocator's cudaMalloc retries during the timed rows (the rows' counter is cumulative: the baseline is the
    # last row before them, 0 when they are every row), and over the whole run (warm-up included)
    retries = [r["alloc_retries"] for r in rows if r.get("alloc_retries") is not None]
    before = [r["alloc_retries"] for r in log_metrics.rows[:len(log_metrics.rows) - len(rows)]
              if r.get("alloc_retries") is not None]
    t["alloc_retries"] = retries[-1] - (before[-1] if before else 0) if retries else None
    t["alloc_retries_total"] = retries[-1] if retries else None
    gc_ms = [r["gc_ms"] for r in rows if r.get("gc_ms") is not None]
    t["gc_ms"] = sum(gc_ms) / len(gc_ms) if gc_ms else None   # a mean: collections come every few steps
    if t["model_fwd_bwd_ms"] is not None and t["optimizer_ms"] is not None:
        t["entry_over_model_and_opt"] = t["entry_step_ms"] / (t["model_fwd_bwd_ms"] + t["optimizer_ms"])
    t["entry_over_bare"] = t["entry_step_ms"] / t["bare_step_ms"]
    if rank == 0 and log_metrics.log_dir:
        with open(os.path.join(log_metrics.log_dir, "timing.json"), "w") as f:
            json.dump(t, f, indent=1)
