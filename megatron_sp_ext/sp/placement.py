"""Sequence placements: which global tokens each rank holds, in which local order.

* "contiguous": rank r holds [r*S/P, (r+1)*S/P).
* "zigzag": 2P equal chunks; rank r holds chunks r and 2P-1-r, in that order (identical to
  Megatron's ``get_batch_on_this_cp_rank``). Balances causal ring attention.
* "tasp_zigzag": TASP's eqs. 5-6 with m rings: 2*P*m equal pieces of u = S/(2Pm) tokens; ring i
  of rank r carries piece r*m+i and its mirror 2Pm-1-(r*m+i). The local order is ring-major
  ([piece, mirror] of ring 0, then ring 1, ...) so each ring's block is one contiguous slice.
  It holds the same tokens as "zigzag", in another order.
A placement is a list of pieces (global_start, length) in local order.

Packed variable-length samples (``cu_seqlens``: cumulative sample lengths over the full sequence): each sample
is placed on its own ("contiguous": piece r of P of every sample; "zigzag": pieces r and 2P-1-r of 2P of every
sample, Megatron/TE's THD convention), the rank's pieces concatenated in sample order (``varlen_pieces``).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from ..config import SEQ_PLACEMENTS
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


def cu_tuple(cu_seqlens, seqlen: int) -> tuple[int, ...]:
    """``cu_seqlens`` (1-D int tensor or sequence [n_samples + 1]: 0, cumulative lengths, ``seqlen``) as a tuple
    of ints; raises SPConfigError when it is not one."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise SPConfigError(f"cu_seqlens must be a 1-D integer tensor [n_samples + 1]; got dtype "
                                f"{cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}")
        cu = tuple(int(x) for x in cu_seqlens.tolist())
    else:
        cu = tuple(int(x) for x in cu_seqlens)
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != seqlen:
        raise SPConfigError(f"cu_seqlens={list(cu)} is invalid: it must start at 0, never decrease and end at the "
                            f"full packed sequence length {seqlen}")
    return cu


@lru_cache(maxsize=1024)
def varlen_pieces(placement: str, rank: int, world: int, cu: tuple[int, ...]) -> Pieces:
    """Global (start, length) runs of ``rank``'s shard of the packed sequence ``cu`` (cumulative lengths), in
    local order: each sample placed on its own, samples in order; empty samples hold nothing."""
    if placement not in ("contiguous", "zigzag"):
        raise SPConfigError(f"placement={placement!r} does not support cu_seqlens (packed samples): use "
                            f"'contiguous' or 'zigzag'")
    div = divisor(placement, world)
    out = []
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        n = b - a
        if n % div != 0:
            raise SPConfigError(
                f"cu_seqlens: sample {i} has length {n}, not divisible by {div}, which placement={placement!r} "
                f"needs for {world} ranks: pad each sample to a multiple of {div} (Megatron's convention for "
                f"THD context parallelism)")
        if n == 0:
            continue
        out += [(a + st, ln) for st, ln in pieces(placement, rank, world, n)]
    return tuple(out)


def _runs(placement: str, rank: int, world: int, seqlen: int, cu_seqlens) -> Pieces:
    if cu_seqlens is None:
        return pieces(placement, rank, world, seqlen)
    return varlen_pieces(placement, rank, world, cu_tuple(cu_seqlens, seqlen))


def positions(placement: str, rank: int, world: int, seqlen: int) -> torch.Tensor:
    """Global position of each local token (int64 [S_local])."""
    return torch.cat([torch.arange(a, a + n) for a, n in pieces(placement, rank, world, seqlen)])


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup, *, placement: str = "contiguous",
                   seq_dim: int = 1, cu_seqlens: "torch.Tensor | None" = None) -> torch.Tensor:
    """The full sequence ``x`` (identical on every rank) -> this rank's shard (a new tensor).

    cu_seqlens: 1-D int [n_samples + 1], cumulative sample lengths over the full packed sequence (B=1, same
    on every rank): each sample is placed on its own (see ``varlen_pieces``)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    runs = _runs(placement, rank, world, x.shape[seq_dim], cu_seqlens)
    return torch.cat([x.narrow(seq_dim, a, n) for a, n in runs], dim=seq_dim).contiguous()


def unshard_sequence(x: torch.Tensor, group: dist.ProcessGroup, *, placement: str = "contiguous",
                     seq_dim: int = 1, cu_seqlens: "torch.Tensor | None" = None) -> torch.Tensor:
    """Inverse of ``shard_sequence`` (same ``placement`` and ``cu_seqlens``): all-gather the shards and restore
    global order (not autograd)."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    seqlen = x.shape[seq_dim] * world
    runs_of = [_runs(placement, r, world, seqlen, cu_seqlens) for r in range(world)]  # checked before the gather
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
    return out
