"""CUDA-suite worker for the TP x CP attention block (sp/layers/tp_cp.py), and the functional case it shares with
tests/test_tp_cp_block.py: the block on TP x CP ranks against a float64 single-device reference of the whole
attention block on the full sequence (output, input grad, every parameter grad after Megatron's reductions).

Ranks: global rank r = p T + t (TP fastest, Megatron's order), so the WORLD group is TP x CP in CP-major order.
Records follow tests/gpu/cuda_suite.py: {"family", "case", "errs": {name: rel_err}, "tol"}; SPX_SUITE_DEVICE=cpu runs
the same worker on forked gloo ranks.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from tests.blocks import rms, rope
from tests.reference import reference_attention, rel_err
from tests.gpu.suite_judge import checked_reference_err

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
SHRINK = int(os.environ.get("SPX_SUITE_SHRINK", "1"))  # CPU dry runs: 1/SHRINK of the sequence lengths


def tp_cp_groups(tp: int):
    """(tp_group, cp_group, tcp_group) of this rank for global rank r = p * tp + t (every rank builds them all)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // tp
    mine = {}
    for p in range(cp):
        g = dist.new_group([p * tp + t for t in range(tp)])
        if rank // tp == p:
            mine["tp"] = g
    for t in range(tp):
        g = dist.new_group([p * tp + t for p in range(cp)])
        if rank % tp == t:
            mine["cp"] = g
    return mine["tp"], mine["cp"], dist.group.WORLD


def reference_block(x, p, h, hkv, d, ang, qk_norm, causal):
    """The whole block in float64 on the full sequence x [B, S, dim]: per-head q/k RMS norm, RoPE, attention,
    output projection (Megatron's attention math)."""
    b, s, _ = x.shape
    q, k, v = (x @ p["w_qkv"].t() + p["b_qkv"]).split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(b, s, h, d), k.reshape(b, s, hkv, d), v.reshape(b, s, hkv, d)
    if qk_norm:
        q, k = rms(q, p["nq"]), rms(k, p["nk"])
    o = reference_attention(rope(q, ang), rope(k, ang), v, causal=causal)
    return o.reshape(b, s, h * d) @ p["w_o"].t() + p["b_o"]


def single_device_block(x, p, h, hkv, d, ang, qk_norm, causal):
    """The whole block on one device in x's dtype with torch's own kernels (SDPA): the unsharded baseline."""
    import torch.nn.functional as F  # noqa: PLC0415
    b, s, _ = x.shape
    q, k, v = (x @ p["w_qkv"].t() + p["b_qkv"]).split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(b, s, h, d), k.reshape(b, s, hkv, d), v.reshape(b, s, hkv, d)
    if qk_norm:
        q, k = rms(q, p["nq"]), rms(k, p["nk"])
    q, k = rope(q, ang), rope(k, ang)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                       enable_gqa=hkv != h).transpose(1, 2)
    return o.reshape(b, s, h * d) @ p["w_o"].t() + p["b_o"]


def tp_cp_case(rank: int, world: int, tp: int, *, form: str = "pipelined", h: int = 8, hkv: int = 8, d: int = 16,
               chunks: int = 1, qk_norm: bool = True, causal: bool = False, placement: str = "zigzag",
               s_tp: int = 4, dim: int = 32, b: int = 2, dtype=torch.float64, device: str = "cpu",
               seed: int = 5, baseline: "dict | None" = None) -> dict:
    """tp_cp_self_attention on this rank (TP size ``tp``, CP size world / tp) against ``reference_block``:
    {name: relative error} for the output and input grad of this rank's tokens, w_qkv / b_qkv / w_o grads
    summed over CP compared with this TP shard's rows/columns, b_o and norm-weight grads summed over all ranks."""
    from megatron_sp_ext.sp.placement import pieces
    from megatron_sp_ext.sp.layers.call import LayerWeights
    from megatron_sp_ext.sp.layers.tp_cp import TpCpGroups, tp_cp_self_attention
    tp_g, cp_g, tcp_g = tp_cp_groups(tp)
    cp = world // tp
    t, pr = rank % tp, rank // tp
    ht, kvt = h // tp, hkv // tp
    s_cp = s_tp * tp
    s = s_cp * cp
    gen = torch.Generator().manual_seed(seed)
    p0 = {"w_qkv": torch.randn((h + 2 * hkv) * d, dim, generator=gen) * 0.2,
          "b_qkv": torch.randn((h + 2 * hkv) * d, generator=gen) * 0.1,
          "w_o": torch.randn(dim, h * d, generator=gen) * 0.2, "b_o": torch.randn(dim, generator=gen) * 0.1,
          "nq": 1 + 0.1 * torch.randn(d, generator=gen), "nk": 1 + 0.1 * torch.randn(d, generator=gen)}
    # values representable in ``dtype``: the reference sees exactly the block's inputs
    p0 = {k: v.to(dtype).double().to(device) for k, v in p0.items()}
    x_full, dy_full = (torch.randn(b, s, dim, generator=gen).to(dtype).double().to(device) for _ in range(2))
    ang = torch.randn(s, d // 2, generator=gen, dtype=torch.float64).to(device)
    cp_tokens = [torch.tensor([i for a, n in pieces(placement, q, cp, s) for i in range(a, a + n)], device=device)
                 for q in range(cp)]
    mine = cp_tokens[pr][t * s_tp:(t + 1) * s_tp]
    ref = {k: v.clone().requires_grad_() for k, v in p0.items()}
    xr = x_full.clone().requires_grad_()
    reference_block(xr, ref, h, hkv, d, ang, qk_norm, causal).backward(dy_full)

    # this TP shard's parameters
    q_rows = torch.arange(t * ht * d, (t + 1) * ht * d, device=device)
    k_rows = h * d + torch.arange(t * kvt * d, (t + 1) * kvt * d, device=device)
    rows = torch.cat([q_rows, k_rows, k_rows + hkv * d])
    cols = q_rows
    shard = {"w_qkv": p0["w_qkv"][rows], "b_qkv": p0["b_qkv"][rows], "w_o": p0["w_o"][:, cols], "b_o": p0["b_o"],
             "nq": p0["nq"], "nk": p0["nk"]}
    par = {k: v.to(dtype).requires_grad_() for k, v in shard.items()}
    ang_cp = ang[cp_tokens[pr]].to(dtype)
    ang_all = ang[torch.cat(cp_tokens)].to(dtype)

    def prep(branch, y4, w, gathered):
        if w is not None:
            y4 = rms(y4, w)
        return rope(y4, ang_all if gathered else ang_cp)
    x = x_full[:, mine].to(dtype).requires_grad_()
    weights = LayerWeights(par["w_qkv"], par["w_o"], par["b_qkv"], par["b_o"], par["nq"] if qk_norm else None,
                           par["nk"] if qk_norm else None)
    y = tp_cp_self_attention(x, weights, TpCpGroups(tp_g, cp_g, tcp_g), num_heads=ht, num_kv_heads=kvt, prep=prep,
                             head_chunks=chunks, causal=causal, placement=placement, form=form)
    y.backward(dy_full[:, mine].to(dtype))
    with torch.no_grad():
        y_ref = reference_block(x_full, p0, h, hkv, d, ang, qk_norm, causal)
    errs = {"out": rel_err(y, y_ref[:, mine]), "dx": rel_err(x.grad, xr.grad[:, mine])}
    if baseline is not None:  # the same block on one device in ``dtype`` (torch's own kernels): its errors
        bp = {k: v.to(dtype).requires_grad_() for k, v in p0.items()}
        xb = x_full.to(dtype).requires_grad_()
        single_device_block(xb, bp, h, hkv, d, ang.to(dtype), qk_norm, causal).backward(dy_full.to(dtype))
        baseline.update({"dw_qkv": rel_err(bp["w_qkv"].grad, ref["w_qkv"].grad), "dx": rel_err(xb.grad, xr.grad),
                         "dw_o": rel_err(bp["w_o"].grad, ref["w_o"].grad), "db_o": rel_err(bp["b_o"].grad, ref["b_o"].grad),
                         "db_qkv": rel_err(bp["b_qkv"].grad, ref["b_qkv"].grad)})
        with torch.no_grad():
            baseline["out"] = rel_err(single_device_block(x_full.to(dtype), {k: v.to(dtype) for k, v in p0.items()},
                                                          h, hkv, d, ang.to(dtype), qk_norm, causal), y_ref)
        for n in ("nq", "nk"):
            if qk_norm:
                baseline["d" + n] = rel_err(bp[n].grad, ref[n].grad)
    for name, sel in (("w_qkv", lambda g: g[rows]), ("b_qkv", lambda g: g[rows]), ("w_o", lambda g: g[:, cols])):
        grad = par[name].grad.double()
        dist.all_reduce(grad, group=cp_g)             # Megatron's DP x CP gradient reduction
        errs["d" + name] = rel_err(grad, sel(ref[name].grad))
    for name in ("b_o",) + (("nq", "nk") if qk_norm else ()):
        grad = par[name].grad.double()
        dist.all_reduce(grad)                          # replicated over TP (sequence-parallel): TP and CP sums
        errs["d" + name] = rel_err(grad, ref[name].grad)
    return errs


# the largest error (vs float64) of the unsharded bf16 block that a bf16 case's errors are divided by: its errors
# reach 4e-2 (a GQA case without QK-norm on H200, large logits); 2.5x that. A baseline further off (or not finite:
# an inf one turned every error into 0) is a kernel fault, and the case is refused instead of judged against it.
BASELINE_CAP = 1e-1


def normalised_errs(errs: dict, baseline: dict) -> dict:
    """Each error divided by the unsharded bf16 block's own error of that name (floor 1e-2); ValueError naming the
    first baseline error that is not a finite number <= BASELINE_CAP."""
    return {k: e / max(checked_reference_err(baseline[k], BASELINE_CAP, f"unsharded bf16 block's {k}"), 1e-2)
            for k, e in errs.items()}


def tp_cp_block_family(rank: int, world: int) -> list:
    """TP2 x CP2 on 4 ranks (TP2 x CP1 on 2): the three forms (18 cases), GQA, HCMS chunks, causal (zigzag) and
    not; float64 (the stream schedule, tol 1e-10) and bf16 (the kernels): bf16 errors against float64 divided by
    the unsharded bf16 block's own errors (floor 1e-2; ``normalised_errs``: refused when a baseline error is not
    finite or over BASELINE_CAP), tol 1.5 (un-normalised, a GQA case without QK-norm reaches 4e-2 on H200: its
    logits are large and the one-device bf16 block is as far from float64)."""
    rec = []
    for dtype in (torch.float64, torch.bfloat16):
        for form in ("pipelined", "mixed", "mixed_in"):
            for (h, hkv, chunks, qk_norm, causal) in ((8, 8, 1, True, False), (8, 4, 2, True, True),
                                                      (8, 2, 1, False, True)):
                base: "dict | None" = {} if dtype != torch.float64 else None
                errs = tp_cp_case(rank, world, 2, form=form, h=h, hkv=hkv, d=64, chunks=chunks, qk_norm=qk_norm,
                                  causal=causal, s_tp=max(4, 128 // SHRINK), dim=256, b=1, dtype=dtype, device=DEV,
                                  baseline=base)
                r = {"family": "tp-cp-block", "case": f"TP=2 CP={world // 2} {form} {dtype} H={h}/{hkv} "
                     f"C={chunks} norm={qk_norm} causal={causal} zigzag", "errs": errs,
                     "tol": 1e-10 if dtype == torch.float64 else 1.5}
                if base is not None:  # bf16: each error relative to the unsharded bf16 block's own error
                    r["baseline"] = base
                    try:
                        r["errs"] = normalised_errs(errs, base)
                    except ValueError as e:
                        r["refused"] = str(e)
                rec.append(r)
    return rec


MEGATRON_FORMS = ("pipelined", "mixed", "mixed_in", "auto")


def tp_cp_megatron_family(rank: int, world: int) -> list:
    """Megatron's own TP sequence-parallel self-attention (SPSelfAttention.running("megatron"): megatron-core's
    local layers) against the TP x CP block's forms and ``auto`` (its FormPolicy; on CUDA timed with CUDA events,
    the calibration on detached copies) in the same module and weights, TP2 x CP(world / 2), fp32, zigzag:
    output, input grad and every parameter grad after Megatron's reductions (TP-sharded: summed over CP;
    replicated: over TP and CP), each relative to Megatron's path. 2 shapes x 4 forms = 8 cases, tol 1e-4."""
    from megatron.core import parallel_state as ps

    from tools.bench_block import build_tp_attention, zigzag_freqs
    if DEV == "cpu":  # Megatron's SP layers allocate their buffers on torch.cuda.current_device(): no CPU path
        torch.cuda.current_device = lambda: "cpu"
    tp, cp, dim, heads, hn = 2, world // 2, 128, 8, 16
    rec = []
    for kv, chunks, causal in ((4, 2, True), (8, 1, False)):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        try:
            attn = build_tp_attention(tp, cp, dim=dim, heads=heads, kv_heads=kv, chunks=chunks, causal=causal,
                                      qk_norm=True, dtype=torch.float32, device=DEV)
            tp_g, cp_g = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
            s = 32 * world
            gen = torch.Generator().manual_seed(11 + rank)
            x0, dy = (torch.randn(s // world, 1, dim, generator=gen).to(DEV) for _ in range(2))
            freqs = zigzag_freqs(s, hn, ps.get_context_parallel_rank(), cp, DEV)
            res = {}
            for form in ("megatron",) + MEGATRON_FORMS:
                attn.zero_grad(set_to_none=True)
                x = x0.clone().requires_grad_()
                with contextlib.nullcontext() if form == "auto" else attn.running(form):
                    y, bias = attn(x, None, rotary_pos_emb=freqs)
                y = y + bias  # linear_proj's skip_bias_add: the layer adds it (bias-dropout-add)
                y.backward(dy)
                r = {"out": y.detach(), "dx": x.grad}
                for n, p in attn.named_parameters():
                    assert p.grad is not None, (form, n)
                    gr = p.grad.clone()
                    dist.all_reduce(gr, group=cp_g)  # Megatron's DP x CP gradient reduction
                    if not getattr(p, "tensor_model_parallel", False):  # replicated under SP: partial over TP too
                        dist.all_reduce(gr, group=tp_g)
                    r["d" + n] = gr
                res[form] = r
            ref = res.pop("megatron")
            for form, r in res.items():
                rec.append({"family": "tp-cp-megatron", "case": f"TP=2 CP={cp} {form} vs Megatron's TP-SP layer fp32 "
                            f"H={heads}/{kv} C={chunks} causal={causal} zigzag",
                            "errs": {k: rel_err(v, ref[k]) for k, v in r.items()}, "tol": 1e-4})
        finally:
            ps.destroy_model_parallel()
    return rec
