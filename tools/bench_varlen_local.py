"""The local attention of packed variable-length samples on ONE GPU: each method of attention/varlen.py
against the floor of the same samples run one by one as separate plain cuDNN calls.

What one Ulysses rank runs after its all-to-all for packed samples (cu_seqlens, B=1): q/k/v [1, H, S, D] over
the whole packed sequence (by default bhsd views of [S, H, D]-contiguous memory, what the exchange leaves),
attention within each sample. Timed per case, heads count and causal flag (CUDA events, median of --iters
after --warmup; forward alone, and forward + backward):
  floor         the samples as separate contiguous [1, H, L, D] tensors, one plain
                F.scaled_dot_product_attention call each (cuDNN backend forced), backward through autograd
  per_sample    varlen "per_sample" (what the Ulysses varlen path runs by default): forward_lse / backward_lse
                of the "auto" backend (the cuDNN kernel on Hopper) per sample, slicing the packed tensors
  grouped       equal lengths in one batched call (B = count)
  flash_varlen  torch's FlashAttention-2 varlen kernel (aten._flash_attention_forward/_backward, cum_seq),
                where its probe passes (varlen.py has no cuDNN ragged-kernel method: see its docstring)
Before timing, every method's out, dq, dk, dv are checked against the floor's (and lse against per_sample's)
on the GPU: a norm-wise relative error above --tol marks the method "wrong" and it is not timed. The JSON
also records what varlen_kernel="auto" picks for the case (its own measurement) and how long choosing took.

    python tools/bench_varlen_local.py --out $OUT/varlen_local.json
    python tools/bench_varlen_local.py --heads 40 5 --causal 0 1 --cases video_mixed many_short --out x.json
    python tools/bench_varlen_local.py --device cpu --shrink 60 --heads 2 --out /tmp/x.json   # smoke test only
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext.attention import varlen  # noqa: E402
from megatron_sp_ext.attention.backends import get_backend  # noqa: E402
from tools.benchlib import median_ms, write_json  # noqa: E402

CASES = {
    # Wan-style video clips of different durations / resolutions packed into one sequence
    "video_mixed": [32760, 14040, 4680],
    # many short clips / images of several lengths (multiples of 390, not one length twice in a row)
    "many_short": [390 * m for m in (2, 5, 3, 8, 1, 4, 6, 2, 3, 7, 1, 5, 4, 2, 6, 3) * 2],
    # equal lengths: one batched call for "grouped"
    "equal_group": [4680] * 8,
    "equal_short": [1560] * 24,
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_inputs(lengths, h, hkv, d, layout, dtype, device, seed=0):
    s = sum(lengths)
    g = torch.Generator(device=device).manual_seed(seed)

    def one(n):
        if layout == "bshd":  # bhsd views of [S, H, D]-contiguous memory (what the Ulysses exchange leaves)
            return torch.randn(1, s, n, d, device=device, dtype=dtype, generator=g).transpose(1, 2)
        return torch.randn(1, n, s, d, device=device, dtype=dtype, generator=g)
    return one(h), one(hkv), one(hkv), one(h)


def floor_fns(q, k, v, do, cu, causal, scale):
    """(fwd, fwd_bwd, reference outputs) of the samples as separate plain cuDNN SDPA calls."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    rep = q.shape[1] // k.shape[1]
    sl = varlen.sample_slices(cu)
    per = [tuple(t[i].contiguous() for t in (q, k, v, do)) for i in sl]
    kernels = [SDPBackend.CUDNN_ATTENTION] if q.is_cuda else [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]

    def call(qs, ks, vs):
        if rep > 1:  # GQA: expanded for the kernel (autograd sums the copies back)
            ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        with sdpa_kernel(kernels):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)

    def fwd():
        with torch.no_grad():
            for qs, ks, vs, _ in per:
                call(qs, ks, vs)

    leaves = [tuple(t.detach().requires_grad_() for t in p[:3]) for p in per]

    def fwd_bwd():
        for (qs, ks, vs), p in zip(leaves, per):
            call(qs, ks, vs).backward(p[3])

    outs, grads = [], []
    for (qs, ks, vs), p in zip(leaves, per):
        o = call(qs, ks, vs)
        outs.append(o.detach())
        grads.append(torch.autograd.grad(o, (qs, ks, vs), p[3]))
    ref = [torch.cat(outs, 2)] + [torch.cat([gr[j] for gr in grads], 2) for j in range(3)]
    return fwd, fwd_bwd, ref


def method_fns(method, be, q, k, v, do, cu, causal, scale):
    def fwd():
        with torch.no_grad():
            varlen.forward_lse(method, be, q, k, v, cu, causal=causal, scale=scale)

    def fwd_bwd():
        with torch.no_grad():
            o, lse = varlen.forward_lse(method, be, q, k, v, cu, causal=causal, scale=scale)
            varlen.backward_lse(method, be, do, q, k, v, o, lse, cu, causal=causal, scale=scale)
    return fwd, fwd_bwd


def run_case(name, lengths, h, hkv, d, causal, layout, dtype, iters, warmup, tol, device):
    cu = tuple([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    scale = d ** -0.5
    q, k, v, do = make_inputs(lengths, h, hkv, d, layout, dtype, device)
    be = get_backend("auto")
    row = {"case": name, "n_samples": len(lengths), "tokens": cu[-1], "lengths": lengths, "heads": h,
           "kv_heads": hkv, "head_dim": d, "causal": causal, "layout": layout,
           "dtype": str(dtype).replace("torch.", ""), "lse_kernel": be.kernel_for(q), "methods": {}}
    fl_fwd, fl_fb, ref = floor_fns(q, k, v, do, cu, causal, scale)
    cuda = device.type == "cuda"  # CUDA events; the host clock for the --device cpu smoke test
    row["floor"] = {"fwd_ms": median_ms(fl_fwd, iters, warmup, None, cuda),
                    "fwd_bwd_ms": median_ms(fl_fb, iters, warmup, None, cuda)}
    here = varlen.methods_here(be, q)
    lse_ref = None
    for method in varlen.METHODS:
        entry = {}
        row["methods"][method] = entry
        if method not in here:
            entry["status"] = "unavailable"
            entry["why"] = ("this torch lacks the op (schema)" if not varlen.schema_ok(method) else
                            "CUDA fp16/bf16 only" if not q.is_cuda else
                            f"the backend's lse kernel is {be.kernel_for(q)}, or the probe against math failed")
            if q.is_cuda and varlen.schema_ok(method):
                try:
                    entry["probe"] = varlen.probe(method, q.device, q.dtype)
                except Exception as e:  # noqa: BLE001 - recorded for the report
                    entry["probe"] = f"{type(e).__name__}: {str(e)[:400]}"
            continue
        try:
            o, lse = varlen.forward_lse(method, be, q, k, v, cu, causal=causal, scale=scale)
            grads = varlen.backward_lse(method, be, do, q, k, v, o, lse, cu, causal=causal, scale=scale)
        except (RuntimeError, ValueError) as e:  # a kernel that refuses this shape: recorded, not timed
            entry["status"], entry["error"] = "error", str(e)[:400]
            continue
        if lse_ref is None:
            lse_ref = lse
        errs = {n: rel_err(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), [o, *grads], ref)}
        errs["lse_vs_per_sample"] = rel_err(lse, lse_ref)
        entry["errs"] = errs
        if max(errs.values()) > tol:
            entry["status"] = "wrong"
            continue
        fwd, fb = method_fns(method, be, q, k, v, do, cu, causal, scale)
        entry.update(status="ok", fwd_ms=median_ms(fwd, iters, warmup, None, cuda),
                     fwd_bwd_ms=median_ms(fb, iters, warmup, None, cuda))
        entry["ratio_fwd"] = entry["fwd_ms"] / row["floor"]["fwd_ms"]
        entry["ratio_fwd_bwd"] = entry["fwd_bwd_ms"] / row["floor"]["fwd_bwd_ms"]
    ok = {m: e for m, e in row["methods"].items() if e.get("status") == "ok"}
    if ok:
        row["fastest_fwd"] = min(ok, key=lambda m: ok[m]["fwd_ms"])
        row["fastest_fwd_bwd"] = min(ok, key=lambda m: ok[m]["fwd_bwd_ms"])
    t0 = time.perf_counter()
    row["auto_choice"] = varlen.VarlenChooser().choose("auto", be, q, k, v, cu, causal=causal, scale=scale,
                                                       need_grad=True)
    if q.is_cuda:
        torch.cuda.synchronize()
    row["auto_choose_s"] = time.perf_counter() - t0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--heads", type=int, nargs="+", default=[40, 5],
                    help="q heads on the GPU (40: all of a Wan-14B layer; 5: one rank of 8-way Ulysses)")
    ap.add_argument("--kv-heads", type=int, default=None, help="k/v heads (default: = heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--layout", choices=["bshd", "bhsd"], default="bshd",
                    help="memory of q/k/v: bshd = [S, H, D]-contiguous (after the exchange), bhsd = contiguous")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tol", type=float, default=2e-2, help="largest norm-wise relative error vs the floor")
    ap.add_argument("--out", default="varlen_local.json")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a smoke test of this script (fp32, wall clock; with --shrink)")
    ap.add_argument("--shrink", type=int, default=1, help="divide every sample length by this (smoke tests)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_varlen_local needs a CUDA GPU (--device cpu: smoke test)")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.device == "cuda" else torch.float32
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
           "schema": {m: varlen.schema_ok(m) for m in varlen.KERNEL_METHODS},
           "kernel_available": {m: varlen.kernel_available(m, device, dtype) for m in varlen.KERNEL_METHODS},
           "shrink": args.shrink, "rows": []}
    for h in args.heads:
        hkv = args.kv_heads or h
        for name in args.cases:
            for causal in args.causal:
                lengths = [max(1, n // args.shrink) for n in CASES[name]]
                row = run_case(name, lengths, h, hkv, args.head_dim, bool(causal), args.layout, dtype,
                               args.iters, args.warmup, args.tol, device)
                res["rows"].append(row)
                cells = []
                for m, e in row["methods"].items():
                    if e.get("status") == "ok":
                        cells.append(f"{m} {e['fwd_ms']:.2f}/{e['fwd_bwd_ms']:.2f} ms "
                                     f"(x{e['ratio_fwd']:.2f}/x{e['ratio_fwd_bwd']:.2f})")
                    else:
                        cells.append(f"{m} {e.get('status')}")
                print(f"{name:12s} H={h:3d} causal={int(causal)} floor {row['floor']['fwd_ms']:.2f}/"
                      f"{row['floor']['fwd_bwd_ms']:.2f} ms | " + " | ".join(cells) + f" | auto={row['auto_choice']}",
                      flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    write_json(args.out, res)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
