"""Print the detected topology, the mesh "auto" would build, and predicted inter-machine volumes.

Runs on the ranks of the current job (torchrun, any backend) or, with --world, simulated on CPU
gloo ranks. Examples:
  python tools/topology_report.py --world 8 --nodes 2 --heads 40 --seqlen 65536
  torchrun --nproc-per-node 8 tools/topology_report.py --heads 40 --seqlen 65536
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_sp_ext as spx  # noqa: E402
from megatron_sp_ext.topology.volume import tas_volume, usp_volume  # noqa: E402


def report(args) -> None:
    g = dist.group.WORLD
    mesh = spx.build_sp_mesh(g, num_heads=args.heads, placement=args.placement, ulysses_size=args.ulysses_size,
                             nodes=args.nodes)
    if dist.get_rank() != 0:
        return
    t = mesh.topology
    N, M, P = t.nodes, t.per_node, mesh.world
    print(f"topology: {N} machine(s) x {M} GPU(s){' (simulated)' if t.simulated else ''}, SP size {P}")
    print(f"chosen:   {mesh.describe()}")
    for j, row in enumerate(mesh.grid):
        print(f"  ulysses group {j}: ranks {list(row)}")
    elem = 2 if args.dtype == "bf16" else 4
    print(f"\ninter-machine volume per GPU per attention layer (forward), B={args.batch} L={args.seqlen} "
          f"H={args.heads} D={args.head_dim} {args.dtype}:")
    print(f"{'P_u':>5} {'P_r':>5} {'USP MiB':>10} {'TAS MiB':>10}  better")
    for p_u in sorted(d for d in range(1, P + 1) if P % d == 0 and args.heads % d == 0):
        p_r = P // p_u
        vu = usp_volume(N, M, p_u, p_r, args.batch, args.seqlen, args.heads, args.head_dim) * elem / 2**20
        vt = tas_volume(N, M, p_u, p_r, args.batch, args.seqlen, args.heads, args.head_dim) * elem / 2**20
        mark = " <- auto P_u" if p_u == math.gcd(P, args.heads) else ""
        print(f"{p_u:>5} {p_r:>5} {vu:>10.1f} {vt:>10.1f}  {'tas' if vt < vu else 'usp'}{mark}")


def _rank(rank, world, path, args):
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    report(args)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=None, help="simulate this many CPU ranks (else use torchrun's)")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--placement", default="auto")
    ap.add_argument("--ulysses-size", type=int, default=None)
    args = ap.parse_args()
    if args.world:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(args.world, os.path.join(tmp, "store"), args), nprocs=args.world)
    else:
        dist.init_process_group()
        report(args)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
