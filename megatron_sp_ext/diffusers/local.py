"""One rank (the SP group None or of size 1): the self-attention on the local kernel of ``SPConfig.backend``, with
the same call as ``SPAttention`` (bshd q/k/v, optional block mask), so SP=1 runs the processor's code path.

    attn = OneRankAttention(cfg)
    out_bshd = attn(q_bshd, k_bshd, v_bshd, causal=False, block_mask=None, block_size=64)
"""
from __future__ import annotations

from typing import Optional

import torch

from ..attention.backends import get_backend
from ..attention.block_sparse import DEFAULT_TILE_SIZE, block_sparse_attention, check_tile_mask
from ..config import SPConfig
from ..sp.ulysses.attend import local_attention


class OneRankAttention:
    """The attention of one rank: q, k, v [B, S, H, D] (the full sequence) -> out [B, S, H, D]. Attributes as
    SPAttention's that the processor sets or reads: ``mode`` ("local"), ``training``."""

    def __init__(self, cfg: SPConfig) -> None:
        self.cfg, self.mode, self.training = cfg, "local", None
        self.backend = get_backend(cfg.backend, cfg.name("backend"))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 softmax_scale: Optional[float] = None, block_mask: Optional[torch.Tensor] = None,
                 block_size: int = DEFAULT_TILE_SIZE) -> torch.Tensor:
        q_bhsd, k_bhsd, v_bhsd = (t.transpose(1, 2) for t in (q, k, v))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        if block_mask is not None:
            mask = check_tile_mask(block_mask, seq_len=q.shape[1], block_size=block_size, num_heads=q.shape[2])
            out = block_sparse_attention(q_bhsd, k_bhsd, v_bhsd, mask, block_size=block_size, causal=causal,
                                         softmax_scale=scale)
        else:
            out = local_attention(self.backend, q_bhsd, k_bhsd, v_bhsd, causal, scale, None)
        return out.transpose(1, 2)
