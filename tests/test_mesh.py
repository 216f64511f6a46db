"""Topology-aware meshes: volume model, mesh groups, hybrid attention vs the float64 reference."""
import itertools

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.placement import pieces
from megatron_sp_ext.topology.volume import arrangement_for, lemma_d1_diff, tas_volume, usp_volume
from tests.harness import run_ranks
from tests.sp_check import run_case


def test_volume_equations():
    B, L, H, D = 1, 1024, 8, 64
    unit = B * L * H * D
    # eq. 4 / eq. 6 regimes: N=4 machines of M=8, P_u=8 (usp: ulysses inside, ring of 4 across)
    assert usp_volume(4, 8, 8, 4, B, L, H, D) == pytest.approx(2 * 3 * unit / 4)
    assert tas_volume(4, 8, 8, 4, B, L, H, D) == pytest.approx(4 * 3 / 4 * unit / 4)
    # eq. 5 / eq. 7 regimes: N=8, M=2, P_u=4, P_r=4
    a = 8 / 4
    assert usp_volume(8, 2, 4, 4, B, L, H, D) == pytest.approx((2 * 3 * a + 4 * (a - 1) / a) * unit / 8)
    assert tas_volume(8, 2, 4, 4, B, L, H, D) == pytest.approx((2 * (8 / 4 - 1) + 4 * 3 / 4 * 8 / 4) * unit / 8)
    assert usp_volume(1, 8, 8, 1, B, L, H, D) == 0 == tas_volume(1, 8, 8, 1, B, L, H, D)


def test_lemma_d1_over_grid():
    for N, M in itertools.product(range(2, 17), range(2, 9)):
        for P_u in range(M, N + 1):
            if (N * M) % P_u:
                continue
            P_r = N * M // P_u
            diff = usp_volume(N, M, P_u, P_r, 1, 1, 1, 1) - tas_volume(N, M, P_u, P_r, 1, 1, 1, 1)
            assert diff == pytest.approx(lemma_d1_diff(N, M, P_u) / N, abs=1e-9), (N, M, P_u)
            assert diff >= -1e-12, (N, M, P_u)
    assert arrangement_for(4, 8, 8) == "tas" and arrangement_for(1, 8, 8) == "usp"


def _mesh_groups(rank, world, nodes, placement, p_u):
    g = dist.group.WORLD
    mesh = spx.build_sp_mesh(g, num_heads=8, placement=placement, ulysses_size=p_u, nodes=nodes)
    return (mesh.arrangement, tuple(mesh.ulysses_members()), tuple(mesh.ring_members()))


@pytest.mark.parametrize("world,nodes", [(8, 2), (8, 4), (4, 2)])
@pytest.mark.parametrize("placement", ["usp", "tas"])
def test_mesh_groups(world, nodes, placement):
    m = world // nodes
    p_u = m if placement == "usp" else nodes  # Ulysses inside machines (usp) / across machines (tas)
    res = run_ranks(_mesh_groups, world, nodes, placement, p_u)
    for r, (pl, ul, ri) in enumerate(res):
        assert pl == placement and r in ul and r in ri
        if placement == "usp":  # Ulysses = my machine, ring = same local rank on every machine
            assert set(ul) == {x for x in range(world) if x // m == r // m}
            assert set(ri) == {x for x in range(world) if x % m == r % m}
        else:  # StreamFusion: ring = my machine, Ulysses = same local rank across machines
            assert set(ri) == {x for x in range(world) if x // m == r // m}
            assert set(ul) == {x for x in range(world) if x % m == r % m}


def _mesh_errors(rank, world):
    g = dist.group.WORLD
    out = {}
    for name, kw in {"pu_world": dict(ulysses_size=3), "pu_heads": dict(ulysses_size=4, num_heads=6),
                     "tas_single": dict(placement="tas"), "bad": dict(placement="ring")}.items():
        kw.setdefault("num_heads", 8)
        try:
            spx.build_sp_mesh(g, **kw)
        except SPConfigError as e:
            out[name] = str(e)
    return out


def test_mesh_errors():
    errs = run_ranks(_mesh_errors, 4)[0]
    assert "ulysses_size=3 does not divide the sequence-parallel size 4" in errs["pu_world"]
    assert "does not divide the number of heads 6" in errs["pu_heads"]
    assert "needs a multi-machine mesh" in errs["tas_single"]
    assert "placement='ring'" in errs["bad"]


def _hybrid(rank, world, nodes, placement, p_u, variant, chunks):
    g = dist.group.WORLD
    n = 0
    for (h, hkv) in ((4, 4), (6, 6), (4, 2)):
        mesh = spx.build_sp_mesh(g, num_heads=h, placement=placement, ulysses_size=p_u, nodes=nodes)
        for causal in (False, True):
            seq_pl = "zigzag" if causal else "contiguous"

            def shard(x, r, w, seq_pl=seq_pl):
                return torch.cat([x[:, a:a + m] for a, m in pieces(seq_pl, r, w, x.shape[1])], dim=1)
            c = min(chunks, h // p_u)
            run_case(lambda q, k, v: spx.hybrid_attention(q, k, v, mesh, head_chunks=c, ring_variant=variant,
                                                          causal=causal, placement=spx.balanced_placement("ring",
                                                              causal)),
                     rank, world, b=1, s=2 * world * 3, h=h, hkv=hkv, d=16, dtype=torch.float32, causal=causal,
                     seed=n, shard=shard)
            n += 1
    return n


@pytest.mark.parametrize("world,nodes,placement,p_u,variant,chunks", [
    (4, 2, "usp", 2, "ring", 1),
    (4, 2, "tas", 2, "ring", 2),
    (4, 2, "tas", 2, "tasp", 1),
    (8, 2, "usp", 2, "tasp", 2),
    (8, 4, "tas", 2, "ring", 1),
])
def test_hybrid_matches_reference(world, nodes, placement, p_u, variant, chunks):
    run_ranks(_hybrid, world, nodes, placement, p_u, variant, chunks)


def _torus(rank, world, nodes, placement, p_u, variant):
    g = dist.group.WORLD
    n = 0
    for (h, hkv) in ((4, 4), (6, 6), (4, 2), (8, 8)):
        if h % p_u:
            continue  # the mesh needs P_u | H (tested in test_mesh_errors)
        mesh = spx.build_sp_mesh(g, num_heads=h, placement=placement, ulysses_size=p_u, nodes=nodes)
        for causal in (False, True):
            for layout in ("bshd", "sbhd"):
                seq_pl = "zigzag" if causal else "contiguous"

                def shard(x, r, w, seq_pl=seq_pl):
                    return torch.cat([x[:, a:a + m] for a, m in pieces(seq_pl, r, w, x.shape[1])], dim=1)
                run_case(lambda q, k, v: spx.torus_attention(q, k, v, mesh, causal=causal,
                                                             placement=spx.balanced_placement("ring", causal),
                                                                 ring_variant=variant,
                                                             layout=layout),
                         rank, world, b=1, s=2 * world * 3, h=h, hkv=hkv, d=16, dtype=torch.float32, causal=causal,
                         seed=10 + n, shard=shard, layout=layout)
                n += 1
    return n


@pytest.mark.parametrize("world,nodes,placement,p_u,variant", [
    (4, 2, "tas", 2, "ring"),    # 2 machines x 2: torus across machines, ring inside
    (4, 2, "usp", 2, "ring"),
    (4, 4, "tas", 4, "ring"),    # pure torus (ring size 1), 4 stages
    (8, 4, "tas", 4, "tasp"),
    (4, 2, "tas", 2, "tasp"),
])
def test_torus_matches_reference(world, nodes, placement, p_u, variant):
    run_ranks(_torus, world, nodes, placement, p_u, variant)
