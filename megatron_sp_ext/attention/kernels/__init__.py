"""Local attention kernels: the registry (``registry``: every kernel, what it declares, every list of names) and the
one choice of a kernel per call (``choose``), under one import. A kernel module per kernel (``base``: what a kernel
is). No kernel name is compared anywhere outside this package (tests/test_registry.py scans)."""
from __future__ import annotations

import torch

from .base import NEEDS, Capabilities, Kernel, KernelCall, LseFunction
from .choose import (AUTO_SETTINGS, PICKS, auto_order, candidates, choose, is_auto, pick, require,
                     via_torch_sdpa)
from .cudnn import dense, grad_in_own_layout
from .registry import (AUTO, FALLBACK, ORDER, TILE_ORDER, by_setting, get, label, names, of_varlen_method,
                       settings, varlen_methods, why_not)


def torch_sdpa_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q, k, v as a plain call through torch's SDPA dispatch gets them: contiguous on CUDA, where torch picks cuDNN
    on Hopper whichever kernel the registry named (why: kernels/cudnn.py), as they are elsewhere."""
    return dense(q, k, v) if q.is_cuda else (q, k, v)


def torch_sdpa_output(out: torch.Tensor) -> torch.Tensor:
    """The output of a plain call through torch's SDPA dispatch: on CUDA its gradient reaches SDPA's backward in
    the output's own layout (``cudnn.grad_in_own_layout``: torch's cuDNN graph cache), as it is elsewhere."""
    return grad_in_own_layout(out) if out.is_cuda else out


__all__ = ["Capabilities", "Kernel", "KernelCall", "LseFunction", "NEEDS", "ORDER", "AUTO", "TILE_ORDER", "FALLBACK",
           "PICKS", "AUTO_SETTINGS", "get", "names", "auto_order", "candidates", "choose", "is_auto",
           "via_torch_sdpa", "torch_sdpa_inputs", "torch_sdpa_output", "by_setting", "settings", "varlen_methods",
           "of_varlen_method", "why_not", "pick", "label", "require"]
