"""A block mask's view for one local kernel call: which query rows attend which key rows, tile by tile.

A block mask (``block_sparse.check_tile_mask``) is a bool tensor ``[H or 1, T, T]`` over the FULL sequence in global
token order: query tile i (tokens ``[i*bs, (i+1)*bs)``) attends key tile j for head h. A kernel call sees some rows of
it: its query rows sit at global positions ``q_pos`` and its key rows at ``k_pos`` (any order, any placement), it
carries the query heads ``heads`` (rows of the mask), and keys at global positions >= ``kv_valid_len`` are padding.
``TileSlice`` is that view; the kernel that runs the call turns it into its own metadata once and keeps it in
``TileSlice.cache`` (the slice lives as long as the ring plan or the Ulysses call that made it), so a slice used by
every step or layer is converted once.

The call's ``causal`` flag (tril within the call's rows) and any explicit token mask AND with the slice. Rows that
select no key: out 0, lse -inf, zero gradients.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(eq=False)
class TileSlice:
    """The block mask's rows for one call. block_mask [H or 1, T, T] bool (global tiles, on the call's device);
    q_pos [Sq] / k_pos [Sk] int64 global positions of the call's query / key rows; heads: the global query heads
    of the call (the mask's rows; ignored for a one-row mask)."""

    block_mask: torch.Tensor
    block_size: int
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    heads: slice = field(default_factory=lambda: slice(None))
    kv_valid_len: Optional[int] = None
    contiguous: bool = False   # q_pos == k_pos == 0..S-1 (the whole sequence): kernels may skip checking the rows
    cache: dict = field(default_factory=dict, repr=False)

    def rows(self, q_rows, kv_rows) -> "TileSlice":
        """The slice of a sub-call: query rows ``q_rows`` and key rows ``kv_rows`` of this call (slices or int64
        index tensors); cached, so a sub-call's metadata is built once too."""
        key = ("rows", _rows_key(q_rows), _rows_key(kv_rows))
        if key not in self.cache:
            self.cache[key] = TileSlice(self.block_mask, self.block_size, _take(self.q_pos, q_rows),
                                        _take(self.k_pos, kv_rows), self.heads, self.kv_valid_len)
        return self.cache[key]

    def with_heads(self, heads: slice) -> "TileSlice":
        """The same rows for the query heads ``heads`` (a head chunk's mask rows); cached."""
        if self.block_mask.shape[0] == 1:
            return self
        key = ("heads", heads.start, heads.stop, heads.step)
        if key not in self.cache:
            self.cache[key] = TileSlice(self.block_mask, self.block_size, self.q_pos, self.k_pos, heads,
                                        self.kv_valid_len, self.contiguous)
        return self.cache[key]

    def mask_rows(self) -> torch.Tensor:
        """The mask's rows of this call's heads: [h, T, T], or the broadcasting [1, T, T]."""
        return self.block_mask if self.block_mask.shape[0] == 1 else self.block_mask[self.heads]

    def token_mask(self, causal: bool = False) -> torch.Tensor:
        """Token-level keep mask [h or 1, Sq, Sk] bool: the tiles AND (``causal``) k_pos <= q_pos AND k_pos <
        kv_valid_len. Built on the mask's device; O(Sq * Sk): for reference kernels and tests."""
        dev = self.block_mask.device
        qp, kp = self.q_pos.to(dev), self.k_pos.to(dev)
        m = self.mask_rows().index_select(1, qp // self.block_size).index_select(2, kp // self.block_size)
        if causal:
            m = m & (kp.unsqueeze(0) <= qp.unsqueeze(1))
        if self.kv_valid_len is not None:
            m = m & (kp < self.kv_valid_len)
        return m

    def selects_any(self, causal: bool = False) -> bool:
        """Whether any query of the call attends any key (any of its heads), decided at tile level (T x T work, no
        token mask; one host sync). Exact: under ``causal`` a tile pair counts when the smallest key position of
        the key tile is <= the largest query position of the query tile."""
        key = ("any", bool(causal))
        if key not in self.cache:
            self.cache[key] = _selects_any(self, causal)
        return self.cache[key]


def _rows_key(rows) -> tuple:
    if isinstance(rows, slice):
        return ("s", rows.start, rows.stop, rows.step)
    return ("t", rows.data_ptr(), rows.numel())


def _take(pos: torch.Tensor, rows) -> torch.Tensor:
    return pos[rows] if isinstance(rows, slice) else pos.index_select(0, rows.to(pos.device))


def _selects_any(ts: TileSlice, causal: bool) -> bool:
    dev = ts.block_mask.device
    t = ts.block_mask.shape[-1]
    qp, kp = ts.q_pos.to(dev), ts.k_pos.to(dev)
    if ts.kv_valid_len is not None:
        kp = kp[kp < ts.kv_valid_len]
    if qp.numel() == 0 or kp.numel() == 0:
        return False
    qt, kt = qp // ts.block_size, kp // ts.block_size
    rows = ts.mask_rows().any(0)  # [T, T]
    big = torch.iinfo(torch.long).max
    q_max = torch.full((t,), -1, dtype=torch.long, device=dev).scatter_reduce(0, qt, qp, "amax")
    k_min = torch.full((t,), big, dtype=torch.long, device=dev).scatter_reduce(0, kt, kp, "amin")
    sel = rows & (q_max >= 0).unsqueeze(1) & (k_min < big).unsqueeze(0)
    if causal:
        sel = sel & (k_min.unsqueeze(0) <= q_max.unsqueeze(1))
    return bool(sel.any())


def full_sequence_slice(block_mask: torch.Tensor, block_size: int, seq_len: int, kv_valid_len: Optional[int],
                        device) -> TileSlice:
    """The slice of a call over the whole sequence in global order (queries and keys at 0..seq_len-1, every head):
    one per (mask tensor and its version, sizes, padding, device), kept while the mask tensor lives (a handful, LRU),
    so a mask shared by the layers of a step is converted once and a changed or new mask never hits a stale one."""
    key = (id(block_mask), block_mask._version, tuple(block_mask.shape), block_size, seq_len, kv_valid_len,
           str(device))
    hit = _FULL.get(key)
    if hit is not None and hit[0]() is block_mask:
        _FULL.move_to_end(key)
        return hit[1]
    pos = torch.arange(seq_len, device=device)
    ts = TileSlice(block_mask, block_size, pos, pos, slice(None), kv_valid_len, contiguous=True)
    _FULL[key] = (weakref.ref(block_mask), ts)
    while len(_FULL) > FULL_SLICES:
        _FULL.popitem(last=False)
    return ts


FULL_SLICES = 16
_FULL = OrderedDict()
