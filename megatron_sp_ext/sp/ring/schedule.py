"""What one ring rank computes and moves at each step: kernel calls on contiguous slices, and the
segment layout of its K|V buffer.

Tokens are held in a *compute order*: with "tasp_zigzag" (causal TASP) a rank's tokens sorted by
global position (= the "zigzag" order); with one rank (masked Ulysses) every run sorted by global
position; otherwise the local order. In compute order a causal diagonal pair is ONE causal kernel call.

K|V buffers are [S_kv, 2, B, Hkv, D]: a K|V block is one row range, K and V are zero-copy bhsd views.
A slot (ring i's K|V block) is one segment, or for causal "tasp_zigzag" two segments (piece, mirror of u
rows each) whose buffer rows change per step: the slots whose origin precedes this rank (A) put their
pieces first, the others (B) follow, mirrors in reverse, so the buffer reads
[A pieces | B pieces | B mirrors | A mirrors]: all queries x A pieces and the later query half x
(B pieces + B mirrors) are two contiguous calls, and at step 0 (all own) the buffer is in zigzag order.

``step_items`` turns (query runs, key runs of one step) into kernel calls: one call when the used
rows are contiguous and the mask is full or exactly causal, else one call per diagonal/misaligned
run pair and one per contiguous key range of each group of fully visible keys (no index copies
unless query rows of a group are scattered).

Packed samples (``cu``: cumulative sample lengths over the full sequence): a query and a key interact only
within one sample, so the runs are split at sample boundaries (``sample_runs``; pieces touching in both rows
and positions merged) and each sample's query runs x key runs become kernel calls as above, causal by global
position inside the sample. Samples never share a call (no mask across samples): a step costs about one call
per sample it touches.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ...attention.tiles import TileSlice

Rows = Union[slice, torch.Tensor]   # a contiguous row range, or int64 indices (rare fallback)
Run = tuple[int, int, int]          # (global start, length, buffer/compute row)


@dataclass
class Item:
    """One kernel call: q rows x kv buffer rows, full (default), causal (diagonal) or with a bool mask; under a
    block mask also its ``tiles`` (``attention.tiles.TileSlice``, ANDed with the rest by the kernel)."""

    q_rows: Rows
    kv_rows: Rows
    causal: bool = False
    mask: Optional[torch.Tensor] = None
    tiles: Optional[TileSlice] = None


def _rel(q: Run, k: Run, causal: bool) -> str:
    """full / none / diag / partial of a (q run, k run) pair under the causal rule q_pos >= k_pos."""
    if not causal:
        return "full"
    qa, ql, _ = q
    ka, kl, _ = k
    if ka + kl - 1 <= qa:
        return "full"
    if ka >= qa + ql:
        return "none"
    if ka == qa and kl == ql:
        return "diag"
    return "partial"


def _coalesce(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted (row, len) ranges with touching neighbours merged."""
    out: list[tuple[int, int]] = []
    for r, n in sorted(runs):
        if out and out[-1][0] + out[-1][1] == r:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((r, n))
    return out


def _global_seq(runs: Sequence[Run]) -> list[tuple[int, int]]:
    """Global (start, len) of runs in row order, touching neighbours merged."""
    out: list[tuple[int, int]] = []
    for g, n, _ in sorted(runs, key=lambda r: r[2]):
        if out and out[-1][0] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((g, n))
    return out


def _rows(runs: Sequence[tuple[int, int]], device) -> Rows:
    co = _coalesce(runs)
    if len(co) == 1:
        return slice(co[0][0], co[0][0] + co[0][1])
    return torch.cat([torch.arange(r, r + n, device=device) for r, n in co])


def sample_runs(runs: Sequence[Run], cu: Sequence[int]) -> dict[int, list[Run]]:
    """``runs`` (global start, length, row) split at the sample boundaries ``cu``, by sample index; a piece that
    continues the previous piece of its sample in both position and row is merged into it."""
    out: dict[int, list[Run]] = {}
    for g, n, r in runs:
        while n > 0:
            s = bisect_right(cu, g) - 1  # the (non-empty) sample holding position g
            ln = min(n, cu[s + 1] - g)
            lst = out.setdefault(s, [])
            if lst and lst[-1][0] + lst[-1][1] == g and lst[-1][2] + lst[-1][1] == r:
                lst[-1] = (lst[-1][0], lst[-1][1] + ln, lst[-1][2])
            else:
                lst.append((g, ln, r))
            g, n, r = g + ln, n - ln, r + ln
    return out


def step_items(q_runs: Sequence[Run], kv_runs: Sequence[Run], causal: bool, device,
               cu: Optional[Sequence[int]] = None) -> list[Item]:
    """Kernel calls for queries ``q_runs`` against keys ``kv_runs`` (see module docstring); with packed samples
    (``cu``) only within each sample."""
    if cu is None:
        return _kv_block_items(q_runs, kv_runs, causal, device)
    qs, ks = sample_runs(q_runs, cu), sample_runs(kv_runs, cu)
    return [it for s in sorted(qs) if s in ks for it in _kv_block_items(qs[s], ks[s], causal, device)]


def _kv_block_items(q_runs: Sequence[Run], kv_runs: Sequence[Run], causal: bool, device) -> list[Item]:
    """Kernel calls for queries ``q_runs`` against keys ``kv_runs``, every pair allowed by the causal rule."""
    rel = {(qi, ki): _rel(q, k, causal) for qi, q in enumerate(q_runs) for ki, k in enumerate(kv_runs)}
    used_q = [q for qi, q in enumerate(q_runs) if any(rel[qi, ki] != "none" for ki in range(len(kv_runs)))]
    used_k = [k for ki, k in enumerate(kv_runs) if any(rel[qi, ki] != "none" for qi in range(len(q_runs)))]
    if not used_q:
        return []
    q_co = _coalesce([(r, n) for _, n, r in used_q])
    k_co = _coalesce([(r, n) for _, n, r in used_k])
    if len(q_co) == 1 and len(k_co) == 1:
        qs = slice(q_co[0][0], q_co[0][0] + q_co[0][1])
        ks = slice(k_co[0][0], k_co[0][0] + k_co[0][1])
        used = [(qi, ki) for qi, q in enumerate(q_runs) if q in used_q for ki, k in enumerate(kv_runs) if k in used_k]
        if all(rel[p] == "full" for p in used):
            return [Item(qs, ks)]
        gq, gk = _global_seq(used_q), _global_seq(used_k)
        if gq == gk and all(a + n <= b for (a, n), (b, _) in zip(gq, gq[1:])):
            return [Item(qs, ks, causal=True)]   # identical increasing positions: the mask is exactly tril
    items: list[Item] = []
    groups: dict = {}
    for ki, k in enumerate(kv_runs):
        full = []
        for qi, q in enumerate(q_runs):
            r = rel[qi, ki]
            if r == "full":
                full.append((q[2], q[1]))
            elif r == "diag":
                items.append(Item(slice(q[2], q[2] + q[1]), slice(k[2], k[2] + k[1]), causal=True))
            elif r == "partial":
                qpos = torch.arange(q[0], q[0] + q[1], device=device)
                kpos = torch.arange(k[0], k[0] + k[1], device=device)
                items.append(Item(slice(q[2], q[2] + q[1]), slice(k[2], k[2] + k[1]),
                                  mask=qpos[:, None] >= kpos[None, :]))
        if full:
            groups.setdefault(tuple(sorted(full)), []).append((k[2], k[1]))
    for qset, ks in groups.items():
        q_rows = _rows(qset, device)
        for r, n in _coalesce(ks):
            items.append(Item(q_rows, slice(r, r + n)))
    return items


def sorted_order(runs: Sequence[tuple[int, int]]) -> tuple[tuple[tuple[int, int, int], ...], tuple]:
    """Compute order = runs sorted by global start. Returns (moves, runs_c): ``moves`` are
    (local_row, compute_row, len) copies; ``runs_c`` are the global runs in compute order, touching ones merged."""
    local, row = [], 0
    for a, n in runs:
        local.append((a, n, row))
        row += n
    moves, crow = [], 0
    for a, n, lrow in sorted(local):
        moves.append((lrow, crow, n))
        crow += n
    merged: list[tuple[int, int]] = []
    for a, n, _ in sorted(local):
        if merged and merged[-1][0] + merged[-1][1] == a:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((a, n))
    return tuple(moves), tuple(merged)


def is_identity(moves) -> bool:
    return all(lr == cr for lr, cr, _ in moves)


def permute_rows(x: torch.Tensor, moves, dim: int, inverse: bool = False) -> torch.Tensor:
    """Rows of ``x`` along ``dim`` from local to compute order (or back with ``inverse``): one copy."""
    if is_identity(moves):
        return x
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    for lr, cr, n in moves:
        src, dst = (cr, lr) if inverse else (lr, cr)
        out.narrow(dim, dst, n).copy_(x.narrow(dim, src, n))
    return out


def ab_layout(origins: Sequence[int], rank: int, u: int) -> tuple[tuple[int, int], ...]:
    """Buffer rows (piece_row, mirror_row) of each slot for the two-segment layout: slots whose origin
    is below ``rank`` first (A), then the others (B); piece k at k*u, mirror k at (2m-1-k)*u."""
    m = len(origins)
    order = [i for i in range(m) if origins[i] < rank] + [i for i in range(m) if origins[i] >= rank]
    rows = [(0, 0)] * m
    for k, i in enumerate(order):
        rows[i] = (k * u, (2 * m - 1 - k) * u)
    return tuple(rows)
