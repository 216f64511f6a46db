"""Per-GPU memory plan for the video DiT: parameters, gradients, optimizer state, activations (with / without
full recompute), the attention's and the SP exchanges' buffers, and whether it fits a GPU.

    python tools/memory_plan.py --model wan-14b --tokens 75600 --sp 8 --gpus 8 --sharding fsdp --recompute full
    python tools/memory_plan.py --table          # wan-14b, 32K / 75K / 300K tokens on 8 / 16 / 64 GPUs
    python tools/memory_plan.py --validate       # against the measured bench_train_step peaks

Model (bf16 autocast over fp32 weights, AdamW, Megatron's fp32 gradient buffers):
  parameters 4 B/param, gradients 4 B, Adam 8 B; autocast's bf16 weight copies 2 B/param (kept for the step).
  none: all replicated; distributed-optimizer: Adam state / (DP x CP); fsdp / zero3: all four / (DP x CP) plus two
  blocks unsharded (bf16 params + fp32 grads; one in use, one prefetched).
  activations: ACT_BYTES_PER_TOKEN_DIM x dim bytes per local token per layer (fitted to the 1 x H200 peaks);
  full recompute keeps each block's fp32 input (4 x dim B per token per layer) plus one block's activations.
  exchanges (SP > 1): Ulysses all-to-all of q, k, v, out in bf16, two in flight: 8 x dim B per local token.
  workspace: a constant (allocator slack, cuDNN workspace).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = float(1 << 30)
ACT_BYTES_PER_TOKEN_DIM = 50.0  # fitted by hand to the MEASURED peaks below (all within 9%)
WORKSPACE_GIB = 1.0
H200_USABLE_GIB = 139.0
SHARDINGS = ("none", "distributed-optimizer", "fsdp", "zero3")

# measured peaks (bench_train_step, megatron-core DDP, fp32 weights, --bf16 autocast, no dist-opt, no recompute)
MEASURED = [  # model, layers, tokens, sp, gpus, peak GiB, source
    ("wan-14b", 4, 32760, 1, 1, 66.0, "ENVIRONMENT.md / tools/results/2026-11-24_h200_step_curves (66.03)"),
    ("wan-14b", 2, 75600, 1, 1, 55.0, "ENVIRONMENT.md / tools/results/2026-11-24_h200_step_curves (54.82)"),
    ("wan-1.3b", 4, 32760, 1, 1, 16.0, "ENVIRONMENT.md / tools/results/2026-11-24_h200_step_curves (16.13)"),
    ("wan-14b", 8, 32760, 2, 2, 103.0, "ENVIRONMENT.md (bea8fe8)"),
    ("wan-14b", 4, 75600, 2, 2, 75.0, "ENVIRONMENT.md (bea8fe8)"),
]


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
         layers: int | None = None, gpu_gib: float = H200_USABLE_GIB) -> Plan:
    """The per-GPU memory of one training step (see the module docstring for the model)."""
    from training.video_dit import preset  # noqa: PLC0415
    if sharding not in SHARDINGS:
        raise ValueError(f"--sharding={sharding!r}: choose one of {', '.join(SHARDINGS)}")
    if recompute not in ("none", "full"):
        raise ValueError(f"--recompute={recompute!r}: choose none or full")
    if sp < 1 or gpus % sp:
        raise ValueError(f"--gpus={gpus} must be a multiple of --sp={sp}")
    cfg = preset(model, layers)
    n, n_blk = param_counts(model, layers)
    shard = gpus if sharding in ("fsdp", "zero3") else 1
    p = 4 * n / shard / GIB
    g = 4 * n / shard / GIB
    o = 8 * n / (gpus if sharding != "none" else 1) / GIB
    cast = 2 * n / GIB if shard == 1 else 0.0
    blocks = 2 * (2 + 4) * n_blk / GIB if shard > 1 else 0.0
    local = tokens / sp
    per_layer = ACT_BYTES_PER_TOKEN_DIM * cfg.dim * local / GIB
    per_layer_rc = 4 * cfg.dim * local / GIB
    act = cfg.layers * per_layer if recompute == "none" else cfg.layers * per_layer_rc + per_layer
    exch = 8 * cfg.dim * local / GIB if sp > 1 else 0.0
    total = p + g + o + cast + blocks + act + exch + WORKSPACE_GIB
    return Plan(model, cfg.layers, tokens, sp, gpus, sharding, recompute, n / 1e9, p, g, o, cast, blocks, act,
                per_layer, per_layer_rc, exch, WORKSPACE_GIB, total, gpu_gib, total <= gpu_gib)


def validate() -> list[dict]:
    """Plan vs each measured peak: rows with plan, measured and relative error."""
    rows = []
    for model, layers, tokens, sp, gpus, peak, src in MEASURED:
        pl = plan(model, tokens, sp, gpus, "none", "none", layers)
        rows.append({"model": model, "layers": layers, "tokens": tokens, "sp": sp, "plan_gib": round(pl.total_gib, 1),
                     "measured_gib": peak, "error": round(pl.total_gib / peak - 1, 3), "source": src})
    return rows


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


def main(argv: list | None = None) -> None:
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
    ap.add_argument("--validate", action="store_true")
    a = ap.parse_args(argv)
    if a.validate:
        rows = validate()
        if a.json:
            print(json.dumps(rows, indent=1))
        else:
            print("| model | layers | tokens | SP | plan GiB | measured GiB | error |\n|---|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['model']} | {r['layers']} | {r['tokens']:,} | {r['sp']} | {r['plan_gib']} | "
                      f"{r['measured_gib']} | {r['error']:+.1%} |")
        return
    plans = table(a.gpu_gib) if a.table else [plan(a.model, a.tokens, a.sp, a.gpus, a.sharding, a.recompute,
                                                     a.layers, a.gpu_gib)]
    if a.json:
        print(json.dumps([asdict(p) for p in plans], indent=1))
        return
    print("| tokens | GPUs | SP | sharding | recompute | params+grads+opt | activations | exchange | total GiB | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in plans:
        print(f"| {p.tokens:,} | {p.gpus} | {p.sp} | {p.sharding} | {p.recompute} | "
              f"{p.parameters_gib + p.gradients_gib + p.optimizer_gib + p.autocast_copies_gib + p.unsharded_blocks_gib:.1f} | "
              f"{p.activations_gib:.1f} | {p.exchange_gib:.1f} | {p.total_gib:.1f} | {'yes' if p.fits else 'no'} |")


if __name__ == "__main__":
    main()
