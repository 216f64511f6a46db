"""Parameter / gradient / optimizer-state sharding beside sequence parallelism (Megatron-LM's --use-torch-fsdp2).

SP (context-parallel) ranks hold the same parameters, so FSDP2 shards over the data x context group, as
Megatron does: one ``fully_shard`` per transformer block, then the root. bf16 compute with fp32 main weights is
FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32 parameters, under the same autocast
as the unsharded run, with cast_forward_inputs=False: FSDP2's default casts every floating-point input of every
sharded module to bf16, which would round the blocks' float64 RoPE angles and the root's timesteps (before their
x1000 sinusoidal embedding), a different model from the unsharded one; autocast already casts what the matmuls
take. FSDP2's root moves the forward's tensor arguments to the CUDA device (token ids included): the model builds
whatever it makes on the fly on its inputs' devices (rope.py). Gradients are averaged
over the data x context ranks by FSDP2's reduce-scatter (the same average TorchOps does with an all-reduce).
Checkpoints go through training/video_dit/checkpoint.py (torch.distributed.checkpoint get_state_dict /
set_state_dict), which reshards DTensors across FSDP and SP sizes.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from megatron_sp_ext.errors import SPConfigError


def check_fsdp2_flags(use_torch_fsdp2: bool, **other: bool) -> Optional[str]:
    """The message for a flag that cannot go with --use-torch-fsdp2 (None when the combination works).
    ``other``: flag name (with dashes) -> whether it was given."""
    if not use_torch_fsdp2:
        return None
    bad = [name for name, on in other.items() if on]
    if bad:
        return (f"--use-torch-fsdp2 cannot run with {', '.join(bad)}: FSDP2 already shards parameters, gradients "
                f"and optimizer state over data x context ranks (drop {', '.join(bad)})")
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
        return f"--use-torch-fsdp2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this is {torch.__version__}"
    return None


def shard_model(model: torch.nn.Module, dp_cp_group: dist.ProcessGroup, device: torch.device,
                bf16: bool) -> torch.nn.Module:
    """FSDP2 over ``dp_cp_group``: each of ``model.blocks`` and the root; fp32 parameters, bf16 compute when
    ``bf16`` (reduce in fp32; the forward must run under bf16 autocast, as the entry's does: inputs are not cast).
    Returns the same module (fully_shard works in place)."""
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise SPConfigError("--use-torch-fsdp2 keeps fp32 parameters (main weights); got another dtype")
    mesh = DeviceMesh.from_group(dp_cp_group, device_type=device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False) \
        if bf16 else MixedPrecisionPolicy(cast_forward_inputs=False)
    for module in (*model.blocks, model):
        module.register_forward_hook(own_output_views)   # before fully_shard's: it then sees the copies
        fully_shard(module, mesh=mesh, mp_policy=mp)
    return model


def own_output_views(module: torch.nn.Module, args, output):
    """A forward hook: every output that requires grad and is a view (e.g. a Linear's [B, S, C] output, a view of
    its 2-D matmul; diffusers' unpatchify) becomes a tensor of its own. FSDP2 puts its pre-backward hook (the
    all-gather of the module's parameters for the backward) on the module's outputs, and an in-place op on a view
    output would silently drop it, so FSDP2 warns "returned a view tensor" about every such output; a copy, the
    size of the output (the model's: latent-sized), takes the risk and the warning away."""
    return tree_map_only(torch.Tensor, lambda t: t.clone() if t.requires_grad and t._base is not None else t, output)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class FsdpOps:
    """The train loop's adapter for an FSDP2 model + torch AdamW over its DTensor shards: the gradients are
    already averaged (reduce-scatter in backward); the norm is the global one (DTensor reduction)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, clip: float) -> None:
        self.model, self.opt, self.clip = model, opt, clip

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def grads_ready(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, norm, foreach=True)
        return _local(norm)

    def update(self) -> None:
        self.opt.step()
        return None

    def discard(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])


def full_parameters(model: torch.nn.Module) -> dict:
    """name -> full (unsharded) parameter tensor, on every rank (collective for FSDP2 models)."""
    return {n: _local(p.detach()).clone() for n, p in model.named_parameters()}
