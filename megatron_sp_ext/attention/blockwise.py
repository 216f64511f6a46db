"""Attention of one call (query rows against one K|V block) with log-sum-exp, and its backward: the names, kept importable here.

The bodies live in their kernel modules (issue 66): ``math_forward`` / ``math_backward`` (fp32, fp64 for fp64, exact
masks) in ``kernels/math.py``, ``fused_forward`` / ``fused_backward`` (torch's flash attention, CUDA or CPU) in
``kernels/torch_flash.py``, the GQA helpers ``expand_kv`` / ``fold_kv_grad`` in ``kernels/base.py``.
Forward returns (out, lse) for the call; backward takes the FINAL (merged) out and lse of the query rows, which
makes each call's gradient contribution exact. All tensors are [B, H, S, D] ("bhsd"); lse is fp32 [B, H, Sq].
GQA: k/v may have fewer heads (H % Hkv == 0); they are expanded and dk/dv summed back.
mask: None (full), "causal" (top-left aligned, Sq == Sk) or a bool tensor [Sq, Sk] (True = keep).
"""
from __future__ import annotations

from .kernels.base import expand_kv, fold_kv_grad
from .kernels.math import Mask, math_backward, math_forward
from .kernels.torch_flash import fused_backward, fused_forward

__all__ = ["Mask", "expand_kv", "fold_kv_grad", "math_forward", "math_backward", "fused_forward", "fused_backward"]
