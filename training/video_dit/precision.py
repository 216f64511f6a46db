"""bf16 Linear weights with fp32 main weights: bf16 autocast's math without its per-step weight casts
(``--bf16-linear-weights``).

Under bf16 autocast every ``nn.Linear`` casts its fp32 weight and bias to bf16 in each forward (one pass over
1.4 B parameters per step at wan-14b dims, 4 layers: ~12 ms of copy kernels on one H200, and the cast's backward
converts each bf16 weight gradient to fp32, ~3 ms more; tools/results/2026-11-24_h200_train_step_profile). Keeping
those parameters in bf16, with the fp32 values as the optimizer's main weights (Megatron's mixed-precision
optimizer), computes the same numbers:
- forward: the Linear reads round_bf16(w_fp32), the value autocast's cast produces;
- backward: the weight gradient is the same bf16 GEMM output, converted to fp32 once when Megatron's DDP adds it
  into its (zeroed) fp32 ``main_grad`` buffer: the value the cast's backward produced;
- the update: the same fused AdamW on the same fp32 main weights, then round_bf16 into the model weights.
Norm, modulation and every other parameter autocast does not cast stay fp32. The main weights start from the
exact fp32 initial values (``restore_main_weights``), not from their bf16 rounding.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

CHOICES = ("auto", "on", "off")


def linear_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters bf16 autocast casts in every forward: weight and bias of each ``nn.Linear``."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            yield from (p for p in (m.weight, m.bias) if p is not None)


def to_bf16_linear_weights(model: nn.Module) -> dict:
    """Store the Linear parameters in bf16 (in place); returns {parameter: its fp32 values} for
    ``restore_main_weights``."""
    originals = {}
    for p in linear_parameters(model):
        if p.dtype != torch.float32:
            raise ValueError(f"--bf16-linear-weights: a Linear parameter is {p.dtype}, expected float32")
        originals[p] = p.detach().clone()
        p.data = p.data.to(torch.bfloat16)
    return originals


def restore_main_weights(originals: dict) -> int:
    """After Megatron's optimizer is built (its fp32 ``main_param`` of each bf16 parameter was copied from the bf16
    values): put the exact fp32 values back. Returns how many were restored. Raises if the optimizer shards its
    main weights (``--use-distributed-optimizer``: ``main_param`` is a shard) or made none."""
    n = 0
    for p, full in originals.items():
        main = getattr(p, "main_param", None)
        if main is None or main.numel() != full.numel():
            raise ValueError("--bf16-linear-weights needs Megatron's non-distributed mixed-precision optimizer "
                             "(each bf16 weight with its full fp32 main_param)")
        main.data.copy_(full.view_as(main))
        n += 1
    return n


def resolve(choice: str, *, bf16: bool, megatron_ddp: bool, bf16_params: bool, distributed_optimizer: bool,
            flag: str = "--bf16-linear-weights") -> bool:
    """Whether to keep Linear weights in bf16: ``auto`` does with --bf16 on Megatron's DDP and non-distributed
    optimizer (where the math is autocast's, bit for bit), ``on`` requires those, ``off`` never."""
    if choice not in CHOICES:
        raise ValueError(f"{flag}={choice!r}: choose one of {', '.join(CHOICES)}")
    fits = bf16 and megatron_ddp and not bf16_params and not distributed_optimizer
    if choice == "on" and not fits:
        raise ValueError(f"{flag}=on needs --bf16, Megatron's DDP (CUDA), no --bf16-params (which already keeps "
                         f"every weight in bf16) and no --use-distributed-optimizer")
    return choice == "on" or (choice == "auto" and fits)
