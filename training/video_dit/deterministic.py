"""``--deterministic-mode`` (Megatron-LM's flag name): the same bits on every rerun of a step on the same machine.

What it sets, before the first CUDA or NCCL call of the process:
  * ``torch.use_deterministic_algorithms(True)``: torch raises on an operation it knows to be nondeterministic
    (rather than running it), picks deterministic cuDNN / cuBLAS algorithms;
  * ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (what cuBLAS needs for deterministic GEMMs; kept when already set) and
    ``NCCL_ALGO=Ring`` (Megatron-LM's requirement: NVLS and the tree/ring switch by message size change the sum's
    order; kept when already set);
  * ``torch.backends.cudnn``: deterministic on, benchmark off.
The local attention kernel must be one whose backward is deterministic: ``math`` (GEMMs and softmax) or ``fa4``
(FlashAttention-4 runs its deterministic backward under torch's switch: attention/kernels/fa4.py); block-sparse
calls (``--sparse-attention``) need ``--sparse-attention-kernel math`` (FA4's block-sparse backward has no
deterministic form, and flex_attention's / cuDNN's are not shown to be). cuDNN and torch's
flash/efficient kernels accumulate dq (and, with GQA, dk/dv) with atomics, so a run that reruns a step (a resume's
control run, 4 x H100 2026-11-27: the same 200-step run twice differed from step 85 at lr 2e-3) cannot use them;
``auto`` may pick them: any other setting is refused by name.
"""
from __future__ import annotations

import os

import torch

from megatron_sp_ext.attention import kernels

from .sparse import SPARSE_FLAG, SPARSE_KERNEL_FLAG

FLAG = "--deterministic-mode"
KERNEL_FLAG = "--sp-attention-backend"
# the kernels whose backward reruns to the same bits (the registry's "deterministic" capability), by setting name:
# the dense attention's (--sp-attention-backend), and the block-sparse calls' (--sparse-attention-kernel)
DETERMINISTIC_KERNELS = tuple(kernels.get(n).setting for n in kernels.names("deterministic"))
DETERMINISTIC_SPARSE_KERNELS = tuple(kernels.get(n).setting for n in kernels.names("tiles", "deterministic"))
MODE_FLAG, ASYNC_FLAG = "--cp-comm-type", "--sp-async-qkv"


NAMES = {"backend": KERNEL_FLAG, "sparse": SPARSE_FLAG, "sparse_kernel": SPARSE_KERNEL_FLAG, "mode": MODE_FLAG,
         "async_qkv": ASYNC_FLAG}   # the Megatron entry's flags; the DeepSpeed entry names its JSON keys instead


def why_not(enabled: bool, backend: str, sparse: str = "none", sparse_kernel: str = "auto",
            mode: "str | list | None" = None, async_qkv: str = "off",
            names: "dict | None" = None) -> "str | None":
    """The refusal of ``--deterministic-mode`` with ``--sp-attention-backend backend`` (and ``--sparse-attention
    sparse`` run on ``--sparse-attention-kernel sparse_kernel``, ``--cp-comm-type mode``, ``--sp-async-qkv
    async_qkv``), or None when it runs. ``auto`` for the mode or the layer form picks by timing: two runs may pick
    different algorithms, which sum in different orders. ``names``: how the user spelled each setting (``NAMES``'
    keys), for the message."""
    if not enabled:
        return None
    n = {**NAMES, **(names or {})}
    if backend not in DETERMINISTIC_KERNELS:
        return (f"{FLAG} with {n['backend']} {backend}: that setting may run a kernel whose backward accumulates "
                f"with atomics (cuDNN, torch's flash / efficient attention); give {n['backend']} "
                f"{' or '.join(DETERMINISTIC_KERNELS)}")
    if sparse not in (None, "none") and sparse_kernel not in DETERMINISTIC_SPARSE_KERNELS:
        return (f"{FLAG} with {n['sparse']} {sparse} on {n['sparse_kernel']} {sparse_kernel}: that setting may run "
                f"a block-sparse backward that is not deterministic (FA4's, flex_attention's, cuDNN's); give "
                f"{n['sparse_kernel']} {' or '.join(DETERMINISTIC_SPARSE_KERNELS)}, or {n['sparse']} none")
    mode = mode[0] if isinstance(mode, (list, tuple)) and len(mode) == 1 else mode
    for key, value in (("mode", mode), ("async_qkv", async_qkv)):
        if value == "auto":
            return (f"{FLAG} with {n[key]} auto: auto picks by timing, so a rerun may run another algorithm (another "
                    f"order of sums); give {n[key]} a fixed value" + (" (hcms equals ulysses bit for bit, whatever "
                                                                      "its head chunks)" if key == "mode" else ""))
    return None


def enable() -> dict:
    """Turn deterministic execution on for this process (see the module docstring); returns what it set."""
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
    for k, v in env.items():
        os.environ.setdefault(k, v)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {k: os.environ[k] for k in env}
