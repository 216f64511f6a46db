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

from ..heads import HeadLayout
from ..problem import seq_batch


_WORD = torch.int64   # what ``copy_bits`` moves: 8-byte words (4 bf16 / fp16 values, 2 fp32)


def as_words(t: torch.Tensor) -> "torch.Tensor | None":
    """``t`` reinterpreted as 8-byte words (same storage, last dim / ratio), or None where that view does not exist
    (last dim not contiguous or not a multiple of the ratio, misaligned offset or strides, 8-byte dtypes)."""
    if t.element_size() >= 8 or t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.detach().view(_WORD)
    except RuntimeError:
        return None


def _word_pair(dst: torch.Tensor, src: torch.Tensor) -> "tuple | None":
    """(dst, src) as words for a same-dtype, same-shape copy on a GPU, else None. Not on CPU: torch's CPU copy of
    2-byte values was faster than of words (3.2 vs 3.9 ms, one q [4096, 40, 128] bf16 head split, 2 cores,
    2026-11-28)."""
    if dst.device.type == "cpu" or dst.dtype != src.dtype or dst.shape != src.shape:
        return None
    if torch.is_grad_enabled() and (dst.requires_grad or src.requires_grad):
        return None   # a differentiable copy (or torch's in-place check on a leaf): copy_ keeps autograd's view
    dw, sw = as_words(dst), as_words(src)
    return None if dw is None or sw is None else (dw, sw)


def copy_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, moving 8-byte words on a GPU where both have a view as words (a head's D values are
    contiguous in every layout here): the strided copies around the exchanges index 4x fewer elements (bf16). The
    same bytes either way."""
    pair = _word_pair(dst, src)
    if pair is None:
        dst.copy_(src)
    else:
        pair[0].copy_(pair[1])


def index_copy_bits(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(dim, index, src)`` (``dim`` not the last), as 8-byte words where ``copy_bits`` would."""
    pair = _word_pair(dst, src) if dst.dim() and dim % dst.dim() != dst.dim() - 1 else None
    if pair is None:
        dst.index_copy_(dim, index, src)
    else:
        pair[0].index_copy_(dim, index, pair[1])


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


def all_peers_view(x: torch.Tensor, layout: HeadLayout, kind: str, c: int, seq_layout: str) -> torch.Tensor:
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
    return (*seq_batch(x0.shape, seq_layout), x0.shape[-1])


def stacked(parts: Sequence[torch.Tensor]) -> "torch.Tensor | None":
    """``parts`` (n >= 2 tensors) as ONE [n, *shape] view when they are equally spaced views of one storage with
    one shape, dtype and strides (q, k, v split from one fused projection output: Megatron's
    [S, B, ng, 3 * D] for MHA, a [.., H, 3, D] or [.., 3, H, D] qkv), else None. Slice i of it is ``parts[i]``
    element for element (same storage offset and strides), so copying from it reads exactly those tensors."""
    if len(parts) < 2:
        return None
    x0 = parts[0]
    if any(t.shape != x0.shape or t.stride() != x0.stride() or t.dtype != x0.dtype or t.device != x0.device
           or t.untyped_storage().data_ptr() != x0.untyped_storage().data_ptr() for t in parts[1:]):
        return None
    delta = parts[1].storage_offset() - x0.storage_offset()
    if delta == 0 or any(parts[i + 1].storage_offset() - parts[i].storage_offset() != delta
                         for i in range(len(parts) - 1)):
        return None
    return x0.as_strided((len(parts), *x0.shape), (delta, *x0.stride()), x0.storage_offset())


def _fused_runs(parts: Sequence[torch.Tensor], kinds: Sequence[str], layout: HeadLayout, c: int):
    """Consecutive parts that one copy can pack: [(first index, count, stacked view or None)]. Parts fuse when
    ``stacked`` finds them in one storage and every rank holds the same heads of each (same widths and per-rank
    counts: q with k/v for MHA, k with v for GQA)."""
    runs, i = [], 0
    while i < len(parts):
        j = len(parts)
        while j > i + 1:
            ks = kinds[i:j]
            counts = {(layout.q_counts if k == "q" else layout.kv_counts) for k in ks}
            if len(counts) == 1 and len(set(widths(layout, ks, 0, c))) == 1:
                view = stacked(parts[i:j])
                if view is not None:
                    runs.append((i, j - i, view))
                    break
            j -= 1
        if j == i + 1:
            runs.append((i, 1, None))
        i = j
    return runs


def _all_peers_stacked(x: torch.Tensor, layout: HeadLayout, kind: str, c: int, seq_layout: str) -> torch.Tensor:
    """Even layouts only: ``all_peers_view`` of each slice of a stacked [n, ...] view, as [P, S_loc, B, n, w, D]."""
    per_rank = layout.q_counts[0] if kind == "q" else layout.kv_counts[0]
    start, size = _chunk(layout, kind, 0, c)
    n, a, b_, _, d = x.shape
    y = x.view(n, a, b_, layout.world, per_rank, d)[:, :, :, :, start:start + size]
    return y.permute(3, 2, 1, 0, 4, 5) if seq_layout == "bshd" else y.permute(3, 1, 2, 0, 4, 5)


def pack(parts: Sequence[torch.Tensor], kinds: Sequence[str], layout: HeadLayout, c: int,
         seq_layout: str, out: torch.Tensor) -> list[int]:
    """Copy chunk c of ``parts`` (local layout) into the flat send buffer ``out``; returns splits.
    Even layouts: parts that are equally spaced views of one fused tensor (``stacked``) are packed by one copy
    (q|k|v of an MHA projection in one pass, k|v for GQA) instead of one copy each; same bytes, same values."""
    s_loc, bsz, d = _dims(parts[0], seq_layout)
    splits = seg_splits(layout, kinds, c, s_loc * bsz, d)
    if layout.even:
        ws = widths(layout, kinds, 0, c)
        buf = out.view(layout.world, s_loc, bsz, sum(ws), d)
        col = 0
        for i, n, view in _fused_runs(parts, kinds, layout, c):
            w = ws[i]
            if view is None:
                copy_bits(buf[:, :, :, col:col + w], all_peers_view(parts[i], layout, kinds[i], c, seq_layout))
            else:
                dst = buf[:, :, :, col:col + n * w].unflatten(3, (n, w))
                copy_bits(dst, _all_peers_stacked(view, layout, kinds[i], c, seq_layout))
            col += n * w
        return splits
    off = 0
    for p in range(layout.world):
        ws = widths(layout, kinds, p, c)
        seg = out[off:off + splits[p]].view(s_loc, bsz, sum(ws), d)
        col = 0
        for x, kind, w in zip(parts, kinds, ws):
            a, b = _range(layout, kind, p, c)
            copy_bits(seg[:, :, col:col + w], _seq_major(x, a, b, seq_layout))
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
            copy_bits(all_peers_view(x, layout, kind, c, seq_layout), buf[:, :, :, col:col + w])
            col += w
        return
    off = 0
    for p in range(layout.world):
        ws = widths(layout, kinds, p, c)
        seg = flat[off:off + splits[p]].view(s_loc, bsz, sum(ws), d)
        col = 0
        for x, kind, w in zip(parts, kinds, ws):
            a, b = _range(layout, kind, p, c)
            copy_bits(_seq_major(x, a, b, seq_layout), seg[:, :, col:col + w])
            col += w
        off += splits[p]


def columns(buf_sbwd: torch.Tensor, ws: Sequence[int]) -> list[torch.Tensor]:
    """Split a head-sharded [S, B, W, D] buffer into per-part views, each returned as bhsd [B, n, S, D]."""
    out, col = [], 0
    for w in ws:
        out.append(buf_sbwd[:, :, col:col + w].permute(1, 2, 0, 3))
        col += w
    return out


# --- sequence order of the head-sharded side ---------------------------------------------------------
# The exchange delivers the gathered sequence in rank order (rank p's shard, in p's local order). With a
# non-contiguous placement (zigzag, tasp_zigzag) that is not global order, and one causal kernel call
# needs global order. Every placement cuts the sequence into equal pieces, so the permutation is a piece
# permutation; it is folded into the copies the exchange path makes anyway (received q/k/v/dO into the
# kernel's native layout, and the kernel's output/grads into the send buffers), never a copy of its own.


class SeqOrder:
    """Piece permutation between rank order and global order of the gathered sequence.

    piece: tokens per piece (u).  to_global[j]: global piece index of gathered piece j (rank order).
    """

    def __init__(self, piece: int, to_global: Sequence[int]) -> None:
        self.piece, self.to_global = piece, tuple(to_global)
        inv = [0] * len(self.to_global)
        for j, g in enumerate(self.to_global):
            inv[g] = j
        self.from_global = tuple(inv)
        self._idx: dict = {}

    def index(self, which: str, device) -> torch.Tensor:
        """int64 index tensor ("to_global" or "from_global") on ``device`` (cached)."""
        key = (which, str(device))
        if key not in self._idx:
            self._idx[key] = torch.tensor(getattr(self, which), dtype=torch.int64, device=device)
        return self._idx[key]


def seq_order(runs_by_rank: Sequence[Sequence[tuple[int, int]]]) -> "SeqOrder | None":
    """The order of ``runs_by_rank`` (each rank's global (start, len) runs, local order) gathered in
    rank order; None when that already is global order (contiguous placement)."""
    flat = [r for runs in runs_by_rank for r in runs]
    u = flat[0][1]
    if any(n != u for _, n in flat) or any(a % u for a, _ in flat):
        raise ValueError(f"placement pieces are not equal-length: {flat}")
    to_global = [a // u for a, _ in flat]
    if sorted(to_global) != list(range(len(flat))):
        raise ValueError(f"placement pieces do not tile the sequence: {flat}")
    if to_global == list(range(len(flat))):
        return None
    return SeqOrder(u, to_global)


def sorted_order(runs_by_rank: Sequence[Sequence[tuple[int, int]]]) -> tuple["SeqOrder | None", tuple]:
    """For equal-length pieces that need not tile [0, S) (a hybrid mesh's Ulysses group holds a subset of
    the sequence): the permutation of the gathered pieces (rank order) into ascending global position,
    and the merged global runs of the sorted sequence. (None, runs) when already ascending."""
    flat = [r for runs in runs_by_rank for r in runs]
    u = flat[0][1]
    if any(n != u for _, n in flat):
        raise ValueError(f"placement pieces are not equal-length: {flat}")
    rank_of = {j: i for i, j in enumerate(sorted(range(len(flat)), key=lambda j: flat[j][0]))}
    to_global = [rank_of[j] for j in range(len(flat))]
    merged: list = []
    for a, n in sorted(flat):
        if merged and merged[-1][0] + merged[-1][1] == a:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((a, n))
    order = None if to_global == list(range(len(flat))) else SeqOrder(u, to_global)
    return order, tuple(merged)


def to_kernel_layout(src_sbhd: torch.Tensor, order: "SeqOrder | None") -> torch.Tensor:
    """Gathered [S, B, h, D] (rank order, any strides) -> a new [B, S, h, D]-backed tensor in global order,
    returned as a bhsd [B, h, S, D] view (the layout the attention kernels read natively). Without an
    order it is exactly ``src.permute(1, 2, 0, 3).transpose(1, 2).contiguous().transpose(1, 2)``."""
    s, b, h, d = src_sbhd.shape
    dst = torch.empty((b, s, h, d), dtype=src_sbhd.dtype, device=src_sbhd.device)
    if order is None:
        copy_bits(dst, src_sbhd.transpose(0, 1))
    else:
        n = len(order.to_global)
        src = src_sbhd.view(n, order.piece, b, h, d).permute(2, 0, 1, 3, 4)
        index_copy_bits(dst.view(b, n, order.piece, h, d), 1, order.index("to_global", dst.device), src)
    return dst.transpose(1, 2)


def to_send_layout(t_bhsd: torch.Tensor, order: "SeqOrder | None", out_sbhd: torch.Tensor) -> None:
    """Head-sharded result [B, h, S, D] in global order -> ``out_sbhd`` [S, B, h, D] (any strides) in rank
    order (the inverse of ``to_kernel_layout``'s permutation), one copy."""
    src = t_bhsd.permute(2, 0, 1, 3)
    if order is None:
        copy_bits(out_sbhd, src)
        return
    s, b, h, d = src.shape
    n = len(order.to_global)
    index_copy_bits(out_sbhd.view(n, order.piece, b, h, d), 0, order.index("from_global", src.device),
                    src.reshape(n, order.piece, b, h, d))


def columns_sbhd(buf_sbwd: torch.Tensor, ws: Sequence[int]) -> list[torch.Tensor]:
    """Split a head-sharded [S, B, W, D] buffer into per-part [S, B, w, D] views."""
    out, col = [], 0
    for w in ws:
        out.append(buf_sbwd[:, :, col:col + w])
        col += w
    return out
