"""A diffusers model's ``_cp_plan`` carried out with torch's module hooks (no diffusers hook registry, nothing of
diffusers patched).

    state = SequenceState(group, sp_size, sparse)
    handles = install_plan(model, type(model)._cp_plan, state)     # list of torch RemovableHandle
    for h in handles: h.remove()

The model's own forward pre-hook first sets ``state.ctx`` (the patch grid of ``hidden_states`` [B, C, F, H, W] and,
with a SparseAttentionPlan, its token order) and, with ``state.check_inputs``, checks that every SP rank was given the
same inputs (inputs.py: one all_gather per model forward, on every rank), then every plan entry:
- ``{name: ContextParallelInput(split_dim, expected_dims, split_output=False)}`` at module M: M's input ``name`` is
  put in the token order and sharded along split_dim (a forward pre-hook with kwargs);
- ``{index: ContextParallelInput(..., split_output=True)}``: M's output ``index`` likewise (a forward hook);
- ``ContextParallelOutput(gather_dim, expected_dims)``: M's output is gathered and put back in raster order.
Entries are read by their fields (diffusers' classes live in a private module). A tensor whose dimension count
differs from ``expected_dims`` is left whole, as diffusers' own hooks do (Wan's 1-D
timestep: one per sample, not per token). Hooks fire again when gradient checkpointing recomputes a layer: the split
of the same full input gives the same shard, in the context of the forward that built the graph (not the latest
one): torch's non-reentrant checkpoint reruns a layer on its original argument objects, and ``SequenceState.contexts``
maps the tensors a forward hands to its blocks (the rope's sharded cos/sin, blocks.0's full hidden_states) to that
forward's context, so two forwards before one backward recompute each in its own grid and token order.
A split hook sits on a block, which ``fuse_elementwise`` compiles with its hooks: it is opaque to the compiler
(``torch.compiler.disable``), like the self-attention.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import SPConfigError
from .inputs import INPUT_NAMES, check_same_inputs
from .sequence import ForwardContext, gather_tokens, split_tokens


@dataclass
class SequenceState:
    """What the hooks and processors of one parallelized model share: the SP group (None: one rank), its size, the
    SparseAttentionPlan (or None), whether each forward checks its inputs are the same on every rank, the current
    forward's ``ForwardContext`` and ``contexts``: the tensors each
    forward handed to its layers -> that forward's context (weak keys by identity: entries go with the tensors)."""

    group: Optional[dist.ProcessGroup]
    sp_size: int
    sparse: Any = None
    patch_size: tuple = (1, 1, 1)
    check_inputs: bool = True
    ctx: Optional[ForwardContext] = field(default=None)
    contexts: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary, repr=False)

    def remember(self, tensors, ctx: ForwardContext) -> None:
        """Tie ``tensors`` (an iterable; non-tensors skipped) to ``ctx``, the forward that made them."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.contexts[t] = ctx

    def context_of(self, values) -> ForwardContext:
        """The context of the forward that made the first remembered tensor among ``values`` (tensors, or tuples /
        lists of them, e.g. a layer's inputs); the current forward's when none is remembered (its first run)."""
        for v in values:
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor):
                    ctx = self.contexts.get(t)
                    if ctx is not None:
                        return ctx
        return self.current()

    def current(self) -> ForwardContext:
        if self.ctx is None:
            raise SPConfigError("parallelize: a parallelized layer ran outside the model's forward (its context, set "
                                "by the model's forward, is missing): call the model, not its layers")
        return self.ctx


def is_split(entry: Any) -> bool:
    """A plan's split entry (diffusers' ContextParallelInput: split_dim, expected_dims, split_output)."""
    return all(hasattr(entry, a) for a in ("split_dim", "expected_dims", "split_output"))


def is_gather(entry: Any) -> bool:
    """A plan's gather entry (diffusers' ContextParallelOutput: gather_dim, expected_dims)."""
    return all(hasattr(entry, a) for a in ("gather_dim", "expected_dims"))


def _param_names(module: torch.nn.Module) -> list[str]:
    """The forward's parameter names after self, in order."""
    return list(inspect.signature(type(module).forward).parameters)[1:]


def _locate(names: list[str], name: str, args: tuple, kwargs: dict):
    """(value, where) of input ``name``: where is "kw", an int position, or None when not passed."""
    if name in kwargs:
        return kwargs[name], "kw"
    if name in names and names.index(name) < len(args):
        i = names.index(name)
        return args[i], i
    return None, None


def _put(args: tuple, kwargs: dict, name: str, where, value) -> tuple[tuple, dict]:
    if where == "kw":
        return args, {**kwargs, name: value}
    args = list(args)
    args[where] = value
    return tuple(args), kwargs


def full_input_kept(model: torch.nn.Module, module: torch.nn.Module) -> bool:
    """Whether a full input of ``module`` lives through its call anyway, so that its shard is best a view (no
    copy): the model's own inputs (the caller holds them), any input without autograd, and a layer's arguments under
    the model's gradient checkpointing (kept for the recompute). Otherwise (a layer with autograd, no checkpointing)
    a view saved for backward would keep the whole full tensor: the shard is copied and the full freed."""
    return (module is model or not torch.is_grad_enabled()
            or bool(getattr(model, "gradient_checkpointing", False)))


def _split_inputs_hook(entries: dict, state: SequenceState, names: list[str], model: torch.nn.Module):
    @torch.compiler.disable   # on blocks.0, inside a compiled block's call (fused.py): run eagerly, not traced
    def hook(module, args, kwargs):
        ctx = state.context_of([*args, *kwargs.values()])     # a recompute: the forward that built the graph
        view = full_input_kept(model, module)
        for name, cpi in entries.items():
            value, where = _locate(names, name, args, kwargs)
            if not isinstance(value, torch.Tensor) or (cpi.expected_dims not in (None, value.dim())):
                continue
            state.remember([value], ctx)
            shard = split_tokens(value, state.group, cpi.split_dim, ctx, view=view)
            args, kwargs = _put(args, kwargs, name, where, shard)
        return args, kwargs
    return hook


def _map_outputs(output, entries: dict, fn):
    """``output`` (a tensor or a tuple/list of them) with ``fn(x, entry)`` applied at each index of ``entries``
    whose entry expects ``x``'s number of dims (or any); the container's type kept."""
    single = isinstance(output, torch.Tensor)
    outs = [output] if single else list(output)
    for index, entry in entries.items():
        if entry is not None and (entry.expected_dims is None or outs[index].dim() == entry.expected_dims):
            outs[index] = fn(outs[index], entry)
    return outs[0] if single else type(output)(outs)


def _split_outputs_hook(entries: dict, state: SequenceState):
    def hook(module, args, output):
        ctx = state.current()

        def split(x, cpi):   # a copy: the full output (e.g. rope's cos/sin tables) is then freed
            shard = split_tokens(x, state.group, cpi.split_dim, ctx)
            state.remember([shard], ctx)     # e.g. rope's cos/sin shards, handed to every layer
            return shard
        return _map_outputs(output, entries, split)
    return hook


def _gather_output_hook(cpos: list, state: SequenceState):
    def hook(module, args, output):
        ctx = state.current()
        return _map_outputs(output, dict(enumerate(cpos)),
                            lambda x, cpo: gather_tokens(x, state.group, cpo.gather_dim, ctx))
    return hook


def _context_hook(state: SequenceState, names: list[str]):
    def hook(module, args, kwargs):
        x, _ = _locate(names, "hidden_states", args, kwargs)
        if state.check_inputs:   # a per-model setting, before any per-rank refusal: every rank reaches the collective
            check_same_inputs({name: _locate(names, name, args, kwargs)[0] for name in INPUT_NAMES}, state.group)
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            raise SPConfigError(f"parallelize: {type(module).__name__}'s hidden_states must be a latent "
                                f"[B, C, F, H, W]; got {type(x).__name__} {list(getattr(x, 'shape', []))}")
        grid = tuple(int(n) // int(p) for n, p in zip(x.shape[2:], state.patch_size))
        state.ctx = ForwardContext.of(grid, state.sparse, x.device, state.sp_size)
        return None
    return hook


def install_plan(model: torch.nn.Module, plan: dict, state: SequenceState) -> list:
    """Register the context hook and ``plan``'s split/gather hooks on ``model``; returns the hook handles (the
    context hook first, so it runs before the model's own split entry "")."""
    handles = [model.register_forward_pre_hook(_context_hook(state, _param_names(model)), with_kwargs=True)]
    try:
        _install_entries(model, plan, state, handles)
    except BaseException:
        for h in handles:   # nothing left behind on a refused plan
            h.remove()
        raise
    return handles


def _install_entries(model: torch.nn.Module, plan: dict, state: SequenceState, handles: list) -> None:
    for name, entry in plan.items():
        module = model.get_submodule(name)
        if is_gather(entry) or (isinstance(entry, (list, tuple)) and all(e is None or is_gather(e) for e in entry)):
            cpos = [entry] if is_gather(entry) else list(entry)
            handles.append(module.register_forward_hook(_gather_output_hook(cpos, state)))
            continue
        if not isinstance(entry, dict) or not all(is_split(v) for v in entry.values()):
            raise SPConfigError(f"parallelize: {type(model).__name__}._cp_plan[{name!r}] = {entry!r} is not a plan "
                                f"entry this client carries out (ContextParallelInput per input/output, or "
                                f"ContextParallelOutput)")
        inputs = {k: v for k, v in entry.items() if not v.split_output}
        outputs = {k: v for k, v in entry.items() if v.split_output}
        if inputs:
            handles.append(module.register_forward_pre_hook(
                _split_inputs_hook(inputs, state, _param_names(module), model), with_kwargs=True))
        if outputs:
            handles.append(module.register_forward_hook(_split_outputs_hook(outputs, state)))
