"""Ulysses/HCMS under zigzag and tasp_zigzag placement: one causal kernel call per chunk in global order
(the permutation folded into the exchange copies), against the float64 reference, against the old
masked position-run path, and the zero-copy send path == the copying path bit for bit (gloo, CPU)."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.attention.backends import AutoBackend
from megatron_sp_ext.comm.transport import NcclTransport
from megatron_sp_ext.sp.ulysses import layout as lay
from megatron_sp_ext.sp.placement import pieces
from megatron_sp_ext.sp.ring import RingBackend
from megatron_sp_ext.sp.ulysses import local_order
from tests.harness import run_ranks
from tests.reference import make_qkv, rel_err
from tests.sp_check import run_case

# (b, s_per_rank, h, hkv, d): even heads, uneven heads, GQA with kv < P, odd piece length
SHAPES = [(1, 8, 8, 8, 16), (2, 6, 6, 6, 16), (1, 4, 8, 2, 32), (2, 12, 12, 4, 8)]


def _sharder(placement):
    def shard(x, r, w):
        return torch.cat([x[:, a:a + n] for a, n in pieces(placement, r, w, x.shape[1])], dim=1)
    return shard


class CountingSDPA(AutoBackend):
    """SDPA that records (causal, q length, kv length) of every kernel call (plain or with log-sum-exp)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __call__(self, q, k, v, *, causal, softmax_scale):
        self.calls.append((causal, q.shape[2], k.shape[2]))
        return super().__call__(q, k, v, causal=causal, softmax_scale=softmax_scale)

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None):
        self.calls.append((causal, q.shape[2], k.shape[2]))
        return super().forward_lse(q, k, v, causal=causal, softmax_scale=softmax_scale, mask=mask)


def _zigzag_ref(rank, world, placements):
    g, n = dist.group.WORLD, 0
    for placement in placements:
        if placement == "tasp_zigzag" and world == 2:
            shapes = SHAPES[:2]
        else:
            shapes = SHAPES
        for (b, sl, h, hkv, d) in shapes:
            per = 2 * (len(pieces(placement, 0, world, 2 * world * 64)) // 2)
            sl = max(sl, per) * (1 if sl % per == 0 else per)  # tasp_zigzag needs 2m pieces per rank
            if h < world:
                continue
            for layout in ("bshd", "sbhd"):
                for c, contig in ((1, True), (2, False), (2, True)):
                    if c > min(h // world, 2):
                        continue
                    be = CountingSDPA()
                    run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, g, head_chunks=c, causal=True, layout=layout,
                                                                   placement=placement, backend=be,
                                                                   qkv_contiguous=contig),
                             rank, world, b=b, s=sl * world, h=h, hkv=hkv, d=d, dtype=torch.float32, causal=True,
                             layout=layout, shard=_sharder(placement), seed=n)
                    # one causal call over the whole sequence per chunk: no masked position runs
                    assert be.calls == [(True, sl * world, sl * world)] * c, be.calls
                    n += 1
    return n


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_causal_one_kernel_matches_reference(world):
    assert run_ranks(_zigzag_ref, world, ["zigzag", "tasp_zigzag"])[0] > 0


def _bf16(rank, world):
    g = dist.group.WORLD
    run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, g, causal=True, placement="zigzag"),
             rank, world, b=1, s=16 * world, h=8, hkv=4, d=32, dtype=torch.bfloat16, causal=True,
             shard=_sharder("zigzag"))
    return True


def test_zigzag_causal_bf16():
    run_ranks(_bf16, 4)


def _padding(rank, world):
    """kv_valid_len inside a piece and at a piece boundary, causal and not, zigzag and tasp_zigzag."""
    g, n = dist.group.WORLD, 0
    s = 4 * world * 2 * 3
    for placement in ("zigzag", "tasp_zigzag"):
        for valid in (s - 5, s - s // (2 * world)):
            for causal in (False, True):
                mask = torch.zeros(s, s, dtype=torch.bool)
                mask[:, :valid] = True
                if causal:
                    mask &= torch.ones(s, s, dtype=torch.bool).tril()
                be = CountingSDPA()
                run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, g, head_chunks=2, causal=causal,
                                                               placement=placement, kv_valid_len=valid, backend=be),
                         rank, world, b=2, s=s, h=6, hkv=3, d=16, dtype=torch.float32, causal=causal,
                         shard=_sharder(placement), mask=mask, seed=n, compare_rows=valid)
                want = [(True, valid, valid), (False, s - valid, valid)] if causal else [(False, s, valid)]
                assert be.calls == want * 2, be.calls
                n += 1
    return n


def test_padding_cuts_keys_in_one_or_two_calls():
    run_ranks(_padding, 3)


def _vs_masked(rank, world):
    """The new path equals the old masked position-run path (a RingBackend over the gathered runs) within
    fp32 rounding (different kernels and summation order, so not bit for bit)."""
    g = dist.group.WORLD
    b, sl, h, d = 1, 8, 8, 16
    s = sl * world
    q, k, v, do = make_qkv(5, b, s, h, h, d)
    for placement in ("zigzag", "tasp_zigzag"):
        for valid in (None, s - 3):
            shard = _sharder(placement)
            mine = [shard(t, rank, world) for t in (q, k, v, do)]
            runs = tuple(r for p in range(world) for r in pieces(placement, p, world, s))
            res = []
            for masked in (False, True):
                x = [t.clone().requires_grad_() for t in mine[:3]]
                if masked:
                    be = RingBackend(None, "ring", runs, (runs,), AutoBackend(), valid)
                    o = spx.ulysses_attention(*x, g, causal=True, backend=be)
                else:
                    o = spx.ulysses_attention(*x, g, causal=True, placement=placement, kv_valid_len=valid)
                o.backward(mine[3])
                res.append([o] + [t.grad for t in x])
            for name, a, c in zip(("out", "dq", "dk", "dv"), *res):
                assert rel_err(a, c) < 1e-5, f"{placement} valid={valid} {name}: {rel_err(a, c)}"
    return True


def test_equals_old_masked_path():
    run_ranks(_vs_masked, 4)


class RecordingNccl(NcclTransport):
    """The group's all_to_all, recording whether each send buffer came from ``send_buffer`` (a copy)."""

    def __init__(self, group):
        super().__init__(group)
        self.fresh, self.sends = set(), []

    def send_buffer(self, numel, like):
        t = super().send_buffer(numel, like)
        self.fresh.add(t.data_ptr())
        return t

    def all_to_all(self, send, recv, *a, **kw):
        self.sends.append(send.data_ptr() in self.fresh)
        return super().all_to_all(send, recv, *a, **kw)


class CopyingNccl:
    """Today's path: the same all_to_all, but not an NcclTransport, so every send is packed by a copy."""

    name, stream_ordered = "nccl_copy", False

    def __init__(self, group):
        self.inner = NcclTransport(group)

    def send_buffer(self, numel, like):
        return self.inner.send_buffer(numel, like)

    def all_to_all(self, *a, **kw):
        return self.inner.all_to_all(*a, **kw)


def _zero_copy(rank, world):
    g = dist.group.WORLD
    n = 0
    for (b, h, hkv, causal, layout, placement) in ((1, 8, 8, False, "bshd", "contiguous"),
                                                   (1, 6, 2, True, "sbhd", "contiguous"),
                                                   (2, 8, 4, True, "bshd", "zigzag"),
                                                   (1, 8, 8, True, "bshd", "zigzag")):
        q, k, v, do = make_qkv(11 + n, b, 8 * world, h, hkv, 16)
        shard = _sharder(placement)
        mine = [shard(t, rank, world) for t in (q, k, v, do)]
        if layout == "sbhd":
            mine = [t.transpose(0, 1).contiguous() for t in mine]
        res, recs = [], []
        for tr in (RecordingNccl(g), CopyingNccl(g)):
            for c in (1, 2):
                x = [t.clone().requires_grad_() for t in mine[:3]]
                o = spx.ulysses_attention(*x, g, head_chunks=c, causal=causal, layout=layout, placement=placement,
                                          transport=tr)
                o.backward(mine[3])
                res.append([o] + [t.grad for t in x])
            recs.append(tr)
        for other in res[1:]:
            for a, c in zip(res[0], other):
                assert torch.equal(a, c)
        sends = recs[0].sends
        if b == 1 and placement == "contiguous":  # the outputs (and the grads the kernel returns in its
            assert sends.count(False) >= 3, sends    # native layout) go straight from the kernel's results
        else:  # the permutation (or B > 1) needs the copy: nothing is sent in place
            assert False not in sends, sends
        n += 1
    return n


def test_zero_copy_send_equals_copying_path():
    run_ranks(_zero_copy, 2)


def test_seq_order_tables():
    assert lay.seq_order([pieces("contiguous", p, 4, 16) for p in range(4)]) is None
    zz = lay.seq_order([pieces("zigzag", p, 2, 8) for p in range(2)])
    assert zz.to_global == (0, 3, 1, 2) and zz.from_global == (0, 2, 3, 1)
    assert local_order("zigzag", 4, 8, False, None) == (None, None)  # non-causal: order does not matter
    # padding that cuts nothing (== S) is no padding; keys past the sequence are refused by name
    assert local_order("zigzag", 4, 8, True, 32) == (local_order("zigzag", 4, 8, True, None)[0], None)
    with pytest.raises(SPConfigError, match="kv_valid_len=40 is larger than the sequence"):
        local_order("zigzag", 4, 8, True, 40)
    x = torch.arange(2 * 8 * 3 * 1.0).view(8, 2, 3, 1)  # [S, B, h, D], rank order
    back = torch.empty_like(x)
    lay.to_send_layout(lay.to_kernel_layout(x, zz), zz, back)
    assert torch.equal(back, x)
    with pytest.raises(spx.SPConfigError, match="kv_valid_len=0"):
        local_order("zigzag", 4, 8, True, 0)


def _same_as_contiguous(rank, world):
    """Same kernel on the same global-order data: zigzag/tasp_zigzag causal == contiguous causal, bit for bit
    (output and every grad, after putting both in global order), for Ulysses and HCMS, GQA included."""
    from megatron_sp_ext.sp.placement import divisor
    g, n = dist.group.WORLD, 0
    for (h, hkv) in ((8, 8), (6, 2)):
        s = divisor("tasp_zigzag", world) * 2
        q, k, v, do = make_qkv(21 + n, 1, s, h, hkv, 16)

        def run(pl, c):
            x = [_sharder(pl)(t, rank, world).clone().requires_grad_() for t in (q, k, v)]
            o = spx.ulysses_attention(*x, g, head_chunks=c, causal=True, placement=pl)
            o.backward(_sharder(pl)(do, rank, world))
            return [spx.unshard_sequence(t, g, placement=pl) for t in [o] + [t.grad for t in x]]
        for c in (1, 2):
            if c > h // world:
                continue
            base = run("contiguous", c)
            for pl in ("zigzag", "tasp_zigzag"):
                for name, a, b in zip(("out", "dq", "dk", "dv"), run(pl, c), base):
                    assert torch.equal(a, b), f"{pl} C={c} H={h}/{hkv}: {name} differs from contiguous"
                n += 1
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_bitwise_equals_contiguous(world):
    assert run_ranks(_same_as_contiguous, world)[0] > 0


def test_hybrid_rows_sort_and_merge_pieces():
    """USP's Ulysses level delivers each gathered sequence in ascending position: zigzag over 4 ranks as
    two Ulysses groups {0,1} and {2,3} (pieces of 2 tokens) merges 4 pieces into 2 runs and into 1 run."""
    from megatron_sp_ext.sp.ring.hybrid import sorted_rows
    rows = sorted_rows(((0, 1), (2, 3)), 4, "zigzag", 16)
    (o0, runs0), (o1, runs1) = rows
    assert runs0 == ((0, 4), (12, 4)) and runs1 == ((4, 8),)
    assert o0.to_global == (0, 3, 1, 2) and o1.to_global == (0, 3, 1, 2)
    order, merged = lay.sorted_order([((0, 2),), ((2, 2),)])
    assert order is None and merged == ((0, 4),)


def _hybrid_sorted(rank, world):
    """USP with sorted gathers == the float64 reference, causal zigzag and padded, HCMS chunks and GQA."""
    g = dist.group.WORLD
    n = 0
    for (h, hkv, c) in ((4, 4, 2), (8, 2, 1)):
        mesh = spx.build_sp_mesh(g, num_heads=h, placement="usp", ulysses_size=2, nodes=2)
        for valid in (None, 2 * world * 3 - 4):
            s = 2 * world * 3
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            if valid is not None:
                mask[:, valid:] = False
            run_case(lambda q, k, v: spx.hybrid_attention(q, k, v, mesh, head_chunks=c, causal=True,
                                                          placement=spx.balanced_placement("ring", True),
                                                              kv_valid_len=valid),
                     rank, world, b=1, s=s, h=h, hkv=hkv, d=16, dtype=torch.float32, causal=True, seed=n,
                     shard=_sharder("zigzag"), mask=mask, compare_rows=valid)
            n += 1
    return n


def test_usp_sorted_gather_matches_reference():
    run_ranks(_hybrid_sorted, 4)


def _megatron_auto_ring(rank, world):
    """cp_comm_type=auto when its calibration picks the ring (forced here: CPU never times) == CP=1, causal,
    Megatron's zigzag batches; and when it keeps Ulysses the zigzag batch goes through ONE causal kernel."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_sp_ext.megatron.core_attention import SPDotProductAttention
    from tests.test_megatron import _assert_equals_full_sequence, _block
    ps.initialize_model_parallel(context_parallel_size=world)
    try:
        for forced in ("ring", "hcms"):
            SPDotProductAttention._auto_mode = lambda self, q, k, causal, m=forced: m
            block = _block("auto", world, 1, 1, None, True)
            be = CountingSDPA()
            for layer in block.layers:
                layer.self_attention.core_attention.backend = be
            s, b = 8 * world, 2
            g = torch.Generator().manual_seed(3)
            x_full, dy_full = torch.randn(s, b, 64, generator=g), torch.randn(s, b, 64, generator=g)
            split = lambda t: get_batch_on_this_cp_rank({"x": t.transpose(0, 1)})["x"].transpose(0, 1)  # noqa: E731
            x = split(x_full).clone().requires_grad_()
            y = block(x, attention_mask=None)
            y.backward(split(dy_full))
            if forced == "hcms":
                assert be.calls == [(True, s, s)] * len(block.layers), be.calls
            grads = {n: p.grad.clone() for n, p in block.named_parameters()}
            for gr in grads.values():
                dist.all_reduce(gr, group=ps.get_context_parallel_group())
            dx = x.grad.clone()
            block.zero_grad(set_to_none=True)
            _assert_equals_full_sequence(block, x_full, dy_full, split, y, dx, grads, f"auto->{forced}")
    finally:
        ps.destroy_model_parallel()
    return True


def test_megatron_auto_ring_and_zigzag_one_kernel():
    run_ranks(_megatron_auto_ring, 2)


def _call_orders(rank, world, fake):
    """Causal Ulysses in both placements, one after the other with the same shapes, through the cuDNN branch
    (explicit kernels, held saved tensors): every call's output and gradients against float64."""
    g, n = dist.group.WORLD, 0
    for layout in ("bshd", "sbhd"):
        for c in (1, 2):
            for order in (("contiguous", "zigzag", "zigzag"), ("zigzag", "contiguous", "zigzag")):
                be = AutoBackend()
                for placement in order:
                    run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, g, head_chunks=c, causal=True,
                                                                   layout=layout, placement=placement, backend=be),
                             rank, world, b=1, s=16 * world, h=4, hkv=2, d=16, dtype=torch.float32, causal=True,
                             layout=layout, shard=_sharder(placement), seed=n)
                    n += 1
    assert fake.backward_calls >= n, (fake.backward_calls, n)  # every call ran the cuDNN branch
    return n


def test_cudnn_graph_cache_call_order_contiguous_then_zigzag(monkeypatch):
    """Regression (CUDA, 2026-11-24): causal zigzag Ulysses with one head chunk gave right outputs and wrong
    gradients after a same-shaped contiguous call: torch keeps one cuDNN backward graph per q/k/v shape+stride
    key with O's/dO's strides baked in, and the two placements fed O/dO in different layouts. tests/fake_cudnn.py
    reproduces that cache on the CPU; the library now feeds O/dO in q's layout (lse_kernels.in_layout_of)."""
    from tests import fake_cudnn
    fake = fake_cudnn.install(monkeypatch)
    assert run_ranks(_call_orders, 2, fake)[0] == 24
