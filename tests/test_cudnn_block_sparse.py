"""cuDNN frontend's block-sparse attention as the registry's "cudnn_block_sparse" kernel, on the CPU stand-in
(tests/fake_cudnn_block_sparse.py: the package's argument checks, the token mask its block lists say, NaN where the
real backward writes nothing): forward with lse and backward from the final out/lse exact against the math kernel in
float64, 64- and 128-token kernel blocks, GQA, empty rows, all-True, padded keys, causal (diagonal blocks on the dense
kernel, merged by lse), ring-step rows; refusals with reasons; the metadata cached; "auto"'s per-call tile order."""
import sys

import pytest
import torch

from megatron_sp_ext.attention import backends, kernels
from megatron_sp_ext.attention.kernels import cudnn_block_sparse as cbs
from megatron_sp_ext.attention.tiles import TileSlice
from tests import fake_cudnn_block_sparse as fake_bsa
from tests import fake_fa4

F64 = torch.float64
NAME = "cudnn_block_sparse"


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


def _case(bs, kind, h, hkv, s, valid=None, q_pos=None, k_pos=None, seed=0, d=16, batch=1):
    g = torch.Generator().manual_seed(seed)
    full = int(max(q_pos.max(), k_pos.max())) + 1 if q_pos is not None else s
    t = -(-full // bs)
    bm = _mask(kind, h, t, g)
    qp = q_pos if q_pos is not None else torch.arange(s)
    kp = k_pos if k_pos is not None else torch.arange(s)
    ts = TileSlice(bm, bs, qp, kp, slice(None), valid, contiguous=q_pos is None)
    q, do = (torch.randn(batch, h, qp.numel(), d, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(batch, hkv, kp.numel(), d, generator=g, dtype=F64) for _ in range(2))
    return ts, q, k, v, do


def _compare(ts, q, k, v, do, causal):
    """out within 1e-9 of math (1e-6 with causal: the diagonal blocks merge by cuDNN's fp32 lse), lse within fp32,
    gradients within 1e-5 (from the fp32 lse)."""
    cb, ref = kernels.get(NAME), kernels.get("math")
    assert cb.why_not(backends.tile_call(q, ts, causal, True)) is None
    o, lse = cb.forward(q, k, v, 0.2, causal, ts)
    grads = cb.backward(do, q, k, v, o, lse, 0.2, causal, ts)
    o_r, lse_r = ref.forward(q, k, v, 0.2, causal, ts)
    grads_r = ref.backward(do, q, k, v, o_r, lse_r, 0.2, causal, ts)
    tol = 1e-6 if causal else 1e-9
    torch.testing.assert_close(o, o_r, rtol=tol, atol=tol)
    live = torch.isfinite(lse_r)
    torch.testing.assert_close(lse[live], lse_r[live].float(), rtol=1e-6, atol=1e-6)
    assert not torch.isfinite(lse[~live]).any()
    for a, b in zip(grads, grads_r):   # the lse cuDNN returns is fp32: gradients from it agree to ~1e-7
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bs", [128, 64, 256])
@pytest.mark.parametrize("kind", ["random", "empty", "window", "all"])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_math(monkeypatch, bs, kind, causal):
    fake = fake_bsa.install(monkeypatch)
    cases = [(4, 2, 512, None, 1), (2, 2, 450, None, 2)] + ([] if causal else [(3, 1, 512, 400, 1)])
    for h, hkv, s, valid, batch in cases:
        ts, q, k, v, do = _case(bs, kind, h, hkv, s, valid, batch=batch)
        _compare(ts, q, k, v, do, causal)
    blocks = {c[1] for c in fake.calls}
    assert blocks == ({64} if bs == 64 else {128}) and {c[0] for c in fake.calls} == {"fwd", "bwd"}


def test_ring_step_rows(monkeypatch):
    """A ring step's rows: queries and keys at other global positions (zigzag pieces of 128), not causal; the causal
    diagonal of a rank's zigzag rows (identical increasing positions); a key piece ending in padding; rows ending in
    a short group (the DiT's last tile)."""
    fake = fake_bsa.install(monkeypatch)
    zig = torch.cat([torch.arange(0, 128), torch.arange(896, 1024)])
    other = torch.cat([torch.arange(384, 512), torch.arange(512, 640)])
    for bs in (128, 64):
        ts, q, k, v, do = _case(bs, "empty", 4, 2, 0, q_pos=zig, k_pos=other)
        _compare(ts, q, k, v, do, False)
        ts, q, k, v, do = _case(bs, "random", 4, 2, 0, q_pos=zig, k_pos=zig)
        _compare(ts, q, k, v, do, True)
        ts, q, k, v, do = _case(bs, "random", 2, 2, 0, valid=1000, q_pos=other, k_pos=zig)
        _compare(ts, q, k, v, do, False)
        short = torch.cat([torch.arange(0, 128), torch.arange(896, 1000)])
        ts, q, k, v, do = _case(bs, "empty", 2, 1, 0, q_pos=short, k_pos=short)
        _compare(ts, q, k, v, do, True)
        ts, q, k, v, do = _case(bs, "random", 2, 1, 0, q_pos=other, k_pos=short)
        _compare(ts, q, k, v, do, False)
    assert {c[1] for c in fake.calls} == {64, 128}


def test_bshd_storage_runs_without_copies_and_bhsd_otherwise(monkeypatch):
    fake = fake_bsa.install(monkeypatch)
    ts, q, k, v, do = _case(128, "random", 4, 4, 512)
    q_s, k_s, v_s, do_s = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, do))  # [B, S, H, D]
    _compare(ts, q_s, k_s, v_s, do_s, False)
    _compare(ts, q, k, v, do, False)
    assert [c[2] for c in fake.calls] == ["bshd", "bshd", "bhsd", "bhsd"]


def test_refusals_name_the_reason_and_auto_moves_on(monkeypatch):
    fake_bsa.install(monkeypatch)
    cb = kernels.get(NAME)
    pos = torch.arange(512)
    q = torch.zeros(1, 2, 512, 32, dtype=torch.bfloat16)
    fine = TileSlice(torch.ones(1, 16, 16, dtype=torch.bool), 32, pos, pos, contiguous=True)
    assert "64- or 128-token" in cb.why_not(backends.tile_call(q, fine, False, True))
    assert backends.get_backend("auto").tile_kernel(q, fine, False, True).name == "math"
    shifted_rows = TileSlice(torch.ones(1, 9, 9, dtype=torch.bool), 64, pos + 32, pos + 32)   # groups cut tiles
    assert "inside one 64-token tile" in cb.why_not(backends.tile_call(q, shifted_rows, False, True))
    ts = TileSlice(torch.ones(1, 4, 4, dtype=torch.bool), 128, pos, pos, contiguous=True)
    assert "block-sparse calls only" in cb.why_not(kernels.KernelCall.of(q, "lse"))
    shifted = TileSlice(torch.ones(1, 8, 8, dtype=torch.bool), 128, pos, pos + 256)
    assert "non-causal" in cb.why_not(backends.tile_call(q, shifted, True, True))
    assert cb.why_not(backends.tile_call(q, shifted, False, True)) is None
    padded = TileSlice(torch.ones(1, 4, 4, dtype=torch.bool), 128, pos, pos, kv_valid_len=500, contiguous=True)
    assert "padded keys" in cb.why_not(backends.tile_call(q, padded, True, True))
    assert "bf16" in cb.why_not(backends.tile_call(q.half(), ts, False, True))
    named = backends.with_tile_kernel("auto", NAME)
    with pytest.raises(Exception, match="tile_setting='cudnn_block_sparse' cannot run here"):
        named.tile_kernel(q, fine, False, True)
    assert named.tile_kernel(q, ts, False, True).name == NAME
    with pytest.raises(Exception, match="backend='cudnn_block_sparse' is invalid"):   # block-sparse only
        backends.get_backend(NAME)
    assert "block-sparse calls only" in cb.why_not(kernels.KernelCall.of(q, "lse"))


def test_not_installed_and_not_a_gpu_are_reasons():
    cb = kernels.get(NAME)
    call = kernels.KernelCall(torch.device("cpu"), torch.bfloat16, 128, frozenset({"tiles", "lse"}))
    reason = cb.why_not(call)
    assert ("not installed" in reason and "nvidia-cudnn-frontend" in reason) if not cbs.installed() \
        else "NVIDIA GPUs" in reason


def test_metadata_is_built_on_the_slice_device_once_and_keyed(monkeypatch):
    fake_bsa.install(monkeypatch)
    pos = torch.arange(512)
    bm = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(3)) < 0.5
    ts = TileSlice(bm, 64, pos, pos, contiguous=True)
    m1 = cbs.block_metadata(ts, 512, 512, False)
    assert m1 is cbs.block_metadata(ts, 512, 512, False)
    m2 = cbs.block_metadata(ts, 512, 512, True)
    assert m2 is not m1 and m2.diag is not None and m1.diag is None
    assert m1.block == 64 and m1.index.dtype == torch.int32 and tuple(m1.index.shape) == (2, 8, 8)
    assert torch.equal(m1.nums, bm.sum(-1).int())
    for r in range(8):   # each query block lists exactly its selected key blocks, ascending, first
        for h in range(2):
            n = int(m1.nums[h, r])
            assert m1.index[h, r, :n].tolist() == torch.nonzero(bm[h, r]).flatten().tolist()
    assert int(m2.nums.sum()) == int(bm.tril(-1).sum()) and torch.equal(m2.diag, bm.diagonal(dim1=1, dim2=2))
    idx, nums, sizes = m1.lists(2, 2, torch.device("cpu"))
    assert idx.shape == (2, 2, 8, 8) and idx.is_contiguous() and sizes is None
    assert m1.lists(2, 2, torch.device("cpu"))[0] is idx and nums.shape == (2, 2, 8)
    m128 = cbs.block_metadata(TileSlice(torch.ones(1, 4, 4, dtype=torch.bool), 128, pos, pos, contiguous=True),
                              512, 512, False)
    assert m128.block == 128


def test_auto_orders_block_sparse_kernels_by_tile_size(monkeypatch):
    """The unmeasured default (kernels.TILE_ORDER): FA4 first at tiles of a multiple of 128 tokens, cuDNN's first at
    other tiles; each falls to the other where the first cannot run the call."""
    fake_fa4.install(monkeypatch)
    fake_bsa.install(monkeypatch)
    be = backends.get_backend("auto")
    pos = torch.arange(512)
    q = torch.zeros(1, 2, 512, 128, dtype=torch.bfloat16)
    t128 = TileSlice(torch.ones(1, 4, 4, dtype=torch.bool), 128, pos, pos, contiguous=True)
    t64 = TileSlice(torch.ones(1, 8, 8, dtype=torch.bool), 64, pos, pos, contiguous=True)
    t32 = TileSlice(torch.ones(1, 16, 16, dtype=torch.bool), 32, pos, pos, contiguous=True)
    assert be.tile_kernel(q, t128, False, True).name == "fa4"
    assert be.tile_kernel(q, t64, False, True).name == NAME
    assert be.tile_kernel(q, t32, False, True).name == "fa4"     # cuDNN's blocks are >= 64 tokens
    assert kernels.auto_order(backends.tile_call(q, t64, False, True))[:2] == (NAME, "fa4")
    assert kernels.auto_order(kernels.KernelCall.of(q, "lse")) == kernels.AUTO
    monkeypatch.setattr(kernels.get("fa4"), "probed", {(str(q.device), q.dtype, False): False})
    assert be.tile_kernel(q, t128, False, True).name == NAME    # FA4's route off here: cuDNN's


def test_fwd_and_bwd_on_a_dense_dtype_the_package_lacks_are_refused_by_the_fake(monkeypatch):
    """The stand-in is strict: an empty list without allow_empty_block_nums, a repeated key block, GQA in the
    backward are errors (so the kernel's calls are shown to avoid them)."""
    fake = fake_bsa.install(monkeypatch)
    q = torch.randn(1, 2, 128, 32, dtype=F64)
    idx = torch.zeros(1, 2, 2, 2, dtype=torch.int32)
    with pytest.raises(AssertionError, match="allow_empty"):
        fake.block_sparse_attention_forward(q, q, q, idx, q2k_block_nums=torch.zeros(1, 2, 2, dtype=torch.int32))
    with pytest.raises(AssertionError, match="twice"):
        fake.block_sparse_attention_forward(q, q, q, idx, q2k_block_nums=torch.full((1, 2, 2), 2, dtype=torch.int32))
    with pytest.raises(AssertionError, match="MHA"):
        fake.block_sparse_attention_backward(q, q, q[:, :1], q[:, :1], q, torch.zeros(1, 2, 128), idx)


@pytest.mark.parametrize("world,tile,masks", [(2, 128, ("random", "window", "all")),
                                              (2, 64, ("random", "window", "all")), (4, 64, ("random",))])
def test_cuda_cudnn_block_sparse_family_dry_run_on_cpu(monkeypatch, world, tile, masks):
    """tests/gpu/cuda_block_sparse.cudnn_block_sparse_family on CPU gloo ranks with the stand-in (tile_setting
    "cudnn_block_sparse" named: every block-sparse call of every mode runs this kernel or fails), one tile size per
    test; P=4: the modes P=2 lacks (tasp, usp C=2, torus tas) on the random per-head mask with an empty row, not
    causal (causal tasp_zigzag needs S = 3072 for whole 64-token blocks: the GPU's size, minutes on this CPU; here
    S = 1536): the records' count, each within the bf16 tolerance against float64."""
    from tests.gpu import cuda_block_sparse as fam
    from tests.harness import run_ranks
    from tests.gpu.suite_judge import verdict
    fake_bsa.install(monkeypatch)
    monkeypatch.setattr(fam, "DEV", "cpu")
    monkeypatch.setattr(fam, "SHRINK", 4)
    monkeypatch.setattr(fam, "TILES", (tile,))
    monkeypatch.setattr(fam, "MASKS", masks)
    monkeypatch.setattr(fam, "HEADS", (4, 2) if world == 2 else (8, 2))   # hcms C=2: 2 heads a rank
    monkeypatch.setattr(fam, "CAUSAL", (False, True) if world == 2 else (False,))
    monkeypatch.setattr(fam, "MODES", None if world == 2 else ("tasp", "usp C=2", "torus tas"))
    for per_rank in run_ranks(fam.cudnn_block_sparse_family, world, timeout=300):
        assert len(per_rank) == {2: 24, 4: 3}[world]
        assert all(f"bs={tile} " in r["case"] and r["family"] == "cudnn_block_sparse" for r in per_rank)
        for r in per_rank:
            assert not verdict(r), (verdict(r), r)


def entry_losses(rank, world, sparse, kernel, sp, mode):
    """(losses, the registry's block-sparse picks) of a short CPU run of the megatron entry (tiny preset, 4x8x8
    tokens after the patch, 64-token tiles 4,4,4) on --sparse-attention-kernel ``kernel``."""
    from training import pretrain_video_dit  # noqa: PLC0415
    kernels.PICKS.clear()
    argv = ["--model", "tiny", "--train-iters", "2", "--frames", "4", "--latent-size", "16x16", "--quiet",
            "--sparse-attention", "tiles", "--sparse-tile", "4,4,4", *sparse, "--sparse-attention-kernel", kernel,
            "--context-parallel-size", str(sp), "--cp-comm-type", mode]
    losses = pretrain_video_dit.main(argv)["losses"]
    return losses, {n: c for (n, what), c in kernels.PICKS.items() if what == "tiles"}


@pytest.mark.parametrize("sparse,sp,mode", [(("--sparse-topk", "2"), 1, "ulysses"),
                                            (("--sparse-window", "0,1,1"), 2, "ring")])
def test_dit_entry_on_the_kernel_gives_the_math_kernels_losses(monkeypatch, sparse, sp, mode):
    """The DiT's --sparse-attention-kernel cudnn_block_sparse (VSA's 64-token tiles) at SP=1 and on the SP=2 ring:
    the losses of the same run on the math kernel (the stand-in computes in fp32 like math)."""
    pytest.importorskip("megatron.core")
    from tests.harness import run_ranks
    fake_bsa.install(monkeypatch)
    got = run_ranks(entry_losses, sp, sparse, NAME, sp, mode)
    ref = run_ranks(entry_losses, sp, sparse, "math", sp, mode)
    for (a, picks), (m, picks_m) in zip(got, ref):
        assert len(a) == 2 and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, m)), (a, m)
        assert set(picks) == {NAME} and set(picks_m) == {"math"}, (picks, picks_m)


def _source_signature(path: str, name: str) -> list:
    """[(argument name, kind, default source)] of function ``name`` in the file ``path``, read without importing it
    (the package's import needs CUDA's Python bindings)."""
    import ast
    tree = ast.parse(open(path).read())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    a = fn.args
    pos = [(x.arg, "pos") for x in a.args]
    pos_defaults = [None] * (len(a.args) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    kw = [(x.arg, "kw") for x in a.kwonlyargs]
    kw_defaults = [ast.unparse(d) if d is not None else None for d in a.kw_defaults]
    return [(n, k, d) for (n, k), d in zip(pos + kw, pos_defaults + kw_defaults)]


def test_the_stand_in_has_the_packages_signatures():
    """Where nvidia-cudnn-frontend is installed (found, not imported), the stand-in's two calls take exactly its
    arguments, kinds and defaults (read from its api.py), so the kernel's calls are the package's."""
    import importlib.util
    import inspect
    import os
    spec = importlib.util.find_spec("cudnn") if cbs.installed() else None
    if spec is None:
        pytest.skip("needs nvidia-cudnn-frontend installed (or its wheel unpacked on PYTHONPATH)")
    api = next(os.path.join(loc, "block_sparse_attention", "api.py") for loc in spec.submodule_search_locations)
    fake = fake_bsa.FakeBSA((), None)
    for name in ("block_sparse_attention_forward", "block_sparse_attention_backward"):
        mine = [(p.name, "kw" if p.kind == p.KEYWORD_ONLY else "pos",
                 None if p.default is p.empty else repr(p.default)) for p in
                inspect.signature(getattr(fake, name)).parameters.values()]
        assert mine == _source_signature(api, name), name


def test_check_tool_on_the_stand_in(monkeypatch):
    """tests/gpu/check_cudnn_block_sparse.py (the GPU's first contact) on the CPU stand-in: its cases run and are right,
    the kernel block named; a wrong dq is reported."""
    import argparse
    from tests.gpu import check_cudnn_block_sparse as tool
    fake = fake_bsa.install(monkeypatch)
    args = argparse.Namespace(cases="0,23,35,36,41", head_dim=16, shrink=4)
    rows = tool.check(args, torch.device("cpu"))
    assert [(r["bs"], r["kind"], r["causal"], r["s"], r["valid"], r["bshd"]) for r in rows] == [
        (128, "random", False, 512, None, False), (64, "random_empty", True, 512, None, False),
        (64, "random_empty", True, 502, None, False), (128, "random", False, 512, 487, False),
        (64, "random_empty", True, 512, None, True)]
    assert not [r for r in rows if tool.wrong(r)], rows
    assert [r["block"] for r in rows] == [128, 64, 64, 128, 64] and rows[1]["dead_rows"] > 0
    real = fake.block_sparse_attention_backward

    def wrong_bwd(*a, **kw):
        res = real(*a, **kw)
        return dict(res, dq_tensor=res["dq_tensor"] * 1.1)
    monkeypatch.setattr(fake, "block_sparse_attention_backward", wrong_bwd)
    monkeypatch.setattr(sys.modules["cudnn.block_sparse_attention"], "block_sparse_attention_backward", wrong_bwd)
    bad = tool.check(argparse.Namespace(cases="0", head_dim=16, shrink=4), torch.device("cpu"))
    assert tool.wrong(bad[0]) and bad[0]["dq"] > 5e-2 and bad[0]["dk"] < 1e-2


@pytest.mark.parametrize("rows", [1, 3])
def test_zero_dead_writes_the_dead_blocks_rows_only_through_a_strided_view(rows):
    """The kernel's outputs are bshd storage seen as bhsd: the dead blocks' rows (of every head for a one-row mask,
    of their head otherwise) become the fill in place, every other element keeps its bits."""
    g = torch.Generator().manual_seed(3)
    live = torch.rand(rows, 5, generator=g) < 0.5
    live[0, 0], live[-1, -1] = False, True
    storage = torch.randn(2, 5 * 4, 3, 8, generator=g)          # [B, S, H, D], 5 blocks of 4 rows
    x = storage.transpose(1, 2)                                   # [B, H, S, D], not contiguous
    before = x.clone()
    assert cbs.zero_dead(x, live, 4, float("-inf")) is x          # a device mask: no list of dead blocks (no sync)
    per_row = live.repeat_interleave(4, dim=1).expand(3, -1)      # [H, S]
    expect = torch.where(per_row[None, :, :, None], before, float("-inf"))
    assert torch.equal(storage.transpose(1, 2), expect)
    lse = torch.randn(2, 3, 20, generator=g)                      # [B, H, S]: the lse's dead rows too
    want = torch.where(per_row[None], lse, float("-inf"))
    assert torch.equal(cbs.zero_dead(lse, live, 4, float("-inf")), want)
    assert torch.equal(cbs.zero_dead(x, torch.ones(rows, 5, dtype=torch.bool), 4), expect)   # all live: untouched


def test_a_package_that_does_not_import_is_a_reason_not_a_crash(monkeypatch):
    """Found on a GPU (2026-11-29): cudnn's frontend installed without its CuTe DSL was picked by "auto" and every call
    failed with "No module named 'cutlass'". A package that is found but does not import is now a reason, so the
    registry picks another kernel and an explicit choice is refused by name."""
    def broken():
        raise ModuleNotFoundError("No module named 'cutlass'")
    monkeypatch.setattr(cbs, "installed", lambda: True)
    monkeypatch.setattr(cbs, "api", broken)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cbs.import_problem.cache_clear()
    try:
        reason = cbs.why_not(torch.device("cuda"), torch.bfloat16, 128)
        assert "does not import" in reason and "cutlass" in reason and "nvidia-cudnn-frontend" in reason
        call = kernels.KernelCall(torch.device("cuda"), torch.bfloat16, 128, frozenset({"tiles", "lse"}))
        assert "does not import" in kernels.get(NAME).why_not(call)
        monkeypatch.setattr(cbs, "api", lambda: object())   # importable: no reason from the import
        cbs.import_problem.cache_clear()
        assert cbs.why_not(torch.device("cuda"), torch.bfloat16, 128) is None
    finally:
        cbs.import_problem.cache_clear()
