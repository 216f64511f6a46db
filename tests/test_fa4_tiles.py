"""FlashAttention-4's block sparsity as the registry's "fa4" kernel, on the CPU stand-in (tests/fake_fa4.py, which
rebuilds the token mask from the block-sparse tensors FA4 would get, forward and transposed backward layouts, and
evaluates the mask_mod's aux tensors): the metadata is exact (float64 against the math kernel), 128-token tiles run as
full blocks, tiles that cut a kernel block (and padded keys) go through the mask_mod, rows finer than 16 tokens are
refused so the registry picks another kernel, and "auto" picks FA4 for block-sparse calls where it runs."""
import pytest
import torch

from megatron_sp_ext.attention import backends, kernels
from megatron_sp_ext.attention.kernels import fa4
from megatron_sp_ext.attention.tiles import TileSlice
from tests import fake_fa4
from tests.harness import run_ranks
from tests.gpu.suite_judge import verdict

F64 = torch.float64


def _mask(kind, h, t, g):
    if kind == "all":
        return torch.ones(1, t, t, dtype=torch.bool)
    if kind == "window":
        i = torch.arange(t)
        return ((i[:, None] - i[None, :]).abs() <= 1)[None]
    m = torch.rand(h, t, t, generator=g) < 0.4
    if kind == "empty":
        m[:, 1] = False
    return m


def _case(bs, kind, causal, h, hkv, s, valid=None, q_pos=None, k_pos=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = int(max(q_pos.max(), k_pos.max())) + 1 if q_pos is not None else s
    t = -(-full // bs)
    bm = _mask(kind, h, t, g)
    qp = q_pos if q_pos is not None else torch.arange(s)
    kp = k_pos if k_pos is not None else torch.arange(s)
    ts = TileSlice(bm, bs, qp, kp, slice(None), valid)
    q, do = (torch.randn(1, h, qp.numel(), 32, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(1, hkv, kp.numel(), 32, generator=g, dtype=F64) for _ in range(2))
    return ts, q, k, v, do


def _compare(ts, q, k, v, do, causal):
    fa, ref = kernels.get("fa4"), kernels.get("math")
    o, lse = fa.forward(q, k, v, 0.2, causal, ts)
    grads = fa.backward(do, q, k, v, o, lse, 0.2, causal, ts)
    o_r, lse_r = ref.forward(q, k, v, 0.2, causal, ts)
    grads_r = ref.backward(do, q, k, v, o_r, lse_r, 0.2, causal, ts)
    torch.testing.assert_close(o, o_r, rtol=1e-9, atol=1e-9)
    live = torch.isfinite(lse_r)
    torch.testing.assert_close(lse[live], lse_r[live].float(), rtol=1e-6, atol=1e-6)
    assert not torch.isfinite(lse[~live]).any()
    for a, b in zip(grads, grads_r):   # the lse FA4 returns is fp32: gradients from it agree to ~1e-7
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bs", [128, 256, 64, 32, 48])
@pytest.mark.parametrize("kind", ["random", "empty", "window", "all"])
@pytest.mark.parametrize("causal", [False, True])
def test_fa4_tiles_match_math(monkeypatch, bs, kind, causal):
    fake = fake_fa4.install(monkeypatch)
    for h, hkv, s, valid in ((4, 2, 512, None), (2, 2, 448, 400), (3, 1, 300, None)):
        ts, q, k, v, do = _case(bs, kind, causal, h, hkv, s, valid)
        _compare(ts, q, k, v, do, causal)
    assert any(c[0] == "sparse_fwd" for c in fake.calls) and any(c[0] == "sparse_bwd" for c in fake.calls)


def test_placed_rows_and_different_query_key_rows(monkeypatch):
    """A ring step's rows: queries and keys at other global positions (zigzag pieces of 128), not causal; and the
    causal diagonal of a rank's zigzag rows (identical increasing positions)."""
    fake_fa4.install(monkeypatch)
    zig = torch.cat([torch.arange(0, 128), torch.arange(896, 1024)])
    other = torch.cat([torch.arange(384, 512), torch.arange(512, 640)])
    for bs in (128, 64):
        ts, q, k, v, do = _case(bs, "random", False, 4, 2, 0, q_pos=zig, k_pos=other)
        _compare(ts, q, k, v, do, False)
        ts, q, k, v, do = _case(bs, "random", True, 4, 2, 0, q_pos=zig, k_pos=zig)
        _compare(ts, q, k, v, do, True)


def test_full_blocks_need_no_mask_mod_and_partial_blocks_do(monkeypatch):
    fake_fa4.install(monkeypatch)
    pos = torch.arange(1024)
    bm = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(0)) < 0.5
    meta = fa4.tile_metadata(TileSlice(bm, 128, pos, pos), 1024, 1024, causal=True)
    assert meta.aux is None and meta.causal_in_kernel          # 128-token tiles: full blocks + FA4's causal diagonal
    assert int(meta.fwd.full_block_cnt.sum() + meta.fwd.mask_block_cnt.sum()) <= int(bm.tril().sum())
    bm64 = torch.rand(2, 16, 16, generator=torch.Generator().manual_seed(1)) < 0.5
    meta = fa4.tile_metadata(TileSlice(bm64, 64, pos, pos), 1024, 1024, causal=False)
    assert meta.aux is not None and not meta.causal_in_kernel  # tiles cut kernel blocks: the mask_mod decides
    meta = fa4.tile_metadata(TileSlice(bm, 128, pos, pos, kv_valid_len=1000), 1024, 1024, causal=False)
    assert meta.aux is not None                                 # padded keys inside a block


def test_registry_picks_fa4_for_tiles_and_refuses_what_it_cannot_run(monkeypatch):
    fake_fa4.install(monkeypatch)
    pos = torch.arange(256)
    q = torch.zeros(1, 2, 256, 32, dtype=torch.bfloat16)
    be = backends.get_backend("auto")
    assert be.tile_kernel(q, TileSlice(torch.ones(1, 2, 2, dtype=torch.bool), 128, pos, pos), False, True).name == "fa4"
    fine = TileSlice(torch.ones(1, 32, 32, dtype=torch.bool), 8, pos, pos)   # 8-token tiles: finer than FA4's rows
    assert kernels.get("fa4").why_not(backends.tile_call(q, fine, False, True)) is not None
    assert be.tile_kernel(q, fine, False, True).name == "math"             # lse needed: math (flex has none)
    with pytest.raises(Exception, match="backend='fa4' cannot run here"):
        backends.get_backend("fa4").tile_kernel(q, fine, False, True)
    with pytest.raises(Exception, match="backend='cudnn' cannot run here.*no block sparsity"):
        backends.get_backend("cudnn").tile_kernel(q, fine, False, True)


def test_failed_probe_turns_the_route_off(monkeypatch):
    """A route whose probe fails (here: the partial route, by a wrong mask_mod evaluation) is refused, and "auto"
    runs the call on another kernel; nothing silently wrong."""
    fake = fake_fa4.install(monkeypatch)
    real = fake._sparse_keep
    monkeypatch.setattr(fake, "_sparse_keep", lambda bst, h, sq, sk, causal, mm, aux, transposed: real(
        bst, h, sq, sk, causal, None, None, transposed) if mm is not None else real(bst, h, sq, sk, causal, mm, aux,
                                                                                     transposed))
    pos = torch.arange(512)
    ts = TileSlice(torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(2)) < 0.5, 64, pos, pos)
    q = torch.zeros(1, 2, 512, 32, dtype=torch.bfloat16)
    assert "mask_mod route" in kernels.get("fa4").why_not(backends.tile_call(q, ts, False, True))
    assert backends.get_backend("auto").tile_kernel(q, ts, False, True).name == "math"


@pytest.mark.parametrize("world", [4])   # every mode (P=2 runs a subset of the same cases)
def test_cuda_fa4_block_sparse_family_dry_run_on_cpu(monkeypatch, world):
    """tests/gpu/cuda_block_sparse.fa4_block_sparse_family on CPU gloo ranks with the FA4 stand-in (backend "fa4" named:
    every block-sparse call of every mode runs FA4's block sparsity, its metadata rebuilt and checked by the fake):
    the records' count, each within the bf16 tolerance against float64."""
    from tests.gpu import cuda_block_sparse as fam
    fake_fa4.install(monkeypatch)
    monkeypatch.setattr(fam, "DEV", "cpu")
    monkeypatch.setattr(fam, "SHRINK", 4)
    for per_rank in run_ranks(fam.fa4_block_sparse_family, world, timeout=600):
        assert len(per_rank) == {2: 40, 4: 70}[world]
        for r in per_rank:
            assert not verdict(r), (verdict(r), r)


def test_a_probe_that_raises_is_tried_once_more_and_its_reason_named(monkeypatch):
    """A probe that raises (2 ranks compiling at once, seen on an H100) gets one more try; a second failure refuses
    the route with the reason in the message."""
    from megatron_sp_ext.attention.kernels import fa4_mask_mod
    fake_fa4.install(monkeypatch)
    calls = []
    real = fa4_mask_mod.probe

    def flaky(kernel, device, dtype, partial):
        calls.append(partial)
        if len(calls) == 1:
            return False, "raised RuntimeError: cache file busy"
        return real(kernel, device, dtype, partial)
    monkeypatch.setattr(fa4_mask_mod, "probe", flaky)
    assert kernels.get("fa4").route_ok(torch.device("cpu"), torch.bfloat16, partial=True) and len(calls) == 2
    monkeypatch.setattr(fa4_mask_mod, "probe", lambda *a: (False, "raised RuntimeError: always"))
    pos = torch.arange(512)
    ts = TileSlice(torch.ones(2, 8, 8, dtype=torch.bool), 64, pos, pos)
    q = torch.zeros(1, 2, 512, 32, dtype=torch.float16)
    assert "RuntimeError: always" in kernels.get("fa4").why_not(backends.tile_call(q, ts, False, True))
