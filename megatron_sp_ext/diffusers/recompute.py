"""Gradient checkpointing that keeps the self-attention: every block of a parallelized diffusers Wan model is
recomputed in the backward EXCEPT its self-attention call, whose autograd node keeps what the kernel saves (q, k, v,
the output and its log-sum-exp) as it would without checkpointing.

    sp = parallelize(model, group)
    keep_attention_checkpointing(sp)        # instead of model.enable_gradient_checkpointing()

How: diffusers' ``enable_gradient_checkpointing(gradient_checkpointing_func=...)`` runs every block through
``torch.utils.checkpoint.checkpoint`` (non-reentrant) with a ``context_fn``: its forward context RECORDS each
attention output of the block (the attention runs under an identity ``saved_tensors_hooks``, so its node saves its
tensors plainly instead of handing them to the checkpoint), and its recompute context REPLAYS them: the recomputed
block gets the recorded output without running the attention (no kernel, no exchange); everything else of the block
(norms, modulation, projections, QK-norm, RoPE, the sparse plan's branch, cross-attention, FFN) is recomputed as in
diffusers' full checkpointing. The numbers are those of full checkpointing and of no checkpointing, bit for bit.

Why not torch's selective checkpointing policy (``create_selective_checkpoint_contexts``): its policy sees aten ops,
and the sequence-parallel attention is a Python autograd Function of several ops with collectives that write into
buffers in place (c10d's all-to-all), which its cache refuses to replay; the processor knows the one call to keep.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Optional

import torch

from ..errors import SPConfigError


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class KeptAttention:
    """The record / replay switch the processors of one parallelized model consult (``run``). ``calls``: attention
    calls that ran (recorded or outside any checkpoint); ``replayed``: calls answered from the record."""

    def __init__(self) -> None:
        self._mode, self._store = None, None
        self.calls, self.replayed = 0, 0

    def run(self, attention: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
        """``attention(*args, **kwargs)``, kept (recording), answered from the record (replaying), or plain."""
        if self._mode == "replay":
            if not self._store:
                raise SPConfigError("keep_attention_checkpointing: a block's recompute asked for more attention "
                                    "outputs than its forward recorded (the block calls its self-attention a "
                                    "different number of times in the recompute)")
            self.replayed += 1
            return self._store.popleft()
        self.calls += 1
        if self._mode != "record":
            return attention(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):   # saved plainly, not by the checkpoint
            out = attention(*args, **kwargs)
        self._store.append(out)
        return out

    @contextlib.contextmanager
    def _within(self, mode: str, store: deque):
        outer = (self._mode, self._store)
        self._mode, self._store = mode, store
        try:
            yield
        finally:
            self._mode, self._store = outer

    def contexts(self) -> tuple:
        """checkpoint's ``context_fn``: (forward context, recompute context) sharing one record."""
        store: deque = deque()
        return self._within("record", store), self._within("replay", store)

    def checkpoint(self, module: torch.nn.Module, *args) -> torch.Tensor:
        """diffusers' ``_gradient_checkpointing_func``: ``module(*args)`` checkpointed; its attention kept where
        the block's self-attention processor consults this object (the others recompute whole)."""
        proc = getattr(getattr(module, "attn1", None), "processor", None)
        keep = getattr(proc, "kept", None) is self
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False,
                                                 context_fn=self.contexts if keep else
                                                 torch.utils.checkpoint.noop_context_fn)


def keep_attention_checkpointing(handle, num_layers: Optional[int] = None) -> KeptAttention:
    """Turn on gradient checkpointing of every block of ``handle.model`` (a ``parallelize`` handle) with the
    self-attention kept (module docstring) in the first ``num_layers`` layers (None: all, VACE's blocks too; the
    other blocks recompute whole, as diffusers' checkpointing: less memory); returns the ``KeptAttention`` the
    processors consult (its counters). ``handle.remove()`` takes the processors away; the model's checkpointing then
    recomputes whole blocks (``model.disable_gradient_checkpointing()`` turns it off)."""
    if getattr(handle, "removed", True) or not getattr(handle, "processors", None):
        raise SPConfigError("keep_attention_checkpointing takes the handle parallelize returned (not removed)")
    layers = len(handle.model.blocks)
    if num_layers is not None and not 0 <= num_layers <= layers:
        raise SPConfigError(f"keep_attention_checkpointing: num_layers={num_layers}; the model has {layers} layers "
                            f"(0..{layers}, or None for all)")
    kept = KeptAttention()
    for proc in handle.processors:
        main = proc.where.startswith("blocks.")
        if num_layers is None or (main and proc.layer_index < num_layers):
            proc.kept = kept
    handle.model.enable_gradient_checkpointing(gradient_checkpointing_func=kept.checkpoint)
    return kept
