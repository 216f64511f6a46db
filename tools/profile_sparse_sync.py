r"""Host syncs and step time of the sparse DiT step with the cross-rank block-mask check per call vs once per mask.

The video DiT (training/video_dit) with top-k block-sparse self-attention (``--sparse-attention tiles
--sparse-topk K``) runs under sequence parallelism; every layer's attention used to compare its block mask across
the group on every call (``sp.checks.check_same_tile_mask``: an all_gather and a host sync). With
``sp.checks.MaskChecks`` each distinct mask is compared once, and the DiT declares its top-k masks agreed (every
rank takes the top-k of the same all-reduced tiles), so they cost no collective. This tool times both, one model
each, in one job:
  per_call   MaskChecks(per_call=True): the check on every call (the behaviour before #66)
  per_mask   MaskChecks(): once per distinct mask, top-k masks agreed (the default)
and writes ONE JSON: per variant the step times (fwd + bwd + AdamW; CUDA events, no sync inside the steps), their
median, the mask checks' collectives per step (``MaskChecks.collectives``) and on CUDA the host syncs per step
(``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing call warns once; counted over the measured steps);
``speedup`` = per_call / per_mask median step time.

    torchrun --nproc-per-node 2 tools/profile_sparse_sync.py --out $OUT/sparse_sync.json --model wan-14b \
        --num-layers 2 --frames 21 --latent-size 60x104 --sparsity 0.9 --bf16 --steps 10
    python tools/profile_sparse_sync.py --dry --out /tmp/sparse_sync.json   # tiny model on CPU (1 process)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext.sp.checks import MaskChecks  # noqa: E402
from megatron_sp_ext import SPConfig  # noqa: E402
from tools.benchlib import init_world, write_json  # noqa: E402
from training.video_dit import VideoDiT, preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.engine import flow_matching_batch, local_loss, prepare  # noqa: E402
from training.video_dit.parallel import DiTParallelConfig, parallelize  # noqa: E402
from training.video_dit.sparse import SparseSpec, num_tiles_of  # noqa: E402

VARIANTS = {"per_call": True, "per_mask": False}   # name -> MaskChecks(per_call=...)
DRY = ["--model", "tiny", "--num-layers", "2", "--frames", "4", "--latent-size", "8x8", "--sparse-tile", "1,2,2",
       "--sparse-topk", "3", "--steps", "3", "--warmup", "1"]


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan-14b")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--frames", type=int, default=21)
    ap.add_argument("--latent-size", default="60x104", help="HxW latent pixels")
    ap.add_argument("--sparse-tile", default="4,4,8", help="T,H,W tokens per tile (the DiT's default)")
    ap.add_argument("--sparse-topk", type=int, default=None, help="key tiles per query tile (default: from "
                                                                   "--sparsity)")
    ap.add_argument("--sparsity", type=float, default=0.9, help="K = max(1, round((1 - s) * tiles))")
    ap.add_argument("--mode", default="ulysses", help="--cp-comm-type of the attention core")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="autocast the forward to bfloat16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dry", action="store_true", help="the tiny model on CPU: " + " ".join(DRY))
    ap.add_argument("--out", default="sparse_sync.json")
    args = ap.parse_args(argv)
    if args.dry:
        args = ap.parse_args(DRY + [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--dry"])
        args.dry = True
    for v in args.variants.split(","):
        if v not in VARIANTS:
            ap.error(f"--variants: {v!r} is invalid: choose among {', '.join(VARIANTS)}")
    return args


def sparse_setup(args) -> tuple:
    """(DiTConfig, SparseSpec, info): the model and its top-k selection for the run's token grid."""
    cfg = preset(args.model, args.num_layers)
    h, w = (int(x) for x in args.latent_size.lower().split("x"))
    pt, ph, pw = cfg.patch
    grid = (args.frames // pt, h // ph, w // pw)
    tile = tuple(int(x) for x in args.sparse_tile.split(","))
    n_tiles = num_tiles_of(grid, tile)
    k = args.sparse_topk if args.sparse_topk is not None else max(1, round((1.0 - args.sparsity) * n_tiles))
    info = {"model": args.model, "layers": cfg.layers, "grid": list(grid), "tokens": grid[0] * grid[1] * grid[2],
            "tile": list(tile), "n_tiles": n_tiles, "topk": k, "sparsity": 1.0 - k / n_tiles}
    return cfg, SparseSpec(tile, topk=k), info


def run_variant(name: str, args, group, device: torch.device) -> dict:
    """Warm-up then ``args.steps`` measured steps of a fresh model whose attention core checks masks as ``name``
    says; every rank returns its own numbers."""
    cfg, spec, _ = sparse_setup(args)
    torch.manual_seed(0)
    with torch.device(device):
        model = VideoDiT(cfg)
    sp = dist.get_world_size(group)
    sp_cfg = SPConfig(mode=args.mode, source="megatron") if sp > 1 else SPConfig(source="megatron")
    core = parallelize(model, group if sp > 1 else None, DiTParallelConfig(sp=sp_cfg, sparse=spec)).core
    checks = MaskChecks(per_call=VARIANTS[name])
    if sp > 1:   # the core's attention and the model's top-k declarations share one MaskChecks
        core.attention.res.mask_checks = core.mask_checks = checks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = SyntheticVideoLatents(cfg.in_channels, (args.frames,), *(int(x) for x in args.latent_size.split("x")),
                                 cfg.text_len, cfg.text_dim, seed=1)
    batch = flow_matching_batch(data, 0, 7, 0, 1, 1, cfg.patch, tile=spec.tile)
    inp = prepare(batch, dist.get_rank(group), sp, device)
    dtype = torch.bfloat16 if args.bf16 else None

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        (local_loss(model, inp, autocast_dtype=dtype) * sp).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    cuda = device.type == "cuda"
    before = checks.collectives
    syncs = None
    if cuda:
        torch.cuda.synchronize(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                events[0].record()
                for i in range(args.steps):
                    step()
                    events[i + 1].record()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(device)
        times = [events[i].elapsed_time(events[i + 1]) for i in range(args.steps)]
        syncs = sum("synchroniz" in str(w.message) for w in caught) / args.steps
    else:
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    return {"step_ms": times, "step_ms_median": statistics.median(times),
            "mask_collectives_per_step": (checks.collectives - before) / args.steps,
            "host_syncs_per_step": syncs}


def profile(args, group, device: torch.device) -> dict:
    """Every variant on this rank (collective: every rank calls it); the JSON document of rank 0's view, with each
    variant's step time as the max over ranks (a step ends when its slowest rank does)."""
    _, _, info = sparse_setup(args)
    doc = {"config": {**info, "mode": args.mode, "sp": dist.get_world_size(group), "bf16": args.bf16,
                      "steps": args.steps, "warmup": args.warmup, "dry": args.dry,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
           "variants": {}}
    for name in args.variants.split(","):
        res = run_variant(name, args, group, device)
        slowest = torch.tensor(res["step_ms"], dtype=torch.float64)
        if dist.get_backend(group) == "nccl":
            slowest = slowest.to(device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        res["step_ms"] = slowest.cpu().tolist()
        res["step_ms_median"] = statistics.median(res["step_ms"])
        doc["variants"][name] = res
    v = doc["variants"]
    if "per_call" in v and "per_mask" in v:
        doc["speedup"] = v["per_call"]["step_ms_median"] / v["per_mask"]["step_ms_median"]
    return doc


def main(argv: Optional[list] = None) -> dict:
    args = parse(argv)
    if "RANK" not in os.environ:   # one process without torchrun (the dry run): a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get(
            "MASTER_PORT", "29517"))
    _, _, device = init_world("gloo" if args.dry else None)
    if args.dry:
        device = torch.device("cpu")
    try:
        doc = profile(args, dist.group.WORLD, device)
        if dist.get_rank() == 0:
            write_json(args.out, doc)
            for name, res in doc["variants"].items():
                print(f"{name}: {res['step_ms_median']:.1f} ms/step, {res['mask_collectives_per_step']:g} mask "
                      f"checks/step, host syncs/step {res['host_syncs_per_step']}")
        return doc
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
