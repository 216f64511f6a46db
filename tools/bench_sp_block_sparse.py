r"""The block-sparse ring across real ranks (#55 item 2): one torchrun job, one rank per GPU over NCCL (gloo on CPU
for the smoke run), fwd+bwd time of the sparse ring beside the dense ring and dense / sparse Ulysses on the same
inputs, with the skipped steps and skipped K|V bytes from the ring's own plan.

Per sequence length S (--seqlens; bf16, B=1, non-causal: the video DiT's self-attention; shards from
``spx.shard_sequence`` in the default placement; the same full q/k/v/dO on every rank, seeded):
  dense_ulysses   ``spx.ulysses_attention(q, k, v, group, backend=--kernel)``            (once per S)
  dense_ring      ``spx.ring_attention(q, k, v, group, backend=--kernel)``               (once per S)
and per mask (--masks) and target sparsity (--sparsities), masks built by tools/bench_block_sparse.py's
``masks_for`` (random: per head and query tile round((1 - s) * nT) key tiles drawn at random, seeded, top-k-like,
[H, nT, nT]; window: ``training.video_dit.sparse.window_tile_mask`` on ``grid_for(S)`` with the window of
``window_for_sparsity``, [1, nT, nT]; the actual sparsity is in every row):
  sparse_ulysses  ``spx.ulysses_attention(..., block_mask=bm, block_size=--block-size, backend=--kernel)``
  sparse_ring     ``spx.ring_attention(..., block_mask=bm, block_size=--block-size, backend=--kernel)``, with the
                  plan's counters for EVERY rank (``sparse_ring_plan(bm, ...).counts(rank)``: steps run / skipped,
                  K|V bytes sent / skipped in the forward, dK|dV bytes sent / skipped in the backward); the dense
                  ring row carries the same counters of an all-True mask (nothing skipped), for comparison.

Every row: ``fwd_bwd_ms`` = the max over ranks of each rank's median (``ms_per_rank``: the medians, one all_gather)
of --iters forward+backward calls after --warmup calls, a barrier before each timed call, each call timed alone
(CUDA events: ``benchlib.event_ms``; the host clock on CPU: ``benchlib.host_ms``); ``first_call_s`` (host clock,
max over ranks: the first call compiles FA4's kernels, builds the ring plan and the tile metadata); useful TFLOP/s
per rank (4 * D * the rank's selected (query, key) pairs summed over heads for the forward, 3.5x that for fwd+bwd;
dense rows count every pair) at its own median, and ``useful_tflops`` (all ranks' useful work / P at the max);
``time_vs_dense`` (this row's ms / the dense row of the same family) beside ``work_vs_dense`` (1 - sparsity): the
time must fall with the skipped work. ``kernel_calls``: the calls the kernel registry routed by pick/require during
the row, by "kernel/tiles" or "kernel/dense" (a named FA4's block-sparse calls; a backend that bypasses the registry,
such as math, leaves it empty). A row that fails (out of memory, a kernel refused) records ``error`` on every rank
and the job goes on (a failure on ONE rank in the middle of an exchange cannot be caught: its peers wait in it).

Correctness, inside the job and at no extra call: the output and dq/dk/dv of the last timed call of the ring rows
(sparse and dense) against the Ulysses row of the same inputs and mask; norm-wise relative error per tensor, max over
tensors and ranks (``max_rel_err``; ``ok`` within --tol, bf16). ``sanity`` at the top: every check, the smallest
config's, and ``ok`` (False when any timed ring path disagrees with Ulysses: its time is then not a result).
``falls_with_work``: per (S, ulysses / ring, mask) the times from dense down the sparsities and whether each sparser
mask ran faster (a mask at 80% and 90% whose actual sparsities tie, e.g. the same window, can legitimately fail it).

NOT timed: building the masks and full inputs, sharding, the plan counters (computed on the host from the same
tables the ring uses), the correctness checks, fwd alone. Timed calls include everything the public functions do per
call (the mask's same-on-every-rank checksum all_gather, plan cache look-ups, exchanges, kernels, merges).

Link: env NCCL_P2P_DISABLE=1 -> "host" (NCCL through host memory), else "nvlink"; "gloo" on CPU. The caller sets
NCCL_NVLS_ENABLE=0 etc.; nothing here uses multicast. Rank 0 writes --out/bench_sp_block_sparse.json (after every
row: a job cut short keeps what it measured) and prints a markdown table.

    torchrun --nproc-per-node 2 tools/bench_sp_block_sparse.py --out $OUT/nvlink
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 tools/bench_sp_block_sparse.py --out $OUT/host
    torchrun --nproc-per-node 2 tools/bench_sp_block_sparse.py --seqlens 32768,75776 --heads 40 --head-dim 128 \\
        --block-size 128 --tile 4,4,8 --sparsities 0.8,0.9 --masks window,random --kernel fa4 --iters 10 --warmup 3 \\
        --out $OUT                                                       # the defaults spelled out, more iterations
    torchrun --nproc-per-node 2 tools/bench_sp_block_sparse.py --smoke --out /tmp/sp_bs   # CPU, gloo, tiny (the test)
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_sp_ext as spx  # noqa: E402
from megatron_sp_ext.attention import backends, block_sparse, kernels  # noqa: E402
from megatron_sp_ext.sp.heads import split_more_first  # noqa: E402
from megatron_sp_ext.sp.placement import positions  # noqa: E402
from megatron_sp_ext.sp.ring.sparse import sparse_ring_plan  # noqa: E402
from tools.bench_block_sparse import masks_for, selected_pairs  # noqa: E402
from tools.benchlib import event_ms, host_ms, init_world, run_meta, write_json  # noqa: E402

OUT_NAME = "bench_sp_block_sparse.json"
Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------------------------ collectives
def gather_floats(values: list, device: torch.device) -> list:
    """Every rank's ``values`` (floats): [[rank 0's], [rank 1's], ...] (one all_gather)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [x.tolist() for x in out]


def agreed_error(error: Optional[str]) -> Optional[str]:
    """None when no rank failed, else every failing rank's message (the same string on every rank)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if len(bad) == len(errors) and len(set(errors)) == 1:
        return f"every rank: {errors[0]}"
    return "; ".join(bad) if bad else None


# ------------------------------------------------------------------------------------------------ timing
def time_fwd_bwd(attn: Attn, q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor,
                 do_bshd: torch.Tensor, iters: int, warmup: int, device: torch.device) -> tuple:
    """(timing dict, [out, dq, dk, dv] of the last call) of ``attn`` forward+backward on this rank's shards.
    A barrier before every timed call; each call timed alone (CUDA events, or the host clock on CPU); the median per
    rank, gathered: ``ms_per_rank`` and ``fwd_bwd_ms`` (their max); ``first_call_s`` (max over ranks)."""
    cuda = device.type == "cuda"
    qkv = [x.detach().clone().requires_grad_() for x in (q_bshd, k_bshd, v_bshd)]
    last: dict = {}

    def fwd_bwd() -> torch.Tensor:
        for x in qkv:
            x.grad = None
        out_bshd = attn(*qkv)
        out_bshd.backward(do_bshd)
        last["out"] = out_bshd
        return out_bshd

    one = event_ms if cuda else host_ms
    dist.barrier()
    first_ms = host_ms(fwd_bwd)
    for _ in range(warmup):
        fwd_bwd()
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(one(fwd_bwd))
    median = sorted(times)[len(times) // 2]
    per_rank = gather_floats([median, first_ms], device)
    timing = {"fwd_bwd_ms": max(r[0] for r in per_rank), "ms_per_rank": [round(r[0], 3) for r in per_rank],
              "first_call_s": round(max(r[1] for r in per_rank) / 1e3, 3), "iters": iters, "warmup": warmup}
    return timing, [last["out"].detach(), *(x.grad for x in qkv)]


def rel_errors(got: list, ref: list, device: torch.device) -> dict:
    """Norm-wise relative error of out, dq, dk, dv (``got`` against ``ref``), each the max over ranks."""
    mine = [float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) for a, b in zip(got, ref)]
    worst = [max(col) for col in zip(*gather_floats(mine, device))]
    return {name: float(f"{e:.3g}") for name, e in zip(("out", "dq", "dk", "dv"), worst)}


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


# ------------------------------------------------------------------------------------------------ useful work
def ring_pairs(bm: Optional[torch.Tensor], s: int, h: int, world: int, block_size: int) -> list:
    """Selected (query, key) pairs summed over heads of each ring rank (its queries against every key); dense: all."""
    if bm is None:
        return [float(s // world * s * h)] * world
    keys = torch.arange(s)
    return [selected_pairs(bm, positions(spx.DEFAULT_PLACEMENT, r, world, s), keys, block_size, h)
            for r in range(world)]


def ulysses_pairs(bm: Optional[torch.Tensor], s: int, h: int, world: int, block_size: int) -> list:
    """Selected pairs of each Ulysses rank: the full sequence, its heads (``split_more_first``, in rank order)."""
    counts = split_more_first(h, world)
    if bm is None:
        return [float(s * s * c) for c in counts]
    full, out, start = torch.arange(s), [], 0
    for c in counts:
        out.append(selected_pairs(block_sparse.head_rows(bm, slice(start, start + c)), full, full, block_size, c))
        start += c
    return out


def plan_counts(bm: torch.Tensor, s: int, h: int, d: int, world: int, block_size: int, elem_bytes: int) -> list:
    """``sparse_ring_plan(bm, ...).counts(rank)`` for every rank (K|V bytes: one rank's k and v shards)."""
    kv_bytes = 2 * (s // world) * h * d * elem_bytes
    plan = sparse_ring_plan(bm.cpu(), world=world, seq_len=s, block_size=block_size, placement=spx.DEFAULT_PLACEMENT,
                            causal=False, kv_bytes=kv_bytes)
    return [plan.counts(r) for r in range(world)]


# ------------------------------------------------------------------------------------------------ one row
def bench_row(row: dict, attn: Attn, shards: list, pairs: list, args: argparse.Namespace,
              device: torch.device) -> tuple:
    """``row`` filled with the timing of ``attn`` (or ``error``) and the useful TFLOP/s of ``pairs`` (per rank);
    returns (row, [out, dq, dk, dv] of the last call, or None after an error)."""
    d = shards[0].shape[-1]
    before = dict(kernels.PICKS)
    error, got = None, None
    try:
        timing, got = time_fwd_bwd(attn, *shards, args.iters, args.warmup, device)
    except Exception as e:  # noqa: BLE001 - a row that cannot run here is recorded, the job goes on
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
    error = agreed_error(error)
    row["kernel_calls"] = {f"{n}/{what}": c - before.get((n, what), 0) for (n, what), c in kernels.PICKS.items()
                           if c != before.get((n, what), 0)}
    if error is not None:
        row["error"] = error
        got = None
    else:
        row.update(timing)
        flops = [3.5 * 4.0 * d * p for p in pairs]           # fwd+bwd useful FLOPs per rank
        row["useful_pairs_per_rank"] = pairs
        row["useful_tflops_per_rank"] = [_sig(f / ms / 1e9) for f, ms in zip(flops, row["ms_per_rank"])]
        row["useful_tflops"] = _sig(sum(flops) / len(flops) / row["fwd_bwd_ms"] / 1e9)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, got


def check(row: dict, got: Optional[list], ref: Optional[list], tol: float, device: torch.device) -> Optional[dict]:
    """The ring row's output and gradients against Ulysses' (``ref``) on the same inputs; the check's record."""
    if got is None or ref is None:
        row["check"] = "not run: " + ("this row failed" if got is None else "the Ulysses reference failed")
        return None
    errs = rel_errors(got, ref, device)
    row["rel_err_vs_ulysses"] = errs
    row["max_rel_err"] = max(errs.values())
    row["ok"] = row["max_rel_err"] <= tol
    return {"s": row["s"], "row": row["row"], "mask": row.get("mask", "dense"),
            "target_sparsity": row.get("target_sparsity", 0.0), "max_rel_err": row["max_rel_err"], "ok": row["ok"]}


# ------------------------------------------------------------------------------------------------ the job
def link_label(device: torch.device) -> str:
    """'gloo' on CPU; on NCCL 'host' when NCCL_P2P_DISABLE is 1, else 'nvlink'."""
    if device.type != "cuda":
        return "gloo"
    return "host" if os.environ.get("NCCL_P2P_DISABLE", "0").strip().lower() in ("1", "true", "yes") else "nvlink"


def full_inputs(s: int, h: int, d: int, device: torch.device, dtype: torch.dtype, seed: int) -> list:
    """q, k, v, dO [1, S, H, D] (bshd), the same on every rank (seeded generator)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(1, s, h, d, device=device, dtype=dtype, generator=g) for _ in range(4)]


def run(args: argparse.Namespace, device: torch.device) -> dict:
    """Every row on this rank (inside an initialised default process group); rank 0 writes the JSON after every row.
    Returns the document (the same rows on every rank; only rank 0 writes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16
    elem_bytes = torch.finfo(dtype).bits // 8
    h, d, bs = args.heads, args.head_dim, args.block_size
    seqlens = sorted(int(x) for x in args.seqlens.split(","))
    for s in seqlens:
        if s % (world * bs):
            raise SystemExit(f"S={s} must be a multiple of P * --block-size = {world * bs}")
    path = os.path.join(args.out, OUT_NAME)
    meta = run_meta(torch=torch.__version__, world=world, link=link_label(device),
                    NCCL_P2P_DISABLE=os.environ.get("NCCL_P2P_DISABLE"),
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
                    utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    dtype=str(dtype), batch=1, causal=False, heads=h, head_dim=d, block_size=bs, tile=args.tile,
                    kernel=args.kernel, placement=spx.DEFAULT_PLACEMENT, tol=args.tol,
                    flops="useful: 4*D*selected pairs per head (fwd); fwd+bwd 3.5x; per rank",
                    timing="fwd+bwd, median per rank of --iters after --warmup, barrier before each call, max over "
                           "ranks; CUDA events (host clock on CPU)")
    doc = {"meta": meta, "rows": [], "sanity": {"tol": args.tol, "checks": []}}
    t_job = time.perf_counter()

    def done(row: dict) -> None:
        doc["rows"].append(row)
        if rank == 0:
            write_json(path, doc)
            brief = {k: row.get(k) for k in ("row", "s", "mask", "sparsity", "fwd_bwd_ms", "useful_tflops",
                                             "max_rel_err", "error") if k in row}
            print(f"[bench_sp_block_sparse] {brief}", flush=True)

    for s in seqlens:
        full = full_inputs(s, h, d, device, dtype, args.seed)
        shards = [spx.shard_sequence(x, dist.group.WORLD).contiguous() for x in full]
        del full
        base = {"s": s, "h": h, "d": d, "p": world, "kernel": args.kernel}
        dense_ms = {}
        all_true = torch.ones(1, block_sparse.num_tiles(s, bs), block_sparse.num_tiles(s, bs), dtype=torch.bool)

        def uly(bm: Optional[torch.Tensor] = None) -> Attn:
            kw = {} if bm is None else {"block_mask": bm, "block_size": bs}
            return lambda q, k, v: spx.ulysses_attention(q, k, v, dist.group.WORLD, backend=args.kernel, **kw)

        def ring(bm: Optional[torch.Tensor] = None) -> Attn:
            kw = {} if bm is None else {"block_mask": bm, "block_size": bs}
            return lambda q, k, v: spx.ring_attention(q, k, v, dist.group.WORLD, backend=args.kernel, **kw)

        row, ref = bench_row(dict(base, row="dense_ulysses", sparsity=0.0), uly(), shards,
                             ulysses_pairs(None, s, h, world, bs), args, device)
        dense_ms["ulysses"] = row.get("fwd_bwd_ms")
        done(row)
        row, got = bench_row(dict(base, row="dense_ring", sparsity=0.0,
                                  counts_per_rank=plan_counts(all_true, s, h, d, world, bs, elem_bytes)),
                             ring(), shards, ring_pairs(None, s, h, world, bs), args, device)
        dense_ms["ring"] = row.get("fwd_bwd_ms")
        rec = check(row, got, ref, args.tol, device)
        del got, ref
        done(row)
        if rec:
            doc["sanity"]["checks"].append(rec)
        for bm, mask_meta in masks_for(s, h, args):
            meta_row = dict(base, **mask_meta)
            bm_dev = bm.to(device)   # one tensor for every call: the ring's plan cache keys on it
            row, ref = bench_row(dict(meta_row, row="sparse_ulysses"), uly(bm_dev), shards,
                                 ulysses_pairs(bm, s, h, world, bs), args, device)
            if dense_ms["ulysses"] and "fwd_bwd_ms" in row:
                row["time_vs_dense"] = round(row["fwd_bwd_ms"] / dense_ms["ulysses"], 4)
            row["work_vs_dense"] = round(1.0 - row["sparsity"], 4)
            done(row)
            counts = plan_counts(bm, s, h, d, world, bs, elem_bytes)
            row, got = bench_row(dict(meta_row, row="sparse_ring", counts_per_rank=counts,
                                      steps_skipped=sum(c["steps_skipped"] for c in counts),
                                      kv_bytes_skipped=sum(c["bytes_skipped"] for c in counts),
                                      dkv_bytes_skipped=sum(c["dkv_bytes_skipped"] for c in counts)),
                                 ring(bm_dev), shards, ring_pairs(bm, s, h, world, bs), args, device)
            if dense_ms["ring"] and "fwd_bwd_ms" in row:
                row["time_vs_dense"] = round(row["fwd_bwd_ms"] / dense_ms["ring"], 4)
            row["work_vs_dense"] = round(1.0 - row["sparsity"], 4)
            rec = check(row, got, ref, args.tol, device)
            del got, ref, bm_dev
            done(row)
            if rec:
                doc["sanity"]["checks"].append(rec)
        del shards
    checks = doc["sanity"]["checks"]
    smallest = [c for c in checks if c["s"] == seqlens[0] and c["row"] == "sparse_ring"]
    doc["sanity"].update(
        smallest_config=smallest[0] if smallest else None,
        max_rel_err=max((c["max_rel_err"] for c in checks), default=None),
        ok=bool(checks) and all(c["ok"] for c in checks),
        unchecked_ring_rows=sum(1 for r in doc["rows"] if r["row"].endswith("ring") and "max_rel_err" not in r))
    doc["falls_with_work"] = falls_with_work(doc["rows"])
    doc["job_s"] = round(time.perf_counter() - t_job, 1)
    doc["table"] = table(doc["rows"])
    if rank == 0:
        write_json(path, doc)
        print(doc["table"], flush=True)
        for f in doc["falls_with_work"]:
            print(f"S={f['s']} {f['family']} {f['mask']}: sparsity {f['sparsity']} -> ms "
                  f"{[None if x is None else round(x, 2) for x in f['fwd_bwd_ms']]}, falls={f['falls']}", flush=True)
        print(f"sanity: ring vs Ulysses max rel err {doc['sanity']['max_rel_err']} (tol {args.tol}), "
              f"ok={doc['sanity']['ok']}; job {doc['job_s']} s; wrote {path}", flush=True)
    return doc


def falls_with_work(rows: list) -> list:
    """Per (S, family ulysses / ring, mask): the times from the dense row down the sparsities, and ``falls``: each
    sparser mask ran faster than the denser one before it (None when a row of the series failed)."""
    out = []
    for s in sorted({r["s"] for r in rows}):
        for family in ("ulysses", "ring"):
            dense = next((r for r in rows if r["s"] == s and r["row"] == f"dense_{family}"), None)
            for mask in sorted({r["mask"] for r in rows if r["s"] == s and "mask" in r}):
                series = [dense] + sorted((r for r in rows if r["s"] == s and r["row"] == f"sparse_{family}"
                                           and r.get("mask") == mask), key=lambda r: r["sparsity"])
                ms = [None if r is None else r.get("fwd_bwd_ms") for r in series]
                falls = None if None in ms else all(b < a for a, b in zip(ms, ms[1:]))
                out.append({"s": s, "family": family, "mask": mask, "sparsity": [0.0] + [r["sparsity"]
                            for r in series[1:]], "fwd_bwd_ms": ms, "falls": falls})
    return out


def _mb(counts: list, key: str) -> str:
    """``key`` summed over the ranks' counters, in MiB (3 significant digits)."""
    return f"{sum(c[key] for c in counts) / 2**20:.3g}"


def table(rows: list) -> str:
    """The rows as a markdown table (counts: summed over ranks)."""
    lines = ["| S | row | mask | sparsity | fwd+bwd ms (max) | ms per rank | useful TFLOP/s/rank | "
             "time/work vs dense | steps run/skipped | K\\|V MB sent/skipped | dK\\|dV MB sent/skipped | "
             "rel err vs Ulysses |",
             "|" + "---|" * 12]
    for r in rows:
        c = r.get("counts_per_rank")
        steps = kv = dkv = ""
        if c:
            steps = f"{sum(x['steps_run'] for x in c)}/{sum(x['steps_skipped'] for x in c)}"
            kv = f"{_mb(c, 'bytes_sent')}/{_mb(c, 'bytes_skipped')}"
            dkv = f"{_mb(c, 'dkv_bytes_sent')}/{_mb(c, 'dkv_bytes_skipped')}"
        vs = f"{r['time_vs_dense']:.3f} / {r['work_vs_dense']:.3f}" if "time_vs_dense" in r else ""
        err = "" if "max_rel_err" not in r else f"{r['max_rel_err']:.2e}" + ("" if r["ok"] else " WRONG")
        timing = (f"{r['fwd_bwd_ms']:.2f} | {', '.join(f'{x:.2f}' for x in r['ms_per_rank'])} | "
                  f"{', '.join(f'{x:.4g}' for x in r['useful_tflops_per_rank'])}"
                  if "fwd_bwd_ms" in r else f"error: {r.get('error', '')[:80]} | | ")
        lines.append(f"| {r['s']} | {r['row']} | {r.get('mask', 'dense')} | {r['sparsity']} | {timing} | {vs} | "
                     f"{steps} | {kv} | {dkv} | {err} |")
    lines.append("counts summed over ranks (the plan's: forward K|V hops, backward dK|dV partials); "
                 "time/work vs dense: this row's ms / the dense row's of its family, beside 1 - sparsity.")
    return "\n".join(lines)


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    """The tool's flags; --smoke: CPU, gloo, S 256 and 512, H=4, D=16, 64-token tiles, the math kernel."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="32768,75776", help="full sequence lengths S (multiples of P * block size)")
    ap.add_argument("--heads", type=int, default=40, help="query heads (40: wan-14b)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128, help="tokens per mask tile")
    ap.add_argument("--tile", default="4,4,8", help="tokens per tile T,H,W of the window mask's grid (its volume "
                    "must be --block-size)")
    ap.add_argument("--sparsities", default="0.8,0.9")
    ap.add_argument("--masks", default="window,random")
    ap.add_argument("--kernel", default="fa4", choices=backends.backend_names(),
                    help="the local kernel (``backend=``) of every row")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tol", type=float, default=2e-2, help="norm-wise relative error of the ring vs Ulysses (bf16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, S=256,512, H=4, D=16, tiles of 64, math")
    ap.add_argument("--out", default="bench_sp_block_sparse_out")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seqlens, args.heads, args.head_dim, args.block_size, args.tile = "256,512", 4, 16, 64, "4,4,4"
        args.iters, args.warmup = 2, 1
        args.kernel = kernels.get(kernels.FALLBACK).setting
    return args


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark (see the module docstring). Joins torchrun's group (NCCL on GPUs; gloo with --smoke or
    without CUDA) unless a default group already exists (tests), which is then left as it was."""
    args = parse(argv)
    own_group = not dist.is_initialized()
    if own_group and (args.smoke or not torch.cuda.is_available()):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        device = torch.device("cpu")
    elif own_group:
        device = init_world()[2]
    else:
        cpu = args.smoke or dist.get_backend() == "gloo" or not torch.cuda.is_available()
        device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    try:
        return run(args, device)
    finally:
        if own_group:
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
