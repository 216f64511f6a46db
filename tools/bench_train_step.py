"""Training-step benchmark launched as users launch training (torchrun), measuring what the entry point measures.

One torchrun job runs the entry point (training/pretrain_video_dit.py or training/train_deepspeed.py) in-process
once per variant, each with --timing, and writes ONE JSON with, per variant:
  entry_step_ms      median wall time per step of the entry point's own loop (its metrics.jsonl, past warm-up)
  model_fwd_bwd_ms   CUDA events around forward+backward inside those same steps
  optimizer_ms       CUDA events from the end of backward to the end of the update (reduction, clip, guard, step)
  bare_step_ms       the same model + optimizer stepped on the last batch with nothing around it (the benchmark)
  entry_over_model_and_opt   target <= 1.15;   entry_over_bare   target within 5% of 1.0
  mfu, tokens_per_s, peak_mem_gib
Variants: "guarded" (the defaults: finite check every step) and "bare_loop" (--no-check-for-nan-in-loss-and-grad),
both with metrics read back every --log-interval steps (default 10); guard_overhead = guarded / bare_loop - 1
(target < 1%). "unfused" is the defaults with --fused-elementwise off (fused_speedup = unfused / guarded step time).
"cudnn" and "fa4" are the defaults with attention on that kernel (fa4_speedup = cudnn / fa4 step time).
The medians leave out the first log interval (warm-up, which includes torch.compile's compilation).

    torchrun --nproc-per-node 1 tools/bench_train_step.py --out $OUT -- --model wan-1.3b --num-layers 4 \
        --frames 21 --latent-size 60x104 --bf16 --train-iters 30 --ddp-impl torch
Everything after "--" goes to the entry point unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {"guarded": [],  # the defaults: finite check every step
            "bare_loop": ["--no-check-for-nan-in-loss-and-grad"],
            "unfused": ["--fused-elementwise", "off"],  # the eager elementwise path (the default on CPU)
            "cudnn": ["--sp-attention-backend", "cudnn"],  # attention on cuDNN (every call), the defaults otherwise
            "fa4": ["--sp-attention-backend", "fa4"]}  # attention on FlashAttention-4 (every call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entry", choices=["megatron", "deepspeed"], default="megatron")
    ap.add_argument("--variants", default="guarded,bare_loop")
    ap.add_argument("--log-interval", type=int, default=10, help="the entry's --log-interval in every variant "
                    "(the first interval is warm-up and left out of the medians)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="train_step_out")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the entry point's flags")
    args = ap.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    for v in args.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r} (choose from {', '.join(VARIANTS)})")
    if args.entry == "megatron":
        from training import pretrain_video_dit as entry
    else:
        from training import train_deepspeed as entry
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # shared by the runs below
    results = {}
    os.makedirs(args.out, exist_ok=True)
    for v in args.variants.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            res = entry.main([*rest, *VARIANTS[v], "--log-interval", str(args.log_interval), "--timing", "--quiet",
                              "--log-dir", os.path.join(tmp, v)])
        results[v] = res["timing"]
        if int(os.environ.get("RANK", "0")) == 0:
            t = res["timing"]
            print(f"[bench_train_step] {v}: entry {t['entry_step_ms']:.1f} ms, model fwd+bwd "
                  f"{t['model_fwd_bwd_ms']:.1f} + optimizer {t['optimizer_ms']:.1f} ms "
                  f"(entry/(fwd+bwd+opt) {t.get('entry_over_model_and_opt', float('nan')):.3f}), bare step "
                  f"{t['bare_step_ms']:.1f} ms (entry/bare {t['entry_over_bare']:.3f}), mfu {t['mfu']}, "
                  f"peak {t['peak_mem_gib']} GiB", flush=True)
    if "guarded" in results and "bare_loop" in results:
        results["guard_overhead"] = results["guarded"]["entry_step_ms"] / results["bare_loop"]["entry_step_ms"] - 1
    if "guarded" in results and "unfused" in results:
        results["fused_speedup"] = results["unfused"]["entry_step_ms"] / results["guarded"]["entry_step_ms"]
    if "cudnn" in results and "fa4" in results:
        results["fa4_speedup"] = results["cudnn"]["entry_step_ms"] / results["fa4"]["entry_step_ms"]
    if int(os.environ.get("RANK", "0")) == 0:
        from tools.gpu_ranks import run_meta  # noqa: PLC0415
        out = {"meta": run_meta(), "entry": args.entry, "argv": rest,
               "world": int(os.environ.get("WORLD_SIZE", "1")), "results": results}
        tag = f"_{args.tag}" if args.tag else ""
        path = os.path.join(args.out, f"train_step{tag}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out["results"], indent=1))
        print(f"wrote {path}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
