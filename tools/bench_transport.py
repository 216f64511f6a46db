"""Transport micro-benchmark: NCCL vs the copy-engine (symmetric-memory) all-to-alls (``symm_mem``: barrier
kernels; ``copy_engine``: stream-memory flags, no kernels), alone and beside
attention. Answers "does moving the exchange off the SMs let it hide behind attention?".

For each P and (H, L): the q|k|v exchange of one Ulysses call ([L/P tokens, 3H heads, D] bf16) timed
alone per transport, flash attention of H/P heads over L tokens alone, and both at once (attention on
the compute stream, the exchange repeated ``--repeat`` times on a side stream). Reports
overlap_efficiency = (t_attn + t_comm - t_both) / min(t_attn, t_comm) (1 = fully hidden) and the
attention slowdown. Writes transport.json / transport.md under --out.

    python tools/bench_transport.py --world-sizes 2,4 --heads 40 --seqlens 16384,32768 --out $OUT
    python tools/bench_transport.py --links host --world-sizes 2,4 --out $OUT        # only nccl runs there

``--sweep`` (with ``--links emu<M>``): exchange time vs bytes inside an emulated machine (NCCL over
NVLink) and across machines (the host-staged transport), and NCCL over the whole box, in one job;
writes links_sweep.json and links_sweep.png (the emulation's measured bandwidths):

    python tools/bench_transport.py --links emu2 --world-sizes 4 --sweep --out $OUT

``--check`` (one GPU is enough): 4 processes on cuda:0 joined by gloo run the host-staged transport's
CUDA path and compare it bit for bit with gloo's all-to-all; writes host_staged_check.json:

    python tools/bench_transport.py --check --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.benchlib import (finish_worker, init_nccl_rank, links_option, median_ms, plot_or_skip,  # noqa: E402
                            run_meta, run_world_sizes, transports_for_links, write_json, write_results)
from tools.gpu_ranks import bandwidth_row, link_groups  # noqa: E402



class _PullsOnly:
    """Diagnostic, timing only: copy_engine's peer pulls of one exchange with no flags, staging or slot
    protocol (it reads the peers' workspaces whatever they hold): does a bare copy-engine pull progress
    beside attention?"""

    def __init__(self, ce, nbytes: int) -> None:
        from megatron_sp_ext.comm import stream_ops  # noqa: PLC0415
        self.ce, self.seg, self.ops = ce, nbytes // ce.world, stream_ops
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def all_to_all(self, send, recv):
        ce, cur = self.ce, torch.cuda.current_stream()
        ce._start.record(cur)
        for r in range(ce.world):
            s = ce._streams[r]
            ce._start.wait(s)
            self.ops.memcpy(s, self.dst.data_ptr() + r * self.seg, ce._base[r] + ce.rank * self.seg, self.seg)
            ce._joined[r].record(s)
            ce._joined[r].wait(cur)


class _LocalCopyOnly:
    """Diagnostic, timing only: one device-local copy of the exchange's size (copy engine) on the stream."""

    def __init__(self, nbytes: int) -> None:
        from megatron_sp_ext.comm import stream_ops  # noqa: PLC0415
        self.ops, self.n = stream_ops, nbytes
        self.a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.b = torch.empty_like(self.a)

    def all_to_all(self, send, recv):
        self.ops.memcpy(torch.cuda.current_stream(), self.b.data_ptr(), self.a.data_ptr(), self.n)


def _worker(rank, world, port, args, path):
    init_nccl_rank(rank, world, port, timeout_s=120)
    from megatron_sp_ext.comm.transport import default_transports  # noqa: PLC0415
    group = dist.group.WORLD
    side = torch.cuda.Stream()
    dev = torch.device("cuda", rank)
    transports = {n: default_transports().get(n, group, dev, "--transports") for n in args.transports}
    out = []
    for h in args.heads:
        for L in args.seqlens:
            n = (L // world) * 3 * h * 128
            send = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            recv = torch.empty_like(send)
            if "copy_engine" in args.transports:
                ce = transports["copy_engine"]
                ce.all_to_all(send, recv)  # sizes its workspace
                transports["ce_pulls_only"] = _PullsOnly(ce, n * 2)
                transports["local_copy_only"] = _LocalCopyOnly(n * 2)
            q = torch.randn(1, h // world, L, 128, device="cuda", dtype=torch.bfloat16)
            row = {"P": world, "H": h, "L": L, "bytes": n * 2}
            row["t_attn"] = median_ms(lambda: F.scaled_dot_product_attention(q, q, q), args.iters, 3, group)
            for name, tr in transports.items():

                def comm(tr=tr):
                    for _ in range(args.repeat):
                        tr.all_to_all(send, recv)
                row[f"t_comm_{name}"] = median_ms(comm, args.iters, 3, group)

                attn_in_both = []

                def both(comm=comm):
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        comm()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    F.scaled_dot_product_attention(q, q, q)
                    b.record()
                    attn_in_both.append((a, b))
                    torch.cuda.current_stream().wait_stream(side)
                t_both = median_ms(both, args.iters, 3, group)
                # the attention kernel's own time while the exchange runs (its stream has nothing else):
                # ~t_attn means the exchange did not slow attention, only its tail (or launch) showed
                times = sorted(a.elapsed_time(b) for a, b in attn_in_both)
                row[f"t_attn_beside_{name}"] = times[len(times) // 2]
                t_c, t_a = row[f"t_comm_{name}"], row["t_attn"]
                row[f"t_both_{name}"] = t_both
                row[f"overlap_eff_{name}"] = (t_a + t_c - t_both) / min(t_a, t_c)
            out.append(row)
            if rank == 0:
                print("[transport] " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in row.items()), flush=True)
    finish_worker(rank, path, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--heads", default="40")
    ap.add_argument("--seqlens", default="16384,32768")
    ap.add_argument("--repeat", type=int, default=2, help="exchanges per timed region (q|k|v in, grads out...)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", default="transport_out")
    ap.add_argument("--transports", default=None,
                    help="comma list of nccl,symm_mem,copy_engine,host_staged (default: the three first, "
                         "only nccl under --links host)")
    ap.add_argument("--sweep", action="store_true", help="exchange time vs bytes intra vs inter emulated machine")
    ap.add_argument("--sweep-sizes", default="65536,262144,1048576,4194304,16777216,67108864,268435456",
                    help="bytes per rank of each swept exchange")
    ap.add_argument("--check", action="store_true",
                    help="one GPU: --check-ranks processes on cuda:0 over gloo check host_staged bit for bit")
    ap.add_argument("--check-ranks", type=int, default=4)
    ap.add_argument("--check-device", default="cuda", choices=["cuda", "cpu"], help="cpu: the same check on CPU")
    links_option(ap)
    args = ap.parse_args()
    if args.check:
        return check_main(args)
    if args.sweep:
        return sweep_main(args)
    args.transports = (args.transports.split(",") if args.transports
                       else transports_for_links(["nccl", "symm_mem", "copy_engine"]))
    args.heads = [int(x) for x in args.heads.split(",")]
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    per_world = run_world_sizes(_worker, [int(w) for w in args.world_sizes.split(",")], args, args.out, "transport")
    rows = [r for rs in per_world for r in rs]
    meta = run_meta()
    names = [n for n in ("nccl", "symm_mem", "copy_engine", "host_staged", "ce_pulls_only", "local_copy_only")
             if rows and f"t_comm_{n}" in rows[0]]
    lines = [f"{meta['device']}, {meta['date']}: q|k|v exchange x{args.repeat} (ms) alone and beside flash attention",
             "(\"attn beside\": the attention kernel's own time while the exchange runs)",
             "", "| P | H | L | attn | " + " | ".join(f"{n} alone / with attn / overlap eff / attn beside"
                                                     for n in names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        lines.append(f"| {r['P']} | {r['H']} | {r['L'] // 1024}K | {r['t_attn']:.2f} | " + " | ".join(
            f"{r[f't_comm_{n}']:.2f} / {r[f't_both_{n}']:.2f} / {r[f'overlap_eff_{n}']:.2f} / {r[f't_attn_beside_{n}']:.2f}"
            for n in names) + " |")
    write_results(args.out, "transport", {"meta": meta, "results": rows}, lines)


def _sweep_worker(rank, world, port, args, path):
    """Exchange time vs bytes: inside this rank's emulated machine, across machines, whole box."""
    init_nccl_rank(rank, world, port, timeout_s=120)
    from megatron_sp_ext.comm.transport import default_transports  # noqa: PLC0415
    from megatron_sp_ext.topology.emulate import emulated_machine_size, link_transport  # noqa: PLC0415
    dev, pool = torch.device("cuda", rank), default_transports()
    m = emulated_machine_size()
    intra, cross = link_groups(world, m)
    cases = [("whole box, nccl", dist.group.WORLD, "nccl")]
    if intra:
        cases.append((f"intra-machine ({m} GPUs)", intra[rank // m], None))
    if cross:
        cases.append((f"inter-machine ({world // m} machines)", cross[rank % m], None))
    out = {"machine_size": m, "world": world, "series": {}}
    for label, g, name in cases:
        tr = pool.get(name or link_transport(g), g, dev)
        rows = [bandwidth_row(tr, n, g, dev, args.iters) for n in args.sweep_sizes]
        out["series"][label] = {"transport": tr.name, "ranks": dist.get_world_size(g), "rows": rows}
        if rank == 0:
            print(f"[sweep] {label} via {tr.name}: " + ", ".join(
                f"{r['bytes'] >> 10}KiB {r['ms']:.3f}ms {r['GBps_per_gpu']:.1f}GB/s" for r in rows), flush=True)
    finish_worker(rank, path, out)


def _check_worker(rank, world, store_dir, args, path):
    """One process per simulated rank, all on cuda:0, joined by gloo: the host-staged transport's CUDA
    path (pinned shared slots, stream-memory flags on host memory, copy-engine copies) against gloo's
    all_to_all of the same data on the CPU, bit for bit, on uneven tables and back-to-back exchanges."""
    import datetime  # noqa: PLC0415
    from megatron_sp_ext.comm.host_staged import HostStagedTransport  # noqa: PLC0415
    cuda = args.check_device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    g, dev = dist.group.WORLD, torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tr = HostStagedTransport(g, dev, slots=2, timeout=datetime.timedelta(seconds=60))
    gen, data = torch.Generator().manual_seed(3), torch.Generator().manual_seed(50 + rank)
    side = torch.cuda.Stream() if cuda else None
    checked = 0
    for n in range(12):
        scale = 1 if n < 6 else 100_000  # then past the first workspace size
        table = (torch.randint(0, 6, (world, world), generator=gen) * scale).tolist()
        table[n % world][(n + 1) % world] = 0
        send = torch.randn(sum(table[rank]), generator=data).to(torch.bfloat16)
        rs = [table[r][rank] for r in range(world)]
        want = torch.empty(sum(rs), dtype=torch.bfloat16)
        dist.all_to_all_single(want, send, rs, table[rank], group=g)
        send_d = send.to(dev)
        got = torch.full((sum(rs),), float("nan"), dtype=torch.bfloat16, device=dev)
        from megatron_sp_ext.comm.streams import on_stream  # noqa: PLC0415
        with on_stream(side if n % 2 else None):
            tr.all_to_all(send_d, got, table[rank], rs, table=table)
            tr.all_to_all(send_d, got, table[rank], rs, table=table)  # twice, back to back: slot reuse
        sync()
        ok = torch.equal(got.cpu(), want)
        if not ok:
            raise SystemExit(f"[check] rank {rank}: host_staged exchange {n} differs from gloo's all_to_all")
        checked += 1
    nbytes = 64 << 20
    x = torch.randn(nbytes // 2 // world * world, device=dev).to(torch.bfloat16)
    y = torch.empty_like(x)
    tr.all_to_all(x, y)
    sync()
    import time  # noqa: PLC0415
    t0 = time.perf_counter()
    for _ in range(5):
        tr.all_to_all(x, y)
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / 5
    tr.close()
    finish_worker(rank, path, {"device": str(dev), "ranks_on_one_gpu": world, "exchanges_checked_bitwise": 2 * checked,
                               "note": "all ranks share one GPU and its PCIe link: the bandwidth is not a per-GPU "
                                       "figure",
                               "ms_64MiB_per_rank": ms, "GBps_per_rank": nbytes * (world - 1) / world / ms / 1e6})


def check_main(args) -> None:
    import tempfile  # noqa: PLC0415
    import torch.multiprocessing as mp  # noqa: PLC0415
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "host_staged_check.json")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_check_worker, args=(args.check_ranks, tmp, args, path), nprocs=args.check_ranks,
                           start_method="spawn")
    with open(path) as f:
        res = json.load(f)
    res["meta"] = run_meta()
    write_json(path, res)
    print(json.dumps(res, indent=1))


def sweep_main(args) -> None:
    if not args.links.startswith("emu"):
        raise SystemExit("--sweep measures an emulated cluster: give --links emu<M> (e.g. emu2 on 4 GPUs)")
    args.sweep_sizes = [int(x) for x in args.sweep_sizes.split(",")]
    per_world = run_world_sizes(_sweep_worker, [int(w) for w in args.world_sizes.split(",")], args, args.out,
                                "sweep")
    meta = run_meta()
    write_results(args.out, "links_sweep", {"meta": meta, "results": per_world})

    def draw(plt):
        fig, axes = plt.subplots(1, len(per_world), figsize=(6 * len(per_world), 4.5), squeeze=False)
        for ax, res in zip(axes[0], per_world):
            for label, s in res["series"].items():
                xs = [r["bytes"] / 2**20 for r in s["rows"]]
                ax.plot(xs, [r["ms"] for r in s["rows"]], marker="o",
                        label=f"{label} [{s['transport']}] {max(r['GBps_per_gpu'] for r in s['rows']):.0f} GB/s/GPU")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("all-to-all buffer per rank (MiB)")
            ax.set_ylabel("exchange time (ms)")
            ax.set_title(f"P={res['world']} as {res['world'] // res['machine_size']} x {res['machine_size']} "
                         f"(emulated), {meta['device']}")
            ax.legend(fontsize=7)
        return fig
    plot_or_skip(os.path.join(args.out, "links_sweep.png"), draw, "sweep")
    print(json.dumps(meta.get("links_probe", {}), indent=1))


if __name__ == "__main__":
    main()
