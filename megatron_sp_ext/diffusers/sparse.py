"""Block-sparse self-attention on diffusers' WanTransformer3DModel: the window (training-free) and VSA's top-k tiles.

``BlockSparsePlan`` is the ``sparse=`` of ``megatron_sp_ext.diffusers.parallelize`` (the SparseAttentionPlan of
docs/diffusers.md). The tile grid is the model's latent grid after patchify, (F/p_t, H/p_h, W/p_w); the tokens
run in its tile order (``token_order``, edge cells compacted, ``megatron_sp_ext.video_tiles``), sharded
contiguously over the SP group, so a tile is ``block_size`` consecutive tokens and SP=1 computes what SP=N does.

* ``window=(wt, wh, ww)``: each query tile attends the key tiles within +-(wt, wh, ww) tiles of it; one mask per
  grid for every layer and head, built once (cached).
* ``topk=K`` (VSA): per layer and head, each query tile attends the K key tiles of highest pooled score q . k (q, k
  mean-pooled per tile, the pooled sums all-reduced over the SP group so every rank builds the same mask:
  ``masks_agreed`` is True, so no per-layer cross-rank compare). With
  ``coarse=True`` (VSA's default) the coarse branch (dense attention of the pooled q over the pooled k/v, each
  tile's result given to its tokens) is added through a gate, ``Linear(dim, heads * head_dim)`` of the
  self-attention's input as in VSA's ``gate_compress``: a registered submodule ``blocks.{i}.attn1.sparse_gate`` of
  every layer, zero-initialised so a pretrained model starts as its fine block-sparse attention. The gates are in
  ``model.state_dict()`` (``save_pretrained`` and ``torch.distributed.checkpoint`` carry them);
  ``from_pretrained`` drops them as unknown keys: ``load_gates(model, path)`` reads them back from the
  checkpoint's safetensors files.

The gate reads the self-attention's input (``norm_hidden_states`` of the layer): a forward pre-hook on each
``attn1`` (torch's hook API) hands it to the plan, which uses it in the same layer's ``__call__`` and drops it.
Nothing of diffusers is imported here (the model is duck-typed: ``model.blocks[i].attn1``).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..errors import SPConfigError
from ..video_tiles import (DEFAULT_TILE, SparseSpec, TileRun, check_tile_grid, coarse_tiles, device_window_mask,
                           gated_spread, num_tiles_of, pad_tile_mask, pool_tiles, tile_order, topk_tile_mask)

log = logging.getLogger(__name__)

GATE_NAME = "sparse_gate"            # blocks.{i}.attn1.sparse_gate.{weight,bias}


def _ints(value, setting: str, size: int, low: int) -> tuple:
    """``value`` as a tuple of ``size`` ints >= ``low``, or SPConfigError naming ``setting``."""
    vals = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if len(vals) != size or not all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in vals):
        what = f"{size} integers" if size > 1 else "an integer"
        raise SPConfigError(f"BlockSparsePlan({setting}={value!r}) is invalid: give {what} >= {low}")
    return vals


@dataclass(frozen=True)
class _Layout:
    """Where this rank's S_local tokens sit in the tile order of one grid: ``run`` (TileRun), ``tile_index``
    [S_local] (the tile of each token; ``num_tiles`` for SP padding), ``num_tiles``, ``num_padded_tiles`` (tiles of the
    SP-padded full sequence)."""

    run: TileRun
    tile_index: torch.Tensor
    num_tiles: int
    num_padded_tiles: int


class BlockSparsePlan:
    """Block-sparse self-attention for WanTransformer3DModel (``parallelize(model, group, sparse=plan)``).

    BlockSparsePlan(tile=(4, 4, 8), *, window=None, topk=None, coarse=True)
        tile: (Tt, Th, Tw) latent tokens (after patchify) per tile; ``block_size`` = Tt*Th*Tw (128 by default, a
              FlashAttention-4 kernel block; VSA's checkpoints were trained with 4x4x4 = 64).
        window: (wt, wh, ww) tiles each way (training-free); or
        topk: K key tiles per query tile and head (VSA), with
        coarse: VSA's gated coarse branch (gates added by ``attach``; False: the fine top-k attention alone).
    Exactly one of ``window`` / ``topk``. Errors: SPConfigError naming the keyword.
    """

    def __init__(self, tile: tuple = DEFAULT_TILE, *, window: Optional[tuple] = None, topk: Optional[int] = None,
                 coarse: bool = True) -> None:
        tile = tuple(tile) if isinstance(tile, (tuple, list)) else (tile,)
        check_tile_grid((1, 1, 1), tile, setting="BlockSparsePlan tile")
        if (window is None) == (topk is None):
            raise SPConfigError(f"BlockSparsePlan(window={window!r}, topk={topk!r}): give exactly one of window="
                                f"(wt, wh, ww) (a local window of tiles) or topk=K (VSA's top-k key tiles)")
        if window is not None:
            window = _ints(window, "window", 3, 0)
        if topk is not None:
            topk = _ints(topk, "topk", 1, 1)[0]
        if not isinstance(coarse, bool):
            raise SPConfigError(f"BlockSparsePlan(coarse={coarse!r}) is invalid: give True or False")
        self.spec = SparseSpec(tile=tile, topk=topk, window=window)
        self.coarse = coarse and topk is not None       # the coarse branch is VSA's (top-k only)
        # top-k masks are built per layer from tiles all-reduced over the group: equal on every rank by construction,
        # so the processor records them as agreed instead of comparing each across ranks (a window mask, cached per
        # grid, is compared once)
        self.masks_agreed = topk is not None
        self._orders: dict = {}                         # (grid, device) -> order on the device
        self._layouts: dict = {}                        # (grid, S_local, rank, world, device) -> _Layout
        self._gates: list = []                          # the gate of each layer (coarse), by layer index
        self._hooks: list = []
        self._inputs: dict = {}                         # layer index -> this forward's attn1 input (coarse)

    # ---- the SparseAttentionPlan protocol ---------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per tile (of the block mask)."""
        return self.spec.block_size

    def token_order(self, grid_thw: tuple, device) -> torch.Tensor:
        """LongTensor [F*H*W] on ``device``: position i of the tile order holds raster (f, h, w) token order[i].
        Cached per (grid, device)."""
        grid = tuple(int(g) for g in grid_thw)
        key = (grid, str(torch.device(device)))
        order = self._orders.get(key)
        if order is None:
            order = tile_order(grid, self.spec.tile)[0].to(device)
            if len(self._orders) >= 8:
                self._orders.clear()
            self._orders[key] = order
        return order

    def attach(self, model: nn.Module) -> None:
        """Add the coarse branch's zero-initialised gate to every layer's ``attn1`` as the registered submodule
        ``sparse_gate`` (top-k with coarse only; nothing for a window), and a forward pre-hook handing the gate its
        input. A gate already on the model is kept (with its weights)."""
        if self._hooks:
            raise SPConfigError("BlockSparsePlan.attach: this plan is already attached to a model (detach it first; "
                                "one plan per model)")
        layers = getattr(model, "blocks", None)   # diffusers' name of the model's transformer layers
        if layers is None or not all(hasattr(b, "attn1") for b in layers):
            raise SPConfigError(f"BlockSparsePlan.attach({type(model).__name__}): expected a diffusers "
                                f"WanTransformer3DModel (model.blocks[i].attn1)")
        if not self.coarse:
            return
        self._gates = []
        for index, layer in enumerate(layers):
            attn = layer.attn1
            gate = getattr(attn, GATE_NAME, None)
            if gate is None:
                weight = attn.to_q.weight
                gate = nn.Linear(attn.to_q.in_features, attn.inner_dim, device=weight.device, dtype=weight.dtype)
                nn.init.zeros_(gate.weight)
                nn.init.zeros_(gate.bias)
                attn.add_module(GATE_NAME, gate)
            self._gates.append(gate)
            self._hooks.append(attn.register_forward_pre_hook(self._input_hook(index), with_kwargs=True))

    def detach(self, model: nn.Module) -> None:
        """Remove the hooks and the gates ``attach`` added (their weights go with them)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._gates = [], []
        self._inputs.clear()
        for layer in getattr(model, "blocks", ()):
            if isinstance(getattr(getattr(layer, "attn1", None), GATE_NAME, None), nn.Module):
                delattr(layer.attn1, GATE_NAME)

    def __call__(self, layer_index: int, q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor,
                 grid_thw: tuple, group: Optional[dist.ProcessGroup]) -> tuple:
        """(block_mask, extra_bshd) for layer ``layer_index``'s self-attention on this rank's q, k, v
        [B, S_local, H, D] (tile order, after norm and RoPE): block_mask bool [1 or H, T, T] over the full (SP-padded)
        sequence, T = ceil(S_local * world / block_size), the same on every rank; extra [B, S_local, H, D] the gated
        coarse branch (top-k with coarse) or None."""
        grid = tuple(int(g) for g in grid_thw)
        batch, seq_local, heads, head_dim = q_bshd.shape
        layout = self._layout(grid, seq_local, group, q_bshd.device)
        if self.spec.window is not None:
            mask = device_window_mask(grid, self.spec.tile, self.spec.window, layout.num_padded_tiles, str(q_bshd.device))
            return mask, None
        if batch != 1:
            raise SPConfigError(f"BlockSparsePlan(topk={self.spec.topk}): the top-k tiles are picked per sample and "
                                f"the plan gives one block mask per forward: run batch 1 per forward (got {batch}; "
                                f"diffusers' Wan pipelines call the transformer once per guidance branch)")
        group = group if group is not None and dist.get_world_size(group) > 1 else None
        q_tiles, k_tiles, v_tiles = (pool_tiles(t, layout.tile_index, layout.num_tiles, group, layout.run)
                                     for t in (q_bshd, k_bshd, v_bshd))              # [B, H, nT, D], whole sequence
        mask = pad_tile_mask(topk_tile_mask(q_tiles[0], k_tiles[0], self.spec.topk), layout.num_padded_tiles)
        if not self.coarse:
            return mask, None
        hidden = self._inputs.pop(layer_index, None)
        if hidden is None or hidden.shape[:2] != (batch, seq_local) or layer_index >= len(self._gates):
            raise SPConfigError(f"BlockSparsePlan: layer {layer_index}'s attn1 input was not seen (attach the plan to "
                                f"the model it runs: parallelize(model, group, sparse=plan) does)")
        gate_bshd = self._gates[layer_index](hidden).view(batch, seq_local, heads, head_dim)
        extra = gated_spread(gate_bshd, coarse_tiles(q_tiles, k_tiles, v_tiles), layout.tile_index, layout.run)
        return mask, extra

    # ---- gates in checkpoints ---------------------------------------------------------------------------------

    def load_gates(self, model: nn.Module, path: str) -> int:
        """Copy the gates (``blocks.{i}.attn1.sparse_gate.*``) of a diffusers checkpoint into ``model`` (attached):
        ``path`` is the model's directory (``save_pretrained``'s, e.g. ``<pipeline>/transformer``, sharded or not) or
        one ``.safetensors`` file; read with safetensors (no pickle). Returns the tensors copied. SPConfigError
        naming ``path`` when a gate is missing or its shape differs (e.g. saved without an attached top-k plan).
        Full tensors: call it before sharding the parameters (FSDP2)."""
        wanted = {name: tensor for name, tensor in model.state_dict().items() if f".{GATE_NAME}." in name}
        if not wanted:
            raise SPConfigError(f"BlockSparsePlan.load_gates: the model has no gates: attach a plan with topk= and "
                                f"coarse=True first (parallelize(model, group, sparse=plan))")
        found = _read_safetensors(path, set(wanted))
        missing = sorted(set(wanted) - set(found))
        if missing:
            raise SPConfigError(f"BlockSparsePlan.load_gates(path={path!r}): {len(missing)} of {len(wanted)} gate "
                                f"tensors are not in the checkpoint (first: {missing[0]}); was it saved with a top-k "
                                f"plan attached?")
        with torch.no_grad():
            for name, tensor in found.items():
                if tensor.shape != wanted[name].shape:
                    raise SPConfigError(f"BlockSparsePlan.load_gates(path={path!r}): {name} has shape "
                                        f"{list(tensor.shape)} in the checkpoint, {list(wanted[name].shape)} in the "
                                        f"model")
                wanted[name].copy_(tensor)
        return len(found)

    # ---- internals --------------------------------------------------------------------------------------------

    def _input_hook(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            self._inputs[index] = hidden
        return hook

    def _layout(self, grid: tuple, seq_local: int, group, device) -> _Layout:
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if world > 1 else 0
        key = (grid, seq_local, rank, world, str(device))
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        n_tokens = grid[0] * grid[1] * grid[2]
        if seq_local * world < n_tokens:
            raise SPConfigError(f"BlockSparsePlan: {world} rank(s) x {seq_local} tokens do not hold the latent grid "
                                f"{grid} ({n_tokens} tokens): grid_thw must be the grid of the tokens attended")
        tile = self.block_size
        num_tiles = num_tiles_of(grid, self.spec.tile)
        positions = torch.arange(seq_local) + rank * seq_local                     # contiguous shard of tile order
        tile_index = torch.where(positions < n_tokens, positions // tile, torch.full_like(positions, num_tiles))
        layout = _Layout(TileRun(rank * seq_local, n_tokens, tile), tile_index.to(device), num_tiles,
                         -(-seq_local * world // tile))
        if len(self._layouts) >= 8:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout


def _read_safetensors(path: str, names: set) -> dict:
    """The tensors ``names`` found in a safetensors file or a diffusers model directory (the files its index names
    for them when it is sharded; every ``*.safetensors`` file for the names no index lists): name -> CPU tensor."""
    from safetensors import safe_open  # noqa: PLC0415 - optional dependency (diffusers requires it)
    if os.path.isdir(path):
        index = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors.index.json")]
        if index:
            with open(os.path.join(path, index[0])) as fh:
                weight_map = json.load(fh)["weight_map"]
            files = sorted({weight_map[n] for n in names if n in weight_map})
        if not index or not names <= set(weight_map):
            files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
        files = [os.path.join(path, f) for f in files]
    elif os.path.isfile(path) and path.endswith(".safetensors"):
        files = [path]
    else:
        raise SPConfigError(f"BlockSparsePlan.load_gates(path={path!r}): not a diffusers model directory or a "
                            f".safetensors file")
    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in names & set(f.keys()):
                out[name] = f.get_tensor(name)
    log.debug("BlockSparsePlan.load_gates: %d tensors from %s", len(out), files)
    return out
