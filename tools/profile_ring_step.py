"""Where a sparse ring step's kernel time goes (#53: the ring's run steps at 0.69 of a dense ring step at 90%
random, the Ulysses rows at 0.85): one run step of rank 0 as tools/bench_block_sparse.py times it (this rank's
queries against one origin's keys under the step's tile mask, the registry's block-sparse kernel, forward with
log-sum-exp then backward from that out/lse), beside the dense step of the same shape, under torch.profiler: the
CUDA time of every kernel by name (forward, backward's preprocess / main / postprocess, copies) per call, and the
useful TFLOP/s of both. One JSON file.

    python tools/profile_ring_step.py --out DIR                       (one GPU: S 75,776, H 40, P 8, random 90%)
    python tools/profile_ring_step.py --out DIR --smoke               (CPU, tiny, math kernel: the flow)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext.sp.placement import positions  # noqa: E402
from megatron_sp_ext.sp.ring.sparse import sparse_ring_plan  # noqa: E402
from tools.bench_block_sparse import _inputs, random_topk_mask, selected_pairs, sparse_fns  # noqa: E402
from tools.bench_kernels import _plain  # noqa: E402


def kernel_times(fn, reps: int, cuda: bool) -> dict:
    """{kernel name: device us per call} of ``fn`` over ``reps`` profiled calls (after one warmup call)."""
    fn()
    act = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=act) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    per: dict = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) if cuda else e.self_cpu_time_total
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if t and (not cuda or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA):
            per[e.key] += t / reps
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, default=75776)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--kernel", default="fa4", help="block-sparse kernel with log-sum-exp (fa4, math)")
    ap.add_argument("--dense-kernel", default="fa4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU: S 1024, H 2, D 16, P 4, block 64, math, sdpa")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seqlen, args.heads, args.head_dim, args.world, args.block_size = 1024, 2, 16, 4, 64
        args.kernel, args.dense_kernel, args.reps = "math", "sdpa", 1
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    s, h, d, p, bs = args.seqlen, args.heads, args.head_dim, args.world, args.block_size
    bm = random_topk_mask(h, s // bs, args.sparsity, seed=0)
    plan = sparse_ring_plan(bm, world=p, seq_len=s, block_size=bs, placement="contiguous", causal=False)
    pos = [positions("contiguous", r, p, s) for r in range(p)]
    step = next(st for st in range(1, p) if plan.runs(0, 0, st))   # a step on another rank's keys
    origin = plan.origin(0, 0, step)
    q, k, v, do = _inputs(h, pos[0].numel(), pos[origin].numel(), d, dev, dtype)
    pairs = selected_pairs(bm, pos[0], pos[origin], bs, h)
    fwd, fwd_bwd, build_ms = sparse_fns(args.kernel, q, k, v, do, bm.to(dev), pos[0].to(dev), pos[origin].to(dev), bs)
    dense_fwd, dense_fb = _plain(args.dense_kernel, q, k, v, do, False)[:2]
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "s": s, "h": h, "d": d, "p": p, "block_size": bs,
           "sparsity": round(1 - float(bm.float().mean()), 4), "step": step, "origin": origin,
           "useful_pairs": pairs, "metadata_ms": round(build_ms, 3), "kernel": args.kernel,
           "dense_kernel": args.dense_kernel, "reps": args.reps, "unit": "device us per call"}
    for name, fn, flops in (("sparse_fwd_bwd", fwd_bwd, 3.5 * 4 * d * pairs),
                            ("dense_fwd_bwd", dense_fb, 3.5 * 4 * d * h * q.shape[2] * k.shape[2])):
        per = kernel_times(fn, args.reps, cuda)
        total = sum(per.values())
        res[name] = {"total_us": round(total, 1), "useful_tflops": round(flops / total / 1e6, 2) if total else None,
                     "kernels": {n: round(t, 1) for n, t in per.items()}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_ring_step.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({n: res[n] if not isinstance(res[n], dict) else {"total_us": res[n]["total_us"],
                      "useful_tflops": res[n]["useful_tflops"]} for n in res}))
    return res


if __name__ == "__main__":
    main()
