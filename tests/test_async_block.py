"""Async Ulysses block == the plain block (fused QKV GEMM -> QK-norm/RoPE -> ulysses_attention -> out GEMM):
output and every parameter and input gradient; fp32/bf16, GQA, QK-norm on/off, HCMS on/off (gloo, CPU)."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.sp.layers.async_qkv import async_ulysses_self_attention
from tests.blocks import block_params, gathered_prep, local_prep, reference_case, rms
from tests.harness import run_ranks
from tests.reference import rel_err

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _case(rank, world, h, hkv, d, chunks, qk_norm, dtype):
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(11)
    dim, b, sl = 32, 2, 6
    s = sl * world
    p = block_params(gen, h, hkv, d, dim)
    x_full = torch.randn(b, s, dim, generator=gen)
    dy_full = torch.randn(b, s, dim, generator=gen)
    ang_full = torch.randn(s, d // 2, generator=gen, dtype=torch.float64)
    mine = slice(rank * sl, (rank + 1) * sl)
    ang = ang_full[mine]

    prep = local_prep(h, hkv, d, ang)

    results = []
    for use_async in (False, True):
        params = {k: v.to(dtype).clone().requires_grad_() for k, v in p.items()}
        x = x_full[:, mine].to(dtype).clone().requires_grad_()
        nq, nk = (params["nq"], params["nk"]) if qk_norm else (None, None)
        if use_async:
            y = async_ulysses_self_attention(x, spx.LayerWeights(params["w_qkv"], params["w_o"], params["b_qkv"],
                                                                 params["b_o"], nq, nk), g,
                                             num_heads=h, num_kv_heads=hkv, prep=prep, head_chunks=chunks)
        else:  # the plain block: fused GEMM, then Ulysses
            qkv = x @ params["w_qkv"].t() + params["b_qkv"]
            q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
            q, k = prep("q", q, nq), prep("k", k, nk)
            o = spx.ulysses_attention(q, k, v.reshape(b, sl, hkv, d), g, head_chunks=chunks)
            y = o.reshape(b, sl, h * d) @ params["w_o"].t() + params["b_o"]
        y.backward(dy_full[:, mine].to(dtype))
        results.append([y.detach(), x.grad] + [params[k].grad for k in ("w_qkv", "b_qkv", "w_o", "b_o")]
                       + ([params["nq"].grad, params["nk"].grad] if qk_norm else []))
    names = ["out", "dx", "dW_qkv", "db_qkv", "dW_o", "db_o", "dnorm_q", "dnorm_k"]
    for name, a, ref in zip(names, results[1], results[0]):
        grad = ref.clone()
        if name.startswith("dW") or name.startswith("db") or name.startswith("dnorm"):
            dist.all_reduce(grad)  # parameter grads: compare the CP-reduced values too
            a = a.clone()
            dist.all_reduce(a)
        err = rel_err(a, grad)
        assert err <= TOL[dtype], f"H={h}/{hkv} C={chunks} norm={qk_norm} {dtype} {name}: {err:.2e}"
    return True


@pytest.mark.parametrize("world,h,hkv,chunks", [(2, 8, 8, 1), (2, 8, 8, 2), (2, 8, 4, 2), (2, 8, 2, 1),
                                                (4, 6, 6, 1), (4, 8, 2, 1), (4, 8, 2, 2)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_async_block_equals_plain_fp32(world, h, hkv, chunks, qk_norm):
    run_ranks(_case, world, h, hkv, 8, chunks, qk_norm, torch.float32)


def _schedule(rank, world, chunks):
    """Chunk 0 of each branch's exchange is issued right after its own GEMM (before the next branch's
    GEMM), the later chunks chunk-major (q, k, v of chunk 1, then chunk 2, ...) once all are projected;
    in backward the dO exchange is issued before the output-projection weight gradient."""
    import megatron_sp_ext.sp.layers.async_qkv as ab
    events = []
    real_exchange, real_chunk, real_mm = ab._exchange_all_chunks, ab._exchange_chunk, ab._mm

    def exchange(parts, kinds, *a, **k):
        events.append(("exchange", tuple(parts[0].shape)))
        return real_exchange(parts, kinds, *a, **k)

    def chunk(part, kind, plan, c, *a, **k):
        events.append(("exchange", tuple(part.shape), kind, c))
        return real_chunk(part, kind, plan, c, *a, **k)

    def mm(a, b):
        events.append(("gemm", tuple(a.shape), tuple(b.shape)))
        return real_mm(a, b)
    ab._exchange_all_chunks, ab._exchange_chunk, ab._mm = exchange, chunk, mm
    try:
        h, hkv, d, dim = 4, 2, 8, 16
        x = torch.randn(1, 3, dim, requires_grad=True)
        w_qkv = torch.randn((h + 2 * hkv) * d, dim, requires_grad=True)
        w_o = torch.randn(dim, h * d, requires_grad=True)
        prep = lambda br, y, w: y.view(1, 3, h if br == "q" else hkv, d)  # noqa: E731
        y = ab.async_ulysses_self_attention(x, spx.LayerWeights(w_qkv, w_o), dist.group.WORLD, num_heads=h,
                                            num_kv_heads=hkv, prep=prep, head_chunks=chunks)
        fwd = list(events)
        events.clear()
        y.sum().backward()
        bwd = list(events)
    finally:
        ab._exchange_all_chunks, ab._exchange_chunk, ab._mm = real_exchange, real_chunk, real_mm
    kinds = [e[0] for e in fwd]
    assert kinds == ["gemm", "exchange", "gemm", "exchange", "gemm", "exchange"] + ["exchange"] * 3 * (chunks - 1) \
        + ["gemm"], fwd
    order = [(e[2], e[3]) for e in fwd if e[0] == "exchange"]
    assert order == [("q", 0), ("kv", 0), ("kv", 0)] + [(k, c) for c in range(1, chunks) for k in ("q", "kv", "kv")]
    # backward: dO = dy W_o (gemm), its exchange, then dW_o = dy^T O overlapping it, then the branches
    kinds = [e[0] for e in bwd]
    assert kinds[:3] == ["gemm", "exchange", "gemm"], bwd
    assert bwd[2][1] == (16, 3) and bwd[2][2] == (3, h * d), bwd  # dy^T [dim, tokens] @ O [tokens, H*D]
    assert kinds.count("gemm") == 2 + 2 * 3, bwd  # + (dW, dx) for each of v, k, q
    return True


@pytest.mark.parametrize("chunks", [1, 2])
def test_schedule_overlaps_exchanges_with_gemms(chunks):
    run_ranks(_schedule, 2, chunks)


@pytest.mark.parametrize("chunks", [1, 2])
def test_async_block_equals_plain_bf16(chunks):
    run_ranks(_case, 2, 8, 4, 8, chunks, True, torch.bfloat16)


def _pre_attention(rank, world, h, hkv, chunks):
    """The benchmark's pre-attention parts: async (per-branch GEMM + exchange) and fused (plain order,
    one q|k|v exchange) deliver the same head-sharded q, k, v."""
    from megatron_sp_ext.sp.ulysses import layout as lay
    from megatron_sp_ext.sp.layers.async_qkv import make_async_plan, project_and_exchange
    gen = torch.Generator().manual_seed(2)
    d, dim, b, sl = 8, 16, 2, 3
    x = torch.randn(b, sl, dim, generator=gen)
    w = torch.randn((h + 2 * hkv) * d, dim, generator=gen)
    nq, nk = 1 + torch.randn(h * d, generator=gen) * 0.1, 1 + torch.randn(hkv * d, generator=gen) * 0.1

    def prep(branch, y, wn):
        return rms(y, wn).view(b, sl, -1, d)
    plan = make_async_plan(dist.group.WORLD, spx.AttentionProblem(), num_heads=h, num_kv_heads=hkv, head_dim=d,
                           prep=prep, seq_local=sl, device=x.device, run=spx.LayerRun(head_chunks=chunks))
    ra, _, _ = project_and_exchange(x, w, None, nq, nk, plan)
    rf, _, _ = project_and_exchange(x, w, None, nq, nk, plan, fused=True)
    hl = plan.heads
    for c in range(hl.chunks):
        ws = lay.widths(hl, ("q", "kv", "kv"), rank, c)
        cols = lay.columns(rf["qkv"][c].view(world * sl, b, sum(ws), d), ws)
        for name, ref, n in zip("qkv", cols, ws):
            got = ra[name][c].view(world * sl, b, n, d).permute(1, 2, 0, 3)
            assert rel_err(got, ref) < 1e-5, (name, c)
    return True


@pytest.mark.parametrize("world,h,hkv,chunks", [(2, 4, 2, 2), (4, 6, 6, 1)])
def test_pre_attention_parts_agree(world, h, hkv, chunks):
    run_ranks(_pre_attention, world, h, hkv, chunks)


def _autocast(rank, world, form="async"):
    """Under bf16 autocast with fp32 weights and input (a DiT's mixed-precision step), the async block
    (form "async") or the all-gather block ("allgather") runs in one dtype inside and matches the plain
    block under the same autocast (the all-gather block's weight grads after the CP sum)."""
    from megatron_sp_ext.sp.layers.allgather import allgather_self_attention
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(4)
    h, d, dim, b, sl = 4, 8, 32, 1, 4
    p0 = {"w_qkv": torch.randn(3 * h * d, dim, generator=gen) * 0.2, "w_o": torch.randn(dim, h * d, generator=gen) * 0.2,
          "nq": torch.ones(h * d), "nk": torch.ones(h * d)}
    x0, dy = torch.randn(b, sl, dim, generator=gen), torch.randn(b, sl, dim, generator=gen)

    prep, prep_full = local_prep(h, h, d), gathered_prep(h, h, d)
    res = []
    for use_block in (False, True):
        p = {k: v.clone().requires_grad_() for k, v in p0.items()}
        x = x0.clone().requires_grad_()
        kw = dict(num_heads=h, num_kv_heads=h)
        weights = spx.LayerWeights(p["w_qkv"], p["w_o"], norm_q=p["nq"], norm_k=p["nk"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if use_block and form == "async":
                y = async_ulysses_self_attention(x, weights, g, prep=prep, **kw)
            elif use_block:
                y = allgather_self_attention(x, weights, g, prep=prep_full, **kw)
            else:
                q, k, v = (x @ p["w_qkv"].t()).split(h * d, dim=-1)
                o = spx.ulysses_attention(prep("q", q, p["nq"]), prep("k", k, p["nk"]), v.reshape(b, sl, h, d), g)
                y = o.reshape(b, sl, h * d) @ p["w_o"].t()
        y.float().backward(dy)
        res.append((y.float(), x.grad, p["w_qkv"].grad, p["w_o"].grad))
    for name, a, ref in zip(("out", "dx", "dW_qkv", "dW_o"), res[1], res[0]):
        if name.startswith("dW"):  # parameter grads compared after the CP sum
            a, ref = a.clone(), ref.clone()
            dist.all_reduce(a)
            dist.all_reduce(ref)
        assert a.dtype == ref.dtype and rel_err(a, ref) < 3e-2, (form, name, a.dtype, ref.dtype, rel_err(a, ref))
    return True


def test_async_block_under_autocast():
    run_ranks(_autocast, 2)


@pytest.mark.parametrize("world,h,hkv,chunks,qk_norm,causal,placement,kv_valid", [
    (2, 8, 8, 2, True, False, "contiguous", None), (2, 8, 4, 1, True, True, "zigzag", None),
    (4, 8, 2, 1, True, True, "zigzag", None), (4, 6, 6, 1, False, False, "contiguous", 21)])
def test_async_block_matches_float64_reference(world, h, hkv, chunks, qk_norm, causal, placement, kv_valid):
    run_ranks(reference_case, world, "async", h, hkv, 8, chunks, qk_norm, causal, placement, kv_valid)
