"""Loss curves of one block-sparse DiT run on several block-sparse kernels (issue #53: "a sparse run on FA4 against the
same run on flex: within bf16 noise"), on one GPU.

Runs the megatron-core entry (training/pretrain_video_dit.py, one rank) --steps steps with the same seed, data and
flags, changing only --sparse-attention-kernel (and, for the noise run, the precision):
  <ref>_bf16      the reference: --bf16 on --ref-kernel (default flex, the established block-sparse kernel)
  <k>_bf16        each of --kernels (default fa4): the same run on kernel k
  <ref>_fp32      the noise yardstick: the reference run without --bf16 (fp32; the same kernel, FA4 takes no fp32),
                  so its gap to the reference is bf16's rounding alone (tools/loss_curves.py --noise)
then tools/loss_curves.py writes <out>/loss_curves.json / .png: each run's max / mean relative gap to the reference
per step, the noise gap and ``within_noise``; the JSON also gets each run's flags and wall seconds.

The sparse flags come from tools/bench_train_step.sparse_variant_flags (--variant sparse_topk90: K = 10% of the grid's
tiles; sparse_window90: the window nearest 90% sparsity). Default size: wan-1.3b widths, 2 layers, token grid 8x32x64
(--frames 8 --latent-size 64x128, 16384 tokens, 128 tiles of 4x4x8 = 128 tokens: FA4's kernel block).

    source tools/gpu_install.sh && python3 tools/sparse_curves.py --out $OUT/sparse_curves     (or: bash
    tools/gpu_round.sh's stage "curves", which does both)
    python tools/sparse_curves.py --out /tmp/x --dry-run     (CPU: print and parse-check the runs' flags)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.loss_curves import compare  # noqa: E402

ENTRY = os.path.join("training", "pretrain_video_dit.py")
KERNEL_FLAG = "--sparse-attention-kernel"


def base_flags(a: argparse.Namespace) -> list:
    """The entry flags every run shares (no precision, no sparse kernel)."""
    return ["--model", a.model, "--num-layers", str(a.num_layers), "--frames", a.frames, "--latent-size",
            a.latent_size, "--train-iters", str(a.steps), "--seed", str(a.seed), "--lr", str(a.lr),
            "--ddp-impl", "torch",
            "--fused-elementwise", "off", *a.extra]   # not --quiet: the log names the kernel that ran


def plan(a: argparse.Namespace) -> tuple[list, dict]:
    """([(name, entry argv), ...] reference first and noise last, info of the sparse variant)."""
    from tools.bench_train_step import sparse_variant_flags  # noqa: PLC0415
    from training import pretrain_video_dit  # noqa: PLC0415
    base = base_flags(a)
    sparse, info = sparse_variant_flags(a.variant, base, a.tile, pretrain_video_dit)
    common = base + sparse
    runs = [(f"{a.ref_kernel}_bf16", common + [KERNEL_FLAG, a.ref_kernel, "--bf16"])]
    runs += [(f"{k}_bf16", common + [KERNEL_FLAG, k, "--bf16"]) for k in a.kernels.split(",") if k != a.ref_kernel]
    runs.append((f"{a.ref_kernel}_fp32", common + [KERNEL_FLAG, a.ref_kernel]))
    return runs, info


def check_flags(runs: list) -> None:
    """Parse every run's argv with the entry's parser here (CPU: the kernel is checked against the registry's choices,
    then parsed as "auto", since FA4 / flex do not run on CPU)."""
    from megatron_sp_ext.attention.block_sparse import KERNELS  # noqa: PLC0415
    from training import pretrain_video_dit  # noqa: PLC0415
    for name, argv in runs:
        i = argv.index(KERNEL_FLAG) + 1
        if argv[i] not in KERNELS:
            raise SystemExit(f"{name}: {KERNEL_FLAG} {argv[i]} is not one of {', '.join(KERNELS)}")
        pretrain_video_dit.parse(argv[:i] + ["auto"] + argv[i + 1:])


def run_one(name: str, argv: list, out: str) -> dict:
    """One run on one GPU (torchrun, one rank); its metrics.jsonl under <out>/runs/<name>."""
    log_dir = os.path.join(out, "runs", name)
    os.makedirs(log_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", ENTRY,
           *argv, "--log-dir", log_dir]
    print(f"[sparse_curves] {name}: {shlex.join(cmd)}", flush=True)
    start = time.time()
    with open(os.path.join(log_dir, "stdout.txt"), "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.time() - start
    with open(os.path.join(log_dir, "stdout.txt")) as f:
        text = f.read()
    if rc != 0:
        print(text[-3000:], file=sys.stderr)
        raise SystemExit(f"[sparse_curves] {name} failed (exit {rc}) after {seconds:.0f} s: {log_dir}/stdout.txt")
    kernel_line = next((ln.strip() for ln in text.splitlines() if "attention kernel:" in ln), "")
    print(f"[sparse_curves] {name}: {seconds:.1f} s", flush=True)
    return {"metrics": os.path.join(log_dir, "metrics.jsonl"), "seconds": round(seconds, 1), "argv": argv,
            "kernel_line": kernel_line}


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for loss_curves.json / .png and runs/<name>/")
    p.add_argument("--kernels", default="fa4", help="comma list of block-sparse kernels compared to --ref-kernel")
    p.add_argument("--ref-kernel", default="flex", help="the reference's kernel (and the fp32 noise run's)")
    from tools.bench_train_step import SPARSE_VARIANTS  # noqa: PLC0415
    p.add_argument("--variant", default="sparse_topk90", choices=list(SPARSE_VARIANTS),
                   help="the sparse selection and its target sparsity (K or the window from the token grid)")
    p.add_argument("--tile", default="4,4,8")
    p.add_argument("--model", default="wan-1.3b")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--frames", default="8")
    p.add_argument("--latent-size", default="64x128")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=2e-4, help="the runs' learning rate (the entry's own 2e-3 made the "
                   "50-step run chaotic on 1 x H200, 2026-11-26: loss 1.3-23.7, fp32 and bf16 parted by 127%%, so no "
                   "kernel could be judged against bf16 noise)")
    p.add_argument("--dry-run", action="store_true", help="print the runs and parse-check their flags; run nothing")
    p.add_argument("extra", nargs="*", help="after --: more entry flags for every run")
    a = p.parse_args(argv)
    runs, info = plan(a)
    check_flags(runs)
    if a.dry_run:
        for name, run_argv in runs:
            print(f"{name}: {shlex.join(run_argv)}")
        print(f"sparse: {json.dumps(info)}")
        return 0
    done = {name: run_one(name, run_argv, a.out) for name, run_argv in runs}
    names = [n for n, _ in runs]
    res = compare((names[0], done[names[0]]["metrics"]), [(n, done[n]["metrics"]) for n in names[1:-1]],
                  (names[-1], done[names[-1]]["metrics"]), a.out)
    res.update(sparse=info, runs_detail=done, steps=a.steps)
    with open(os.path.join(a.out, "loss_curves.json"), "w") as f:
        json.dump(res, f, indent=1)
    noise = res["noise"]
    print(f"noise ({noise['name']} vs {res['reference']}): max rel {noise['max_rel']:.3e}, "
          f"mean {noise['mean_rel']:.3e}")
    for name, g in res["runs"].items():
        print(f"{name} vs {res['reference']}: max rel {g['max_rel']:.3e}, mean {g['mean_rel']:.3e}, "
              f"within noise: {g['within_noise']}")
    print(f"wrote {os.path.join(a.out, 'loss_curves.json')} and loss_curves.png; "
          + ", ".join(f"{n} {d['seconds']} s" for n, d in done.items()))
    return 0 if all(g["within_noise"] for g in res["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
