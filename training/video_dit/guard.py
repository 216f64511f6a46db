"""Non-finite guard: the loss and gradient norm of every step, agreed by all ranks with ONE small all-reduce.

``StepGuard.reduce`` builds, on every rank, the vector
    [ loss_r / dp_world,  loss_bad[0..world-1],  grad_bad[0..world-1] ]
(rank r sets only its own flags) and all-reduces it (sum) over all ranks: element 0 is then the mean
sample loss (engine.sample_loss's value) and the flags say which ranks saw a non-finite loss or
gradient norm. The gradient norm is the one clipping computes anyway. With the check on, the vector
is read back (one host sync per step, as the clip of Megatron's own optimizer does) and ``verdict``
decides before the optimizer step: stop with ``NonFiniteError`` naming the step, the ranks and the
batch's samples, or skip the update (``--skip-nonfinite-steps N``: counted; the run stops past N).
With the check off nothing is read back: the loss stays on the device for the metrics.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger("video_dit")


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is NaN/Inf (and skipping is off or exhausted)."""


@dataclass
class Verdict:
    ok: bool
    loss: Optional[float] = None               # mean sample loss (None when not read back)
    loss_ranks: list = field(default_factory=list)
    grad_ranks: list = field(default_factory=list)


class StepGuard:
    """One per run; ``enabled`` = --check-for-nan-in-loss-and-grad, ``max_skips`` = --skip-nonfinite-steps."""

    def __init__(self, enabled: bool, max_skips: int, rank: int, world: int, dp_world: int, group=None) -> None:
        if max_skips < 0:
            raise ValueError(f"--skip-nonfinite-steps={max_skips}: must be >= 0")
        self.enabled, self.max_skips, self.group = enabled, max_skips, group
        self.rank, self.world, self.dp_world = rank, world, dp_world
        self.skipped: list = []  # steps skipped so far

    def reduce(self, loss_r: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> torch.Tensor:
        """The all-reduced vector (see module docstring), on loss_r's device; no host sync."""
        v = torch.zeros(1 + 2 * self.world, dtype=torch.float32, device=loss_r.device)
        v[0] = loss_r.detach().float() / self.dp_world
        v[1 + self.rank] = (~torch.isfinite(loss_r.detach())).float()
        if grad_norm is not None:
            v[1 + self.world + self.rank] = (~torch.isfinite(grad_norm.detach())).float()
        if self.world > 1:
            dist.all_reduce(v, group=self.group)
        return v

    def read(self, v: torch.Tensor) -> Verdict:
        """Host read-back of ``reduce``'s vector (one sync)."""
        vals = v.tolist()
        lr = [r for r in range(self.world) if vals[1 + r] > 0]
        gr = [r for r in range(self.world) if vals[1 + self.world + r] > 0]
        return Verdict(not lr and not gr, vals[0], lr, gr)

    def decide(self, verdict: Verdict, step: int, samples: list) -> bool:
        """True: apply the update; False: skip it (counted). Raises NonFiniteError to stop.
        ``samples``: this rank's sample names of the step (files or ids); gathered from all ranks on failure."""
        if verdict.ok:
            return True
        names = _gather_names(samples, self.world, self.group)
        where = []
        if verdict.loss_ranks:
            where.append(f"loss non-finite on rank(s) {verdict.loss_ranks}")
        if verdict.grad_ranks:
            where.append(f"gradient norm non-finite on rank(s) {verdict.grad_ranks}")
        bad = sorted(set(verdict.loss_ranks) | set(verdict.grad_ranks))
        batch = "; ".join(f"rank {r}: {', '.join(map(str, names[r]))}" for r in bad)
        msg = f"step {step}: {' and '.join(where)}; batch samples: {batch}"
        if len(self.skipped) < self.max_skips:
            self.skipped.append(step)
            if self.rank == 0:
                log.warning("skipping step %s (%d of at most %d, --skip-nonfinite-steps): %s", step,
                            len(self.skipped), self.max_skips, msg)
            return False
        extra = (f"; already skipped {len(self.skipped)} step(s) {self.skipped}, the most --skip-nonfinite-steps="
                 f"{self.max_skips} allows" if self.max_skips
                 else "; pass --skip-nonfinite-steps N to skip up to N such steps")
        raise NonFiniteError(f"non-finite training step, stopped before the optimizer update and before any "
                             f"checkpoint write: {msg}{extra}")


def _gather_names(samples: list, world: int, group) -> list:
    if world == 1:
        return [samples]
    out: list = [None] * world
    dist.all_gather_object(out, list(samples), group=group)
    return out


class SpikeDetector:
    """Warn when a loss exceeds ``factor`` x the median of the last ``window`` finite losses (no stop)."""

    def __init__(self, factor: float = 3.0, window: int = 50, min_history: int = 10) -> None:
        self.factor, self.window, self.min_history = factor, window, min_history
        self.history: list = []
        self.spikes: list = []

    def update(self, step: int, loss: float, samples: Optional[list] = None) -> bool:
        spike = False
        if len(self.history) >= self.min_history and self.factor > 0:
            med = sorted(self.history)[len(self.history) // 2]
            if loss == loss and med > 0 and loss > self.factor * med:
                spike = True
                self.spikes.append(step)
                log.warning("loss spike at step %s: %.4g > %.3g x running median %.4g (samples: %s)", step, loss,
                            self.factor, med, samples)
        if loss == loss and abs(loss) != float("inf"):
            self.history = (self.history + [loss])[-self.window:]
        return spike
