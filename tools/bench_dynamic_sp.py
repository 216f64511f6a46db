"""Dynamic vs uniform sequence parallelism on one GPU, EMULATED: each rank's kernels timed one by one, exchanges
from their bytes at a link rate (a model, stated as such in the output).

For a pack of samples (``--pack wan-mix``: Wan's kind of mix, ``--samples`` samples of which 40% single images of
1,560 tokens and 60% clips of 8K-75K tokens drawn with ``--seed``; or ``equal:N:L``, N clips of L tokens) and P
ranks, two plans of the same pack (megatron_sp_ext.sp.dynamic):
  uniform  every sample over all P ranks (what --pack-samples does today)
  dynamic  each sample over an aligned sub-group sized to its length (--dynamic-context-parallel's plan_pack)
each under two SP modes (--modes), per rank and per layer, fwd+bwd, timed on this GPU (CUDA events, median of
--reps after --warmup), on the library's local kernel (--backend, default auto: FlashAttention-4 where installed,
which the DiT runs; cudnn crashed here twice, a batched call of 20 samples of 1,560 tokens failing cuDNN's graph and
leaving the CUDA context broken, 2026-11-25 on an H100 and an H200):
  attention  ulysses: for each sub-group the rank is in, one varlen call over its samples' FULL lengths with H/d heads;
             ring: d steps, each one varlen call over the samples' local chunks (ceil(n/d) query x key rows) with all
             H heads; d = 1 (both): the rank's whole samples in one varlen call with all H heads
  rest       the block without its attention core on the rank's own tokens (QKV and output projections, cross-
             attention to the text tokens, the MLP), bf16
  exchange   ulysses: q, k, v and output forward, their gradients backward (8 tensors of the rank's rows x H x D
             bf16 values, times (d-1)/d); ring: k, v forward and k, v, dk, dv backward over d-1 steps (6 tensors of
             its rows x H x D per step); at the link rate: "host" = a pinned device-to-host copy rate MEASURED in this
             job (the PCIe / host-staged class), "nvlink" = --nvlink-gbps (a stated figure, not measured here)
A rank's emulated layer time is attention + rest + exchange (no overlap assumed); the step is the slowest rank's.
Kernels with the same shapes are timed once (uniform SP's ranks are identical). Writes ONE JSON to --out.

    python tools/bench_dynamic_sp.py --model wan-14b --world 8 --out $OUT          # one GPU, 1-2 minutes
    python tools/bench_dynamic_sp.py --smoke --out /tmp/bd                          # CPU, seconds (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from itertools import accumulate
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext.attention.backends import get_backend  # noqa: E402
from megatron_sp_ext.sp.dynamic import DynamicPlan  # noqa: E402
from megatron_sp_ext.sp.ulysses.attend import local_attention  # noqa: E402
from training.video_dit import preset  # noqa: E402
from training.video_dit.dynamic import DynamicSP  # noqa: E402

IMAGE_TOKENS = 1560
EXCHANGED_TENSORS = 8  # ulysses: q, k, v, output forward; their gradients backward
RING_TENSORS = 6  # ring, per step: k, v forward; k, v, dk, dv backward


def wan_mix(samples: int, seed: int, image_share: float = 0.4, clip_range=(8000, 75000),
            image_tokens: int = IMAGE_TOKENS) -> list:
    """``samples`` samples, round(image_share * samples) of them images, the others clips of uniformly drawn
    lengths, in a seeded random order."""
    rng = random.Random(seed)
    images = round(image_share * samples)
    out = [image_tokens] * images + [rng.randint(*clip_range) for _ in range(samples - images)]
    rng.shuffle(out)
    return out


def parse_pack(text: str, samples: int, seed: int) -> list:
    if text == "wan-mix":
        return wan_mix(samples, seed)
    parts = text.split(":")
    if len(parts) == 3 and parts[0] == "equal":
        return [int(parts[2])] * int(parts[1])
    raise SystemExit(f"--pack={text!r}: use wan-mix or equal:N:L")


class Timer:
    """fwd+bwd times of kernels by shape, each measured once (median of reps after warmup)."""

    def __init__(self, device, reps: int, warmup: int) -> None:
        self.device, self.reps, self.warmup, self.memo = device, reps, warmup, {}

    def time(self, key, fn) -> float:
        if key not in self.memo:
            for _ in range(self.warmup):
                fn()
            times = []
            for _ in range(self.reps):
                if self.device.type == "cuda":
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    torch.cuda.synchronize()
                    ev[0].record()
                    fn()
                    ev[1].record()
                    ev[1].synchronize()
                    times.append(ev[0].elapsed_time(ev[1]))
                else:
                    t0 = time.perf_counter()
                    fn()
                    times.append(1e3 * (time.perf_counter() - t0))
            self.memo[key] = statistics.median(times)
        return self.memo[key]


def attention_ms(timer: Timer, backend, lengths: tuple, heads: int, head_dim: int, dtype) -> float:
    """fwd+bwd of one varlen call over ``lengths`` (full samples) with ``heads`` heads."""
    def run():
        s = sum(lengths)
        q, k, v = (torch.randn(1, heads, s, head_dim, device=timer.device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        o = local_attention(backend, q, k, v, False, head_dim ** -0.5, None, 0.0,
                            tuple(cu) if len(lengths) > 1 else None, "auto")
        o.backward(torch.ones_like(o))
    return timer.time(("attn", tuple(sorted(lengths)), heads), run)


class Rest(torch.nn.Module):
    """The block without its attention core: QKV and output projections, cross-attention to the text, the MLP."""

    def __init__(self, cfg) -> None:
        super().__init__()
        d = cfg.dim
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.cq, self.ckv, self.cout = torch.nn.Linear(d, d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(d, d)
        self.ffn = torch.nn.Sequential(torch.nn.Linear(d, cfg.ffn), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(cfg.ffn, d))
        self.heads = cfg.heads

    def forward(self, x, text):
        b, s, d = x.shape
        y = self.out(self.qkv(x)[..., :d])
        q = self.cq(y).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, -1, self.heads, d // self.heads).transpose(1, 2) for t in self.ckv(text).chunk(2, -1))
        y = y + self.cout(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))
        return y + self.ffn(y)


def rest_ms(timer: Timer, rest: Rest, tokens: int, text_len: int, dim: int, dtype) -> float:
    def run():
        x = torch.randn(1, tokens, dim, device=timer.device, dtype=dtype, requires_grad=True)
        text = torch.randn(1, text_len, dim, device=timer.device, dtype=dtype)
        rest(x, text).sum().backward()
    return timer.time(("rest", tokens), run)


def host_link_gbps(device, mib: int = 256) -> float:
    """Measured rate of a pinned device-to-host copy (GB/s); on the CPU a plain copy's rate."""
    n = mib * 2**20 // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty(n, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best / 1e9


def run_plan(plan: DynamicPlan, mode: str, timer: Timer, backend, rest: Rest, cfg, dtype, links: dict) -> dict:
    """Per-rank emulated layer times of ``plan`` under ``mode`` ("ulysses" or "ring", ms) and exchanged bytes."""
    per_rank = []
    value_bytes = torch.tensor([], dtype=dtype).element_size()
    for r in range(plan.world):
        attn, sent, tokens = 0.0, 0.0, 0
        for start, size in plan.groups():
            if not start <= r < start + size:
                continue
            ids = [i for i in range(len(plan.lengths)) if (plan.starts[i], plan.sizes[i]) == (start, size)]
            lengths = tuple(plan.lengths[i] for i in ids)
            chunks = tuple(-(-n // size) for n in lengths)
            rows = sum(chunks)
            tokens += rows
            if size == 1 or mode == "ulysses":
                attn += attention_ms(timer, backend, lengths, cfg.heads // size, cfg.head_dim, dtype)
            else:  # the ring: size steps over the samples' chunk pairs
                attn += size * attention_ms(timer, backend, chunks, cfg.heads, cfg.head_dim, dtype)
            if size > 1 and mode == "ulysses":
                sent += EXCHANGED_TENSORS * rows * cfg.dim * value_bytes * (size - 1) / size
            elif size > 1:
                sent += RING_TENSORS * rows * cfg.dim * value_bytes * (size - 1)
        rest_t = rest_ms(timer, rest, tokens, cfg.text_len, cfg.dim, dtype)
        per_rank.append({"rank": r, "tokens": tokens, "attention_ms": attn, "rest_ms": rest_t,
                         "exchanged_bytes": sent,
                         **{f"exchange_ms_{k}": sent / (g * 1e9) * 1e3 for k, g in links.items()}})
    out = {"sizes": list(plan.sizes), "starts": list(plan.starts), "ranks": per_rank,
           "exchanged_bytes": sum(p["exchanged_bytes"] for p in per_rank)}
    compute = [p["attention_ms"] + p["rest_ms"] for p in per_rank]
    out["compute_slowest_over_mean"] = max(compute) / statistics.mean(compute)
    for k in links:
        tot = [c + p[f"exchange_ms_{k}"] for c, p in zip(compute, per_rank)]
        out[f"step_ms_{k}"] = max(tot)
        out[f"slowest_over_mean_{k}"] = max(tot) / statistics.mean(tot)
    return out


def bench_pack(name: str, lengths: list, world: int, modes: list, timer, backend, rest, cfg, dtype, links) -> dict:
    """Uniform vs dynamic SP on one pack, per mode (the plan: the DiT's, dynamic.DynamicSP, for that mode)."""
    uniform = DynamicPlan(world, tuple(lengths), (world,) * len(lengths), (0,) * len(lengths))
    res = {"pack": name, "lengths": lengths, "tokens": sum(lengths)}
    for mode in modes:
        sp = DynamicSP(world, cfg, mode=mode)
        dynamic = sp.plan([0] + list(accumulate(lengths)))
        m = {"plan": dynamic.describe(sp.cost), "uniform": run_plan(uniform, mode, timer, backend, rest, cfg, dtype,
                                                                     links),
             "dynamic": run_plan(dynamic, mode, timer, backend, rest, cfg, dtype, links)}
        for k in links:
            m[f"speedup_{k}"] = m["uniform"][f"step_ms_{k}"] / m["dynamic"][f"step_ms_{k}"]
        m["exchanged_bytes_ratio"] = (m["dynamic"]["exchanged_bytes"] / m["uniform"]["exchanged_bytes"]
                                      if m["uniform"]["exchanged_bytes"] else None)
        res[mode] = m
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan-14b")
    p.add_argument("--world", type=int, default=8, help="P, the SP ranks emulated")
    p.add_argument("--pack", action="append", default=None,
                   help="wan-mix (default) or equal:N:L; repeat for several packs (default: wan-mix, equal:8:32760, "
                        "equal:3:75600)")
    p.add_argument("--samples", type=int, default=20, help="wan-mix: samples per pack (per DP rank)")
    p.add_argument("--modes", default="ulysses,ring", help="SP modes modelled, comma-separated (ulysses, ring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None,
                   help="local attention kernel (megatron_sp_ext backends; default auto)")
    p.add_argument("--nvlink-gbps", type=float, default=150.0,
                   help="stated all-to-all rate per GPU for the 'nvlink' model (GB/s; not measured here)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny dims, small packs (CI)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        cfg, dtype, world = preset("tiny"), torch.float32, min(args.world, 4)
        packs = [("wan-mix (smoke: images of 15 tokens, clips of 40-300)",
                  wan_mix(10, args.seed, clip_range=(40, 300), image_tokens=15)), ("equal:4:96", [96] * 4)]
    else:
        cfg, dtype, world = preset(args.model), torch.bfloat16, args.world
        packs = [(t, parse_pack(t, args.samples, args.seed)) for t in (args.pack or ["wan-mix", "equal:8:32760",
                                                                                   "equal:3:75600"])]
    torch.manual_seed(0)
    backend = get_backend(args.backend or "auto", "--backend")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("ulysses", "ring") for m in modes):
        raise SystemExit(f"--modes={args.modes!r}: use ulysses and/or ring")
    rest = Rest(cfg).to(device, dtype)
    timer = Timer(device, args.reps, args.warmup)
    links = {"host": host_link_gbps(device), "nvlink": args.nvlink_gbps}
    results = [bench_pack(name, lengths, world, modes, timer, backend, rest, cfg, dtype, links)
               for name, lengths in packs]
    out = {"what": "EMULATED on one device: per-rank kernels timed one by one; exchange = bytes / link rate "
                   "(host: measured pinned D2H copy rate; nvlink: stated --nvlink-gbps); no overlap",
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "model": "tiny" if args.smoke else args.model, "world": world, "dtype": str(dtype).replace("torch.", ""),
           "backend": getattr(backend, "name", str(args.backend)), "link_gbps": links, "packs": results}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_dynamic_sp.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    for r in results:
        print(f"{r['pack']}: {len(r['lengths'])} samples, {r['tokens']:,} tokens")
        for mode in modes:
            m = r[mode]
            print(f"  {mode}: {m['plan']}")
            for k in links:
                print(f"  {mode}, {k} link ({links[k]:.0f} GB/s): uniform {m['uniform'][f'step_ms_{k}']:.1f} ms/layer, "
                      f"dynamic {m['dynamic'][f'step_ms_{k}']:.1f} (slowest/mean "
                      f"{m['dynamic'][f'slowest_over_mean_{k}']:.3f}): {m[f'speedup_{k}']:.3f}x")
            ratio = m["exchanged_bytes_ratio"]
            print(f"  {mode}: exchanged {m['dynamic']['exchanged_bytes'] / 1e9:.2f} GB vs uniform "
                  f"{m['uniform']['exchanged_bytes'] / 1e9:.2f} GB" + (f" ({ratio:.0%})" if ratio is not None else ""))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
