"""Sequence placements: which global tokens each rank holds, in which local order.

* "contiguous": rank r holds [r*S/P, (r+1)*S/P).
* "zigzag": 2P equal chunks; rank r holds chunks r and 2P-1-r, in that order (identical to
  Megatron's ``get_batch_on_this_cp_rank``). Balances causal ring attention.
* "tasp_zigzag": TASP's eqs. 5-6 with m rings: 2*P*m equal pieces of u = S/(2Pm) tokens; ring i
  of rank r carries piece r*m+i and its mirror 2Pm-1-(r*m+i). The local order is ring-major
  ([piece, mirror] of ring 0, then ring 1, ...) so each ring's block is one contiguous slice.
  It holds the same tokens as "zigzag", in another order.
A placement is a list of pieces (global_start, length) in local order.
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


def positions(placement: str, rank: int, world: int, seqlen: int) -> torch.Tensor:
    """Global position of each local token (int64 [S_local])."""
    return torch.cat([torch.arange(a, a + n) for a, n in pieces(placement, rank, world, seqlen)])


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup, *, placement: str = "contiguous",
                   seq_dim: int = 1) -> torch.Tensor:
    """The full sequence ``x`` (identical on every rank) -> this rank's shard (a new tensor)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    runs = pieces(placement, rank, world, x.shape[seq_dim])
    return torch.cat([x.narrow(seq_dim, a, n) for a, n in runs], dim=seq_dim).contiguous()


def unshard_sequence(x: torch.Tensor, group: dist.ProcessGroup, *, placement: str = "contiguous",
                     seq_dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence``: all-gather the shards and restore global order (not autograd)."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    seqlen = x.shape[seq_dim] * world
    shape = list(x.shape)
    shape[seq_dim] = seqlen
    out = x.new_empty(shape)
    for r, part in enumerate(parts):
        off = 0
        for a, n in pieces(placement, r, world, seqlen):
            out.narrow(seq_dim, a, n).copy_(part.narrow(seq_dim, off, n))
            off += n
    return out
