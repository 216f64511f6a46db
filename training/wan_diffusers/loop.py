"""The Wan entry's step loop: the video DiT's guard, spike detector and telemetry around Wan's flow-matching step.

Gradients over SP ranks (megatron_sp_ext.diffusers): every SP rank computes the loss L on the model's GATHERED
output (the same value on each); the gather's backward keeps this rank's chunk of dL/d(output), so rank r's parameter
gradients are its part g_r and the model's gradient is their SUM over the SP group. The data-parallel reduction of
both sharding choices (torch all-reduce, ``video_dit.loop.TorchOps``; FSDP2's reduce-scatter, ``sharding.FsdpOps``)
AVERAGES over all data x context ranks (FSDP2 shards over all of them, as the video DiT's entry does: the most memory
saved). So each rank back-propagates ``sp_size * L``: the average over dp x sp ranks of sp * g_(d,r) is
(1 / dp) sum_d sum_r g_(d,r), the mean over data-parallel ranks of the full gradient (exactly the SP=1 gradient at
SP=1 x DP). The loss the guard and the metrics see is ``L / sp_size`` per rank (StepGuard sums it over all ranks and
divides by dp: the mean sample loss).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from training.video_dit.engine import describe_samples
from training.video_dit.guard import StepGuard, SpikeDetector
from training.video_dit.telemetry import GcTimer, Telemetry

from .flow import WanStepBatches, flow_loss, step_batches
from .task import WanTask

log = logging.getLogger("video_dit")


@dataclass
class Layout:
    """This rank's place: SP (context) rank and size, DP rank and size, global rank and world size."""
    sp_rank: int
    sp_world: int
    dp_rank: int
    dp_world: int
    rank: int
    world: int


@dataclass(frozen=True)
class StepForm:
    """How every step runs: ``autocast`` (bf16 autocast's dtype, None: off), ``task`` (the conditioning, the expert's
    timestep range and the loss: task.py), ``dtype`` (the batches cast to it: float64 test runs; None: as read)."""
    autocast: Optional[torch.dtype] = None
    task: WanTask = WanTask()
    dtype: Optional[torch.dtype] = None


@dataclass(frozen=True)
class StepHooks:
    """What the loop calls: ``save(steps done)`` at each --save-interval, ``on_grads(step)`` once the gradients are
    reduced (tests read them there), ``after_step(steps done, telemetry)`` on every rank after each step (validation
    videos: training/wan_diffusers/validate.py). None: not called."""
    save: Optional[Callable[[int], None]] = None
    on_grads: Optional[Callable[[int], None]] = None
    after_step: Optional[Callable[[int, Telemetry], None]] = None


def train_steps(args, ops, model, dataset, cfg, lay: Layout, device, metrics, *, start: int, form: StepForm,
                hooks: StepHooks = StepHooks(), workers: int = 0) -> list:
    """Run steps [start, args.train_iters); returns the mean sample loss per step (None where not read back).
    ``ops``: TorchOps or FsdpOps over all ranks; ``cfg``: the DiTConfig of the same widths (MFU); ``form``: StepForm;
    ``hooks``: StepHooks."""
    save, on_grads, after_step = hooks.save, hooks.on_grads, hooks.after_step
    guard = StepGuard(args.check_for_nan_in_loss_and_grad, args.skip_nonfinite_steps, lay.rank, lay.world,
                      lay.dp_world)
    spikes = SpikeDetector(args.loss_spike_factor)
    tel = Telemetry(metrics, cfg=cfg, device=device, world=lay.world, interval=args.log_interval, timing=args.timing,
                    tensorboard_dir=args.tensorboard_dir, writer_rank=lay.rank == 0)
    batches = WanStepBatches(dataset, start=start, stop=args.train_iters, seed=args.seed, dp_rank=lay.dp_rank,
                             dp_world=lay.dp_world, micro_batch=args.micro_batch_size, shift=args.timestep_shift,
                             task=form.task)
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses: list = []
    with GcTimer() as gc_timer:
        for step, batch, ids in step_batches(batches, device, workers, form.dtype):
            ev = tel.events()
            if ev:
                ev.mark(0)
            ops.zero_grad()
            loss = flow_loss(model, batch, form.autocast, form.task)
            ops.backward(loss * lay.sp_world)   # the SUM over SP ranks under the average over all ranks (docstring)
            if ev:
                ev.mark(1)
            grad_norm = ops.grads_ready()
            if on_grads is not None:
                on_grads(step)
            vec = guard.reduce(loss / lay.sp_world, grad_norm)
            value, apply = vec[0], True
            if guard.enabled:
                verdict = guard.read(vec)
                value = verdict.loss
                apply = guard.decide(verdict, step, describe_samples(dataset, ids))
                out = ops.update() if apply else ops.discard()
                if value is not None and apply:
                    spikes.update(step, value, describe_samples(dataset, ids))
            else:
                out = ops.update()
            if ev:
                ev.mark(2)
            losses.append(value)
            x = batch["x"]
            grid = [n // p for n, p in zip(x.shape[2:], cfg.patch)]
            tokens = grid[0] * grid[1] * grid[2]
            tel.record(step, value, out if out is not None else grad_norm, ops.lr(),
                       tokens * x.shape[0] * lay.dp_world, tokens, len(guard.skipped), ev,
                       {"tokens": tokens, "gc_ms": gc_timer.take()})
            if save is not None and args.save and args.save_interval and (step + 1) % args.save_interval == 0:
                tel.flush()
                save(step + 1)
            if after_step is not None:
                after_step(step + 1, tel)
    tel.close()
    if guard.skipped and lay.rank == 0:
        log.warning("skipped %d non-finite step(s): %s", len(guard.skipped), guard.skipped)
    rows = metrics.rows
    return [r["loss"] for r in rows[-len(losses):]] if losses else []
