"""Block-sparse self-attention for the video DiT (``--sparse-attention tiles``), VSA-style: the DiT's flags and its
per-forward ``SparseStep`` (built once per shape by ``SparseStepCache``).

The tile math (tile order with compacted edge cells, window / top-k block masks, pooled tiles summed over the SP
group, the coarse branch, the one-device reference) is model-independent and lives in ``megatron_sp_ext.video_tiles``
(shared with the diffusers client); its names are re-exported here. ``--sparse-window`` picks a fixed local window
(``window_tile_mask``), ``--sparse-topk K`` VSA's top-k key tiles per query tile from the pooled q/k
(``topk_tile_mask``) plus the coarse branch through the DiT's zero-initialised gate (``model.py``).
The batch is put in tile order before sharding (``engine.flow_matching_batch(tile=...)``), so every rank holds one
contiguous run of the tile order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_sp_ext import video_tiles
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.video_tiles import (  # noqa: F401 - re-exported: the DiT's entry points, tests and tools
    DEFAULT_TILE, SparseSpec, TileRun, coarse_attention, coarse_tiles, device_window_mask, gated_spread,
    num_tiles_of, pad_tile_mask, pool_tiles, reference_sparse_attention, row_major_ids, spread_tiles, tile_coords,
    tile_counts, tile_order, tile_positions, tile_token_mask, tiles_per_axis, topk_tile_mask, window_tile_mask)

SPARSE_CHOICES = ("none", "tiles")
TILE_FLAG, TOPK_FLAG, WINDOW_FLAG, SPARSE_FLAG = "--sparse-tile", "--sparse-topk", "--sparse-window", \
    "--sparse-attention"
SPARSE_KERNEL_FLAG = "--sparse-attention-kernel"   # the megatron entry's block-sparse kernel (cli.add_sparse_kernel_arg)


def check_tile_grid(grid_thw: tuple, tile_thw: tuple) -> None:
    """Raise SPConfigError naming ``--sparse-tile`` when ``tile_thw`` is not three positive sizes (any grid runs:
    edge cells are compacted, ``megatron_sp_ext.video_tiles``)."""
    video_tiles.check_tile_grid(grid_thw, tile_thw, setting=TILE_FLAG)


@dataclass(frozen=True)
class SparseStep:
    """What one forward's sparse self-attention needs (``sparse_step``), the same in every block: ``spec``,
    ``tile_index`` [S_local] (the tile of each local token; >= ``num_tiles`` for SP padding), ``num_tiles`` (tiles
    of the grid), ``num_padded_tiles`` (tiles of the SP-padded full sequence, ceil(S_padded / block_size)), ``group`` (the
    SP group the pooled tiles are summed over; None: one rank) and, for a window, its ``window_mask``
    [1, num_padded_tiles, num_padded_tiles] on the device (None for top-k, which is picked per layer); ``run``: where the local
    tokens sit in tile order (``TileRun``)."""

    spec: SparseSpec
    tile_index: torch.Tensor
    num_tiles: int
    num_padded_tiles: int
    group: Optional[dist.ProcessGroup]
    window_mask: Optional[torch.Tensor]
    run: Optional[TileRun] = None


def sparse_step(spec: SparseSpec, token_ids: torch.Tensor, grid_thw: tuple, group: Optional[dist.ProcessGroup],
                device: torch.device) -> SparseStep:
    """The ``SparseStep`` of a forward on this rank's tokens: ``token_ids`` [S_local] are their row-major ids (as
    RoPE reads them; ``row_major_ids`` of their tile-order positions), which must be one contiguous run of tile
    order (the batch was put in tile order before sharding, ``engine.flow_matching_batch(tile=...)``): raises
    SPConfigError otherwise."""
    positions = tile_positions(token_ids.cpu(), tuple(grid_thw), spec.tile)
    seq_local = positions.numel()
    if not torch.equal(positions, torch.arange(seq_local) + positions[0]):
        raise SPConfigError(f"{SPARSE_FLAG} tiles: this rank's tokens are not one contiguous run of the tile order "
                            f"(build the batch with engine.flow_matching_batch(..., tile=...), or permute the "
                            f"patches with sparse.tile_order before sharding them contiguously)")
    world = dist.get_world_size(group) if group is not None else 1
    tile = spec.block_size
    num_tiles = num_tiles_of(tuple(grid_thw), spec.tile)
    num_padded_tiles = -(-seq_local * world // tile)
    window = None
    if spec.window is not None:
        window = device_window_mask(tuple(grid_thw), tuple(spec.tile), tuple(spec.window), num_padded_tiles, str(device))
    n_tokens = grid_thw[0] * grid_thw[1] * grid_thw[2]
    tile_index = torch.where(positions < n_tokens, positions // tile, torch.full_like(positions, num_tiles))
    return SparseStep(spec, tile_index.to(device), num_tiles, num_padded_tiles,
                      group if world > 1 else None, window, TileRun(int(positions[0]), n_tokens, tile))


class SparseStepCache:
    """The ``SparseStep`` of the last (spec, grid, token ids, SP group, device) seen: a run with a fixed shape builds it
    once instead of every forward. ``sparse_step`` does host tensor work over every local token (its index over the
    tile order is an OpenMP-parallel op: 7.1 ms per call in a training entry's profile on an H200, 2026-11-26,
    results/2026-11-26_h200x4_table_steps_cudnn/call3/profile/topk90) and a blocking host-to-device copy of
    ``tile_index`` (a stream sync), both in the step's critical path: the likely cause of short sparse steps' entry
    over bare step (wan-1.3b 4 layers, window 90%: 114.4 vs 107.5 ms). As ``rope.RopeCache``: token ids on the host
    (what the entry points pass) are compared on the host, without a device sync; token ids already on a device (a
    wrapper moved the model's inputs, as FSDP2's root does) are not cached. The cached step is shared: read its
    tensors only."""

    def __init__(self) -> None:
        self.key: tuple = ()
        self.group = None
        self.ids: Optional[torch.Tensor] = None
        self.step: Optional[SparseStep] = None

    def get(self, spec: SparseSpec, token_ids: torch.Tensor, grid_thw: tuple, group: Optional[dist.ProcessGroup],
            device: torch.device) -> SparseStep:
        """``sparse_step(spec, token_ids, grid_thw, group, device)``, cached."""
        if token_ids.device.type != "cpu":
            return sparse_step(spec, token_ids, grid_thw, group, device)
        key = (spec, tuple(int(g) for g in grid_thw), str(torch.device(device)), token_ids.dtype, token_ids.shape[0])
        if self.step is None or self.key != key or self.group is not group or not torch.equal(self.ids, token_ids):
            step = sparse_step(spec, token_ids, grid_thw, group, device)   # raises before anything is kept
            self.key, self.group, self.ids, self.step = key, group, token_ids.clone(), step
        return self.step
