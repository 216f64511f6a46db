"""Shared by the BlockSparsePlan tests (tests/test_diffusers_sparse.py, tests/gpu/cuda_diffusers_sparse.py): non-zero
gates, a plan wrapper that records every layer's block mask, and the single-device reference processor that computes
the plan's attention from scratch (tile order, ``reference_sparse_attention``, an independent coarse branch).
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch

from megatron_sp_ext.diffusers.rope import wan_rotary_eager as wan_rotary
from megatron_sp_ext.diffusers.sparse import GATE_NAME, BlockSparsePlan
from megatron_sp_ext.video_tiles import reference_sparse_attention, tile_order, topk_tile_mask, window_tile_mask


def set_gates(model, seed: int = 3) -> None:
    """Every attached gate to fixed non-zero values (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in model.blocks:
            gate = getattr(blk.attn1, GATE_NAME)
            for p in gate.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p))


class RecordingPlan:
    """``plan`` (a SparseAttentionPlan) whose calls keep each layer's block mask in ``masks`` (on the CPU)."""

    def __init__(self, plan) -> None:
        self.plan, self.block_size, self.masks = plan, plan.block_size, {}

    def token_order(self, grid_thw, device):
        return self.plan.token_order(grid_thw, device)

    def attach(self, model) -> None:
        self.plan.attach(model)

    def detach(self, model) -> None:
        self.plan.detach(model)

    def __call__(self, layer_index, *args):
        mask, extra = self.plan(layer_index, *args)
        self.masks[layer_index] = mask.detach().cpu().clone()
        return mask, extra


class ReferenceProcessor:
    """diffusers' WanAttnProcessor self-attention with a BlockSparsePlan's sparsity computed on one device from
    scratch: q, k, v in tile order, the window mask of the grid or the top-k of mean-pooled q . k (or the given
    ``masks[layer]``: the selection a run made), ``reference_sparse_attention``, plus (top-k) the gate
    (``attn.sparse_gate`` of the block input) times the dense attention of the pooled tiles, back to raster order.
    ``picked``: a dict that gets the masks used, per layer (CPU). The grid's token count must be a multiple of the
    tile size (whole tiles)."""

    def __init__(self, layer: int, grid_thw: tuple, tile: tuple, window=None, topk=None,
                 masks: Optional[dict] = None, picked: Optional[dict] = None) -> None:
        self.layer, self.grid, self.tile, self.window, self.topk = layer, grid_thw, tile, window, topk
        self.masks, self.picked = masks, picked

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        q, k = wan_rotary(q, *rotary_emb), wan_rotary(k, *rotary_emb)
        perm, inv = (t.to(q.device) for t in tile_order(self.grid, self.tile))
        q, k, v = (t[:, perm] for t in (q, k, v))                          # [1, S, H, D] in tile order
        b, s, h, d = q.shape
        bs = math.prod(self.tile)
        assert s % bs == 0, "the reference takes whole tiles"
        pooled = [t.reshape(b, s // bs, bs, h, d).mean(2).transpose(1, 2) for t in (q, k, v)]   # [B, H, nT, D]
        if self.masks is not None:
            mask = self.masks[self.layer].to(q.device)
        elif self.window is not None:
            mask = window_tile_mask(self.grid, self.tile, self.window).to(q.device)
        else:
            mask = topk_tile_mask(pooled[0][0], pooled[1][0], self.topk)
        if self.picked is not None:
            self.picked[self.layer] = mask.cpu().clone()
        out = reference_sparse_attention(q, k, v, mask, bs)
        if self.topk is not None:
            scores = pooled[0] @ pooled[1].transpose(-1, -2) / math.sqrt(d)
            coarse = (scores.softmax(-1) @ pooled[2]).transpose(1, 2).repeat_interleave(bs, dim=1)   # [B, S, H, D]
            gate = getattr(attn, GATE_NAME)(hidden_states)[:, perm].view(b, s, h, d)
            out = out + gate * coarse
        out = out[:, inv].flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def reference_model(stock, grid_thw: tuple, tile: tuple, masks: Optional[dict] = None, picked: Optional[dict] = None,
                    **plan_kw):
    """A copy of ``stock`` with the plan's gates (top-k: ``set_gates``) and every attn1 on ``ReferenceProcessor``."""
    ref = copy.deepcopy(stock)
    if plan_kw.get("topk") is not None:
        BlockSparsePlan(tile, **plan_kw).attach(ref)
        set_gates(ref)
    for i, blk in enumerate(ref.blocks):
        blk.attn1.set_processor(ReferenceProcessor(i, grid_thw, tile, masks=masks, picked=picked, **plan_kw))
    return ref
