"""Measured per-GPU peaks for training/video_dit/memory_plan.py's validation (#51 item 8, #52, #67), in ONE GPU job
per rank count.

Runs the megatron-core entry in-process (as tools/bench_train_step.py does: --timing, its peak_mem_gib, i.e.
torch.cuda.max_memory_allocated past the first steps, optimizer state included) for wan-14b dimensions at
32,760 tokens (--frames 21 --latent-size 60x104) and 75,600 tokens (--latent-size 90x160), 2 to 16 layers,
no / full / selective recompute (--recompute-modules outside_core_attn, also with --cpu-offloading), megatron DDP
or --use-torch-fsdp2. On N GPUs (torchrun --nproc-per-node N) every configuration runs at SP = N (CP = N: FSDP2
shards over the N ranks), the points recorded as sp = gpus = N (rank 0's peak). The plan decides what to run: a
configuration whose plan exceeds this GPU's memory (less a margin) is recorded as skipped with its plan, not run;
an out-of-memory run is recorded as such (on one rank only, the others may wait in a collective until the job's
timeout: the margin keeps the plan's +-2% away from that). Results go to $OUT/memory_peaks.json after every
configuration (a timeout keeps what finished); no configuration starts past --budget-s.

    torchrun --nproc-per-node 1 tools/measure_peaks.py --out $OUT            # ~5 min on 1 x H100
    torchrun --nproc-per-node 2 tools/measure_peaks.py --out $OUT/p2         # the 2-rank points
    torchrun --nproc-per-node 4 tools/measure_peaks.py --out $OUT/p4         # the 4-rank points
    python -m training.video_dit.memory_plan --merge $OUT/memory_peaks.json
    python -m training.video_dit.memory_plan --validate
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GRIDS = {32760: ("21", "60x104"), 75600: ("21", "90x160")}
# recompute: none, full, selective (outside_core_attn), selective+offload (and --cpu-offloading)
RECOMPUTE_FLAGS = {"none": [], "full": ["--recompute-granularity", "full"],
                   "selective": ["--recompute-granularity", "selective", "--recompute-modules", "outside_core_attn"],
                   "selective+offload": ["--recompute-granularity", "selective", "--recompute-modules",
                                         "outside_core_attn", "--cpu-offloading"]}
# (sharding, recompute, layers, tokens), most telling first; 16 layers and FSDP2 8 layers do not fit 80 GB at one
# rank (the plan says so; they are recorded as skipped)
CONFIGS = [("fsdp", "full", 4, 32760), ("none", "full", 8, 32760), ("fsdp", "full", 2, 75600),
           ("none", "full", 4, 75600), ("fsdp", "full", 6, 32760), ("none", "full", 6, 75600),
           ("none", "none", 2, 32760), ("none", "selective", 2, 75600), ("fsdp", "selective", 2, 75600),
           ("none", "selective+offload", 2, 75600), ("fsdp", "full", 8, 32760), ("none", "full", 16, 32760),
           ("fsdp", "full", 16, 32760), ("none", "full", 8, 75600), ("none", "full", 16, 75600)]
# at 2 and 4 ranks (SP = CP = ranks): the sharded terms first (FSDP2, then megatron DDP beside it), both token counts
CONFIGS_SHARDED = [("fsdp", "full", 4, 32760), ("none", "full", 4, 32760), ("fsdp", "full", 4, 75600),
                   ("fsdp", "selective", 4, 75600), ("none", "selective", 4, 75600), ("fsdp", "full", 8, 32760),
                   ("fsdp", "none", 4, 32760), ("fsdp", "selective+offload", 4, 75600), ("fsdp", "full", 12, 75600)]


def configs_for(world: int) -> list:
    return CONFIGS if world == 1 else CONFIGS_SHARDED


def split_recompute(recompute: str) -> tuple[str, bool]:
    """("selective+offload") -> ("selective", True): the plan's recompute and its offload."""
    return recompute.split("+")[0], recompute.endswith("+offload")


def entry_argv(sharding: str, recompute: str, layers: int, tokens: int, tmp: str, world: int = 1) -> list:
    frames, size = GRIDS[tokens]
    argv = ["--model", "wan-14b", "--num-layers", str(layers), "--frames", frames, "--latent-size", size, "--bf16",
            "--train-iters", "4", "--log-interval", "2", "--timing", "--timing-bare-steps", "1", "--quiet",
            "--context-parallel-size", str(world), "--num-workers", "0", "--log-dir", tmp, "--modulation", "wan"]
    argv += RECOMPUTE_FLAGS[recompute]
    if sharding == "fsdp":
        argv += ["--use-torch-fsdp2"]
    return argv


def main(argv: list | None = None) -> None:
    from tools.gpu_ranks import run_meta  # noqa: PLC0415
    from training.video_dit.memory_plan import plan  # noqa: PLC0415
    from training import pretrain_video_dit as entry  # noqa: PLC0415
    from training.video_dit.faults import on_rank0  # noqa: PLC0415
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no configuration past this many seconds")
    ap.add_argument("--margin-gib", type=float, default=1.5, help="run only plans below GPU memory minus this")
    a = ap.parse_args(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    gpu_gib = torch.cuda.mem_get_info()[1] / 2**30
    device = f"{world} x {torch.cuda.get_device_name(0)}"
    out = {"meta": run_meta(), "gpu_gib": gpu_gib, "world": world, "points": [], "skipped": []}
    path = os.path.join(a.out, "memory_peaks.json")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    for sharding, recompute, layers, tokens in configs_for(world):
        rc, offload = split_recompute(recompute)
        key = {"model": "wan-14b", "modulation": "wan", "layers": layers, "tokens": tokens, "sp": world, "gpus": world,
               "sharding": sharding, "recompute": rc, "offload": offload}
        planned = plan("wan-14b", tokens, world, world, sharding, rc, layers, offload=offload).total_gib
        started = time.perf_counter() - t0
        if world > 1:  # every rank decides alike (rank 0's clock)
            flag = torch.tensor([started], device="cuda")
            dist.broadcast(flag, 0)
            started = float(flag)
        if planned > gpu_gib - a.margin_gib:
            out["skipped"].append({**key, "plan_gib": planned, "why": f"plan {planned:.1f} GiB > {gpu_gib:.1f} GiB"})
        elif started > a.budget_s:
            out["skipped"].append({**key, "plan_gib": planned, "why": f"past --budget-s {a.budget_s:.0f}"})
        else:
            s0 = time.perf_counter()
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    t = entry.main(entry_argv(sharding, recompute, layers, tokens, tmp, world))["timing"]
                out["points"].append({**key, "peak_gib": t["peak_mem_gib"], "plan_gib": planned,
                                      "error": planned / t["peak_mem_gib"] - 1, "entry_step_ms": t["entry_step_ms"],
                                      "bare_step_ms": t["bare_step_ms"], "device": device,
                                      "source": "tools/measure_peaks.py", "seconds": time.perf_counter() - s0})
            except torch.OutOfMemoryError as e:
                out["points"].append({**key, "peak_gib": None, "plan_gib": planned, "oom": str(e)[:300],
                                      "device": device})
            gc.collect()
            torch.cuda.empty_cache()
            p = out["points"][-1]
            if rank == 0:
                print(f"[measure_peaks] {key}: peak {p['peak_gib']} GiB, plan {planned:.1f} GiB", flush=True)

        def write() -> None:
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
        on_rank0(f"writing {path}", write)   # rank 0; its failure ends every rank, not a wait in the next broadcast
    print(f"wrote {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
