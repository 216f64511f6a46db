"""Hybrid (Ulysses x Ring) attention over an SPMesh.

Inputs are this rank's shard in the rank order of the whole SP group (``shard_sequence(x, group,
placement=...)``: "contiguous", or "zigzag" for balanced causal), whatever the mesh placement:
the mesh's internal order is hidden. Ulysses (HCMS-chunked if asked) exchanges heads inside the
Ulysses group; each chunk's local attention is ring/TASP attention over the Ring group, whose
causal masks come from the global positions of every rank's tokens.

Packed samples (``cu_seqlens``): the shards are in the per-sample placement (``shard_sequence(...,
cu_seqlens=)``); the Ulysses stage only moves heads (it runs no attention itself), the gathered pieces are
sorted by position and the ring backend attends within each sample.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch

from ...attention.backends import get_backend
from ...comm.capability import check_p2p, needs_p2p
from ...config import DEFAULT_PLACEMENT
from ...errors import SPConfigError
from ...topology.mesh import SPMesh
from ..checks import MaskChecks, check_ring_inputs, packed_cu
from ..placement import pieces, varlen_pieces
from ..ulysses import ulysses_attention
from ..ulysses.layout import sorted_order
from .ring import VARIANTS, RingBackend, checked_mask


def rank_runs(placement: str, rank: int, world: int, seqlen: int, cu: Optional[tuple] = None):
    """Global (start, len) runs SP rank ``rank`` holds: ``pieces``, or per sample (``varlen_pieces``) with ``cu``
    (the packed samples' layout, ``PackedSamples.layout``)."""
    return pieces(placement, rank, world, seqlen) if cu is None else varlen_pieces(placement, rank, world, cu)


def mesh_runs(mesh: SPMesh, placement: str, seqlen: int, cu: Optional[tuple] = None) -> tuple:
    """kv_runs[j]: global runs covered by ring index j after the Ulysses gather (Ulysses order)."""
    out = []
    for row in mesh.grid:
        runs = []
        for g in row:
            runs.extend(rank_runs(placement, g, mesh.world, seqlen, cu))
        out.append(tuple(runs))
    return tuple(out)


def unit_pieces(runs_by_rank) -> list:
    """Every rank's runs cut into pieces of one length (the gcd of all run lengths; packed samples give runs of
    different lengths), so a piece permutation can sort them."""
    unit = 0
    for runs in runs_by_rank:
        for _, n in runs:
            unit = math.gcd(unit, n)
    return [[(a + j * unit, unit) for a, n in runs for j in range(n // unit)] for runs in runs_by_rank]


@lru_cache(maxsize=64)
def sorted_rows(grid: tuple, world: int, placement: str, seqlen: int, cu: Optional[tuple] = None) -> tuple:
    """Per Ulysses group (grid row): (permutation of its gathered pieces into ascending position, merged runs)."""
    return tuple(sorted_order(unit_pieces([rank_runs(placement, g, world, seqlen, cu) for g in row])) for row in grid)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh, *,
                     head_chunks: "int | str" = 1, ring_variant: str = "ring", causal: bool = False,
                     softmax_scale: Optional[float] = None, layout: str = "bshd",
                     placement: str = DEFAULT_PLACEMENT, backend: str = "auto",
                     kv_valid_len: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None,
                     block_mask: Optional[torch.Tensor] = None, block_size: int = 64,
                     mask_checks: Optional[MaskChecks] = None) -> torch.Tensor:
    """Ulysses over ``mesh.ulysses_group`` then ring/TASP over ``mesh.ring_group``. Shapes as ulysses_attention.
    ``kv_valid_len``: keys at global positions >= kv_valid_len are padding and get no attention.
    cu_seqlens: packed samples (B=1; cumulative lengths over the full sequence, the same on every rank; shards in
    the per-sample "contiguous" or "zigzag" placement of ``shard_sequence``): each sample attends within itself.
    block_mask / block_size: block-sparse attention as ``ulysses_attention``'s (global tiles, the same on every
    rank): the Ulysses exchange puts each group's sequence in ascending order and the ring ("ring" or "tasp") runs
    under the mask with its step and hop skips over the mesh's runs (``RingBackend``); not with cu_seqlens.
    mask_checks: a ``MaskChecks`` (sp/checks.py) that compares each distinct block mask across ranks once (None: this
    call compares it: one all_gather and a host sync). A mask checked over the mesh's group is agreed on its Ulysses group too: the
    inner exchange does not compare it again."""
    if ring_variant not in VARIANTS:
        raise SPConfigError(f"ring_variant={ring_variant!r} is invalid: choose one of {', '.join(VARIANTS)}")
    check_ring_inputs(q, k, v, layout, mesh.group)
    s_loc = q.shape[1] if layout == "bshd" else q.shape[0]
    seqlen = s_loc * mesh.world
    block_mask, kv_valid_len = checked_mask("hybrid_attention", block_mask, block_size, seqlen, q.shape[2],
                                            cu_seqlens, kv_valid_len, mesh.group, mask_checks)
    if mesh.ring_group is not None and needs_p2p(ring_variant, mesh.ring_size):
        check_p2p(f"hybrid_attention(ring_variant={ring_variant!r})", mesh.ring_group, q.device,
                  "ulysses_attention")
    pk = packed_cu(cu_seqlens, q, layout, seqlen, kv_valid_len, placement, mesh.world)
    cu = None if pk is None else pk.layout
    runs = mesh_runs(mesh, placement, seqlen, cu)
    order = None
    if mesh.ulysses_group is not None and (causal or kv_valid_len is not None or cu is not None
                                           or block_mask is not None):
        rows = sorted_rows(mesh.grid, mesh.world, placement, seqlen, cu)
        order = rows[mesh.ring_index][0]
        runs = tuple(merged for _, merged in rows)
    ring = RingBackend(mesh.ring_group, ring_variant, runs[mesh.ring_index], runs, get_backend(backend), kv_valid_len,
                       None if pk is None else pk.segments, block_mask=block_mask, block_size=block_size,
                       seq_len=seqlen)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if mesh.ulysses_group is None:  # P_u == 1: pure ring over the mesh order, every head
        to = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t.permute(1, 2, 0, 3))
        out = ring(to(q), to(k), to(v), causal=causal, softmax_scale=scale)
        return out.transpose(1, 2) if layout == "bshd" else out.permute(2, 0, 1, 3)
    inner = mask_checks if mask_checks is not None else MaskChecks()
    if block_mask is not None:   # equal over the whole mesh group (just checked): equal over its Ulysses group
        inner.agree(block_mask, mesh.ulysses_group)
    return ulysses_attention(q, k, v, mesh.ulysses_group, head_chunks=head_chunks, causal=causal,
                             softmax_scale=scale, layout=layout, backend=ring, seq_order=order,
                             block_mask=block_mask, block_size=block_size, mask_checks=inner)
