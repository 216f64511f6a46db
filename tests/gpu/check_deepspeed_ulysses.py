"""GPU check: the stock DeepSpeed scripts with DeepSpeed's own Ulysses vs with our JSON block.

For each script in training/ds_examples (DistributedAttention GPT, ALST tiny Llama) it launches
``torchrun --nproc-per-node N -m megatron_sp_ext.deepspeed.launch <script>`` for 10 bf16
iterations, once with a config holding only DeepSpeed's ``"sequence_parallel_size": N`` and once
per mode with ``"sequence_parallel_ext": {"mode": ...}`` added (ulysses, hcms; ring for the
DistributedAttention script), and compares the per-iteration loss and grad norm with DeepSpeed's
run (max relative difference; pass: < 1% at every iteration, and DeepSpeed's own run's loss falls
>= 20% from the first iteration to the last, so that the runs compared are training). Adam at
--lr 5e-4 (default), no warmup, gradient clipping 1.0.
Writes <out>/deepspeed_ulysses.json (versions, date, commands, per-iteration values) and .md.

Needs >= 2 GPUs, deepspeed and transformers (carried as wheels, see docs/deepspeed.md):
    python tests/gpu/check_deepspeed_ulysses.py --nproc 2 --out results/<date>_deepspeed
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = {
    "train_ulysses": {"modes": [{"mode": "ulysses"}, {"mode": "hcms", "head_chunks": 2},
                                {"mode": "ring", "causal": True}], "extra": []},
    "train_alst_llama": {"modes": [{"mode": "ulysses"}, {"mode": "hcms", "head_chunks": 2}],
                         "extra": ["--kv-heads", "4"]},
}


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _config(args, block) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
           "sequence_parallel_size": args.nproc, "bf16": {"enabled": not args.fp32},
           "optimizer": {"type": "Adam", "params": {"lr": args.lr, "torch_adam": True}}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 1}, "steps_per_print": 1000}
    if block is not None:
        cfg["sequence_parallel_ext"] = block
    return cfg


def _run(args, script, block, tmp, tag) -> dict:
    cfg_path, log_path = os.path.join(tmp, f"{tag}.json"), os.path.join(tmp, f"{tag}.log.json")
    with open(cfg_path, "w") as f:
        json.dump(_config(args, block), f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-port", str(args.port), "-m", "megatron_sp_ext.deepspeed.launch",
           os.path.join("training", "ds_examples", f"{script}.py"), "--deepspeed_config", cfg_path,
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--hidden", str(args.hidden), "--heads", str(args.heads), "--layers", str(args.layers),
           "--vocab", str(args.vocab), "--log-json", log_path, *SCRIPTS[script]["extra"]]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    print(f"[{tag}] {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    row = {"script": script, "block": block, "command": " ".join(cmd), "config": _config(args, block),
           "returncode": proc.returncode}
    if proc.returncode != 0 or not os.path.exists(log_path):
        row["error"] = (proc.stdout + proc.stderr)[-4000:]
        print(row["error"], flush=True)
        return row
    with open(log_path) as f:
        row.update(json.load(f))
    return row


def _rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="GPUs = sequence_parallel_size")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--lr", type=float, default=5e-4, help=(
        "Adam's lr (default 5e-4). At 1e-2, DeepSpeed's own runs did not train (2 x H200, bf16, 2026-11-29: "
        "train_ulysses 4.70 -> 0.02 -> 10.3 -> 4.56, a 3%% drop; train_alst_llama 4.70 -> 5.62, up 20%%). "
        "Loss drop over 10 steps at the default dims on 2 CPU ranks (gloo, bf16; fp32 the same to 0.3 points up "
        "to 8e-4), train_ulysses / train_alst_llama: 2e-4 18%%/44%%, 3e-4 27/51, 5e-4 44/57, 7e-4 59/52, "
        "8e-4 66/7 and 1e-3 76/12 (the Llama blows up at step 9), fp32 2e-3 88/2 (the Llama stuck at ln 97); with "
        "--seed 1, 2, 3 in the scripts the smallest drop of both was 22%% at 3e-4, 29%% at 4e-4, 31%% at 5e-4, "
        "22%% at 6e-4. The CPU bf16 run at 1e-2 reproduced the H200 train_ulysses losses to 0.01"))
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16")
    p.add_argument("--cpu", action="store_true", help="smoke run on CPU ranks (gloo, DS_ACCELERATOR=cpu)")
    p.add_argument("--scripts", default=",".join(SCRIPTS))
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--tolerance", type=float, default=0.01)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "deepspeed_ulysses"))
    args = p.parse_args(argv)
    import torch  # noqa: PLC0415
    if args.cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    elif torch.cuda.device_count() < args.nproc:
        print(f"needs {args.nproc} GPUs (--nproc), found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    unknown = set(args.scripts.split(",")) - set(SCRIPTS)
    if unknown:
        print(f"--scripts: unknown {sorted(unknown)}; valid: {', '.join(SCRIPTS)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([sys.executable, *sys.argv]), "commit": commit or None,
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "deepspeed": _version("deepspeed"),
                           "transformers": _version("transformers")},
              "gpu": "cpu" if args.cpu else torch.cuda.get_device_name(0), "nproc": args.nproc, "runs": [], "summary": []}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for script in args.scripts.split(","):
            base = _run(args, script, None, tmp, f"{script}_deepspeed")
            report["runs"].append(base)
            for block in SCRIPTS[script]["modes"]:
                row = _run(args, script, block, tmp, f"{script}_{block['mode']}")
                report["runs"].append(row)
                summ = {"script": script, "mode": block["mode"]}
                if "loss" in row and "loss" in base:
                    summ.update(loss_max_rel=_rel(row["loss"], base["loss"]),
                                grad_norm_max_rel=_rel(row["grad_norm"], base["grad_norm"]),
                                loss_drop=1 - base["loss"][-1] / base["loss"][0])
                    summ["pass"] = (summ["loss_max_rel"] < args.tolerance and summ["grad_norm_max_rel"] < args.tolerance
                                    and summ["loss_drop"] >= 0.2)
                else:
                    summ["pass"] = False
                    summ["error"] = (row.get("error") or base.get("error") or "")[-500:]
                ok &= summ["pass"]
                report["summary"].append(summ)
    lines = [f"DeepSpeed {report['versions']['deepspeed']}, transformers {report['versions']['transformers']}, "
             f"torch {report['versions']['torch']}, {args.nproc} x {report['gpu']}, "
             f"{'fp32' if args.fp32 else 'bf16'}, {args.steps} iterations, {report['date']}",
             "", "| script | mode | loss max rel. diff | grad norm max rel. diff | loss drop | pass |",
             "|---|---|---|---|---|---|"]
    for s in report["summary"]:
        if "loss_max_rel" in s:
            lines.append(f"| {s['script']} | {s['mode']} | {s['loss_max_rel']:.2e} | {s['grad_norm_max_rel']:.2e} | "
                         f"{s['loss_drop']:.0%} | {'yes' if s['pass'] else 'NO'} |")
        else:
            lines.append(f"| {s['script']} | {s['mode']} | - | - | - | NO (failed to run) |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "deepspeed_ulysses.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "deepspeed_ulysses.md"), "w") as f:
        f.write(table + "\n\nCommand: `" + report["command"] + "`\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
