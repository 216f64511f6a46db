"""Main-job demo: sequence-parallel attention on N CPU processes vs a single-process reference.

Spawns N gloo ranks; each holds a contiguous sequence shard of a video-DiT-like attention problem
and runs plain Ulysses and HCMS (forward and backward). Rank 0 prints the agreement with the
float64 full-sequence reference. Usage: python tools/demo_sp.py --nproc 4
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_sp_ext as spx  # noqa: E402


def _reference(q, k, v, do):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    o = torch.einsum("bhst,bthd->bshd", torch.softmax(s, -1), v)
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad


def _rank(rank, world, store_path, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 1, args.seq, args.heads, args.head_dim
    q, k, v, do = (torch.randn(b, s, h, d, generator=g) for _ in range(4))
    ref = _reference(q, k, v, do)
    sl = s // world
    mine = lambda t: t[:, rank * sl:(rank + 1) * sl]  # noqa: E731
    for name, chunks in (("ulysses", 1), ("hcms C=2", 2)):
        qs, ks, vs = (mine(t).clone().requires_grad_() for t in (q, k, v))
        out = spx.ulysses_attention(qs, ks, vs, dist.group.WORLD, head_chunks=chunks)
        out.backward(mine(do))
        errs = [((x.double() - mine(r)).norm() / mine(r).norm()).item()
                for x, r in zip((out, qs.grad, ks.grad, vs.grad), ref)]
        worst = torch.tensor(max(errs))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{name:9s} on {world} CPU ranks, L={s} H={h} D={d}: max relative error vs float64 "
                  f"reference (out, dq, dk, dv) = {worst.item():.2e}  {'OK' if worst < 1e-5 else 'MISMATCH'}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args.nproc, os.path.join(tmp, "store"), args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
