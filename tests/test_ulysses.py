"""Ulysses and HCMS against the float64 reference, and HCMS == Ulysses bit for bit (gloo, CPU)."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.heads import head_layout
from tests.harness import run_ranks
from tests.reference import rel_err
from tests.sp_check import run_case

# (b, s_per_rank, h, hkv, d)
SHAPES = [
    (1, 6, 8, 8, 64),    # even heads
    (2, 5, 6, 6, 64),    # uneven heads for P=4 (H=6), batch 2, odd shard length
    (1, 4, 8, 2, 128),   # GQA, kv heads < P for P=4
    (1, 4, 8, 4, 64),    # GQA, kv heads >= P
]


def _ulysses_ref(rank, world, dtypes, chunk_list, contiguous=True):
    group = dist.group.WORLD
    for (b, sl, h, hkv, d) in SHAPES:
        for dtype in dtypes:
            for causal in (False, True):
                for layout in ("bshd", "sbhd"):
                    base = None
                    for c in chunk_list:
                        if c > h // world:
                            continue  # more chunks than heads per rank: rejected (tested below)
                        res = run_case(
                            lambda q, k, v: spx.ulysses_attention(q, k, v, group, head_chunks=c, causal=causal,
                                                                  layout=layout, qkv_contiguous=contiguous),
                            rank, world, b=b, s=sl * world, h=h, hkv=hkv, d=d, dtype=dtype, causal=causal,
                            layout=layout, seed=hash((b, sl, h, hkv, d, causal)) % 1000)
                        if base is None:
                            base = res
                        else:  # HCMS must equal plain Ulysses exactly ...
                            same_kv = head_layout(h, hkv, world, c).kv_repeat == head_layout(h, hkv, world, 1).kv_repeat
                            for name, x, y in zip(("out", "dq", "dk", "dv"), res, base):
                                if same_kv or name in ("out", "dq"):
                                    assert torch.equal(x, y), f"C={c} {name} differs from C=1 ({h}/{hkv} heads, {layout})"
                                else:  # ... except GQA dk/dv when chunking replicates kv heads: summation order
                                    assert rel_err(x, y) < 1e-6, f"C={c} {name} ({h}/{hkv} heads): {rel_err(x, y)}"
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_reference_fp32(world):
    run_ranks(_ulysses_ref, world, [torch.float32], [1])


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_reference_bf16(world):
    run_ranks(_ulysses_ref, world, [torch.bfloat16], [1])


@pytest.mark.parametrize("world", [2, 4])
def test_hcms_equals_ulysses_and_reference(world):
    run_ranks(_ulysses_ref, world, [torch.float32], [1, 2, 3, 4])


@pytest.mark.parametrize("world", [2, 4])
def test_packed_qkv_variant_equals_reference(world):
    run_ranks(_ulysses_ref, world, [torch.float32], [1, 2], False)


def _contig_bitwise(rank, world):
    from tests.reference import make_qkv
    g = dist.group.WORLD
    q, k, v, do = make_qkv(3, 1, 8 * world, 8, 4, 32)
    sl = 8
    mine = [t[:, rank * sl:(rank + 1) * sl] for t in (q, k, v, do)]
    outs = []
    for contig in (False, True):
        for c in (1, 2):
            x = [t.clone().requires_grad_() for t in mine[:3]]
            o = spx.ulysses_attention(*x, g, head_chunks=c, qkv_contiguous=contig)
            o.backward(mine[3])
            outs.append([o] + [t.grad for t in x])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)
    return True


def test_contiguous_qkv_variant_is_bitwise_identical():
    run_ranks(_contig_bitwise, 2)


def test_ulysses_three_ranks_uneven():
    run_ranks(_ulysses_ref, 3, [torch.float32], [1, 2])


def _bad_inputs(rank, world):
    g = dist.group.WORLD
    q = torch.randn(1, 4, 8, 16)
    errors = {}
    cases = {
        "shape": lambda: spx.ulysses_attention(q, torch.randn(1, 5, 8, 16), torch.randn(1, 5, 8, 16), g),
        "head_dim": lambda: spx.ulysses_attention(q, torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8), g),
        "layout": lambda: spx.ulysses_attention(q, q, q, g, layout="bhsd"),
        "chunks": lambda: spx.ulysses_attention(q, q, q, g, head_chunks=5),
        "chunks0": lambda: spx.ulysses_attention(q, q, q, g, head_chunks=0),
        "uneven_seq": lambda: spx.ulysses_attention(*(torch.randn(1, 7 + 2 * rank, 8, 16) for _ in range(3)), g),
    }
    for name, fn in cases.items():
        try:
            fn()
        except SPConfigError as e:
            errors[name] = str(e)
        else:
            raise AssertionError(f"{name}: no error raised")
    return errors


def test_bad_inputs_raise_clear_errors():
    errs = run_ranks(_bad_inputs, 2)[0]
    assert "head_dim" in errs["head_dim"]
    assert "layout='bhsd'" in errs["layout"] and "bshd" in errs["layout"]
    assert "head_chunks=5" in errs["chunks"] and "1..4" in errs["chunks"]
    assert "head_chunks=0" in errs["chunks0"]
    assert "differ across ranks" in errs["uneven_seq"]
    assert "disagree" in errs["shape"]


def _auto(rank, world):
    from megatron_sp_ext.sp.ulysses import HCMSPolicy
    pol = HCMSPolicy()
    res = run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, dist.group.WORLD, head_chunks="auto", policy=pol),
                   rank, world, b=1, s=8 * world, h=8, hkv=8, d=32, dtype=torch.float32, causal=False)
    assert len(pol.cache) == 1 and next(iter(pol.cache.values())).chunks == 1  # CPU: nothing overlaps
    return len(res)


def test_auto_on_cpu_picks_plain_and_matches_reference():
    run_ranks(_auto, 2)
