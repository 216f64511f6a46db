"""One ring (#50): ring and TASP, with or without a block mask, are one autograd Function over one point-to-point
path; the plan cache never serves a stale mask; a masked ring takes the emulated machines' links bit for bit.

Numbers are checked against tests/test_block_sparse.py's float64 masked reference (out and every input gradient).
"""
import ast
import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.attention import block_sparse as bsp
from megatron_sp_ext.attention.backends import get_backend
from megatron_sp_ext.sp.ring import ring as ring_mod
from megatron_sp_ext.topology.emulate import MACHINE_SIZE_ENV
from megatron_sp_ext.topology.hamiltonian import routing_tables
from tests.harness import run_ranks
from tests.gpu.suite_judge import verdict
from tests.test_block_sparse import TOL64, check_case, random_mask, window_mask

PKG = Path(spx.__file__).parent


def _classes(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            yield node.name, [ast.unparse(b) for b in node.bases]


def test_one_autograd_function_for_ring_and_tasp():
    """Under sp/ring only ring._RingFn (ring and TASP, dense or masked) and torus._TorusFn (its staged Ulysses
    exchange) subclass torch.autograd.Function."""
    found = {(p.name, name) for p in sorted((PKG / "sp" / "ring").glob("*.py")) for name, bases in _classes(p)
             if any(b.endswith("Function") for b in bases)}
    assert found == {("ring.py", "_RingFn"), ("torus.py", "_TorusFn")}, found


def test_one_point_to_point_path():
    """Point-to-point batches are started only in comm/p2p.py (no batch_isend_irecv / P2POp / link all-to-all
    elsewhere in the ring family); comm/multiring.py is gone."""
    assert not (PKG / "comm" / "multiring.py").exists()
    words = {"batch_isend_irecv", "P2POp", "isend", "irecv", "all_to_all", "emulated_link"}

    def used(path: Path) -> set:
        tree = ast.parse(path.read_text())
        return {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(tree)
                if isinstance(n, (ast.Attribute, ast.Name))} & words
    for p in sorted((PKG / "sp" / "ring").glob("*.py")):
        assert not used(p), f"{p.name} uses {used(p)}: point-to-point goes through comm/p2p.py"
    assert {"batch_isend_irecv", "P2POp", "all_to_all"} <= used(PKG / "comm" / "p2p.py")


# --------------------------------------------------------------------------------------- plan cache soundness
def test_masked_plans_live_on_their_problem():
    """#85: a masked plan (its host copy of the mask and skip tables, the ring's host decisions) is built once per
    AttentionProblem and reused by every later call of that problem (the layers of a step, a hybrid/torus call's
    fresh RingBackend); another problem (a layer's own top-k mask) gets its own; without an owner nothing is kept."""
    from megatron_sp_ext.sp.problem import AttentionProblem
    t = 4
    m = window_mask(t)
    kw = dict(variant="ring", s_loc=16, q_runs=((0, 16),), kv_runs=(((0, 16),),), causal=False, scale=1.0,
              backend=get_backend("sdpa"), tile=4)
    p1 = AttentionProblem(block_mask=m, tile=4)
    a = ring_mod.make_ring_plan(None, block_mask=m, owner=p1, **kw)
    assert ring_mod.make_ring_plan(None, block_mask=m, owner=p1, **kw) is a        # the same problem: one plan
    p2 = p1.with_mask(m.clone(), agreed=True)
    b = ring_mod.make_ring_plan(None, block_mask=p2.block_mask, owner=p2, **kw)
    assert b is not a and torch.equal(b.tiles.block_mask, a.tiles.block_mask)    # another problem: its own plan
    assert ring_mod.make_ring_plan(None, block_mask=m, **kw) is not ring_mod.make_ring_plan(None, block_mask=m, **kw)
    assert a.tiles.block_mask.device.type == "cpu" and a.tiles.block_mask is not m   # the plan's own host copy
    be = lambda: ring_mod.RingBackend(None, "ring", ((0, 16),), (((0, 16),),), get_backend("sdpa"),  # noqa: E731
                                      problem=p1, seq_len=16)
    k = torch.zeros(1, 2, 16, 8)
    assert be().plan(k, False, 1.0) is be().plan(k, False, 1.0)                 # a fresh backend per call: one plan
    assert ring_mod.RingBackend(None, "ring", ((0, 16),), (((0, 16),),), get_backend("sdpa"),
                                problem=AttentionProblem(), seq_len=16).problem is None   # no mask: a dense ring


def test_masked_plans_go_with_their_problem_and_frozen_masks():
    """A masked ring plan is cached on the problem that carries the mask (``owner``): the same problem gets one plan,
    another problem (even with an equal mask) its own, and the plan goes with its problem; nothing is keyed on a
    tensor's id. A mask changed in place after its problem was built is refused by name (what is derived from it
    would be stale)."""
    import weakref

    from megatron_sp_ext import AttentionProblem
    t = 4
    m = window_mask(t)
    kw = dict(variant="ring", s_loc=16, q_runs=((0, 16),), kv_runs=(((0, 16),),), causal=False, scale=1.0,
              backend=get_backend("sdpa"), tile=4)
    owner = AttentionProblem(block_mask=m, tile=4)
    a = ring_mod.make_ring_plan(None, block_mask=m, owner=owner, **kw)
    assert ring_mod.make_ring_plan(None, block_mask=m, owner=owner, **kw) is a  # the same problem: one plan
    other = AttentionProblem(block_mask=m.clone(), tile=4)
    assert ring_mod.make_ring_plan(None, block_mask=other.block_mask, owner=other, **kw) is not a
    assert ring_mod.make_ring_plan(None, block_mask=m, **kw) is not a   # no owner: built, not cached
    gone = weakref.ref(a)
    del a, owner
    gc.collect()
    assert gone() is None   # the plan went with its problem
    x = torch.randn(1, 16, 2, 8)
    p = AttentionProblem(block_mask=m, tile=4)
    spx.ulysses_attention(x, x, x, None, p)
    m[0, 0, 3] = True   # in place, after the problem was built
    with pytest.raises(SPConfigError, match="block_mask was changed in place after its AttentionProblem was built"):
        spx.ulysses_attention(x, x, x, None, p)


def _in_place(rank, world, variant, causal, placement):
    """A masked call, the SAME mask tensor changed in place, a dense call, the mask again, then a new tensor: every
    result against the reference of the mask it had at that call."""
    g = dist.group.WORLD
    rings = 1 if variant == "ring" else len(routing_tables(world).cycles)
    s, bs = 2 * world * rings * 4, 5
    t = bsp.num_tiles(s, bs)
    bm = random_mask(11, 4, t, keep=0.4)
    call = lambda m: lambda q, k, v: spx.ring_attention(q, k, v, g, variant=variant, causal=causal,  # noqa: E731
                                                          placement=placement, block_mask=m, block_size=bs)
    kw = dict(s=s, h=4, hkv=2, d=8, bs=bs, causal=causal, placement=placement)
    check_case(call(bm), rank, world, block_mask=bm.clone(), seed=1, **kw)
    bm.copy_(random_mask(12, 4, t, keep=0.4))  # in place: same id, new contents
    check_case(call(bm), rank, world, block_mask=bm.clone(), seed=2, **kw)
    ones = torch.ones(1, t, t, dtype=torch.bool)
    check_case(call(None), rank, world, block_mask=ones, seed=3, **kw)  # dense between masked calls
    bm[:, :, : t // 2] = False  # in place again, then masked again
    check_case(call(bm), rank, world, block_mask=bm.clone(), seed=4, **kw)
    del bm
    gc.collect()
    fresh = window_mask(t)  # a new tensor (it may reuse the freed one's id)
    check_case(call(fresh), rank, world, block_mask=fresh.clone(), seed=5, **kw)
    return True


@pytest.mark.parametrize("world,variant,causal,placement", [
    (2, "ring", True, "zigzag"), (3, "ring", False, "contiguous"), (3, "tasp", True, "tasp_zigzag"),
    (4, "tasp", False, "contiguous")])
def test_mask_changed_in_place_gives_the_new_result(world, variant, causal, placement):
    run_ranks(_in_place, world, variant, causal, placement)


# ------------------------------------------------------------------------------------------ host-staged batches
def _staged(rank, world):
    """The gloo-with-CUDA-tensors path of comm/p2p (host copies, received ones copied back at the wait) forced on
    CPU tensors: masked ring and TASP, dense ring, and torus (its stages' batches) against the reference, and the
    path was taken."""
    from megatron_sp_ext.comm import p2p
    g = dist.group.WORLD
    s, bs = 2 * world * len(routing_tables(world).cycles) * 4, 5
    t = bsp.num_tiles(s, bs)
    bm = random_mask(41, 4, t, keep=0.4)
    taken = []
    p2p.needs_host_staging = lambda group, like: taken.append(1) or True  # this forked rank only
    mesh = spx.build_sp_mesh(g, num_heads=4, placement="tas", ulysses_size=2, nodes=2)
    kw = dict(s=s, h=4, hkv=2, d=8, bs=bs)
    for n, (causal, fn) in enumerate((
            (True, lambda q, k, v: spx.ring_attention(q, k, v, g, causal=True, placement="zigzag", block_mask=bm,
                                                      block_size=bs)),
            (False, lambda q, k, v: spx.ring_attention(q, k, v, g, variant="tasp", block_mask=bm, block_size=bs)),
            (False, lambda q, k, v: spx.torus_attention(q, k, v, mesh, block_mask=bm, block_size=bs)))):
        check_case(fn, rank, world, block_mask=bm, causal=causal, placement="zigzag" if causal else "contiguous",
                   seed=n, **kw)
    ones = torch.ones(1, t, t, dtype=torch.bool)
    check_case(lambda q, k, v: spx.ring_attention(q, k, v, g, causal=True, placement="zigzag"), rank, world,
               block_mask=ones, causal=True, placement="zigzag", seed=9, **kw)
    assert taken, "the host-staged path was not taken"
    return True


def test_host_staged_batches_are_right():
    run_ranks(_staged, 4)


# ------------------------------------------------------------------------------------- emulated machines' links
def _emulated(rank, world, causal):
    """Masked ring, tasp, hybrid (ring across machines) and torus (staged Ulysses across machines): bitwise equal
    with and without the emulated machines, with traffic on the emulated link, and right against the reference."""
    from megatron_sp_ext.comm import transport as T
    g = dist.group.WORLD
    h, d, s, bs = 4, 8, 48, 5
    t = bsp.num_tiles(s, bs)
    bm = random_mask(31, h, t, keep=0.45)
    meshes = {}

    def mesh(placement):
        if placement not in meshes:
            meshes[placement] = spx.build_sp_mesh(g, num_heads=h, placement=placement, ulysses_size=2, nodes=2)
        return meshes[placement]
    plc = "zigzag" if causal else "contiguous"
    fns = {
        "ring": lambda q, k, v: spx.ring_attention(q, k, v, g, causal=causal, placement=plc, block_mask=bm,
                                                   block_size=bs),
        "tasp": lambda q, k, v: spx.ring_attention(q, k, v, g, variant="tasp", causal=causal, placement=plc,
                                                   block_mask=bm, block_size=bs),
        "hybrid": lambda q, k, v: spx.hybrid_attention(q, k, v, mesh("usp"), causal=causal, placement=plc,
                                                       block_mask=bm, block_size=bs),
        "torus": lambda q, k, v: spx.torus_attention(q, k, v, mesh("tas"), causal=causal, placement=plc,
                                                     block_mask=bm, block_size=bs),
    }

    def epochs():
        return sum(x.inter._epoch for x in T._EMULATED.values())

    def runs():
        out, moved = {}, {}
        for name, fn in fns.items():
            before = epochs()
            out[name] = check_case(fn, rank, world, s=s, h=h, hkv=2, d=d, bs=bs, block_mask=bm, causal=causal,
                                   placement=plc, tol=TOL64)
            moved[name] = epochs() - before
        return out, moved
    os.environ.pop(MACHINE_SIZE_ENV, None)
    plain, _ = runs()
    os.environ[MACHINE_SIZE_ENV] = "2"
    try:
        emulated, moved = runs()
    finally:
        os.environ.pop(MACHINE_SIZE_ENV, None)
    for name in plain:
        assert moved[name] > 0, f"{name}: nothing went through the emulated link"
        (o1, g1), (o2, g2) = plain[name], emulated[name]
        assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2)), name
    return True


@pytest.mark.parametrize("causal", [False, True])
def test_masked_ring_family_under_emulated_machines_is_bitwise(causal):
    run_ranks(_emulated, 4, causal)


def test_cuda_family_dry_run_on_cpu(monkeypatch):
    """tests/gpu/cuda_one_ring.one_ring_family on 4 CPU gloo ranks (SPX_SUITE_DEVICE=cpu, SPX_SUITE_SHRINK=16): its 10
    records, each within tolerance."""
    from tests.gpu import cuda_block_sparse as cbs, cuda_one_ring as fam
    monkeypatch.setattr(cbs, "DEV", "cpu")
    monkeypatch.setattr(cbs, "SHRINK", 16)
    for per_rank in run_ranks(fam.one_ring_family, 4):
        assert len(per_rank) == 10
        for r in per_rank:
            assert not verdict(r), (verdict(r), r)
