r"""Per-GPU memory plan of the diffusers Wan fine-tuning entry (training/train_wan_diffusers.py): weights, gradients,
AdamW, autocast's bf16 weight copies, what the blocks keep between forward and backward, one block's backward,
the Ulysses exchange buffers, a workspace; the peak and whether it fits.

    python -m training.wan_diffusers.memory_plan --model wan-1.3b --grid 720p --recompute selective
    python -m training.wan_diffusers.memory_plan --model wan-14b --grid 720p --lora-rank 32 --recompute keep8
    python -m training.wan_diffusers.memory_plan --model wan-14b --frames 21 --latent-size 90x160 --sp 4 --fsdp2
    python -m training.wan_diffusers.memory_plan --validate    # plan vs the committed one-H200 peaks; exit 1 > 15%

Recompute (the entry's --recompute-granularity): none; full (diffusers' gradient checkpointing, every block);
selective (every block recomputed but its self-attention: keep_attention_checkpointing); keepN (selective in the
first N blocks, full in the others: the bench's @recompute=keepN).

Activations (per local token = tokens / SP): what a block keeps, the root's (patch embedding, rope, output head,
loss), and one block's backward at its peak are DERIVED on the CPU from diffusers' own model (kept_bytes.py; the
committed ``DERIVED`` table, re-derived by tests/test_wan_memory_plan.py): bytes per token as sums over the model's
widths (dim, ffn, heads, head_dim, patch channels, LoRA rank). E.g. without recompute a block keeps 68 dim + 4 ffn +
8 heads + 36 B per token (diffusers' fp32 residual casts and FP32LayerNorm inputs among them); full: its bf16 input,
2 dim; selective: + q, k, v, out (8 dim) and the fp32 log-sum-exp (4 B per head).

Phases (no FSDP2: torch AdamW, fused on CUDA; weights fp32 with bf16 autocast, or for LoRA a bf16 base with fp32
adapters): the larger of
  end of the forward: weights, Adam, every block's kept, the root's, and every bf16 weight copy (autocast's cache
    holds them until the forward's autocast exits; without recompute the linears save them anyway);
  backward of block i (L-1 .. 0): weights, Adam, the gradients of the root and of blocks i .. L-1, the kept of
    blocks below i and the root's, block i's backward (its derived peak), its bf16 copies (recomputed: one block's;
    without recompute those of blocks 0 .. i);
  optimizer step: weights, gradients, Adam (fused AdamW: no temporaries) and, on more than one rank, the flat copy
    of the gradients the all-reduce reads (training/video_dit/loop.TorchOps).
FSDP2 (--fsdp2: fully_shard per block + root over --gpus, fp32 weights, bf16 compute): the video DiT plan's phases
(memory_plan.py there): shards, one block unsharded in bf16 (+ its bf16 gradient for full FT), the root in bf16, no
autocast copies, foreach AdamW's one temporary at the step.
Exchange (SP > 1): the Ulysses all-to-all buffers of q, k, v, out in bf16, two in flight, 8 dim B per local token
(the video DiT plan's convention; not derived here: the probe runs at SP=1).
Workspace: training/video_dit/memory_plan.WORKSPACE_GIB (allocator slack, cuBLAS / cuDNN workspaces).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Optional

from megatron_sp_ext.errors import SPConfigError

from training.video_dit.memory_plan import GIB, H200_USABLE_GIB, WORKSPACE_GIB

from .kept_bytes import Derived, PerToken, widths
from .model import GRIDS, WAN_PRESETS, preset_kwargs

MAX_VALIDATION_ERROR = 0.15
EXCHANGE_BYTES_PER_DIM = 8   # Ulysses: q, k, v, out in bf16, two exchanges in flight (video DiT plan's convention)
FSDP_BLOCK_BYTES_FULL = 4    # one block unsharded in the backward: bf16 parameters + its bf16 gradient
ADAM_FOREACH_TEMP = 4        # FSDP2's foreach AdamW: one fp32 temporary of the shard's size
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "results")
PEAK_FILES = ("2026-11-29_h200_round7b/call6_bench_fa4/wan13_720p_wan-1.3b-720p.json",
              "2026-11-29_h200_i86train/*.json", "2026-11-29_h200_round9/call[458]_*/*.json")

# python -m training.wan_diffusers.kept_bytes (diffusers 0.42.1, torch 2.13 CPU); tests re-derive and compare
DERIVED = {
    ("none", False): Derived(block=PerToken((("dim", 68.0), ("ffn", 4.0), ("heads", 8.0), ("one", 36.0))),
                             root=PerToken((("dim", 10.0), ("head_dim", 8.0), ("patch_channels", 6.0), ("one", 8.0))),
                             work=PerToken((("dim", 68.0), ("ffn", 4.0), ("heads", 8.0), ("patch_channels", 16.0),
                                            ("one", 36.0)))),
    ("none", True): Derived(block=PerToken((("dim", 50.0), ("ffn", 4.0), ("heads", 8.0), ("rank", 16.0),
                                            ("one", 36.0))),
                            root=PerToken((("head_dim", 8.0), ("patch_channels", 4.0))),
                            work=PerToken((("dim", 50.0), ("ffn", 4.0), ("heads", 8.0), ("patch_channels", 16.0),
                                           ("rank", 16.0), ("one", 36.0)))),
    ("full", False): Derived(block=PerToken((("dim", 2.0),)),
                             root=PerToken((("dim", 10.0), ("head_dim", 8.0), ("patch_channels", 6.0), ("one", 8.0))),
                             work=PerToken((("dim", 74.0), ("ffn", 4.0), ("heads", 8.0), ("patch_channels", -4.0),
                                            ("one", 28.0)))),
    ("full", True): Derived(block=PerToken((("dim", 2.0),)),
                            root=PerToken((("dim", 4.0), ("head_dim", 8.0), ("patch_channels", 4.0), ("one", 8.0))),
                            work=PerToken((("dim", 64.0), ("ffn", 10.0), ("heads", 8.0), ("patch_channels", -4.0),
                                           ("rank", 16.0), ("one", 28.0)))),
    ("selective", False): Derived(block=PerToken((("dim", 10.0), ("heads", 4.0))),
                                  root=PerToken((("dim", 10.0), ("head_dim", 8.0), ("patch_channels", 6.0),
                                                 ("one", 8.0))),
                                  work=PerToken((("dim", 74.0), ("ffn", 4.0), ("heads", 8.0), ("patch_channels", -4.0),
                                                 ("one", 28.0)))),
    ("selective", True): Derived(block=PerToken((("dim", 10.0), ("heads", 4.0))),
                                 root=PerToken((("dim", 4.0), ("head_dim", 8.0), ("patch_channels", 4.0),
                                                ("one", 8.0))),
                                 work=PerToken((("dim", 64.0), ("ffn", 10.0), ("heads", 8.0), ("patch_channels", -4.0),
                                                ("rank", 16.0), ("one", 28.0)))),
}


@dataclass(frozen=True)
class PlanInput:
    """One configuration: model preset, layers (None: the preset's), tokens (after the patch), SP ranks, GPUs
    (FSDP2's shard count; default SP), recompute (none / full / selective / keepN), LoRA rank (0: full
    fine-tuning), FSDP2, usable GPU memory."""

    model: str
    tokens: int
    sp: int = 1
    recompute: str = "full"
    lora_rank: int = 0
    layers: Optional[int] = None
    fsdp2: bool = False
    gpus: Optional[int] = None
    gpu_gib: float = H200_USABLE_GIB


@dataclass
class Plan:
    """The peak per GPU (GiB) and its parts at the peak's phase."""

    model: str
    layers: int
    tokens: int
    sp: int
    recompute: str
    lora_rank: int
    fsdp2: bool
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    autocast_copies_gib: float
    unsharded_gib: float
    kept_activations_gib: float
    block_backward_gib: float
    exchange_gib: float
    workspace_gib: float
    peak_phase: str
    total_gib: float
    gpu_gib: float
    fits: bool


@dataclass(frozen=True)
class Params:
    """Parameter counts / bytes of the model as the entry holds it (meta device)."""

    weight_bytes: float      # every parameter as stored (fp32; LoRA without FSDP2: bf16 base, fp32 adapters)
    numel: int
    block_numel: int
    trainable: int
    block_trainable: int
    cast: int                # trainable fp32 weights autocast copies to bf16 (Linear / Conv weights), whole model
    block_cast: int


def parse_recompute(text: str, layers: int) -> tuple[str, int]:
    """(none|full|selective, blocks keeping the attention) of --recompute (keepN: the first N of ``layers``)."""
    if text in ("none", "full"):
        return text, 0
    if text == "selective":
        return "selective", layers
    if text.startswith("keep") and text[4:].isdigit() and 0 <= int(text[4:]) <= layers:
        return "selective", int(text[4:])
    raise SPConfigError(f"--recompute={text!r}: none, full, selective or keepN (selective in the first N of the "
                        f"{layers} blocks, full in the others; 0 <= N <= {layers})")


@lru_cache(maxsize=None)
def count_params(model: str, layers: Optional[int], lora_rank: int, bf16_base: bool) -> Params:
    """Count the entry's model on the meta device: its preset, the LoRA adapters (training/wan_diffusers/lora.py's
    defaults), the base in bf16 where the entry stores it so (LoRA without FSDP2)."""
    import torch  # noqa: PLC0415
    from diffusers import WanTransformer3DModel  # noqa: PLC0415
    from .lora import LoraSettings, add_lora, base_to_bf16  # noqa: PLC0415
    with torch.device("meta"):
        m = WanTransformer3DModel(**preset_kwargs(model, layers))
        if lora_rank:
            add_lora(m, LoraSettings(lora_rank, float(lora_rank)), seed=0)
            if bf16_base:
                base_to_bf16(m)
    lin = (torch.nn.Linear, torch.nn.Conv3d)

    def cast(mod) -> int:
        return sum(p.numel() for sub in mod.modules() if isinstance(sub, lin) for p in sub.parameters(recurse=False)
                   if p.requires_grad and p.dtype == torch.float32 and p.dim() > 1)

    ps = list(m.parameters())
    return Params(weight_bytes=float(sum(p.numel() * p.element_size() for p in ps)), numel=sum(p.numel() for p in ps),
                  block_numel=sum(p.numel() for p in m.blocks[0].parameters()),
                  trainable=sum(p.numel() for p in ps if p.requires_grad),
                  block_trainable=sum(p.numel() for p in m.blocks[0].parameters() if p.requires_grad),
                  cast=cast(m), block_cast=cast(m.blocks[0]))


def model_widths(model: str, lora_rank: int) -> dict:
    kw = WAN_PRESETS[model]
    heads, hd = kw["num_attention_heads"], kw["attention_head_dim"]
    volume = kw["patch_size"][0] * kw["patch_size"][1] * kw["patch_size"][2]
    return widths(heads * hd, kw["ffn_dim"], heads, hd, kw["out_channels"] * volume, lora_rank)


# the config keys that decide what a model holds and keeps (its widths, depth, inputs): two configs equal on them plan
# alike (the A14B experts share one)
PLANNED_KEYS = ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers", "in_channels", "out_channels",
                "text_dim", "freq_dim", "patch_size", "image_dim", "added_kv_proj_dim")


def preset_of_config(path: str) -> str:
    """The preset whose widths equal those of the ``config.json`` in ``path`` (a WanTransformer3DModel directory, as
    the entry's --init takes; read as JSON); SPConfigError naming --init when none does."""
    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise SPConfigError(f"--init {path}: cannot read {file} ({e}); --plan-memory reads the model's config "
                            f"there") from None
    def norm(v):
        return list(v) if isinstance(v, (list, tuple)) else v
    for name, kw in WAN_PRESETS.items():
        if name.startswith("tiny"):
            continue
        if all(norm(config.get(k)) == norm(kw.get(k)) for k in PLANNED_KEYS):
            return name
    got = ", ".join(f"{k}={config.get(k)}" for k in PLANNED_KEYS[:4])
    raise SPConfigError(f"--init {path}: its config ({got}) has the widths of no preset the memory plan knows "
                        f"({', '.join(n for n in WAN_PRESETS if not n.startswith('tiny'))})")


def plan(cfg: PlanInput) -> Plan:
    """The per-GPU peak of one training step of ``cfg`` (module docstring: phases and terms)."""
    if cfg.model not in WAN_PRESETS:
        raise SPConfigError(f"--model={cfg.model!r}: one of {', '.join(WAN_PRESETS)}")
    layers = preset_kwargs(cfg.model, cfg.layers)["num_layers"]
    if cfg.sp < 1:
        raise SPConfigError(f"--sp={cfg.sp}: must be >= 1")
    gpus = cfg.gpus or cfg.sp
    if gpus < 1 or gpus % cfg.sp:
        raise SPConfigError(f"--gpus={gpus}: a multiple of --sp={cfg.sp}")
    if cfg.tokens < 1 or cfg.tokens % cfg.sp:
        raise SPConfigError(f"{cfg.tokens} tokens do not divide by --sp={cfg.sp} (the model's split needs equal "
                            f"shards)")
    if cfg.lora_rank < 0:
        raise SPConfigError(f"--lora-rank={cfg.lora_rank}: must be >= 0 (0: full fine-tuning)")
    rc, n_keep = parse_recompute(cfg.recompute, layers)
    lora = cfg.lora_rank > 0
    pr = count_params(cfg.model, cfg.layers, cfg.lora_rank, lora and not cfg.fsdp2)
    width = model_widths(cfg.model, cfg.lora_rank)
    local = cfg.tokens / cfg.sp

    def gib_of(d: PerToken) -> float:
        return d.bytes(width) * local / GIB

    # per block (0 .. L-1): its mode, what it keeps, its backward's peak
    modes = ["none"] * layers if rc == "none" else ["selective"] * n_keep + ["full"] * (layers - n_keep)
    keeps = [gib_of(DERIVED[(m, lora)].block) for m in modes]
    works = [gib_of(DERIVED[(m, lora)].work) for m in modes]
    root = gib_of(DERIVED[(modes[-1], lora)].root)
    exch = EXCHANGE_BYTES_PER_DIM * width["dim"] * local / GIB if cfg.sp > 1 else 0.0
    g_blk, n_root_tr = 4 * pr.block_trainable / GIB, pr.trainable - layers * pr.block_trainable
    if cfg.fsdp2:
        shard = gpus
        w = 4 * pr.numel / shard / GIB
        o = 8 * pr.trainable / shard / GIB
        unsharded = ((FSDP_BLOCK_BYTES_FULL if not lora else 2) * pr.block_numel +
                     2 * (pr.numel - layers * pr.block_numel)) / GIB
        phases = {}
        for i in range(layers):
            g = (4 * n_root_tr / GIB + (layers - i) * g_blk) / shard
            phases[f"backward of block {i}"] = (w, g, o, 0.0, unsharded, root + sum(keeps[:i]), works[i], exch)
        g_all = 4 * pr.trainable / shard / GIB
        phases["optimizer step"] = (w, g_all, o + ADAM_FOREACH_TEMP * pr.trainable / shard / GIB, 0.0, 0.0, 0.0,
                                    0.0, 0.0)
    else:
        w = pr.weight_bytes / GIB
        o = 8 * pr.trainable / GIB
        copies_all, copies_blk = 2 * pr.cast / GIB, 2 * pr.block_cast / GIB
        copies_root = copies_all - layers * copies_blk
        phases = {"end of the forward": (w, 0.0, o, copies_all, 0.0, root + sum(keeps), 0.0, 0.0)}
        for i in range(layers):
            g = 4 * n_root_tr / GIB + (layers - i) * g_blk
            cp = copies_root + (i + 1) * copies_blk if rc == "none" else copies_blk
            phases[f"backward of block {i}"] = (w, g, o, cp, 0.0, root + sum(keeps[:i]), works[i], exch)
        g_all = 4 * pr.trainable / GIB
        flat = g_all if gpus > 1 else 0.0   # TorchOps' flat all-reduce buffer
        phases["optimizer step"] = (w, g_all + flat, o, 0.0, 0.0, 0.0, 0.0, 0.0)
    phase, parts = max(phases.items(), key=lambda kv: sum(kv[1]))
    total = sum(parts) + WORKSPACE_GIB
    return Plan(cfg.model, layers, cfg.tokens, cfg.sp, cfg.recompute, cfg.lora_rank, cfg.fsdp2, *parts,
                WORKSPACE_GIB, phase, total, cfg.gpu_gib, total <= cfg.gpu_gib)


def grid_tokens(model: str, frames: int, height: int, width: int) -> int:
    """Tokens of a latent ``frames`` x ``height`` x ``width`` after the preset's patch (the entry's arithmetic);
    SPConfigError naming --frames / --latent-size when the patch does not divide it."""
    pt, ph, pw = WAN_PRESETS[model]["patch_size"]
    if frames < 1 or height < 1 or width < 1 or frames % pt or height % ph or width % pw:
        raise SPConfigError(f"--frames {frames} --latent-size {height}x{width}: positive multiples of the patch "
                            f"{(pt, ph, pw)}")
    return (frames // pt) * (height // ph) * (width // pw)


def measured_rows(paths: Optional[list] = None) -> list[dict]:
    """The bench's one-GPU rows (tools/bench_diffusers_wan.py JSON: top-level rows or per-case rows) of
    ``PEAK_FILES``: {model, layers, tokens, recompute, lora_rank, variant, peak_gib (None: out of memory), source}.
    Top-k rows are left out: the block-sparse plan's gates and tile tensors are not modelled; so are @fused=on rows
    (Inductor's fused blocks keep fewer intermediates: 5-15% below the eager peak the plan models, an upper bound)."""
    if paths is None:
        paths = sorted(p for pat in PEAK_FILES for p in glob.glob(os.path.join(RESULTS, pat)))
    out = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        groups = [doc] if "rows" in doc else list(doc.get("cases", {}).values())
        for g in groups:
            meta = g["meta"]
            for r in g["rows"]:
                if (r.get("sparse") or "topk" in r["variant"] or "fused=on" in r["variant"]
                        or meta.get("world", 1) != 1):
                    continue
                rc = r.get("recompute") or meta["recompute"]
                out.append({"model": meta["model"], "layers": meta["layers"], "tokens": meta["tokens"],
                            "recompute": "selective" if rc == "keep" else rc, "lora_rank": r.get("lora_rank") or 0,
                            "variant": r["variant"], "peak_gib": r.get("peak_mem_gib"),
                            "source": os.path.relpath(path, RESULTS)})
    return out


def validate(rows: Optional[list] = None) -> list[dict]:
    """Plan vs every measured row: plan_gib, error (plan / measured - 1; None for an out-of-memory row) and, for an
    out-of-memory row, whether the plan agrees it does not fit."""
    out = []
    for r in measured_rows() if rows is None else rows:
        p = plan(PlanInput(r["model"], r["tokens"], recompute=r["recompute"], lora_rank=r["lora_rank"],
                           layers=r["layers"]))
        err = None if r["peak_gib"] is None else p.total_gib / r["peak_gib"] - 1
        out.append({**r, "plan_gib": round(p.total_gib, 2), "phase": p.peak_phase,
                    "error": None if err is None else round(err, 4), "plan_fits": p.fits})
    return out


def tight(total_gib: float, gpu_gib: float) -> bool:
    """Within the plan's validation bound (MAX_VALIDATION_ERROR) below the GPU's memory: the measured peak may be
    over it (and the allocator's reserve, which the plan does not count, comes on top)."""
    return gpu_gib * (1 - MAX_VALIDATION_ERROR) < total_gib <= gpu_gib


def summary(rows: list) -> tuple[str, list]:
    """(``N rows, median |error| X%, max Y%``, failures: rows off by more than MAX_VALIDATION_ERROR and
    out-of-memory rows the plan says fit with room: below the GPU's memory less the validation bound)."""
    errs = sorted(abs(r["error"]) for r in rows if r["error"] is not None)
    med = (errs[len(errs) // 2] if len(errs) % 2 else (errs[len(errs) // 2 - 1] + errs[len(errs) // 2]) / 2) \
        if errs else float("nan")
    line = f"{len(errs)} rows, median |error| {med:.1%}, max {max(errs, default=float('nan')):.1%}"
    bad = [r for r in rows if (r["error"] is not None and abs(r["error"]) > MAX_VALIDATION_ERROR) or
           (r["error"] is None and r["plan_gib"] <= H200_USABLE_GIB * (1 - MAX_VALIDATION_ERROR))]
    return line, bad


def _describe(r: dict) -> str:
    return (f"{r['model']} {r['layers']} blocks {r['tokens']:,} tokens recompute={r['recompute']}"
            f"{' LoRA ' + str(r['lora_rank']) if r['lora_rank'] else ' full FT'} ({r['variant']}, {r['source']})")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m training.wan_diffusers.memory_plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan-1.3b", help=f"the preset ({', '.join(WAN_PRESETS)})")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    ap.add_argument("--grid", default=None, help=f"Wan's latent grid at 81 frames ({', '.join(GRIDS)}); or "
                    f"--frames / --latent-size")
    ap.add_argument("--frames", type=int, default=None, help="latent frames (the entry's --frames)")
    ap.add_argument("--latent-size", default=None, help="latent HxW (the entry's --latent-size, e.g. 90x160)")
    ap.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks (the entry's --context-parallel-size)")
    ap.add_argument("--gpus", type=int, default=None, help="ranks FSDP2 shards over / all-reduce spans (default --sp)")
    ap.add_argument("--recompute", default="full", help="none, full, selective or keepN")
    ap.add_argument("--lora-rank", type=int, default=0, help="R > 0: LoRA (bf16 base, fp32 adapters); 0: full FT")
    ap.add_argument("--fsdp2", action="store_true", help="the entry's --use-torch-fsdp2")
    ap.add_argument("--gpu-gib", type=float, default=H200_USABLE_GIB, help="usable GPU memory (H200: 139 GiB)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--validate", action="store_true", help="plan vs the committed one-H200 peaks (results/); exit 1 "
                    "when one is off by more than 15%% or an out-of-memory row is planned to fit")
    return ap


def tokens_of(model: str, grid: Optional[str], frames: Optional[int], latent_size: Optional[str]) -> int:
    """Tokens of --grid or --frames / --latent-size (SPConfigError naming the flag)."""
    if grid is not None:
        if frames is not None or latent_size is not None:
            raise SPConfigError(f"--grid {grid} with --frames / --latent-size: give one or the other")
        if grid not in GRIDS:
            raise SPConfigError(f"--grid={grid!r}: one of {', '.join(GRIDS)} (or --frames F --latent-size HxW)")
        return grid_tokens(model, *GRIDS[grid])
    if frames is None or latent_size is None:
        raise SPConfigError("give --grid (480p, 720p) or both --frames and --latent-size")
    try:
        h, w = (int(v) for v in latent_size.lower().split("x"))
    except ValueError:
        raise SPConfigError(f"--latent-size={latent_size!r}: HxW, e.g. 90x160") from None
    return grid_tokens(model, frames, h, w)


def print_plan(p: Plan) -> None:
    print(f"{p.model} ({p.layers} blocks), {p.tokens:,} tokens, SP={p.sp}, recompute={p.recompute}, "
          f"{'LoRA rank ' + str(p.lora_rank) if p.lora_rank else 'full fine-tuning'}"
          f"{', FSDP2' if p.fsdp2 else ''}: peak at {p.peak_phase}")
    for name in ("weights", "gradients", "optimizer", "autocast_copies", "unsharded", "kept_activations",
                 "block_backward", "exchange", "workspace"):
        print(f"  {name.replace('_', ' '):<18} {getattr(p, name + '_gib'):8.2f} GiB")
    verdict = ("does NOT fit" if not p.fits else f"tight: within the plan's {MAX_VALIDATION_ERROR:.0%} validation bound of "
               f"the limit, may not fit" if tight(p.total_gib, p.gpu_gib) else "fits")
    print(f"  {'total':<18} {p.total_gib:8.2f} GiB of {p.gpu_gib:g}: {verdict}")


def main(argv: Optional[list] = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.validate:
        rows = validate()
        for r in rows:
            got = "out of memory" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB"
            err = "" if r["error"] is None else f" ({r['error']:+.1%})"
            print(f"{_describe(r)}: plan {r['plan_gib']:.1f} GiB{err} vs measured {got} [{r['phase']}]")
        line, bad = summary(rows)
        print(line)
        oom = [r for r in rows if r["error"] is None]
        if oom:
            planned = ", ".join(f"{r['plan_gib']:.1f}" for r in oom)
            print(f"{len(oom)} out-of-memory rows, planned at {planned} GiB (each must be above "
                  f"{H200_USABLE_GIB * (1 - MAX_VALIDATION_ERROR):.0f} GiB: the usable {H200_USABLE_GIB:g} less the "
                  f"{MAX_VALIDATION_ERROR:.0%} bound)")
        for r in bad:
            print(f"FAIL: {_describe(r)}: plan {r['plan_gib']} GiB vs measured {r['peak_gib']}", file=sys.stderr)
        return 1 if bad else 0
    try:
        tokens = tokens_of(a.model, a.grid, a.frames, a.latent_size)
        p = plan(PlanInput(a.model, tokens, a.sp, a.recompute, a.lora_rank, a.layers, a.fsdp2, a.gpus, a.gpu_gib))
    except SPConfigError as e:   # one line naming the flag (no usage text)
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(asdict(p), indent=1))
    else:
        print_plan(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
