"""Megatron-LM's manual garbage collection (``--manual-gc``, ``--manual-gc-interval``) for the step loop.

Python's threshold-triggered collector runs wherever an allocation crosses its threshold; in a training
step that is often between two steps, where the host has no lead on the GPU and a collection of a large
heap (compiled kernels' Python objects) leaves the GPU idle, at a different step on every rank. With
``--manual-gc`` the automatic collector is off for the loop and a full collection runs every
``--manual-gc-interval`` steps (0: none between steps), at the same step on every rank. The heap built before
the loop (modules, the model) is collected once and frozen (``gc.freeze``), so these collections walk only the
objects the steps made: on the tiny CPU demo a full collection of the unfrozen heap takes ~190 ms.
"""
from __future__ import annotations

import gc


class ManualGc:
    """A context manager over the step loop: ``enabled`` turns the automatic collector off inside the block (one
    full collection on entry, then the survivors frozen) and restores its previous state on exit (unfrozen);
    ``step_done(step)`` collects after every ``interval``-th step (0: never)."""

    def __init__(self, enabled: bool, interval: int = 0) -> None:
        if interval < 0:
            raise ValueError(f"--manual-gc-interval={interval}: must be >= 0 (0: no collection between steps)")
        self.enabled, self.interval = enabled, interval
        self._was_enabled = True

    def __enter__(self) -> "ManualGc":
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
            gc.freeze()
        return self

    def step_done(self, step: int) -> None:
        """After step ``step`` (0-based) ran: a full collection when ``(step + 1) % interval == 0``."""
        if self.enabled and self.interval and (step + 1) % self.interval == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.enabled:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
