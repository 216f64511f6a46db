r"""Training-step benchmark launched as users launch training (torchrun), measuring what the entry point measures.

One torchrun job runs the entry point (training/pretrain_video_dit.py or training/train_deepspeed.py) in-process
once per variant, each with --timing, and writes ONE JSON with, per variant:
  entry_step_ms      median wall time per step of the entry point's own loop (its metrics.jsonl, past warm-up)
  model_fwd_bwd_ms   CUDA events around forward+backward inside those same steps
  optimizer_ms       CUDA events from the end of backward to the end of the update (reduction, clip, guard, step)
  bare_step_ms       the same model + optimizer stepped on the last batch with nothing around it (the benchmark)
  entry_over_model_and_opt   target <= 1.15;   entry_over_bare   target within 5% of 1.0
  mfu, tokens_per_s, peak_mem_gib, losses (every step) and loss_curve (first vs last quarter: fell or not)
Variants: "guarded" (the defaults: finite check every step) and "bare_loop" (--no-check-for-nan-in-loss-and-grad),
both with metrics read back every --log-interval steps (default 10); guard_overhead = guarded / bare_loop - 1
(target < 1%). "unfused" is the defaults with --fused-elementwise off (fused_speedup = unfused / guarded step time).
"cudnn" and "fa4" are the defaults with attention on that kernel (fa4_speedup = cudnn / fa4 step time).
Block-sparse (#45): "sparse_topk80" / "sparse_topk90" (--sparse-attention tiles --sparse-topk K) and
"sparse_window80" / "sparse_window90" (--sparse-window t,h,w) are the defaults with the DiT's block-sparse
self-attention at ~0.8 / ~0.9 sparsity; K and the window are computed at run time from the run's token grid
(--frames / --latent-size / --model's patch; one grid only) and --sparse-tile (``sparse_variant_flags``):
K = round((1 - s) * nT) of nT tiles, the window nearest s (tools/bench_block_sparse.window_for_sparsity). Each
sparse result records its flags, nT, K or window and the actual sparsity. --sparse-args "FLAGS" gives entry flags
to the sparse variants only (the dense ones of the same job run without them, #69 item 4): a kernel
(--sparse-attention-kernel), a tile (--sparse-tile 4,4,4: also the tile K / the window are computed for), and for
variant "sparse_custom" its own --sparse-topk K or --sparse-window t,h,w (the fixed variants refuse them, naming
sparse_custom). sparse_speedup_<v> = guarded / <v> step
time and sparse_tokens_per_s_ratio_<v> = <v> / guarded tokens/s (both need "guarded", the dense defaults, in the
job). MFU: the entry's ``mfu`` counts DENSE attention FLOPs (DiTConfig.flops_per_token), so for a sparse variant it
is a dense-equivalent rate; ``mfu_sparse_aware`` rescales it to the FLOPs the sparse step
computes (``sparse_flops_per_token``: self-attention x (1 - sparsity), plus the top-k gate's Linear and the coarse
branch). At SP=1 the DiT's sparse core is megatron_sp_ext's block-sparse kernel (the factory's one-rank path:
flex_attention on CUDA); with SP > 1 the factory's SPAttention runs its block_mask path (results record
``sparse_core``, from --context-parallel-size).
The medians leave out the first log interval (warm-up, which includes torch.compile's compilation).
Agreement (#51 item 9): each variant's ``step_agreement`` says whether its entry step and bare step agree within 2%
(``STEP_AGREEMENT_TOL``), and where a flagged entry's excess lies: ``between_steps_ms`` (entry step - fwd+bwd -
optimizer: the GPU idle between steps), ``data_wait_ms`` (the loop waiting on its data path, median per step) and
``gc_ms`` (host time in Python's garbage collector, mean per step);
a run of fewer than 2 x --log-interval steps has no full interval past the warm-up, so
its medians include the compilation: the bench then flags it (JSON and a WARNING line) with the --train-iters it
needs. ``mfu`` is the entry step's; ``mfu_bare`` the bare step's (mfu x entry / bare step time; same FLOPs).
Recompute (#67): "recompute_full", "recompute_selective" (--recompute-granularity selective --recompute-modules
outside_core_attn: every part of a block but the attention core recomputed) and "recompute_selective_offload" (the
same with --cpu-offloading) override the entry flags' recompute; recompute_selective_speedup = recompute_full /
recompute_selective entry step time (_bare: the bare steps; target >= 1.15), each variant with its plan_gib.
FSDP2 (#52): variant "fsdp2" is the defaults with --use-torch-fsdp2 (with "guarded" in the job,
fsdp2_overhead = fsdp2 / guarded entry step time - 1, and the same for the bare step). Every variant of the
megatron-core entry also records ``plan_gib`` (training/video_dit/memory_plan.py for the run's model, layers,
tokens, SP, world, sharding and recompute) and ``plan_error`` = plan / measured peak - 1, beside ``peak_mem_gib``.
Every variant records ``first_step_loss`` (the entry's loss of its first step, from its metrics rows).
Dynamic SP (#55 item 3, megatron-core entry, --context-parallel-size > 1): "packed" is the defaults with
--pack-samples (uniform SP: every sample of the pack split over all context ranks), "dynamic_cp" the same plus
--dynamic-context-parallel (each sample over its own aligned sub-group); the budget --max-tokens-per-step and the
mix come from the entry flags (--frames cycles per sample, so --frames 21,1,1,11 packs images with clips;
--latent-size cycles independently). Both see the same sample stream, so the same packs. Each records ``pack``: the
first step's and the bare step's pack (samples, their latent shapes and video tokens; under dynamic_cp also each
sample's SP size and the plan in words) and the samples / tokens of every logged step. With both in the job:
dynamic_cp_speedup = packed / dynamic_cp entry step time (dynamic_cp_speedup_bare: the bare steps),
dynamic_cp_same_pack, and dynamic_cp_first_loss_rel_diff = |loss dynamic_cp - loss packed| / |loss packed| of the
first step (same pack, same init: ~1e-7 in fp32; bf16 rounds differently on the two placements).

    torchrun --nproc-per-node 1 tools/bench_train_step.py --out $OUT -- --model wan-1.3b --num-layers 4 \
        --frames 21 --latent-size 60x104 --bf16 --train-iters 30 --ddp-impl torch
Everything after "--" goes to the entry point unchanged.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import tempfile
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext.attention import kernels  # noqa: E402
from tools.benchlib import AutoDecisions, init_world, run_meta, write_json  # noqa: E402

VARIANTS = {"guarded": [],  # the defaults: finite check every step
            "bare_loop": ["--no-check-for-nan-in-loss-and-grad"],
            "unfused": ["--fused-elementwise", "off"],  # the eager elementwise path (the default on CPU)
            "cudnn": ["--sp-attention-backend", "cudnn"],  # attention on cuDNN (every call), the defaults otherwise
            "fa4": ["--sp-attention-backend", "fa4"],  # attention on FlashAttention-4 (every call)
            "fsdp2": ["--use-torch-fsdp2"],  # FSDP2 over data x context ranks (megatron-core entry)
            # recompute choices (#67), each replacing the entry flags' own recompute flags: whole blocks; every part
            # of a block but the attention core (the core's q, k, v, out, lse kept); the same with the kept core
            # tensors offloaded to host memory
            "recompute_full": ["--recompute-granularity", "full"],
            "recompute_selective": ["--recompute-granularity", "selective", "--recompute-modules",
                                    "outside_core_attn"],
            "recompute_selective_offload": ["--recompute-granularity", "selective", "--recompute-modules",
                                            "outside_core_attn", "--cpu-offloading"],
            "packed": ["--pack-samples"],  # packed steps, uniform SP (needs --max-tokens-per-step in the entry flags)
            "dynamic_cp": ["--pack-samples", "--dynamic-context-parallel"],  # the same packs, dynamic SP
            # the model before 2026-11-29: a Linear(d, 6d) per block for the AdaLN (config.MODULATIONS), the same
            # FLOPs as the default (Wan's shared projection + tables): the "before" of #68's SP=1 step
            "modulation_linear": ["--modulation", "linear"]}
PACKED_VARIANTS = ("packed", "dynamic_cp")  # their results record the pack (pack_info)
STEP_AGREEMENT_TOL = 0.02  # entry step vs bare step: beyond this the run is flagged
# block-sparse variants: (selection, target sparsity); their flags depend on the grid (sparse_variant_flags).
# "sparse_custom": the user's own selection (--sparse-topk K or --sparse-window t,h,w in --sparse-args).
SPARSE_VARIANTS = {"sparse_topk80": ("topk", 0.8), "sparse_topk90": ("topk", 0.9),
                   "sparse_window80": ("window", 0.8), "sparse_window90": ("window", 0.9),
                   "sparse_custom": ("custom", None)}
DEFAULT_SPARSE_TILE = "4,4,8"


def split_sparse_args(text: str, tile: Optional[str]) -> tuple[str, Optional[list], list]:
    """--sparse-args (entry flags for the sparse variants only, shell-quoted) as (the tile the sparse variants use,
    their own selection flags (--sparse-topk / --sparse-window) or None, the other flags). The tile: --sparse-tile
    in ``text``, else the tool's --sparse-tile ``tile``, else the DiT's default; both given and different stop the
    job naming them."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--sparse-tile")
    ap.add_argument("--sparse-topk")
    ap.add_argument("--sparse-window")
    try:
        known, other = ap.parse_known_args(shlex.split(text))
    except (ValueError, SystemExit) as e:
        raise SystemExit(f"--sparse-args {text!r}: not a list of entry flags ({e})") from None
    if known.sparse_tile is not None and tile is not None and known.sparse_tile != tile:
        raise SystemExit(f"--sparse-tile {tile} and --sparse-args '--sparse-tile {known.sparse_tile}' disagree: give "
                         f"the sparse variants' tile once")
    selection = None
    if known.sparse_topk is not None or known.sparse_window is not None:
        selection = ((["--sparse-topk", known.sparse_topk] if known.sparse_topk is not None else [])
                     + (["--sparse-window", known.sparse_window] if known.sparse_window is not None else []))
    return known.sparse_tile or tile or DEFAULT_SPARSE_TILE, selection, other


def sparse_variant_flags(name: str, rest: list, tile: str, entry, selection: Optional[list] = None,
                         other: Optional[list] = None) -> tuple[list, dict]:
    """(extra entry flags, info) of the sparse variant ``name`` for the entry flags ``rest``: the token grid comes
    from ``entry.parse(rest)`` (--frames, --latent-size, --model's patch; one grid only), tiles of ``tile``
    ("T,H,W"); topk: K = max(1, round((1 - s) * nT)); window: ``window_for_sparsity``; sparse_custom: the user's
    ``selection`` (--sparse-topk K or --sparse-window t,h,w). ``other``: further entry flags of the sparse variants
    only (--sparse-args: a kernel, ...), after the variant's own. info: flags, grid, tile, n_tiles, topk or window,
    target (None for sparse_custom) and actual sparsity."""
    from tools.bench_block_sparse import window_for_sparsity  # noqa: PLC0415
    from training.video_dit.sparse import check_tile_grid, num_tiles_of, window_tile_mask  # noqa: PLC0415
    kind, target = SPARSE_VARIANTS[name]
    if kind == "custom" and selection is None:
        raise SystemExit("--variants sparse_custom: give its selection in --sparse-args (--sparse-topk K or "
                         "--sparse-window t,h,w)")
    if kind != "custom" and selection is not None:
        raise SystemExit(f"--variants {name}: it sets its own --sparse-topk / --sparse-window (target sparsity "
                         f"{target}); give yours in --sparse-args with --variants sparse_custom")
    args = entry.parse(list(rest))
    grid = token_grid(args)
    if grid is None:
        raise SystemExit(f"--variants {name}: needs one --frames and one --latent-size (K / the window is computed "
                         f"from the token grid); got --frames {args.frames} --latent-size {args.latent_size}")
    tile_thw = tuple(int(x) for x in tile.split(","))
    check_tile_grid(grid, tile_thw)   # SPConfigError naming --sparse-tile for a tile that is not 3 positive sizes
    n_tiles = num_tiles_of(grid, tile_thw)   # any grid: edge blocks compacted (training/video_dit/sparse.py)
    flags = ["--sparse-attention", "tiles", "--sparse-tile", tile]
    info = {"grid": list(grid), "tile": list(tile_thw), "n_tiles": n_tiles, "target_sparsity": target}
    if kind == "custom":
        from training.video_dit.cli import sparse_spec  # noqa: PLC0415
        spec = sparse_spec(entry.parse([*rest, *flags, *selection]))   # SPConfigError naming a bad flag
        kind, k, w = ("topk", spec.topk, None) if spec.topk is not None else ("window", None, spec.window)
    elif kind == "topk":
        k = max(1, round((1.0 - target) * n_tiles))
    else:
        w = window_for_sparsity(grid, tile_thw, target)
    if kind == "topk":
        flags += ["--sparse-topk", str(k)]
        info.update(topk=k, sparsity=1.0 - k / n_tiles)
    else:
        flags += ["--sparse-window", ",".join(map(str, w))]
        info.update(window=list(w), sparsity=1.0 - float(window_tile_mask(grid, tile_thw, w).float().mean()))
    flags += list(other or [])
    info["flags"] = flags
    return flags, info


def variant_flags(variants: list, rest: list, sparse_tile: Optional[str], sparse_args: str,
                  entry) -> tuple[dict, dict]:
    """({variant: its entry flags beside ``rest``}, {sparse variant: info}): the dense variants' flags
    (``VARIANTS``) and the sparse ones' (``sparse_variant_flags`` with --sparse-tile and --sparse-args, which reach
    the sparse variants only)."""
    extra, sparse_info = {v: list(VARIANTS[v]) for v in variants if v in VARIANTS}, {}
    tile, selection, other = split_sparse_args(sparse_args, sparse_tile)
    if sparse_args.strip() and not any(v in SPARSE_VARIANTS for v in variants):
        raise SystemExit(f"--sparse-args {sparse_args!r}: no sparse_* variant in --variants {','.join(variants)} to "
                         f"give them to")
    for v in variants:
        if v in SPARSE_VARIANTS:
            extra[v], sparse_info[v] = sparse_variant_flags(v, rest, tile, entry, selection, other)
    return extra, sparse_info


def pack_info(args, world: int, rows: list) -> dict:
    """The packs of a --pack-samples run with entry flags ``args`` (megatron-core entry) on ``world`` ranks, from the
    entry's own PackPlan over its dataset: ``first_step`` and ``bare_step`` (the run's last step, which the bare
    steps repeat) of data-parallel rank 0: sample ids, latent (T, H, W), video tokens per sample and in all; with
    --dynamic-context-parallel at SP > 1 also each sample's SP size and the plan in words (DynamicSP, as the entry
    plans it). ``steps``: samples and video tokens of every step the entry logged (its metrics rows)."""
    from training.video_dit.cli import build_dataset  # noqa: PLC0415
    from training.video_dit.config import preset  # noqa: PLC0415
    from training.video_dit.dynamic import DynamicSP  # noqa: PLC0415
    from training.video_dit.packing import make_pack_plan  # noqa: PLC0415
    cfg = preset(args.model, args.num_layers)
    sp = args.context_parallel_size or 1
    dataset = build_dataset(args, cfg)
    plan = make_pack_plan(args, dataset, cfg, sp, 0, 0)
    dyn = DynamicSP(sp, cfg, args.min_dynamic_context_parallel_size, mode=args.cp_comm_type[0]) \
        if args.dynamic_context_parallel and sp > 1 else None

    def one(step: int) -> dict:
        ids = plan.pack(plan.index(step, 0, world // sp))
        tokens = [plan.tokens(i) for i in ids]
        out = {"step": step, "samples": len(ids), "sample_ids": ids, "total_tokens": sum(tokens), "tokens": tokens,
               "latent_thw": [list(dataset.shape_of(i)[0][1:]) for i in ids]}
        if dyn is not None:
            cu = [0]
            for n in tokens:
                cu.append(cu[-1] + n)
            d = dyn.plan(cu)
            out.update(sp_sizes=list(d.sizes), plan=d.describe(dyn.cost))
        return out
    return {"first_step": one(0), "bare_step": one(max(args.train_iters - 1, 0)), "sp": sp,
            "max_tokens_per_step": args.max_tokens_per_step,
            "steps": [{"step": r["step"], "samples": r.get("samples"), "tokens": r.get("tokens")} for r in rows]}


def check_packed_variants(variants: list, entry_name: str, parsed: dict) -> None:
    """The packed / dynamic_cp variants' preconditions, named before any run (SystemExit): the megatron-core entry
    (--dynamic-context-parallel is its flag) and, for dynamic_cp, --context-parallel-size > 1 (at 1 it is uniform
    SP). ``parsed``: variant -> its parsed entry flags."""
    for v in variants:
        if v not in PACKED_VARIANTS:
            continue
        if entry_name != "megatron":
            raise SystemExit(f"--variants {v}: runs the megatron-core entry (--entry megatron); the DeepSpeed entry "
                             f"takes dynamic SP from its JSON config (sequence_parallel_ext.dynamic)")
        if v == "dynamic_cp" and (parsed[v].context_parallel_size or 1) < 2:
            raise SystemExit("--variants dynamic_cp: needs --context-parallel-size > 1 in the entry flags (at 1 every "
                             "sample is on one rank: dynamic and uniform SP are the same run)")


def token_grid(args) -> Optional[tuple]:
    """(T', H', W') token grid of the entry flags ``args`` (one --frames and one --latent-size, --model's patch);
    None when the run has several grids."""
    from training.video_dit.cli import frames_and_sizes  # noqa: PLC0415
    from training.video_dit.config import preset  # noqa: PLC0415
    frames, sizes = frames_and_sizes(args)
    if len(frames) != 1 or len(sizes) != 1:
        return None
    pt, ph, pw = preset(args.model).patch
    return frames[0] // pt, sizes[0][0] // ph, sizes[0][1] // pw


def step_agreement(timing: dict, train_iters: int, log_interval: int, tol: float = STEP_AGREEMENT_TOL) -> dict:
    """Whether the entry's step (median of its rows past the first log interval) and the bare step agree within
    ``tol``; ``train_iters_needed``: 2 x ``log_interval``, one full interval past the warm-up (with fewer steps the
    entry's medians fall back to every row, compilation included). ``mfu_bare``: the MFU of the bare step."""
    ratio = timing["entry_over_bare"]
    needed = 2 * log_interval
    out = {"entry_over_bare": ratio, "tol": tol, "agrees": abs(ratio - 1.0) <= tol, "train_iters": train_iters,
           "train_iters_needed": needed, "warmup_in_median": train_iters < needed}
    mfu = timing.get("mfu")
    out["mfu_bare"] = mfu * timing["entry_step_ms"] / timing["bare_step_ms"] if mfu is not None else None
    if out["agrees"]:
        out["note"] = None
    elif out["warmup_in_median"]:
        out["note"] = (f"entry step {timing['entry_step_ms']:.1f} ms vs bare step {timing['bare_step_ms']:.1f} ms "
                       f"(x{ratio:.3f}): --train-iters {train_iters} < 2 x --log-interval {log_interval}, so the "
                       f"entry's medians include the warm-up (compilation); run --train-iters >= {needed}. The "
                       f"entry's mfu and tokens_per_s are wrong by the same factor: use mfu_bare")
    else:
        out["note"] = (f"entry step {timing['entry_step_ms']:.1f} ms vs bare step {timing['bare_step_ms']:.1f} ms "
                       f"(x{ratio:.3f}) past the warm-up: the entry's loop costs {ratio - 1:+.1%} over the bare step "
                       f"(more --train-iters only if the steps vary: {train_iters} now)")
    inside = [timing.get(k) for k in ("model_fwd_bwd_ms", "optimizer_ms")]
    if None not in inside:   # where the entry's excess lies: between the steps (GPU idle), data, collector
        out["between_steps_ms"] = timing["entry_step_ms"] - sum(inside)
        out["data_wait_ms"], out["gc_ms"] = timing.get("data_wait_ms"), timing.get("gc_ms")
        if out["note"] is not None and not out["warmup_in_median"] and out["data_wait_ms"] is not None:
            data_bound = out["data_wait_ms"] >= 0.5 * out["between_steps_ms"]
            out["note"] += (f"; {out['between_steps_ms']:.1f} ms of each step lie between one step's update and the "
                            f"next forward: {out['data_wait_ms']:.1f} ms waiting for the data path"
                            + (" (its DataLoader workers cannot keep up with this step: --num-workers)"
                               if data_bound else "")
                            + (f", {out['gc_ms']:.1f} ms per step in Python's garbage collector"
                               + ((" (its --manual-gc-interval collections: a larger interval, or 0)"
                                   if timing.get("manual_gc") else " (--manual-gc moves it out of the steps)")
                                  if out["gc_ms"] >= 0.5 * out["between_steps_ms"] else "")
                               if out["gc_ms"] is not None else ""))
    return out


def loss_curve(losses: list) -> dict:
    """The run's loss trend: the mean of its first and of its last quarter of steps (at least one step each) and
    whether it fell; empty without steps."""
    if not losses:
        return {}
    q = max(1, len(losses) // 4)
    first, last = sum(losses[:q]) / q, sum(losses[-q:]) / q
    return {"steps": len(losses), "first_quarter_mean": first, "last_quarter_mean": last, "fell": last < first}


def plan_beside_peak(args, flags: list, world: int) -> dict:
    """training/video_dit/memory_plan.py's per-GPU plan of the run (megatron-core entry flags ``args`` plus the
    variant's ``flags``): plan_gib and the settings it assumed, or plan_gib None and why."""
    from training.video_dit.memory_plan import plan  # noqa: PLC0415
    grid = token_grid(args)
    rc = getattr(args, "recompute_granularity", None)
    modules = list(getattr(args, "recompute_modules", None) or [])
    if rc == "selective" and modules == ["outside_core_attn"]:
        rc = "selective"   # the plan's "selective": everything of a block but the attention core recomputed
    elif rc == "selective":
        rc = f"selective {' '.join(modules)}"
    offload = bool(getattr(args, "cpu_offloading", False))
    why = ("several token grids" if grid is None else None) or \
        (f"--recompute-granularity {rc} (the plan models none, full and selective outside_core_attn)"
         if rc not in (None, "full", "selective") else None) or \
        ("--cpu-offloading-num-layers (the plan offloads every block or none)"
         if offload and getattr(args, "cpu_offloading_num_layers", None) is not None else None) or \
        ("no --bf16 (the plan models bf16 autocast)" if not getattr(args, "bf16", False) else None)
    if why:
        return {"plan_gib": None, "plan_skipped": why}
    sharding = "fsdp" if "--use-torch-fsdp2" in flags or getattr(args, "use_torch_fsdp2", False) else \
        "distributed-optimizer" if getattr(args, "use_distributed_optimizer", False) else "none"
    tokens = grid[0] * grid[1] * grid[2]
    sp = getattr(args, "context_parallel_size", None) or 1
    n_rc = getattr(args, "recompute_num_layers", None) if rc else None
    modulation = getattr(args, "modulation", "wan")
    p = plan(args.model, tokens, sp, world, sharding, rc or "none", getattr(args, "num_layers", None),
             offload=offload, recompute_layers=n_rc, modulation=modulation)
    return {"plan_gib": p.total_gib, "plan_peak_phase": p.peak_phase,
            "plan_settings": {"model": args.model, "modulation": modulation, "layers": p.layers, "tokens": tokens, "sp": sp, "gpus": world,
                              "sharding": sharding, "recompute": p.recompute, "offload": offload,
                              "recompute_layers": p.recompute_layers}}


PREFLIGHT_FRACTION = 0.92   # of the GPU's memory: above it the plan is too close to call (the memory plan's error
                            # on its validation points is up to ~2%; allocator fragmentation comes on top)


def memory_preflight(plan: dict, gpu_gib: Optional[float] = None) -> Optional[str]:
    """A warning when the run's per-GPU memory plan (``plan_beside_peak``) is above PREFLIGHT_FRACTION of the GPU's
    memory (``gpu_gib``, default: this CUDA device's; no GPU: no warning), else None. 2 x H100, 2026-11-25: a run
    planned at 75.2 of 79 GiB failed ~100 s in, with nothing recorded."""
    if gpu_gib is None:
        if not torch.cuda.is_available():
            return None
        gpu_gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30
    need = plan.get("plan_gib")
    if need is None or need <= PREFLIGHT_FRACTION * gpu_gib:
        return None
    return (f"training/video_dit/memory_plan.py plans {need:.1f} GiB per GPU of this GPU's {gpu_gib:.1f} GiB (over "
            f"{PREFLIGHT_FRACTION:.0%}): it may run out of memory; --recompute-granularity full, "
            f"--use-distributed-optimizer or --use-torch-fsdp2 lower it")


def sparse_flops_per_token(cfg, seqlen: int, text_len: int, sparsity: float, n_tiles: int, topk: bool) -> float:
    """Forward+backward FLOPs per token of the sparse step, on DiTConfig.flops_per_token's terms: the
    self-attention term x (1 - sparsity); with top-k also the gate (Linear(dim, dim) per token) and the coarse
    branch (dense attention over n_tiles pooled tiles, per token: its total / seqlen). Pooling and top-k picking
    are not counted (as the dense count leaves out norms and RoPE)."""
    d, L = cfg.dim, cfg.layers
    dense = cfg.flops_per_token(seqlen, text_len)
    self_attn = 3 * 2 * 2 * seqlen * d * L
    extra = 3 * (2 * d * d + 2 * 2 * n_tiles * n_tiles * d / seqlen) * L if topk else 0.0
    return dense - self_attn * sparsity + extra



def device_memory_after() -> dict:
    """After a variant (its model and optimizer freed, the allocator's cache emptied): GiB in use on this GPU, and
    the part outside torch's allocator (CUDA context, NCCL buffers, kernels' own allocations). A variant that ran
    out of memory on 1 x H100 (sparse_topk90 at 75,600 tokens, 2026-11-25) had ~20 GiB outside torch's allocator
    after two variants in the same process; this records whether that grows from variant to variant."""
    if not torch.cuda.is_available():
        return {}
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    used = (total - free) / 2**30
    return {"gpu_used_after_gib": round(used, 3),
            "outside_torch_after_gib": round(used - torch.cuda.memory_reserved() / 2**30, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entry", choices=["megatron", "deepspeed"], default="megatron")
    ap.add_argument("--variants", default="guarded,bare_loop")
    ap.add_argument("--log-interval", type=int, default=10, help="the entry's --log-interval in every variant "
                    "(the first interval is warm-up and left out of the medians)")
    ap.add_argument("--sparse-tile", default=None, help=f"T,H,W tile of the sparse_* variants (default "
                    f"{DEFAULT_SPARSE_TILE}, the DiT's: 128 tokens)")
    ap.add_argument("--sparse-args", default="", help="entry flags given to the sparse_* variants only (one quoted "
                    "string; the dense variants of the job run without them), e.g. \"--sparse-tile 4,4,4 "
                    "--sparse-attention-kernel cudnn_block_sparse\"; a --sparse-tile there is the tile K / the window "
                    "are computed for; --sparse-topk K or --sparse-window t,h,w there: variant sparse_custom only")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="train_step_out")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the entry point's flags")
    args = ap.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    for v in args.variants.split(","):
        if v not in VARIANTS and v not in SPARSE_VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r} (choose from {', '.join([*VARIANTS, *SPARSE_VARIANTS])})")
    if args.entry == "megatron":
        from training import pretrain_video_dit as entry
    else:
        from training import train_deepspeed as entry
    variants = args.variants.split(",")
    extra, sparse_info = variant_flags(variants, rest, args.sparse_tile, args.sparse_args, entry)
    parsed_all = {v: entry.parse([*rest, *extra[v]]) for v in variants}  # a bad flag stops the job before any run
    check_packed_variants(variants, args.entry, parsed_all)
    init_world()  # shared by the runs below
    results = {}
    os.makedirs(args.out, exist_ok=True)
    tag = f"_{args.tag}" if args.tag else ""
    partial = os.path.join(args.out, f"train_step{tag}.partial.json")
    if args.entry == "megatron":
        for v in variants:
            warn = memory_preflight(plan_beside_peak(parsed_all[v], extra[v], int(os.environ.get("WORLD_SIZE", "1"))))
            if warn and int(os.environ.get("RANK", "0")) == 0:
                print(f"[bench_train_step] WARNING {v}: {warn}", flush=True)
    for v in args.variants.split(","):
        kernels.PICKS.clear()   # which kernels this variant's calls ran on (``block_sparse_kernels``)
        with tempfile.TemporaryDirectory() as tmp, AutoDecisions() as decisions:
            res = entry.main([*rest, *extra[v], "--log-interval", str(args.log_interval), "--timing", "--quiet",
                              "--log-dir", os.path.join(tmp, v)])
        parsed = parsed_all[v]
        t = dict(res["timing"])
        t["auto_decisions"] = decisions.messages   # the mode / head chunks auto picked per shape (rank 0's log)
        t.update(device_memory_after())
        t["first_step_loss"] = res["losses"][0] if res.get("losses") else None
        t["losses"] = list(res.get("losses") or [])   # every step's loss (the curve: falling or not)
        t["loss_curve"] = loss_curve(t["losses"])
        t["step_agreement"] = step_agreement(t, parsed.train_iters, args.log_interval)
        t["mfu_bare"] = t["step_agreement"]["mfu_bare"]
        if args.entry == "megatron":
            t.update(plan_beside_peak(parsed, extra[v], int(os.environ.get("WORLD_SIZE", "1"))))
            if t.get("plan_gib") is not None and t.get("peak_mem_gib"):
                t["plan_error"] = t["plan_gib"] / t["peak_mem_gib"] - 1
        if v in sparse_info:
            t["sparse"] = _sparse_result(sparse_info[v], res["timing"], rest, entry)
        if v in PACKED_VARIANTS:
            t["pack"] = pack_info(parsed, int(os.environ.get("WORLD_SIZE", "1")), res.get("rows") or [])
        results[v] = t
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[bench_train_step] {v}: entry {t['entry_step_ms']:.1f} ms, model fwd+bwd "
                  f"{t['model_fwd_bwd_ms']:.1f} + optimizer {t['optimizer_ms']:.1f} ms "
                  f"(entry/(fwd+bwd+opt) {t.get('entry_over_model_and_opt', float('nan')):.3f}), bare step "
                  f"{t['bare_step_ms']:.1f} ms (entry/bare {t['entry_over_bare']:.3f}), mfu {t['mfu']} (entry), "
                  f"{t['mfu_bare']} (bare), peak {t['peak_mem_gib']} GiB, plan {t.get('plan_gib')} GiB", flush=True)
            if not t["step_agreement"]["agrees"]:
                print(f"[bench_train_step] WARNING {v}: {t['step_agreement']['note']}", flush=True)
            write_json(partial, {"meta": run_meta(), "argv": rest, "results_so_far": results})  # a later crash keeps these
    if "guarded" in results and "bare_loop" in results:
        results["guard_overhead"] = results["guarded"]["entry_step_ms"] / results["bare_loop"]["entry_step_ms"] - 1
    if "guarded" in results and "unfused" in results:
        results["fused_speedup"] = results["unfused"]["entry_step_ms"] / results["guarded"]["entry_step_ms"]
    if "guarded" in results and "fsdp2" in results:
        results["fsdp2_overhead"] = results["fsdp2"]["entry_step_ms"] / results["guarded"]["entry_step_ms"] - 1
        results["fsdp2_overhead_bare"] = results["fsdp2"]["bare_step_ms"] / results["guarded"]["bare_step_ms"] - 1
    for v in ("recompute_selective", "recompute_selective_offload"):
        if "recompute_full" in results and v in results:   # #67: target >= 1.15 for recompute_selective
            results[f"{v}_speedup"] = results["recompute_full"]["entry_step_ms"] / results[v]["entry_step_ms"]
            results[f"{v}_speedup_bare"] = results["recompute_full"]["bare_step_ms"] / results[v]["bare_step_ms"]
    if "cudnn" in results and "fa4" in results:
        results["fa4_speedup"] = results["cudnn"]["entry_step_ms"] / results["fa4"]["entry_step_ms"]
    if "packed" in results and "dynamic_cp" in results:
        results.update(dynamic_cp_comparison(results["packed"], results["dynamic_cp"]))
    for v in sparse_info:
        if "guarded" in results:
            results[f"sparse_speedup_{v}"] = results["guarded"]["entry_step_ms"] / results[v]["entry_step_ms"]
            if results["guarded"].get("tokens_per_s") and results[v].get("tokens_per_s"):
                results[f"sparse_tokens_per_s_ratio_{v}"] = \
                    results[v]["tokens_per_s"] / results["guarded"]["tokens_per_s"]
    if int(os.environ.get("RANK", "0")) == 0:
        flagged = [v for v, r in results.items() if isinstance(r, dict) and "step_agreement" in r
                   and not r["step_agreement"]["agrees"]]
        out = {"meta": run_meta(), "entry": args.entry, "argv": rest,
               "world": int(os.environ.get("WORLD_SIZE", "1")), "step_agreement_flagged": flagged,
               "results": results}
        path = write_json(os.path.join(args.out, f"train_step{tag}.json"), out)
        if os.path.exists(partial):
            os.remove(partial)
        print(json.dumps(out["results"], indent=1))
        print(f"wrote {path}")
    if dist.is_initialized():
        dist.destroy_process_group()


def dynamic_cp_comparison(packed: dict, dyn: dict) -> dict:
    """dynamic_cp_speedup (packed / dynamic_cp entry step time), _bare (the bare steps), whether both ran the same
    packs, and the relative difference of their first-step losses (same pack, same init)."""
    out = {"dynamic_cp_speedup": packed["entry_step_ms"] / dyn["entry_step_ms"],
           "dynamic_cp_speedup_bare": packed["bare_step_ms"] / dyn["bare_step_ms"]}
    keys = ("sample_ids", "tokens")
    out["dynamic_cp_same_pack"] = all(packed["pack"][w][k] == dyn["pack"][w][k] for w in ("first_step", "bare_step")
                                      for k in keys)
    a, b = packed.get("first_step_loss"), dyn.get("first_step_loss")
    out["dynamic_cp_first_loss_rel_diff"] = abs(b - a) / abs(a) if a is not None and b is not None and a else None
    return out


def _sparse_result(info: dict, timing: dict, rest: list, entry) -> dict:
    """``info`` plus the sparse-aware MFU (``mfu`` x sparse / dense FLOPs per token; ``mfu`` itself is
    dense-equivalent) and which core ran the sparse attention."""
    from training.video_dit.config import preset  # noqa: PLC0415
    args = entry.parse(list(rest))
    cfg = preset(args.model, getattr(args, "num_layers", None))
    seqlen = info["grid"][0] * info["grid"][1] * info["grid"][2]
    ratio = sparse_flops_per_token(cfg, seqlen, cfg.text_len, info["sparsity"], info["n_tiles"],
                                   "topk" in info) / cfg.flops_per_token(seqlen, cfg.text_len)
    sp = getattr(args, "context_parallel_size", None) or 1
    mfu = timing.get("mfu")
    return {**info, "mfu_is": "dense-equivalent (DiTConfig.flops_per_token counts dense attention)",
            "sparse_over_dense_flops": ratio, "mfu_sparse_aware": mfu * ratio if mfu is not None else None,
            "sparse_core": "one-device block-sparse kernel" if sp == 1 else "SPAttention block_mask path",
            "block_sparse_kernels": {n: c for (n, what), c in kernels.PICKS.items() if what == "tiles"}}


if __name__ == "__main__":
    main()
