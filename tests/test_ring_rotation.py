"""The ring backward's dK|dV return (sp/ring/rotation.py): partials straight home vs the traveling fp32
accumulator, the head-chunked last step; float64 reference, bitwise agreement, the op tables, the env settings."""
import os

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.attention import backends
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.placement import pieces
from megatron_sp_ext.sp.ring import ring as ring_mod
from megatron_sp_ext.sp.ring import rotation
from megatron_sp_ext.sp.ring.schedule import Item
from megatron_sp_ext.topology.emulate import MACHINE_SIZE_ENV
from megatron_sp_ext.topology.hamiltonian import routing_tables
from tests.harness import run_ranks
from tests.reference import assert_close, make_qkv, reference_attention
from tests.sp_check import run_case

SCHEDULES = (("travel", "1"), ("home", "1"), ("home", "2"))


# ---------------------------------------------------------------- settings
def test_schedule_from_env():
    assert rotation.dkv_schedule_from_env({}) == rotation.DkvSchedule("home", 0)
    assert rotation.dkv_schedule_from_env({"SPX_RING_DKV": "travel", "SPX_RING_DKV_CHUNKS": "3"}) == \
        rotation.DkvSchedule("travel", 3)
    with pytest.raises(SPConfigError, match=r"SPX_RING_DKV='hme' is invalid.*home, travel"):
        rotation.dkv_schedule_from_env({"SPX_RING_DKV": "hme"})
    for bad in ("0", "x", "-2"):
        with pytest.raises(SPConfigError, match=rf"SPX_RING_DKV_CHUNKS='{bad}' is invalid"):
            rotation.dkv_schedule_from_env({"SPX_RING_DKV_CHUNKS": bad})


def test_head_chunks():
    home = rotation.DkvSchedule("home", 0)
    assert rotation.head_chunks(home, 40, 1 << 20) == [(0, 40)]               # small: one chunk
    assert rotation.head_chunks(home, 40, 1 << 30) == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert rotation.head_chunks(rotation.DkvSchedule("home", 3), 4, 0) == [(0, 2), (2, 3), (3, 4)]
    assert rotation.head_chunks(rotation.DkvSchedule("home", 8), 2, 0) == [(0, 1), (1, 2)]  # capped by Hkv


# ---------------------------------------------------------------- the op tables
def _plan(rank, world, variant, causal):
    if variant == "tasp":
        rt = routing_tables(world)
        m = len(rt.cycles)
    else:
        rt, m = ring_mod._single_ring(world), 1
    u = 2
    placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
    seqlen = 2 * world * m * u
    runs = tuple(pieces(placement, o, world, seqlen) for o in range(world))
    s_loc = seqlen // world
    lens = (s_loc // m,) * m
    ab = causal and variant == "tasp"
    moves = ring_mod.sorted_order(runs[rank])[0] if ab else ()
    return ring_mod.RingPlan(None, rank, world, variant, rt, tuple(sum(lens[:i]) for i in range(m)), lens, runs[rank],
                             runs, causal, 1.0, backends.get_backend("math"), None, "ab" if ab else "plain",
                             q_moves=moves, kv_moves=moves)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("variant,causal", [("ring", False), ("ring", True), ("tasp", False), ("tasp", True)])
def test_home_ops_pair_up_and_cover_every_row(world, variant, causal):
    """Every send r -> p at step s meets p's receive from r (same order, same sizes); each home receives every
    row of its block exactly once per step, from the rank that holds that slot."""
    plans = [_plan(r, world, variant, causal) for r in range(world)]
    s_loc = sum(plans[0].slot_len)
    for step in range(1, world):
        for r in range(world):
            ops = rotation.home_ops(plans[r], step)
            for p in range(world):
                sent = [n for k, peer, _, n in ops if k == "send" and peer == p]
                got = [n for k, peer, _, n in rotation.home_ops(plans[p], step) if k == "recv" and peer == r]
                assert sent == got, (step, r, p)
            rows = sorted((row, n) for k, _, row, n in ops if k == "recv")
            assert sum(n for _, n in rows) == s_loc and all(a + n <= b for (a, n), (b, _) in zip(rows, rows[1:]))
            for k, peer, _, _ in ops:   # sends go to the origins of held slots, receives come from their holders
                slots = range(len(plans[r].slot_len))
                if k == "send":
                    assert peer in {plans[r].routing.origin(i, r, step) for i in slots}
                else:
                    assert peer in {rotation.holder(plans[r].routing, i, r, step) for i in slots}


# ---------------------------------------------------------------- numbers vs float64, bitwise agreement
class _Recording(backends.AutoBackend):
    """The default backend, recording the K/V head count of every backward call."""

    def __init__(self):
        super().__init__("sdpa")
        self.heads = []

    def backward_lse(self, do, q, k, v, out, lse, **kw):
        self.heads.append(k.shape[1])
        return super().backward_lse(do, q, k, v, out, lse, **kw)


def _shard(placement):
    def shard(x, r, w):
        return torch.cat([x[:, a:a + n] for a, n in pieces(placement, r, w, x.shape[1])], 1)
    return shard


def _cases(world, variant):
    rings = len(routing_tables(world).cycles) if variant == "tasp" else 1
    s = 2 * world * rings * 2
    n = 0
    for causal in (False, True):
        for dtype, layout in ((torch.float32, "bshd"), (torch.bfloat16, "sbhd")):
            yield dict(causal=causal, dtype=dtype, layout=layout, s=s, valid=None, seed=n)
            n += 1
        yield dict(causal=causal, dtype=torch.float32, layout="bshd", s=s, valid=s - 3, seed=n)  # key padding
        n += 1


def _schedules(rank, world, variant):
    g = dist.group.WORLD
    for case in _cases(world, variant):
        causal, s, valid = case["causal"], case["s"], case["valid"]
        placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
        mask = None
        if valid is not None:
            mask = torch.ones(s, s, dtype=torch.bool).tril() if causal else torch.ones(s, s, dtype=torch.bool)
            mask[:, valid:] = False
        results = {}
        for route, chunks in SCHEDULES:
            os.environ[rotation.DKV_ROUTE_ENV], os.environ[rotation.DKV_CHUNKS_ENV] = route, chunks
            be = _Recording()
            results[route, chunks] = run_case(
                lambda q, k, v: spx.ring_attention(q, k, v, g, variant=variant, causal=causal,
                                                   placement=spx.balanced_placement(variant, causal),
                                                   layout=case["layout"],
                                                   backend=be, kv_valid_len=valid),
                rank, world, b=1, s=s, h=4, hkv=2, d=8, dtype=case["dtype"], causal=causal, layout=case["layout"],
                seed=case["seed"], shard=_shard(placement), mask=mask, compare_rows=valid)
            assert (1 in be.heads) == (chunks == "2"), (route, chunks, be.heads)  # the chunked last step ran
        tag = f"rank{rank} P={world} {variant} {case}"
        for a, b in zip(results["home", "1"], results["home", "2"]):
            assert torch.equal(a, b), f"{tag}: head-chunked last step differs from one chunk"
        # every step >= 1 of these plans has calls on disjoint keys: the home sums are the traveling sums
        for a, b in zip(results["travel", "1"], results["home", "1"]):
            assert torch.equal(a, b), f"{tag}: home route differs from the traveling accumulator"
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("variant", ["ring", "tasp"])
def test_schedules_match_float64_and_each_other(world, variant):
    run_ranks(_schedules, world, variant)


def _emulated(rank, world, variant, causal):
    """The home route over the emulated host-staged link gives the bits of the gloo point-to-point route."""
    g = dist.group.WORLD
    placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
    rings = len(routing_tables(world).cycles) if variant == "tasp" else 1
    s = 2 * world * rings * 2
    os.environ[rotation.DKV_ROUTE_ENV], os.environ[rotation.DKV_CHUNKS_ENV] = "home", "2"
    got = {}
    for emulate in ("", "1"):
        os.environ[MACHINE_SIZE_ENV] = emulate
        got[emulate] = run_case(lambda q, k, v: spx.ring_attention(q, k, v, g, variant=variant, causal=causal,
                                                                   placement=spx.balanced_placement(variant, causal)),
                                rank, world, b=1, s=s, h=4, hkv=2, d=8, dtype=torch.bfloat16, causal=causal,
                                seed=3, shard=_shard(placement))
    os.environ[MACHINE_SIZE_ENV] = ""
    for name, a, b in zip(("out", "dq", "dk", "dv"), got[""], got["1"]):
        assert torch.equal(a, b), f"rank{rank} {variant} causal={causal} {name} differs over the emulated link"
    return True


@pytest.mark.parametrize("variant,causal", [("ring", True), ("tasp", False), ("tasp", True)])
def test_home_route_over_emulated_link_is_bitwise(variant, causal):
    run_ranks(_emulated, 3 if variant == "ring" else 4, variant, causal)


def _overlapping_calls(rank, world):
    """A step whose kernel calls share key rows (each query half x every key, steps >= 1): the partial is summed
    in the accumulator dtype and rounded once to the wire dtype; still within the float64 tolerance."""
    g = dist.group.WORLD
    s, h, hkv, d = 4 * world, 4, 2, 8
    s_loc, half = s // world, s // world // 2
    runs = tuple(pieces("contiguous", o, world, s) for o in range(world))
    plan = ring_mod.make_ring_plan(g, variant="ring", s_loc=s_loc, q_runs=runs[rank], kv_runs=runs, causal=False,
                                   scale=0.321, backend=backends.get_backend("sdpa"))
    plan.items = lambda step, device, base=plan.items: base(step, device) if step == 0 else [
        Item(slice(0, half), slice(None)), Item(slice(half, s_loc), slice(None))]
    assert not rotation._disjoint(plan.items(1, "cpu"))
    try:
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v, do = make_qkv(7, 1, s, h, hkv, d, dtype)
            qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
            ref = reference_attention(qr, kr, vr, softmax_scale=0.321)
            ref.backward(do.double())
            mine = lambda t: t[:, rank * s_loc:(rank + 1) * s_loc]  # noqa: E731
            for route in ("home", "travel"):
                os.environ[rotation.DKV_ROUTE_ENV], os.environ[rotation.DKV_CHUNKS_ENV] = route, "2"
                qs, ks, vs = (mine(t).transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
                out = ring_mod._RingFn.apply(qs, ks, vs, plan)
                out.backward(mine(do).transpose(1, 2))
                for name, got, want in (("out", out.detach(), ref.detach()), ("dq", qs.grad, qr.grad),
                                        ("dk", ks.grad, kr.grad), ("dv", vs.grad, vr.grad)):
                    assert_close(f"rank{rank} {route} {dtype} {name}", got.transpose(1, 2), mine(want), dtype)
    finally:
        del plan.items
    return True


def test_overlapping_calls_in_a_step_stay_within_tolerance():
    run_ranks(_overlapping_calls, 3)
