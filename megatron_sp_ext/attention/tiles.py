"""A block mask's view for one local kernel call: which query rows attend which key rows, tile by tile.

A block mask (``block_sparse.check_tile_mask``) is a bool tensor ``[H or 1, T, T]`` over the FULL sequence in global
token order: query tile i (tokens ``[i*tile, (i+1)*tile)``) attends key tile j for head h. A kernel call sees some rows
of it: its query rows sit at global positions ``q_pos`` and its key rows at ``k_pos`` (any order, any placement), it
carries the query heads ``heads`` (rows of the mask), and keys at global positions >= ``kv_valid_len`` are padding.
``TileSlice`` is that view.

Two kinds of data, kept apart so that a call whose mask is new (a top-k mask per layer) needs no host sync:
  - the rows' positions are HOST data (they follow from the placement: ``q_pos`` / ``k_pos`` live on the CPU), so a
    kernel decides on the host, without reading the device, whether it can run the call (tile alignment of its
    blocks, identical increasing rows for causal, padding inside a block);
  - the mask is DEVICE data (on the call's device), read only by device ops: the kernels' metadata (FA4's block
    lists, cuDNN's, flex's BlockMask, the math kernel's token mask) is built from it on the device.
A whole-sequence slice (``contiguous``: rows 0..S-1, the Ulysses chunks' and one rank's calls) makes its device
positions by ``arange`` on the device; other slices (a ring step's rows) copy their positions to the device once,
from pinned memory without blocking the host.

Each kernel keeps its metadata in ``TileSlice.cache``, so a slice converts once for as long as it lives. Slices live
on their ``AttentionProblem`` (``problem_slice``: one per problem, sequence length, padding and device; a ring plan's
per step, in the plan the problem keeps): a mask shared by every layer of a step is converted once per step, a
layer's own top-k mask (its own derived problem) once for that layer's forward and backward, and nothing is keyed
on tensor ids. The call's ``causal`` flag ANDs at token level by global position (key position <= query position;
kernels that apply causal as tril over the rows run only rows where the two agree). Rows that select no key: out 0,
lse -inf, zero gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(eq=False)
class TileSlice:
    """The block mask's rows for one call. block_mask [H or 1, T, T] bool (global tiles, on the call's device);
    tile: tokens per mask tile; q_pos [Sq] / k_pos [Sk] int64 global positions of the call's query / key rows (host
    tensors; given on a device they are copied to the host once, a sync); heads: the global query heads of the call
    (the mask's rows; ignored for a one-row mask); contiguous: q_pos == k_pos == 0..S-1 (the whole sequence)."""

    block_mask: torch.Tensor
    tile: int
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    heads: slice = field(default_factory=lambda: slice(None))
    kv_valid_len: Optional[int] = None
    contiguous: bool = False
    cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.q_pos, self.k_pos = _host(self.q_pos), _host(self.k_pos)

    @property
    def block_size(self) -> int:
        """``tile`` under its older name."""
        return self.tile

    @property
    def device(self) -> torch.device:
        """Where the mask (and so the kernels' metadata) lives."""
        return self.block_mask.device

    def rows(self, q_rows, kv_rows) -> "TileSlice":
        """The slice of a sub-call: query rows ``q_rows`` and key rows ``kv_rows`` of this call (slices, cached; or
        int64 index tensors, on the host to stay sync-free)."""
        if isinstance(q_rows, slice) and isinstance(kv_rows, slice):
            key = ("rows", q_rows.start, q_rows.stop, q_rows.step, kv_rows.start, kv_rows.stop, kv_rows.step)
            if key not in self.cache:
                self.cache[key] = self._sub(q_rows, kv_rows)
            return self.cache[key]
        return self._sub(q_rows, kv_rows)

    def _sub(self, q_rows, kv_rows) -> "TileSlice":
        return TileSlice(self.block_mask, self.tile, _take(self.q_pos, q_rows), _take(self.k_pos, kv_rows),
                         self.heads, self.kv_valid_len)

    def with_heads(self, heads: slice) -> "TileSlice":
        """The same rows for the query heads ``heads`` (a head chunk's mask rows); cached."""
        if self.block_mask.shape[0] == 1:
            return self
        key = ("heads", heads.start, heads.stop, heads.step)
        if key not in self.cache:
            self.cache[key] = TileSlice(self.block_mask, self.tile, self.q_pos, self.k_pos, heads,
                                        self.kv_valid_len, self.contiguous)
        return self.cache[key]

    def mask_rows(self) -> torch.Tensor:
        """The mask's rows of this call's heads: [h, T, T], or the broadcasting [1, T, T]."""
        return self.block_mask if self.block_mask.shape[0] == 1 else self.block_mask[self.heads]

    # -- host decisions (no device read)
    def identical_increasing(self) -> bool:
        """Whether the query and key rows are the same strictly increasing positions: causal by position is then tril
        over the rows (what FA4's and cuDNN's causal kernels apply). Host only; cached."""
        if "increasing" not in self.cache:
            qp, kp = self.q_pos, self.k_pos
            self.cache["increasing"] = self.contiguous or (
                qp.numel() == kp.numel() and bool(torch.equal(qp, kp)) and bool((qp[1:] > qp[:-1]).all()))
        return self.cache["increasing"]

    def valid_keys(self) -> Optional[torch.Tensor]:
        """bool [Sk] on the host: the key rows before ``kv_valid_len`` (None: no padding)."""
        return None if self.kv_valid_len is None else self.k_pos < self.kv_valid_len

    def padded(self) -> bool:
        """Whether any key row is padding (host only)."""
        if self.kv_valid_len is None:
            return False
        if self.contiguous:
            return self.kv_valid_len < self.k_pos.numel()
        return bool((self.k_pos >= self.kv_valid_len).any())

    # -- device data (no host sync for whole-sequence slices; other slices copy their positions once)
    def positions_on_device(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_pos, k_pos) on the mask's device: ``arange`` there for a whole-sequence slice, else one copy each
        that does not block the host (cached)."""
        if "dev_pos" not in self.cache:
            dev = self.device
            if self.contiguous:
                qp = torch.arange(self.q_pos.numel(), device=dev)
                kp = qp if self.k_pos.numel() == self.q_pos.numel() else torch.arange(self.k_pos.numel(), device=dev)
            else:
                qp, kp = _to_device(self.q_pos, dev), _to_device(self.k_pos, dev)
            self.cache["dev_pos"] = (qp, kp)
        return self.cache["dev_pos"]

    def tiles_of_rows(self, which: str, step: int = 1) -> torch.Tensor:
        """int64 tile index of the query (``which`` "q") or key ("k") rows 0, step, 2*step, ... on the mask's device
        (whole-sequence slices: by ``arange`` there, no copy)."""
        pos = self.q_pos if which == "q" else self.k_pos
        if self.contiguous:
            return torch.arange(0, pos.numel(), step, device=self.device) // self.tile
        qp, kp = self.positions_on_device()
        return (qp if which == "q" else kp)[::step] // self.tile

    def valid_keys_on_device(self) -> torch.Tensor:
        """bool [Sk] on the mask's device: the key rows before ``kv_valid_len`` (all True without padding)."""
        kp = self.positions_on_device()[1]
        if self.kv_valid_len is None:
            return torch.ones(kp.shape, dtype=torch.bool, device=kp.device)
        return kp < self.kv_valid_len

    def token_mask(self, causal: bool = False) -> torch.Tensor:
        """Token-level keep mask [h or 1, Sq, Sk] bool on the mask's device: the tiles AND (``causal``) k_pos <= q_pos
        AND k_pos < kv_valid_len. O(Sq * Sk): for reference kernels and tests."""
        qp, kp = self.positions_on_device()
        m = self.mask_rows().index_select(1, qp // self.tile).index_select(2, kp // self.tile)
        if causal:
            m = m & (kp.unsqueeze(0) <= qp.unsqueeze(1))
        if self.kv_valid_len is not None:
            m = m & (kp < self.kv_valid_len)
        return m

    def selects_any(self, causal: bool = False) -> bool:
        """Whether any query of the call attends any key (any of its heads), decided at tile level (T x T work, no
        token mask). Exact: under ``causal`` a tile pair counts when the smallest key position of the key tile is
        <= the largest query position of the query tile. Reads the mask: a host mask (the ring's skip tables) costs no
        sync, a device mask one."""
        key = ("any", bool(causal))
        if key not in self.cache:
            self.cache[key] = _selects_any(self, causal)
        return self.cache[key]


def _host(pos: torch.Tensor) -> torch.Tensor:
    pos = torch.as_tensor(pos)
    return pos if pos.device.type == "cpu" else pos.cpu()


def _to_device(pos: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on ``dev``: to a CUDA device from pinned memory without blocking the host (torch's pinned
    allocator keeps the source until the copy ran), elsewhere a plain copy."""
    if dev.type == "cuda":
        return pos.pin_memory().to(dev, non_blocking=True)
    return pos.to(dev)


def _take(pos: torch.Tensor, rows) -> torch.Tensor:
    return pos[rows] if isinstance(rows, slice) else pos.index_select(0, _host(rows))


def _selects_any(ts: TileSlice, causal: bool) -> bool:
    dev = ts.block_mask.device
    t = ts.block_mask.shape[-1]
    qp, kp = ts.q_pos.to(dev), ts.k_pos.to(dev)
    if ts.kv_valid_len is not None:
        kp = kp[kp < ts.kv_valid_len]
    if qp.numel() == 0 or kp.numel() == 0:
        return False
    qt, kt = qp // ts.tile, kp // ts.tile
    rows = ts.mask_rows().any(0)  # [T, T]
    big = torch.iinfo(torch.long).max
    q_max = torch.full((t,), -1, dtype=torch.long, device=dev).scatter_reduce(0, qt, qp, "amax")
    k_min = torch.full((t,), big, dtype=torch.long, device=dev).scatter_reduce(0, kt, kp, "amin")
    sel = rows & (q_max >= 0).unsqueeze(1) & (k_min < big).unsqueeze(0)
    if causal:
        sel = sel & (k_min.unsqueeze(0) <= q_max.unsqueeze(1))
    return bool(sel.any())


def full_sequence_slice(block_mask: torch.Tensor, tile: int, seq_len: int, kv_valid_len: Optional[int],
                        device=None) -> TileSlice:
    """The slice of a call over the whole sequence in global order (queries and keys at 0..seq_len-1, every head),
    its mask on ``device`` (default: where it is). Uncached: ``problem_slice`` keeps one per problem."""
    mask = block_mask if device is None else block_mask.to(device)
    pos = torch.arange(seq_len)
    return TileSlice(mask, tile, pos, pos, slice(None), kv_valid_len, contiguous=True)


def problem_slice(pr, device) -> TileSlice:
    """The whole-sequence slice of a bound problem ``pr`` (``sp.problem.BoundProblem``: its mask on ``device``, its
    tile, the full sequence the mask covers, its padding), built once per problem (``AttentionProblem.cached``):
    every call of that problem (the layers of a step, a checkpoint's recompute, the backward) reuses it and the
    kernels' metadata it keeps. The source mask's in-place version is part of the key (changed in place: a new
    slice)."""
    source = pr.source
    key = ("tiles", pr.mask_seq_len, pr.block_size, pr.kv_valid_len, str(device), source.block_mask._version)
    return source.cached(key, lambda: full_sequence_slice(pr.mask_on(device), pr.block_size, pr.mask_seq_len,
                                                          pr.kv_valid_len))
