"""flash-attn 2/3 (the ``flash_attn`` package's ``flash_attn_func``): plain calls on CUDA."""
from __future__ import annotations

import importlib.util

import torch

from .base import Capabilities, Kernel


class FlashAttnKernel(Kernel):
    name = setting = "flash_attn"
    label = "flash-attn (flash_attn_func)"
    package = "flash_attn"
    caps = Capabilities(plain=True, lse=False, dtypes={"cuda": (torch.float16, torch.bfloat16)})

    def installed(self) -> bool:
        return importlib.util.find_spec("flash_attn") is not None

    def attention(self, q, k, v, causal, scale, tiles=None):
        from flash_attn import flash_attn_func  # noqa: PLC0415
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                              causal=causal)
        return out.transpose(1, 2)
