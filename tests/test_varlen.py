"""Packed variable-length samples (cu_seqlens) under sequence parallelism (issue #36).

Placement: per-sample "contiguous" / "zigzag" shards (what each rank holds, round trip, errors).
Attention: Ulysses / HCMS on a packed sequence against a float64 per-sample reference (block-diagonal mask),
output and every input gradient of this rank's shard; HCMS bit-identical to Ulysses (the ring family:
tests/test_ring_varlen.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from tests.harness import run_ranks
from megatron_sp_ext.sp.placement import pad_samples, packed_samples
from tests.packed_reference import block_mask, positions, ragged, sharder
from tests.sp_check import run_case


def _lengths(world, placement, mults=(3, 1, 2)):
    div = world if placement == "contiguous" else 2 * world
    return [m * div for m in mults]


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def _placement_rank(rank, world):
    g = dist.group.WORLD
    for placement in ("contiguous", "zigzag"):
        cu = _cu(_lengths(world, placement))
        s = int(cu[-1])
        x = torch.arange(s, dtype=torch.float64).view(1, s, 1, 1).expand(1, s, 2, 3).contiguous()
        for seq_dim, full in ((1, x), (0, x.transpose(0, 1).contiguous())):
            shard = spx.shard_sequence(full, g, placement=placement, seq_dim=seq_dim, cu_seqlens=cu)
            pos = shard.select(3, 0).select(2, 0).flatten().long().tolist()
            assert pos == positions(cu.tolist(), placement, rank, world), (placement, seq_dim, pos)
            back = spx.unshard_sequence(shard, g, placement=placement, seq_dim=seq_dim, cu_seqlens=cu)
            assert torch.equal(back, full), (placement, seq_dim)
    # samples whose lengths do not divide: each padded at its tail (zero rows), dropped again by unshard; x may
    # also come already padded
    cu_list = ragged(world)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    s = cu_list[-1]
    x = (torch.arange(s, dtype=torch.float64) + 1).view(1, s, 1, 1).expand(1, s, 2, 3).contiguous()
    for placement in ("contiguous", "zigzag"):
        shard = spx.shard_sequence(x, g, placement=placement, cu_seqlens=cu)
        pos = (shard.select(3, 0).select(2, 0).flatten().long() - 1).tolist()  # padding rows: 0 - 1
        assert pos == positions(cu_list, placement, rank, world), (placement, pos)
        back = spx.unshard_sequence(shard, g, placement=placement, cu_seqlens=cu)
        assert torch.equal(back, x), placement
        lay = packed_samples(cu, shard.shape[1] * world, placement, world)
        x_pad = pad_samples(x, lay, 1)
        assert x_pad.shape[1] == shard.shape[1] * world
        assert torch.equal(spx.shard_sequence(x_pad, g, placement=placement, cu_seqlens=cu), shard)
    with pytest.raises(SPConfigError, match="cu_seqlens"):
        spx.shard_sequence(x, g, cu_seqlens=torch.tensor([0, 4]))  # does not end at the sequence length
    with pytest.raises(SPConfigError, match="must start at 0 and never decrease"):
        spx.shard_sequence(x, g, cu_seqlens=torch.tensor([0, 5, 4, s]))
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_unshard_per_sample(world):
    assert all(run_ranks(_placement_rank, world))


def _attention_rank(rank, world, placement, dtype=torch.float32, layouts=("bshd", "sbhd"), hkv_per_rank=(1, 2),
                    fake=None):
    g = dist.group.WORLD
    n = 0
    for mults in ((3, 1, 2), (1, 2, 1, 4), None):
        cu_list = [0]
        for m in (_lengths(world, placement, mults) if mults else []):
            cu_list.append(cu_list[-1] + m)
        if mults is None:  # lengths that divide by neither P nor 2P: padded per sample
            cu_list = ragged(world)
        cu = torch.tensor(cu_list, dtype=torch.int32)
        for layout in layouts:
            for causal in (False, True):
                for hk in hkv_per_rank:  # hk=1: GQA (2 q heads per k/v head)
                    outs = []
                    for c in (1, 2):
                        outs.append(run_case(
                            lambda q, k, v: spx.ulysses_attention(q, k, v, g, head_chunks=c, causal=causal,
                                                                  layout=layout, placement=placement,
                                                                  cu_seqlens=cu),
                            rank, world, b=1, s=cu_list[-1], h=2 * world, hkv=hk * world, d=8, dtype=dtype,
                            causal=causal, layout=layout, shard=sharder(cu_list, placement),
                            mask=block_mask(cu_list, causal), seed=n))
                    for a, b in zip(*outs):  # HCMS == Ulysses, bit for bit (P=1: no exchange, no chunks)
                        assert world == 1 or torch.equal(a, b), (placement, layout, causal, hk)
                    n += 1
    if fake is not None:  # every call ran the explicit-kernel branch, per sample
        assert fake.backward_calls >= 2 * n * 3, (fake.backward_calls, n)
    return n


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("placement", ["contiguous", "zigzag"])
def test_ulysses_hcms_packed_samples(world, placement):
    assert all(run_ranks(_attention_rank, world, placement))


def test_ulysses_packed_samples_explicit_kernels(monkeypatch):
    """The cuDNN branch (kernel forward/backward with log-sum-exp, held saved tensors) on the CPU."""
    from tests import fake_cudnn
    fake = fake_cudnn.install(monkeypatch)
    assert all(run_ranks(_attention_rank, 2, "zigzag", layouts=("bshd",), hkv_per_rank=(1,), fake=fake))
    assert all(run_ranks(_attention_rank, 2, "contiguous", layouts=("sbhd",), hkv_per_rank=(2,), fake=fake))


def _refusals_rank(rank, world):
    g = dist.group.WORLD
    cu = torch.tensor([0, 4 * world, 8 * world], dtype=torch.int32)
    q = torch.randn(1, 8, 2 * world, 8)
    with pytest.raises(SPConfigError, match="kv_valid_len"):
        spx.ulysses_attention(q, q, q, g, cu_seqlens=cu, kv_valid_len=5)
    with pytest.raises(SPConfigError, match="batch size 1"):
        spx.ulysses_attention(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), g,
                              cu_seqlens=cu)
    with pytest.raises(SPConfigError, match=r"do not divide by 4 .* must hold 20 rows .* shard_sequence"):
        spx.ulysses_attention(q, q, q, g, cu_seqlens=torch.tensor([0, 3, 8 * world]), placement="zigzag")
    with pytest.raises(SPConfigError, match="tasp_zigzag"):
        spx.ulysses_attention(q, q, q, g, cu_seqlens=cu, placement="tasp_zigzag")
    return True


def test_ulysses_packed_samples_refusals():
    assert all(run_ranks(_refusals_rank, 2))


def _megatron_thd_rank(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_sp_ext.megatron import SPTransformerConfig
    from megatron_sp_ext.megatron.core_attention import SPDotProductAttention
    ps.initialize_model_parallel(context_parallel_size=world)
    try:
        h, hkv, d = 4, 2, 8
        cu_list = [0, 12, 16, 24]  # three samples, each a multiple of 2 * CP
        cu = torch.tensor(cu_list, dtype=torch.int32)
        n = 0
        for mode, chunks in (("ulysses", 1), ("hcms", 2), ("ring", 1), ("tasp", 1)):
            for causal in (False, True):
                cfg = SPTransformerConfig(num_layers=1, hidden_size=h * d, num_attention_heads=h, num_query_groups=hkv,
                                          use_cpu_initialization=True, context_parallel_size=world,
                                          cp_comm_type=mode, attention_dropout=0.0, hcms_head_chunks=chunks)
                core = SPDotProductAttention(cfg, 1, AttnMaskType.causal if causal else AttnMaskType.no_mask, "self",
                                             cp_comm_type=mode)
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                         cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)

                def attn(q, k, v):  # sbhd [t, 1, heads, D] shards -> Megatron's THD [t, heads, D] and back
                    out = core(q.squeeze(1), k.squeeze(1), v.squeeze(1), None, packed_seq_params=params)
                    assert out.shape == (q.shape[0], h * d)
                    return out.view(q.shape[0], 1, h, d)
                run_case(attn, rank, world, b=1, s=cu_list[-1], h=h, hkv=hkv, d=d, dtype=torch.float32,
                         causal=causal, layout="sbhd", shard=sharder(cu_list, "zigzag"),
                         mask=block_mask(cu_list, causal), seed=n)
                n += 1
        # padding inside samples (real lengths 10, 3, 7 placed as 12, 4, 8: cu_seqlens_q / cu_seqlens_q_padded):
        # the padding rows form segments of their own, causal or not, so the reference is block-diagonal over the
        # segments [0, 10), [10, 12), [12, 15), [15, 16), [16, 23), [23, 24) of the padded sequence
        real = torch.tensor([0, 10, 13, 20], dtype=torch.int32)
        segments = [0, 10, 12, 15, 16, 23, 24]
        for mode, causal in (("hcms", True), ("hcms", False), ("ring", False), ("ring", True)):
            cfg = SPTransformerConfig(num_layers=1, hidden_size=h * d, num_attention_heads=h, num_query_groups=hkv,
                                      use_cpu_initialization=True, context_parallel_size=world,
                                      cp_comm_type=mode, attention_dropout=0.0, hcms_head_chunks=2)
            core = SPDotProductAttention(cfg, 1, AttnMaskType.causal if causal else AttnMaskType.no_mask, "self",
                                         cp_comm_type=mode)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                                     cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)

            def attn(q, k, v):
                return core(q.squeeze(1), k.squeeze(1), v.squeeze(1), None,
                            packed_seq_params=params).view(q.shape[0], 1, h, d)
            run_case(attn, rank, world, b=1, s=cu_list[-1], h=h, hkv=hkv, d=d, dtype=torch.float32, causal=causal,
                     layout="sbhd", shard=sharder(cu_list, "zigzag"), mask=block_mask(segments, causal), seed=n)
            n += 1
        bad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                              cu_seqlens_q_padded=torch.tensor([0, 8, 16, 24], dtype=torch.int32))
        x = torch.randn(cu_list[-1] // world, h, d)
        with pytest.raises(SPConfigError, match="padded cumulative lengths .* at least its real length"):
            core(x, x, x, None, packed_seq_params=bad)
    finally:
        ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("cp", [1, 2])
def test_megatron_thd_packed_seq_params(cp):
    """SPDotProductAttention with Megatron's THD packed_seq_params (CP=2: per-sample zigzag split; CP=1: the local
    per-sample path): ulysses, hcms, ring and tasp against the per-sample float64 reference."""
    pytest.importorskip("megatron.core")
    assert all(run_ranks(_megatron_thd_rank, cp, timeout=400))


def _deepspeed_cu_seqlens(rank, world):
    """SPDistributedAttention(..., cu_seqlens=) through the factory equals the functional API (Ulysses, HCMS, ring)."""
    import importlib
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    from megatron_sp_ext.deepspeed import SPDistributedAttention, build_sequence_parallel_groups
    g = build_sequence_parallel_groups(world).install().get_sequence_parallel_group()
    cu = _cu(_lengths(world, "contiguous"))
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(1, int(cu[-1]), 4, 8, generator=gen) for _ in range(3)]
    q, k, v = (spx.shard_sequence(t, g, placement="contiguous", seq_dim=1, cu_seqlens=cu) for t in full)
    for mode, chunks in (("ulysses", 1), ("hcms", 2)):
        attn = SPDistributedAttention(lambda *a, **kw: None, g, 2, 0, mode=mode, head_chunks=chunks)
        got = attn(q, k, v, 0, cu_seqlens=cu)
        want = spx.ulysses_attention(q, k, v, g, head_chunks=chunks, cu_seqlens=cu)
        assert torch.equal(got, want), mode
    ring = SPDistributedAttention(lambda *a, **kw: None, g, 2, 0, mode="ring")
    got = ring(q, k, v, 0, cu_seqlens=cu)
    assert torch.equal(got, spx.ring_attention(q, k, v, g, placement="contiguous", cu_seqlens=cu))
    return True


def test_deepspeed_adapter_takes_cu_seqlens():
    pytest.importorskip("deepspeed")
    run_ranks(_deepspeed_cu_seqlens, 2)


def _varlen_kernel_rank(rank, world):
    """ulysses_attention(varlen_kernel=...): "grouped" and "auto" against float64 per sample (lengths with equal
    samples, so "grouped" batches some), and the bad value refused by name."""
    g = dist.group.WORLD
    cu_list = [0]
    for m in _lengths(world, "zigzag", (2, 2, 1, 2)):
        cu_list.append(cu_list[-1] + m)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    n = 0
    for kernel in ("grouped", "auto"):
        for causal in (False, True):
            run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, g, causal=causal, placement="zigzag",
                                                           cu_seqlens=cu, varlen_kernel=kernel),
                     rank, world, b=1, s=cu_list[-1], h=2 * world, hkv=world, d=8, dtype=torch.float32,
                     causal=causal, layout="bshd", shard=sharder(cu_list, "zigzag"),
                     mask=block_mask(cu_list, causal), seed=n)
            n += 1
    q = torch.randn(1, cu_list[-1] // world, 2 * world, 8)
    with pytest.raises(SPConfigError, match="varlen_kernel='cudnn_varlen' is invalid: choose one of auto"):
        spx.ulysses_attention(q, q, q, g, cu_seqlens=cu, placement="zigzag", varlen_kernel="cudnn_varlen")
    return n


@pytest.mark.parametrize("world", [1, 2])
def test_ulysses_varlen_kernel_setting(world):
    assert run_ranks(_varlen_kernel_rank, world) == [4] * world


def _order_rank(rank, world, order):
    """Equal shard shapes, different math: padded samples, samples that divide, one unpacked sequence, called in
    ``order`` on one process (plans, orders and kernel choices kept between calls must be keyed on the samples)."""
    g = dist.group.WORLD
    div = 2 * world
    calls = {"padded": [0, div + 1, 2 * div - 1], "divides": [0, 2 * div, 3 * div], "unpacked": None}
    # every variant's shard holds 3 * div / world rows: padded (div + 1 -> 2 div) + (div - 2 -> div)
    for n, name in enumerate(order):
        cu = calls[name]
        for attn_name, attn in (
                ("hcms", lambda q, k, v, c: spx.ulysses_attention(q, k, v, g, head_chunks=2, causal=True,
                                                                  placement="zigzag", cu_seqlens=c)),
                ("ring", lambda q, k, v, c: spx.ring_attention(q, k, v, g, causal=True,
                                                               placement=spx.balanced_placement("ring", True,
                                                                   packed=True), cu_seqlens=c))):
            if cu is None:
                run_case(lambda q, k, v: attn(q, k, v, None), rank, world, b=1, s=3 * div, h=2 * world, hkv=world,
                         d=8, dtype=torch.float32, causal=True, shard=sharder([0, 3 * div], "zigzag"), seed=n)
            else:
                c = torch.tensor(cu, dtype=torch.int32)
                run_case(lambda q, k, v: attn(q, k, v, c), rank, world, b=1, s=cu[-1], h=2 * world, hkv=world, d=8,
                         dtype=torch.float32, causal=True, shard=sharder(cu, "zigzag"), mask=block_mask(cu, True),
                         seed=n)
    return True


@pytest.mark.parametrize("order", [("padded", "divides", "unpacked"), ("unpacked", "divides", "padded")])
def test_packed_call_order(order):
    assert all(run_ranks(_order_rank, 2, order))
