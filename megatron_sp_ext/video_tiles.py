"""Tile math of block-sparse video self-attention, model-independent (VSA-style): the tile order of a (T', H', W')
token grid, window and top-k block masks, pooled tiles, the coarse branch, and the one-device reference.

Tiles: the token grid (after patchify) is cut into cells of ``tile_thw`` = (Tt, Th, Tw) tokens; ``tile_order``
puts the tokens in tile order: every whole cell's tokens next to each other (cells in (t, h, w) order, the tokens
of a cell in (t, h, w) order), then the tokens of the grid's edge cells (those the grid cuts: Wan's 480p grid
21x30x52 and 720p grid 21x45x80 are cut by no power-of-two tile) in the same order. A tile of the block mask is
``block_size`` = Tt*Th*Tw consecutive tokens of that order: a whole cell, or near the grid's edges a run of
edge-cell tokens (the last tile may be shorter). So every grid runs, no token is padding, and every tile but the
last is a whole 128-token kernel block of FlashAttention-4's block sparsity (none is cut, so none needs its slow
partially-masked route: padding each axis of 21x30x52 to whole 4x4x8 cells would leave 37.5% of the tiles partial,
and would add 31% tokens). A tile's coordinates (``tile_coords``) are its cell's; an edge tile's are the cell
holding its tokens' centroid. On a grid the tile cuts exactly this is plain tile order.
Default tile 4x4x8 (128 tokens): FA4's block sparsity runs 543-596 useful TFLOP/s fwd+bwd at 128-token tiles
against 88-104 at 64-token tiles on random masks (1 x H100, 2026-11-25, results/2026-11-25_h100_fa4_tiles).

Two ways to pick each query tile's key tiles:

* ``window_tile_mask``: a fixed local window, key tile within +-(wt, wh, ww) tiles of the query tile on each
  axis; the same mask in every layer and head (training-free).
* ``topk_tile_mask`` (Video Sparse Attention, FastVideo): q and k are mean-pooled per tile (``pool_tiles``), the
  tile-level scores q_tile . k_tile pick each query tile's K highest key tiles per head. As in VSA the selection
  is plain top-k (the query tile's own key tile is not forced in; it is kept when it scores in the top K, as it
  usually does). The selection is not differentiable; the fine attention over the selected tiles and the coarse
  branch (``coarse_attention``: dense attention of pooled q over pooled k/v, each tile's result given to its
  tokens) are. Models add the coarse branch through a learned, zero-initialised gate (``gated_spread``).

Under sequence parallelism the sequence is sharded contiguously IN TILE ORDER (3D-neighbouring tiles on one rank,
so a local window touches few other ranks); the pooled tiles are summed over the SP group (``pool_tiles`` with a
group, a differentiable all-reduce), so every rank builds the same block mask over the full sequence.

``reference_sparse_attention`` is the single-device reference (torch SDPA with the token mask expanded from the block
mask); the SP modes take ``block_mask=`` / ``block_size=`` in ``megatron_sp_ext``'s attention. Clients: the video DiT
(training/video_dit/sparse.py) and the diffusers plan (megatron_sp_ext/diffusers/sparse.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .attention import kernels
from .comm.autograd_reduce import all_reduce_sum
from .errors import SPConfigError

DEFAULT_TILE = (4, 4, 8)


@dataclass(frozen=True)
class SparseSpec:
    """A block-sparse self-attention: ``tile`` (Tt, Th, Tw) tokens per tile, and exactly one of ``topk`` (key tiles
    per query tile, VSA) or ``window`` ((wt, wh, ww) tiles each way). Validated by its clients (they name their own
    flags / keywords)."""

    tile: tuple
    topk: Optional[int] = None
    window: Optional[tuple] = None

    @property
    def block_size(self) -> int:
        """Tokens per tile = the block size of the block mask."""
        tt, th, tw = self.tile
        return tt * th * tw


def tiles_per_axis(grid_thw: tuple, tile_thw: tuple) -> tuple:
    """(nt, nh, nw): cells along frames, rows, columns, the grid's edge cells counted (ceil)."""
    check_tile_grid(grid_thw, tile_thw)
    return tuple(-(-g // t) for g, t in zip(grid_thw, tile_thw))


def check_tile_grid(grid_thw: tuple, tile_thw: tuple, setting: str = "tile") -> None:
    """Raise SPConfigError naming ``setting`` (the user's flag or keyword) when ``tile_thw`` is not three positive
    sizes (any grid runs: edge cells are compacted, see the module docstring)."""
    if len(tile_thw) == 3 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tile_thw):
        return
    raise SPConfigError(f"{setting}={','.join(map(str, tile_thw))} is invalid: give three positive sizes T,H,W "
                        f"(tokens per tile along frames, rows, columns; default {','.join(map(str, DEFAULT_TILE))})")


def _cell_ids(grid_thw: tuple, tile_thw: tuple) -> tuple:
    """Per row-major token: (its cell's index in (t, h, w) cell order [N], whether the cell is whole [N], its
    index inside the cell in (t, h, w) order [N], the cell counts per axis)."""
    t_n, h_n, w_n = grid_thw
    tt, th, tw = tile_thw
    nt, nh, nw = tiles_per_axis(grid_thw, tile_thw)
    t, h, w = torch.meshgrid(torch.arange(t_n), torch.arange(h_n), torch.arange(w_n), indexing="ij")
    t, h, w = t.reshape(-1), h.reshape(-1), w.reshape(-1)
    cell = ((t // tt) * nh + h // th) * nw + w // tw
    whole = ((t // tt + 1) * tt <= t_n) & ((h // th + 1) * th <= h_n) & ((w // tw + 1) * tw <= w_n)
    inner = ((t % tt) * th + h % th) * tw + w % tw
    return cell, whole, inner, (nt, nh, nw)


def tile_order(grid_thw: tuple, tile_thw: tuple) -> tuple:
    """(perm, inv), LongTensors [N] with N = T'*H'*W': ``perm[p]`` is the row-major (t, h, w) index of the token at
    tile-order position p (whole cells in (t, h, w) order, each cell's tokens in (t, h, w) order, then the edge
    cells' tokens the same way); ``inv[i]`` is the tile-order position of row-major token i. ``x_rowmajor[:, perm]``
    is tile order, ``x_tiles[:, inv]`` row-major. Tile ``j`` holds positions [j * block_size, (j + 1) * block_size).
    Cached per (grid, tile): the tensors are shared, read them only."""
    return _tile_order(tuple(int(g) for g in grid_thw), tuple(int(t) for t in tile_thw))


@lru_cache(maxsize=32)
def _tile_order(grid_thw: tuple, tile_thw: tuple) -> tuple:
    cell, whole, inner, _ = _cell_ids(grid_thw, tile_thw)
    vol = tile_thw[0] * tile_thw[1] * tile_thw[2]
    key = (~whole).long() * (cell.numel() * vol) + cell * vol + inner
    perm = key.argsort()
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return perm, inv


def tile_coords(grid_thw: tuple, tile_thw: tuple) -> torch.Tensor:
    """[nT, 3] integer cell coordinates (t, h, w) of every tile of ``tile_order`` (nT = ceil(N / block_size)):
    a whole cell's own; an edge tile's the cell holding the centroid of its tokens."""
    return _tile_coords(tuple(int(g) for g in grid_thw), tuple(int(t) for t in tile_thw))


@lru_cache(maxsize=32)
def _tile_coords(grid_thw: tuple, tile_thw: tuple) -> torch.Tensor:
    perm, _ = tile_order(grid_thw, tile_thw)
    t_n, h_n, w_n = grid_thw
    vol = tile_thw[0] * tile_thw[1] * tile_thw[2]
    thw = torch.stack([perm // (h_n * w_n), perm // w_n % h_n, perm % w_n], dim=-1).double()   # [N, 3] tile order
    n = perm.numel()
    tiles = -(-n // vol)
    idx = torch.arange(n) // vol
    sums = torch.zeros(tiles, 3, dtype=torch.double).index_add(0, idx, thw)
    counts = torch.bincount(idx, minlength=tiles).double()
    centroid = sums / counts[:, None]
    return (centroid / torch.tensor(tile_thw, dtype=torch.double)).floor().long()


def num_tiles_of(grid_thw: tuple, tile_thw: tuple) -> int:
    """Tiles of the grid's tile order: ceil(N / block_size)."""
    return -(-(grid_thw[0] * grid_thw[1] * grid_thw[2]) // (tile_thw[0] * tile_thw[1] * tile_thw[2]))


def row_major_ids(positions: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Row-major token ids of tile-order ``positions`` [S] (a shard, padding included): ``perm[p]`` for p < N,
    p itself for the padding positions p >= N (they carry no token of the grid)."""
    n_tokens = perm.numel()
    real = positions < n_tokens
    return torch.where(real, perm[positions.clamp(max=n_tokens - 1)], positions)


def tile_positions(token_ids: torch.Tensor, grid_thw: tuple, tile_thw: tuple) -> torch.Tensor:
    """Inverse of ``row_major_ids``: the tile-order position [S] of row-major ``token_ids`` [S] (ids >= N, the
    padding, map to themselves)."""
    _, inv = tile_order(grid_thw, tile_thw)
    return row_major_ids(token_ids, inv)


def window_tile_mask(grid_thw: tuple, tile_thw: tuple, window_thw: tuple) -> torch.Tensor:
    """bool [1, nT, nT] (query tiles x key tiles, tile order): key tile k is selected for query tile q when their
    cell coordinates (``tile_coords``) differ by at most (wt, wh, ww) = ``window_thw`` tiles on each axis. Cached per
    arguments (read it only)."""
    ints = lambda xs: tuple(int(x) for x in xs)  # noqa: E731
    return _window_tile_mask(ints(grid_thw), ints(tile_thw), ints(window_thw))


@lru_cache(maxsize=32)
def _window_tile_mask(grid_thw: tuple, tile_thw: tuple, window_thw: tuple) -> torch.Tensor:
    coords = tile_coords(grid_thw, tile_thw)                       # [nT, 3] in tile order
    dist_thw = (coords[:, None, :] - coords[None, :, :]).abs()     # [nT, nT, 3]
    reach = torch.tensor(window_thw, dtype=dist_thw.dtype)
    return (dist_thw <= reach).all(dim=-1)[None]


def topk_tile_mask(q_tiles: torch.Tensor, k_tiles: torch.Tensor, k: int) -> torch.Tensor:
    """bool [H, nT, nT]: for each head and query tile the ``k`` key tiles of highest score q_tile . k_tile
    (q_tiles, k_tiles: [H, nT, D], pooled per tile of one sample; ``k`` >= nT selects every tile). Plain top-k as in
    VSA (the diagonal is not forced); computed without gradient, in fp32 also under autocast (a bf16 matmul's
    rounding picks other tiles near ties than SP=1 does; float64 stays float64)."""
    with torch.no_grad(), torch.autocast(q_tiles.device.type, enabled=False):
        wide = _wide_dtype(q_tiles.dtype)
        scores = torch.matmul(q_tiles.to(wide), k_tiles.to(wide).transpose(-1, -2))  # [H, nT, nT]
        keep = min(k, scores.shape[-1])
        picked = scores.topk(keep, dim=-1).indices
        mask = torch.zeros_like(scores, dtype=torch.bool)
        return mask.scatter_(-1, picked, True)


def pad_tile_mask(block_mask: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """Grow [Hm, nT, nT] to [Hm, num_tiles, num_tiles] with False: the padding tiles of an SP-padded sequence
    (ceil(S_padded / block_size) tiles) attend nothing and are attended by nothing."""
    hm, nt, _ = block_mask.shape
    if num_tiles == nt:
        return block_mask
    out = block_mask.new_zeros(hm, num_tiles, num_tiles)
    out[:, :nt, :nt] = block_mask
    return out


@dataclass(frozen=True)
class TileRun:
    """Where this rank's tokens sit in tile order: positions ``first_position`` .. + S_local - 1 (one contiguous
    run, as ``sparse_step`` requires), ``n_tokens`` tokens in the grid (positions >= it are SP padding), tile i =
    positions [i * block_size, (i + 1) * block_size). Lets ``pool_tiles`` / ``coarse_attention`` pool and spread by
    reshapes instead of index_add / index_select over ``tile_index`` (on 1 x H100 at 32,760 tokens the index route
    took ~15 ms of a top-k step's 65 ms over the window step: results/2026-11-25_h100x2_sparse)."""

    first_position: int
    n_tokens: int
    block_size: int

    def layout(self, seq_local: int, num_tiles: int) -> tuple[int, int, int, int]:
        """(real, offset, first_tile, local_tiles): the local tokens that are grid tokens (the first ``real``), the
        first one's offset in its tile, that tile, and the tiles the real tokens touch."""
        real = max(0, min(seq_local, self.n_tokens - self.first_position))
        t0 = min(self.first_position // self.block_size, num_tiles)
        if real == 0:
            return 0, 0, t0, 0
        off = self.first_position % self.block_size
        return real, off, t0, -(-(off + real) // self.block_size)


def tile_counts(num_tiles: int, n_tokens: int, block_size: int, device=None) -> torch.Tensor:
    """Tokens of each tile of the whole grid [num_tiles] (every tile ``block_size`` but a shorter last one)."""
    starts = torch.arange(num_tiles, device=device) * block_size
    return (n_tokens - starts).clamp(min=0, max=block_size)


def pool_tiles(x_bshd: torch.Tensor, tile_index: torch.Tensor, num_tiles: int,
               group: Optional[dist.ProcessGroup] = None, run: Optional[TileRun] = None) -> torch.Tensor:
    """Mean of every tile's tokens: x [B, S_local, H, D] (this rank's tokens), ``tile_index`` [S_local] (tile of
    each local token; >= num_tiles for padding, which is left out) -> [B, H, num_tiles, D]. With an SP ``group``
    of more than one rank the per-rank sums are all-reduced (differentiable: the backward sums the gradients), so
    every rank gets the pooled tiles of the whole sequence (a shorter last tile: its mean over its own count).
    ``run`` (the tokens are one contiguous run of tile order): the same means by a reshape and a sum, summed in fp32."""
    b, _, h, d = x_bshd.shape
    if run is not None:
        return _pool_run(x_bshd, run, num_tiles, group)
    acc = _acc_dtype(x_bshd.dtype)
    real = tile_index < num_tiles
    idx = tile_index[real]
    sums = x_bshd.new_zeros(b, num_tiles, h, d, dtype=acc).index_add(1, idx, x_bshd[:, real].to(acc))
    counts = torch.bincount(idx, minlength=num_tiles).to(acc)
    if group is not None and dist.get_world_size(group) > 1:
        sums = all_reduce_sum(sums, group)
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
    return (sums / counts.clamp(min=1)[None, :, None, None]).to(x_bshd.dtype).transpose(1, 2)


def _wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32, float64 for float64: the dtype of the tile scores and the coarse branch."""
    return torch.promote_types(dtype, torch.float32)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The pooled sums' dtype: fp32 for bf16/fp16 inputs (summed, all-reduced over the SP group and divided before
    the one rounding to the input dtype, so SP=P rounds like SP=1: bf16 partial sums rounded per rank and then
    summed in bf16 changed the top-k selection against SP=1 (7e-2 gradient error on an H200, 2026-11-25))."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _pool_run(x_bshd: torch.Tensor, run: TileRun, num_tiles: int, group) -> torch.Tensor:
    b, s, h, d = x_bshd.shape
    real, off, t0, local = run.layout(s, num_tiles)
    acc = _acc_dtype(x_bshd.dtype)
    grown = F.pad(x_bshd[:, :real], (0, 0, 0, 0, off, local * run.block_size - off - real))
    sums = grown.view(b, local, run.block_size, h, d).sum(2, dtype=acc)   # no fp32 copy of x
    sums = F.pad(sums, (0, 0, 0, 0, t0, num_tiles - t0 - local))          # [B, nT, H, D] in acc
    if group is not None and dist.get_world_size(group) > 1:
        sums = all_reduce_sum(sums, group)
    counts = tile_counts(num_tiles, run.n_tokens, run.block_size, x_bshd.device).to(acc)
    return (sums / counts.clamp(min=1)[None, :, None, None]).to(x_bshd.dtype).transpose(1, 2)


def coarse_attention(q_tiles: torch.Tensor, k_tiles: torch.Tensor, v_tiles: torch.Tensor,
                     tile_index: torch.Tensor, run: Optional[TileRun] = None) -> torch.Tensor:
    """VSA's coarse branch: dense attention of pooled q over pooled k/v (all [B, H, nT, D], default scale
    1/sqrt(D)), each query tile's result given to its tokens: -> [B, S_local, H, D] for the local tokens of
    ``tile_index`` [S_local]; padding tokens (tile >= nT) get zeros. ``run``: spread by expand/reshape (see
    ``TileRun``) instead of an index_select."""
    return spread_tiles(coarse_tiles(q_tiles, k_tiles, v_tiles), tile_index, run)


def coarse_tiles(q_tiles: torch.Tensor, k_tiles: torch.Tensor, v_tiles: torch.Tensor) -> torch.Tensor:
    """The coarse branch per tile: dense attention of pooled q over pooled k/v, [B, H, nT, D] each (input dtype).
    Computed in fp32 (float64 inputs: float64) also under autocast: nT is the token count / tile size (256 at 32K
    tokens), so it costs little, and its dq cancels strongly (pooled tiles score alike): in bf16 it was the SP=1
    top-k step's largest error."""
    with torch.autocast(q_tiles.device.type, enabled=False):
        wide = _wide_dtype(q_tiles.dtype)
        out = kernels.torch_sdpa().call(q_tiles.to(wide), k_tiles.to(wide), v_tiles.to(wide))
    return out.to(q_tiles.dtype)


def spread_tiles(out_tiles: torch.Tensor, tile_index: torch.Tensor, run: Optional[TileRun] = None) -> torch.Tensor:
    """Each tile's row of ``out_tiles`` [B, H, nT, D] given to the local tokens of ``tile_index`` [S_local]:
    -> [B, S_local, H, D], zeros for padding tokens (tile >= nT); ``run``: by expand/reshape."""
    num_tiles = out_tiles.shape[2]
    if run is not None:
        b, h, _, d = out_tiles.shape
        s = tile_index.numel()
        real, off, t0, local = run.layout(s, num_tiles)
        per_tile = out_tiles[:, :, t0:t0 + local].transpose(1, 2)                        # [B, local, H, D]
        spread = per_tile.unsqueeze(2).expand(b, local, run.block_size, h, d).reshape(b, local * run.block_size, h, d)
        spread = spread[:, off:off + real]
        return spread if real == s else F.pad(spread, (0, 0, 0, 0, 0, s - real))   # padding tokens: zeros
    real = tile_index < num_tiles
    per_token = out_tiles.index_select(2, tile_index.clamp(max=num_tiles - 1)).transpose(1, 2)  # [B, S, H, D]
    return per_token * real[None, :, None, None].to(per_token.dtype)


class _GatedSpread(torch.autograd.Function):
    """gate * spread_tiles(out_tiles): saves gate and the small out_tiles, not the spread [B, S, H, D] (rebuilt in
    the backward), one [S, dim] activation less per layer than the plain product."""

    @staticmethod
    def forward(ctx, gate, out_tiles, tile_index, run):
        ctx.save_for_backward(gate, out_tiles, tile_index)
        ctx.run = run
        return gate * spread_tiles(out_tiles, tile_index, run)

    @staticmethod
    def backward(ctx, grad):
        gate, out_tiles, tile_index = ctx.saved_tensors
        with torch.enable_grad():
            tiles = out_tiles.detach().requires_grad_(ctx.needs_input_grad[1])
            spread = spread_tiles(tiles, tile_index, ctx.run)
            g_tiles = torch.autograd.grad(spread, tiles, grad * gate)[0] if ctx.needs_input_grad[1] else None
        g_gate = grad * spread.detach() if ctx.needs_input_grad[0] else None
        return g_gate, g_tiles, None, None


def gated_spread(gate_bshd: torch.Tensor, out_tiles: torch.Tensor, tile_index: torch.Tensor,
                 run: Optional[TileRun] = None) -> torch.Tensor:
    """``gate_bshd * spread_tiles(out_tiles, tile_index, run)`` ([B, S_local, H, D]) without keeping the spread for
    the backward (VSA's gated coarse branch)."""
    return _GatedSpread.apply(gate_bshd, out_tiles, tile_index, run)


def tile_token_mask(block_mask: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """bool [Hm, S, S] from a block mask [Hm, nT, nT] (nT = ceil(S / block_size)): token i attends token j when
    block (i // block_size, j // block_size) is selected."""
    tile_of = torch.arange(seq_len, device=block_mask.device) // block_size
    return block_mask[:, tile_of][:, :, tile_of]


def reference_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor,
                           block_size: int, kv_valid_len: Optional[int] = None) -> torch.Tensor:
    """One-device block-sparse attention (the reference of the SP modes' ``block_mask=``): q, k, v [B, S, H, D] in
    global (tile) order, ``block_mask`` bool [H or 1, nT, nT] over query x key blocks of ``block_size`` tokens;
    keys at positions >= ``kv_valid_len`` are padding. Rows that select no (valid) key give zeros. -> [B, S, H, D].
    torch SDPA with the expanded token mask: O(S^2) memory, for checks and small runs."""
    seq_len = q.shape[1]
    n_tiles = -(-seq_len // block_size)
    heads = q.shape[2]
    if block_mask.dim() != 3 or block_mask.shape[1:] != (n_tiles, n_tiles) or block_mask.shape[0] not in (1, heads):
        raise SPConfigError(f"block_mask of shape {list(block_mask.shape)}: expected [H or 1, {n_tiles}, {n_tiles}] "
                            f"for {seq_len} tokens in tiles of {block_size} ({heads} heads)")
    allowed = tile_token_mask(block_mask.to(q.device), block_size, seq_len)  # [Hm, S, S]
    if kv_valid_len is not None and kv_valid_len < seq_len:
        allowed = allowed & (torch.arange(seq_len, device=q.device) < kv_valid_len)
    any_key = allowed.any(dim=-1)  # [Hm, S]
    safe = allowed | ~any_key[..., None]  # empty rows attend everything, then zeroed: no NaN in fwd or bwd
    o = kernels.torch_sdpa().call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=safe[None])
    o = o * any_key[None, :, :, None].to(o.dtype)
    return o.transpose(1, 2)


@lru_cache(maxsize=16)
def device_window_mask(grid_thw: tuple, tile_thw: tuple, window_thw: tuple, num_tiles: int, device: str) -> torch.Tensor:
    """The window mask padded to ``num_tiles`` on ``device``: ONE tensor per arguments for the whole run, so every
    step and layer passes the same mask and the kernel's metadata for it (FA4's block-sparse tensors) is built once
    (not per forward, which cost host time and a transfer every step)."""
    return pad_tile_mask(window_tile_mask(grid_thw, tile_thw, window_thw), num_tiles).to(device)


