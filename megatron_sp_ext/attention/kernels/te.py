"""Transformer Engine's fused attention (``transformer_engine.pytorch.DotProductAttention``): plain calls on CUDA."""
from __future__ import annotations

import importlib.util

import torch

from .base import Capabilities, Kernel


class TEKernel(Kernel):
    name = setting = "te"
    label = "Transformer Engine DotProductAttention"
    package = "transformer_engine"
    caps = Capabilities(plain=True, lse=False, dtypes={"cuda": (torch.float16, torch.bfloat16)})

    def __init__(self) -> None:
        self._mods: dict = {}

    def installed(self) -> bool:
        return importlib.util.find_spec("transformer_engine") is not None

    def attention(self, q, k, v, causal, scale, tiles=None):
        import transformer_engine.pytorch as te  # noqa: PLC0415
        b, h, s, d = q.shape
        key = (h, k.shape[1], d, causal, scale)
        if key not in self._mods:
            self._mods[key] = te.DotProductAttention(
                h, d, num_gqa_groups=k.shape[1], attention_dropout=0.0, qkv_format="bshd",
                attn_mask_type="causal" if causal else "no_mask", softmax_scale=scale)
        out = self._mods[key](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.view(b, s, h, d).transpose(1, 2)
