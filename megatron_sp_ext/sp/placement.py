"""Sequence placements: which global tokens each rank holds, in which local order.

* "contiguous": rank r holds [r*S/P, (r+1)*S/P).
* "zigzag": 2P equal chunks; rank r holds chunks r and 2P-1-r, in that order (identical to
  Megatron's ``get_batch_on_this_cp_rank``). Balances causal ring attention.
* "tasp_zigzag": TASP's eqs. 5-6 with m rings: 2*P*m equal pieces of u = S/(2Pm) tokens; ring i
  of rank r carries piece r*m+i and its mirror 2Pm-1-(r*m+i). The local order is ring-major
  ([piece, mirror] of ring 0, then ring 1, ...) so each ring's K|V block is one contiguous slice.
  It holds the same tokens as "zigzag", in another order.
A placement is a list of pieces (global_start, length) in local order.

Packed variable-length samples (``cu_seqlens``: cumulative sample lengths over the full sequence): each sample
is placed on its own ("contiguous": piece r of P of every sample; "zigzag": pieces r and 2P-1-r of 2P of every
sample, Megatron/TE's THD convention), the rank's pieces concatenated in sample order (``varlen_pieces``).
A sample whose length does not divide by the placement's divisor (P, or 2P for "zigzag") is padded at its tail to
the next multiple (``PackedSamples``): ``shard_sequence`` inserts the zero rows, the attention treats them as a
segment of their own (no real token attends a padding token, nor the other way round), ``unshard_sequence``
drops them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import torch
import torch.distributed as dist

from .. import modes
from ..config import DEFAULT_PLACEMENT, SEQ_PLACEMENTS
from ..errors import SPConfigError
from ..topology.hamiltonian import hamiltonian_cycles

Pieces = tuple[tuple[int, int], ...]


def num_rings(world: int) -> int:
    """Rings TASP runs for this world size (n-1, or n-2 where no full decomposition exists)."""
    return max(1, len(hamiltonian_cycles(world)))


def divisor(placement: str, world: int) -> int:
    """The global sequence length must be a multiple of this."""
    if placement == "contiguous":
        return world
    if placement == "zigzag":
        return 2 * world
    if placement == "tasp_zigzag":
        return 2 * world * num_rings(world)
    raise SPConfigError(f"placement={placement!r} is invalid: choose one of {', '.join(SEQ_PLACEMENTS)}")


@lru_cache(maxsize=1024)
def pieces(placement: str, rank: int, world: int, seqlen: int) -> Pieces:
    """Global (start, length) runs of ``rank``'s shard in local order."""
    div = divisor(placement, world)
    if seqlen % div != 0:
        raise SPConfigError(
            f"sequence length {seqlen} is not divisible by {div}, which placement={placement!r} needs for "
            f"{world} ranks: pad the sequence to a multiple of {div}")
    if placement == "contiguous":
        s = seqlen // world
        return ((rank * s, s),)
    if placement == "zigzag":
        c = seqlen // (2 * world)
        return ((rank * c, c), ((2 * world - 1 - rank) * c, c))
    m = num_rings(world)
    u = seqlen // (2 * world * m)
    out = []
    for i in range(m):
        idx = rank * m + i
        out += [(idx * u, u), ((2 * world * m - 1 - idx) * u, u)]
    return tuple(out)


@dataclass(frozen=True)
class PackedSamples:
    """Packed samples as the ranks hold them (cumulative lengths, ``n_samples + 1`` entries each).

    real:   the samples' real cumulative lengths (the user's ``cu_seqlens``);
    layout: the cumulative lengths as placed: sample i occupies rows [layout[i], layout[i+1]) of the padded
            sequence, its real tokens first, then ``(layout[i+1] - layout[i]) - (real[i+1] - real[i])`` padding rows.
    Megatron's ``cu_seqlens_q`` / ``cu_seqlens_q_padded`` pair maps to (real, layout)."""

    real: tuple[int, ...]
    layout: tuple[int, ...]

    @property
    def padded(self) -> bool:
        return self.real != self.layout

    @property
    def segments(self) -> tuple[int, ...]:
        """Attention boundaries in layout coordinates: each sample's real rows, then its padding rows as a segment
        of their own (tokens attend only within their segment)."""
        out = [0]
        for i in range(len(self.real) - 1):
            for edge in (self.layout[i] + self.real[i + 1] - self.real[i], self.layout[i + 1]):
                if edge != out[-1]:
                    out.append(edge)
        return tuple(out)


def _cu_ints(cu_seqlens, what: str) -> tuple[int, ...]:
    """A 1-D integer tensor or sequence as a tuple of ints that starts at 0 and never decreases."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise SPConfigError(f"{what} must be a 1-D integer tensor [n_samples + 1]; got dtype "
                                f"{cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}")
        cu = tuple(int(x) for x in cu_seqlens.tolist())
    else:
        cu = tuple(int(x) for x in cu_seqlens)
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise SPConfigError(f"{what}={list(cu)} is invalid: it must start at 0 and never decrease")
    return cu


def _pad_each(real: tuple[int, ...], div: int) -> PackedSamples:
    """The samples ``real`` (cumulative lengths) each padded at its tail to a multiple of ``div``."""
    return PackedSamples(real, tuple(accumulate((-(-(b - a) // div) * div for a, b in zip(real, real[1:])),
                                                initial=0)))


def packed_samples(cu_seqlens, seqlen: int, placement: str, world: int) -> PackedSamples:
    """``cu_seqlens`` (1-D int tensor or sequence, the samples' real cumulative lengths; or a ``PackedSamples``) for
    a padded sequence of ``seqlen`` rows (shard rows x world) split by ``placement``: samples are padded to a
    multiple of the placement's divisor. Raises SPConfigError when ``seqlen`` fits neither."""
    div = divisor(placement, world)
    if isinstance(cu_seqlens, PackedSamples):
        pk = cu_seqlens
        real, lay = pk.real, pk.layout
        if (len(real) != len(lay) or len(real) < 2 or real[0] != 0 or lay[0] != 0
                or any(lb - la < rb - ra or rb < ra for ra, rb, la, lb in zip(real, real[1:], lay, lay[1:]))):
            raise SPConfigError(f"packed samples: the padded cumulative lengths {list(lay)} must start at 0 and give "
                                f"every sample at least its real length (cumulative {list(real)})")
    else:
        pk = _pad_each(_cu_ints(cu_seqlens, "cu_seqlens"), div)
    if pk.layout[-1] != seqlen:
        if pk.padded and pk.real[-1] == seqlen:
            raise SPConfigError(
                f"cu_seqlens={list(pk.real)}: some samples' lengths do not divide by {div} (placement={placement!r}, "
                f"{world} ranks), so each is padded to a multiple of {div}: the shards must hold {pk.layout[-1]} "
                f"rows in all ({pk.layout[-1] // world} per rank), as shard_sequence(x, group, placement="
                f"{placement!r}, cu_seqlens=...) makes them; these hold {seqlen}")
        raise SPConfigError(f"cu_seqlens={list(pk.real)} is invalid: it must end at the full packed sequence length "
                            f"{seqlen} ({seqlen // world} rows x {world} ranks)")
    return pk


@lru_cache(maxsize=1024)
def varlen_pieces(placement: str, rank: int, world: int, cu: tuple[int, ...]) -> Pieces:
    """Global (start, length) runs of ``rank``'s shard of the packed sequence ``cu`` (cumulative lengths as placed:
    ``PackedSamples.layout``), in local order: each sample placed on its own, samples in order; empty samples hold
    nothing."""
    if placement not in ("contiguous", "zigzag"):
        raise SPConfigError(f"placement={placement!r} does not support cu_seqlens (packed samples): use "
                            f"'contiguous' or 'zigzag'")
    div = divisor(placement, world)
    out = []
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        n = b - a
        if n % div != 0:
            raise SPConfigError(
                f"packed samples: sample {i} is placed on {n} rows, not a multiple of {div}, which placement="
                f"{placement!r} needs for {world} ranks: the padded lengths (Megatron's cu_seqlens_q_padded) must "
                f"be multiples of {div}")
        if n == 0:
            continue
        out += [(a + st, ln) for st, ln in pieces(placement, rank, world, n)]
    return tuple(out)


def _runs(placement: str, rank: int, world: int, seqlen: int, cu_seqlens) -> Pieces:
    if cu_seqlens is None:
        return pieces(placement, rank, world, seqlen)
    return varlen_pieces(placement, rank, world, packed_samples(cu_seqlens, seqlen, placement, world).layout)


def positions(placement: str, rank: int, world: int, seqlen: int) -> torch.Tensor:
    """Global position of each local token (int64 [S_local])."""
    return torch.cat([torch.arange(a, a + n) for a, n in pieces(placement, rank, world, seqlen)])


def pad_samples(x: torch.Tensor, pk: PackedSamples, seq_dim: int) -> torch.Tensor:
    """x with its samples at their real lengths (``pk.real[-1]`` rows along ``seq_dim``) -> the padded layout
    (``pk.layout[-1]`` rows, zero rows at each sample's tail); autograd flows to x's rows."""
    parts = []
    for i in range(len(pk.real) - 1):
        n, pad = pk.real[i + 1] - pk.real[i], (pk.layout[i + 1] - pk.layout[i]) - (pk.real[i + 1] - pk.real[i])
        parts.append(x.narrow(seq_dim, pk.real[i], n))
        if pad:
            shape = list(x.shape)
            shape[seq_dim] = pad
            parts.append(x.new_zeros(shape))
    return torch.cat(parts, dim=seq_dim)


def unpad_samples(x: torch.Tensor, pk: PackedSamples, seq_dim: int) -> torch.Tensor:
    """Inverse of ``pad_samples``: the real rows of each sample of the padded layout ``x``."""
    return torch.cat([x.narrow(seq_dim, pk.layout[i], pk.real[i + 1] - pk.real[i]) for i in range(len(pk.real) - 1)],
                     dim=seq_dim)


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup, *, placement: str = DEFAULT_PLACEMENT,
                   seq_dim: int = 1, cu_seqlens: "torch.Tensor | PackedSamples | None" = None) -> torch.Tensor:
    """The full sequence ``x`` (identical on every rank) -> this rank's shard (a new tensor).

    cu_seqlens: 1-D int [n_samples + 1], cumulative sample lengths over the full packed sequence ``x`` (B=1, same
    on every rank): each sample is placed on its own (see ``varlen_pieces``). A sample whose length does not
    divide by the placement's divisor (P, or 2P for "zigzag") gets zero rows at its tail up to the next multiple,
    so the shard holds sum(padded lengths) / P rows; the attention functions given the same cu_seqlens keep
    those rows apart. ``x`` may also be given already padded (sum(padded lengths) rows)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if cu_seqlens is None:
        runs = pieces(placement, rank, world, x.shape[seq_dim])
    else:
        pk = padded_samples(cu_seqlens, placement, world)
        if pk.padded and x.shape[seq_dim] == pk.real[-1]:
            x = pad_samples(x, pk, seq_dim)
        elif x.shape[seq_dim] != pk.layout[-1]:
            raise SPConfigError(f"shard_sequence: x has {x.shape[seq_dim]} rows along dim {seq_dim}; cu_seqlens="
                                f"{list(pk.real)} needs {pk.real[-1]} (or {pk.layout[-1]} already padded)")
        runs = varlen_pieces(placement, rank, world, pk.layout)
    return torch.cat([x.narrow(seq_dim, a, n) for a, n in runs], dim=seq_dim).contiguous()


def padded_samples(cu_seqlens, placement: str, world: int) -> PackedSamples:
    """``cu_seqlens`` (the samples' real cumulative lengths, or a ``PackedSamples``) with each sample padded to a
    multiple of ``placement``'s divisor over ``world`` ranks: the layout ``shard_sequence`` gives the shards."""
    if not isinstance(cu_seqlens, PackedSamples):
        cu_seqlens = _pad_each(_cu_ints(cu_seqlens, "cu_seqlens"), divisor(placement, world))
    return packed_samples(cu_seqlens, cu_seqlens.layout[-1], placement, world)


def unshard_sequence(x: torch.Tensor, group: dist.ProcessGroup, *, placement: str = DEFAULT_PLACEMENT,
                     seq_dim: int = 1, cu_seqlens: "torch.Tensor | PackedSamples | None" = None) -> torch.Tensor:
    """Inverse of ``shard_sequence`` (same ``placement`` and ``cu_seqlens``): all-gather the shards and restore
    global order (not autograd). With cu_seqlens the padding rows are dropped: ``cu_seqlens[-1]`` rows."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    seqlen = x.shape[seq_dim] * world
    pk = None if cu_seqlens is None else packed_samples(cu_seqlens, seqlen, placement, world)  # checked first
    runs_of = [_runs(placement, r, world, seqlen, pk) for r in range(world)]
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    shape = list(x.shape)
    shape[seq_dim] = seqlen
    out = x.new_empty(shape)
    for r, part in enumerate(parts):
        off = 0
        for a, n in runs_of[r]:
            out.narrow(seq_dim, a, n).copy_(part.narrow(seq_dim, off, n))
            off += n
    return unpad_samples(out, pk, seq_dim) if pk is not None and pk.padded else out


def balanced_placement(variant: str, causal: bool, *, packed: bool = False) -> str:
    """The load-balanced placement for causal ``variant`` ("ring" or "tasp"; hybrid and torus rings take
    "ring"): "zigzag", "tasp_zigzag" ("zigzag" for packed samples), and "contiguous" when not causal. Pass it
    explicitly, the same to ``shard_sequence`` and the attention; the default is ``DEFAULT_PLACEMENT``."""
    if not causal:
        return "contiguous"
    return "tasp_zigzag" if modes.get(variant).multi_ring and not packed else "zigzag"
