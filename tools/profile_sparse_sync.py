"""Host syncs of the sparse DiT step, per step and per layer (#85: a top-k mask per layer must cost no host sync).

The video DiT (training/video_dit) with top-k block-sparse self-attention (``--sparse-attention tiles --sparse-topk``)
on one GPU: P=1 (the one-device core), or P ranks sharing the GPU over gloo (``--share-gpu``; gloo moves CUDA
tensors through host memory, so its exchanges sync by themselves: read the sites). Every synchronizing CUDA call
warns under ``torch.cuda.set_sync_debug_mode("warn")`` (a device-to-host copy, ``.item()``, ``nonzero``, a blocking
host-to-device copy, a stream/device sync); this tool counts those warnings:
  step        per measured step (forward + backward + AdamW), with the Python sites that raised them;
  per layer   each block replayed alone on the inputs it got in a step (its forward, then its backward from a
              random output gradient): the forward's syncs with their sites, the backward's (autograd replays a
              backward's warnings when it ends, so their site is the backward call; the count is exact).
Writes ONE JSON (rank 0; counts are per rank and must agree) and prints a summary. Before/after a change: run the
same command on both trees. Step times are CUDA-event medians without the sync check.

    torchrun --nproc-per-node 1 tools/profile_sparse_sync.py --out $OUT/sparse_sync_p1.json --bf16
    torchrun --nproc-per-node 2 tools/profile_sparse_sync.py --share-gpu --out $OUT/sparse_sync_p2.json --bf16
    ... --kernel cudnn_block_sparse   # the block-sparse kernel (--sparse-attention-kernel; default auto: FA4)
    python tools/profile_sparse_sync.py --dry --out /tmp/sparse_sync.json   # tiny model on CPU (1 process)
(defaults: wan-14b dims, 2 blocks, Wan's 480p latent 21 x 60 x 104, 4x4x8 tiles, top-k 90% sparse, ulysses)
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext import SPConfig  # noqa: E402
from tools.benchlib import init_world, write_json  # noqa: E402
from training.video_dit import VideoDiT, preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.engine import flow_matching_batch, local_loss, prepare  # noqa: E402
from training.video_dit.parallel import DiTParallelConfig, parallelize  # noqa: E402
from training.video_dit.sparse import SparseSpec, num_tiles_of  # noqa: E402

SYNC_WORD = "synchroniz"   # torch's warning: "called a synchronizing CUDA operation"
DRY = ["--model", "tiny", "--num-layers", "2", "--frames", "4", "--latent-size", "8x8", "--sparse-tile", "1,2,2",
       "--sparse-topk", "3", "--steps", "2", "--warmup", "1"]


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan-14b")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--frames", type=int, default=21)
    ap.add_argument("--latent-size", default="60x104", help="HxW latent pixels")
    ap.add_argument("--sparse-tile", default="4,4,8", help="T,H,W tokens per tile (the DiT's default)")
    ap.add_argument("--sparse-topk", type=int, default=None, help="key tiles per query tile (default: --sparsity)")
    ap.add_argument("--sparsity", type=float, default=0.9, help="K = max(1, round((1 - s) * tiles))")
    ap.add_argument("--mode", default="ulysses", help="--cp-comm-type of the attention core (P > 1)")
    ap.add_argument("--kernel", default="auto", help="--sparse-attention-kernel: auto (FA4 at 128-token tiles), fa4, "
                                                     "cudnn_block_sparse, flex, math")
    ap.add_argument("--share-gpu", action="store_true", help="every rank on GPU 0 over gloo")
    ap.add_argument("--steps", type=int, default=5, help="measured steps (timed, then counted)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="autocast the forward to bfloat16")
    ap.add_argument("--dry", action="store_true", help="the tiny model on CPU: " + " ".join(DRY))
    ap.add_argument("--out", default="sparse_sync.json")
    args = ap.parse_args(argv)
    if args.dry:
        args = ap.parse_args(DRY + [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--dry"])
        args.dry = True
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


class SyncCounter:
    """Counts the sync warnings raised inside ``with counter.region(name)`` (``sync_mode``: the context that turns
    the warnings on, ``torch.cuda.set_sync_debug_mode("warn")`` on CUDA); ``counts[name]`` and ``sites[name]``
    ({"file:line": n}, the Python line that made the call)."""

    def __init__(self, sync_mode: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.sync_mode = sync_mode
        self.counts: dict = collections.Counter()
        self.sites: dict = collections.defaultdict(collections.Counter)

    @contextlib.contextmanager
    def region(self, name: str):
        def seen(message, category, filename, lineno, file=None, line=None):
            if SYNC_WORD in str(message):
                self.counts[name] += 1
                self.sites[name][f"{os.path.relpath(filename)}:{lineno}"] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            with self.sync_mode():
                yield


def cuda_sync_mode() -> contextlib.AbstractContextManager:
    """``torch.cuda.set_sync_debug_mode("warn")`` for the duration (restored to the default after)."""
    @contextlib.contextmanager
    def on():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return on()


def build(args, group, device: torch.device) -> tuple:
    """(model, step fn, the prepared batch, autocast dtype) of the run."""
    cfg, spec, _ = sparse_setup(args)
    torch.manual_seed(0)
    with torch.device(device):
        model = VideoDiT(cfg)
    sp = dist.get_world_size(group)
    sp_cfg = SPConfig(mode=args.mode, source="megatron") if sp > 1 else SPConfig(source="megatron")
    parallelize(model, group if sp > 1 else None, DiTParallelConfig(sp=sp_cfg, sparse=spec, tile_setting=args.kernel))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    h, w = (int(x) for x in args.latent_size.lower().split("x"))
    data = SyntheticVideoLatents(cfg.in_channels, (args.frames,), h, w, cfg.text_len, cfg.text_dim, seed=1)
    inp = prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, cfg.patch, tile=spec.tile), dist.get_rank(group), sp,
                  device)
    dtype = torch.bfloat16 if args.bf16 else None

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        (local_loss(model, inp, autocast_dtype=dtype) * sp).backward()
        opt.step()
    return model, step, inp, dtype


def block_inputs(model, run: Callable[[], None]) -> list:
    """Each block's (args, kwargs) of one ``run()`` (its tensors detached; the block input requires grad)."""
    got: list = []

    def keep(_module, args, kwargs):
        args = tuple(a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args)
        got.append((args, dict(kwargs)))
    handles = [blk.register_forward_pre_hook(keep, with_kwargs=True) for blk in model.blocks]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return got[:len(model.blocks)]


def count_layers(model, inputs: list, counter: SyncCounter, dtype) -> None:
    """Each block alone on its captured inputs: forward (region ``block<i>.fwd``), then backward from a random
    output gradient (``block<i>.bwd``), as in a step (autocast ``dtype``)."""
    dev_type = inputs[0][0][0].device.type
    for i, (blk, (args, kwargs)) in enumerate(zip(model.blocks, inputs)):
        with counter.region(f"block{i}.fwd"):
            with torch.autocast(dev_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = blk(*args, **kwargs)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(i)).to(out)
        with counter.region(f"block{i}.bwd"):
            out.backward(grad)


def profile(args, group, device: torch.device, sync_mode: Optional[Callable] = None) -> dict:
    """The run on this rank (collective: every rank calls it): step times, syncs per step and per layer. ``sync_mode``
    (default: the CUDA check on CUDA, none elsewhere; tests pass their own) turns the sync warnings on."""
    _, _, info = sparse_setup(args)
    cuda = device.type == "cuda"
    sync_mode = sync_mode or (cuda_sync_mode if cuda else contextlib.nullcontext)
    model, step, inp, dtype = build(args, group, device)
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    counter = SyncCounter(sync_mode)
    for _ in range(args.steps):
        with counter.region("step"):
            step()
    inputs = block_inputs(model, lambda: local_loss(model, inp, autocast_dtype=dtype))
    count_layers(model, inputs, counter, dtype)
    layers = {f"block{i}": {part: counter.counts[f"block{i}.{part}"] for part in ("fwd", "bwd")}
              for i in range(len(model.blocks))}
    doc = {"config": {**info, "mode": args.mode if dist.get_world_size(group) > 1 else "one device",
                      "kernel": args.kernel,
                      "sp": dist.get_world_size(group), "share_gpu": args.share_gpu, "bf16": args.bf16,
                      "steps": args.steps, "warmup": args.warmup, "dry": args.dry,
                      "sync_check": sync_mode is not contextlib.nullcontext,
                      "device": torch.cuda.get_device_name(device) if cuda else "cpu"},
           "step_ms": times, "step_ms_median": statistics.median(times),
           "syncs_per_step": counter.counts["step"] / args.steps, "per_layer": layers,
           "syncs_per_layer": sum(v["fwd"] + v["bwd"] for v in layers.values()) / max(1, len(layers)),
           "sites": {name: dict(c.most_common(20)) for name, c in sorted(counter.sites.items())}}
    slowest = torch.tensor(times, dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        slowest = slowest.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)   # a step ends when its slowest rank does
    doc["step_ms"] = slowest.cpu().tolist()
    doc["step_ms_median"] = statistics.median(doc["step_ms"])
    return doc


def main(argv: Optional[list] = None) -> dict:
    args = parse(argv)
    if "RANK" not in os.environ:   # one process without torchrun (the dry run): a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get(
            "MASTER_PORT", "29517"))
    _, _, device = init_world("gloo" if args.dry else None, share_gpu=args.share_gpu)
    if args.dry:
        device = torch.device("cpu")
    try:
        doc = profile(args, dist.group.WORLD, device)
        if dist.get_rank() == 0:
            write_json(args.out, doc)
            print(f"{doc['step_ms_median']:.1f} ms/step; host syncs per step {doc['syncs_per_step']:g}, per layer "
                  f"{doc['syncs_per_layer']:g} ({doc['per_layer']}); sync check {doc['config']['sync_check']}")
        return doc
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
