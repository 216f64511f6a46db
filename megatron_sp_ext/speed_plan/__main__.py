"""How long each sequence-parallel mode takes for one attention layer on a cluster (megatron_sp_ext/speed_plan).

    python -m megatron_sp_ext.speed_plan --tokens 300000 --heads 40 --machines 4 --gpus-per-machine 8 --nic-gbit 400
    python -m megatron_sp_ext.speed_plan --tokens 75600 --heads 12 --density 0.1 --machines 2 --probe run.json
    python -m megatron_sp_ext.speed_plan --validate [--results results/]   # every committed row; exit 1 off bounds
    python -m megatron_sp_ext.speed_plan --table [--doc docs/choosing_a_mode.md]   # the docs' table and plot

Each line: a mode with its settings (HCMS chunks C, mesh arrangement and Ulysses size P_u, the ring inside), its
forward and forward+backward ms, the kernels' and copies' time, the exchanges' time, how much of it kernels hide
and how much is exposed. Times are device time of one call: below ~16K tokens the host's issue time bounds a call
(not modelled). Links: --intra-* / --inter-* (GB/s per GPU, ms, hidden share), --nic-gbit (a NIC per GPU), or a
benchmark JSON's measured probe (--probe FILE: its meta.links_probe; --links nvlink|host|emu<M> as it ran).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Optional

from ..errors import SPConfigError
from ..sp.speed_plan.cluster import COPY_TBPS, PRESETS, Cluster, Link, nic
from ..sp.speed_plan.plan import predict_all, rank_modes, separable
from ..sp.speed_plan.rates import KernelRates, package_rates
from ..sp.speed_plan.schedules import Problem


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_sp_ext.speed_plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("problem")
    g.add_argument("--tokens", type=int, default=75_600, help="sequence length (the full sequence of one sample)")
    g.add_argument("--heads", type=int, default=40, help="query heads (wan-14b 40, wan-1.3b 12)")
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--causal", action="store_true")
    g.add_argument("--density", type=float, default=1.0, help="share of tile pairs a block mask selects (0.1: 90%% "
                   "block-sparse)")
    g.add_argument("--tile", type=int, default=128, help="tokens per tile of the block mask")
    g.add_argument("--batch", type=int, default=1)
    g = ap.add_argument_group("cluster")
    g.add_argument("--machines", type=int, default=1)
    g.add_argument("--gpus-per-machine", type=int, default=8)
    g.add_argument("--device", default="H200", help="kernel-rate table rows (H200, H100)")
    g.add_argument("--kernel", default="fa4", help="dense kernel of the rate table")
    g.add_argument("--intra-gbps", type=float, default=PRESETS["nvlink_large"].gbps, help="GB/s per GPU inside a "
                   "machine (default: NCCL over NVLink at attention-sized messages, measured)")
    g.add_argument("--intra-latency-ms", type=float, default=0.0)
    g.add_argument("--intra-hidden", type=float, default=PRESETS["nvlink"].hidden, help="share of an exchange a kernel "
                   "beside it hides (NVLink: 0.44 measured)")
    g.add_argument("--nic-gbit", type=float, default=400.0, help="a NIC per GPU of this line rate (Gb/s)")
    g.add_argument("--inter-gbps", type=float, default=None, help="GB/s per GPU across machines (instead of --nic-gbit)")
    g.add_argument("--inter-latency-ms", type=float, default=None)
    g.add_argument("--inter-hidden", type=float, default=1.0)
    g.add_argument("--copy-tbps", type=float, default=COPY_TBPS["words"], help="the layouts' copies, TB/s read+write")
    g.add_argument("--probe", default=None, help="a benchmark JSON whose meta.links_probe gives the links")
    g.add_argument("--links", default="nvlink", help="with --probe: the regime it ran in (nvlink, host, emu<M>)")
    g.add_argument("--rates", default=None, help="a kernel-rate table (default: the package's)")
    ap.add_argument("--rank", action="store_true", help="auto's ranking: fastest first, and what it cannot separate")
    ap.add_argument("--margin", type=float, default=0.05, help="with --rank: the plan's margin (fraction)")
    g = ap.add_argument_group("validation and the docs")
    g.add_argument("--validate", action="store_true", help="predict every committed row; exit 1 off the bounds")
    g.add_argument("--results", default="results", help="with --validate: the results folder")
    g.add_argument("--clock", default="table", choices=("table", "floor"), help="with --validate: kernel rates from "
                   "the table, or scaled per job by its own one-GPU FA4 floor")
    g.add_argument("--table", action="store_true", help="the docs' table and plot")
    g.add_argument("--doc", default="docs/choosing_a_mode.md", help="with --table: the markdown file it goes into")
    g.add_argument("--plot", default="docs/speed_plan.png", help="with --table: the PNG")
    g.add_argument("--devices", default="H200,H100", help="with --table")
    g.add_argument("--nics", default="400,200", help="with --table: NIC line rates, Gb/s")
    g.add_argument("--max-machines", type=int, default=32, help="with --table")
    return ap


def _cluster(args, rates: KernelRates) -> Cluster:
    if args.probe:
        try:
            with open(args.probe) as f:
                probes = json.load(f)["meta"]["links_probe"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise SPConfigError(f"--probe {args.probe}: no meta.links_probe readable ({e})") from None
        world = args.machines * args.gpus_per_machine
        if str(world) not in probes:
            raise SPConfigError(f"--probe {args.probe} has probes for {', '.join(probes) or 'no'} GPUs, not "
                                f"--machines x --gpus-per-machine = {world}")
        return Cluster.from_probe(probes[str(world)], args.links, world, device=args.device, kernel=args.kernel,
                                  copy_tbps=args.copy_tbps)
    intra = Link(args.intra_gbps, args.intra_latency_ms, args.intra_hidden, "intra")
    inter = nic(args.nic_gbit) if args.inter_gbps is None else Link(args.inter_gbps, args.inter_latency_ms or 0.0,
                                                                    args.inter_hidden, "inter")
    if args.inter_latency_ms is not None:
        inter = replace(inter, latency_ms=args.inter_latency_ms)
    return Cluster(args.machines, args.gpus_per_machine, intra, inter, device=args.device, kernel=args.kernel,
                   copy_tbps=args.copy_tbps)


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        rates = KernelRates.load(args.rates) if args.rates else package_rates()
        if args.validate:
            from .validate import validate   # noqa: PLC0415
            summary = validate(args.results, rates, args.clock)
            print("\n".join(summary.lines))
            return 0 if summary.ok else 1
        if args.table:
            from .table import run_table   # noqa: PLC0415
            run_table(args.doc, args.plot, rates, args.devices.split(","), [int(x) for x in args.nics.split(",")],
                      args.max_machines)
            return 0
        for name, value, low in (("--tokens", args.tokens, 1), ("--heads", args.heads, 1), ("--machines",
                                  args.machines, 1), ("--gpus-per-machine", args.gpus_per_machine, 1)):
            if value < low:
                raise SPConfigError(f"{name}={value} is invalid: use an integer >= {low}")
        if not 0.0 < args.density <= 1.0:
            raise SPConfigError(f"--density={args.density} is invalid: use a share in (0, 1]")
        pb = Problem(args.tokens, args.heads, args.head_dim, args.causal, args.density, args.tile, args.batch,
                     args.kv_heads)
        cl = _cluster(args, rates)
        rates.check(cl.device, cl.kernel)
        print(f"{pb.tokens:,} tokens, {pb.heads} heads x {pb.head_dim}, {'causal' if pb.causal else 'full'}"
              f"{'' if pb.density >= 1 else f', density {pb.density:g} at {pb.tile}-token tiles'} on "
              f"{cl.machines} x {cl.per_machine} {cl.device} ({cl.intra.name or 'intra'} {cl.intra.gbps:g} GB/s; "
              f"{cl.inter.name or 'inter'} {cl.inter.gbps:g} GB/s per GPU)")
        if args.rank:
            ranking = rank_modes(pb, cl, rates=rates)
            for st, ms in ranking:
                print(f"{st.label():<28} {ms:10.2f} ms")
            close = separable(ranking, args.margin)
            print(f"within {args.margin:.0%} of the best: {', '.join(st.label() for st, _ in close)}")
            return 0
        preds, refused = predict_all(pb, cl, rates=rates)
        for p in sorted(preds, key=lambda p: p.fwd_bwd_ms):
            print(p.line())
        for st, why in refused:
            print(f"{st.label():<26} cannot run: {why}")
        return 0
    except SPConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
