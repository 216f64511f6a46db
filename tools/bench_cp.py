r"""PyTorch's own context-parallel ring beside ours, in one torchrun job (one process per GPU).

PyTorch: ``torch.distributed.tensor.experimental.context_parallel`` (SDPA patched to its ring; causal
buffers load-balanced head-tail = our "zigzag"), both rotate methods (``set_rotate_method``
"allgather" and "alltoall"). Ours: ring, tasp, ulysses (contiguous placement), ulysses_zigzag
(causal, zigzag placement), usp (hybrid mesh, P_u = P/2). For each (H, L, causal): forward and
forward+backward ms (median of --iters, max over ranks), the floor (one SDPA call of ceil(H/P) heads
over L on one GPU, same job) and the ratio to it; every mode's output and q/k/v gradients are gathered
to the full sequence and compared with our plain Ulysses (bf16 tolerance).

    torchrun --nproc-per-node 2 tools/bench_cp.py --heads 40 --seqlens 32768,65536 --links nvlink --out $OUT
    torchrun --nproc-per-node 2 tools/bench_cp.py --heads 40 --seqlens 32768,65536 --links host --out $OUT

The ring backward's dK|dV return (sp/ring/rotation.py): "ring"/"tasp" run the default route (partials
straight home, the last step in ``--dkv-chunks`` head chunks); "ring_travel"/"tasp_travel" the previous
traveling fp32 accumulator, as a baseline side by side (SPX_RING_DKV set per mode, on every rank);
"ring:C" / "tasp:C" run the default route with C head chunks (a sweep of C in one job):

    torchrun --nproc-per-node 2 tools/bench_cp.py --heads 40 --seqlens 32768,65536 --links host \
        --modes ring,ring_travel,tasp,tasp_travel,ring:1,ring:8 --dkv-chunks auto --out $OUT

"ulysses_views" (not in the default --modes): plain Ulysses with ``qkv_contiguous=False``, the kernel on zero-copy
views of the receive buffer (no copies into its native layout) and one packed dq|dk|dv exchange per chunk, beside
the default's copies (#68: the copies around the exchanges are 2.5 ms of the 32K P=2 row's 5.9 ms gap).
"hcms" (head chunks "auto") and "auto" (the factory's mode="auto": Ulysses/HCMS, ring or TASP per shape) run
through ``make_attention`` as a model's attention does. Every mode is also checked against ONE full-sequence call
(tools/full_reference.py: rel_err_vs_full, rank 0). Transformer Engine's context parallelism as peers in the same
job (``--peers te_p2p,te_a2a,te_all_gather`` or ``te``): after our rows, rank 0 starts tools/bench_cp_te.py as its
own torchrun on the same GPUs (TE imported only there; SPX_TE_SITE from tools/gpu_install.sh), merges its rows
(each TE output/gradient checked against the same full-sequence call) and adds every mode's time over TE's p2p
ring (vs_te_p2p_fwd / vs_te_p2p_fwd_bwd; auto_vs_te_p2p per row). docs/te_peer.md:

    torchrun --nproc-per-node 2 tools/bench_cp.py --heads 40 --seqlens 32768,65536,131072 --links nvlink \
        --modes ulysses,hcms,ring,auto --peers te --out $OUT

``--links host`` sets NCCL_P2P_DISABLE=1 before NCCL starts (GPU-to-GPU traffic through host memory).
Writes bench_cp_<links>_P<P>.json / .md / .png to --out (rank 0).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.gpu_ranks import probe_links  # noqa: E402
from tools.benchlib import (AutoDecisions, cp_grid, init_world, median_ms, plot_or_skip, run_meta,  # noqa: E402
                            write_json, write_results)
from tools.floor import add_ratios, floor_ms, kernel_floor_ms  # noqa: E402
from tools.profile_calls import profile_calls  # noqa: E402
from tools.full_reference import full_inputs, full_reference, rel_errs, within  # noqa: E402
from tools.te_peer import (check_grid, find_te, merge_te_rows, parse_peers, te_command, te_env,  # noqa: E402
                            te_script_args)
from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from training.video_dit.faults import on_rank0  # noqa: E402

TOL = 2e-2   # norm-wise relative error vs our plain Ulysses, bf16
OURS = ("ring", "tasp", "ulysses", "ulysses_zigzag", "usp", "hcms", "auto")
TRAVEL = ("ring_travel", "tasp_travel")   # the previous dK|dV schedule (baseline; not in the default --modes)
TORCH = ("torch_cp_allgather", "torch_cp_alltoall")


def placement_of(mode: str, causal: bool) -> str:
    """Which tokens a rank holds for ``mode`` (PyTorch's head-tail balancer = our zigzag)."""
    if not causal or mode in ("ulysses", "ulysses_views"):
        return "contiguous"
    return "tasp_zigzag" if mode.startswith("tasp") else "zigzag"


def _gather_full(x_bshd, group, placement):
    import megatron_sp_ext as spx  # noqa: PLC0415
    return spx.unshard_sequence(x_bshd.contiguous(), group, placement=placement, seq_dim=1)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def our_mode(name, group, causal, h, mesh_cache):
    import megatron_sp_ext as spx  # noqa: PLC0415
    if name.split(":")[0] in ("ring", "tasp") + TRAVEL:
        variant = name.split(":")[0].split("_")[0]
        return lambda q, k, v: spx.ring_attention(q, k, v, group, variant=variant, causal=causal,
                                                  placement=spx.balanced_placement(variant, causal))
    if name == "ulysses":
        return lambda q, k, v: spx.ulysses_attention(q, k, v, group, causal=causal)
    if name == "ulysses_views":   # the kernel on zero-copy views of the receive buffer, one packed dq|dk|dv exchange
        return lambda q, k, v: spx.ulysses_attention(q, k, v, group, causal=causal, qkv_contiguous=False)
    if name in ("hcms", "auto"):   # as a model's attention runs them: the factory, head chunks per shape
        attn = spx.make_attention(spx.SPConfig(mode=name, head_chunks="auto"), group, num_heads=h,
                                  placement=placement_of(name, causal))
        return lambda q, k, v: attn(q, k, v, causal=causal)
    if name == "ulysses_zigzag":
        return lambda q, k, v: spx.ulysses_attention(q, k, v, group, causal=causal, placement="zigzag")
    if name == "usp":
        world = dist.get_world_size(group)
        key = (h, world)
        if key not in mesh_cache:
            mesh_cache[key] = spx.build_sp_mesh(group, num_heads=h, placement="usp", ulysses_size=max(1, world // 2))
        return lambda q, k, v: spx.hybrid_attention(q, k, v, mesh_cache[key], causal=causal,
                                                    placement=spx.balanced_placement("ring", causal))
    raise SystemExit(f"unknown mode {name}")


def run_ours(name, fn, full, group, causal, args):
    """Time ``fn`` on this rank's shards (bshd) and return (entry, full out/grads for the check)."""
    import megatron_sp_ext as spx  # noqa: PLC0415
    pl = placement_of(name, causal)
    os.environ["SPX_RING_DKV"] = "travel" if name in TRAVEL else "home"   # read by each ring backward
    os.environ["SPX_RING_DKV_CHUNKS"] = name.split(":")[1] if ":" in name else args.dkv_chunks
    q, k, v, do = (spx.shard_sequence(t, group, placement=pl, seq_dim=1) for t in full)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fb():
        qg.grad = kg.grad = vg.grad = None
        o = fn(qg, kg, vg)
        o.backward(do)
        return o
    with torch.no_grad():
        t_f = median_ms(lambda: fn(q, k, v), args.iters, args.warmup, group)
    t_fb = median_ms(fb, args.iters, args.warmup, group)
    entry = {"fwd_ms": t_f, "fwd_bwd_ms": t_fb, "placement": pl}
    if profiled(args, name):
        tag = f"{name}_H{full[0].shape[2]}_L{full[0].shape[1]}_{'causal' if causal else 'full'}_{args.links}"
        calls = profile_calls_of(args)
        if "fwd" in calls:   # the forward alone, as t_f times it (the causal ring's host-link outlier, #84)
            with torch.no_grad():
                entry["profile_fwd"] = profile_calls(lambda: fn(q, k, v), args.profile_reps, group,
                                                     args.profile_traces, f"{tag}_fwd")
        if "fwd_bwd" in calls:
            entry["profile"] = profile_calls(fb, args.profile_reps, group, args.profile_traces, tag)
    o = fb()
    got = [_gather_full(t, group, pl) for t in (o.detach(), qg.grad, kg.grad, vg.grad)]
    return entry, got


CALLS = ("fwd", "fwd_bwd")   # --profile-calls: a mode's forward alone (under no_grad, as fwd_ms), its forward+backward


def profile_calls_of(args) -> tuple:
    """The calls ``--profile-calls`` names (SPConfigError naming the flag for anything else)."""
    got = tuple(c.strip() for c in args.profile_calls.split(",") if c.strip())
    bad = [c for c in got if c not in CALLS]
    if bad or not got:
        raise SPConfigError(f"--profile-calls {args.profile_calls!r}: a comma list of {', '.join(CALLS)}")
    return got


def profiled(args, name: str) -> bool:
    """Whether ``--profile-reps`` profiles mode ``name`` (``--profile-modes``: all timed modes by default; the FA4
    floor is "floor_fa4")."""
    if args.profile_reps <= 0:
        return False
    return not args.profile_modes or name in args.profile_modes.split(",")


def run_torch_cp(method, full, mesh, group, causal, args):
    """PyTorch's ring under ``context_parallel`` (buffers [B, H, L, D], seq dim 2)."""
    from torch.distributed.tensor.experimental import context_parallel  # noqa: PLC0415
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method  # noqa: PLC0415
    set_rotate_method(method)
    old_lb = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = causal  # its balancer is for causal only (it refuses otherwise)
    bufs = [t.transpose(1, 2).contiguous() for t in full]   # bhsd copies it shards in place
    try:
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            q, k, v, do = bufs
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def fb():
                qg.grad = kg.grad = vg.grad = None
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                o.backward(do)
                return o
            with torch.no_grad():
                t_f = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                 args.iters, args.warmup, group)
            t_fb = median_ms(fb, args.iters, args.warmup, group)
            o = fb()
            local = [t.transpose(1, 2) for t in (o.detach(), qg.grad, kg.grad, vg.grad)]
    finally:
        _cp_options.enable_load_balance = old_lb
    pl = "zigzag" if causal else "contiguous"
    got = [_gather_full(t, group, pl) for t in local]
    return {"fwd_ms": t_f, "fwd_bwd_ms": t_fb, "placement": pl, "rotate_method": method}, got


def bench_row(group, mesh, h, seqlen, causal, modes, args, mesh_cache):
    world = dist.get_world_size(group)
    full = full_inputs(seqlen, h, args.head_dim)   # the same full tensors on every rank (and in the TE job)
    full_ref = full_reference(*full, causal=causal) if dist.get_rank() == 0 else None
    row = {"P": world, "H": h, "L": seqlen, "D": args.head_dim, "causal": causal, "links": args.links,
           "floor": floor_ms(group, h, seqlen, args.head_dim, causal, iters=args.iters, warmup=args.warmup),
           "floor_fa4": kernel_floor_ms(group, "fa4", h, seqlen, args.head_dim, causal, iters=args.iters,
                                        warmup=args.warmup, profile=(lambda fb: profile_calls(
                                            fb, args.profile_reps, group, args.profile_traces,
                                            f"floor_fa4_H{h}_L{seqlen}_{'causal' if causal else 'full'}_"
                                            f"{args.links}"))
                                        if profiled(args, "floor_fa4") else None),
           "modes": {}}
    ref = None
    order = ["ulysses"] + [m for m in modes if m != "ulysses"]
    for name in order:
        if name == "ulysses_zigzag" and not causal:
            continue   # the same as contiguous without a mask
        torch.cuda.empty_cache()
        try:
            if name in TORCH:
                entry, got = run_torch_cp(name.split("_")[-1], full, mesh, group, causal, args)
            else:
                with AutoDecisions() as decisions:   # what auto / hcms picked for this row, with the reason
                    entry, got = run_ours(name, our_mode(name, group, causal, h, mesh_cache), full, group, causal,
                                          args)
                if decisions.messages:
                    entry["auto_decisions"] = decisions.messages
        except Exception as e:  # noqa: BLE001 - a mode that cannot run here is reported, not fatal
            row["modes"][name] = {"error": f"{type(e).__name__}: {e}"}
            if dist.get_rank() == 0:
                print(f"[bench_cp] {name} failed: {e}", flush=True)
            continue
        add_ratios(entry, row["floor"])
        add_ratios(entry, row["floor_fa4"], tag="fa4")
        if full_ref is not None:
            entry["rel_err_vs_full"] = rel_errs(got, full_ref)
            entry["ok"] = within(entry["rel_err_vs_full"])
        if name == "ulysses":
            ref = got
        elif ref is not None:
            errs = {k: _rel(a, b) for k, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
            entry["rel_err_vs_ulysses"] = errs
            entry["ok"] = entry.get("ok", True) and all(e < TOL for e in errs.values())
        row["modes"][name] = entry
        del got
    return row


def write_reports(rows, args, meta):
    name = f"bench_cp_{args.links}_P{rows[0]['P']}"
    modes = []
    for r in rows:
        modes += [m for m in r["modes"] if m not in modes]
    lines = [f"{meta['device']} x {rows[0]['P']}, {meta['date']}, torch {meta['torch']}, links={args.links}, bf16, "
             f"B=1, D={args.head_dim}, median of {args.iters}, max over ranks.",
             "Cells: fwd / fwd+bwd ms [ratio to the floor fwd / fwd+bwd]; X = output/grads differ from Ulysses or from "
             "the full-sequence call; te_* = Transformer Engine (its own processes, same job); auto / TE p2p: "
             "fwd / fwd+bwd time ratio.", "",
             "| H | L | causal | floor ms | FA4 floor ms | " + " | ".join(modes)
             + " | auto / FA4 floor | auto / TE p2p |",
             "|---|---|---|---|---|" + "---|" * (len(modes) + 2)]
    for r in rows:
        cells = []
        for m in modes:
            e = r["modes"].get(m)
            if e is None:
                cells.append("-")
            elif "error" in e:
                cells.append("error")
            else:
                cells.append(f"{e['fwd_ms']:.1f} / {e['fwd_bwd_ms']:.1f} [{e['ratio_fwd']:.2f} / "
                             f"{e['ratio_fwd_bwd']:.2f}]" + ("" if e.get("ok", True) else " X"))
        fl, fa4, vs = r["floor"], r.get("floor_fa4", {}), r.get("auto_vs_te_p2p")
        auto = r["modes"].get("auto", {})
        cells.append(f"{auto['ratio_fa4_fwd']:.3f} / {auto['ratio_fa4_fwd_bwd']:.3f}" if "ratio_fa4_fwd" in auto
                     else "-")
        cells.append(f"{vs['fwd']:.3f} / {vs['fwd_bwd']:.3f}" if vs else "-")
        fa4_cell = f"{fa4['fwd']:.1f} / {fa4['fwd_bwd']:.1f}" if "fwd" in fa4 else "-"
        lines.append(f"| {r['H']} | {r['L'] // 1024}K | {'yes' if r['causal'] else 'no'} | "
                     f"{fl['fwd']:.1f} / {fl['fwd_bwd']:.1f} | {fa4_cell} | " + " | ".join(cells) + " |")
    lines += profile_lines(rows)
    write_results(args.out, name, {"meta": meta, "rows": rows}, lines)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4))
        width = 0.8 / max(1, len(modes))
        for i, m in enumerate(modes):
            ys = [r["modes"].get(m, {}).get("ratio_fwd_bwd", float("nan")) for r in rows]
            ax.bar([x + i * width for x in range(len(rows))], ys, width, label=m)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
        ax.set_xticklabels([f"H{r['H']} {r['L'] // 1024}K {'causal' if r['causal'] else 'full'}" for r in rows],
                           fontsize=8)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel("fwd+bwd time / floor (lower is better)")
        ax.set_title(f"context parallel, P={rows[0]['P']}, links={args.links}")
        ax.legend(fontsize=7)
        return fig
    plot_or_skip(os.path.join(args.out, name + ".png"), draw, "bench_cp")


def profile_lines(rows) -> list:
    """The markdown of ``--profile-reps``: per profiled mode (and FA4 floor) and call (fwd+bwd; fwd with
    ``--profile-calls fwd``), ms per call, max over ranks (beside: the least over ranks)."""
    out = []
    for r in rows:
        entries = [("FA4 floor", r.get("floor_fa4", {}))] + list(r["modes"].items())
        for m, e in entries:
            for call, key in (("fwd+bwd", "profile"), ("fwd", "profile_fwd")):
                p = e.get(key)
                if not p or "max_over_ranks" not in p:
                    continue
                if not out:
                    out = ["", "Profiled calls (ms per call, max over ranks; exposed = exchange kernels running while "
                           "no other kernel does, beside = while one does (least over ranks: near 0 with a large "
                           "exposed time, the exchange ran after the compute, not beside it); elementwise includes "
                           "the layouts' copies):", "",
                           "| L | causal | mode | call | window | attention | exchange | exposed | beside | elementwise "
                           "| GEMM | idle |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
                c = p["max_over_ranks"]
                out.append(f"| {r['L'] // 1024}K | {'yes' if r['causal'] else 'no'} | {m} | {call} | "
                           f"{p['window_ms_max']:.2f} | {c['attention']:.2f} | {c['exchange']:.2f} | "
                           f"{p['exchange_exposed_ms_max']:.2f} | {p.get('exchange_beside_ms_min', float('nan')):.2f} "
                           f"| {c['elementwise']:.2f} | {c['GEMM']:.2f} | {c['idle']:.2f} |")
    return out


def run_te_side(args, peers: list, world: int, site, timeout_s: Optional[float] = None) -> tuple:
    """Rank 0, after our process group is gone: TE's rows from tools/bench_cp_te.py as its own torchrun on the same
    GPUs (at most ``timeout_s``, default --te-timeout) -> (its JSON doc or None, why it is missing)."""
    timeout_s = args.te_timeout if timeout_s is None else timeout_s
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory(prefix="bench_cp_te_") as tmp:
        out_json = os.path.join(tmp, "te_rows.json")
        cmd = te_command(sys.executable, world, os.path.join(here, "bench_cp_te.py"),
                         te_script_args(args, peers, out_json))
        print(f"[bench_cp] TE side: {' '.join(cmd)}", flush=True)
        # its own session: on a timeout (ours, or a SIGTERM from outside) the whole TE job goes, workers included
        proc = subprocess.Popen(cmd, env=te_env(os.environ, site, os.path.dirname(here)), start_new_session=True)

        def stop(*_):
            for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(wait_s)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        old_term = signal.signal(signal.SIGTERM, lambda *a: (stop(), sys.exit(143)))
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop()
            return None, f"the TE job ran past its {timeout_s:.0f} s (--te-timeout / --time-limit)"
        finally:
            signal.signal(signal.SIGTERM, old_term)
        if not os.path.exists(out_json):
            return None, f"the TE job exited {rc} without rows (its log is above)"
        with open(out_json) as f:
            return json.load(f), ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="40")
    ap.add_argument("--seqlens", default="32768,65536")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", default="no,yes", help="comma list of no/yes")
    ap.add_argument("--modes", default=",".join(TORCH + OURS))
    ap.add_argument("--dkv-chunks", default="auto",
                    help="head chunks of the ring backward's last step (SPX_RING_DKV_CHUNKS): a count or auto")
    ap.add_argument("--links", choices=("nvlink", "host"), default="nvlink",
                    help="host: NCCL_P2P_DISABLE=1 (set here, before NCCL starts)")
    ap.add_argument("--nccl-priority", choices=("default", "high"), default="default",
                    help="high: the job's NCCL streams at high priority (ProcessGroupNCCL.Options("
                         "is_high_priority_stream=True), Megatron's --high-priority-stream-groups): the ring's "
                         "exchange kernels then go before a compute kernel that takes every SM (in the meta)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_cp_out"))
    ap.add_argument("--peers", default="", help="Transformer Engine's CP timed in the same job, after ours: "
                    "te_p2p,te_a2a,te_all_gather (comma list) or te (all three); needs TE (SPX_TE_SITE, "
                    "docs/te_peer.md)")
    ap.add_argument("--te-timeout", type=int, default=1800, help="seconds the TE side may run")
    ap.add_argument("--profile-reps", type=int, default=0,
                    help="after each mode's timing, profile this many fwd+bwd calls of it (and of the FA4 floor) on "
                         "every rank: its kernels by category per call, the exchange's exposed time, the top "
                         "kernels (tools/profile_calls.py), in the mode's entry as \"profile\"; 0: no profile. Each "
                         "mode is timed before its own profile but after earlier ones: where a torch build leaves the "
                         "profiler attached (pytorch#144455), compare a row timed without this flag")
    ap.add_argument("--profile-modes", default="",
                    help="with --profile-reps: only these modes (comma list; floor_fa4 = the FA4 floor)")
    ap.add_argument("--profile-traces", default=None,
                    help="with --profile-reps: keep rank 0's Chrome traces in this folder (large: 10-100 MB each)")
    ap.add_argument("--profile-calls", default="fwd_bwd",
                    help="with --profile-reps: which of a mode's calls to profile, comma list of " + "/".join(CALLS) +
                         " (fwd: the forward alone, as its fwd_ms times it, in the entry as \"profile_fwd\"; "
                         "the FA4 floor: fwd_bwd only)")
    ap.add_argument("--time-limit", type=int, default=0,
                    help="seconds the whole job may run (0: no limit): the TE side gets at most what is left of it "
                         "less 20 s, so that the merged JSON is written before an outer timeout")
    args = ap.parse_args()
    try:   # the peers checked before any GPU work: a bad setting is one message, no traceback
        profile_calls_of(args)
        peers = parse_peers(args.peers)
        check_grid(peers, [int(x) for x in args.heads.split(",")], [int(x) for x in args.seqlens.split(",")],
                   int(os.environ.get("WORLD_SIZE", "1")))
        te_site = find_te(os.environ) if peers else None
    except SPConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"bench_cp: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if args.links == "host":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(k, "1" if k != "NCCL_NVLS_ENABLE" else "0")
    t_job = time.time()
    init_world("nccl", timeout_s=600, high_priority=args.nccl_priority == "high")
    # its own links probe in the JSON: what the speed plan predicts this job's rows from (speed_plan --validate)
    probe = probe_links(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    group = dist.group.WORLD
    modes = [m for m in args.modes.split(",") if m]
    rows, mesh_cache = [], {}
    partial = os.path.join(args.out, f"bench_cp_{args.links}_P{world}.partial.json")   # rows so far, if cut short
    for h, L, causal in cp_grid(args):
        t0 = time.time()
        r = bench_row(group, mesh, h, L, causal, modes, args, mesh_cache)
        rows.append(r)
        # rank 0 writes; its failure ends every rank rather than leaving the others in the next row's collectives
        snapshot = {"rows": rows, "note": "our rows so far (the job did not finish)"}
        on_rank0(f"writing {partial}", lambda: write_json(partial, snapshot), group)
        if dist.get_rank() == 0:
            brief = " ".join(f"{n}={e['fwd_bwd_ms']:.1f}[{e['ratio_fwd_bwd']:.2f}]"
                             for n, e in r["modes"].items() if "error" not in e)
            print(f"[bench_cp P={world} H={h} L={L} causal={causal} {time.time() - t0:.0f}s] "
                  f"floor={r['floor']['fwd_bwd']:.1f} {brief}", flush=True)
    rank = dist.get_rank()
    if peers:   # our NCCL communicators and cached memory go before TE's job takes the same GPUs
        dist.barrier()
        dist.destroy_process_group()
        del mesh, mesh_cache
        torch.cuda.empty_cache()
        if rank != 0:
            return
        budget = args.te_timeout if not args.time_limit else min(
            args.te_timeout, args.time_limit - (time.time() - t_job) - 20)
        te_doc, why = (run_te_side(args, peers, world, te_site, budget) if budget > 30 else
                       (None, f"no time left for the TE job (--time-limit {args.time_limit} s)"))
        merge_te_rows(rows, te_doc, peers, why)

    def report() -> None:
        meta = run_meta(date=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()), torch=torch.__version__,
                        nccl=str(torch.cuda.nccl.version()), NCCL_P2P_DISABLE=os.environ.get("NCCL_P2P_DISABLE", ""),
                        links=args.links, nccl_priority=args.nccl_priority, links_probe={str(world): probe})
        if peers:
            meta["te"] = (te_doc or {}).get("meta", {"error": why})
        write_reports(rows, args, meta)
        if os.path.exists(partial):
            os.remove(partial)
        bad = [(r["L"], r["causal"], m) for r in rows for m, e in r["modes"].items() if e.get("ok") is False]
        if bad:
            print(f"[bench_cp] outputs differ from Ulysses or the full-sequence call beyond {TOL}: {bad}", flush=True)
    if peers:   # the group is gone: rank 0 alone is still here
        report()
    else:   # rank 0 writes; its failure ends every rank rather than leaving the others in the barrier
        on_rank0("writing the reports", report, group)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
