"""Block-sparse attention (block_mask / block_size) in the sequence-parallel modes vs a float64 masked reference.

The reference here builds its token mask on its own (tile of each position, AND causal) and runs an explicit
softmax in float64 on one device; every rank compares its shard of out, dq, dk, dv. gloo, CPU.
"""
import math

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.attention import block_sparse as bsp
from megatron_sp_ext.attention.backends import LocalAttention, get_backend, wrap_callable
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.factory import SPResources, make_attention
from megatron_sp_ext.sp.placement import positions
from megatron_sp_ext.topology.hamiltonian import routing_tables
from tests.harness import run_ranks
from tests.reference import make_qkv, rel_err
from tests.gpu.suite_judge import verdict

TOL64 = 1e-10


# ----------------------------------------------------------------------------------------------- masks, reference
def random_mask(seed: int, heads: int, t: int, keep: float = 0.35) -> torch.Tensor:
    """[heads, t, t] random tiles (~1-keep sparse), with query-tile row 1 empty for every head."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(heads, t, t, generator=g) < keep
    m[:, 1] = False
    return m


def window_mask(t: int, radius: int = 1) -> torch.Tensor:
    """[1, t, t] 1D window (band): query tile i attends key tiles |i - j| <= radius."""
    i = torch.arange(t)
    return ((i.view(-1, 1) - i.view(1, -1)).abs() <= radius).unsqueeze(0)


def keep_tokens(block_mask: torch.Tensor, s: int, bs: int, causal: bool) -> torch.Tensor:
    """[H or 1, S, S] token keep mask, built element by element from the definition."""
    tile = torch.arange(s) // bs
    keep = block_mask[:, tile][:, :, tile]
    if causal:
        keep = keep & torch.ones(s, s, dtype=torch.bool).tril()
    return keep


def masked_reference(q, k, v, keep_hss, scale=None):
    """float64 attention [B, S, H, D] under keep [H or 1, S, S]; rows without a kept key give 0 (and 0 grads)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * scale
    any_row = keep.any(-1, keepdim=True) if (keep := keep_hss.unsqueeze(0)) is not None else None
    s = torch.where(any_row, s.masked_fill(~keep, float("-inf")), torch.zeros_like(s))
    p = torch.softmax(s, dim=-1) * keep
    return (p @ v).transpose(1, 2)


def check_case(fn, rank, world, *, s, h, hkv, d, bs, block_mask, causal, placement="contiguous",
               dtype=torch.float64, seed=0, tol=TOL64, kv_valid_len=None, b=1):
    """fn(q, k, v) on this rank's shards (``placement``) vs the float64 masked reference: out, dq, dk, dv.
    kv_valid_len: keys at positions >= it are masked out in the reference too."""
    q, k, v, do = make_qkv(seed, b, s, h, hkv, d, torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    keep = keep_tokens(block_mask, s, bs, causal)
    if kv_valid_len is not None:
        keep = keep & (torch.arange(s) < kv_valid_len)
    ref = masked_reference(qr, kr, vr, keep)
    ref.backward(do)
    pos = positions(placement, rank, world, s)
    mine = [t[:, pos].to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*mine)
    out.backward(do[:, pos].to(dtype))
    errs = {"out": rel_err(out, ref[:, pos]), "dq": rel_err(mine[0].grad, qr.grad[:, pos]),
            "dk": rel_err(mine[1].grad, kr.grad[:, pos]), "dv": rel_err(mine[2].grad, vr.grad[:, pos])}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"rank {rank}: {bad} > {tol} (s={s}, h={h}/{hkv}, bs={bs}, causal={causal}, {placement})"
    return out.detach(), [t.grad for t in mine]


def _shape(world):
    """(S, block_size): S a multiple of 2P (zigzag), never of block_size (a partial last tile)."""
    s = 2 * world * 7
    return s, {2: 9, 3: 9, 4: 9}.get(world, 9)


# ------------------------------------------------------------------------------------------------------- unit
def test_check_tile_mask_names_the_setting():
    ok = torch.ones(1, 3, 3, dtype=torch.bool)
    assert bsp.check_tile_mask(ok, seq_len=20, block_size=8, num_heads=4) is not None
    with pytest.raises(SPConfigError, match=r"block_mask must be a bool tensor \[1 or 4, 3, 3\].*shape \[1, 2, 2\]"):
        bsp.check_tile_mask(ok[:, :2, :2], seq_len=20, block_size=8, num_heads=4)
    with pytest.raises(SPConfigError, match="block_mask.*dtype torch.int64"):
        bsp.check_tile_mask(ok.long(), seq_len=20, block_size=8, num_heads=4)
    with pytest.raises(SPConfigError, match=r"block_mask.*\[2, 3, 3\]"):
        bsp.check_tile_mask(ok.expand(2, 3, 3), seq_len=20, block_size=8, num_heads=4)
    with pytest.raises(SPConfigError, match="block_size=0"):
        bsp.check_tile_mask(ok, seq_len=20, block_size=0, num_heads=4)
    with pytest.raises(SPConfigError, match=r"tile=0 is invalid"):   # the public word (#85); block_size still taken
        bsp.check_tile_mask(ok, seq_len=20, tile=0, num_heads=4)
    with pytest.raises(SPConfigError, match=r"ceil\(S/tile\).*S=20, tile=8; got shape \[1, 2, 2\]"):
        bsp.check_tile_mask(ok[:, :2, :2], seq_len=20, tile=8, num_heads=4)
    with pytest.raises(SPConfigError, match="kernel='flex' cannot run here"):
        bsp.resolve_kernel("flex", torch.device("cpu"))


def test_pair_selected_matches_token_mask():
    s, bs = 45, 7
    t = bsp.num_tiles(s, bs)
    for seed in range(6):
        bm = random_mask(seed, 2, t, keep=0.15)
        g = torch.Generator().manual_seed(seed)
        for _ in range(10):
            qp, kp = torch.randperm(s, generator=g)[:9], torch.randperm(s, generator=g)[:9]
            for causal in (False, True):
                dense = bool(bsp.token_mask(bm, qp, kp, bs, causal=causal).any())
                assert bsp.pair_selected(bm, qp, kp, bs, causal=causal) == dense


def test_local_kernel_matches_reference():
    s, bs, h, hkv, d = 45, 7, 4, 2, 8
    bm = random_mask(3, h, bsp.num_tiles(s, bs))
    for causal in (False, True):
        q, k, v, do = make_qkv(1, 1, s, h, hkv, d, torch.float64)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = masked_reference(qr, kr, vr, keep_tokens(bm, s, bs, causal))
        ref.backward(do)
        qb, kb, vb = (t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
        out = bsp.block_sparse_attention(qb, kb, vb, bm, block_size=bs, causal=causal, kernel="math")
        out.backward(do.transpose(1, 2))
        assert rel_err(out.transpose(1, 2), ref) < TOL64
        for mine, r in ((qb, qr), (kb, kr), (vb, vr)):
            assert rel_err(mine.grad.transpose(1, 2), r.grad) < TOL64
        # rows of query tile 1 (empty) give zeros and zero dq
        assert out[:, :, bs:2 * bs].abs().max() == 0 and qb.grad[:, :, bs:2 * bs].abs().max() == 0


def test_flex_mask_mod_matches_math_forward():
    """The flex path's mask_mod (eager flex_attention, forward only: its CPU mode) against the math kernel."""
    s, bs, h, hkv, d = 45, 7, 4, 2, 8
    bm = random_mask(5, h, bsp.num_tiles(s, bs))
    q, k, v, _ = make_qkv(2, 1, s, h, hkv, d, torch.float64)
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    pos = torch.arange(s)
    for causal in (False, True):
        fm = bsp.flex_mask(bm, pos, pos, bs, causal=causal)
        with torch.no_grad():
            of, lf = bsp.flex_attention_masked(qb, kb, vb, fm, d ** -0.5, compiled=False)
        om, lm = bsp.math_forward(qb, kb, vb, bsp.token_mask(bm, pos, pos, bs, causal=causal), d ** -0.5)
        assert rel_err(of, om) < TOL64
        assert torch.equal(torch.isneginf(lf), torch.isneginf(lm))


# ---------------------------------------------------------------------------------------------------- Ulysses
def _ulysses(rank, world, hkv, causal, placement, chunks):
    g = dist.group.WORLD
    s, bs = _shape(world)
    t = bsp.num_tiles(s, bs)
    for n, bm in enumerate((random_mask(7 + world, 4, t), window_mask(t))):
        check_case(lambda q, k, v: spx.ulysses_attention(q, k, v, g, causal=causal, placement=placement,
                                                         head_chunks=chunks, block_mask=bm, block_size=bs),
                   rank, world, s=s, h=4, hkv=hkv, d=8, bs=bs, block_mask=bm, causal=causal, placement=placement,
                   seed=n)
    return True


@pytest.mark.parametrize("world,hkv,causal,placement,chunks", [
    (2, 2, False, "contiguous", "auto"), (2, 4, True, "zigzag", 2), (3, 2, True, "contiguous", 1),
    (4, 2, False, "zigzag", 1), (4, 4, True, "contiguous", 1)])
def test_ulysses_block_mask_matches_reference(world, hkv, causal, placement, chunks):
    run_ranks(_ulysses, world, hkv, causal, placement, chunks)


# ------------------------------------------------------------------------------------------------------- ring
def _ring(rank, world, hkv, causal, placement, layout):
    g = dist.group.WORLD
    s, bs = _shape(world)
    t = bsp.num_tiles(s, bs)
    for n, bm in enumerate((random_mask(11 + world, 4, t), window_mask(t))):
        def fn(q, k, v):
            if layout == "sbhd":
                q, k, v = (x.transpose(0, 1) for x in (q, k, v))
            o = spx.ring_attention(q, k, v, g, causal=causal, placement=placement, layout=layout, block_mask=bm,
                                   block_size=bs)
            return o.transpose(0, 1) if layout == "sbhd" else o
        check_case(fn, rank, world, s=s, h=4, hkv=hkv, d=8, bs=bs, block_mask=bm, causal=causal,
                   placement=placement, seed=n)
    return True


@pytest.mark.parametrize("world,hkv,causal,placement,layout", [
    (2, 2, False, "contiguous", "bshd"), (2, 4, True, "zigzag", "sbhd"), (3, 2, True, "contiguous", "bshd"),
    (3, 4, False, "zigzag", "bshd"), (4, 2, True, "zigzag", "bshd"), (4, 4, False, "contiguous", "bshd")])
def test_ring_block_mask_matches_reference(world, hkv, causal, placement, layout):
    run_ranks(_ring, world, hkv, causal, placement, layout)


def _ring_tasp_zigzag(rank, world):
    """variant "ring" on shards in the tasp_zigzag placement (positions from placement.py)."""
    g = dist.group.WORLD
    s, bs = 2 * world * 2 * 3, 5  # tasp_zigzag needs 2 * P * rings; 3 ranks: 2 rings
    bm = random_mask(4, 1, bsp.num_tiles(s, bs), keep=0.4)
    check_case(lambda q, k, v: spx.ring_attention(q, k, v, g, causal=True, placement="tasp_zigzag",
                                                  block_mask=bm, block_size=bs),
               rank, world, s=s, h=4, hkv=2, d=8, bs=bs, block_mask=bm, causal=True, placement="tasp_zigzag")
    return True


def test_ring_block_mask_tasp_zigzag_placement():
    run_ranks(_ring_tasp_zigzag, 3)


def _tasp(rank, world, causal, placement):
    """variant "tasp" (one K|V slot per Hamiltonian cycle) under a block mask, and the factory's mode tasp."""
    g = dist.group.WORLD
    rings = len(routing_tables(world).cycles)
    s, bs = 2 * world * rings * 5, 7
    t = bsp.num_tiles(s, bs)
    for n, bm in enumerate((random_mask(29 + world, 4, t), window_mask(t))):
        check_case(lambda q, k, v: spx.ring_attention(q, k, v, g, variant="tasp", causal=causal, placement=placement,
                                                      block_mask=bm, block_size=bs),
                   rank, world, s=s, h=4, hkv=2, d=8, bs=bs, block_mask=bm, causal=causal, placement=placement,
                   seed=n)
    cfg = SPConfig(mode="tasp")
    attn = make_attention(cfg, g, num_heads=4, num_kv_heads=2, placement=placement, resources=SPResources(cfg))
    bm = window_mask(t)
    check_case(lambda q, k, v: attn(q, k, v, causal=causal, block_mask=bm, block_size=bs), rank, world, s=s, h=4,
               hkv=2, d=8, bs=bs, block_mask=bm, causal=causal, placement=placement, seed=7)
    from megatron_sp_ext.sp.ring import sparse_ring_plan
    plan = sparse_ring_plan(bm, world=world, seq_len=s, block_size=bs, placement=placement, causal=causal,
                            variant="tasp", kv_bytes=1000)
    return plan.counts(rank), rings


@pytest.mark.parametrize("world,causal,placement", [(3, True, "tasp_zigzag"), (3, False, "contiguous"),
                                                    (4, True, "zigzag"), (4, False, "tasp_zigzag")])
def test_tasp_block_mask_matches_reference(world, causal, placement):
    res = run_ranks(_tasp, world, causal, placement)
    for counts, rings in res:
        assert counts["steps_run"] + counts["steps_skipped"] == world * rings
        assert counts["bytes_sent"] + counts["bytes_skipped"] == 1000 * (world - 1)
    # a window of one tile each side over 2 * P * rings * 5 tokens: some (step, slot) blocks are skipped
    assert sum(c["steps_skipped"] for c, _ in res) > 0


def _skips(rank, world, causal):
    """Banded mask, contiguous, P=4, S=64, 8-token tiles: each rank holds 2 tiles, the band reaches its
    neighbours only. Counts what the ring actually ran (the local backend's kernel calls) and sent (p2p ops) and
    checks the output."""
    import megatron_sp_ext.sp.ring.sparse as sparse_mod
    g = dist.group.WORLD
    s, bs, d = 64, 8, 8
    bm = window_mask(8, 1)
    calls, sent = {"fwd": 0, "bwd": 0}, {"kv": 0, "bytes": 0}
    batch = dist.batch_isend_irecv
    inner = get_backend("sdpa")

    class Counting(LocalAttention):
        name = "counting"

        def forward_lse(self, *a, **kw):
            calls["fwd"] += 1
            return inner.forward_lse(*a, **kw)

        def backward_lse(self, *a, **kw):
            calls["bwd"] += 1
            return inner.backward_lse(*a, **kw)

    def count_batch(ops):
        for op in ops:
            if op.op is dist.isend:
                sent["kv"] += 1
                sent["bytes"] += op.tensor.numel() * op.tensor.element_size()
        return batch(ops)
    dist.batch_isend_irecv = count_batch
    try:
        check_case(lambda q, k, v: spx.ring_attention(q, k, v, g, causal=causal, block_mask=bm, block_size=bs,
                                                      backend=Counting()),
                   rank, world, s=s, h=2, hkv=2, d=d, bs=bs, block_mask=bm, causal=causal)
    finally:
        dist.batch_isend_irecv = batch
    block = 2 * 1 * 2 * (s // world) * d * 8  # k and v, fp64
    plan = sparse_mod.sparse_ring_plan(bm, world=world, seq_len=s, block_size=bs, placement="contiguous",
                                       causal=causal, kv_bytes=block)
    return plan.counts(rank), calls, sent, block


@pytest.mark.parametrize("causal", [False, True])
def test_ring_skips_steps_and_transfers_of_a_banded_mask(causal):
    res = run_ranks(_skips, 4, causal)
    counts = [r[0] for r in res]
    # non-causal: rank r needs blocks r-1, r, r+1 (no wrap): runs 2, 3, 3, 2 of 4 steps; block 0 hops once (rank 1
    # is the only later rank that needs it), blocks 1, 2, 3 hop 3 times: 10 of 12 K|V hops.
    # causal: rank r needs r-1 and r; blocks 0, 1, 2 hop once (to r+1), block 3 never: 3 of 12 hops.
    runs = [1, 2, 2, 2] if causal else [2, 3, 3, 2]
    sends = [1, 1, 1, 0] if causal else [3, 2, 2, 3]
    assert [c["steps_run"] for c in counts] == runs
    assert [c["steps_skipped"] for c in counts] == [4 - n for n in runs]
    block = res[0][3]
    assert [c["bytes_sent"] for c in counts] == [n * block for n in sends]
    assert [c["bytes_skipped"] for c in counts] == [(3 - n) * block for n in sends]
    for rank, (c, calls, sent, _) in enumerate(res):
        assert calls == {"fwd": runs[rank], "bwd": runs[rank]}, (rank, calls)
        # what went out: forward and backward K|V hops (2 x sends) + one dK|dV partial per run step beyond step 0
        assert sent["kv"] == 2 * sends[rank] + runs[rank] - 1, (rank, sent)
        assert sent["bytes"] == (2 * sends[rank] + runs[rank] - 1) * block
        assert c["dkv_bytes_sent"] == (runs[rank] - 1) * block


# ---------------------------------------------------------------------------------------------- factory, edges
def _factory(rank, world):
    """SPAttention(...)(q, k, v, causal=, block_mask=, block_size=) for every mode that takes it (auto resolves to
    hcms here and stays there), placement zigzag, causal and not."""
    g = dist.group.WORLD
    s, bs = _shape(world)
    bm = random_mask(21, 4, bsp.num_tiles(s, bs), keep=0.5)
    n = 0
    for mode in ("ulysses", "hcms", "ring", "usp", "auto"):
        cfg = SPConfig(mode=mode, head_chunks=2 if mode == "hcms" else 1)
        attn = make_attention(cfg, g, num_heads=4, num_kv_heads=2, placement="zigzag", resources=SPResources(cfg))
        for causal in (False, True):
            check_case(lambda q, k, v: attn(q, k, v, causal=causal, block_mask=bm, block_size=bs), rank, world,
                       s=s, h=4, hkv=2, d=8, bs=bs, block_mask=bm, causal=causal, placement="zigzag", seed=n)
            n += 1
    return n


def test_factory_modes_take_block_mask():
    assert run_ranks(_factory, 2) == [10, 10]


def _refusals(rank, world):
    g = dist.group.WORLD
    s, bs = 16, 4
    bm = torch.ones(1, 4, 4, dtype=torch.bool)
    q = torch.randn(1, s // world, 4, 8, dtype=torch.float64)
    mesh = spx.build_sp_mesh(g, num_heads=4)
    cases = [
        ("variant='ring3' is invalid", lambda: spx.hybrid_attention(q, q, q, mesh, block_mask=bm, block_size=bs,
                                                                     ring_variant="ring3")),
        ("cu_seqlens", lambda: spx.ulysses_attention(q, q, q, g, block_mask=bm, block_size=bs,
                                                      cu_seqlens=torch.tensor([0, 8, 16]))),
        ("cu_seqlens", lambda: spx.ring_attention(q, q, q, g, block_mask=bm, block_size=bs,
                                                   cu_seqlens=torch.tensor([0, 8, 16]))),
        ("dropout_p", lambda: spx.ulysses_attention(q, q, q, g, block_mask=bm, block_size=bs, dropout_p=0.1)),
        (r"block_mask must be a bool tensor \[1 or 4, 2, 2\]",
         lambda: spx.ulysses_attention(q, q, q, g, block_mask=bm, block_size=8)),
        ("block_size=0", lambda: spx.ring_attention(q, q, q, g, block_mask=bm, block_size=0)),
        ("not backend='user'", lambda: spx.ulysses_attention(q, q, q, g, block_mask=bm, block_size=bs,
                                                              backend=wrap_callable(lambda *a, **kw: None, "user"))),
    ]
    for pattern, call in cases:
        with pytest.raises(SPConfigError, match=pattern):
            call()
    return len(cases)


def test_refusals_name_the_setting():
    assert run_ranks(_refusals, 2) == [7, 7]


def _all_true_all_false(rank, world):
    """All-True equals block_mask=None bit for bit where the same kernel runs (Ulysses on backend "math": its
    dense call and the block path both run blockwise.math_forward / math_backward; the ring's dense path runs other
    kernels: compared to 1e-10); all-False gives zeros and zero gradients in every mode."""
    g = dist.group.WORLD
    s, bs = 2 * world * 7, 9
    t = bsp.num_tiles(s, bs)
    ones, zeros = torch.ones(1, t, t, dtype=torch.bool), torch.zeros(4, t, t, dtype=torch.bool)
    q, k, v, do = make_qkv(3, 1, s, 4, 2, 8, torch.float64)
    pos = positions("contiguous", rank, world, s)

    def run(fn):
        mine = [x[:, pos].clone().requires_grad_() for x in (q, k, v)]
        out = fn(*mine)
        out.backward(do[:, pos])
        return [out.detach()] + [x.grad for x in mine]
    for causal in (False, True):
        uly = lambda bm: lambda a, b, c: spx.ulysses_attention(a, b, c, g, causal=causal, backend="math",  # noqa: E731
                                                               block_mask=bm, block_size=bs)
        ring = lambda bm: lambda a, b, c: spx.ring_attention(a, b, c, g, causal=causal, block_mask=bm,  # noqa: E731
                                                             block_size=bs)
        dense, masked = run(uly(None)), run(uly(ones))
        assert all(torch.equal(a, b) for a, b in zip(dense, masked)), "ulysses all-True != dense (math)"
        dense, masked = run(ring(None)), run(ring(ones))
        assert all(rel_err(b, a) < TOL64 for a, b in zip(dense, masked)), "ring all-True != dense"
        for fn in (uly(zeros), ring(zeros)):
            assert all(x.abs().max() == 0 for x in run(fn)), "all-False mask: nonzero output or gradient"
    return True


def test_all_true_equals_dense_and_all_false_gives_zeros():
    run_ranks(_all_true_all_false, 2)


def _bf16(rank, world):
    g = dist.group.WORLD
    s, bs = _shape(world)
    bm = random_mask(31, 1, bsp.num_tiles(s, bs), keep=0.6)
    for fn in (lambda q, k, v: spx.ulysses_attention(q, k, v, g, causal=True, block_mask=bm, block_size=bs),
               lambda q, k, v: spx.ring_attention(q, k, v, g, causal=True, block_mask=bm, block_size=bs)):
        check_case(fn, rank, world, s=s, h=4, hkv=2, d=8, bs=bs, block_mask=bm, causal=True,
                   dtype=torch.bfloat16, tol=3e-2)
    return True


def test_bf16_matches_reference():
    run_ranks(_bf16, 2)


def test_cuda_family_dry_run_on_cpu(monkeypatch):
    """tests/gpu/cuda_block_sparse.block_sparse_family on 4 CPU gloo ranks (SPX_SUITE_DEVICE=cpu, SPX_SUITE_SHRINK=16):
    its 34 records, each within tolerance (the Ulysses cases run the math kernel here)."""
    from tests.gpu import cuda_block_sparse as fam
    monkeypatch.setattr(fam, "DEV", "cpu")
    monkeypatch.setattr(fam, "SHRINK", 16)
    for per_rank in run_ranks(fam.block_sparse_family, 4):
        assert len(per_rank) == 34
        assert sum("kernel=math" in r["case"] for r in per_rank) == 34
        for r in per_rank:
            assert not verdict(r), (verdict(r), r)


# ------------------------------------------------------------------------------------------------------ hybrid
def _hybrid(rank, world, ulysses_size, causal, placement, chunks, variant):
    g = dist.group.WORLD
    s, bs = _shape(world)
    t = bsp.num_tiles(s, bs)
    mesh = spx.build_sp_mesh(g, num_heads=4, ulysses_size=ulysses_size)
    for n, bm in enumerate((random_mask(17 + world, 4, t), window_mask(t))):
        check_case(lambda q, k, v: spx.hybrid_attention(q, k, v, mesh, causal=causal, placement=placement,
                                                        head_chunks=chunks, ring_variant=variant, block_mask=bm,
                                                        block_size=bs),
                   rank, world, s=s, h=4, hkv=2, d=8, bs=bs, block_mask=bm, causal=causal, placement=placement,
                   seed=n)
    return True


@pytest.mark.parametrize("world,ulysses_size,causal,placement,chunks,variant", [
    (4, 2, True, "zigzag", 2, "ring"), (4, 2, False, "contiguous", 1, "ring"), (2, 1, True, "zigzag", 1, "ring"),
    (2, 2, False, "zigzag", 1, "ring"), (3, 1, True, "zigzag", 1, "tasp")])
def test_hybrid_block_mask_matches_reference(world, ulysses_size, causal, placement, chunks, variant):
    run_ranks(_hybrid, world, ulysses_size, causal, placement, chunks, variant)


# ------------------------------------------------------------------------------------------------ kv_valid_len
def _kv_valid(rank, world):
    """kv_valid_len ANDs with the block mask in Ulysses, the ring and the hybrid (keys past it: never attended)."""
    g = dist.group.WORLD
    s, bs = _shape(world)
    valid = s - 11
    bm = random_mask(41, 4, bsp.num_tiles(s, bs), keep=0.5)
    mesh = spx.build_sp_mesh(g, num_heads=4, ulysses_size=1)
    n = 0
    for causal in (False, True):
        for fn in (lambda q, k, v: spx.ulysses_attention(q, k, v, g, causal=causal, placement="zigzag",
                                                         kv_valid_len=valid, block_mask=bm, block_size=bs),
                   lambda q, k, v: spx.ring_attention(q, k, v, g, causal=causal, placement="zigzag",
                                                      kv_valid_len=valid, block_mask=bm, block_size=bs),
                   lambda q, k, v: spx.hybrid_attention(q, k, v, mesh, causal=causal, placement="zigzag",
                                                        kv_valid_len=valid, block_mask=bm, block_size=bs)):
            check_case(fn, rank, world, s=s, h=4, hkv=2, d=8, bs=bs, block_mask=bm, causal=causal,
                       placement="zigzag", seed=n, kv_valid_len=valid)
            n += 1
    return n


def test_kv_valid_len_ands_with_block_mask():
    assert run_ranks(_kv_valid, 2) == [6, 6]


def _batch2(rank, world):
    """B = 2 (the exchange's non-per-piece path), Ulysses in sbhd and the ring in bshd, causal zigzag; and the same
    calls under no_grad."""
    g = dist.group.WORLD
    s, bs = _shape(world)
    bm = random_mask(43, 4, bsp.num_tiles(s, bs), keep=0.5)

    def uly_sbhd(q, k, v):
        o = spx.ulysses_attention(*(x.transpose(0, 1) for x in (q, k, v)), g, causal=True, placement="zigzag",
                                  layout="sbhd", head_chunks=2, block_mask=bm, block_size=bs)
        return o.transpose(0, 1)
    for n, fn in enumerate((uly_sbhd, lambda q, k, v: spx.ring_attention(q, k, v, g, causal=True, placement="zigzag",
                                                                         block_mask=bm, block_size=bs))):
        out, _ = check_case(fn, rank, world, s=s, h=4, hkv=2, d=8, bs=bs, block_mask=bm, causal=True,
                            placement="zigzag", seed=n, b=2)
        q, k, v, _ = make_qkv(n, 2, s, 4, 2, 8, torch.float64)
        pos = positions("zigzag", rank, world, s)
        with torch.no_grad():  # inference: nothing kept, same output
            assert torch.equal(fn(q[:, pos], k[:, pos], v[:, pos]), out)
    return True


def test_batch_of_two():
    run_ranks(_batch2, 2)


# ------------------------------------------------------------------------------------------------------- torus
def _torus(rank, world, causal, placement, variant):
    g = dist.group.WORLD
    s, bs = _shape(world)
    t = bsp.num_tiles(s, bs)
    mesh = spx.build_sp_mesh(g, num_heads=4, nodes=2)
    for n, bm in enumerate((random_mask(19 + world, 4, t), window_mask(t))):
        check_case(lambda q, k, v: spx.torus_attention(q, k, v, mesh, causal=causal, placement=placement,
                                                       ring_variant=variant, block_mask=bm, block_size=bs),
                   rank, world, s=s, h=4, hkv=2, d=8, bs=bs, block_mask=bm, causal=causal, placement=placement,
                   seed=n)
    cfg = SPConfig(mode="torus", nodes=2)
    attn = make_attention(cfg, g, num_heads=4, num_kv_heads=2, placement=placement, resources=SPResources(cfg))
    bm = random_mask(23, 4, t)
    check_case(lambda q, k, v: attn(q, k, v, causal=causal, block_mask=bm, block_size=bs), rank, world, s=s, h=4,
               hkv=2, d=8, bs=bs, block_mask=bm, causal=causal, placement=placement, seed=5)
    return True


@pytest.mark.parametrize("world,causal,placement,variant", [(4, True, "zigzag", "ring"), (2, False, "contiguous", "ring"),
                                                            (4, False, "contiguous", "tasp")])
def test_torus_block_mask_matches_reference(world, causal, placement, variant):
    run_ranks(_torus, world, causal, placement, variant)


def _one_rank(rank, world):
    g = dist.group.WORLD
    s, bs = 23, 5
    bm = random_mask(47, 4, bsp.num_tiles(s, bs), keep=0.5)
    for causal in (False, True):
        for fn in (lambda q, k, v: spx.ulysses_attention(q, k, v, g, causal=causal, block_mask=bm, block_size=bs),
                   lambda q, k, v: spx.ring_attention(q, k, v, g, causal=causal, block_mask=bm, block_size=bs)):
            check_case(fn, rank, world, s=s, h=4, hkv=2, d=8, bs=bs, block_mask=bm, causal=causal)
    return True


def test_one_rank():
    run_ranks(_one_rank, 1)
