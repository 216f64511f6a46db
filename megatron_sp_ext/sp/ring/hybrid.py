"""Hybrid (Ulysses x Ring) attention over an SPMesh.

Inputs are this rank's shard in the rank order of the whole SP group (``shard_sequence(x, group,
placement=...)``: "contiguous", or "zigzag" for balanced causal), whatever the mesh arrangement:
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

from ...config import DEFAULT_PLACEMENT
from ...topology.mesh import SPMesh
from ..placement import pieces, varlen_pieces
from ..problem import AttentionProblem, problem_from_keywords
from ..ulysses import ulysses_attention
from ..ulysses.layout import sorted_order
from .ring import RingBackend


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


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh,
                     problem: Optional[AttentionProblem] = None, *, head_chunks: "int | str" = 1,
                     ring_variant: str = "ring", backend: str = "auto", **keywords) -> torch.Tensor:
    """Ulysses over ``mesh.ulysses_group`` then ring/TASP over ``mesh.ring_group``. Shapes as ulysses_attention.
    problem: the ``AttentionProblem`` built once by the caller, or its settings as keywords (causal, placement,
    kv_valid_len, cu_seqlens, block_mask, tile / block_size, softmax_scale, layout): one problem per call.
    kv_valid_len: keys at global positions >= kv_valid_len are padding and get no attention.
    cu_seqlens: packed samples (B=1; cumulative lengths over the full sequence, the same on every rank; shards in
    the per-sample "contiguous" or "zigzag" placement of ``shard_sequence``): each sample attends within itself.
    block_mask / tile: block-sparse attention as ``ulysses_attention``'s (global tiles, the same on every rank): the
    Ulysses exchange puts each group's sequence in ascending order and the ring ("ring" or "tasp") runs under the
    mask with its step and hop skips over the mesh's runs (``RingBackend``); not with cu_seqlens. The problem is
    agreed over the mesh's whole group: its inner Ulysses call runs no second check."""
    problem, _ = problem_from_keywords("hybrid_attention", problem, keywords)
    pr = problem.bind(q, k, v, mesh.group, what="hybrid_attention", mode=mesh.arrangement, backend=backend,
                      variant=("ring_variant", ring_variant), p2p=(mesh.ring_group,))
    causal, placement = pr.causal, pr.placement
    cu = None if pr.packed is None else pr.packed.layout
    runs = mesh_runs(mesh, placement, pr.seqlen, cu)
    order = None
    if mesh.ulysses_group is not None and (causal or pr.kv_valid_len is not None or cu is not None
                                           or pr.block_mask is not None):
        rows = sorted_rows(mesh.grid, mesh.world, placement, pr.seqlen, cu)
        order = rows[mesh.ring_index][0]
        runs = tuple(merged for _, merged in rows)
    ring = RingBackend(mesh.ring_group, ring_variant, runs[mesh.ring_index], runs, pr.backend, pr.kv_valid_len,
                       pr.segments, problem=problem, seq_len=pr.seqlen)   # masked plans: kept on the problem
    if mesh.ulysses_group is None:  # P_u == 1: pure ring over the mesh order, every head
        return pr.from_kernel(ring(*pr.to_kernel(q, k, v), causal=causal, softmax_scale=pr.scale))
    inner = problem.inner(softmax_scale=pr.scale, seq_order=order, kv_valid_len=None, cu_seqlens=None,
                          placement=DEFAULT_PLACEMENT, dropout_p=0.0)
    return ulysses_attention(q, k, v, mesh.ulysses_group, inner, head_chunks=head_chunks, backend=ring)
