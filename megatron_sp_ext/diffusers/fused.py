"""Fused elementwise work for a diffusers Wan model: diffusers' regional compilation (``compile_repeated_blocks``:
``torch.compile`` of every ``WanTransformerBlock``) with the project's Inductor options, for stock models and
parallelized ones alike.

    fused = fuse_elementwise(model)            # backend "inductor" (tests: "aot_eager"); before or after
                                               # parallelize, keep_attention_checkpointing, LoRA
    loss = ...; loss.backward()                # each block: its norms, AdaLN modulation, gated residuals, QK-norm,
                                               # RoPE, GELU and casts fused around the GEMMs, forward and backward
    fused.remove()                             # the blocks eager again

Why: diffusers' block runs its elementwise math unfused in float32 (FP32LayerNorm, ``norm * (1 + scale) + shift``,
``x + y * gate`` with ``.float()`` casts, RMSNorm of q and k, RoPE, GELU): a few full passes over [S, dim] each, in
the forward, a checkpoint's recompute and the backward. Compiled, the same math (the same ops; fused float32 sums may
add in another order) runs in a few kernels per region.

The parallelized self-attention (processor.py ``attend``: the sparse plan, the exchanges, FA4 / cuDNN / the
kept-attention record and replay) is opaque to the compiler (``torch.compiler.disable``), as are the sequence plan's
hooks (hooks.py): each block compiles to a graph before its attention and one after it, with one graph break between.
Gradient checkpointing (diffusers' or ``keep_attention_checkpointing``) wraps the compiled block from outside and
reruns it in the recompute. The blocks share their compiled code (parameters are graph inputs), so the compile time
does not grow with depth.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import torch

from ..errors import SPConfigError
from ..inductor import compile_options


@dataclass
class FusedLayers:
    """What ``fuse_elementwise`` did: the compiled layers (diffusers' repeated blocks) of ``model`` with
    ``backend``. ``remove()`` makes them eager again (idempotent)."""

    model: torch.nn.Module = field(repr=False)
    backend: Union[str, Callable]
    layers: list = field(default_factory=list, repr=False)
    removed: bool = False

    def remove(self) -> None:
        """Drop the layers' compiled call (``nn.Module.compile`` keeps it in ``_compiled_call_impl``): eager again."""
        if self.removed:
            return
        for layer in self.layers:
            layer._compiled_call_impl = None
        self.layers, self.removed = [], True


def fuse_elementwise(model: torch.nn.Module, backend: Union[str, Callable] = "inductor") -> FusedLayers:
    """Compile every repeated block of ``model`` (a diffusers model with ``_repeated_blocks``: WanTransformer3DModel
    and its VACE form; stock or parallelized) with ``backend`` (a ``torch.compiler.list_backends`` name:
    "inductor" fuses; "aot_eager" runs the same graphs op by op, for tests; or a backend callable) and the
    project's Inductor options (megatron_sp_ext.inductor). Compilation happens at the first call (the same graphs
    for every block of a kind: a few per kind and input shape, split at the attention). Returns the ``FusedLayers``
    handle. Raises SPConfigError naming what is refused: a model without repeated
    blocks, an unknown backend, blocks already compiled."""
    kinds = getattr(model, "_repeated_blocks", None)
    if not kinds or not hasattr(model, "compile_repeated_blocks"):
        raise SPConfigError(f"fuse_elementwise: {type(model).__name__} is not a diffusers model with repeated blocks "
                            f"(ModelMixin._repeated_blocks); it compiles diffusers' WanTransformer3DModel's blocks")
    known = torch.compiler.list_backends(exclude_tags=())
    if not callable(backend) and backend not in known:
        raise SPConfigError(f"fuse_elementwise: backend={backend!r}; valid: 'inductor' (fused kernels), 'aot_eager' "
                            f"(the same graphs unfused), or another of torch.compiler.list_backends()")
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    compiled = [type(m).__name__ for m in layers if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled:
        raise SPConfigError(f"fuse_elementwise: {len(compiled)} {compiled[0]} of this {type(model).__name__} are "
                            f"already compiled (compile_repeated_blocks or Module.compile, or an earlier "
                            f"fuse_elementwise: remove() its handle first)")
    options = compile_options(backend)
    model.compile_repeated_blocks(backend=backend, **({"options": options} if options else {}))
    return FusedLayers(model, backend, layers)
