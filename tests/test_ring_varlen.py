"""Packed variable-length samples (cu_seqlens) in the ring family (issue #36): ring and TASP, hybrid (usp/tas)
and torus meshes, and the factory path, against a float64 per-sample reference (block-diagonal mask, causal
inside each sample): output and every input gradient of this rank's shard.

Shards come from the per-sample placement (each sample split on its own: "contiguous" P pieces, "zigzag" 2P
pieces [r, 2P-1-r]); the expected positions come from tests/packed_reference.py, independent of the library.
Sample lengths that divide by neither P nor 2P are padded per sample (tests.packed_reference.ragged). Also: the
schedule never pairs tokens of different samples, rows stay finite when a step gives them no key, and the refusals
(shards not padded as shard_sequence pads them, tasp_zigzag, kv_valid_len, B > 1) are SPConfigErrors naming the
setting.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.ring.schedule import sample_runs, step_items
from tests.harness import run_ranks
from tests.packed_reference import block_mask, ragged, sharder
from tests.sp_check import run_case


def packed_cu(world, placement, mults):
    """Cumulative lengths of samples of mults[i] * divisor tokens (0: an empty sample)."""
    div = world if placement == "contiguous" else 2 * world
    cu = [0]
    for m in mults:
        cu.append(cu[-1] + m * div)
    return cu


# contiguous: a sample of P tokens (< 2P) and an empty one; zigzag: lengths 2P, 6P, 4P, 2P
MULTS = {"contiguous": (3, 1, 0, 2), "zigzag": (1, 3, 2, 1)}


def check(attn, rank, world, cu, placement, causal, layout, h, hkv, seed):
    run_case(lambda q, k, v: attn(q, k, v, torch.tensor(cu, dtype=torch.int32)), rank, world, b=1, s=cu[-1], h=h,
             hkv=hkv, d=8, dtype=torch.float32, causal=causal, layout=layout, shard=sharder(cu, placement),
             mask=block_mask(cu, causal), seed=seed)


def _ring_rank(rank, world, variant):
    g = dist.group.WORLD
    n = 0
    for causal in (False, True):
        placement = "zigzag" if causal else "contiguous"
        cu = packed_cu(world, placement, MULTS[placement])
        for layout in ("bshd", "sbhd"):
            for hkv in (2, 1):  # hkv=1: GQA, 2 q heads per k/v head
                check(lambda q, k, v, c: spx.ring_attention(q, k, v, g, variant=variant, causal=causal,
                                                            placement=spx.balanced_placement(variant, causal,
                                                                packed=True), layout=layout,
                                                            cu_seqlens=c),
                      rank, world, cu, placement, causal, layout, 2, hkv, n)
                n += 1
    # non-causal attention in the zigzag placement (what a causal model's non-causal layer sees), and causal in the
    # contiguous placement (unbalanced but exact; sample lengths 3P and P, not multiples of 2P)
    # and sample lengths that divide by neither P nor 2P (each padded at its tail; padding kept apart)
    for causal, placement, mults in ((False, "zigzag", (2, 1)), (True, "contiguous", MULTS["contiguous"]),
                                     (False, "contiguous", None), (True, "zigzag", None)):
        cu = packed_cu(world, placement, mults) if mults else ragged(world)
        check(lambda q, k, v, c: spx.ring_attention(q, k, v, g, variant=variant, causal=causal, placement=placement,
                                                    cu_seqlens=c),
              rank, world, cu, placement, causal, "bshd", 2, 2, n)
        n += 1
    if variant == "ring":  # one kernel call per sample and step (causal zigzag: the diagonal is one causal call)
        from megatron_sp_ext.attention.backends import get_backend
        from megatron_sp_ext.sp.placement import varlen_pieces
        from megatron_sp_ext.sp.ring.ring import make_ring_plan
        for causal, placement in ((False, "contiguous"), (True, "zigzag")):
            cu = tuple(packed_cu(world, placement, MULTS[placement]))
            runs = tuple(varlen_pieces(placement, o, world, cu) for o in range(world))
            plan = make_ring_plan(g, variant="ring", s_loc=cu[-1] // world, q_runs=runs[rank], kv_runs=runs,
                                  causal=causal, scale=1.0, backend=get_backend("sdpa"), cu_seqlens=cu)
            samples = sum(b > a for a, b in zip(cu, cu[1:]))
            for step in range(world):
                items = plan.items(step, "cpu")
                assert len(items) == samples, (causal, step, items)
                assert all(it.mask is None and isinstance(it.q_rows, slice) for it in items), items
    return n


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("variant", ["ring", "tasp"])
def test_ring_packed_samples(world, variant):
    assert all(run_ranks(_ring_rank, world, variant))


def _one_sample_rank(rank, world):
    """One sample covering the whole sequence equals the call without cu_seqlens, bit for bit."""
    g = dist.group.WORLD
    for variant in ("ring", "tasp"):
        for causal in (False, True):
            pl = "zigzag" if causal else "contiguous"
            gen = torch.Generator().manual_seed(5)
            q, k, v = (torch.randn(1, 2 * 3, 2, 8, generator=gen) for _ in range(3))
            cu = torch.tensor([0, 2 * 3 * world])
            a = spx.ring_attention(q, k, v, g, variant=variant, causal=causal, placement=pl, cu_seqlens=cu)
            b = spx.ring_attention(q, k, v, g, variant=variant, causal=causal, placement=pl)
            assert torch.equal(a, b), (variant, causal)
    return True


def test_one_sample_equals_unpacked():
    assert all(run_ranks(_one_sample_rank, 2))


def test_schedule_pairs_only_same_sample():
    """Every kernel call of a step pairs rows of one sample; a query with no key of its sample in the step gets
    no call; touching pieces of a sample are one run."""
    cu = (0, 6, 10, 16)
    # queries: rows 0..3 = positions 4..7 (sample 0 tail + sample 1 head); keys: positions 0..5, 10..11
    q_runs = [(4, 4, 0)]
    kv_runs = [(0, 6, 0), (10, 2, 6)]
    assert sample_runs(q_runs, cu) == {0: [(4, 2, 0)], 1: [(6, 2, 2)]}
    assert sample_runs([(0, 3, 0), (3, 3, 3)], cu) == {0: [(0, 6, 0)]}
    for causal in (False, True):
        items = step_items(q_runs, kv_runs, causal, "cpu", cu)
        assert len(items) == 1  # sample 1's queries see no key here; sample 2's keys have no query
        it = items[0]
        assert (it.q_rows, it.kv_rows) == (slice(0, 2), slice(0, 6))
        if causal:  # position 4 sees 0..4, position 5 sees 0..5
            assert torch.equal(it.mask, torch.arange(4, 6).view(2, 1) >= torch.arange(6).view(1, 6))
        else:
            assert it.mask is None and not it.causal


def _no_key_rank(rank, world):
    """Rows that see no key at a step stay finite: causal P=4, many 1-piece samples (every rank's queries of a
    sample see no key of the later ranks' pieces at most steps)."""
    g = dist.group.WORLD
    cu = packed_cu(world, "zigzag", (1, 1, 1, 1))
    check(lambda q, k, v, c: spx.ring_attention(q, k, v, g, causal=True, placement=spx.balanced_placement("ring",
                                                True, packed=True), cu_seqlens=c),
          rank, world, cu, "zigzag", True, "bshd", 4, 2, 7)
    return True


def test_rows_without_keys_in_a_step_stay_finite():
    assert all(run_ranks(_no_key_rank, 4))


def _mesh_rank(rank, world, nodes, placement, p_u, variant, kind):
    g = dist.group.WORLD
    h = 4
    mesh = spx.build_sp_mesh(g, num_heads=h, placement=placement, ulysses_size=p_u, nodes=nodes)
    n = 0
    for causal in (False, True):
        seq_pl = "zigzag" if causal else "contiguous"
        cu = packed_cu(world, seq_pl, MULTS[seq_pl])
        for layout, hkv, cu in (("bshd", 4, cu), ("sbhd", 2, cu), ("bshd", 2, ragged(world))):
            if kind == "hybrid":
                def attn(q, k, v, c):
                    return spx.hybrid_attention(q, k, v, mesh, head_chunks=2, ring_variant=variant, causal=causal,
                                                placement=spx.balanced_placement("ring", causal),
                                                layout=layout, cu_seqlens=c)
            else:
                def attn(q, k, v, c):
                    return spx.torus_attention(q, k, v, mesh, ring_variant=variant, causal=causal,
                                               placement=spx.balanced_placement("ring", causal), layout=layout,
                                               cu_seqlens=c)
            check(attn, rank, world, cu, seq_pl, causal, layout, h, hkv, 20 + n)
            n += 1
    return n


@pytest.mark.parametrize("kind,world,nodes,placement,p_u,variant", [
    ("hybrid", 4, 2, "usp", 2, "ring"), ("hybrid", 4, 2, "tas", 2, "tasp"), ("torus", 4, 2, "tas", 2, "ring"),
    ("torus", 4, 2, "usp", 2, "tasp"),
    ("hybrid", 2, 2, "usp", 1, "ring"),   # P_u = 1: the ring alone over the mesh order
    ("torus", 4, 4, "tas", 4, "ring"),    # ring size 1: the torus stages alone
])
def test_mesh_packed_samples(kind, world, nodes, placement, p_u, variant):
    """P=4 as 2 emulated machines x 2: Ulysses inside (usp) or across (tas), ring/TASP in the other dimension;
    and the degenerate meshes (one of the two dimensions of size 1)."""
    assert all(run_ranks(_mesh_rank, world, nodes, placement, p_u, variant, kind))


def _factory_rank(rank, world):
    from megatron_sp_ext.config import SPConfig
    from megatron_sp_ext.sp.factory import make_attention
    g = dist.group.WORLD
    n = 0
    for mode in ("ulysses", "hcms", "ring", "tasp", "usp", "tas", "torus", "auto"):
        cfg = SPConfig(mode=mode, head_chunks=2, nodes=2)
        for causal in (False, True):
            placement = "zigzag" if causal else "contiguous"
            cu = packed_cu(world, placement, (1, 2)) if causal else ragged(world)
            attn = make_attention(cfg, g, num_heads=8, num_kv_heads=4, layout="sbhd", placement=placement)
            check(lambda q, k, v, c: attn(q, k, v, causal=causal, cu_seqlens=c), rank, world, cu, placement, causal,
                  "sbhd", 8, 4, 40 + n)
            n += 1
    return n


def test_factory_every_mode_packed_samples():
    assert all(run_ranks(_factory_rank, 4))


def _refusals_rank(rank, world):
    g = dist.group.WORLD
    q = torch.randn(1, 8, 2, 8)
    cu = torch.tensor([0, 8 * world])
    mesh = spx.build_sp_mesh(g, num_heads=2, placement="usp", ulysses_size=1)
    calls = {"ring": lambda **kw: spx.ring_attention(q, q, q, g, **kw),
             "tasp": lambda **kw: spx.ring_attention(q, q, q, g, variant="tasp", **kw),
             "hybrid": lambda **kw: spx.hybrid_attention(q, q, q, mesh, **kw),
             "torus": lambda **kw: spx.torus_attention(q, q, q, mesh, **kw)}
    for name, call in calls.items():
        with pytest.raises(SPConfigError, match="kv_valid_len cannot be combined with cu_seqlens"):
            call(cu_seqlens=cu, kv_valid_len=5)
        with pytest.raises(SPConfigError, match=r"do not divide by .* shard_sequence"):
            call(cu_seqlens=torch.tensor([0, 3, 8 * world]), causal=True)
        with pytest.raises(SPConfigError, match="cu_seqlens=.*must end at the full packed sequence length"):
            call(cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(SPConfigError, match="placement='tasp_zigzag' does not support cu_seqlens"):
        spx.ring_attention(q, q, q, g, variant="tasp", causal=True, placement="tasp_zigzag", cu_seqlens=cu)
    q2 = q.expand(2, -1, -1, -1)
    with pytest.raises(SPConfigError, match="batch size 1"):
        spx.ring_attention(q2, q2, q2, g, cu_seqlens=cu)
    return True


def test_packed_refusals():
    assert all(run_ranks(_refusals_rank, 2))
