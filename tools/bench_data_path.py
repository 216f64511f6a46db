r"""How fast the DiT entry's data path delivers batches on this host, without a model: the floor it puts under a step.

    python tools/bench_data_path.py --model wan-1.3b --frames 16 --latent-size 64x128 --sparse-tile 4,4,4 \
        --workers 0,2,4,8 --batches 24 --out DIR

For each worker count W the entry's own path (``pipeline.StepBatches`` through ``pipeline.step_inputs``: DataLoader
read-ahead, pinned memory and the non-blocking copy to the device, the batch in tile order with --sparse-tile) is
drained by a consumer that does nothing else; ``ms_per_batch`` is the mean interval between batches after the
read-ahead is used up (the first ``W x 2`` + 2 batches are left out): the fastest step the entry can run at with W
workers. Batches from W workers arrive in bursts (W nearly at once, then a gap), so the median interval
(``median_ms``) says little about the rate; it is kept beside. W=0 builds every batch in this thread: its interval
is one batch's host cost. The host's CPU count and torch's threads are recorded beside the rows. Writes
DIR/bench_data_path.json (+ .md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.benchlib import run_meta, write_results  # noqa: E402
from training.video_dit.config import preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.loop import default_workers  # noqa: E402
from training.video_dit.pipeline import StepBatches, step_inputs  # noqa: E402

PREFETCH = 2  # batches each worker reads ahead (pipeline.step_inputs' default)


def intervals_ms(batches: StepBatches, device: torch.device, workers: int) -> list:
    """Host ms between consecutive batches of ``step_inputs`` past the read-ahead (the device copy waited for)."""
    out, last = [], None
    for i, (_, inp, _) in enumerate(step_inputs(batches, device, workers, prefetch=PREFETCH)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        if last is not None and i >= workers * PREFETCH + 2:
            out.append(1e3 * (now - last))
        last = now
        del inp
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan-1.3b")
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--latent-size", default="64x128", help="HxW")
    ap.add_argument("--sparse-tile", default=None, help="t,h,w: batches in tile order (as --sparse-attention tiles)")
    ap.add_argument("--workers", default="0,2,4,8")
    ap.add_argument("--batches", type=int, default=24, help="batches timed per worker count (after the read-ahead)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="bench_data_path_out")
    args = ap.parse_args(argv)
    cfg = preset(args.model)
    h, w = (int(v) for v in args.latent_size.lower().split("x"))
    tile = tuple(int(v) for v in args.sparse_tile.split(",")) if args.sparse_tile else None
    data = SyntheticVideoLatents(cfg.in_channels, [args.frames], h, w, cfg.text_len, cfg.text_dim, seed=0)
    device = torch.device(args.device)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows, lines = [], ["| workers | ms per batch (mean) | median | min | max | batches |", "|---|---|---|---|---|---|"]
    for n in (int(v) for v in args.workers.split(",")):
        stop = args.batches + n * PREFETCH + 3
        batches = StepBatches(data, start=0, stop=stop, seed=0, dp_rank=0, dp_world=1, micro_batch=1,
                              patch=cfg.patch, sp_rank=0, sp_world=1, tile=tile)
        ms = sorted(intervals_ms(batches, device, n))
        row = {"workers": n, "ms_per_batch": sum(ms) / len(ms), "median_ms": ms[len(ms) // 2], "min_ms": ms[0],
               "max_ms": ms[-1], "batches": len(ms), "intervals_ms": ms}
        rows.append(row)
        lines.append(f"| {n} | {row['ms_per_batch']:.1f} | {row['median_ms']:.1f} | {ms[0]:.1f} | {ms[-1]:.1f} | "
                     f"{len(ms)} |")
        print(lines[-1], flush=True)
    tokens = args.frames // cfg.patch[0] * (h // cfg.patch[1]) * (w // cfg.patch[2])
    meta = run_meta(cpus=cpus, torch_threads=torch.get_num_threads(), model=args.model, tokens=tokens,
                grid=[args.frames // cfg.patch[0], h // cfg.patch[1], w // cfg.patch[2]], tile=tile,
                device=str(device), default_workers=default_workers(cpus, 1))
    write_results(args.out, "bench_data_path", {"meta": meta, "results": rows}, lines)


if __name__ == "__main__":
    main()
