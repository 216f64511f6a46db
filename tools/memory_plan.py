"""Per-GPU memory plan for the video DiT: parameters, gradients, optimizer state, activations (with / without
full recompute), the attention's and the SP exchanges' buffers, and whether it fits a GPU.

    python tools/memory_plan.py --model wan-14b --tokens 75600 --sp 8 --gpus 8 --sharding fsdp --recompute full
    python tools/memory_plan.py --table          # wan-14b, 32K / 75K / 300K tokens on 8 / 16 / 64 GPUs
    python tools/memory_plan.py --validate       # fit and validate points apart; exit 1 if a validate one is >10% off
    python tools/memory_plan.py --merge $OUT/memory_peaks.json   # add tools/measure_peaks.py's GPU peaks (validate)

Model (bf16 autocast over fp32 weights, AdamW, Megatron's fp32 gradient buffers):
  parameters 4 B/param, gradients 4 B, Adam 8 B.
  none / distributed-optimizer: autocast's bf16 weight copies, 2 B/param: without recompute every block's copies
  are saved for the backward; with full recompute the autocast cache is dropped when the forward's autocast ends,
  so the backward holds one recomputed block's copies (the end of the forward, all copies and no block's
  activations, is the other candidate peak: the larger of the two counts). Distributed-optimizer: Adam / (DP x CP).
  fsdp / zero3: parameters, gradients and Adam / (DP x CP), no autocast copies (FSDP2 gathers bf16 itself), plus
  two blocks unsharded (bf16 params + fp32 gradients: one in use, one prefetched; at one rank no unsharded
  gradient: it is the shard) and the root's own (non-block) parameters gathered in bf16 for the whole step.
  activations: c x dim bytes per local token per layer, c the one constant FITTED to the
  measured peaks marked "fit" (tools/results/memory_peaks/peaks.json; least squares of the relative error).
  full recompute keeps each block's input, the bf16 residual stream (the patch embedding's output is bf16 under
  autocast, and every block adds bf16 to it): 2 x dim B per local token per layer, plus one block's activations
  while it is recomputed.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = float(1 << 30)
WORKSPACE_GIB = 1.0
H200_USABLE_GIB = 139.0
MAX_VALIDATION_ERROR = 0.10
SHARDINGS = ("none", "distributed-optimizer", "fsdp", "zero3")
PEAKS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory_peaks", "peaks.json")
POINT_KEYS = ("model", "layers", "tokens", "sp", "gpus", "sharding", "recompute")


@dataclass
class Plan:
    model: str
    layers: int
    tokens: int
    sp: int
    gpus: int
    sharding: str
    recompute: str
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
    total_gib: float
    gpu_gib: float
    fits: bool


def param_counts(model: str, layers: int | None) -> tuple[int, int]:
    """(all parameters, parameters of one block), counted on the meta device."""
    import torch  # noqa: PLC0415
    from training.video_dit import VideoDiT, preset  # noqa: PLC0415
    cfg = preset(model, layers)
    with torch.device("meta"):
        m = VideoDiT(cfg)
    return sum(p.numel() for p in m.parameters()), sum(p.numel() for p in m.blocks[0].parameters())


def plan(model: str, tokens: int, sp: int, gpus: int, sharding: str = "none", recompute: str = "none",
         layers: int | None = None, gpu_gib: float = H200_USABLE_GIB, act_bytes: float | None = None) -> Plan:
    """The per-GPU memory of one training step (see the module docstring for the model); ``act_bytes``: the
    activation constant (default: fitted to the "fit" points of PEAKS_FILE)."""
    from training.video_dit import preset  # noqa: PLC0415
    if sharding not in SHARDINGS:
        raise ValueError(f"--sharding={sharding!r}: choose one of {', '.join(SHARDINGS)}")
    if recompute not in ("none", "full"):
        raise ValueError(f"--recompute={recompute!r}: choose none or full")
    if sp < 1 or gpus % sp:
        raise ValueError(f"--gpus={gpus} must be a multiple of --sp={sp}")
    c = fitted_act_bytes() if act_bytes is None else act_bytes
    cfg = preset(model, layers)
    n, n_blk = param_counts(model, layers)
    fsdp = sharding in ("fsdp", "zero3")
    shard = gpus if fsdp else 1
    p = 4 * n / shard / GIB
    g = 4 * n / shard / GIB
    o = 8 * n / (gpus if sharding != "none" else 1) / GIB
    local = tokens / sp
    per_layer = c * cfg.dim * local / GIB
    per_layer_rc = 2 * cfg.dim * local / GIB
    # two blocks unsharded: bf16 params, and fp32 gradients before their reduce-scatter where there is one to do
    # (one rank: the gradient is the shard itself; the plan without this was 8-18% over three FSDP2 peaks
    # measured at one rank on an H100, 2026-11-25, and this term was revised after them)
    unsharded_grad = 4 if shard > 1 else 0
    blocks = (2 * (2 + unsharded_grad) * n_blk + 2 * (n - cfg.layers * n_blk)) / GIB if fsdp else 0.0
    if recompute == "none":
        act = cfg.layers * per_layer
        cast = 0.0 if fsdp else 2 * n / GIB
    else:
        inputs = cfg.layers * per_layer_rc
        cast_all, cast_blk = (0.0, 0.0) if fsdp else (2 * n / GIB, 2 * n_blk / GIB)
        if cast_all > per_layer + cast_blk:  # the end of the forward: every block's copies, no block's activations
            act, cast = inputs, cast_all
        else:  # the backward: one block recomputed (its activations and its bf16 weight copies)
            act, cast = inputs + per_layer, cast_blk
    exch = 8 * cfg.dim * local / GIB if sp > 1 else 0.0
    total = p + g + o + cast + blocks + act + exch + WORKSPACE_GIB
    return Plan(model, cfg.layers, tokens, sp, gpus, sharding, recompute, n / 1e9, p, g, o, cast, blocks, act,
                per_layer, per_layer_rc, exch, WORKSPACE_GIB, total, gpu_gib, total <= gpu_gib)


def load_points(path: str = PEAKS_FILE) -> list:
    """The measured peaks of ``path`` (each with role "fit" or "validate")."""
    with open(path) as f:
        points = json.load(f)["points"]
    for pt in points:
        if pt.get("role") not in ("fit", "validate"):
            raise ValueError(f"{path}: every point needs role fit or validate; got {pt}")
    return points


def fit_act_bytes(points: list) -> float:
    """The activation constant that minimises the squared relative error over the "fit" points only: each plan is
    linear in it (total = rest + c x coefficient), so the least-squares c is closed-form."""
    num = den = 0.0
    for pt in points:
        if pt["role"] != "fit":
            continue
        args = [pt[k] for k in ("model", "tokens", "sp", "gpus", "sharding", "recompute")]
        at0 = plan(*args, layers=pt["layers"], act_bytes=0.0).total_gib
        at1 = plan(*args, layers=pt["layers"], act_bytes=1.0).total_gib
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
                  act_bytes=c)
        rows.append({**{k: pt[k] for k in POINT_KEYS}, "role": pt["role"], "plan_gib": round(pl.total_gib, 2),
                     "measured_gib": pt["peak_gib"], "error": round(pl.total_gib / pt["peak_gib"] - 1, 4),
                     "device": pt.get("device", ""), "source": pt.get("source", ""), "act_bytes": c})
    return rows


def merge(measured_json: str, path: str = PEAKS_FILE) -> int:
    """Add tools/measure_peaks.py's measured points (role validate; a point already there is replaced) to
    ``path``; returns how many were added or replaced."""
    with open(measured_json) as f:
        new = [pt for pt in json.load(f)["points"] if pt.get("peak_gib") is not None]
    with open(path) as f:
        data = json.load(f)
    key = lambda pt: tuple(pt[k] for k in POINT_KEYS)  # noqa: E731
    fresh = {key(pt) for pt in new}
    data["points"] = [pt for pt in data["points"] if key(pt) not in fresh or pt["role"] == "fit"] + \
        [{**{k: pt[k] for k in POINT_KEYS}, "peak_gib": round(pt["peak_gib"], 2), "role": "validate",
          "device": pt.get("device", ""), "source": pt.get("source", measured_json)} for pt in new]
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return len(new)


def markdown(rows: list) -> str:
    """The fitted / validated table of docs/full_depth_sharding.md."""
    c = rows[0]["act_bytes"] if rows else float("nan")
    out = [f"Activation constant fitted to the fit rows: {c:.1f} x dim bytes per local token per layer.", "",
           "| role | model | layers | tokens | SP | GPUs | sharding | recompute | plan GiB | measured GiB | error | "
           "device |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['role']} | {r['model']} | {r['layers']} | {r['tokens']:,} | {r['sp']} | {r['gpus']} | "
                   f"{r['sharding']} | {r['recompute']} | {r['plan_gib']:.1f} | {r['measured_gib']:.1f} | "
                   f"{r['error']:+.1%} | {r['device']} |")
    return "\n".join(out)


def table(gpu_gib: float = H200_USABLE_GIB) -> list[Plan]:
    """wan-14b full depth at 32K / 75K / 300K tokens on 8 / 16 / 64 GPUs (SP = min(gpus, 8 at 32K ... ))."""
    out = []
    for tokens in (32760, 75600, 302400):
        for gpus in (8, 16, 64):
            sp = 8 if tokens <= 75600 else min(gpus, 32)
            sp = min(sp, gpus)
            for rc in ("none", "full"):
                out.append(plan("wan-14b", tokens, sp, gpus, "fsdp", rc, gpu_gib=gpu_gib))
    return out


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan-14b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=75600)
    ap.add_argument("--sp", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--sharding", default="fsdp", choices=SHARDINGS)
    ap.add_argument("--recompute", default="full", choices=["none", "full"])
    ap.add_argument("--gpu-gib", type=float, default=H200_USABLE_GIB, help="usable GPU memory (H200: 139 GiB)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--validate", action="store_true", help="plan vs every measured peak (fit and validate rows); "
                    "exit 1 when a validate row is off by more than 10%%")
    ap.add_argument("--peaks", default=PEAKS_FILE, help="the measured peaks (JSON, each point role fit or validate)")
    ap.add_argument("--merge", default=None, help="add tools/measure_peaks.py's JSON to --peaks as validate points")
    a = ap.parse_args(argv)
    if a.merge:
        print(f"merged {merge(a.merge, a.peaks)} points into {a.peaks}")
        return 0
    if a.validate:
        rows = validate(a.peaks)
        print(json.dumps(rows, indent=1) if a.json else markdown(rows))
        bad = [r for r in rows if r["role"] == "validate" and abs(r["error"]) > MAX_VALIDATION_ERROR]
        for r in bad:
            print(f"FAIL: {r['model']} {r['layers']} layers {r['tokens']} tokens SP={r['sp']} {r['sharding']} "
                  f"recompute={r['recompute']}: plan {r['plan_gib']} GiB vs measured {r['measured_gib']} GiB "
                  f"({r['error']:+.1%}, limit {MAX_VALIDATION_ERROR:.0%})", file=sys.stderr)
        return 1 if bad else 0
    plans = table(a.gpu_gib) if a.table else [plan(a.model, a.tokens, a.sp, a.gpus, a.sharding, a.recompute,
                                                     a.layers, a.gpu_gib)]
    if a.json:
        print(json.dumps([asdict(p) for p in plans], indent=1))
        return 0
    print("| tokens | GPUs | SP | sharding | recompute | params+grads+opt | activations | exchange | total GiB | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in plans:
        print(f"| {p.tokens:,} | {p.gpus} | {p.sp} | {p.sharding} | {p.recompute} | "
              f"{p.parameters_gib + p.gradients_gib + p.optimizer_gib + p.autocast_copies_gib + p.unsharded_blocks_gib:.1f} | "
              f"{p.activations_gib:.1f} | {p.exchange_gib:.1f} | {p.total_gib:.1f} | {'yes' if p.fits else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
