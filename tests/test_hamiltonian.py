"""hamiltonian_cycles(n): Hamiltonian, arc-disjoint, complete where a decomposition exists; routing tables."""
import time

import pytest

from megatron_sp_ext import hamiltonian_cycles
from megatron_sp_ext.topology.hamiltonian import routing_tables

# n with no decomposition of K_n* (Tillson): the largest possible set, n-2 cycles
PARTIAL = {4, 6}


@pytest.mark.parametrize("n", range(2, 65))
def test_cycles_properties(n):
    cycles = hamiltonian_cycles(n)
    arcs = set()
    for cyc in cycles:
        assert sorted(cyc) == list(range(n)), f"n={n}: not Hamiltonian: {cyc}"
        for a, b in zip(cyc, cyc[1:] + cyc[:1]):
            assert a != b and (a, b) not in arcs, f"n={n}: arc {a}->{b} repeated"
            arcs.add((a, b))
    if n in PARTIAL:
        assert len(cycles) == n - 2
    else:
        assert len(cycles) == n - 1 and len(arcs) == n * (n - 1)
    rt = routing_tables(n)
    for i, cyc in enumerate(cycles):
        for a, b in zip(cyc, cyc[1:] + cyc[:1]):
            assert rt.nxt[i][a] == b and rt.prv[i][b] == a
            assert rt.out_ring[a][b] == i and rt.in_ring[b][a] == i
        for r in range(n):  # after n-1 steps back along a Hamiltonian cycle we are one step ahead
            assert rt.origin(i, r, n - 1) == rt.nxt[i][r]
            assert {rt.origin(i, r, s) for s in range(n)} == set(range(n))


def test_fast():
    from megatron_sp_ext.topology import hamiltonian as hm
    hm._cycles.cache_clear()
    t = time.perf_counter()
    hamiltonian_cycles(64)
    assert time.perf_counter() - t < 1.0
