r"""Local attention kernels side by side on one GPU, one job: FlashAttention-4 ("fa4") against cuDNN ("cudnn", what
torch's SDPA picks on Hopper and what every mode ran before FA4), through the library's own kernel calls.

Rows (bf16, B=1, head dim 128 unless --head-dim):
  plain      differentiable call (``get_backend(name)(q, k, v)``): fwd and fwd+bwd ms, TFLOP/s
  lse        the block form the ring / head-chunked blocks use (``forward_lse`` / ``backward_lse``): fwd, fwd+bwd
  gqa        plain with H/4 key-value heads (FA4 reads them as they are; cuDNN gets them expanded)
  varlen     packed samples (3-8 of them) in one call per kernel: fa4_varlen vs per-sample cuDNN calls
  cross      the DiT's cross-attention shape: S queries on 512 text keys, non-causal
For every row: each kernel's first call (compile) time, the medians (CUDA events, after warm-up), the speedup
(cuDNN time / FA4 time) and the outputs' and gradients' relative difference (FA4 vs cuDNN).

    python tools/bench_kernels.py --out $OUT            # default grid: S 8K..128K, H 40 (24 at 128K)

The speed plan's kernel-rate table (megatron_sp_ext/sp/speed_plan/rates.py gives the format):
    python tools/bench_kernels.py --rates --out $OUT    # one GPU: dense FA4 / cuDNN over S x H x causal, then the
                                                        # block-sparse kernels at 90% (bench_block_sparse --table);
                                                        # writes $OUT/kernel_rates.json
    python tools/bench_kernels.py --rates-from results/<day>/bench_kernels.json .../bench_block_sparse.json \
        --out $OUT                                      # the same table out of committed measurements
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext.attention import backends, kernels, varlen  # noqa: E402
from tools.bench_block_sparse import dense_fns  # noqa: E402
from tools.benchlib import median_ms, run_meta, write_json  # noqa: E402

KERNELS = ("cudnn", "fa4")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _flops(sq: int, sk: int, h: int, d: int, causal: bool) -> float:
    return 4.0 * sq * sk * h * d * (0.5 if causal else 1.0)


def _inputs(sq, sk, h, hkv, d, seed=0, bshd=False):
    """q, k, v, dO as [1, H, S, D]; ``bshd``: views of [1, S, H, D] memory (what the modes hand the kernel)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t(s, heads):
        x = torch.randn(1, s, heads, d, device="cuda", dtype=torch.bfloat16, generator=g) if bshd else \
            torch.randn(1, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
        return x.transpose(1, 2) if bshd else x
    return t(sq, h), t(sk, hkv), t(sk, hkv), t(sq, h)


def _plain(name, q, k, v, do, causal):
    qkv = [t.detach().requires_grad_() for t in (q, k, v)]
    return (*dense_fns(name, q, k, v, do, causal, leaves=qkv), qkv)


def _lse(name, q, k, v, do, causal):
    be = backends.get_backend(name)
    scale = q.shape[-1] ** -0.5
    box = {}

    def fwd():
        box["o"], box["lse"] = be.forward_lse(q, k, v, causal=causal, softmax_scale=scale)
        return box["o"]

    def fwd_bwd():
        o = fwd()
        box["g"] = be.backward_lse(do, q, k, v, o, box["lse"], causal=causal, softmax_scale=scale)
        return o
    return fwd, fwd_bwd, box


def _varlen(name, q, k, v, do, cu, causal):
    be = backends.get_backend(name)
    method = kernels.by_setting(name).caps.varlen or "per_sample"   # the kernel's own varlen call where it has one
    scale = q.shape[-1] ** -0.5
    box = {}

    def fwd():
        box["o"], box["lse"] = varlen.forward_lse(method, be, q, k, v, cu, causal=causal, scale=scale)
        return box["o"]

    def fwd_bwd():
        o = fwd()
        box["g"] = varlen.backward_lse(method, be, do, q, k, v, o, box["lse"], cu, causal=causal, scale=scale)
        return o
    return fwd, fwd_bwd, box


def _row(kind, make, flops, iters, warmup):
    row, outs = {"kind": kind}, {}
    for name in KERNELS:
        fwd, fwd_bwd, keep = make(name)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = fwd_bwd()
        torch.cuda.synchronize()
        row[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 3)
        row[f"{name}_fwd_ms"] = median_ms(fwd, iters, warmup, None)
        row[f"{name}_fwd_bwd_ms"] = median_ms(fwd_bwd, iters, warmup, None)
        row[f"{name}_fwd_tflops"] = round(flops / row[f"{name}_fwd_ms"] / 1e9, 1)
        row[f"{name}_bwd_tflops"] = round(2.5 * flops / (row[f"{name}_fwd_bwd_ms"] - row[f"{name}_fwd_ms"]) / 1e9, 1)
        o = fwd_bwd()
        grads = [t.grad for t in keep] if isinstance(keep, list) else list(keep["g"])
        outs[name] = [o.detach().clone()] + [g.detach().clone() for g in grads]
        del keep, o, grads
        torch.cuda.empty_cache()
    row["speedup_fwd"] = round(row["cudnn_fwd_ms"] / row["fa4_fwd_ms"], 3)
    row["speedup_fwd_bwd"] = round(row["cudnn_fwd_bwd_ms"] / row["fa4_fwd_bwd_ms"], 3)
    row["fa4_vs_cudnn_rel"] = {n: _rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), outs["fa4"], outs["cudnn"])}
    return row


def _write(path: str, rows: list) -> None:
    # after every row: a run cut short keeps what it measured
    write_json(path, {"meta": run_meta(torch=torch.__version__, cudnn=torch.backends.cudnn.version()), "rows": rows})


RATE_SEQLENS, RATE_HEADS = (2048, 4096, 8192, 16384, 32768, 65536), (4, 10, 20, 40)


def device_key(name: str) -> str:
    """The rate table's device key of a CUDA device name: "NVIDIA H200" -> "H200" (the whole name if no model)."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,3})\b", name)
    return m.group(1) if m else name


def rates_table(paths: list) -> dict:
    """The speed plan's kernel-rate table (megatron_sp_ext/sp/speed_plan/rates.py) from bench_kernels JSONs (their
    "plain" rows) and bench_block_sparse JSONs (their dense rows and Ulysses-layout block-sparse rows)."""
    devices: dict = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        dev = devices.setdefault(device_key(doc["meta"]["device"]), {"sm_count": 132, "dense": {}, "block_sparse": {}})
        for r in doc["rows"]:
            base = {"s": r["s"], "h": r["h"], "source": path}
            if r.get("kind") == "plain" and "sk" not in r and "hkv" not in r:   # bench_kernels
                for k in KERNELS:
                    dev["dense"].setdefault(k, []).append({**base, "causal": r["causal"], "fwd_ms": r[f"{k}_fwd_ms"],
                                                           "fwd_bwd_ms": r[f"{k}_fwd_bwd_ms"]})
            elif r.get("kind") == "dense" and r.get("p", 1) == 1 and "error" not in r:   # bench_block_sparse
                dev["dense"].setdefault(r["kernel"], []).append({**base, "causal": bool(doc["meta"].get("causal")),
                                                                 "fwd_ms": r["fwd_ms"], "fwd_bwd_ms": r["fwd_bwd_ms"]})
            elif r.get("kind") == "ulysses" and r.get("p", 1) == 1 and "fwd_ms" in r and "error" not in r:
                dev["block_sparse"].setdefault(r["kernel"], []).append(
                    {**base, "tile": r["block_size"], "density": round(1 - r["sparsity"], 4), "mask": r["mask"],
                     "fwd_ms": r["fwd_ms"], "fwd_bwd_ms": r["fwd_bwd_ms"]})
    return {"format": "megatron_sp_ext speed-plan kernel rates (megatron_sp_ext/sp/speed_plan/rates.py)",
            "written_by": " ".join(["tools/bench_kernels.py"] + sys.argv[1:]), "devices": devices}


def measure_rates(args) -> None:
    """--rates: dense rows over RATE_SEQLENS x RATE_HEADS x causal, the block-sparse table at 90%, both converted."""
    rows, path = [], os.path.join(args.out, "bench_kernels_rates.json")
    for s in RATE_SEQLENS:
        for h in RATE_HEADS:
            for causal in (False, True):
                q, k, v, do = _inputs(s, s, h, h, args.head_dim, bshd=True)
                rows.append({"s": s, "h": h, "causal": causal, "layout": "bshd", **_row(
                    "plain", lambda n: _plain(n, q, k, v, do, causal), _flops(s, s, h, args.head_dim, causal),
                    args.iters, args.warmup)})
                _write(path, rows)
                print(json.dumps(rows[-1]), flush=True)
    from tools import bench_block_sparse  # noqa: PLC0415
    sparse_dir = os.path.join(args.out, "block_sparse")
    bench_block_sparse.main(["--table", "--table-kernels", "cudnn_block_sparse,fa4", "--table-seqlens", "32768,75776",
                             "--table-sparsities", "0.9", "--budget-s", str(args.rates_sparse_s), "--out", sparse_dir])
    sparse = [os.path.join(sparse_dir, "bench_block_sparse.json")]
    out = write_json(os.path.join(args.out, "kernel_rates.json"),
                     rates_table([path] + [p for p in sparse if os.path.exists(p)]))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="8192,16384,32768,65536,131072")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--heads-longest", type=int, default=24, help="heads at the longest sequence (memory)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--kinds", default="plain,lse,gqa,varlen,cross")
    ap.add_argument("--out", default="bench_kernels_out")
    ap.add_argument("--rates", action="store_true", help="measure the speed plan's kernel-rate table (module doc)")
    ap.add_argument("--rates-sparse-s", type=float, default=300, help="with --rates: the block-sparse table's budget")
    ap.add_argument("--rates-from", nargs="+", metavar="JSON", help="the kernel-rate table from bench_kernels / "
                    "bench_block_sparse JSONs (no GPU)")
    args = ap.parse_args()
    if args.rates_from:
        print(f"wrote {write_json(os.path.join(args.out, 'kernel_rates.json'), rates_table(args.rates_from))}")
        return
    torch.cuda.set_device(0)
    if args.rates:
        return measure_rates(args)
    seqlens = [int(x) for x in args.seqlens.split(",")]
    kinds = args.kinds.split(",")
    d, rows = args.head_dim, []
    path = os.path.join(args.out, "bench_kernels.json")

    def done(row: dict) -> None:
        rows.append(row)
        _write(path, rows)
        print(json.dumps(row), flush=True)
    for s in seqlens:
        h = args.heads_longest if s == max(seqlens) and len(seqlens) > 1 else args.heads
        for causal in (False, True):
            fl = _flops(s, s, h, d, causal)
            if "plain" in kinds:
                q, k, v, do = _inputs(s, s, h, h, d)
                done({"s": s, "h": h, "causal": causal, **_row(
                    "plain", lambda n: _plain(n, q, k, v, do, causal), fl, args.iters, args.warmup)})
            if "lse" in kinds:
                done({"s": s, "h": h, "causal": causal, **_row(
                    "lse", lambda n: _lse(n, q, k, v, do, causal), fl, args.iters, args.warmup)})
            if "gqa" in kinds:
                q, k, v, do = _inputs(s, s, h, h // 4 if h % 4 == 0 else h, d)
                done({"s": s, "h": h, "hkv": k.shape[1], "causal": causal, **_row(
                    "gqa", lambda n: _plain(n, q, k, v, do, causal), fl, args.iters, args.warmup)})
            if "varlen" in kinds and s <= 65536:
                for n_samples in (3, 8):
                    parts = [s // n_samples // 128 * 128] * n_samples
                    parts[-1] = s - sum(parts[:-1])
                    cu = tuple([0] + list(torch.tensor(parts).cumsum(0).tolist()))
                    q, k, v, do = _inputs(s, s, h, h, d)
                    flv = sum(_flops(n, n, h, d, causal) for n in parts)
                    done({"s": s, "h": h, "causal": causal, "samples": n_samples, **_row(
                        "varlen", lambda n: _varlen(n, q, k, v, do, cu, causal), flv, args.iters, args.warmup)})
        if "cross" in kinds:
            q, k, v, do = _inputs(s, 512, h, h, d)
            done({"s": s, "h": h, "sk": 512, "causal": False, **_row(
                "cross", lambda n: _plain(n, q, k, v, do, False), _flops(s, 512, h, d, False), args.iters,
                args.warmup)})
        del q, k, v, do
        torch.cuda.empty_cache()
    print(f"{'kind':<7} {'S':>7} {'H':>3} {'causal':>6} {'cuDNN fwd/fwd+bwd':>18} {'FA4 fwd/fwd+bwd':>17} {'x':>6} "
          f"{'FA4 1st call s':>14}")
    for r in rows:
        print(f"{r['kind']:<7} {r['s']:>7} {r['h']:>3} {str(r['causal']):>6} "
              f"{r['cudnn_fwd_ms']:>8.2f}/{r['cudnn_fwd_bwd_ms']:<9.2f} {r['fa4_fwd_ms']:>7.2f}/{r['fa4_fwd_bwd_ms']:<9.2f}"
              f" {r['speedup_fwd_bwd']:>6.3f} {r['fa4_first_call_s']:>14}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
