"""FlashAttention-4's block sparsity through the registry's "fa4" kernel on ONE GPU: correctness against the math
kernel (fp32, same device) and a first timing, in one job. Cases: 128- and 64-token tiles (64: partial kernel
blocks through the mask_mod), random per-head / window / all-True / empty query tiles, causal and not, GQA, padded
keys, a ragged length. Timing: S=32,768, H=40, D=128, bf16, fwd+bwd, FA4 block-sparse vs FA4 dense vs flex.

    python tests/gpu/check_fa4_tiles.py --out $OUT          # writes check_fa4_tiles.json, prints a table
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron_sp_ext.attention import kernels  # noqa: E402
from megatron_sp_ext.attention.tiles import TileSlice  # noqa: E402
from tools.benchlib import median_ms  # noqa: E402


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def mask_of(kind: str, h: int, t: int, sparsity: float, g: torch.Generator) -> torch.Tensor:
    if kind == "all":
        return torch.ones(1, t, t, dtype=torch.bool)
    if kind == "window":
        w = max(0, round((1 - sparsity) * t / 2))
        i = torch.arange(t)
        return ((i[:, None] - i[None, :]).abs() <= w)[None]
    keep = max(1, round((1 - sparsity) * t))
    scores = torch.rand(h, t, t, generator=g)
    m = torch.zeros(h, t, t, dtype=torch.bool).scatter_(-1, scores.topk(keep, -1).indices, True)
    if kind == "random_empty":
        m[:, 1] = False
    return m


def check(args, dev) -> list:
    fa4, ref = kernels.get("fa4"), kernels.get("math")
    rows = []
    g = torch.Generator().manual_seed(0)
    cases = []
    for bs in (128, 64):
        for kind in ("random", "random_empty", "window", "all"):
            for causal in (False, True):
                for h, hkv in ((8, 2), (4, 4)):
                    cases.append(dict(bs=bs, kind=kind, causal=causal, h=h, hkv=hkv, s=2048, valid=None))
    cases += [dict(bs=128, kind="random", causal=False, h=4, hkv=4, s=2048 - 40, valid=None),
              dict(bs=128, kind="random", causal=False, h=4, hkv=4, s=2048, valid=2048 - 100),
              dict(bs=64, kind="window", causal=True, h=4, hkv=2, s=1984, valid=1900)]
    if args.dit:   # the DiT sparse family's shapes: 8 or 4 heads (MHA), head dim 64 (and 128), top-k 3 of 8 tiles
        # per head and query tile, q/k/v handed over as [B, S, H, D] memory (what the DiT passes), S 1024 and 540
        cases = [dict(bs=128, kind="topk3", causal=False, h=h, hkv=h, s=s, valid=None, d=d, bshd=bshd)
                 for d in (64, 128) for h in (8, 4) for s in (1024, 540) for bshd in (True, False)]
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    for c in cases:
        t = -(-c["s"] // c["bs"])
        bm = (mask_of("random", c["h"], t, 1 - 3 / t, g) if c["kind"] == "topk3" else
              mask_of(c["kind"], c["h"], t, 0.7, g)).to(dev)
        pos = torch.arange(c["s"], device=dev)
        ts = TileSlice(bm, c["bs"], pos, pos, slice(None), c["valid"])
        d = c.get("d", 128)
        if c.get("bshd"):   # [B, S, H, D] memory seen as [B, H, S, D]
            q, do = (torch.randn(1, c["s"], c["h"], d, generator=g).to(dev, torch.bfloat16).transpose(1, 2)
                     for _ in range(2))
            k, v = (torch.randn(1, c["s"], c["hkv"], d, generator=g).to(dev, torch.bfloat16).transpose(1, 2)
                    for _ in range(2))
        else:
            q, do = (torch.randn(1, c["h"], c["s"], d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(1, c["hkv"], c["s"], d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
        row = dict(c)
        call = kernels.KernelCall(dev, torch.bfloat16, d,
                                  frozenset({"tiles", "lse"} | ({"causal"} if c["causal"] else set())), ts)
        row["why_not"] = fa4.why_not(call)
        try:
            o, lse = fa4.forward(q, k, v, 0.088, c["causal"], ts)
            dq, dk, dv = fa4.backward(do, q, k, v, o, lse, 0.088, c["causal"], ts)
            o_r, lse_r = ref.forward(q.float(), k.float(), v.float(), 0.088, c["causal"], ts)
            g_r = ref.backward(do.float(), q.float(), k.float(), v.float(), o_r, lse_r, 0.088, c["causal"], ts)
            live = torch.isfinite(lse_r)
            row.update(out=rel(o, o_r), dq=rel(dq, g_r[0]), dk=rel(dk, g_r[1]), dv=rel(dv, g_r[2]),
                       lse=rel(torch.where(live, lse, 0), torch.where(live, lse_r, 0)),
                       dead_rows=int((~live).sum()), dead_lse_ok=bool((lse[~live] < -1e30).all()),
                       dead_out_max=float(o.float().permute(0, 1, 2, 3)[~live].abs().max()) if (~live).any() else 0.0,
                       partial=ts.cache[("fa4_meta", c["s"], c["s"], c["causal"], True)].aux is not None)
        except Exception as e:  # noqa: BLE001 - record and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def ms(fn, iters: int = 10) -> float:
    """Median ms of ``iters`` calls after 2 warm-up calls (CUDA events; one process: no group)."""
    return median_ms(fn, iters, 2, None)


def timing(args, dev) -> list:
    fa4, flex = kernels.get("fa4"), kernels.get("flex")
    s, h, d = args.seq, 40, 128
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, h, s, d, generator=g).to(dev, torch.bfloat16) for _ in range(4))
    rows = []
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    dense = ms(lambda: torch.autograd.grad(fa4.attention(qr, kr, vr, False, 0.088), (qr, kr, vr), do))
    rows.append(dict(kernel="fa4 dense", ms=dense, tflops=3.5 * 4 * d * s * s * h / dense / 1e9))
    for bs in (128, 64):
        t = s // bs
        for kind in ("window", "random"):
            for sp in (0.8, 0.9):
                bm = mask_of(kind, h, t, sp, g).to(dev)
                pos = torch.arange(s, device=dev)
                pairs = float(bm.expand(h, t, t).sum()) * bs * bs
                for name, kern in (("fa4", fa4), ("flex", flex)) if bs == 128 else (("fa4", fa4),):
                    ts = TileSlice(bm, bs, pos, pos)
                    row = dict(kernel=name, bs=bs, mask=kind, sparsity=1 - pairs / (h * s * s))
                    try:
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        kern.prepare(ts, s, s, False)
                        torch.cuda.synchronize()
                        row["meta_ms"] = (time.perf_counter() - t0) * 1e3
                        f = lambda: torch.autograd.grad(kern.attention(qr, kr, vr, False, 0.088, ts), (qr, kr, vr), do)  # noqa: E731
                        row["ms"] = ms(f)
                        row["tflops_useful"] = 3.5 * 4 * d * pairs / row["ms"] / 1e9
                        row["vs_dense_eff"] = row["tflops_useful"] / rows[0]["tflops"]
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--dit", action="store_true", help="the DiT sparse family's shapes instead (head dim 64, MHA)")
    ap.add_argument("--cases", default="", help="comma-separated case indices to run (default: all)")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    res = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "check": check(args, dev)}
    if not args.skip_timing:
        res["timing"] = timing(args, dev)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_fa4_tiles.json"), "w") as f:
        json.dump(res, f, indent=1)
    bad = [r for r in res["check"] if "error" in r or max(r.get(x, 0) for x in ("out", "dq", "dk", "dv")) > 2e-2]
    print(f"check: {len(res['check']) - len(bad)} of {len(res['check'])} right")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
