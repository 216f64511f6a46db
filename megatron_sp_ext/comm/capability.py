"""What a process group can carry for tensors on a device, checked before a mode's first exchange.

gloo carries CUDA tensors in its collectives (all_to_all_single, all_gather: through host memory) but not point to
point: its send/recv of a CUDA tensor fails (``gloo/transport/tcp/pair.cc ... writev ... Bad address``) and leaves the
group broken for every later call. The ring family's hops (ring and TASP: their steps and dK|dV returns are
batched send/recv pairs; the inner ring of usp/tas; torus's stages) are point to point, unless the group spans
emulated machines, whose hops take the host-staged link (comm/host_staged.py). Ulysses/HCMS exchange by all-to-all
and run anywhere. Which modes exchange point to point is the mode registry's declaration (modes.py: ``p2p``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import modes
from ..errors import SPConfigError
from ..topology.emulate import spans_machines

GLOO_CUDA_P2P = ("a gloo group cannot send or receive CUDA tensors point to point (its send/recv fails and leaves "
                 "the group unusable)")


def p2p_unavailable_reason(group: Optional[dist.ProcessGroup], device: torch.device) -> Optional[str]:
    """Why ``group`` cannot exchange ``device`` tensors point to point, or None when it can (or needs not)."""
    if group is None or dist.get_world_size(group) == 1 or torch.device(device).type != "cuda":
        return None
    if dist.get_backend(group) != "gloo" or spans_machines(group):
        return None
    return GLOO_CUDA_P2P


def needs_p2p(mode: str, world: int) -> bool:
    """Whether ``mode`` exchanges point to point on a group of ``world`` (> 1) ranks (as the mode registry
    declares it: this layer knows no algorithm by name)."""
    return world > 1 and modes.get(mode).p2p


def check_p2p(what: str, group: Optional[dist.ProcessGroup], device: torch.device, instead: str) -> None:
    """Raise SPConfigError naming ``what`` (the user's setting or function) when ``group`` cannot run its hops on
    ``device`` tensors; ``instead``: what would run."""
    reason = p2p_unavailable_reason(group, device)
    if reason is not None:
        raise SPConfigError(f"{what} cannot run on this process group with CUDA tensors: {reason}; use an NCCL group "
                            f"for CUDA tensors, or {instead}")
