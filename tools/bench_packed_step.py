r"""Packed mixed-size training step vs the same clips padded to the longest, and one at a time (same job).

Clips of different sizes (``--clips FxHxW,...``: latent frames x height x width) are trained three ways, each a
full training step (forward + backward + AdamW step, bf16 autocast with --bf16, the entry's fused elementwise
regions on CUDA), timed with CUDA events, interleaved per repetition:
  packed      one sequence of all clips (B=1, cu_seqlens: per-sample self-attention, RoPE, modulation, text;
              what --pack-samples trains)
  padded      the clips as one batch [N, S_max], each padded to the longest clip (timed as N clips of the longest
              shape: the same tensor sizes, GEMM and attention work as padding with a key mask)
  sequential  one clip per micro-step (gradient accumulation over N micro-steps), one optimizer step
tokens_per_s counts REAL video tokens only (sum of the clips' tokens) per step time. Writes ONE JSON (rank 0):
per variant the median step ms (max over ranks), tokens/s, peak memory, loss (AdamW at lr 0: the weights stay
put, so packed and sequential must agree; padded trains other clips); and packed_speedup_vs_padded /
_vs_sequential. Under torchrun with P > 1 ranks, self-attention is Ulysses over all ranks (a clip whose token
count does not divide by P is padded per sample, as --pack-samples does).

    torchrun --nproc-per-node 1 tools/bench_packed_step.py --model wan-1.3b --num-layers 4 \
        --clips 13x60x104,9x40x72,5x48x84 --bf16 --out $OUT
(20,280 + 6,480 + 5,040 = 31,800 tokens.) CPU smoke run: python tools/bench_packed_step.py --model tiny
--clips 4x6x10,2x8x8,6x4x8 --reps 2 --warmup 1 --out /tmp/bp
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext import SPConfig  # noqa: E402
from tools.benchlib import init_world, write_json  # noqa: E402
from training.video_dit import VideoDiT, preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.engine import flow_matching_batch, local_loss, prepare  # noqa: E402
from training.video_dit.parallel import DiTParallelConfig, parallelize  # noqa: E402
from training.video_dit.fused import resolve_fused  # noqa: E402
from training.video_dit.packing import packed_batch, packed_host_inputs, tokens_of  # noqa: E402
from training.video_dit.pipeline import to_device  # noqa: E402

VARIANTS = ("packed", "padded", "sequential")


def parse_clips(text: str) -> list:
    """'13x60x104,9x40x72' -> [(13, 60, 104), (9, 40, 72)]."""
    try:
        clips = [tuple(int(v) for v in c.lower().split("x")) for c in text.split(",")]
    except ValueError:
        raise SystemExit(f"--clips={text!r}: expected FxHxW[,FxHxW...] (latent frames x height x width)") from None
    if not clips or any(len(c) != 3 for c in clips):
        raise SystemExit(f"--clips={text!r}: expected FxHxW[,FxHxW...] (latent frames x height x width)")
    return clips


def _inputs(cfg, clips, rank, world, device, seed=1):
    """{variant: [StepInputs of each micro-step]} for this rank."""
    n = len(clips)
    data = SyntheticVideoLatents(cfg.in_channels, [c[0] for c in clips], clips[0][1], clips[0][2], cfg.text_len,
                                 cfg.text_dim, seed=seed, sizes=[c[1:] for c in clips])
    out = {"packed": [to_device(packed_host_inputs(packed_batch(data, list(range(n)), seed, cfg.patch), rank, world),
                                device)]}
    longest = max(clips, key=lambda c: tokens_of((0, *c), cfg.patch))
    pad = SyntheticVideoLatents(cfg.in_channels, [longest[0]], longest[1], longest[2], cfg.text_len, cfg.text_dim,
                                seed=seed)
    out["padded"] = [prepare(flow_matching_batch(pad, 0, seed, 0, 1, n, cfg.patch), rank, world, device)]
    out["sequential"] = [prepare(flow_matching_batch(data, 0, seed, 0, 1, 1, cfg.patch, base=i), rank, world, device)
                         for i in range(n)]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan-1.3b")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--clips", default="13x60x104,9x40x72,5x48x84")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (as the entry's --bf16)")
    ap.add_argument("--fused-elementwise", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="bench_packed_out")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad} (choose from {', '.join(VARIANTS)})")
    clips = parse_clips(args.clips)
    cuda = torch.cuda.is_available()
    own = not dist.is_initialized()
    if own:
        if "RANK" in os.environ:
            init_world(timeout_s=600)
        else:  # a plain python run: one rank
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = preset(args.model, args.num_layers)
    torch.manual_seed(1)
    with torch.device(device):
        model = VideoDiT(cfg)
    group = dist.group.WORLD if world > 1 else None
    # the variants give each compiled elementwise region several shape families in ONE process (packed per-token
    # modulation, a padded batch, clips one at a time): more graphs than torch.compile's default limit of 8 per
    # region, which with fullgraph=True is a hard failure (seen on 1 x H200, 2026-11-24). A training run has one
    # family (static, then dynamic in S); the benchmark raises the limit for itself only.
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    parallelize(model, group, DiTParallelConfig(sp=SPConfig(mode="ulysses", source="megatron"),
                                                fused_backend=resolve_fused(args.fused_elementwise, device)))
    # lr 0: the full AdamW step is timed, the weights stay put, so every variant's loss is of the same weights
    # (packed equals sequential up to rounding: the check that they train the same thing)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=cuda or None)
    autocast = torch.bfloat16 if args.bf16 else None
    inputs = _inputs(cfg, clips, rank, world, device)
    real_tokens = sum(tokens_of((0, *c), cfg.patch) for c in clips)

    def step(variant):
        opt.zero_grad(set_to_none=True)
        micro = inputs[variant]
        total = 0.0
        for inp in micro:
            loss = local_loss(model, inp, autocast) / len(micro)
            (loss * world).backward()
            total = total + loss.detach()
        if world > 1:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        return total

    times = {v: [] for v in variants}
    losses, peaks = {}, {}
    for rep in range(args.warmup + args.reps):
        for v in variants:  # interleaved: drift hits every variant alike
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
            t0 = time.perf_counter()
            loss = step(v)
            if cuda:
                ev[1].record()
                ev[1].synchronize()
                ms = ev[0].elapsed_time(ev[1])
                peaks[v] = torch.cuda.max_memory_allocated(device) / 2**30
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if rep >= args.warmup:
                times[v].append(ms)
            losses[v] = float(loss)
    result = {"model": args.model, "layers": cfg.layers, "clips": [list(c) for c in clips], "world": world,
              "bf16": args.bf16, "real_tokens": real_tokens, "device": torch.cuda.get_device_name(device) if cuda
              else "cpu", "reps": args.reps, "warmup": args.warmup, "variants": {}}
    for v in variants:
        t = torch.tensor(times[v], device=device if cuda else "cpu")
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = sorted(t.tolist())
        med = ms[len(ms) // 2]
        result["variants"][v] = {"step_ms": med, "step_ms_all": ms, "tokens_per_s": real_tokens / (med / 1e3),
                                 "peak_mem_gib": peaks.get(v), "loss": losses[v],
                                 "computed_tokens": sum(i.x.shape[0] * i.x.shape[1] for i in inputs[v]) * world}
    r = result["variants"]
    for other in ("padded", "sequential"):
        if "packed" in r and other in r:
            result[f"packed_speedup_vs_{other}"] = r[other]["step_ms"] / r["packed"]["step_ms"]
    if rank == 0:
        path = write_json(os.path.join(args.out, "bench_packed_step.json"), result)
        print(json.dumps({k: v for k, v in result.items() if k != "variants"}), flush=True)
        for v, row in r.items():
            print(f"{v:>10}: {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:.0f} real tokens/s, "
                  f"loss {row['loss']:.4f}, peak {row['peak_mem_gib']} GiB", flush=True)
        print(f"wrote {path}", flush=True)
    if own:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
