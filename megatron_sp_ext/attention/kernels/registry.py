"""The registry of local attention kernels: one module per kernel, each declaring what it can do (``base``).

Every list of kernel names in the library derives from here (the ``backend`` setting's choices, the log-sum-exp
kernels, the varlen methods, the block-sparse kernels); which kernel runs a call is decided in one place, ``choose``
("auto": the first kernel of ``AUTO``, or of ``TILE_ORDER`` then AUTO for a block-sparse call, that can run it). No
kernel name is compared anywhere outside this package (tests/test_registry.py scans).

ORDER is fastest first on Hopper, measured (fwd+bwd, bf16, D=128; ../shared/ENVIRONMENT.md):
  fa4    FlashAttention-4: 1.12-1.17x cuDNN dense (H200, 2026-11-24); block-sparse 440-571 useful TFLOP/s at
         128-token tiles (H100, 2026-11-25)
  cudnn  cuDNN through torch: 511-528 TFLOP/s backward, 561-654 forward (H200, 2026-11-24)
  flash  torch's FlashAttention-2: below cuDNN on Hopper; the CPU's fused op
  flex   flex_attention, block-sparse only: 323-392 useful TFLOP/s at 128-token tiles, 59-255 at 64 (H100)
  math   the fp32 reference: any device, dtype and mask (4 useful TFLOP/s as a ring step kernel)
  flash_attn, te: plain calls only, never picked by "auto" (named by the user).
  torch_sdpa: torch's own SDPA dispatch (it picks cuDNN, FlashAttention-2, efficient or math per call), the one place
         the library calls F.scaled_dot_product_attention: "auto"'s plain calls where its log-sum-exp kernel is
         one of torch's, attention dropout, explicit masks (``choose.plain_kernel`` / ``dropout_kernel`` /
         ``torch_sdpa``); not a setting (``offered`` False).
  cudnn_block_sparse: cuDNN frontend's block sparsity (nvidia-cudnn-frontend), native 64- and 128-token blocks:
         block-sparse calls only. Its place among the block-sparse kernels is per call (``TILE_ORDER``, by the
         call's tile size), not ORDER's.

Block-sparse calls ("auto"): ``TILE_ORDER`` puts the kernels it names first, in its order, for a call whose tile size it
lists, then the rest of AUTO. The order is the kernel table's (tools/bench_block_sparse.py --table --table-kernels
cudnn_block_sparse,fa4, H=40 and 5, S 32K / 75K, 90% random / top-k / window, fwd+bwd as a fraction of dense FA4's
useful rate; 1 x H100 of 4, 2026-11-27, results/2026-11-27_h100x4_2045):
  tiles of a multiple of 128 tokens: FA4 first (0.72-0.89 of dense FA4; cuDNN's 0.60-0.75)
  other tiles (64, 192, ...): cuDNN's first (0.48-0.65 of dense FA4; FA4 cuts its 128-token blocks: 0.12-0.51)
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from .base import Kernel, KernelCall
from .cudnn import CudnnKernel
from .cudnn_block_sparse import CudnnBlockSparseKernel
from .fa4 import FA4Kernel
from .flash_attn import FlashAttnKernel
from .flex import FlexKernel
from .math import MathKernel
from .sdpa import TorchSdpaKernel
from .te import TEKernel
from .torch_flash import TorchFlashKernel

_CLASSES = (FA4Kernel, CudnnKernel, TorchFlashKernel, FlexKernel, CudnnBlockSparseKernel, MathKernel, FlashAttnKernel,
            TEKernel, TorchSdpaKernel)
ORDER = tuple(c.name for c in _CLASSES)
SDPA = TorchSdpaKernel.name   # torch's own SDPA dispatch: reached through the chooser only (not offered)
AUTO = ("fa4", "cudnn", "flash", "flex", "cudnn_block_sparse", "math")     # what "auto" may pick, in this order
# block-sparse calls: (tile size multiple, kernels first in this order); the first entry whose multiple divides the
# call's tile size applies. Measured on H100 (module docstring; 2026-11-27): FA4 leads at 128-token tiles, cuDNN at 64.
TILE_ORDER = ((128, ("fa4", "cudnn_block_sparse")), (1, ("cudnn_block_sparse", "fa4")))
FALLBACK = "math"


@lru_cache(maxsize=None)
def get(name: str) -> Kernel:
    """The kernel called ``name`` (one instance per process)."""
    for c in _CLASSES:
        if c.name == name:
            return c()
    raise KeyError(name)


def names(*needs: str, auto_only: bool = False) -> tuple[str, ...]:
    """Kernel names (ORDER) whose declared capabilities cover ``needs`` (no device check); without "tiles" among
    ``needs``, only kernels with dense calls. "deterministic": a backward with the same bits on every rerun under
    torch's deterministic switch (for its block-sparse calls too when "tiles" is among ``needs``)."""
    out = []
    for n in (AUTO if auto_only else ORDER):
        caps = get(n).caps
        if not get(n).offered or "tiles" not in needs and not caps.dense:
            continue
        ok = {"plain": caps.plain, "lse": caps.lse, "varlen": caps.varlen is not None,
              "tiles": caps.tiles != "none", "dropout": caps.dropout,
              "deterministic": caps.deterministic == "all" if "tiles" in needs else caps.deterministic != "none"}
        if all(ok.get(need, True) for need in needs):
            out.append(n)
    return tuple(out)


def by_setting(setting: str) -> Optional[Kernel]:
    """The kernel a user's setting (``backend=...``) names, or None."""
    for n in ORDER:
        if get(n).offered and get(n).setting == setting:
            return get(n)
    return None


def settings() -> tuple[str, ...]:
    """Every offered kernel's setting name (ORDER)."""
    return tuple(get(n).setting for n in ORDER if get(n).offered)


def varlen_methods() -> tuple[str, ...]:
    """The varlen methods of the kernels that have one (ORDER)."""
    return tuple(get(n).caps.varlen for n in names("varlen"))


def of_varlen_method(method: str) -> Optional[Kernel]:
    """The kernel whose varlen method is ``method``, or None."""
    for n in names("varlen"):
        if get(n).caps.varlen == method:
            return get(n)
    return None


def why_not(name: str, call: KernelCall) -> Optional[str]:
    """None if kernel ``name`` runs ``call`` here, else the reason in a user's words."""
    return get(name).why_not(call)


def label(name: str) -> str:
    """Kernel ``name`` in a user's words."""
    return get(name).label
