"""Local attention kernels: the registry (``registry``: every kernel, what it declares, every list of names) and the
one choice of a kernel per call (``choose``), under one import. A kernel module per kernel (``base``: what a kernel
is). No kernel name is compared anywhere outside this package (tests/test_registry.py scans)."""
from __future__ import annotations

from .base import NEEDS, Capabilities, Kernel, KernelCall, LseFunction
from .choose import (AUTO_SETTINGS, PICKS, auto_order, candidates, choose, dropout_kernel, is_auto, pick,
                     plain_kernel, require, torch_sdpa, via_torch_sdpa)
from .registry import (AUTO, FALLBACK, ORDER, SDPA, TILE_ORDER, by_setting, get, label, names, of_varlen_method,
                       settings, varlen_methods, why_not)
from .sdpa import torch_sdpa_inputs, torch_sdpa_output

__all__ = ["Capabilities", "Kernel", "KernelCall", "LseFunction", "NEEDS", "ORDER", "AUTO", "TILE_ORDER", "FALLBACK",
           "SDPA", "PICKS", "AUTO_SETTINGS", "get", "names", "auto_order", "candidates", "choose", "is_auto",
           "plain_kernel", "dropout_kernel", "torch_sdpa", "via_torch_sdpa", "torch_sdpa_inputs", "torch_sdpa_output",
           "by_setting", "settings", "varlen_methods", "of_varlen_method", "why_not", "pick", "label", "require"]
