"""Pack/unpack between the sequence-sharded layout and per-peer exchange segments.

Local side: x in "bshd" [B, S_loc, H, D] or "sbhd" [S_loc, B, H, D] (all heads, local tokens).
Exchange segment for peer p: [S_loc, B, w_p, D] contiguous, where w_p is the sum of the head
widths of the parts (e.g. q | k | v heads of p's chunk c) placed side by side on the head axis.
Head-sharded side: the received buffer viewed as [S, B, W, D] (S = P * S_loc, rank order), so
q, k and v of a chunk are zero-copy views (``columns``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .heads import HeadLayout


def _chunk(layout: HeadLayout, kind: str, rank: int, c: int) -> tuple[int, int]:
    table = layout.q_chunks if kind == "q" else layout.kv_chunks
    return table[rank][c]


def _range(layout: HeadLayout, kind: str, rank: int, c: int) -> tuple[int, int]:
    return layout.q_range(rank, c) if kind == "q" else layout.kv_range(rank, c)


def widths(layout: HeadLayout, kinds: Sequence[str], rank: int, c: int) -> list[int]:
    """Head widths of each part for ``rank``'s chunk ``c``."""
    return [_chunk(layout, k, rank, c)[1] for k in kinds]


def _seq_major(x: torch.Tensor, a: int, b: int, seq_layout: str) -> torch.Tensor:
    """Heads [a, b) of x as an [S_loc, B, n, D] view."""
    part = x[:, :, a:b]
    return part.transpose(0, 1) if seq_layout == "bshd" else part


def _all_peers_view(x: torch.Tensor, layout: HeadLayout, kind: str, c: int, seq_layout: str) -> torch.Tensor:
    """Even layouts only: chunk c of every peer's heads as one [P, S_loc, B, n, D] view."""
    per_rank = layout.q_counts[0] if kind == "q" else layout.kv_counts[0]
    start, size = _chunk(layout, kind, 0, c)
    if seq_layout == "bshd":
        b, s, _, d = x.shape
        return x.view(b, s, layout.world, per_rank, d)[:, :, :, start:start + size].permute(2, 1, 0, 3, 4)
    s, b, _, d = x.shape
    return x.view(s, b, layout.world, per_rank, d)[:, :, :, start:start + size].permute(2, 0, 1, 3, 4)


def seg_splits(layout: HeadLayout, kinds: Sequence[str], c: int, tokens: int, d: int) -> list[int]:
    """Element counts of each peer's segment (tokens = S_loc * B)."""
    return [tokens * sum(widths(layout, kinds, p, c)) * d for p in range(layout.world)]


def _dims(x0: torch.Tensor, seq_layout: str) -> tuple[int, int, int]:
    """(S_loc, B, D) of a local-layout tensor."""
    s_loc, bsz = (x0.shape[1], x0.shape[0]) if seq_layout == "bshd" else (x0.shape[0], x0.shape[1])
    return s_loc, bsz, x0.shape[-1]


def pack(parts: Sequence[torch.Tensor], kinds: Sequence[str], layout: HeadLayout, c: int,
         seq_layout: str, out: torch.Tensor) -> list[int]:
    """Copy chunk c of ``parts`` (local layout) into the flat send buffer ``out``; returns splits."""
    s_loc, bsz, d = _dims(parts[0], seq_layout)
    splits = seg_splits(layout, kinds, c, s_loc * bsz, d)
    if layout.even:
        ws = widths(layout, kinds, 0, c)
        buf = out.view(layout.world, s_loc, bsz, sum(ws), d)
        col = 0
        for x, kind, w in zip(parts, kinds, ws):
            buf[:, :, :, col:col + w].copy_(_all_peers_view(x, layout, kind, c, seq_layout))
            col += w
        return splits
    off = 0
    for p in range(layout.world):
        ws = widths(layout, kinds, p, c)
        seg = out[off:off + splits[p]].view(s_loc, bsz, sum(ws), d)
        col = 0
        for x, kind, w in zip(parts, kinds, ws):
            a, b = _range(layout, kind, p, c)
            seg[:, :, col:col + w].copy_(_seq_major(x, a, b, seq_layout))
            col += w
        off += splits[p]
    return splits


def unpack(flat: torch.Tensor, parts: Sequence[torch.Tensor], kinds: Sequence[str], layout: HeadLayout,
           c: int, seq_layout: str) -> None:
    """Inverse of ``pack``: copy each peer's segment of ``flat`` into chunk c of ``parts``."""
    s_loc, bsz, d = _dims(parts[0], seq_layout)
    splits = seg_splits(layout, kinds, c, s_loc * bsz, d)
    if layout.even:
        ws = widths(layout, kinds, 0, c)
        buf = flat.view(layout.world, s_loc, bsz, sum(ws), d)
        col = 0
        for x, kind, w in zip(parts, kinds, ws):
            _all_peers_view(x, layout, kind, c, seq_layout).copy_(buf[:, :, :, col:col + w])
            col += w
        return
    off = 0
    for p in range(layout.world):
        ws = widths(layout, kinds, p, c)
        seg = flat[off:off + splits[p]].view(s_loc, bsz, sum(ws), d)
        col = 0
        for x, kind, w in zip(parts, kinds, ws):
            a, b = _range(layout, kind, p, c)
            _seq_major(x, a, b, seq_layout).copy_(seg[:, :, col:col + w])
            col += w
        off += splits[p]


def columns(buf_sbwd: torch.Tensor, ws: Sequence[int]) -> list[torch.Tensor]:
    """Split a head-sharded [S, B, W, D] buffer into per-part views, each returned as bhsd [B, n, S, D]."""
    out, col = [], 0
    for w in ws:
        out.append(buf_sbwd[:, :, col:col + w].permute(1, 2, 0, 3))
        col += w
    return out
