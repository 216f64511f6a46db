"""Timed trials inside a model's forward, kept out of activation checkpointing.

The ``auto`` policies (sp.calibration's ModePolicy, head_chunks="auto", the block policies, varlen_kernel="auto")
time their candidates, fwd+bwd on private tensors, inside the caller's forward the first time a shape is seen. Under
torch's non-reentrant checkpoint (``torch.utils.checkpoint(use_reentrant=False)``) every tensor saved for backward
goes through the checkpoint's saved-tensor hooks: a trial's tensors were counted in the first forward but not in
the recompute (the choice is cached by then), and the backward raised CheckpointError ("A different number of
tensors was saved"). ``isolated_trial`` pushes its own saved-tensor hooks, which keep each tensor as autograd
would without hooks (torch applies only the innermost pair), so a trial saves nothing through the checkpoint's,
or any other outer, hooks (CPU offload included). Reentrant checkpoint installs no hooks: nothing to isolate.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _pack(t: torch.Tensor) -> torch.Tensor:
    # detached: the packed value must not hold the tensor's grad_fn (a reference cycle); autograd re-attaches it
    return t.detach() if t.requires_grad else t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def isolated_trial() -> Iterator[None]:
    """Within: tensors saved for backward bypass every outer saved-tensor hook (activation checkpointing's); wrap a
    whole timed measurement (warm-ups and rounds) that runs inside a model's forward."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield
