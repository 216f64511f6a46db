"""#85: the block-sparse kernels' metadata is built from the mask on its device without reading it on the host.

1. Equal to a host-built reference: FA4's block lists (forward and transposed backward layouts, full vs partial
   blocks, the mask_mod's aux tensors) and cuDNN's (key-block lists per query block, valid keys per key block, live
   and causal-diagonal blocks), each rebuilt here block by block from the token-level tile selection with Python
   loops: random and window masks, one mask row or one per head, causal or not, padded keys or not, whole-sequence
   rows and a ring step's placed rows.
2. Never read on the host: the same builds with the mask on the ``meta`` device (no values: ``.item()``,
   ``bool(t)``, ``nonzero``, ``.tolist()`` or a copy to the host would raise), the CPU's stand-in for
   ``torch.cuda.set_sync_debug_mode("error")`` (tests/gpu/cuda_tile_sync.py runs that one on a GPU).
3. Slices live on their problem: one whole-sequence slice (and its metadata) per AttentionProblem, a new one for a
   derived problem (a layer's top-k mask), none kept in a module cache.
"""
import pytest
import torch

from megatron_sp_ext.attention import block_sparse as bsp
from megatron_sp_ext.attention import tiles
from megatron_sp_ext.attention.kernels import cudnn_block_sparse as cbs
from megatron_sp_ext.attention.kernels import fa4
from megatron_sp_ext.attention.kernels.math import MathKernel
from megatron_sp_ext.attention.tiles import TileSlice
from tests import fake_fa4

KB = fa4.KERNEL_BLOCK


def _mask(kind: str, heads: int, t: int, seed: int) -> torch.Tensor:
    if kind == "window":
        i = torch.arange(t)
        return ((i[:, None] - i[None, :]).abs() <= 1)[None].expand(heads, t, t).clone()
    m = torch.rand(heads, t, t, generator=torch.Generator().manual_seed(seed)) < 0.4
    m[:, 1] = False   # a query tile that selects nothing
    return m


def _slice(kind, heads, tile, s, valid, placed, seed=0):
    """A whole-sequence slice (rows 0..s-1), or ``placed``: a ring step's rows (zigzag query pieces, other keys)."""
    if not placed:
        bm = _mask(kind, heads, -(-s // tile), seed)
        return tiles.full_sequence_slice(bm, tile, s, valid)
    q_pos = torch.cat([torch.arange(0, 256), torch.arange(768, 1024)])
    k_pos = torch.cat([torch.arange(256, 512), torch.arange(512, 768)])
    return TileSlice(_mask(kind, heads, 1024 // tile, seed), tile, q_pos, k_pos, slice(None), valid)


def _selection(ts: TileSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile selection [h, Sq, Sk] without causal or padding, valid keys [Sk]) token by token, on the host."""
    rows = ts.mask_rows()
    sel = rows[:, ts.q_pos // ts.tile][:, :, ts.k_pos // ts.tile]
    valid = torch.ones(ts.k_pos.numel(), dtype=torch.bool) if ts.kv_valid_len is None else ts.k_pos < ts.kv_valid_len
    return sel, valid


def _lists_of(blocks: torch.Tensor, counts: torch.Tensor, idx: torch.Tensor) -> None:
    """counts / idx are the row-wise lists of ``blocks`` [h, R, C]: the selected columns first, ascending."""
    h, r, c = blocks.shape
    for hh in range(h):
        for i in range(r):
            want = [j for j in range(c) if blocks[hh, i, j]]
            n = int(counts[hh, i])
            assert n == len(want) and idx[hh, i, :n].tolist() == want, (hh, i)
            assert sorted(idx[hh, i].tolist()) == list(range(c))   # the rest: every other column once


def _fa4_reference(ts: TileSlice, sq: int, sk: int, causal: bool) -> tuple:
    """(full, partial) [h, nq, nk] block by block: a block is "any" when some selected tile pair meets a valid key in
    it, "all" when every (row, column) of it (rows past sq / sk excepted) is selected and valid; causal: full below
    the diagonal only, nothing above it."""
    sel, valid = _selection(ts)
    h = sel.shape[0]
    nq, nk = -(-sq // KB), -(-sk // KB)
    full = torch.zeros(h, nq, nk, dtype=torch.bool)
    partial = torch.zeros_like(full)
    for i in range(nq):
        for j in range(nk):
            rs, cs = slice(i * KB, min(sq, (i + 1) * KB)), slice(j * KB, min(sk, (j + 1) * KB))
            block, v = sel[:, rs, cs], valid[cs]
            any_ = block.flatten(1).any(1) & v.any()
            all_ = block.flatten(1).all(1) & v.all()
            if causal and j > i:
                continue
            f = all_ & (j < i) if causal else all_
            full[:, i, j], partial[:, i, j] = f, any_ & ~f
    return full, partial


CASES = [(kind, heads, tile, valid, causal, placed)
         for kind in ("random", "window") for heads in (1, 3) for tile in (128, 64)
         for valid, causal, placed in ((None, False, False), (None, True, False), (700, False, False),
                                       (None, False, True), (None, True, True), (300, False, True))]


@pytest.mark.parametrize("kind,heads,tile,valid,causal,placed", CASES)
def test_fa4_metadata_equals_the_host_reference(monkeypatch, kind, heads, tile, valid, causal, placed):
    fake_fa4.install(monkeypatch)
    ts = _slice(kind, heads, tile, 1024, valid, placed, seed=heads + tile)
    if causal and placed:   # causal needs the same increasing rows on both sides: a rank's zigzag diagonal
        ts = TileSlice(ts.block_mask, tile, ts.q_pos, ts.q_pos, slice(None), valid)
    sq, sk = ts.q_pos.numel(), ts.k_pos.numel()
    meta = fa4.tile_metadata(ts, sq, sk, causal)
    full, partial = _fa4_reference(ts, sq, sk, causal)
    _lists_of(full, meta.fwd.full_block_cnt[0], meta.fwd.full_block_idx[0])
    _lists_of(partial, meta.fwd.mask_block_cnt[0], meta.fwd.mask_block_idx[0])
    _lists_of(full.transpose(1, 2), meta.bwd.full_block_cnt[0], meta.bwd.full_block_idx[0])
    _lists_of(partial.transpose(1, 2), meta.bwd.mask_block_cnt[0], meta.bwd.mask_block_idx[0])
    aligned = tile % KB == 0 and (valid is None or valid % KB == 0)
    assert (meta.aux is None) == aligned and meta.causal_in_kernel == (causal and aligned)
    if meta.aux is not None:   # the mask_mod's rows: tile per row (padded keys: tile T), the tile mask, positions
        t = ts.block_mask.shape[-1]
        qt = torch.nn.functional.pad(ts.q_pos // tile, (0, fa4.aux_rows(sq) - sq)).int()
        kv = ts.k_pos < (valid if valid is not None else 1 << 40)
        kt = torch.nn.functional.pad(torch.where(kv, ts.k_pos // tile, t), (0, fa4.aux_rows(sk) - sk), value=t).int()
        assert torch.equal(meta.aux[0], qt) and torch.equal(meta.aux[1], kt)
        assert torch.equal(meta.aux[2], torch.nn.functional.pad(ts.mask_rows(), (0, 1)).int())
        if causal:
            assert torch.equal(meta.aux[3][:sq], ts.q_pos.int()) and torch.equal(meta.aux[4][:sk], ts.k_pos.int())


def _cudnn_reference(ts: TileSlice, b: int, causal: bool) -> tuple:
    """(sel strictly below the diagonal when causal [h, nq, nk], sizes [nk] or None, diag [h, nq] or None)."""
    sel_tok, valid = _selection(ts)
    sq, sk = sel_tok.shape[1:]
    nq, nk = -(-sq // b), -(-sk // b)
    sizes = torch.tensor([int(valid[j * b:(j + 1) * b].sum()) for j in range(nk)], dtype=torch.int32)
    sel = torch.zeros(sel_tok.shape[0], nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            sel[:, i, j] = sel_tok[:, i * b, j * b] & (sizes[j] > 0)   # every block inside one tile: its first entry
    diag = None
    if causal:
        diag = torch.stack([sel[:, i, i] for i in range(nq)], 1)
        sel = sel & torch.ones(nq, nk, dtype=torch.bool).tril(-1)
    padded = ts.kv_valid_len is not None or sk % b
    return sel, (sizes if padded else None), diag


@pytest.mark.parametrize("kind,heads,tile,valid,causal,placed", CASES)
def test_cudnn_metadata_equals_the_host_reference(kind, heads, tile, valid, causal, placed):
    ts = _slice(kind, heads, tile, 1024, valid if not causal else None, placed, seed=heads * tile)
    if causal and placed:
        ts = TileSlice(ts.block_mask, tile, ts.q_pos, ts.q_pos, slice(None), None)
    sq, sk = ts.q_pos.numel(), ts.k_pos.numel()
    meta = cbs.block_metadata(ts, sq, sk, causal)
    b = cbs.block_of(ts, sq, sk)
    assert meta.block == b == (128 if tile % 128 == 0 else 64)
    sel, sizes, diag = _cudnn_reference(ts, b, causal)
    _lists_of(sel, meta.nums, meta.index)
    assert (meta.sizes is None) == (sizes is None) and (sizes is None or torch.equal(meta.sizes, sizes))
    assert torch.equal(meta.q_live, sel.any(2)) and torch.equal(meta.k_live, sel.any(1))
    assert (meta.diag is None) == (diag is None) and (diag is None or torch.equal(meta.diag, diag))


def test_refusals_are_decided_on_the_host_positions():
    """What a kernel cannot run is read off the rows' positions (host data), never the mask: FA4 refuses causal
    between different rows and rows finer than 16 tokens per tile; cuDNN padded keys inside a block."""
    bm = _mask("random", 2, 16, 0)
    zig = torch.cat([torch.arange(0, 256), torch.arange(768, 1024)])
    other = torch.cat([torch.arange(256, 512), torch.arange(512, 768)])
    assert fa4.tile_metadata(TileSlice(bm, 64, zig, other), 512, 512, causal=True) is None
    assert fa4.tile_metadata(TileSlice(_mask("random", 1, 128, 0), 8, torch.arange(1024), torch.arange(1024)),
                             1024, 1024, False) is None
    down = other.flip(0)   # keys in descending order: padding (>= 300) before valid keys inside a block
    assert cbs.block_metadata(TileSlice(bm, 64, zig, down, slice(None), 300), 512, 512, False) is None
    assert cbs.block_metadata(TileSlice(bm, 64, zig, down, slice(None), 320), 512, 512, False) is not None
    assert cbs.block_metadata(TileSlice(bm, 64, zig, other, slice(None), 300), 512, 512, False) is not None


@pytest.mark.parametrize("causal,valid", [(False, None), (True, None), (False, 1000)])
@pytest.mark.parametrize("tile,heads", [(128, 4), (64, 1)])
def test_metadata_never_reads_the_mask_on_the_host(monkeypatch, causal, valid, tile, heads):
    """The builds with the mask on the meta device: any host read of its values would raise. Whole-sequence rows
    (the Ulysses chunks' and one rank's calls: the top-k path) and a head chunk of them; the math kernel's token mask
    too."""
    fake_fa4.install(monkeypatch)
    t = -(-1024 // tile)
    ts = tiles.full_sequence_slice(torch.empty(heads, t, t, dtype=torch.bool, device="meta"), tile, 1024, valid)
    for sl in (ts, ts.with_heads(slice(0, 2)) if heads > 1 else ts):
        meta = fa4.tile_metadata(sl, 1024, 1024, causal)
        assert meta.fwd.full_block_cnt.device.type == "meta" and (meta.aux is None) == (tile == 128 and valid is None)
        if not (causal and valid is not None):
            cm = cbs.block_metadata(sl, 1024, 1024, causal)
            assert cm.index.device.type == "meta"
            x = torch.empty(1, sl.mask_rows().shape[0], 1024, 8, device="meta")
            assert cbs.zero_dead(x, cm.live("q", x.device), cm.block) is x
        q = torch.empty(1, sl.mask_rows().shape[0], 1024, 8, device="meta")
        out, lse = MathKernel().forward(q, q, q, 0.3, causal, sl)
        assert out.shape == q.shape and lse.device.type == "meta"


def test_whole_sequence_slices_live_on_their_problem():
    """One slice per AttentionProblem (its layers, its backward and recompute reuse it and the metadata in it); a
    derived problem (a layer's own top-k mask) gets its own; nothing module-level keeps slices."""
    from megatron_sp_ext.sp.problem import AttentionProblem
    bm = _mask("random", 1, 4, 0)
    q = torch.zeros(1, 256, 2, 8)
    pb = AttentionProblem(block_mask=bm, tile=64)
    pr = pb.bind(q, q, q, None, what="test", mode="ulysses")
    a = tiles.problem_slice(pr, q.device)
    assert tiles.problem_slice(pb.bind(q, q, q, None, what="test", mode="ulysses"), q.device) is a
    assert a.contiguous and a.tile == 64 and a.block_mask is pb.mask_on(q.device)
    child = pb.with_mask(_mask("window", 1, 4, 0), agreed=True)
    b = tiles.problem_slice(child.bind(q, q, q, None, what="test", mode="ulysses"), q.device)
    assert b is not a and torch.equal(b.block_mask, child.block_mask)
    assert not [n for n in vars(tiles) if n.isupper() and n.startswith("_")] and not hasattr(tiles, "_FULL")


def test_block_sparse_attention_takes_a_slice_and_keeps_twelve_parameters():
    """The one-device entry: a mask with its tile (``block_size`` still taken), or a TileSlice (placed rows; causal
    by position between different rows runs on a kernel that applies it, here math), against float64."""
    import inspect
    assert len(inspect.signature(bsp.block_sparse_attention).parameters) <= 12
    g = torch.Generator().manual_seed(0)
    zig = torch.cat([torch.arange(0, 64), torch.arange(192, 256)])
    ts = TileSlice(_mask("random", 2, 8, 1), 32, zig, torch.arange(256))
    q = torch.randn(1, 2, 128, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 256, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = bsp.block_sparse_attention(q, k, v, ts, causal=True)
    keep = ts.token_mask(causal=True)                                          # [2, 128, 256]
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf"))
    ref = torch.nan_to_num(torch.softmax(s, -1)) @ v
    torch.testing.assert_close(out, ref)
    g1 = torch.autograd.grad(out.sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    with pytest.raises(Exception, match="tile and block_size name the same setting"):
        bsp.block_sparse_attention(q, k, v, ts.block_mask, tile=32, block_size=32)
    with pytest.raises(Exception, match="TileSlice carries its tile"):
        bsp.block_sparse_attention(q, k, v, ts, tile=32)
    same = bsp.block_sparse_attention(q[:, :, :], q, q, ts.block_mask, block_size=32, kernel="math")
    torch.testing.assert_close(same, bsp.block_sparse_attention(q, q, q, ts.block_mask, tile=32, kernel="math"))


@pytest.mark.parametrize("world", [1, 2])
def test_cuda_tile_sync_worker_runs_on_cpu(monkeypatch, world):
    """tests/gpu/cuda_tile_sync.py (the GPU's no-sync proof) dry-run on CPU gloo ranks (no sync check there: its flow, the
    fresh top-k masks per layer and its records; "auto" and math run on the CPU)."""
    from tests.gpu import cuda_tile_sync as fam
    from tests.harness import run_ranks
    from tests.gpu.suite_judge import merge_ranks
    monkeypatch.setattr(fam, "DEV", "cpu")
    monkeypatch.setattr(fam, "S_RANK", 256)
    monkeypatch.setattr(fam, "D", 16)
    merged = merge_ranks(run_ranks(fam.tile_sync_family, world, timeout=300))
    per_setting = 2 * 2 * (1 + (4 if world > 1 else 2))   # metadata + (warm-up + chunks) x C=1,2, or warm-up + layer
    assert len(merged) == 2 * per_setting and all(m["ok"] for m in merged), [(m["case"], m["why"]) for m in merged]
    assert {m["case"].split(" ")[0] for m in merged} == ({"metadata", "warm-up", "chunks"} if world > 1 else
                                                         {"metadata", "warm-up", "layer"})
