"""The local kernel choice (backend "auto"/"cudnn"/"torch_flash") and the rewritten ring/TASP schedule:
kernel calls per step, the float64 reference (tests/reference.py) on even and odd sizes."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.attention import backends, lse_kernels
from megatron_sp_ext.config import BACKENDS, SPConfig
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.ring import ring as ring_mod
from megatron_sp_ext.sp.placement import pieces
from megatron_sp_ext.sp.ring.schedule import Item, ab_layout, step_items
from megatron_sp_ext.topology.hamiltonian import routing_tables
from tests.harness import run_ranks
from tests.reference import assert_close, make_qkv, reference_attention
from tests.sp_check import run_case


# ---------------------------------------------------------------- backend selection
def test_auto_takes_the_first_available_kernel(monkeypatch):
    seen = []

    def fake(kernel, device, dtype, head_dim=None):
        seen.append(kernel)
        return kernel in ("flash", "math")
    monkeypatch.setattr(lse_kernels, "available", fake)
    assert lse_kernels.best(torch.device("cpu"), torch.bfloat16) == "flash"
    assert seen == ["fa4", "cudnn", "flash"]   # FA4, then cuDNN first, stop at the first that runs
    monkeypatch.setattr(lse_kernels, "available", lambda k, d, t, hd=None: k in ("cudnn", "flash"))
    assert lse_kernels.best(torch.device("cpu"), torch.bfloat16) == "cudnn"
    monkeypatch.setattr(lse_kernels, "available", lambda k, d, t, hd=None: k == "math")
    assert lse_kernels.best(torch.device("cpu"), torch.bfloat16) == "math"


def test_cpu_kernels_and_precision():
    cpu = torch.device("cpu")
    assert not lse_kernels.available("cudnn", cpu, torch.bfloat16)      # CUDA only
    assert not lse_kernels.available("efficient", cpu, torch.float32)  # not offered at all (GPU evidence)
    assert lse_kernels.available("flash", cpu, torch.float32)            # torch's CPU flash op
    assert lse_kernels.best(cpu, torch.float32) == "flash"
    assert lse_kernels.best(cpu, torch.float64) == "math"                # the reference precision stays exact
    for k in lse_kernels.KERNELS:
        if k != "fa4":                                                   # a package of its own (tests/test_fa4.py)
            assert lse_kernels.schema_ok(k), k                           # this torch has the schemas we call


def test_config_backends():
    assert SPConfig().backend == "auto"
    for name in ("auto", "cudnn", "torch_flash", "sdpa"):
        assert name in BACKENDS and SPConfig(backend=name).backend == name
    with pytest.raises(SPConfigError, match=r"--sp-attention-backend='cudnnn' is invalid.*auto, fa4, cudnn"):
        SPConfig(backend="cudnnn", source="megatron")


def test_explicit_unavailable_kernel_is_an_error_naming_the_setting():
    q = torch.randn(1, 2, 8, 16)
    for setting in ("--sp-attention-backend", "sequence_parallel_ext.backend", "backend"):
        be = backends.get_backend("cudnn", setting)
        with pytest.raises(SPConfigError, match=rf"{setting}='cudnn' cannot run here.*use 'auto'"):
            be.forward_lse(q, q, q, causal=False, softmax_scale=0.25)
        with pytest.raises(SPConfigError, match=rf"{setting}='cudnn'"):
            be(q, q, q, causal=False, softmax_scale=0.25)


def test_auto_and_torch_flash_agree_with_math_on_cpu():
    q, k, v, do = (t.transpose(1, 2).contiguous() for t in make_qkv(5, 1, 11, 4, 2, 16))
    ref_o, ref_l = backends.get_backend("math").forward_lse(q, k, v, causal=True, softmax_scale=0.3)
    for name in ("auto", "sdpa", "torch_flash"):
        be = backends.get_backend(name)
        assert be.kernel_for(q) == "flash"
        o, l_ = be.forward_lse(q, k, v, causal=True, softmax_scale=0.3)
        assert_close(f"{name} out", o, ref_o, torch.float32)
        assert_close(f"{name} lse", l_, ref_l, torch.float32)
        g = be.backward_lse(do, q, k, v, ref_o, ref_l, causal=True, softmax_scale=0.3)
        gm = backends.get_backend("math").backward_lse(do, q, k, v, ref_o, ref_l, causal=True, softmax_scale=0.3)
        for a, b in zip(g, gm):
            assert_close(f"{name} grad", a, b, torch.float32)
        out = be(q, k, v, causal=True, softmax_scale=0.3)
        assert_close(f"{name} call", out, ref_o, torch.float32)


# ---------------------------------------------------------------- the schedule: calls per step
def _runs(placement, rank, world, seqlen):
    out, row = [], 0
    for a, n in pieces(placement, rank, world, seqlen):
        out.append((a, n, row))
        row += n
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_zigzag_ring_is_one_call_per_step(world):
    seqlen = 2 * world * 3
    for rank in range(world):
        q = _runs("zigzag", rank, world, seqlen)
        half = len(q) and q[1][2]
        for step in range(world):
            o = (rank - step) % world
            its = step_items(q, _runs("zigzag", o, world, seqlen), True, "cpu")
            assert len(its) == 1 and isinstance(its[0].q_rows, slice) and isinstance(its[0].kv_rows, slice)
            it = its[0]
            if o == rank:      # the diagonal: one causal call over the whole local block
                assert it.causal and it.q_rows == slice(0, 2 * half) and it.kv_rows == slice(0, 2 * half)
            elif o < rank:     # every query x the first half of the keys
                assert not it.causal and it.q_rows == slice(0, 2 * half) and it.kv_rows == slice(0, half)
            else:              # the second half of the queries x every key
                assert not it.causal and it.q_rows == slice(half, 2 * half) and it.kv_rows == slice(0, 2 * half)
            assert it.mask is None


@pytest.mark.parametrize("world", [3, 4, 5, 6])
def test_causal_tasp_is_at_most_two_calls_per_step(world):
    """tasp_zigzag in compute order with the A/B layout: step 0 one causal call, later steps <= 2 unmasked
    calls on contiguous rows, and the work of every step equals the ring's (balanced)."""
    group = None
    rt = routing_tables(world)
    m = len(rt.cycles)
    u = 2
    seqlen = 2 * world * m * u
    for rank in range(world):
        runs = tuple(pieces("tasp_zigzag", o, world, seqlen) for o in range(world))
        plan = ring_mod.RingPlan(group, rank, world, "tasp", rt, tuple(2 * u * i for i in range(m)), (2 * u,) * m,
                                 runs[rank], runs, True, 1.0, backends.get_backend("math"), None, "ab",
                                 *(ring_mod.sorted_order(runs[rank])[0],) * 2)
        s_loc = 2 * m * u
        for step in range(world):
            its = plan.items(step, "cpu")
            assert 1 <= len(its) <= 2
            assert all(isinstance(i.q_rows, slice) and isinstance(i.kv_rows, slice) and i.mask is None for i in its)
            if step == 0:
                assert its == [Item(slice(0, s_loc), slice(0, s_loc), causal=True)]
            work = sum((i.q_rows.stop - i.q_rows.start) * (i.kv_rows.stop - i.kv_rows.start) for i in its)
            assert step == 0 or work == s_loc * s_loc // 2


def test_ab_layout_rows():
    # slots 0 and 2 come from lower ranks (A), slot 1 from a higher one (B)
    assert ab_layout((0, 5, 1), 3, 10) == ((0, 50), (20, 30), (10, 40))
    assert ab_layout((3, 3, 3), 3, 10) == ((0, 50), (10, 40), (20, 30))   # all own: zigzag order


# ---------------------------------------------------------------- numbers vs float64
def _vs_float64(rank, world, variant, h, hkv, units):
    for causal in (False, True):
        _vs_float64_case(rank, world, variant, causal, h, hkv, units)
    return True


def _vs_float64_case(rank, world, variant, causal, h, hkv, units):
    g = dist.group.WORLD
    rings = len(routing_tables(world).cycles) if variant == "tasp" else 1
    s = 2 * world * rings * units
    placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
    q, k, v, do = make_qkv(11 + world, 1, s, h, hkv, 16)
    mine = lambda t: torch.cat([t[:, a:a + n] for a, n in pieces(placement, rank, world, s)], 1)  # noqa: E731
    qs, ks, vs = (mine(t).clone().requires_grad_() for t in (q, k, v))
    o = spx.ring_attention(qs, ks, vs, g, variant=variant, causal=causal, placement=spx.balanced_placement(variant,
                           causal), backend="torch_flash")
    o.backward(mine(do))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal)
    ref.backward(do.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (o.detach(), qs.grad, ks.grad, vs.grad),
                          (ref.detach(), qr.grad, kr.grad, vr.grad)):
        assert_close(f"rank{rank} {variant} causal={causal} {name}", a, mine(b), torch.float32)
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("variant", ["ring", "tasp"])
def test_torch_flash_schedule_matches_float64(world, variant):
    """torch's CPU flash op (fp32) through the ring/TASP schedule, forward and gradients, vs float64."""
    run_ranks(_vs_float64, world, variant, 4, 2, 3)


def _odd(rank, world, variant):
    """Odd chunk sizes (zigzag chunk 3 / TASP piece 3 tokens), GQA 6/2 and 3/1, causal and not, fp32 and bf16."""
    g = dist.group.WORLD
    rings = len(routing_tables(world).cycles) if variant == "tasp" else 1
    n = 0
    for (h, hkv) in ((6, 2), (3, 1)):
        for causal in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                s = 2 * world * rings * 3
                placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"

                def shard(x, r, w, placement=placement):
                    return torch.cat([x[:, a:a + ln] for a, ln in pieces(placement, r, w, x.shape[1])], 1)
                run_case(lambda q, k, v: spx.ring_attention(q, k, v, g, variant=variant, causal=causal,
                                                            placement=spx.balanced_placement(variant, causal)),
                         rank, world, b=1, s=s, h=h, hkv=hkv, d=8, dtype=dtype, causal=causal, seed=n, shard=shard)
                n += 1
    return n


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("variant", ["ring", "tasp"])
def test_odd_sizes_gqa_match_float64(world, variant):
    run_ranks(_odd, world, variant)


def _padded_tasp(rank, world):
    """Causal TASP (A/B layout) with padding keys cut by kv_valid_len, against the float64 reference."""
    g = dist.group.WORLD
    rings = len(routing_tables(world).cycles)
    s = 2 * world * rings * 2
    valid = s - 3

    def shard(x, r, w):
        return torch.cat([x[:, a:a + ln] for a, ln in pieces("tasp_zigzag", r, w, x.shape[1])], 1)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    mask[:, valid:] = False   # padding keys get no attention
    run_case(lambda q, k, v: spx.ring_attention(q, k, v, g, variant="tasp", causal=True,
                                                placement=spx.balanced_placement("tasp", True), kv_valid_len=valid),
             rank, world, b=1, s=s, h=2, hkv=2, d=8, dtype=torch.float32, causal=True, shard=shard, mask=mask,
             compare_rows=valid)
    return True


def test_tasp_ab_layout_with_padding():
    run_ranks(_padded_tasp, 4)
