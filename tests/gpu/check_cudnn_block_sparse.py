"""cuDNN frontend's block-sparse attention through the registry's "cudnn_block_sparse" kernel on ONE GPU (#69): the
first contact, before the CUDA suite's family and the kernel table. Correctness against the math kernel (fp32, same
device), then a first timing, in one job (one process: a CuTe DSL compile failure shows here with its message).

Cases (bf16, D=128): 128- and 64-token tiles, random per-head / random with an empty query tile / window / all-True
masks, causal (diagonal blocks on FA4, merged by lse) and not, GQA 8/2 and MHA 4/4, S=2048; and a short last tile
(S=2008, causal and not), padded keys (kv_valid_len), q/k/v in [B, S, H, D] memory. Each row: relative errors of out,
lse (live rows), dq, dk, dv; rows that select nothing must give out 0 and lse -inf. Timing: S=--seq, H=40, fwd+bwd
through the kernels' forward/backward-from-lse (a ring step's calls), cuDNN's block sparsity vs FA4's vs dense FA4,
64/128-token tiles, window/random at 0.8/0.9, the metadata build apart (``meta_ms``).

    python tests/gpu/check_cudnn_block_sparse.py --out $OUT     # check_cudnn_block_sparse.json; exit 1 on a wrong case
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
from tests.gpu.check_fa4_tiles import mask_of, rel  # noqa: E402

NAME = "cudnn_block_sparse"
TOL = 2e-2   # bf16 against fp32


def cases() -> list:
    out = [dict(bs=bs, kind=kind, causal=causal, h=h, hkv=hkv, s=2048, valid=None, bshd=False)
           for bs in (128, 64) for kind in ("random", "random_empty", "window", "all") for causal in (False, True)
           for h, hkv in ((8, 2), (4, 4))]
    out += [dict(bs=bs, kind="random_empty", causal=causal, h=4, hkv=2, s=2008, valid=None, bshd=False)
            for bs in (128, 64) for causal in (False, True)]                       # a short last tile
    out += [dict(bs=bs, kind="random", causal=False, h=4, hkv=4, s=2048, valid=1948, bshd=False)
            for bs in (128, 64)]                                                    # padded keys
    out += [dict(bs=bs, kind="random_empty", causal=causal, h=8, hkv=8, s=2048, valid=None, bshd=True)
            for bs in (128, 64) for causal in (False, True)]                       # [B, S, H, D] memory
    return out


def check(args, dev) -> list:
    cb, ref = kernels.get(NAME), kernels.get(kernels.FALLBACK)
    g = torch.Generator().manual_seed(0)
    rows = []
    todo = cases()
    if args.cases:
        todo = [todo[int(i)] for i in args.cases.split(",")]
    shrink = getattr(args, "shrink", 1)   # S and kv_valid_len divided (the CPU test's sizes)
    todo = [dict(c, s=c["s"] // shrink, valid=c["valid"] // shrink if c["valid"] else None) for c in todo]
    d = args.head_dim
    for c in todo:
        t = -(-c["s"] // c["bs"])
        bm = mask_of(c["kind"], c["h"], t, 0.7, g).to(dev)
        pos = torch.arange(c["s"], device=dev)
        ts = TileSlice(bm, c["bs"], pos, pos, slice(None), c["valid"], contiguous=True)
        if c["bshd"]:
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
        row["why_not"] = cb.why_not(call)
        try:
            o, lse = cb.forward(q, k, v, 0.088, c["causal"], ts)
            dq, dk, dv = cb.backward(do, q, k, v, o, lse, 0.088, c["causal"], ts)
            o_r, lse_r = ref.forward(q.float(), k.float(), v.float(), 0.088, c["causal"], ts)
            g_r = ref.backward(do.float(), q.float(), k.float(), v.float(), o_r, lse_r, 0.088, c["causal"], ts)
            live = torch.isfinite(lse_r)
            row.update(out=rel(o, o_r), dq=rel(dq, g_r[0]), dk=rel(dk, g_r[1]), dv=rel(dv, g_r[2]),
                       lse=rel(torch.where(live, lse, 0), torch.where(live, lse_r, 0)),
                       dead_rows=int((~live).sum()), dead_lse_ok=bool((lse[~live] < -1e30).all()),
                       dead_out_max=float(o.float()[~live].abs().max()) if (~live).any() else 0.0,
                       block=cb_block(ts, c))
        except Exception as e:  # noqa: BLE001 - record and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cb_block(ts, c) -> int:
    """The kernel block the call ran with (64 or 128)."""
    from megatron_sp_ext.attention.kernels import cudnn_block_sparse  # noqa: PLC0415
    return cudnn_block_sparse.block_metadata(ts, c["s"], c["s"], c["causal"]).block


def wrong(row: dict) -> bool:
    """A case that failed: an error, an error above TOL, or rows that select nothing not giving out 0 / lse -inf."""
    return "error" in row or max(row.get(x, 0.0) for x in ("out", "lse", "dq", "dk", "dv")) > TOL or \
        not row.get("dead_lse_ok", True) or row.get("dead_out_max", 0.0) > 0.0


def timing(args, dev) -> list:
    """fwd+bwd ms (forward with lse, backward from it) of dense FA4, FA4's and cuDNN's block sparsity at S=--seq,
    H=40, D=128; useful TFLOP/s = 3.5 * 4 * D * selected pairs / time; ``vs_dense`` = that over dense FA4's."""
    s, h, d = args.seq, 40, args.head_dim
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, h, s, d, generator=g).to(dev, torch.bfloat16) for _ in range(4))
    fa4 = kernels.get("fa4")
    rows = []
    dense = None
    if fa4.why_not(kernels.KernelCall.of(q, "lse")) is None:
        def dense_call():
            o, lse = fa4.forward(q, k, v, 0.088, False)
            return fa4.backward(do, q, k, v, o, lse, 0.088, False)
        dense = median_ms(dense_call, 10, 2, None)
        rows.append(dict(kernel="fa4 dense", ms=dense, tflops=3.5 * 4 * d * s * s * h / dense / 1e9))
    for bs in (128, 64):
        t = s // bs
        for kind in ("window", "random"):
            for sp in (0.8, 0.9):
                bm = mask_of(kind, h, t, sp, g).to(dev)
                pairs = float(bm.expand(h, t, t).sum()) * bs * bs
                for name in (NAME, "fa4"):
                    kern = kernels.get(name)
                    pos = torch.arange(s, device=dev)
                    ts = TileSlice(bm, bs, pos, pos, contiguous=True)
                    row = dict(kernel=name, bs=bs, mask=kind, sparsity=1 - pairs / (h * s * s))
                    reason = kern.why_not(kernels.KernelCall(dev, torch.bfloat16, d, frozenset({"tiles", "lse"}), ts))
                    if reason is not None:
                        row["not_here"] = reason
                        rows.append(row)
                        continue
                    try:
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        kern.prepare(ts, s, s, False)
                        torch.cuda.synchronize()
                        row["meta_ms"] = (time.perf_counter() - t0) * 1e3

                        def call(kern=kern, ts=ts):
                            o, lse = kern.forward(q, k, v, 0.088, False, ts)
                            return kern.backward(do, q, k, v, o, lse, 0.088, False, ts)
                        row["ms"] = median_ms(call, 10, 2, None)
                        row["tflops_useful"] = 3.5 * 4 * d * pairs / row["ms"] / 1e9
                        if dense is not None:
                            row["vs_dense"] = row["tflops_useful"] / rows[0]["tflops"]
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--head-dim", type=int, default=128, help="head dim of every case (its SM90 backward: 128)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--cases", default="", help="comma-separated case indices to run (default: all)")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    res = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "check": check(args, dev)}
    bad = [r for r in res["check"] if wrong(r)]
    if not args.skip_timing:
        res["timing"] = timing(args, dev)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_cudnn_block_sparse.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"check: {len(res['check']) - len(bad)} of {len(res['check'])} right")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
