"""Ulysses on pre-packed q|k|v (sp/ulysses/packed.py), gloo on CPU: output and the q/k/v gradients (through
pack_qkv's backward) against float64 on the full sequence, causal and not, contiguous and zigzag
placement, padding, GQA (kv heads replicated, and kv >= P), HCMS chunks, B > 1, odd shard lengths,
bf16; bit for bit equal to ulysses_attention(qkv_contiguous=False) on the same backend; clear
errors for sizes it cannot pack."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.ulysses.packed import pack_qkv, packable, packed_head_layout, packed_ulysses_attention
from megatron_sp_ext.sp.placement import pieces
from tests.harness import run_ranks
from tests.sp_check import contiguous_shard, run_case

# (b, s_per_rank, h, hkv, d): MHA, GQA with kv < P (replicated), GQA with kv = P, B > 1, odd shard length
SHAPES = [(1, 8, 8, 8, 16), (2, 5, 8, 2, 16), (1, 6, 8, 4, 8), (2, 7, 12, 12, 8)]


def _packed(group, h, hkv, chunks, **kw):
    def attn(q, k, v):
        hl = packed_head_layout(h, hkv, dist.get_world_size(group), chunks)
        return packed_ulysses_attention(pack_qkv(q, k, v, hl), group, num_heads=h, num_kv_heads=hkv,
                                        head_chunks=chunks, **kw)
    return attn


def _sharder(placement):
    if placement == "contiguous":
        return contiguous_shard

    def shard(x, r, w):
        return torch.cat([x[:, a:a + n] for a, n in pieces(placement, r, w, x.shape[1])], dim=1)
    return shard


def _reference(rank, world, dtype):
    g, n = dist.group.WORLD, 0
    for (b, sl, h, hkv, d) in SHAPES:
        if not packable(h, hkv, world, 1):
            continue
        for causal in (False, True):
            for placement in ("contiguous", "zigzag"):
                if placement == "zigzag" and sl % 2:
                    continue  # zigzag needs two pieces per rank
                for chunks in (1, 2):
                    if not packable(h, hkv, world, chunks):
                        continue
                    run_case(_packed(g, h, hkv, chunks, causal=causal, placement=placement), rank, world, b=b,
                             s=sl * world, h=h, hkv=hkv, d=d, dtype=dtype, causal=causal,
                             shard=_sharder(placement), seed=n)
                    n += 1
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_packed_matches_float64_reference(world):
    assert run_ranks(_reference, world, torch.float32)[0] >= 12


def test_packed_matches_float64_reference_bf16():
    assert run_ranks(_reference, 2, torch.bfloat16)[0] >= 12


def _padding(rank, world):
    g, n = dist.group.WORLD, 0
    s = 6 * world
    for valid in (s - 5, s - s // world):
        for causal in (False, True):
            mask = torch.zeros(s, s, dtype=torch.bool)
            mask[:, :valid] = True
            if causal:
                mask &= torch.ones(s, s, dtype=torch.bool).tril()
            run_case(_packed(g, 8, 4, 2, causal=causal, kv_valid_len=valid), rank, world, b=2, s=s, h=8, hkv=4,
                     d=16, dtype=torch.float32, causal=causal, mask=mask, seed=n, compare_rows=valid)
            n += 1
    return n


def test_packed_padding_matches_reference():
    assert run_ranks(_padding, 2)[0] == 4


def _bitwise(rank, world):
    """Same kernels on the same values as the plain path with zero-copy views: equal bit for bit."""
    g = dist.group.WORLD
    for (b, sl, h, hkv, d) in SHAPES:
        for causal in (False, True):
            for chunks in (1, 2):
                if not packable(h, hkv, world, chunks):
                    continue
                plain = run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, g, head_chunks=chunks, causal=causal,
                                                                       qkv_contiguous=False),
                                 rank, world, b=b, s=sl * world, h=h, hkv=hkv, d=d, dtype=torch.float32,
                                 causal=causal, seed=7)
                packed = run_case(_packed(g, h, hkv, chunks, causal=causal), rank, world, b=b, s=sl * world, h=h,
                                  hkv=hkv, d=d, dtype=torch.float32, causal=causal, seed=7)
                for name, x, y in zip(("out", "dq", "dk", "dv"), packed, plain):
                    assert torch.equal(x, y), f"{name} differs (H={h}/{hkv} C={chunks} causal={causal})"
    return True


def test_packed_is_bitwise_plain_ulysses():
    run_ranks(_bitwise, 2)


def _errors(rank, world):
    g = dist.group.WORLD
    msgs = []
    with pytest.raises(SPConfigError, match="divisible") as e:  # 6 heads over 4 ranks
        packed_head_layout(6, 6, world, 1)
    msgs.append(str(e.value))
    hl = packed_head_layout(8, 8, world, 1)
    sends = pack_qkv(torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8), hl)
    with pytest.raises(SPConfigError, match="chunk buffers"):
        packed_ulysses_attention(sends, g, num_heads=8, num_kv_heads=8, head_chunks=2)
    with pytest.raises(SPConfigError, match="pack_qkv"):  # wrong width
        packed_ulysses_attention([sends[0].narrow(3, 0, 1)], g, num_heads=8, num_kv_heads=8)
    with pytest.raises(SPConfigError, match="pack_qkv"):  # right shape, not contiguous
        packed_ulysses_attention([sends[0].transpose(3, 4).contiguous().transpose(3, 4)], g, num_heads=8,
                                 num_kv_heads=8)
    return msgs


def _entry(rank, world):
    """PackedUlysses: the layout per heads (None for sizes it cannot pack), 'auto' chunks through the policy
    (CPU: 1), and the entry equal to packed_ulysses_attention called directly."""
    from megatron_sp_ext.sp.ulysses.packed import PackedUlysses
    g = dist.group.WORLD
    with pytest.raises(SPConfigError, match="head_chunks='x'"):
        PackedUlysses(g, "x")
    auto = PackedUlysses(g, "auto")
    with pytest.raises(SPConfigError, match="q_like"):
        auto.layout(8, 8)
    like = torch.zeros(()).expand(1, 4, 8, 8)
    assert auto.layout(8, 8, like).chunks == 1 and auto.layout(5, 5, like) is None
    fixed = PackedUlysses(g, 2, causal=True)
    hl = fixed.layout(8, 4)
    assert hl.chunks == 2 and fixed.layout(5, 5) is None
    q, k, v = (torch.randn(1, 4, n, 8, generator=torch.Generator().manual_seed(rank)) for n in (8, 4, 4))
    a = fixed(8, 4, None, *pack_qkv(q, k, v, hl))
    b = packed_ulysses_attention(pack_qkv(q, k, v, hl), g, num_heads=8, num_kv_heads=4, head_chunks=2, causal=True)
    assert torch.equal(a, b)
    return True


def test_packed_entry_object():
    run_ranks(_entry, 2)


def test_packed_bad_sizes_raise_clear_errors():
    msgs = run_ranks(_errors, 4)[0]
    assert "H=6" in msgs[0] and "P=4" in msgs[0]
