"""Shared pieces of the attention-block tests: parameters, the two prep forms, and a float64
single-device reference of the whole block on the full sequence.

Block: y = out_proj(attention(rope(rms(q)), rope(rms(k)), v)) with q|k|v = x W_qkv^T + b_qkv; the
RMS norm runs over all heads of a branch (Wan's QK-norm), RoPE at the tokens' global positions.
"""
from __future__ import annotations

import torch

from tests.reference import reference_attention

EPS = 1e-6


def _acc(t):
    """The norm's compute dtype: at least float32 (float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms(y, w, eps=EPS):
    out = _acc(y) * torch.rsqrt(_acc(y).pow(2).mean(-1, keepdim=True) + eps)
    return (out * _acc(w)).to(y.dtype)


def rope(x, ang):
    """Rotate pairs of x [B, S, n, D] by angles [S, D/2]."""
    cos, sin = ang.cos().to(x.dtype)[None, :, None, :], ang.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


def block_params(gen, h, hkv, d, dim) -> dict:
    """w_qkv [(H + 2 Hkv) D, dim] (q | k | v rows), b_qkv, w_o [dim, H D], b_o, QK-norm weights."""
    return {"w_qkv": torch.randn((h + 2 * hkv) * d, dim, generator=gen) * 0.2,
            "b_qkv": torch.randn((h + 2 * hkv) * d, generator=gen) * 0.1,
            "w_o": torch.randn(dim, h * d, generator=gen) * 0.2, "b_o": torch.randn(dim, generator=gen) * 0.1,
            "nq": 1 + 0.1 * torch.randn(h * d, generator=gen), "nk": 1 + 0.1 * torch.randn(hkv * d, generator=gen)}


def local_prep(h, hkv, d, ang=None):
    """The plain/async blocks' prep: norm over all heads of this rank's tokens, RoPE with ``ang``."""
    def prep(branch, y, w):
        y = rms(y, w) if w is not None else y
        y4 = y.view(y.shape[0], y.shape[1], h if branch == "q" else hkv, d)
        return rope(y4, ang) if ang is not None else y4
    return prep


def gathered_prep(h, hkv, d, ang=None):
    """The all-gather block's prep: this rank's heads of every token; the norm's sum of squares over
    all ranks' heads, RoPE with the gathered angles of ``ang`` (this rank's tokens' table)."""
    def prep(branch, y, w, shard):
        y4 = y.view(y.shape[0], y.shape[1], -1, d)
        if w is not None:
            width = (h if branch == "q" else hkv) * d
            r = torch.rsqrt(shard.sum_sq(y4, branch) / width + EPS)
            y4 = (_acc(y4) * r * _acc(shard.norm_weight(w, branch, d))).to(y.dtype)
        return rope(y4, shard.gather_tokens(ang)) if ang is not None else y4
    return prep


def reference_block(x_full, p, h, hkv, d, ang_full, qk_norm, causal=False, kv_valid=None):
    """The block on the full sequence x [B, S, dim] in float64, one device; differentiable."""
    b, s, _ = x_full.shape
    qkv = x_full @ p["w_qkv"].t() + p["b_qkv"]
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    if qk_norm:
        q, k = rms(q, p["nq"]), rms(k, p["nk"])
    q = rope(q.view(b, s, h, d), ang_full)
    k = rope(k.reshape(b, s, hkv, d), ang_full)
    mask = None
    if causal or kv_valid is not None:
        mask = torch.ones(s, s, dtype=torch.bool, device=x_full.device)
        if causal:
            mask = mask.tril()
        if kv_valid is not None:
            mask[:, kv_valid:] = False
    o = reference_attention(q, k, v.reshape(b, s, hkv, d), mask=mask)
    return o.reshape(b, s, h * d) @ p["w_o"].t() + p["b_o"]


def reference_case(rank, world, form, h, hkv, d, chunks, qk_norm, causal=False, placement="contiguous",
                   kv_valid=None, *, device="cpu", dtype=torch.float64, check=True, **block_kw):
    """The async ("async") or all-gather ("allgather") block in ``dtype`` (default float64) on this rank's tokens
    against ``reference_block`` (float64) on the full sequence: output and input grad of this rank's tokens, every
    parameter grad (summed over ranks: the CP gradient reduction). check: assert each error < 1e-10 and return
    the number of checks; else return {name: relative error}. block_kw: passed to the block (e.g. the all-gather
    block's fused=True, a transport)."""
    import torch.distributed as dist

    import megatron_sp_ext as spx
    from megatron_sp_ext.sp.placement import pieces
    from tests.reference import rel_err
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(31)
    dim, b, sl = 24, 2, 6
    s = sl * world
    # values representable in ``dtype``: the reference sees exactly the inputs the block sees
    p0 = {k: v.to(dtype).double().to(device) for k, v in block_params(gen, h, hkv, d, dim).items()}
    x_full, dy_full = (torch.randn(b, s, dim, generator=gen).to(dtype).double().to(device) for _ in range(2))
    ang_full = torch.randn(s, d // 2, generator=gen, dtype=torch.float64).to(device)
    mine = torch.tensor([i for a, n in pieces(placement, rank, world, s) for i in range(a, a + n)], device=device)
    names = ["w_qkv", "b_qkv", "w_o", "b_o"] + (["nq", "nk"] if qk_norm else [])
    ref_p = {k: v.clone().requires_grad_() for k, v in p0.items()}
    xr = x_full.clone().requires_grad_()
    y_ref = reference_block(xr, ref_p, h, hkv, d, ang_full, qk_norm, causal, kv_valid)
    y_ref.backward(dy_full)
    p = {k: v.to(dtype).requires_grad_() for k, v in p0.items()}
    x = x_full[:, mine].to(dtype).requires_grad_()
    kw = dict(num_heads=h, num_kv_heads=hkv, head_chunks=chunks, causal=causal, placement=placement,
              kv_valid_len=kv_valid, **block_kw)
    weights = spx.LayerWeights(p["w_qkv"], p["w_o"], p["b_qkv"], p["b_o"], p["nq"] if qk_norm else None,
                               p["nk"] if qk_norm else None)
    if form == "async":
        y = spx.async_ulysses_self_attention(x, weights, g, prep=local_prep(h, hkv, d, ang_full[mine]), **kw)
    else:
        y = spx.allgather_self_attention(x, weights, g, prep=gathered_prep(h, hkv, d, ang_full[mine]), **kw)
    y.backward(dy_full[:, mine].to(dtype))
    checks = [("out", y, y_ref[:, mine]), ("dx", x.grad, xr.grad[:, mine])]
    for k in names:
        grad = p[k].grad.double()
        dist.all_reduce(grad)
        checks.append(("d" + k, grad, ref_p[k].grad))
    if not check:
        return {name: rel_err(a, ref) for name, a, ref in checks}
    for name, a, ref in checks:
        err = rel_err(a, ref)
        assert err < 1e-10, f"{form} H={h}/{hkv} C={chunks} norm={qk_norm} causal={causal} {name}: {err:.2e}"
    return len(checks)
