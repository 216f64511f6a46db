"""Ring and TASP attention vs the float64 reference (gloo, CPU), placements, Hamiltonian cycles."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.placement import pieces
from megatron_sp_ext.topology.hamiltonian import routing_tables
from tests.harness import run_ranks
from tests.reference import assert_close, make_qkv, reference_attention
from tests.sp_check import run_case

# (b, units per rank, h, hkv, d); the shard length is units * 2 * rings so every placement fits
SHAPES = [(1, 2, 4, 4, 64), (2, 1, 4, 2, 128), (1, 1, 6, 1, 64)]


def _shard_fn(placement):
    def shard(x, rank, world):
        runs = pieces(placement, rank, world, x.shape[1])
        return torch.cat([x[:, a:a + n] for a, n in runs], dim=1)
    return shard


def _ring_ref(rank, world, variant, dtypes, causals):
    group = dist.group.WORLD
    rings = len(routing_tables(world).cycles) if variant == "tasp" else 1
    n = 0
    for (b, units, h, hkv, d) in SHAPES:
        for dtype in dtypes:
            for causal in causals:
                for layout in ("bshd", "sbhd"):
                    placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
                    s = units * 2 * rings * world * (2 if variant == "ring" else 1)
                    run_case(lambda q, k, v: spx.ring_attention(q, k, v, group, variant=variant, causal=causal,
                                                                placement=spx.balanced_placement(variant, causal),
                                                                layout=layout),
                             rank, world, b=b, s=s, h=h, hkv=hkv, d=d, dtype=dtype, causal=causal, layout=layout,
                             seed=n, shard=_shard_fn(placement))
                    n += 1
    return n


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("variant", ["ring", "tasp"])
def test_ring_fp32_matches_reference(world, variant):
    run_ranks(_ring_ref, world, variant, [torch.float32], [False, True])


@pytest.mark.parametrize("variant", ["ring", "tasp"])
def test_ring_bf16_matches_reference(variant):
    run_ranks(_ring_ref, 4, variant, [torch.bfloat16], [False, True])


def _contiguous_causal(rank, world, variant):
    """Causal with contiguous placement (unbalanced, misaligned runs for tasp): still exact."""
    g = dist.group.WORLD
    run_case(lambda q, k, v: spx.ring_attention(q, k, v, g, variant=variant, causal=True, placement="contiguous"),
             rank, world, b=1, s=7 * world, h=2, hkv=2, d=16, dtype=torch.float32, causal=True)
    return True


@pytest.mark.parametrize("variant", ["ring", "tasp"])
def test_causal_contiguous_placement(variant):
    run_ranks(_contiguous_causal, 4, variant)


def _stale_kv(rank, world, variant):
    """Each rank's K/V differ wildly in scale, so a gradient taken against the wrong (stale) block
    shows up as a large error on that rank's dk/dv shard."""
    g = dist.group.WORLD
    s = 2 * world * 3 * 2
    q, k, v, do = make_qkv(99, 1, s, 2, 2, 16)
    scale = torch.cat([torch.full((s // world,), 1.0 + 3 * r) for r in range(world)]).view(1, s, 1, 1)
    k, v = k * scale, v * (1.0 / scale)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr)
    ref.backward(do.double())
    sl = s // world
    mine = lambda t: t[:, rank * sl:(rank + 1) * sl]  # noqa: E731
    qs, ks, vs = (mine(t).clone().requires_grad_() for t in (q, k, v))
    out = spx.ring_attention(qs, ks, vs, g, variant=variant)
    out.backward(mine(do))
    for name, got, want in (("out", out, ref.detach()), ("dq", qs.grad, qr.grad), ("dk", ks.grad, kr.grad),
                            ("dv", vs.grad, vr.grad)):
        assert_close(f"rank{rank} {variant} {name}", got, mine(want), torch.float32)
    return True


@pytest.mark.parametrize("variant", ["ring", "tasp"])
def test_backward_uses_the_right_kv_block_on_every_rank(variant):
    run_ranks(_stale_kv, 4, variant)


def _placements(rank, world):
    g = dist.group.WORLD
    for placement in ("contiguous", "zigzag", "tasp_zigzag"):
        s = 2 * world * max(1, len(routing_tables(world).cycles)) * 2
        x = torch.arange(2 * s * 3, dtype=torch.float32).view(2, s, 3)
        shard = spx.shard_sequence(x, g, placement=placement)
        back = spx.unshard_sequence(shard, g, placement=placement)
        assert torch.equal(back, x), placement
        xs = x.transpose(0, 1).contiguous()
        assert torch.equal(spx.unshard_sequence(spx.shard_sequence(xs, g, placement=placement, seq_dim=0), g,
                                                placement=placement, seq_dim=0), xs)
    try:
        spx.shard_sequence(torch.zeros(1, 2 * world + 1, 1), g, placement="zigzag")
    except SPConfigError as e:
        assert "not divisible by" in str(e) and "zigzag" in str(e)
    else:
        raise AssertionError("no error for an indivisible sequence")
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_unshard_roundtrip(world):
    run_ranks(_placements, world)


def _megatron_zigzag(rank, world):
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state as ps
    from megatron_sp_ext.megatron.compat import cp_rank_batch as get_batch_on_this_cp_rank
    ps.initialize_model_parallel(context_parallel_size=world)
    try:
        s = 4 * world
        batch = {"tokens": torch.arange(2 * s).view(2, s), "labels": torch.arange(2 * s).view(2, s) + 100}
        mine = get_batch_on_this_cp_rank(dict(batch))
        ours = spx.shard_sequence(batch["tokens"], dist.group.WORLD, placement="zigzag")
        assert torch.equal(mine["tokens"], ours), (mine["tokens"], ours)
    finally:
        ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_equals_megatron_split(world):
    run_ranks(_megatron_zigzag, world)


def test_bad_variant():
    with pytest.raises(SPConfigError, match="variant='x'"):
        spx.ring_attention(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), None,
                           variant="x")
