"""Packed variable-length samples (cu_seqlens, B=1) in the ring family, one process per GPU (NCCL).

For each world size, case (sample lengths) and causal flag: forward and forward+backward ms (CUDA events,
median of --iters after --warmup, max over ranks) of
  ulysses_packed   ulysses_attention(..., cu_seqlens=) (the Ulysses varlen path, its default kernel method)
  ring_packed      ring_attention(variant="ring", cu_seqlens=)
  tasp_packed      ring_attention(variant="tasp", cu_seqlens=)
  ring_unpacked    ring_attention over the same tokens WITHOUT cu_seqlens (one sequence: more math, no per-sample
                   calls; what packing saves or costs against the plain ring)
Shards: per-sample "zigzag" placement for causal, "contiguous" otherwise (shard_sequence(..., cu_seqlens=)).
Before timing, ring_packed and tasp_packed out / dq / dk / dv are compared with ulysses_packed (norm-wise relative
error, bf16 tolerance --tol); a mode above it is marked "wrong" and not timed. Also recorded: the ring's kernel
calls per step (one per sample a step touches). Writes bench_ring_varlen_<links>.json to --out (rank 0).

    python tools/bench_ring_varlen.py --heads 40 --out $OUT                       # P = 2, 4 where the GPUs exist
    python tools/bench_ring_varlen.py --world-sizes 2 --cases video_mixed --causal 1 --links host --out $OUT
    python tools/bench_ring_varlen.py --device cpu --shrink 64 --heads 4 --world-sizes 2 --iters 1 --out /tmp/x
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_sp_ext as spx  # noqa: E402
from tools.benchlib import (finish_worker, init_nccl_rank, links_option, median_ms, run_meta,  # noqa: E402
                            run_world_sizes, write_json)

CASES = {  # Wan-style clips of different sizes; many short clips / images
    "video_mixed": [32760, 14040, 4680],
    "many_short": [390 * m for m in (2, 5, 3, 8, 1, 4, 6, 2, 3, 7, 1, 5, 4, 2, 6, 3)],
}
MODES = ("ulysses_packed", "ring_packed", "tasp_packed", "ring_unpacked")


def lengths_for(case: str, world: int, shrink: int) -> list:
    """The case's sample lengths / shrink, each rounded up to a multiple of 2 * world (per-sample zigzag)."""
    div = 2 * world
    return [max(div, -(-(n // shrink) // div) * div) for n in CASES[case]]


def _call(mode: str, q, k, v, g, causal: bool, placement: str, cu):
    if mode == "ulysses_packed":
        return spx.ulysses_attention(q, k, v, g, causal=causal, placement=placement, cu_seqlens=cu)
    variant = "tasp" if mode.startswith("tasp") else "ring"
    return spx.ring_attention(q, k, v, g, variant=variant, causal=causal, placement=placement,
                              cu_seqlens=cu if mode.endswith("_packed") else None)


def _rel(a: torch.Tensor, b: torch.Tensor, device) -> float:
    num = torch.tensor([(a.double() - b.double()).norm().item() ** 2, b.double().norm().item() ** 2], device=device,
                       dtype=torch.float64)
    dist.all_reduce(num)
    return float((num[0] / num[1].clamp_min(1e-300)).sqrt())


def worker(rank: int, world: int, port: int, args, path: str) -> None:
    if args.device == "cuda":
        init_nccl_rank(rank, world, port)
        device = torch.device("cuda", rank)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device = torch.device("cpu")
    g = dist.group.WORLD
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = []
    for case in args.cases:
        lengths = lengths_for(case, world, args.shrink)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        for h in args.heads:
            for causal in (bool(c) for c in args.causal):
                placement = "zigzag" if causal else "contiguous"
                gen = torch.Generator(device="cpu").manual_seed(0)
                full = [torch.randn(1, cu[-1], h, args.head_dim, generator=gen).to(device, dtype) for _ in range(4)]
                q, k, v, do = (spx.shard_sequence(t, g, placement=placement, seq_dim=1, cu_seqlens=cu_t) for t in full)
                row = {"case": case, "lengths": lengths, "heads": h, "causal": causal, "P": world, "modes": {}}
                ref = None
                for mode in MODES:
                    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                    out = _call(mode, qq, kk, vv, g, causal, placement, cu_t)
                    out.backward(do)
                    got = [out.detach(), qq.grad, kk.grad, vv.grad]
                    rec: dict = {}
                    if mode == "ulysses_packed":
                        ref = got
                    elif mode.endswith("_packed"):
                        rec["rel_err"] = max(_rel(a, b, device) for a, b in zip(got, ref))
                        if rec["rel_err"] > args.tol:
                            rec["status"] = "wrong"
                            row["modes"][mode] = rec
                            continue
                    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

                    def fwd():
                        with torch.no_grad():
                            _call(mode, qq, kk, vv, g, causal, placement, cu_t)

                    def fwd_bwd():
                        _call(mode, qq, kk, vv, g, causal, placement, cu_t).backward(do)
                    cuda = device.type == "cuda"  # median, max over the ranks
                    rec["fwd_ms"] = median_ms(fwd, args.iters, args.warmup, g, cuda)
                    rec["fwd_bwd_ms"] = median_ms(fwd_bwd, args.iters, args.warmup, g, cuda)
                    row["modes"][mode] = rec
                if rank == 0:
                    from megatron_sp_ext.attention.backends import get_backend
                    from megatron_sp_ext.sp.placement import varlen_pieces
                    from megatron_sp_ext.sp.ring.ring import make_ring_plan
                    runs = tuple(varlen_pieces(placement, o, world, tuple(cu)) for o in range(world))
                    plan = make_ring_plan(g, variant="ring", s_loc=cu[-1] // world, q_runs=runs[0], kv_runs=runs,
                                          causal=causal, scale=1.0, backend=get_backend("sdpa"),
                                          cu_seqlens=tuple(cu))
                    row["ring_calls_per_step_rank0"] = [len(plan.items(s, device)) for s in range(world)]
                    print(json.dumps(row), flush=True)
                rows.append(row)
    finish_worker(rank, path, rows, barrier=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--heads", type=int, nargs="+", default=[40])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--shrink", type=int, default=1, help="divide the sample lengths (smoke tests)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", required=True)
    links_option(ap)
    args = ap.parse_args()
    limit = torch.cuda.device_count() if args.device == "cuda" else max(args.world_sizes)
    results = [row for rows in run_world_sizes(worker, args.world_sizes, args, args.out, "bench_ring_varlen",
                                               max_world=limit) for row in rows]
    out = write_json(os.path.join(args.out, f"bench_ring_varlen_{args.links}.json"), {**run_meta(), "rows": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
