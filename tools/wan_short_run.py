r"""The fine-tuning recipe of docs/wan_finetune.md end to end at real size on random weights, timed: a Wan 2.1 T2V
pipeline folder -> generated videos with captions -> ``python -m training.wan_diffusers.prepare`` -> a LoRA of
wan-1.3b with ``training/train_wan_diffusers.py`` writing validation videos mid-run and at the end.

    python3 tools/wan_short_run.py --out runs/wanrun --time-limit 420                 # SP=1, one GPU
    torchrun --nproc-per-node 2 tools/wan_short_run.py --out runs/wanrun2 --time-limit 420   # SP=2

Phases (each rank of a torchrun job takes part as the recipe's torchrun commands do):
1. pipeline: rank 0 writes a random-weight Wan 2.1 T2V pipeline in diffusers' layout (WanPipeline.save_pretrained,
   safetensors) to the work dir: Wan 2.1's AutoencoderKLWan (diffusers' default config, fp32), umT5 at its real width
   (tools/bench_wan_prepare.py's UMT5_XXL: d_model 4096, so the text embeddings are [512, 4096]; 24 layers, 5.7B
   parameters, unless --text-layers cuts the blocks; bf16), wan-1.3b's WanTransformer3DModel (the trainer's preset,
   bf16 files: the trainer reads them into fp32), UniPC with Wan's flow settings, and bench_wan_prepare's word-level
   tokenizer stand-in (umT5 always runs 512 padded tokens).
2. videos: --clips captioned clips of --src-frames frames at --src-size (bench_wan_prepare.make_video) and --prompts
   validation prompts.
3. prepare: ``training.wan_diffusers.prepare.main`` with the recipe's flags (--frames, --buckets, --prompts); under
   torchrun each rank encodes its share, as ``torchrun -m training.wan_diffusers.prepare`` does.
4. train: ``training/train_wan_diffusers.py``'s main: LoRA rank --lora-rank of the pipeline's transformer (--init),
   bf16, --recompute-granularity (full) and --fused-elementwise (off) passed on, --train-iters steps, validation videos every --validation-every steps and at the end
   (--validation-steps, --validation-guidance, the clip's size and frames); at SP = the torchrun world size
   (--cp-comm-type) when started under torchrun.
Both are called in this process with the argv of the CLI (the JSON lists the equivalent commands).

Written to --out DIR (rank 0): wan_short_run.json (meta: machine, date, commit, command; the commands; seconds per
phase; prepare's seconds per clip; the median training step (steps after the first); every validation video's
sample_s / decode_s from the trainer's validation/index.jsonl; SP; peak GPU memory per phase) rewritten after every
phase, and the run's files under DIR/run/ (metrics.jsonl, loss.png, step_time.png, validation/index.jsonl and each
step's mp4 / png / prompts.txt; the JSON's validation rows name them relative to DIR). gpu_round.sh's tarball leaves
out files of 4 MB and more: a video or frame strip above --max-file-mb (3) is copied at half (a quarter, an eighth)
of its sides, the JSON's files.shrunk says so; past --max-out-mb (12) in all, files stay out (files.left_out). The
pipeline (~15 GB at real size), the latents and the LoRA stay in the work dir (a temporary one, removed unless
--keep). Seconds per clip of prepare: its encode loop / clips (the first clip includes the VAE's warm-up).

--time-limit S (counted from the start of this script): at S - 15 seconds the run stops where it is: rank 0 writes
the JSON (timed_out: the phase) with what exists by then, removes a temporary work dir, and exits with status 124.
--dry-run: tiny stand-ins on the CPU (bench_wan_prepare's DRY configs: a 9-frame 40x56 clip to 32x64, 2 training
steps, 2 sampling steps of 5 frames at 32x32) through the same phases, for the tests.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Optional

T_START = time.perf_counter()   # --time-limit counts from here (before torch's import)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from tools import bench_wan_prepare as B  # noqa: E402
from tools.benchlib import join_torchrun, run_meta, write_json  # noqa: E402
from training.video_dit.faults import PeerFailed, on_rank0, run_entry  # noqa: E402,F401 - PeerFailed: the tests
from training.wan_diffusers.prepare import read_jsonl  # noqa: E402

RESULT = "wan_short_run.json"
TAG = "[wan_short_run]"
VIDEO_KEYS = ("step", "i", "prompt", "sample_s", "decode_s", "frames", "height", "width", "steps", "guidance")
MARGIN_S = 15   # --time-limit: what writing the JSON, copying the files and removing the work dir may take
DRY = dict(src_frames=9, src_size="40x56", bucket="32x64", frames=9, clips=2, train_iters=2, validation_every=1,
           validation_steps=2, validation_frames=5, validation_size="32x32")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="the JSON and the run's small files")
    p.add_argument("--time-limit", type=float, default=0, help="seconds for the whole run (0: none)")
    p.add_argument("--clips", type=int, default=4, help="generated training clips")
    p.add_argument("--src-frames", type=int, default=81, help="frames of each generated clip")
    p.add_argument("--src-size", default="480x854", help="HxW of the generated clips (480p 16:9)")
    p.add_argument("--bucket", default="480x832", help="prepare's --buckets")
    p.add_argument("--frames", type=int, default=81, help="prepare's --frames")
    p.add_argument("--prompts", type=int, default=2, help="validation prompts")
    p.add_argument("--text-layers", type=int, default=24,
                   help="umT5 blocks of the written pipeline (24: umT5-XXL, 5.7B; fewer: the same width, less to "
                        "write and load)")
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--validation-every", type=int, default=5, help="the trainer's --validation-every")
    p.add_argument("--validation-steps", type=int, default=20, help="denoising steps per validation video")
    p.add_argument("--validation-guidance", type=float, default=5.0, help="guidance scale (2 forwards per step)")
    p.add_argument("--validation-frames", type=int, default=None, help="default: --frames")
    p.add_argument("--validation-size", default=None, help="default: --bucket")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--cp-comm-type", default="auto", help="the trainer's --cp-comm-type under torchrun")
    p.add_argument("--recompute-granularity", choices=["full", "selective"], default="full",
                   help="the trainer's: full (diffusers' checkpointing) or selective (the attention kept)")
    p.add_argument("--fused-elementwise", choices=["on", "off", "auto"], default="off",
                   help="the trainer's (every block compiled by Inductor, the first step pays the compile)")
    p.add_argument("--max-file-mb", type=float, default=3.0, help="larger files stay in the work dir")
    p.add_argument("--max-out-mb", type=float, default=12.0, help="the run's files copied to --out, in all")
    p.add_argument("--work-dir", default=None, help="pipeline, videos, latents, LoRA (default: a temporary dir)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="tiny CPU stand-ins (tests)")
    return p


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.dry_run:
        for k, v in DRY.items():
            setattr(args, k, v)
    args.validation_frames = args.validation_frames or args.frames
    args.validation_size = args.validation_size or args.bucket
    for flag, n, least in (("--clips", args.clips, 1), ("--prompts", args.prompts, 1),
                           ("--train-iters", args.train_iters, 1), ("--validation-every", args.validation_every, 1),
                           ("--text-layers", args.text_layers, 1), ("--lora-rank", args.lora_rank, 1)):
        if n < least:
            p.error(f"{flag}={n}: must be >= {least}")
    if args.validation_every >= args.train_iters:
        p.error(f"--validation-every={args.validation_every} with --train-iters={args.train_iters}: no mid-run "
                f"validation (give fewer steps between validations than steps)")
    return args


class Run:
    """The result document, its phases and the watchdog of --time-limit (rank 0 writes)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, device: torch.device, work: str,
                 remove_work: bool) -> None:
        self.args, self.rank, self.world, self.device, self.work = args, rank, world, device, work
        self.remove_work = remove_work and rank == 0   # a temporary work dir (tens of GB at real size)
        self.t0 = T_START
        self.log_dir = os.path.join(work, "run")
        self.lock = threading.Lock()
        self.doc: dict = {"meta": run_meta(world=world, dry_run=args.dry_run), "sp": world, "complete": False,
                          "timed_out": None, "phase": None, "seconds": {}, "peak_mem_gib": {}, "commands": {}}
        self.finished = False

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"{TAG} {time.perf_counter() - self.t0:7.1f}s {msg}", flush=True)

    def start(self, phase: str) -> float:
        self.doc["phase"] = phase
        self.say(f"{phase} ...")
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        return time.perf_counter()

    def end(self, phase: str, t0: float) -> None:
        s = time.perf_counter() - t0
        self.doc["seconds"][phase] = round(s, 2)
        if self.device.type == "cuda":
            self.doc["peak_mem_gib"][phase] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        self.say(f"{phase} done in {s:.1f}s")
        self.write()

    def write(self) -> None:
        """The JSON as it stands (rank 0), with what the trainer has written so far."""
        if self.rank != 0:
            return
        with self.lock:
            self.doc["seconds"]["total"] = round(time.perf_counter() - self.t0, 2)
            self.doc.update(collect(self.log_dir))
            write_json(os.path.join(self.args.out, RESULT), self.doc)

    def finish(self, timed_out: Optional[str] = None) -> None:
        """The final JSON and the run's files copied to --out (rank 0; once)."""
        if self.rank != 0 or self.finished:
            return
        self.finished = True
        self.doc["timed_out"] = timed_out
        self.doc["complete"] = timed_out is None and self.doc.get("error") is None
        self.doc["files"] = copy_small(self.log_dir, os.path.join(self.args.out, "run"), self.args.max_file_mb,
                                       self.args.max_out_mb)
        self.write()

    def watchdog(self) -> Optional[threading.Timer]:
        """--time-limit: rank 0 writes what it has, removes a temporary work dir and exits 124 MARGIN_S before the
        limit (the other ranks 20 s after it, should rank 0's exit not end them)."""
        if not self.args.time_limit:
            return None
        elapsed = time.perf_counter() - self.t0
        due = max(1.0, self.args.time_limit - MARGIN_S - elapsed) if self.rank == 0 else \
            self.args.time_limit + 20 - elapsed

        def fire() -> None:
            if self.finished:   # the main thread is writing the final JSON already
                return
            phase = self.doc.get("phase") or "start"
            self.say(f"--time-limit {self.args.time_limit:g}s reached in phase {phase}: writing what there is")
            try:
                self.finish(timed_out=phase)
                self.cleanup()
            finally:
                os._exit(124)

        timer = threading.Timer(due, fire)
        timer.daemon = True
        timer.start()
        return timer

    def cleanup(self) -> None:
        if self.remove_work:
            shutil.rmtree(self.work, ignore_errors=True)


def collect(log_dir: str) -> dict:
    """The trainer's telemetry so far: steps (metrics.jsonl), the median step after the first, the validation rows
    (validation/index.jsonl) with their sampling / decoding seconds."""
    steps = read_jsonl(os.path.join(log_dir, "metrics.jsonl"))
    later = [r["step_time_s"] for r in steps if r.get("step", 0) >= 1 and "step_time_s" in r]
    videos = []
    for r in read_jsonl(os.path.join(log_dir, "validation", "index.jsonl")):
        row = {k: r.get(k) for k in VIDEO_KEYS}
        for k in ("mp4", "png"):   # relative to --out: the run's files go to DIR/run/
            row[k] = os.path.join("run", os.path.relpath(r[k], log_dir)) if k in r else None
        videos.append(row)
    return {"train": {"steps": len(steps), "losses": [r.get("loss") for r in steps],
                      "step_ms_median": round(1e3 * statistics.median(later), 1) if later else None,
                      "first_step_ms": round(1e3 * steps[0]["step_time_s"], 1) if steps else None,
                      "peak_mem_gib": max((r["peak_mem_gib"] for r in steps if "peak_mem_gib" in r), default=None)},
            "validation": videos}


VIDEO_FILE = re.compile(r"\d+\.(mp4|png)$")   # the validator's <i>.mp4 / <i>.png


def copy_small(src: str, dst: str, max_file_mb: float, max_out_mb: float) -> dict:
    """Copy ``src``'s files to ``dst`` (same relative paths), the text and plots first, then the videos and frame
    strips; a video or strip above ``max_file_mb`` is copied at half (a quarter, an eighth) of its size where that
    fits (``shrink``); ``max_out_mb`` in all. Returns {"copied": [rel], "shrunk": {rel: "HxW of HxW"}, "left_out":
    {rel: reason}, "copied_mib"}."""
    found = []
    for root, _, names in os.walk(src):
        for n in names:
            found.append((bool(VIDEO_FILE.match(n)), os.path.relpath(os.path.join(root, n), src)))
    copied, shrunk, left, total = [], {}, {}, 0
    limit = int(max_file_mb * 2**20)
    for _, rel in sorted(found):
        path, out = os.path.join(src, rel), os.path.join(dst, rel)
        size = os.path.getsize(path)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if size > limit:
            how = shrink(path, out, limit) if VIDEO_FILE.match(os.path.basename(rel)) else None
            if how is None:
                left[rel] = f"{size / 2**20:.1f} MiB > --max-file-mb {max_file_mb:g}"
                continue
            shrunk[rel] = how
        else:
            shutil.copyfile(path, out)
        size = os.path.getsize(out)
        if (total + size) / 2**20 > max_out_mb:
            os.remove(out)
            shrunk.pop(rel, None)
            left[rel] = f"--max-out-mb {max_out_mb:g} reached"
            continue
        copied.append(rel)
        total += size
    return {"copied": copied, "shrunk": shrunk, "left_out": left, "copied_mib": round(total / 2**20, 2)}


def shrink(src: str, dst: str, max_bytes: int) -> Optional[str]:
    """``src`` (an mp4 or png) written to ``dst`` with its sides halved, quartered or eighthed, the first that is at
    most ``max_bytes``: "HxW of HxW"; None (nothing left at ``dst``) when none is."""
    import numpy as np  # noqa: PLC0415
    from PIL import Image  # noqa: PLC0415
    if src.endswith(".png"):
        frames, fps = [np.asarray(Image.open(src).convert("RGB"))], None
    else:
        import imageio.v2 as imageio  # noqa: PLC0415
        reader = imageio.get_reader(src, "ffmpeg")
        fps = reader.get_meta_data().get("fps", 16)
        frames = [np.asarray(f) for f in reader]
        reader.close()
    h0, w0 = frames[0].shape[:2]
    for k in (2, 4, 8):
        h, w = max(2, h0 // k // 2 * 2), max(2, w0 // k // 2 * 2)   # even sides (yuv420p)
        small = [np.asarray(Image.fromarray(f).resize((w, h), Image.BILINEAR)) for f in frames]
        if fps is None:
            Image.fromarray(small[0]).save(dst)
        else:
            with imageio.get_writer(dst, "ffmpeg", fps=fps, macro_block_size=1) as wr:
                for f in small:
                    wr.append_data(f)
        if os.path.getsize(dst) <= max_bytes:
            return f"{h}x{w} of {h0}x{w0}"
    os.remove(dst)
    return None


def write_pipeline(root: str, args: argparse.Namespace, device: torch.device) -> dict:
    """The random-weight Wan 2.1 T2V pipeline (module docstring) saved to ``root``; returns what it holds."""
    from diffusers import UniPCMultistepScheduler, WanPipeline  # noqa: PLC0415
    from training.wan_diffusers import model as wan  # noqa: PLC0415
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    text = B.random_text(args.dry_run, device, dtype, args.seed, num_layers=args.text_layers)
    vae = B.random_vae("wan2.1", args.dry_run, "cpu", torch.float32, args.seed)
    kw = dict(B.DRY["wan"]) if args.dry_run else wan.preset_kwargs("wan-1.3b")
    transformer = wan.random_model(kw, args.seed, device).to(dtype)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                    num_train_timesteps=1000)
    pipe = WanPipeline(tokenizer=text.tokenizer, text_encoder=text.text_encoder, vae=vae, scheduler=sched,
                       transformer=transformer)
    pipe.save_pretrained(root, safe_serialization=True)
    te = text.text_encoder.config
    out = {"text_encoder": {"d_model": te.d_model, "num_layers": te.num_layers,
                            "umt5_xxl": not args.dry_run and te.num_layers == B.UMT5_XXL["num_layers"],
                            "params": sum(p.numel() for p in text.text_encoder.parameters()),
                            "dtype": str(dtype).replace("torch.", "")},
           "transformer": {"preset": "dry" if args.dry_run else "wan-1.3b", "num_layers": kw["num_layers"],
                           "params": sum(p.numel() for p in transformer.parameters()),
                           "dtype": str(dtype).replace("torch.", "")},
           "vae": "dry" if args.dry_run else "Wan 2.1 AutoencoderKLWan (diffusers' default config)",
           "tokenizer": "word-level stand-in (bench_wan_prepare.tokenizer)",
           "disk_gib": round(sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(root) for f in fs)
                             / 2**30, 2)}
    return out


def write_inputs(work: str, args: argparse.Namespace) -> tuple:
    """(videos folder, prompts.txt) of the generated clips and validation prompts."""
    from training.wan_diffusers import media  # noqa: PLC0415
    videos = B.make_video(os.path.join(work, "videos"), args.src_frames,
                          media.parse_sizes(args.src_size, "--src-size")[0], args.clips, args.seed)
    prompts = os.path.join(work, "prompts.txt")
    with open(prompts, "w") as f:
        for i in range(args.prompts):
            f.write(" ".join(B.WORDS[(53 * i + 11 * k + 500) % len(B.WORDS)] for k in range(24)) + "\n")
    return videos, prompts


def prepare_argv(args: argparse.Namespace, pipe: str, videos: str, prompts: str, data: str) -> list:
    return ["--pipeline", pipe, "--input", videos, "--output", data, "--frames", str(args.frames), "--buckets",
            args.bucket, "--prompts", prompts]


def train_argv(args: argparse.Namespace, pipe: str, data: str, log_dir: str, lora: str, sp: int,
               cuda: bool) -> list:
    argv = ["--init", pipe, "--data-path", data, "--lora-rank", str(args.lora_rank), "--lora-alpha",
            str(args.lora_rank), "--lora-target-modules", "to_q,to_k,to_v,to_out.0", "--recompute-granularity",
            args.recompute_granularity, "--fused-elementwise", args.fused_elementwise,
            "--lr", "1e-4", "--train-iters", str(args.train_iters), "--seed", str(args.seed), "--log-dir", log_dir,
            "--save-lora", lora, "--validation-prompts", os.path.join(data, "validation", "prompts.safetensors"),
            "--validation-every", str(args.validation_every), "--validation-steps", str(args.validation_steps),
            "--validation-guidance", str(args.validation_guidance), "--validation-size", args.validation_size,
            "--validation-frames", str(args.validation_frames), "--validation-flow-shift", "3.0"]
    if cuda:
        argv.append("--bf16")
    if sp > 1:
        argv += ["--context-parallel-size", str(sp), "--cp-comm-type", args.cp_comm_type]
    return argv


def phases(run: Run) -> None:
    """The four phases (module docstring); collective under torchrun."""
    from training import train_wan_diffusers as trainer  # noqa: PLC0415
    from training.wan_diffusers import prepare  # noqa: PLC0415
    args, work, world = run.args, run.work, run.world
    pipe, data, lora = (os.path.join(work, n) for n in ("pipeline", "data", "lora"))
    launcher = "python" if world == 1 else f"torchrun --nproc-per-node {world}"

    t = run.start("pipeline")
    made = on_rank0("phase pipeline", lambda: write_pipeline(pipe, args, run.device))
    if run.rank == 0:
        run.doc["pipeline"] = made
    run.end("pipeline", t)

    t = run.start("videos")
    videos, prompts = on_rank0("phase videos", lambda: write_inputs(work, args))
    run.end("videos", t)

    argv = prepare_argv(args, pipe, videos, prompts, data)
    run.doc["commands"]["prepare"] = f"{launcher} -m training.wan_diffusers.prepare {shlex.join(argv)}"
    t = run.start("prepare")
    summary = prepare.main(argv)
    barrier(world)
    run.doc["prepare"] = {"clips": summary.get("written"), "share": summary.get("share"),
                          "encode_s": round(summary.get("seconds", 0.0), 2),
                          "seconds_per_clip": round(summary["seconds"] / summary["written"], 3)
                          if summary.get("written") else None, "frames": args.frames, "bucket": args.bucket,
                          "source": f"{args.src_frames} frames {args.src_size}"}
    run.end("prepare", t)

    argv = train_argv(args, pipe, data, run.log_dir, lora, world, run.device.type == "cuda")
    run.doc["commands"]["train"] = f"{launcher} training/train_wan_diffusers.py {shlex.join(argv)}"
    t = run.start("train")
    out = trainer.main(argv)
    run.doc["loss_first_last"] = [out["losses"][0], out["losses"][-1]] if out.get("losses") else None
    run.end("train", t)


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def preflight() -> None:
    """What the phases need that a package gives, checked on every rank before any work: one message, no hang."""
    import importlib.util  # noqa: PLC0415
    missing = [m for m in ("imageio", "imageio_ffmpeg") if importlib.util.find_spec(m) is None]
    if missing:
        raise SPConfigError(f"tools/wan_short_run.py writes its clips and validation videos as mp4 with imageio and "
                            f"imageio-ffmpeg; not installed here: {', '.join(m.replace('_', '-') for m in missing)} "
                            f"(pip install \".[diffusers]\" installs both)")


def summary_line(doc: dict) -> str:
    v = doc.get("validation") or []
    return (f"SP={doc['sp']} seconds {doc['seconds']} step_ms_median {doc.get('train', {}).get('step_ms_median')} "
            f"sample_s {[r['sample_s'] for r in v]} decode_s {[r['decode_s'] for r in v]}")


def main(argv: Optional[list] = None) -> dict:
    args = parse(argv)
    preflight()
    if args.dry_run:   # the CPU check everywhere (prepare and the trainer pick CUDA where they see it)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    rank, world, device, own_pg = join_torchrun(use_cuda=not args.dry_run)
    made = args.work_dir is None
    work = args.work_dir or (tempfile.mkdtemp(prefix="wan_short_run_") if rank == 0 else None)
    if world > 1:
        box = [work]
        dist.broadcast_object_list(box, src=0)
        work = box[0]
    os.makedirs(work, exist_ok=True)
    run = Run(args, rank, world, device, work, remove_work=made and not args.keep)
    run.doc["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")}
    run.say(f"work dir {work}, out {args.out}, SP={world}, device {device}")
    run.write()
    import training.train_wan_diffusers  # noqa: F401,PLC0415 - before the watchdog: a limit fires in a phase, not in
    # the imports (seconds on a busy machine); the phases' own imports of it are then free
    timer = run.watchdog()
    try:
        phases(run)
    except BaseException as e:
        run.doc["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        raise
    finally:
        if timer is not None:
            timer.cancel()
        run.doc["phase"] = None if "error" not in run.doc else run.doc["phase"]
        run.finish()
        if rank == 0:
            print(f"{TAG} {summary_line(run.doc)}", flush=True)
            print(f"{TAG} wrote {os.path.join(args.out, RESULT)}", flush=True)
        barrier_ok = world > 1 and "error" not in run.doc
        if barrier_ok:
            dist.barrier()
        run.cleanup()
        if own_pg and "error" not in run.doc:   # after an error a peer may still be in a collective: NCCL's
            dist.destroy_process_group()          # destroy would wait for it; the process's exit frees the group
    return run.doc


if __name__ == "__main__":
    sys.exit(run_entry(main, "wan_short_run"))
