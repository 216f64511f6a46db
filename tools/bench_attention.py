"""Side-by-side benchmark of sequence-parallel attention modes on N GPUs (one process per GPU).

For every (P, H, L) of the grid and every mode it times forward and forward+backward (CUDA events,
warm-up, median of ``--iters``, max over ranks), measures the bare exchange time (comm ratio rho =
T_comm / T_ulysses) and the local attention time (bound = T_ulysses / max(T_comm, T_attn)), checks
that every HCMS output and gradient equals plain Ulysses bit for bit, and records peak memory.
Writes ``bench.json`` (raw), ``bench.md`` (table) and ``bench.png`` (speedup vs L) to ``--out``.

Modes: deepspeed (DeepSpeed's DistributedAttention with the same SDPA local attention, when
deepspeed imports), minimal (a minimal DeepSpeed-style Ulysses: permute, all_to_all_single, SDPA, back),
ulysses, hcms<C>, auto, prepacked and hcms<C>_prepacked (packed Ulysses from q|k|v already in the send
layout, the path of the DiT's --ulysses-packed-qkv), and (see --modes) ring, tasp, usp, tas, usp-tasp, tas-tasp, torus, mesh_auto
(placement="auto": the mesh the topology detector picks; with --links emu<M> it sees the emulated machines).
Example (4 x H200):
  python tools/bench_attention.py --world-sizes 2,4 --heads 24,40 --seqlens 8192,16384,32768,57344,131072 --out $OUT
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.floor import add_ratios, floor_ms  # noqa: E402
from tools.full_reference import full_reference, rel_errs, within  # noqa: E402
from tools.benchlib import (finish_worker, init_nccl_rank, interleaved_ms, launch, links_option,  # noqa: E402
                            median_ms, no_grad, plot_or_skip, run_meta, write_results)
import megatron_sp_ext as spx  # noqa: E402
from megatron_sp_ext.comm.exchange import all_to_all_flat  # noqa: E402
from megatron_sp_ext.sp.ulysses import HCMSPolicy  # noqa: E402



def _sdpa_bshd(q, k, v, *args, **kwargs):
    """DeepSpeed's local attention callable: [B, S, h, D] in/out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def minimal_ulysses(q, k, v, group, causal: bool = False):
    """The minimal DeepSpeed-style Ulysses (issue 16's yardstick): permute + contiguous, one autograd
    all_to_all_single per tensor, SDPA, all_to_all_single back, permute. q/k/v [B, S/P, H, D], H % P == 0."""
    from torch.distributed.nn.functional import all_to_all_single  # noqa: PLC0415
    p = dist.get_world_size(group)

    def seq_to_head(x):  # [B, s, H, D] -> [B, H/P, s*P, D]
        b, s, h, d = x.shape
        x = x.reshape(b, s, p, h // p, d).permute(2, 1, 0, 3, 4).contiguous()  # [P, s, B, H/P, D]
        y = all_to_all_single(torch.empty_like(x), x, group=group)  # y[j]: rank j's tokens, my heads
        return y.reshape(p * s, b, h // p, d).permute(1, 2, 0, 3)

    o = F.scaled_dot_product_attention(seq_to_head(q), seq_to_head(k), seq_to_head(v), is_causal=causal)
    b, hp, sp, d = o.shape
    o = o.permute(2, 0, 1, 3).reshape(p, sp // p, b, hp, d).contiguous()  # [P, s, B, H/P, D] by destination
    y = all_to_all_single(torch.empty_like(o), o, group=group)  # y[j]: head group j of my tokens
    return y.permute(2, 1, 0, 3, 4).reshape(b, sp // p, p * hp, d)


class Prepacked:
    """Mode "prepacked" / "hcms<C>_prepacked": packed Ulysses timed from q|k|v already in the send layout (a
    model writes them there inside its QK-norm/RoPE kernel: results/2026-11-23_h100_packed_local measured that part),
    gradients left in the send layout. The send buffers are packed once per q, k, v (untimed);
    ``qkv_grads`` maps their gradients back to q, k, v for the correctness check (untimed)."""

    def __init__(self, group, chunks: int, causal: bool) -> None:
        self.group, self.chunks, self.causal, self.packed, self.sends = group, chunks, causal, {}, None

    def _layout(self, q, k):
        return spx.packed_head_layout(q.shape[2], k.shape[2], dist.get_world_size(self.group), self.chunks)

    def __call__(self, q, k, v):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), tuple(q.shape), q.requires_grad)
        if key not in self.packed:  # the timed inputs (with and without grad) each packed once
            with torch.no_grad():
                self.packed[key] = [s.requires_grad_(q.requires_grad) for s in spx.pack_qkv(q, k, v, self._layout(q, k))]
        self.sends = self.packed[key]
        for s in self.sends:
            s.grad = None
        return spx.packed_ulysses_attention(self.sends, self.group, num_heads=q.shape[2], num_kv_heads=k.shape[2],
                                            head_chunks=self.chunks, causal=self.causal)

    def qkv_grads(self, q, k, v):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(spx.pack_qkv(*leaves, self._layout(q, k)), leaves, [s.grad for s in self.sends])


def build_modes(names, group, causal, nodes=None, heads=None):
    modes = {}
    policy = HCMSPolicy()
    meshes = {}

    def mesh(h, placement):
        key = (h, placement)
        if key not in meshes:
            meshes[key] = spx.build_sp_mesh(group, num_heads=h, placement=placement, nodes=nodes)
        return meshes[key]
    for full in names:
        # a "_symm" / "_ce" suffix runs the same mode through a copy-engine transport
        name, tr = split_transport(full)
        outer, modes = modes, {}
        if name == "deepspeed":
            try:
                import deepspeed  # noqa: PLC0415
                from deepspeed.sequence.layer import DistributedAttention  # noqa: PLC0415
                deepspeed.init_distributed(dist_backend=dist.get_backend(group))
            except Exception as e:  # noqa: BLE001
                print(f"[bench] deepspeed mode skipped: {e}", flush=True)
                continue
            ds = DistributedAttention(_sdpa_bshd, group, scatter_idx=2, gather_idx=1)
            modes[name] = lambda q, k, v, ds=ds: ds(q, k, v, 0)
        elif name == "minimal":
            modes[name] = lambda q, k, v: minimal_ulysses(q, k, v, group, causal)
        elif name == "ulysses":
            modes[name] = lambda q, k, v, tr=tr: spx.ulysses_attention(q, k, v, group, causal=causal, transport=tr)
        elif name == "ulysses_packed":
            modes[name] = lambda q, k, v: spx.ulysses_attention(q, k, v, group, causal=causal, qkv_contiguous=False)
        elif name == "prepacked" or (name.startswith("hcms") and name.endswith("_prepacked")):
            modes[name] = Prepacked(group, 1 if name == "prepacked" else int(name[4:-len("_prepacked")]), causal)
        elif name.startswith("hcms") and name.endswith("_packed"):
            c = int(name[4:-7])
            modes[name] = lambda q, k, v, c=c: spx.ulysses_attention(q, k, v, group, head_chunks=c, causal=causal,
                                                                     qkv_contiguous=False)
        elif name.startswith("hcms"):
            c = int(name[4:])
            modes[name] = lambda q, k, v, c=c, tr=tr: spx.ulysses_attention(q, k, v, group, head_chunks=c,
                                                                            causal=causal, transport=tr)
        elif name == "auto":
            def auto(q, k, v, tr=tr):
                return spx.ulysses_attention(q, k, v, group, head_chunks="auto", causal=causal, policy=policy,
                                             transport=tr)
            auto.policy = policy
            modes[name] = auto
        elif name in ("ring", "tasp"):
            modes[name] = lambda q, k, v, n=name: spx.ring_attention(q, k, v, group, variant=n, causal=causal,
                                                                     placement=spx.balanced_placement(n, causal))
        elif name in ("usp", "tas", "usp-tasp", "tas-tasp"):
            pl, variant = name.split("-")[0], ("tasp" if name.endswith("tasp") else "ring")
            modes[name] = lambda q, k, v, pl=pl, variant=variant: spx.hybrid_attention(
                q, k, v, mesh(q.shape[2], pl), ring_variant=variant, causal=causal,
                    placement=spx.balanced_placement("ring", causal))
        elif name == "mesh_auto":  # placement="auto": the mesh the topology detector and volume model pick
            def mesh_auto(q, k, v):
                return spx.hybrid_attention(q, k, v, mesh(q.shape[2], "auto"), causal=causal,
                                            placement=spx.balanced_placement("ring", causal))
            mesh_auto.mesh_of = lambda h: mesh(h, "auto")
            modes[name] = mesh_auto
        elif name == "torus":
            modes[name] = lambda q, k, v: spx.torus_attention(q, k, v, mesh(q.shape[2], "tas"), causal=causal,
                                                              placement=spx.balanced_placement("ring", causal))
        else:
            raise SystemExit(f"unknown mode {name}")
        if tr != "nccl" and (name not in ("ulysses", "auto") and not name.startswith("hcms")
                             or name.endswith(("_packed", "_prepacked"))):
            raise SystemExit(f"mode {full}: the _symm/_ce suffixes apply to ulysses, hcms<C> and auto")
        outer.update({full: fn for fn in modes.values()})
        modes = outer
    return modes


TRANSPORT_SUFFIXES = {"_symm": "symm_mem", "_ce": "copy_engine"}


def split_transport(mode: str) -> tuple:
    """"hcms4_ce" -> ("hcms4", "copy_engine"); no suffix -> (mode, "nccl")."""
    for suffix, tr in sorted(TRANSPORT_SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if mode.endswith(suffix):
            return mode[:-len(suffix)], tr
    return mode, "nccl"


def gather_sequence(x_bshd: torch.Tensor, group) -> torch.Tensor:
    """Every rank's contiguous shard [B, S/P, H, D] gathered in rank order: [B, S, H, D] (every rank calls it)."""
    parts = [torch.empty_like(x_bshd) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x_bshd.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def bench_shape(rank, world, group, h, seqlen, args, modes):
    d, b = args.head_dim, 1
    sl = seqlen // world
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    q, k, v, go = (torch.randn(b, sl, h, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    res = {"P": world, "H": h, "L": seqlen, "D": d, "modes": {}}
    # bare exchange (forward: q|k|v in + out) and local attention
    n_in, n_out = 3 * q.numel(), q.numel()
    s_in, r_in, s_out, r_out = (q.new_empty(n) for n in (n_in, n_in, n_out, n_out))
    res["t_comm_fwd"] = median_ms(lambda: (all_to_all_flat(s_in, r_in, group), all_to_all_flat(s_out, r_out, group)),
                              args.iters, args.warmup, group)
    for suffix, tr_name in TRANSPORT_SUFFIXES.items():  # the same bare exchange through the copy engines
        if any(split_transport(n)[1] == tr_name for n in modes):
            tr = spx.default_transports().get(tr_name, group, q.device)
            tr.all_to_all(s_in, r_in)  # grow the workspace outside the timed region
            res[f"t_comm_fwd{suffix}"] = median_ms(lambda tr=tr: (tr.all_to_all(s_in, r_in), tr.all_to_all(s_out, r_out)),
                                               args.iters, args.warmup, group)
    # the floor: this rank's share (ceil(H/P) heads over the full L) as one SDPA call, same job
    res["floor"] = floor_ms(group, h, seqlen, d, args.causal, iters=args.iters, warmup=args.warmup)
    res["t_attn_fwd"] = res["floor"]["fwd"]
    ref_out = ref_grads = None
    # every mode against ONE full-sequence call (non-causal: every mode's shards are contiguous here, so the rank
    # order of the gathered shards is the sequence order; causal modes hold different placements: vs Ulysses only)
    full_ref = None
    if not args.causal:
        full = [gather_sequence(t, group) for t in (q, k, v, go)]
        full_ref = full_reference(*full, causal=False) if rank == 0 else None
        del full
    res["full_reference"] = ("one SDPA (flash) call over the gathered sequence, all heads, rank 0" if not args.causal
                             else "not run: causal modes hold different placements (checked against Ulysses)")
    # long shapes: fewer repetitions (each call is tens to hundreds of ms)
    iters, warmup = (args.iters, args.warmup) if res["t_attn_fwd"] < 20 else (3, 1)
    res["iters"] = iters
    fns = {n: f for n, f in modes.items()
           if not (n.startswith("hcms") and int(n[4:].split("_")[0]) > h // world)}
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def fb(fn):
        for t in (qg, kg, vg):
            t.grad = None
        o = fn(qg, kg, vg)
        o.backward(go)
        return o

    # 1. per mode: warm-up (auto calibrates here), peak memory of one fwd+bwd, correctness
    for name, fn in fns.items():
        torch.cuda.empty_cache()
        with torch.no_grad():
            for _ in range(warmup):
                fn(q, k, v)
        for _ in range(1 + warmup):
            fb(fn)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        o = fb(fn)
        torch.cuda.synchronize()
        entry = {"peak_mem_gib": (torch.cuda.max_memory_allocated() - base_mem) / 2**30}
        if hasattr(fn, "qkv_grads"):  # gradients left in the send layout: mapped back, untimed
            grads = tuple(g.detach().clone() for g in fn.qkv_grads(qg, kg, vg))
        else:
            grads = (qg.grad.detach().clone(), kg.grad.detach().clone(), vg.grad.detach().clone())
        if not args.causal:
            got = [gather_sequence(t, group) for t in (o.detach(), *grads)]
            if rank == 0:
                entry["rel_err_vs_full"] = rel_errs(got, full_ref)
                entry["ok"] = within(entry["rel_err_vs_full"])
            del got
        if name == "ulysses":
            ref_out, ref_grads = o.detach(), grads
        elif ref_out is not None and (name.startswith(("hcms", "auto", "ulysses_", "prepacked"))):
            # out, dk, dv bit for bit; dq only up to the flash backward's atomic-add noise
            eq = torch.equal(o, ref_out) and all(torch.equal(a, b) for a, b in zip(grads[1:], ref_grads[1:]))
            flag = torch.tensor(int(eq), device="cuda")
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            entry["bitwise_equal_ulysses_out_dk_dv"] = bool(flag.item())
            entry["dq_rel_err_vs_ulysses"] = ((grads[0].float() - ref_grads[0].float()).norm()
                                              / ref_grads[0].float().norm()).item()
        elif ref_out is not None and not args.causal:  # causal modes read the data in different placements
            entry["rel_err_vs_ulysses"] = ((o.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        res["modes"][name] = entry
        del o, grads
    # 2. timing, interleaved: every repetition times each mode once, so clock and allocator drift
    #    hit all modes alike (sequential per-mode timing showed a +-5% spread between identical code)
    t_f, t_fb = interleaved_ms([{n: (lambda fn=fn: no_grad(fn)(q, k, v)) for n, fn in fns.items()},
                                {n: (lambda fn=fn: fb(fn)) for n, fn in fns.items()}], iters, group)
    for name in fns:
        res["modes"][name]["fwd_ms"], res["modes"][name]["fwd_bwd_ms"] = t_f[name], t_fb[name]
        add_ratios(res["modes"][name], res["floor"])
        fn = fns[name]
        if hasattr(fn, "mesh_of"):  # what placement="auto" built for this shape
            m = fn.mesh_of(q.shape[2])
            res["modes"][name]["mesh"] = {"ulysses_size": m.ulysses_size, "ring_size": m.ring_size}
        if hasattr(fn, "policy"):  # what auto chose for this shape (inference and training keys)
            res["modes"][name]["auto_choice"] = {
                ("train" if key[-1] else "infer"): {"chunks": cal.chunks, "measured_ms": cal.measured,
                                                    "confirm": cal.confirm, "reason": cal.reason}
                for key, cal in fn.policy.cache.items()
                if key[0] == tuple(q.shape) and key[-2] == split_transport(name)[1]}
    u = res["modes"].get("ulysses")
    if u:
        res["rho"] = res["t_comm_fwd"] / u["fwd_ms"]
        res["bound_fwd"] = u["fwd_ms"] / max(res["t_comm_fwd"], res["t_attn_fwd"])
        for name, e in res["modes"].items():
            e["speedup_fwd_vs_ulysses"] = u["fwd_ms"] / e["fwd_ms"]
            e["speedup_fwd_bwd_vs_ulysses"] = u["fwd_bwd_ms"] / e["fwd_bwd_ms"]
            if "deepspeed" in res["modes"]:
                dsm = res["modes"]["deepspeed"]
                e["speedup_fwd_vs_deepspeed"] = dsm["fwd_ms"] / e["fwd_ms"]
                e["speedup_fwd_bwd_vs_deepspeed"] = dsm["fwd_bwd_ms"] / e["fwd_bwd_ms"]
            if "minimal" in res["modes"]:
                mm = res["modes"]["minimal"]
                e["speedup_fwd_vs_minimal"] = mm["fwd_ms"] / e["fwd_ms"]
                e["speedup_fwd_bwd_vs_minimal"] = mm["fwd_bwd_ms"] / e["fwd_bwd_ms"]
    return res


def overlap_trace(group, h, seqlen, chunks, args):
    """Profile one HCMS forward+backward; fraction of NCCL kernel time that runs concurrently with compute."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    world = dist.get_world_size(group)
    q, k, v = (torch.randn(1, seqlen // world, h, args.head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    fn = lambda: spx.ulysses_attention(q, k, v, group, head_chunks=chunks, causal=args.causal).sum().backward()  # noqa
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type.name == "CUDA"]
    iv = lambda e: (e.time_range.start, e.time_range.end)  # noqa: E731
    nccl = [iv(e) for e in kern if "nccl" in e.name.lower()]
    comp = [iv(e) for e in kern if "nccl" not in e.name.lower() and ("attn" in e.name.lower() or "fmha" in e.name.lower()
                                                                   or "flash" in e.name.lower())]
    total = sum(b - a for a, b in nccl) or 1
    over = 0
    for a, b in nccl:
        for c, d in comp:
            over += max(0, min(b, d) - max(a, c))
    return {"chunks": chunks, "nccl_kernel_us": total, "nccl_overlapped_with_attention_us": over,
            "overlap_fraction": over / total, "n_nccl_kernels": len(nccl), "n_attention_kernels": len(comp)}


def _worker(rank, world, port, args, part_path):
    init_nccl_rank(rank, world, port, timeout_s=300)
    group = dist.group.WORLD
    modes = build_modes(args.modes.split(","), group, args.causal, nodes=args.nodes)
    out = []
    for h in args.heads:
        for L in args.seqlens:
            t0 = time.time()
            r = bench_shape(rank, world, group, h, L, args, modes)
            out.append(r)
            if rank == 0:
                brief = " ".join(f"{n}={e['fwd_ms']:.2f}/{e['fwd_bwd_ms']:.2f}" for n, e in r["modes"].items())
                print(f"[bench P={world} H={h} L={L} {time.time()-t0:.0f}s] rho={r.get('rho', 0):.2f} {brief}",
                      flush=True)
    trace = None
    if args.trace and world > 1:
        h = args.heads[-1]
        trace = overlap_trace(group, h, args.seqlens[min(1, len(args.seqlens) - 1)], min(4, h // world), args)
    finish_worker(rank, part_path, {"results": out, "trace": trace})


def write_reports(results, traces, args):
    meta = run_meta(torch=torch.__version__, causal=args.causal, dtype="bf16", B=1, D=args.head_dim)
    modes = []
    for r in results:
        for m in r["modes"]:
            if m not in modes:
                modes.append(m)
    lines = [f"Device: {meta['device']} x P, {meta['date']}, bf16, B=1, D={args.head_dim}, causal={args.causal}.",
             "Cells: fwd ms / fwd+bwd ms (speedup fwd / fwd+bwd vs our plain Ulysses) [ratio fwd / fwd+bwd to the "
             "floor]. Floor: one SDPA call of ceil(H/P) heads over L on one GPU of the same job. X: output or a "
             "gradient differs from one full-sequence call (non-causal rows) by more than 2e-2.", "",
             "| P | H | L | floor ms | rho | bound | " + " | ".join(modes) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(modes)]
    for r in results:
        cells = []
        for m in modes:
            e = r["modes"].get(m)
            cells.append("-" if e is None else
                         f"{e['fwd_ms']:.2f} / {e['fwd_bwd_ms']:.2f} ({e.get('speedup_fwd_vs_ulysses', 0):.2f}x / "
                         f"{e.get('speedup_fwd_bwd_vs_ulysses', 0):.2f}x) "
                         f"[{e.get('ratio_fwd', 0):.2f} / {e.get('ratio_fwd_bwd', 0):.2f}]"
                         + (" X" if e.get("ok") is False else ""))
        fl = r.get("floor", {})
        lines.append(f"| {r['P']} | {r['H']} | {r['L'] // 1024}K | {fl.get('fwd', 0):.2f} / {fl.get('fwd_bwd', 0):.2f} | "
                     f"{r.get('rho', 0):.2f} | {r.get('bound_fwd', 0):.2f}x | "
                     + " | ".join(cells) + " |")
    write_results(args.out, args.tag, {"meta": meta, "results": results, "overlap_traces": traces}, lines)
    bad = [(r["L"], m) for r in results for m, e in r["modes"].items() if e.get("ok") is False]
    if bad:
        print(f"[bench_attention] outputs or gradients differ from the full-sequence call beyond 2e-2: {bad}",
              flush=True)

    def draw(plt):
        keys = sorted({(r["P"], r["H"]) for r in results})
        fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
        for ax, (p, h) in zip(axes[0], keys):
            rows = [r for r in results if r["P"] == p and r["H"] == h]
            for m in modes:
                xs = [r["L"] // 1024 for r in rows if m in r["modes"]]
                ys = [r["modes"][m]["speedup_fwd_bwd_vs_ulysses"] for r in rows if m in r["modes"]]
                ax.plot(xs, ys, marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_title(f"P={p} H={h} fwd+bwd")
            ax.set_xlabel("sequence length (K tokens)")
            ax.set_ylabel("speedup vs plain Ulysses")
            ax.axhline(1.0, color="gray", lw=0.5)
        axes[0][0].legend(fontsize=7)
        return fig
    plot_or_skip(os.path.join(args.out, f"{args.tag}.png"), draw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="4")
    ap.add_argument("--heads", default="40")
    ap.add_argument("--seqlens", default="16384")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--modes", default="deepspeed,minimal,ulysses,hcms2,hcms3,hcms4,hcms5,hcms6,hcms8,auto")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--nodes", type=int, default=None, help="simulate this many machines (mesh modes)")
    ap.add_argument("--tag", default="bench", help="output file prefix")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trace", action="store_true", help="profile one HCMS run and report comm/compute overlap")
    ap.add_argument("--out", default="bench_out")
    links_option(ap)  # --links nvlink|host|emu<M> (tools/gpu_ranks.py)
    args = ap.parse_args()
    args.heads = [int(x) for x in args.heads.split(",")]
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    got_all = launch(_worker, [int(x) for x in args.world_sizes.split(",")], args, args.out, args.tag)
    if got_all is None:   # a torchrun rank other than 0: rank 0 writes the reports
        return
    results, traces = [], []
    for got in got_all:
        results += got["results"]
        if got["trace"]:
            traces.append({"P": got["results"][0]["P"], **got["trace"]})
    write_reports(results, traces, args)


if __name__ == "__main__":
    main()
