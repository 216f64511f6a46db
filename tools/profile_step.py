"""Where does one attention fwd+bwd spend its time? CPU launch time vs GPU time, and the top kernels.

For each mode (names as in tools/bench_attention.py): host time of the Python call alone (no
synchronisation: what the CPU needs to issue one fwd+bwd), event-timed GPU wall (max over ranks), and profiler
tables of the CUDA kernels and of the ops' self CPU time over a few steps (rank 0). When the host time approaches the GPU wall the
call is launch-bound and the GPU idles between kernels.

    python tools/profile_step.py --world-size 4 --heads 24 --seqlen 8192 --modes deepspeed,ulysses --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.gpu_ranks import init_nccl_rank, spawn  # noqa: E402
from tools.bench_attention import _time, build_modes  # noqa: E402


def _worker(rank, world, port, args, path):
    init_nccl_rank(rank, world, port, timeout_s=120)
    group = dist.group.WORLD
    modes = build_modes(args.modes, group, False)
    sl = args.seqlen // world
    q, k, v, go = (torch.randn(1, sl, args.heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = {}
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    for name, fn in modes.items():
        def step():
            for t in (qg, kg, vg):
                t.grad = None
            fn(qg, kg, vg).backward(go)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        host = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
        gpu_ms = _time(step, 10, 0, group)  # event-timed median, max over ranks
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if dt > 0 and e.key and not e.key.startswith(("ProfilerStep", "aten::", "autograd::")):
                rows.append((dt / 3 / 1e3, e.count // 3, e.key[:90]))
        rows.sort(reverse=True)
        cpu = sorted(((e.self_cpu_time_total / 3 / 1e3, e.count // 3, e.key[:90]) for e in prof.key_averages()
                      if e.self_cpu_time_total > 0), reverse=True)
        out[name] = {"host_ms": sorted(host)[5], "gpu_ms": gpu_ms, "kernels": rows[:14], "cpu_ops": cpu[:25]}
        if args.timeline:
            out[name]["timeline"] = _timeline(step, os.path.join(os.path.dirname(path), f"trace_{name}_r{rank}.json"))
    if rank == 0:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        for name, r in out.items():
            print(f"[{name}] host {r['host_ms']:.2f} ms per fwd+bwd call, GPU wall {r['gpu_ms']:.2f} ms", flush=True)
            for ms, n, key in r["kernels"]:
                print(f"    {ms:7.3f} ms  x{n:<3d} {key}", flush=True)
            print("  host (self CPU time per step):", flush=True)
            for ms, n, key in r["cpu_ops"]:
                print(f"    {ms:7.3f} ms  x{n:<3d} {key}", flush=True)
            if "timeline" in r:
                print("  GPU timeline of one step (start us, duration us, stream, activity):", flush=True)
                for t0, dur, stream, key in r["timeline"]:
                    print(f"    {t0:9.1f} {dur:8.1f}  s{stream:<4} {key}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _timeline(step, trace_path: str) -> list:
    """Kernels, copies and memsets of one profiled step: (start us from the first, duration us, stream, name)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    os.remove(trace_path)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e]
    if not gpu:
        return []
    t0 = min(float(e["ts"]) for e in gpu)
    rows = [(float(e["ts"]) - t0, float(e.get("dur", 0)), e.get("args", {}).get("stream", -1), e["name"][:60])
            for e in gpu]
    return sorted(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--modes", default="deepspeed,ulysses,ulysses_packed")
    ap.add_argument("--out", default="profile_out")
    ap.add_argument("--timeline", action="store_true", help="also print every GPU activity of one step (rank 0)")
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile_P{args.world_size}_H{args.heads}_L{args.seqlen}.json")
    spawn(_worker, args.world_size, args, path)


if __name__ == "__main__":
    main()
