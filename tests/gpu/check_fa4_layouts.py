"""FlashAttention-4's dense forward/backward against float64, per head dim, length and memory order of ``out``/``dout``.

Why: on 2 x H100 (2026-11-25) the dynamic-SP Ulysses path missed its bf16 gradients (dq 5.9e-2 against SP=1's
1.3e-2) on the tiny test DiT (head dim 8), while the ring on the same FA4 passed; that path was the only one handing
FA4's backward a head-major ``out`` ([B, H, S, D] memory order). This check separates the suspects in one short
GPU job: for each (head dim, sequence length, GQA) it runs FA4's own forward (``flash_attn.cute.interface``) and
its backward three ways: ``out``/``dout`` in FA4's own [B, S, H, D] order, ``out`` head-major, both head-major;
and each of the library's varlen methods (attention/varlen.py: per_sample, grouped, flash_varlen, fa4_varlen; one
that cannot run here is recorded as skipped) on backend "fa4" over two samples of the same rows. Each is compared with float64 math: the
relative max error of out, lse, dq, dk, dv (bf16 passes below 2e-2; fp32 math on the same bf16 inputs is the
floor, reported beside it).

    python tests/gpu/check_fa4_layouts.py --out $OUT          # CUDA + FA4: ~20-40 s (first calls compile)
    (tests/test_check_fa4_layouts.py runs it on the CPU stand-in of FA4, tests/fake_fa4.py)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_sp_ext.attention import backends, varlen  # noqa: E402

TOL = 2e-2
ORDERS = ("own", "out_head_major", "both_head_major")


def _reference(q_bshd, k_bshd, v_bshd, do_bshd, scale):
    """float64 (out, lse [B, H, S], dq, dk, dv) of non-causal attention with GQA (k/v heads repeated)."""
    q, k, v, do = (t.detach().double().requires_grad_(t is not do_bshd) for t in (q_bshd, k_bshd, v_bshd, do_bshd))
    rep = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return out.detach(), lse.detach(), dq, dk, dv


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _head_major(t_bshd: torch.Tensor) -> torch.Tensor:
    """The same values as a [B, S, H, D] view of [B, H, S, D] memory."""
    return t_bshd.transpose(1, 2).contiguous().transpose(1, 2)


def check_case(head_dim: int, seqlen: int, heads: int, kv_heads: int, device, dtype, seed: int = 0) -> dict:
    """One (head dim, length, heads) case: errors of each ``out``/``dout`` order and of the varlen call."""
    iface = __import__("flash_attn.cute.interface", fromlist=["_flash_attn_fwd"])
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(1, seqlen, heads, head_dim, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, seqlen, kv_heads, head_dim, generator=g).to(device, dtype) for _ in range(2))
    scale = head_dim ** -0.5
    ref = _reference(q, k, v, do, scale)
    out, lse = iface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=False, return_lse=True)[:2]
    row = {"head_dim": head_dim, "seqlen": seqlen, "heads": heads, "kv_heads": kv_heads, "dtype": str(dtype),
           "out": _rel(out, ref[0]), "lse": _rel(lse, ref[1])}
    for order in ORDERS:
        o = out if order == "own" else _head_major(out)
        d = _head_major(do) if order == "both_head_major" else do
        try:
            dq, dk, dv = iface._flash_attn_bwd(q, k, v, o, d, lse.float().contiguous(), scale, False)[:3]
            row[order] = {n: _rel(x, r) for n, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:])}
        except Exception as e:  # noqa: BLE001 - a refused layout is a finding, recorded
            row[order] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    # the library's varlen methods on two samples (this case's rows cut unevenly), backend "fa4": bhsd views
    cu = (0, seqlen // 3, seqlen)
    be = backends.get_backend("fa4")
    q_b, k_b, v_b, do_b = (t.transpose(1, 2) for t in (q, k, v, do))
    refs = [_reference(*(t[:, a:b] for t in (q, k, v, do)), scale) for a, b in zip(cu, cu[1:])]
    cat = [torch.cat([r[i] for r in refs], 1) for i in (0, 2, 3, 4)]
    for method in varlen.METHODS:
        try:
            o_v, lse_v = varlen.forward_lse(method, be, q_b, k_b, v_b, cu, causal=False, scale=scale)
            grads = varlen.backward_lse(method, be, do_b, q_b, k_b, v_b, o_v, lse_v, cu, causal=False, scale=scale)
            row[f"varlen_{method}"] = {"out": _rel(o_v.transpose(1, 2), cat[0]), **{
                n: _rel(x.transpose(1, 2), r) for n, x, r in zip(("dq", "dk", "dv"), grads, cat[1:])}}
        except Exception as e:  # noqa: BLE001 - a method that cannot run here is recorded, not a failure
            row[f"varlen_{method}"] = {"skipped": f"{type(e).__name__}: {str(e)[:160]}"}
    row["ok"] = all(e <= TOL for e in _errors(row))
    return row


def _errors(row: dict) -> list:
    out = [row["out"], row["lse"]]
    for key in (*ORDERS, *(f"varlen_{m}" for m in varlen.METHODS)):
        out += [v for v in row[key].values() if isinstance(v, float)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--head-dims", default="8,16,64,128")
    ap.add_argument("--seqlens", default="45,64,90,1000")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), torch.bfloat16
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for heads, kv in ((4, 4), (4, 2)):
                rows.append(check_case(d, s, heads, kv, device, dtype))
                print(json.dumps(rows[-1]), flush=True)
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if device.type == "cuda"
           else "cpu", "torch": torch.__version__, "tol": TOL, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_fa4_layouts.json"), "w") as f:
        json.dump(res, f, indent=1)
    bad = [r for r in rows if not r["ok"]]
    print(f"check_fa4_layouts: {len(rows) - len(bad)} of {len(rows)} within {TOL}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
