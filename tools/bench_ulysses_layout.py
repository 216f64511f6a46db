r"""Causal Ulysses in the zigzag / tasp_zigzag layouts vs the contiguous layout, beside the kernel floor.

Launched with torchrun (one process per GPU). For every (H, L) it times, fwd and fwd+bwd (CUDA events,
median of --iters, max over ranks):
  floor            one rank's share as ONE local kernel call (H/P heads over the whole sequence, SDPA)
  contiguous       ulysses_attention(causal=True) on contiguous shards
  zigzag           the same on Megatron's zigzag shards (permutation folded into the exchange copies)
  tasp_zigzag      the same on TASP's zigzag shards
  zigzag_masked    the old path: masked position runs (a RingBackend over the gathered runs)
  noncausal        plain non-causal Ulysses (for reference)
and checks that zigzag's output (in global order) equals contiguous's (bitwise expected; max abs diff
recorded). Writes bench_ulysses_layout.json (+ .md table) to --out with date, device and command.
Example (2 or 4 GPUs):
  torchrun --nproc-per-node 4 tools/bench_ulysses_layout.py --heads 40 --seqlens 16384,32768,65536 --out $OUT

--adapters (issue #35 item 2): the copies around the exchanges for what Megatron hands over (sbhd, zigzag, causal,
B = 1 by default), fwd and fwd+bwd per row, beside the same floor:
  separate / separate_before    q, k, v as separate tensors, with / without the per-piece exchanges that carry the
                                zigzag permutation (before: MAX_PIECE_SLOTS = 0, the index copies)
  fused / fused_before          q, k, v as views of one [S, B, H, 3 * D] projection output (one-pass pack)
  views                         separate, qkv_contiguous=False: the kernel reads the received buffer in place
  packed                        PackedUlysses on pre-packed q|k|v (no pack copy: what a producer-owned layout gives)
and, with --profile, each mode's copy-like kernels of one fwd+bwd (name matches copy / index / Memcpy: count and ms).
Checks that every mode's output equals separate_before bitwise. Writes bench_ulysses_adapters.json (+ .md).
  torchrun --nproc-per-node 2 tools/bench_ulysses_layout.py --adapters --heads 40 --seqlens 16384,32768,65536 \
      --profile --out $OUT
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_sp_ext as spx  # noqa: E402
from megatron_sp_ext.attention.backends import AutoBackend  # noqa: E402
from megatron_sp_ext.sp.placement import divisor, pieces  # noqa: E402
from megatron_sp_ext.sp.calibration import time_ms  # noqa: E402
from megatron_sp_ext.sp.ring import RingBackend  # noqa: E402
from megatron_sp_ext.sp.ulysses import engine as uly_engine  # noqa: E402
from megatron_sp_ext.sp.ulysses import pack_qkv, packed_head_layout, packed_ulysses_attention  # noqa: E402
from tools.benchlib import init_world, run_meta, write_results  # noqa: E402


def _shard(x, pl, rank, world):
    return torch.cat([x[:, a:a + n] for a, n in pieces(pl, rank, world, x.shape[1])], dim=1).contiguous()


def add_floor(res: dict, full, heads_local: int, iters: int, warmup: int, group, timer) -> None:
    """res["floor"]: one rank's ``heads_local`` heads of the full-sequence q/k/v/dO ``full`` ([B, S, H, D]) as one
    causal cuDNN-family SDPA call, forward and forward+backward (``timer``); every mode's ratios to it."""
    qf, kf, vf, dof = (t[:, :, :heads_local].transpose(1, 2).contiguous().transpose(1, 2) for t in full)
    qf.requires_grad_(), kf.requires_grad_(), vf.requires_grad_()

    def floor_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)

    def floor_fb():
        F.scaled_dot_product_attention(qf, kf, vf, is_causal=True).backward(dof)
    res["floor"] = {"fwd_ms": timer(floor_fwd, iters, warmup, group, long_ms=None),
                    "fwd_bwd_ms": timer(floor_fb, iters, warmup, group, long_ms=None)}
    for m in res["modes"].values():
        m["fwd_ratio_to_floor"] = m["fwd_ms"] / res["floor"]["fwd_ms"]
        m["fwd_bwd_ratio_to_floor"] = m["fwd_bwd_ms"] / res["floor"]["fwd_bwd_ms"]


def bench_shape(group, h, seqlen, d, iters, warmup, device="cuda", timer=time_ms, dtype=torch.bfloat16):
    """One row (see module docstring); ``device``/``timer``/``dtype`` let a CPU smoke test run it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    seqlen -= seqlen % divisor("tasp_zigzag", world)
    g = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(1, seqlen, h, d, device=device, dtype=dtype, generator=g) for _ in range(4)]
    runs = tuple(r for p in range(world) for r in pieces("zigzag", p, world, seqlen))
    masked = RingBackend(None, "ring", runs, (runs,), AutoBackend())
    modes = {
        "contiguous": ("contiguous", dict(causal=True)),
        "zigzag": ("zigzag", dict(causal=True, placement="zigzag")),
        "tasp_zigzag": ("tasp_zigzag", dict(causal=True, placement="tasp_zigzag")),
        "zigzag_masked": ("zigzag", dict(causal=True, backend=masked)),
        "noncausal": ("contiguous", dict(causal=False)),
    }
    res = {"H": h, "L": seqlen, "P": world, "modes": {}}
    outs = {}
    for name, (pl, kw) in modes.items():
        q, k, v, do = (_shard(t, pl, rank, world) for t in full)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                return spx.ulysses_attention(q, k, v, group, **kw)

        def fwd_bwd():
            spx.ulysses_attention(qs, ks, vs, group, **kw).backward(do)
        t_f = timer(fwd, iters, warmup, group, long_ms=None)
        t_fb = timer(fwd_bwd, iters, warmup, group, long_ms=None)
        res["modes"][name] = {"fwd_ms": t_f, "fwd_bwd_ms": t_fb}
        if name in ("contiguous", "zigzag", "tasp_zigzag"):
            outs[name] = spx.unshard_sequence(fwd(), group, placement=pl)
    # the floor: one rank's heads over the whole sequence, one causal kernel call
    add_floor(res, full, h // world, iters, warmup, group, timer)
    c = res["modes"]["contiguous"]
    for name in ("zigzag", "tasp_zigzag", "zigzag_masked"):
        res["modes"][name]["fwd_bwd_vs_contiguous"] = res["modes"][name]["fwd_bwd_ms"] / c["fwd_bwd_ms"]
    for name in ("zigzag", "tasp_zigzag"):
        res["modes"][name]["equals_contiguous"] = bool(torch.equal(outs[name], outs["contiguous"]))
        res["modes"][name]["max_abs_diff"] = float((outs[name].float() - outs["contiguous"].float()).abs().max())
    return res


def _copy_kernels(step, device) -> dict:
    """Copy-like kernels (name matches copy / index / Memcpy) of one call of ``step``: count and device ms."""
    if device != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    n, ms = 0, 0.0
    for e in prof.key_averages():
        if re.search(r"copy|index|Memcpy", e.key, re.IGNORECASE) and getattr(e, "device_time_total", 0) > 0:
            n += e.count
            ms += e.device_time_total / 1e3
    return {"copy_kernels": n, "copy_ms": ms}


def bench_adapters(group, h, seqlen, d, iters, warmup, device="cuda", timer=time_ms, dtype=torch.bfloat16,
                   batch=1, chunks=1, profile=False):
    """One --adapters row (module docstring); ``device``/``timer``/``dtype`` let a CPU smoke test run it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    seqlen -= seqlen % divisor("zigzag", world)
    g = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(batch, seqlen, h, d, device=device, dtype=dtype, generator=g) for _ in range(4)]
    q, k, v, do = (_shard(t, "zigzag", rank, world).transpose(0, 1).contiguous() for t in full)  # sbhd shards
    kw = dict(head_chunks=chunks, causal=True, layout="sbhd", placement="zigzag")

    def leaves():
        return [t.clone().requires_grad_() for t in (q, k, v)]

    def fused_views(ls):
        return torch.split(torch.cat(ls, dim=3), [d, d, d], dim=3)  # [S, B, H, 3 * D] -> views

    def piece_slots(on):
        return uly_engine.MAX_PIECE_SLOTS if on else 0
    modes = {"separate_before": (False, False, True), "separate": (False, True, True),
             "fused_before": (True, False, True), "fused": (True, True, True), "views": (False, True, False)}
    res = {"H": h, "L": seqlen, "P": world, "B": batch, "chunks": chunks, "modes": {}}
    outs = {}
    default_slots = uly_engine.MAX_PIECE_SLOTS
    for name, (fused, pieces_on, contiguous) in modes.items():
        ls = leaves()

        def fwd(ls=ls, fused=fused, contiguous=contiguous):
            with torch.no_grad():
                args = fused_views(ls) if fused else ls
                return spx.ulysses_attention(*args, group, qkv_contiguous=contiguous, **kw)

        def fwd_bwd(ls=ls, fused=fused, contiguous=contiguous):
            args = fused_views(ls) if fused else ls
            spx.ulysses_attention(*args, group, qkv_contiguous=contiguous, **kw).backward(do)
        uly_engine.MAX_PIECE_SLOTS = default_slots if pieces_on else 0
        try:
            row = {"fwd_ms": timer(fwd, iters, warmup, group, long_ms=None),
                   "fwd_bwd_ms": timer(fwd_bwd, iters, warmup, group, long_ms=None)}
            if profile:
                row.update(_copy_kernels(fwd_bwd, device))
            outs[name] = fwd()
        finally:
            uly_engine.MAX_PIECE_SLOTS = default_slots
        res["modes"][name] = row
    if h % world == 0:  # the packed entry: the producer wrote the send layout (not timed here)
        hl = packed_head_layout(h, h, world, chunks)
        qb, kb, vb = (t.transpose(0, 1).contiguous() for t in (q, k, v))
        sends = [t.detach().requires_grad_() for t in pack_qkv(qb, kb, vb, hl)]
        do_b = do.transpose(0, 1).contiguous()
        pkw = dict(num_heads=h, num_kv_heads=h, head_chunks=chunks, causal=True, placement="zigzag")

        def p_fwd():
            with torch.no_grad():
                return packed_ulysses_attention(sends, group, **pkw)

        def p_fwd_bwd():
            packed_ulysses_attention(sends, group, **pkw).backward(do_b)
        row = {"fwd_ms": timer(p_fwd, iters, warmup, group, long_ms=None),
               "fwd_bwd_ms": timer(p_fwd_bwd, iters, warmup, group, long_ms=None)}
        if profile:
            row.update(_copy_kernels(p_fwd_bwd, device))
        res["modes"]["packed"] = row
    add_floor(res, full, h // world, iters, warmup, group, timer)
    base = outs["separate_before"]
    for name, o in outs.items():
        res["modes"][name]["equals_before"] = bool(torch.equal(o, base))
    return res


def _write_adapters(rows, out):
    names = ["separate_before", "separate", "fused_before", "fused", "views", "packed"]
    lines = ["| P | H | L | B | C | floor fwd+bwd ms | " + " | ".join(names) + " | bitwise |",
             "|---|---|---|---|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        m = r["modes"]
        cells = [f"{m[n]['fwd_bwd_ms']:.2f} ({m[n]['fwd_bwd_ratio_to_floor']:.3f})"
                 + (f" [{m[n]['copy_kernels']} copies, {m[n]['copy_ms']:.2f} ms]" if "copy_kernels" in m[n] else "")
                 if n in m else "-" for n in names]
        same = all(m[n].get("equals_before", True) for n in m)
        lines.append(f"| {r['P']} | {r['H']} | {r['L']} | {r['B']} | {r['chunks']} | {r['floor']['fwd_bwd_ms']:.2f} | "
                     + " | ".join(cells) + f" | {same} |")
    write_results(out, "bench_ulysses_adapters", {**run_meta(), "rows": rows},
                  ["fwd+bwd ms (ratio to the kernel floor) [copy-like kernels of one fwd+bwd]", "", *lines])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="40")
    ap.add_argument("--seqlens", default="16384,32768")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="bench_ulysses_layout_out")
    ap.add_argument("--adapters", action="store_true", help="the adapters' exchange copies (module docstring)")
    ap.add_argument("--batch", type=int, default=1, help="--adapters: micro-batch B")
    ap.add_argument("--chunks", type=int, default=1, help="--adapters: HCMS head chunks")
    ap.add_argument("--profile", action="store_true", help="--adapters: count copy-like kernels per mode")
    args = ap.parse_args()
    rank, _, _ = init_world("nccl")
    group = dist.group.WORLD
    rows = []
    if args.adapters:
        for h in (int(x) for x in args.heads.split(",")):
            for seqlen in (int(x) for x in args.seqlens.split(",")):
                rows.append(bench_adapters(group, h, seqlen, args.head_dim, args.iters, args.warmup, batch=args.batch,
                                           chunks=args.chunks, profile=args.profile))
                if rank == 0:
                    r = rows[-1]
                    print(f"[bench_ulysses_layout --adapters] P={r['P']} H={h} L={r['L']} B={r['B']}: " + ", ".join(
                        f"{n} {m['fwd_bwd_ms']:.2f} ms ({m['fwd_bwd_ratio_to_floor']:.3f})"
                        for n, m in r["modes"].items()) + f", floor {r['floor']['fwd_bwd_ms']:.2f} ms", flush=True)
        if rank == 0:
            _write_adapters(rows, args.out)
        dist.destroy_process_group()
        return
    for h in (int(x) for x in args.heads.split(",")):
        for seqlen in (int(x) for x in args.seqlens.split(",")):
            rows.append(bench_shape(group, h, seqlen, args.head_dim, args.iters, args.warmup))
            if rank == 0:
                r = rows[-1]
                print(f"[bench_ulysses_layout] P={r['P']} H={h} L={r['L']}: " + ", ".join(
                    f"{n} {m['fwd_bwd_ms']:.2f} ms ({m['fwd_bwd_ratio_to_floor']:.2f})" for n, m in r["modes"].items())
                    + f", floor {r['floor']['fwd_bwd_ms']:.2f} ms", flush=True)
    if rank == 0:
        lines = ["| P | H | L | floor fwd+bwd | contiguous | zigzag | tasp_zigzag | zigzag masked (old) | zigzag/contig |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            m = r["modes"]
            cell = lambda n: f"{m[n]['fwd_bwd_ms']:.2f} ({m[n]['fwd_bwd_ratio_to_floor']:.2f})"  # noqa: E731
            lines.append(f"| {r['P']} | {r['H']} | {r['L']} | {r['floor']['fwd_bwd_ms']:.2f} | {cell('contiguous')} | "
                         f"{cell('zigzag')} | {cell('tasp_zigzag')} | {cell('zigzag_masked')} | "
                         f"{m['zigzag']['fwd_bwd_vs_contiguous']:.3f} |")
        write_results(args.out, "bench_ulysses_layout", {**run_meta(), "rows": rows}, lines)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
