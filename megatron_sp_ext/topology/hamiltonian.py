"""Directed Hamiltonian decompositions of the complete digraph K_n* and TASP routing tables.

K_n* (every ordered pair an arc) splits into n-1 arc-disjoint directed Hamiltonian cycles for
every n except 4 and 6 (Tillson, 1980). Construction used here:
  * n odd: Walecki's decomposition of the undirected K_n into (n-1)/2 Hamiltonian cycles, each
    taken in both directions -> n-1 directed cycles.
  * n even: the n-2 directed cycles of K_{n-1}* (n-1 is odd) plus a new vertex v = n-1 inserted
    into each: cycle i gives up one arc a_i -> b_i and becomes ... a_i -> v -> b_i ... . If the
    given-up arcs (one per cycle) form a Hamiltonian path b* -> ... -> a* of K_{n-1}, then
    v -> b* -> ... -> a* -> v is the (n-1)-th cycle and all n(n-1) arcs are covered. The path is
    found by a depth-first search for a "rainbow" Hamiltonian path (one arc from each cycle).
  * n = 4, 6 (no decomposition exists): the n-2 cycles with v inserted are returned (the largest
    possible set: n-1 is impossible); the arcs of one directed Hamiltonian path stay unused.
  * The path search (randomised restarts with a small budget, seeded so the result is
    deterministic) finds the path for every even n from 8 to 64; a restart hint per n keeps every
    n under about a second. Should it ever fail (n > 64), the n-2 cycles with v inserted are
    returned, which keeps multi-ring exchanges exact and leaves 1/(n-1) of the links idle.
Cycles are lists of ranks in visiting order: ring i sends r -> cycles[i][(pos(r)+1) % n].
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from functools import lru_cache


def _walecki_odd(m: int) -> list[list[int]]:
    """n-1 directed Hamiltonian cycles of K_m*, m odd (vertex m-1 plays Walecki's infinity)."""
    if m == 1:
        return []
    k = (m - 1) // 2
    inf = m - 1
    ring = 2 * k  # vertices 0..2k-1 on a circle
    cycles = []
    for j in range(k):
        path = [j % ring]
        for t in range(1, k + 1):
            path.append((j + t) % ring)
            if len(path) < ring:
                path.append((j - t) % ring)
        path = path[:ring]
        cyc = [inf] + path
        cycles.append(cyc)
        cycles.append([cyc[0]] + cyc[1:][::-1])
    return cycles


# first restart known to succeed for some n (a speed hint only: the search still runs and is verified)
_RESTART_HINT = {50: 16, 52: 62, 56: 12, 58: 121, 60: 21, 62: 109, 64: 6}


def _rainbow_path(cycles: list[list[int]], m: int, max_restarts: int = 400, budget: int = 3000):
    """A Hamiltonian path of K_m using exactly one arc of each cycle, or None.

    Depth-first search that extends the path by an arc of an unused cycle, trying first the next
    vertices with the fewest onward options (Warnsdorff), ties broken by a seeded RNG; each restart
    has a small node budget. Deterministic for a given m.
    """
    color = [[-1] * m for _ in range(m)]
    for i, cyc in enumerate(cycles):
        for a, b in zip(cyc, cyc[1:] + cyc[:1]):
            color[a][b] = i
    if len(cycles) != m - 1:
        return None
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * m + 100))
    try:
        first = _RESTART_HINT.get(m + 1, 0)
        for seed in list(range(first, max_restarts)) + list(range(0, first)):
            rng = random.Random(seed)
            visited, used = [False] * m, [False] * (m - 1)
            start = rng.randrange(m)
            path, left = [start], [budget]
            visited[start] = True

            def onward(v: int) -> int:
                return sum(1 for w in range(m) if not visited[w] and not used[color[v][w]])

            def dfs(u: int) -> bool:
                if len(path) == m:
                    return True
                left[0] -= 1
                if left[0] < 0:
                    return False
                ranked = []
                for v in range(m):
                    c = color[u][v]
                    if visited[v] or used[c]:
                        continue
                    visited[v], used[c] = True, True
                    ranked.append((onward(v), rng.random(), v))
                    visited[v], used[c] = False, False
                ranked.sort()
                for deg, _, v in ranked:
                    if deg == 0 and len(path) < m - 1:
                        continue  # dead end before the path is complete
                    c = color[u][v]
                    visited[v], used[c] = True, True
                    path.append(v)
                    if dfs(v):
                        return True
                    path.pop()
                    visited[v], used[c] = False, False
                    if left[0] < 0:
                        return False
                return False

            if dfs(start):
                return path
        return None
    finally:
        sys.setrecursionlimit(limit)


def _insert(cyc: list[int], a: int, b: int, v: int) -> list[int]:
    """Cycle with vertex v inserted on its arc a -> b."""
    i = cyc.index(a)
    assert cyc[(i + 1) % len(cyc)] == b
    return cyc[:i + 1] + [v] + cyc[i + 1:]


def _distinct_arcs(cycles: list[list[int]]) -> list[tuple[int, int]]:
    """One arc per cycle with pairwise distinct tails and pairwise distinct heads (backtracking)."""
    arcs = [list(zip(c, c[1:] + c[:1])) for c in cycles]
    tails, heads, chosen = set(), set(), []

    def go(i: int) -> bool:
        if i == len(arcs):
            return True
        for a, b in arcs[i]:
            if a not in tails and b not in heads:
                tails.add(a), heads.add(b), chosen.append((a, b))
                if go(i + 1):
                    return True
                tails.discard(a), heads.discard(b), chosen.pop()
        return False

    if not go(0):
        raise RuntimeError("no distinct-arc choice")
    return chosen


@lru_cache(maxsize=None)
def _cycles(n: int) -> tuple[tuple[int, ...], ...]:
    if n < 1:
        raise ValueError(f"n={n} must be positive")
    if n == 1:
        return ()
    if n == 2:
        return ((0, 1),)
    if n % 2 == 1:
        return tuple(tuple(c) for c in _walecki_odd(n))
    m, v = n - 1, n - 1
    base = _walecki_odd(m)
    path = _rainbow_path(base, m) if n not in (4, 6) else None
    if path is not None:
        arcs = {}
        for a, b in zip(path, path[1:]):
            arcs[next(i for i, c in enumerate(base) if _succ(c, a) == b)] = (a, b)
        out = [_insert(c, *arcs[i], v) for i, c in enumerate(base)]
        out.append([v] + path)
    else:
        out = [_insert(c, a, b, v) for c, (a, b) in zip(base, _distinct_arcs(base))]
    return tuple(tuple(c) for c in out)


def _succ(cyc: list[int], a: int) -> int:
    i = cyc.index(a)
    return cyc[(i + 1) % len(cyc)]


def hamiltonian_cycles(n: int) -> list[list[int]]:
    """n-1 arc-disjoint directed Hamiltonian cycles of K_n* (n-2 for n = 4, 6; see module doc)."""
    return [list(c) for c in _cycles(n)]


@dataclass(frozen=True)
class RoutingTables:
    """TASP routing for one rank set: per ring i, ``nxt[i][r]`` and ``prv[i][r]``.

    ``out_ring[r][p]`` = ring whose arc is r -> p (-1 if none); ``in_ring[r][p]`` = ring whose arc is
    p -> r (-1 if none). At every step rank r sends its ring-i K|V block to nxt[i][r] and receives ring
    i's K|V block from prv[i][r], for all rings at once (one all_to_all).
    """

    n: int
    cycles: tuple[tuple[int, ...], ...]
    nxt: tuple[tuple[int, ...], ...]
    prv: tuple[tuple[int, ...], ...]
    out_ring: tuple[tuple[int, ...], ...]
    in_ring: tuple[tuple[int, ...], ...]

    def origin(self, ring: int, rank: int, step: int) -> int:
        """Rank whose ring-``ring`` K|V block sits on ``rank`` after ``step`` steps (a negative ``step``: the rank
        that holds ``rank``'s block after -``step`` steps). Every ring visits every rank: a position lookup."""
        cyc = self.cycles[ring]
        return cyc[(_positions(self.cycles)[ring][rank] - step) % len(cyc)]


@lru_cache(maxsize=None)
def _positions(cycles: tuple) -> tuple:
    """Per ring: rank -> its position in that ring's cycle."""
    out = []
    for cyc in cycles:
        pos = [0] * len(cyc)
        for i, r in enumerate(cyc):
            pos[r] = i
        out.append(tuple(pos))
    return tuple(out)


@lru_cache(maxsize=None)
def routing_tables(n: int) -> RoutingTables:
    cycles = _cycles(n)
    nxt, prv = [], []
    out_ring = [[-1] * n for _ in range(n)]
    in_ring = [[-1] * n for _ in range(n)]
    for i, cyc in enumerate(cycles):
        nx, pv = [0] * n, [0] * n
        for a, b in zip(cyc, cyc[1:] + cyc[:1]):
            nx[a], pv[b] = b, a
            out_ring[a][b] = i
            in_ring[b][a] = i
        nxt.append(tuple(nx))
        prv.append(tuple(pv))
    return RoutingTables(n, cycles, tuple(nxt), tuple(prv), tuple(map(tuple, out_ring)), tuple(map(tuple, in_ring)))
