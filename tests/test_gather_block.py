"""All-gather QKV block == the plain block (fused QKV GEMM -> QK-norm/RoPE -> ulysses_attention -> out GEMM):
output, input gradient and every parameter gradient (summed over the CP group, where the two forms split
the contributions differently); fp32/bf16, GQA (also kv < P), uneven heads, QK-norm over ALL heads on/off,
HCMS chunks, causal with zigzag placement, padded keys, autocast (gloo, CPU: the unfused all-gather path)."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.layers.allgather import allgather_self_attention, make_gather_plan
from megatron_sp_ext.sp.placement import pieces
from tests.harness import run_ranks
from tests.reference import rel_err
from tests.blocks import block_params, gathered_prep, local_prep, reference_case
from tests.test_async_block import _autocast

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _case(rank, world, h, hkv, d, chunks, qk_norm, dtype, causal=False, placement="contiguous", kv_valid=None,
          device="cpu", fused=None, tol=None):
    """One comparison (the CUDA suite, tests/gpu/test_cuda.py, runs the block family on GPUs)."""
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(21)
    dim, b, sl = 24, 2, 6
    s = sl * world
    p = block_params(gen, h, hkv, d, dim)
    x_full = torch.randn(b, s, dim, generator=gen)
    dy_full = torch.randn(b, s, dim, generator=gen)
    ang_full = torch.randn(s, d // 2, generator=gen, dtype=torch.float64)
    mine = torch.tensor([i for a, n in pieces(placement, rank, world, s) for i in range(a, a + n)])
    ang = ang_full[mine].to(device)

    prep, prep_full = local_prep(h, hkv, d, ang), gathered_prep(h, hkv, d, ang)

    results = []
    for use_gather in (False, True):
        params = {k: v.to(device, dtype).clone().requires_grad_() for k, v in p.items()}
        x = x_full[:, mine].to(device, dtype).clone().requires_grad_()
        nq, nk = (params["nq"], params["nk"]) if qk_norm else (None, None)
        kw = dict(head_chunks=chunks, causal=causal, placement=placement, kv_valid_len=kv_valid)
        if use_gather:
            y = allgather_self_attention(x, spx.LayerWeights(params["w_qkv"], params["w_o"], params["b_qkv"],
                                                             params["b_o"], nq, nk), g,
                                         num_heads=h, num_kv_heads=hkv, prep=prep_full, fused=fused, **kw)
        else:
            qkv = x @ params["w_qkv"].t() + params["b_qkv"]
            q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
            q, k = prep("q", q, nq), prep("k", k, nk)
            o = spx.ulysses_attention(q, k, v.reshape(b, sl, hkv, d), g, **kw)
            y = o.reshape(b, sl, h * d) @ params["w_o"].t() + params["b_o"]
        y.backward(dy_full[:, mine].to(device, dtype))
        results.append([y.detach(), x.grad] + [params[k].grad for k in ("w_qkv", "b_qkv", "w_o", "b_o")]
                       + ([params["nq"].grad, params["nk"].grad] if qk_norm else []))
    names = ["out", "dx", "dW_qkv", "db_qkv", "dW_o", "db_o", "dnorm_q", "dnorm_k"]
    assert len(results[1]) == len(results[0])
    for name, a, ref in zip(names, results[1], results[0]):
        assert a is not None, name
        if name not in ("out", "dx"):  # parameter grads: each form's per-rank share differs; the CP sums agree
            a, ref = a.clone(), ref.clone()
            dist.all_reduce(a)
            dist.all_reduce(ref)
        err = rel_err(a, ref)
        assert err <= (tol or TOL[dtype]), f"H={h}/{hkv} C={chunks} norm={qk_norm} {dtype} causal={causal} {name}: {err:.2e}"
    return len(names)


@pytest.mark.parametrize("world,h,hkv,chunks", [(2, 8, 8, 1), (2, 8, 8, 2), (2, 8, 4, 2), (2, 8, 2, 1),
                                                (2, 5, 5, 1), (4, 6, 6, 1), (4, 8, 2, 1), (4, 8, 2, 2),
                                                (4, 4, 1, 1)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_gather_block_equals_plain_fp32(world, h, hkv, chunks, qk_norm):
    run_ranks(_case, world, h, hkv, 8, chunks, qk_norm, torch.float32)


@pytest.mark.parametrize("chunks", [1, 2])
def test_gather_block_equals_plain_bf16(chunks):
    run_ranks(_case, 2, 8, 4, 8, chunks, True, torch.bfloat16)


@pytest.mark.parametrize("world,placement", [(2, "zigzag"), (4, "zigzag"), (2, "contiguous")])
def test_gather_block_causal(world, placement):
    run_ranks(_case, world, 8, 4, 8, 1, True, torch.float32, causal=True, placement=placement)


def test_gather_block_padded_keys():
    run_ranks(_case, 2, 4, 4, 8, 2, True, torch.float32, kv_valid=9)


def _shard_info(rank, world):
    """Which heads and which w_qkv rows each rank computes; kv copies counted once in cross-rank sums."""
    plan = make_gather_plan(dist.group.WORLD, spx.AttentionProblem(), num_heads=8, num_kv_heads=2, head_dim=2,
                            prep=None, seq_local=3, device=torch.device("cpu"))
    sh = plan.shard
    assert sh.q_heads == (2 * rank, 2 * rank + 1)
    assert sh.kv_heads == (rank // 2,) and sh.kv_owner == (rank % 2 == 0,)
    rows = plan.rows.tolist()
    assert rows[:4] == [4 * rank + i for i in range(4)]                 # q rows of heads 2r, 2r+1
    assert rows[4:6] == [16 + 2 * (rank // 2) + i for i in range(2)]    # k rows of the kv head
    assert rows[6:] == [20 + 2 * (rank // 2) + i for i in range(2)]     # v rows
    assert plan.fused is False  # gloo/CPU: the unfused all-gather path
    with pytest.raises(SPConfigError, match="fused symm_mem matmuls.*cannot run here.*CUDA"):
        make_gather_plan(dist.group.WORLD, spx.AttentionProblem(), num_heads=8, num_kv_heads=2, head_dim=2,
                         prep=None, seq_local=3, device=torch.device("cpu"), run=spx.LayerRun(fused=True))
    y4 = torch.full((1, 3, 1, 2), float(rank + 1))
    got = sh.sum_sq(y4, "k")  # owners: ranks 0 and 2 -> (1 + 9) * 2 elements
    assert torch.allclose(got, torch.full((1, 3, 1, 1), 2.0 * (1 + 9)))
    return True


def test_head_shard_bookkeeping():
    run_ranks(_shard_info, 4)


def test_gather_block_under_autocast():
    run_ranks(_autocast, 2, "allgather")


@pytest.mark.parametrize("world,h,hkv,chunks,qk_norm,causal,placement,kv_valid", [
    (2, 8, 8, 2, True, False, "contiguous", None), (2, 8, 4, 1, True, True, "zigzag", None),
    (4, 8, 2, 1, True, True, "zigzag", None), (4, 6, 6, 1, False, False, "contiguous", 21),
    (4, 4, 1, 1, True, False, "contiguous", None)])
def test_gather_block_matches_float64_reference(world, h, hkv, chunks, qk_norm, causal, placement, kv_valid):
    """Against the whole block in float64 on one device (full sequence), not only against the plain block."""
    run_ranks(reference_case, world, "allgather", h, hkv, 8, chunks, qk_norm, causal, placement, kv_valid)
