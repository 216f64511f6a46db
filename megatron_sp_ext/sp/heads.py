"""Head bookkeeping for Ulysses-style exchanges: which heads each rank owns, GQA, HCMS chunks.

Ulysses rank p owns the contiguous global q-head range ``[q_offsets[p], q_offsets[p] + q_counts[p])``
and the matching kv-head range. When H mod P != 0 the first ``H mod P`` ranks get one more head
(DeepSpeed's uneven-heads rule). GQA: kv heads are replicated by ``kv_repeat`` before the exchange
(the smallest factor that keeps every rank's q heads paired with whole kv heads); their gradients
are summed back by autograd.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..errors import SPConfigError


def split_more_first(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` sizes, larger ones first (HCMS eq. 3)."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def _offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return tuple(out)


@dataclass(frozen=True)
class HeadLayout:
    """Per-rank head ownership for one (H, Hkv, P) and the HCMS chunking of it.

    world: P.  num_heads: H (q).  kv_heads: Hkv as given by the caller.
    kv_repeat: replication factor applied to k/v before the exchange.
    group: q heads per (replicated) kv head.
    q_counts / kv_counts: heads per rank.  chunks: C.
    q_chunks[p][c] / kv_chunks[p][c]: (start, size) of chunk c inside rank p's local head range.
    """

    world: int
    num_heads: int
    kv_heads: int
    kv_repeat: int
    group: int
    q_counts: tuple[int, ...]
    kv_counts: tuple[int, ...]
    chunks: int
    q_chunks: tuple[tuple[tuple[int, int], ...], ...]
    kv_chunks: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def q_offsets(self) -> tuple[int, ...]:
        return _offsets(self.q_counts)

    @property
    def kv_offsets(self) -> tuple[int, ...]:
        return _offsets(self.kv_counts)

    @property
    def even(self) -> bool:
        """True when every rank owns the same number of heads (fast, single-copy pack path)."""
        return len(set(self.q_counts)) == 1

    def q_range(self, rank: int, chunk: int) -> tuple[int, int]:
        """Global q-head range [a, b) of ``rank``'s chunk ``chunk``."""
        start, size = self.q_chunks[rank][chunk]
        a = self.q_offsets[rank] + start
        return a, a + size

    def kv_range(self, rank: int, chunk: int) -> tuple[int, int]:
        start, size = self.kv_chunks[rank][chunk]
        a = self.kv_offsets[rank] + start
        return a, a + size


@lru_cache(maxsize=256)
def head_layout(num_heads: int, kv_heads: int, world: int, chunks: int = 1,
                chunks_name: str = "head_chunks") -> HeadLayout:
    """Build (and cache) the layout; raises SPConfigError naming ``chunks_name`` for bad chunk counts."""
    if num_heads < 1 or kv_heads < 1:
        raise SPConfigError(f"num_heads={num_heads} and kv_heads={kv_heads} must be positive")
    if num_heads % kv_heads != 0:
        raise SPConfigError(
            f"q heads ({num_heads}) must be a multiple of k/v heads ({kv_heads}) for grouped-query attention")
    if num_heads < world:
        raise SPConfigError(
            f"Ulysses needs at least one q head per rank: {num_heads} heads < {world} ranks; "
            f"use a ring mode or a hybrid mesh for this group size")
    if chunks < 1:
        raise SPConfigError(f"{chunks_name}={chunks} is invalid: use a positive integer or 'auto'")
    q_counts = split_more_first(num_heads, world)
    if chunks > min(q_counts):
        raise SPConfigError(
            f"{chunks_name}={chunks} exceeds the heads per rank ({min(q_counts)} on the smallest rank for "
            f"{num_heads} heads over {world} ranks): use 1..{min(q_counts)} or 'auto'")
    group_full = num_heads // kv_heads
    if num_heads % world == 0:
        # smallest replication that gives every rank whole kv heads, at least one per chunk
        repeat = next(r for r in range(1, group_full + 1)
                      if group_full % r == 0 and (kv_heads * r) % world == 0
                      and (kv_heads * r) // world >= chunks)
    else:
        repeat = group_full  # uneven q heads: kv follows q exactly
    group = num_heads // (kv_heads * repeat)
    kv_counts = tuple(c // group for c in q_counts)
    kv_chunks, q_chunks = [], []
    for kc in kv_counts:
        sizes = split_more_first(kc, chunks)
        offs = _offsets(sizes)
        kv_chunks.append(tuple(zip(offs, sizes)))
        q_chunks.append(tuple((o * group, s * group) for o, s in zip(offs, sizes)))
    return HeadLayout(world, num_heads, kv_heads, repeat, group, q_counts, kv_counts, chunks,
                      tuple(q_chunks), tuple(kv_chunks))
