r"""Per-GPU memory plan for the video DiT: parameters, gradients, optimizer state, activations (no recompute, full
recompute, selective recompute that keeps the attention core, activation offloading), the SP exchanges' buffers,
and whether it fits a GPU.

    python -m training.video_dit.memory_plan --model wan-14b --tokens 75600 --sp 8 --gpus 8 --sharding fsdp \
        --recompute full
    python -m training.video_dit.memory_plan --model wan-14b --layers 4 --tokens 75600 --sp 2 --gpus 2 \
        --recompute selective
    python -m training.video_dit.memory_plan --model wan-14b --tokens 32760 --sp 4 --gpus 4 --sharding fsdp \
        --recompute selective --recompute-num-layers auto   # the fewest blocks to rerun that fit
    python -m training.video_dit.memory_plan --table      # wan-14b, 32K / 75K / 300K tokens on 8 / 16 / 64 GPUs
    python -m training.video_dit.memory_plan --validate   # fit and validate points apart; exit 1 if one is >10% off
    python -m training.video_dit.memory_plan --validate --require-ranks 1,2,4   # ... or a rank count has none
    python -m training.video_dit.memory_plan --merge $OUT/memory_peaks.json     # tools/measure_peaks.py's peaks

Recompute choices (the entry's flags): none; full (--recompute-granularity full); selective
(--recompute-granularity selective --recompute-modules outside_core_attn: everything of a block but the attention
core recomputed); --offload (--cpu-offloading, with none or selective); --recompute-num-layers N (the first N
blocks recompute, the others keep what a block keeps without recompute).

Model (bf16 autocast over fp32 weights, AdamW): parameters 4 B/param, gradients 4 B, Adam 8 B.
  none / distributed-optimizer (megatron DDP: fp32 gradient buffers for the whole step, fused AdamW): autocast's
  bf16 weight copies, 2 B/param: without recompute every block's copies are saved for the backward; with
  recompute the autocast cache is dropped when the forward's autocast ends, so the backward holds one recomputed
  block's copies (the end of the forward, all copies and no block's activations, is the other candidate peak: the
  larger of the two counts). Distributed-optimizer: Adam / (DP x CP). The peak is the backward of the last block.
  fsdp / zero3 (FSDP2, sharded over all DP x CP ranks, gradients set to None between steps, torch's foreach
  AdamW): the larger of two phases.
    backward of block i (blocks run L-1 .. 0): parameter and Adam shards; the gradient shards of the blocks whose
      backward is done (L-1-i of them: a shard exists once its reduce-scatter lands); one block unsharded at
      4 B/param (its bf16 parameters, and 2 B/param more: its bf16 gradient or the reduce-scatter buffer in flight,
      whichever meets the activation peak); the root's own parameters gathered in bf16 for the whole step; the
      activations of blocks 0..i (what each keeps) plus one block's working set. No autocast copies (FSDP2 gathers
      bf16 itself).
    optimizer step: parameter, gradient and Adam shards plus foreach AdamW's one temporary of the parameters' size
      (sqrt of the second moment, 4 B/param of the shard).
  Before 2026-11-27 the plan counted every gradient shard, two blocks unsharded at 6 B/param and no optimizer
  phase: +23% on the one 2-rank FSDP2 peak (23.0 GiB measured, plan 28.2), +7% at one rank.
  activations: c x dim bytes per local token per layer, c the one constant FITTED to the measured peaks marked
  "fit" (memory_peaks.json beside this file; least squares of the relative error; all of them without
  recompute, megatron DDP). What a block keeps between its forward and its backward, per local token:
    full: its input, the bf16 residual stream (2 x dim B);
    selective: its input (2 x dim), the attention core's saved q, k, v and output (8 x dim, bf16) and log-sum-exp
      (4 B per head), and at SP > 1 the output after its exchange back (2 x dim: the second region's input; at one
      rank it is the core's output itself);
    selective + offload: only the two recomputed regions' inputs stay (block input, core output: 4 x dim); the
      core's q, k, v, out, lse wait in pinned host memory (host_offload_gib);
    none + offload: nothing but the block being run (its c x dim come back for its backward).
  Recompute holds one block's activations (c x dim) while it is recomputed and backpropagated; under selective
  recompute less the core's q, k, v, out and lse, which it does not recompute (they are among the kept tensors:
  counted twice before 2026-11-27, +12.9% / +7.9% on the FSDP2 / DDP selective points at 2 ranks, now +8.2% /
  +4.9%).
  exchanges (SP > 1): Ulysses all-to-all of q, k, v, out in bf16, two in flight: 8 x dim B per local token.
  workspace: a constant (allocator slack, cuDNN workspace).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache

from .config import MODULATIONS

GIB = float(1 << 30)
WORKSPACE_GIB = 1.0
H200_USABLE_GIB = 139.0
MAX_VALIDATION_ERROR = 0.10
SHARDINGS = ("none", "distributed-optimizer", "fsdp", "zero3")
RECOMPUTES = ("none", "full", "selective")
PEAKS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_peaks.json")
# "modulation": the model's --modulation (config.MODULATIONS); every point measured before 2026-11-29 is "linear"
POINT_KEYS = ("model", "modulation", "layers", "tokens", "sp", "gpus", "sharding", "recompute")
# bytes per local token per layer a block keeps between forward and backward, in units of dim (bf16 tensors)
KEEP_FULL = 2          # the block's input
KEEP_SELECTIVE_SP1 = 10  # input + the core's q, k, v, out (its out is the second region's input)
KEEP_SELECTIVE_SP = 12   # ... + the output exchanged back (the second region's input) at SP > 1
KEEP_SELECTIVE_OFFLOAD = 4  # the regions' inputs only (block input, core output); q, k, v, out, lse on the host
FSDP_BLOCK_BYTES = 4   # one block unsharded in the backward: bf16 parameters + its bf16 gradient / the RS buffer
ADAM_FOREACH_TEMP = 4  # torch foreach AdamW: one fp32 temporary of the parameters' size


@dataclass
class Plan:
    model: str
    layers: int
    tokens: int
    sp: int
    gpus: int
    sharding: str
    recompute: str
    offload: bool
    params_b: float
    parameters_gib: float
    gradients_gib: float
    optimizer_gib: float
    autocast_copies_gib: float
    unsharded_blocks_gib: float
    activations_gib: float
    activations_per_layer_gib: float
    activations_per_layer_recompute_gib: float
    exchange_gib: float
    workspace_gib: float
    optimizer_temp_gib: float
    host_offload_gib: float
    peak_phase: str
    total_gib: float
    gpu_gib: float
    fits: bool
    recompute_layers: int = 0   # how many blocks (the first ones) recompute; the rest keep every activation


def param_counts(model: str, layers: int | None, modulation: str = "wan") -> tuple[int, int]:
    """(all parameters, parameters of one block), counted on the meta device (--modulation: config.MODULATIONS)."""
    import torch  # noqa: PLC0415
    from training.video_dit import VideoDiT, preset  # noqa: PLC0415
    cfg = preset(model, layers, modulation)
    with torch.device("meta"):
        m = VideoDiT(cfg)
    return sum(p.numel() for p in m.parameters()), sum(p.numel() for p in m.blocks[0].parameters())


def kept_per_layer(recompute: str, offload: bool, sp: int, dim: int, heads: int, per_layer: float) -> float:
    """Bytes per local token and layer a block keeps on the GPU between its forward and its backward (the plan's
    activation terms, module docstring); ``per_layer``: the no-recompute constant (c x dim)."""
    if recompute == "full":
        return KEEP_FULL * dim
    if recompute == "selective":
        if offload:
            return KEEP_SELECTIVE_OFFLOAD * dim
        return (KEEP_SELECTIVE_SP if sp > 1 else KEEP_SELECTIVE_SP1) * dim + 4 * heads
    return 0.0 if offload else per_layer


def plan(model: str, tokens: int, sp: int, gpus: int, sharding: str = "none", recompute: str = "none",
         layers: int | None = None, gpu_gib: float = H200_USABLE_GIB, act_bytes: float | None = None,
         offload: bool = False, recompute_layers: int | None = None, modulation: str = "wan") -> Plan:
    """The per-GPU memory of one training step (see the module docstring for the model); ``act_bytes``: the
    activation constant (default: fitted to the "fit" points of PEAKS_FILE); ``offload``: --cpu-offloading;
    ``recompute_layers``: --recompute-num-layers (the first N blocks recompute, the others keep everything as
    without recompute; default all); ``modulation``: the model's --modulation (config.MODULATIONS: "linear" has a
    Linear(d, 6d) per block)."""
    from training.video_dit import preset  # noqa: PLC0415
    if sharding not in SHARDINGS:
        raise ValueError(f"--sharding={sharding!r}: choose one of {', '.join(SHARDINGS)}")
    if recompute not in RECOMPUTES:
        raise ValueError(f"--recompute={recompute!r}: choose one of {', '.join(RECOMPUTES)}")
    if offload and recompute == "full":
        raise ValueError("--offload with --recompute full: the entry refuses --cpu-offloading there (the blocks "
                         "keep only their inputs, held by the checkpoint)")
    if sp < 1 or gpus % sp:
        raise ValueError(f"--gpus={gpus} must be a multiple of --sp={sp}")
    c = fitted_act_bytes() if act_bytes is None else act_bytes
    cfg = preset(model, layers, modulation)
    if recompute_layers is not None and (recompute == "none" or not 0 <= recompute_layers <= cfg.layers):
        raise ValueError(f"--recompute-num-layers={recompute_layers}: " + (
            "needs a recompute choice (full or selective)" if recompute == "none" else
            f"the model has {cfg.layers} layers"))
    n_rc = 0 if recompute == "none" else cfg.layers if recompute_layers is None else recompute_layers
    n, n_blk = param_counts(model, layers, modulation)
    n_root = n - cfg.layers * n_blk
    fsdp = sharding in ("fsdp", "zero3")
    shard = gpus if fsdp else 1
    p = 4 * n / shard / GIB
    g = 4 * n / shard / GIB
    o = 8 * n / (gpus if sharding != "none" else 1) / GIB
    local = tokens / sp
    per_layer = c * cfg.dim * local / GIB
    core = (8 * cfg.dim + 4 * cfg.heads) * local / GIB
    # per block (0 .. L-1; the first n_rc recompute): what it keeps between its forward and its backward, and the
    # working set of its backward: a recomputed block's activations (under selective less the core's q, k, v, out
    # and lse, kept: counted in ``keep``); a block without recompute has its activations among the kept ones
    # (offloaded: they come back for its backward)
    keep_rc = kept_per_layer(recompute, offload, sp, cfg.dim, cfg.heads, c * cfg.dim) * local / GIB
    keep_none = kept_per_layer("none", offload, sp, cfg.dim, cfg.heads, c * cfg.dim) * local / GIB
    keeps = [keep_rc] * n_rc + [keep_none] * (cfg.layers - n_rc)
    work_rc = per_layer - core if recompute == "selective" and not offload else per_layer
    works = [work_rc] * n_rc + [per_layer if offload else 0.0] * (cfg.layers - n_rc)
    keep = keeps[0]
    # offloaded: without recompute everything a block saves; selective: the core's q, k, v, out (bf16) and lse
    host = (n_rc * (core if recompute == "selective" else 0.0) + (cfg.layers - n_rc) * per_layer) if offload else 0.0
    exch = 8 * cfg.dim * local / GIB if sp > 1 else 0.0
    temp = 0.0
    if fsdp:
        # the backward of block i (L-1 .. 0): grads of the blocks done, blocks 0..i's kept tensors, block i's
        # working set
        g_blk = 4 * n_blk / shard / GIB
        blocks = (FSDP_BLOCK_BYTES * n_blk + 2 * n_root) / GIB
        phases = {f"backward of block {i}": (cfg.layers - 1 - i) * g_blk + sum(keeps[:i + 1]) + works[i]
                  for i in range(cfg.layers)}
        phase, bwd = max(phases.items(), key=lambda kv: kv[1])
        grads_bwd = (cfg.layers - 1 - int(phase.rsplit(" ", 1)[1])) * g_blk
        act, cast = bwd - grads_bwd, 0.0
        temp = ADAM_FOREACH_TEMP * n / shard / GIB
        backward_total = p + o + grads_bwd + blocks + act + exch + WORKSPACE_GIB
        optimizer_total = p + g + o + temp + WORKSPACE_GIB
        if optimizer_total > backward_total:
            phase, act, blocks, exch_used = "optimizer step", 0.0, 0.0, 0.0
            total = optimizer_total
        else:
            g, temp, exch_used = grads_bwd, 0.0, exch
            total = backward_total
        return Plan(model, cfg.layers, tokens, sp, gpus, sharding, recompute, offload, n / 1e9, p, g, o, cast,
                    blocks, act, per_layer, keep, exch_used, WORKSPACE_GIB, temp, host, phase, total, gpu_gib,
                    total <= gpu_gib, n_rc)
    blocks = 0.0
    cast_all, cast_blk = 2 * n / GIB, 2 * n_blk / GIB
    if n_rc == 0 and not offload:
        act, cast, phase = cfg.layers * per_layer, cast_all, "backward of the last block"
    elif n_rc == cfg.layers or offload:
        inputs = sum(keeps)
        # (offload without recompute: the saved bf16 weight copies go to the host too, as the recomputed ones go)
        if cast_all > works[-1] + cast_blk:  # the end of the forward: every block's copies, no block's activations
            act, cast, phase = inputs, cast_all, "end of the forward"
        else:  # the backward: one block recomputed (its activations and its bf16 weight copies)
            act, cast, phase = inputs + works[-1], cast_blk, "backward of the last block"
    else:  # the first n_rc blocks recompute: the end of the forward (every kept tensor, every block's copies) is
        # the peak, since any backward phase holds at most one block's working set more while a block without
        # recompute (its c x dim kept, which covers that working set) and the root's copies are already gone
        act, cast, phase = sum(keeps), cast_all, "end of the forward"
    total = p + g + o + cast + blocks + act + exch + WORKSPACE_GIB
    return Plan(model, cfg.layers, tokens, sp, gpus, sharding, recompute, offload, n / 1e9, p, g, o, cast, blocks,
                act, per_layer, keep, exch, WORKSPACE_GIB, temp, host, phase, total, gpu_gib, total <= gpu_gib, n_rc)


def fewest_recomputed_layers(model: str, tokens: int, sp: int, gpus: int, sharding: str, recompute: str,
                             layers: int | None = None, gpu_gib: float = H200_USABLE_GIB, offload: bool = False,
                             margin: float = MAX_VALIDATION_ERROR, modulation: str = "wan") -> int | None:
    """The smallest --recompute-num-layers whose plan stays within ``gpu_gib`` less ``margin`` (the plan's
    validated error): the fewest blocks to rerun; None when even every block recomputed does not fit."""
    from training.video_dit import preset  # noqa: PLC0415
    for n in range(preset(model, layers).layers + 1):
        if plan(model, tokens, sp, gpus, sharding, recompute, layers, gpu_gib, offload=offload,
                recompute_layers=n, modulation=modulation).total_gib <= gpu_gib * (1.0 - margin):
            return n
    return None


def load_points(path: str = PEAKS_FILE) -> list:
    """The measured peaks of ``path`` (each with role "fit" or "validate")."""
    with open(path) as f:
        points = json.load(f)["points"]
    for pt in points:
        if pt.get("role") not in ("fit", "validate"):
            raise ValueError(f"{path}: every point needs role fit or validate; got {pt}")
        if pt.get("modulation") not in MODULATIONS:
            raise ValueError(f"{path}: every point needs the model's modulation, one of {', '.join(MODULATIONS)} "
                             f"(config.MODULATIONS); got {pt}")
    return points


def fit_act_bytes(points: list) -> float:
    """The activation constant that minimises the squared relative error over the "fit" points only: each plan is
    linear in it (total = rest + c x coefficient), so the least-squares c is closed-form."""
    num = den = 0.0
    for pt in points:
        if pt["role"] != "fit":
            continue
        args = [pt[k] for k in ("model", "tokens", "sp", "gpus", "sharding", "recompute")]
        kw = {"layers": pt["layers"], "offload": pt.get("offload", False), "modulation": pt["modulation"]}
        at0 = plan(*args, act_bytes=0.0, **kw).total_gib
        at1 = plan(*args, act_bytes=1.0, **kw).total_gib
        a, rest = (at1 - at0) / pt["peak_gib"], at0 / pt["peak_gib"]
        num += a * (1.0 - rest)
        den += a * a
    if den == 0.0:
        raise ValueError("no fit point constrains the activation constant (mark some peaks role fit)")
    return num / den


@lru_cache(maxsize=None)
def fitted_act_bytes(path: str = PEAKS_FILE) -> float:
    return fit_act_bytes(load_points(path))


def validate(path: str = PEAKS_FILE) -> list[dict]:
    """Plan vs every measured peak of ``path`` (constant fitted to its fit points): rows with role, plan, measured
    and relative error (plan / measured - 1)."""
    points = load_points(path)
    c = fit_act_bytes(points)
    rows = []
    for pt in points:
        pl = plan(pt["model"], pt["tokens"], pt["sp"], pt["gpus"], pt["sharding"], pt["recompute"], pt["layers"],
                  act_bytes=c, offload=pt.get("offload", False), recompute_layers=pt.get("recompute_layers"),
                  modulation=pt["modulation"])
        rows.append({**{k: pt[k] for k in POINT_KEYS}, "offload": pt.get("offload", False),
                     "recompute_layers": pt.get("recompute_layers"), "role": pt["role"],
                     "date": pt.get("date", ""), "derived": bool(pt.get("derived", False)), "phase": pl.peak_phase,
                     "plan_gib": round(pl.total_gib, 2),
                     "measured_gib": pt["peak_gib"], "error": round(pl.total_gib / pt["peak_gib"] - 1, 6),
                     "device": pt.get("device", ""), "source": pt.get("source", ""), "act_bytes": c})
    return rows


def point_key(pt: dict) -> tuple:
    """What identifies a measured configuration (POINT_KEYS, whether it offloads, how many blocks recompute)."""
    return (*(pt[k] for k in POINT_KEYS), bool(pt.get("offload", False)), pt.get("recompute_layers"))


def merge(measured_json: str, path: str = PEAKS_FILE) -> int:
    """Add tools/measure_peaks.py's measured points (role validate; a point already there is replaced) to
    ``path``; returns how many were added or replaced."""
    with open(measured_json) as f:
        measured = json.load(f)
    new = [pt for pt in measured["points"] if pt.get("peak_gib") is not None]
    old = [pt for pt in new if pt.get("modulation") not in MODULATIONS]
    if old:
        raise ValueError(f"{measured_json}: {len(old)} point(s) without the model's modulation (one of "
                         f"{', '.join(MODULATIONS)}; tools/measure_peaks.py writes it since 2026-11-29): add "
                         f"\"modulation\": \"linear\" to points measured before then, e.g. {old[0]}")
    date = str(measured.get("meta", {}).get("date", ""))[:10]
    with open(path) as f:
        data = json.load(f)
    fresh = {point_key(pt) for pt in new}
    data["points"] = [pt for pt in data["points"] if point_key(pt) not in fresh or pt["role"] == "fit"] + \
        [{**{k: pt[k] for k in POINT_KEYS}, "offload": bool(pt.get("offload", False)),
          **({"recompute_layers": pt["recompute_layers"]} if pt.get("recompute_layers") is not None else {}),
          "peak_gib": round(pt["peak_gib"], 2), "role": "validate", "device": pt.get("device", ""),
          "date": pt.get("date", date), "source": pt.get("source", measured_json)} for pt in new]
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return len(new)


def markdown(rows: list) -> str:
    """The fitted / validated table of docs/full_depth_sharding.md."""
    c = rows[0]["act_bytes"] if rows else float("nan")
    out = [f"Activation constant fitted to the fit rows: {c:.1f} x dim bytes per local token per layer.", "",
           "| role | model | layers | tokens | SP | GPUs | sharding | recompute | plan GiB | measured GiB | error | "
           "plan's peak | device | date |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rc = r["recompute"] + (f" (first {r['recompute_layers']})" if r.get("recompute_layers") is not None else "") \
            + (" + offload" if r.get("offload") else "")
        out.append(f"| {r['role']} | {r['model']} ({r['modulation']}) | {r['layers']} | {r['tokens']:,} | {r['sp']} | {r['gpus']} | "
                   f"{r['sharding']} | {rc} | {r['plan_gib']:.1f} | {r['measured_gib']:.1f}{' (derived)' if r.get('derived') else ''} | "
                   f"{r['error']:+.1%} | {r['phase']} | {r['device']} | {r.get('date', '')} |")
    return "\n".join(out)


def failures(rows: list, require_ranks: tuple = ()) -> list[str]:
    """Why ``--validate`` fails: each validate row off by more than MAX_VALIDATION_ERROR (named), and each rank
    count of ``require_ranks`` without a validate row."""
    out = []
    for r in rows:
        if r["role"] == "validate" and abs(r["error"]) > MAX_VALIDATION_ERROR:
            out.append(f"{r['model']} {r['layers']} layers {r['tokens']} tokens SP={r['sp']} GPUs={r['gpus']} "
                       f"{r['sharding']} recompute={r['recompute']}"
                       f"{'' if r.get('recompute_layers') is None else ' first ' + str(r['recompute_layers'])}"
                       f"{' offload' if r.get('offload') else ''} "
                       f"({r['device']}): plan {r['plan_gib']} GiB vs measured {r['measured_gib']} GiB "
                       f"({r['error']:+.1%}, limit {MAX_VALIDATION_ERROR:.0%})")
    have = {r["gpus"] for r in rows if r["role"] == "validate"}
    out += [f"no validate point at {n} ranks (tools/measure_peaks.py on {n} GPUs, then --merge)"
            for n in require_ranks if n not in have]
    return out


def table(gpu_gib: float = H200_USABLE_GIB) -> list[Plan]:
    """wan-14b full depth at 32K / 75K / 300K tokens on 8 / 16 / 64 GPUs (SP = min(gpus, 8 at 32K ... ))."""
    out = []
    for tokens in (32760, 75600, 302400):
        for gpus in (8, 16, 64):
            sp = 8 if tokens <= 75600 else min(gpus, 32)
            sp = min(sp, gpus)
            for rc in ("none", "full", "selective"):
                out.append(plan("wan-14b", tokens, sp, gpus, "fsdp", rc, gpu_gib=gpu_gib))
    return out


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan-14b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--modulation", default="wan", choices=list(MODULATIONS),
                    help="the entry's --modulation (linear: a Linear per block, the model before 2026-11-29)")
    ap.add_argument("--tokens", type=int, default=75600)
    ap.add_argument("--sp", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--sharding", default="fsdp", choices=SHARDINGS)
    ap.add_argument("--recompute", default="full", choices=RECOMPUTES,
                    help="selective: --recompute-granularity selective --recompute-modules outside_core_attn")
    ap.add_argument("--offload", action="store_true", help="--cpu-offloading (with --recompute none or selective)")
    ap.add_argument("--recompute-num-layers", default=None,
                    help="the entry's flag: only the first N blocks recompute (default all); 'auto': the fewest "
                         "that fit --gpu-gib less 10%% (the plan's validated error), printed as the flag to pass")
    ap.add_argument("--gpu-gib", type=float, default=H200_USABLE_GIB, help="usable GPU memory (H200: 139 GiB)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--validate", action="store_true", help="plan vs every measured peak (fit and validate rows); "
                    "exit 1 when a validate row is off by more than 10%% (each named)")
    ap.add_argument("--require-ranks", default="", help="with --validate: also exit 1 when one of these rank "
                    "counts (comma-separated, e.g. 1,2,4) has no validate point")
    ap.add_argument("--peaks", default=PEAKS_FILE, help="the measured peaks (JSON, each point role fit or validate)")
    ap.add_argument("--merge", default=None, help="add tools/measure_peaks.py's JSON to --peaks as validate points")
    a = ap.parse_args(argv)
    if a.merge:
        try:
            n = merge(a.merge, a.peaks)
        except ValueError as e:
            ap.error(str(e))
        print(f"merged {n} points into {a.peaks}")
        return 0
    if a.validate and a.recompute_num_layers is not None:
        ap.error("--recompute-num-layers with --validate: each measured point carries its own (memory_peaks.json)")
    if a.validate:
        try:
            need = tuple(int(x) for x in a.require_ranks.split(",") if x.strip())
        except ValueError:
            ap.error(f"--require-ranks={a.require_ranks!r}: comma-separated rank counts, e.g. 1,2,4")
        rows = validate(a.peaks)
        print(json.dumps(rows, indent=1) if a.json else markdown(rows))
        bad = failures(rows, need)
        for why in bad:
            print(f"FAIL: {why}", file=sys.stderr)
        return 1 if bad else 0
    n_rc = None
    if a.recompute_num_layers is not None and a.table:
        ap.error("--recompute-num-layers with --table: the table plans every block recomputed; plan one "
                 "configuration (--model/--tokens/--sp/--gpus/--sharding/--recompute) instead")
    if a.recompute_num_layers == "auto" and a.offload:
        ap.error("--recompute-num-layers auto with --offload: a block offloaded without recompute keeps nothing on "
                 "the GPU, so auto would always say 0 (no recompute, everything on the host), a setting no measured "
                 "point validates; give --recompute-num-layers N")
    try:
        if a.recompute_num_layers == "auto":
            n_rc = fewest_recomputed_layers(a.model, a.tokens, a.sp, a.gpus, a.sharding, a.recompute, a.layers,
                                            a.gpu_gib, a.offload, modulation=a.modulation)
            if n_rc is None:
                ap.error(f"--recompute-num-layers auto: --recompute {a.recompute} does not fit {a.gpu_gib} GiB "
                         f"less 10% even with every block recomputed; try more GPUs, a larger --sp or --offload")
            print(f"--recompute-num-layers {n_rc}")
        elif a.recompute_num_layers is not None:
            try:
                n_rc = int(a.recompute_num_layers)
            except ValueError:
                ap.error(f"--recompute-num-layers={a.recompute_num_layers!r}: a block count or auto")
        plans = table(a.gpu_gib) if a.table else [plan(a.model, a.tokens, a.sp, a.gpus, a.sharding, a.recompute,
                                                         a.layers, a.gpu_gib, offload=a.offload,
                                                         recompute_layers=n_rc, modulation=a.modulation)]
    except ValueError as e:
        ap.error(str(e))
    if a.json:
        print(json.dumps([asdict(p) for p in plans], indent=1))
        return 0
    print("| tokens | GPUs | SP | sharding | recompute | state (params, grads, Adam, unsharded, temp) | activations | exchange | total GiB | fits | "
          "peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in plans:
        state = p.parameters_gib + p.gradients_gib + p.optimizer_gib + p.autocast_copies_gib + \
            p.unsharded_blocks_gib + p.optimizer_temp_gib
        part = f" (first {p.recompute_layers} of {p.layers})" if p.recompute != "none" and \
            p.recompute_layers != p.layers else ""
        print(f"| {p.tokens:,} | {p.gpus} | {p.sp} | {p.sharding} | {p.recompute}{part}"
              f"{' + offload' if p.offload else ''} "
              f"| {state:.1f} | {p.activations_gib:.1f} | {p.exchange_gib:.1f} | {p.total_gib:.1f} | "
              f"{'yes' if p.fits else 'no'} | {p.peak_phase} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
