r"""Videos + captions -> the Wan trainer's latent files (VAE latents, umT5 text embeddings; I2V conditions).

    python -m training.wan_diffusers.prepare --pipeline Wan2.1-T2V-1.3B-Diffusers --input videos/ --output data/ \
        --frames 81,49 --buckets 480x832,832x480,624x624
    torchrun --nproc-per-node 8 -m training.wan_diffusers.prepare ...      # rank r takes every 8th video
    python -m training.wan_diffusers.prepare ... --shard 3/16              # or one process per share, anywhere
    python -m training.wan_diffusers.prepare --pipeline ... --output data/ --prompts prompts.txt   # validation

Output (the data contract of the trainer, format "wan-latents-v1"): one ``<name>.safetensors`` per video holding
"latent" float32 [C, F', h, w] (normalized as WanPipeline does), "text" float32 [L, D] (WanPipeline.encode_prompt),
with --i2v "cond_latent" [C, F', h, w] (the first frame + zero frames, as WanImageToVideoPipeline builds it) and,
where the pipeline has a CLIP image encoder (Wan 2.1 I2V), "image_embeds" [N, D]; string metadata caption, source,
frames, height, width, vae, format. ``index.jsonl``: one line per file. ``prepare.json``: the settings (a resumed
run must use the same). ``skipped.jsonl``: inputs --skip-bad-inputs left out, with the reason.

Resumable: a video whose source is in the index and whose file exists is not encoded again. Sharded: the sorted
inputs are dealt round-robin over torchrun's ranks x --shard's n shares; each writes ``index.part-K.jsonl`` as it
goes and, at its end, merges every part into ``index.jsonl`` under a file lock (the last to finish writes the whole
index; no rank waits on another). Videos are decoded and resized in DataLoader workers (--num-workers) while the
VAE encodes. bfloat16 on CUDA, float32 on CPU (--dtype). Bad input (unreadable video, too few frames for the
smallest --frames bucket, no caption) stops the job naming the file, or with --skip-bad-inputs is listed in
skipped.jsonl.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_sp_ext.errors import SPConfigError

from training.video_dit.logs import add_log_level_arg, setup_logging
from training.wan_diffusers import encoders as E
from training.wan_diffusers import media

logger = logging.getLogger("video_dit")
WHAT = "prepare"
FORMAT, PROMPTS_FORMAT = E.LATENTS_FORMAT, E.PROMPTS_FORMAT
INDEX, SETTINGS, SKIPPED, LOCK = "index.jsonl", "prepare.json", "skipped.jsonl", ".prepare.lock"
PART = re.compile(r"index\.part-\d+\.jsonl$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Share:
    """This process's share of the inputs: index ``k`` of ``count`` (torchrun rank x --shard), and whether it
    shows the progress bar."""

    k: int
    count: int
    show: bool


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.wan_diffusers.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline", required=True, metavar="DIR",
                   help="local Wan pipeline directory in diffusers' layout (vae/, text_encoder/, tokenizer/; "
                        "image_encoder/ + image_processor/ for Wan 2.1 I2V)")
    p.add_argument("--output", required=True, metavar="DIR", help="where the latent files and index.jsonl go")
    p.add_argument("--input", default=None, metavar="DIR",
                   help="folder of videos (.mp4 .webm .mov .mkv .avi) and/or folders of image frames, each with "
                        "<name>.txt (its caption) beside it")
    p.add_argument("--captions", default=None, metavar="FILE",
                   help="instead of the .txt files: a .jsonl ({\"path\": ..., \"caption\": ...} per line) or .csv "
                        "(header path,caption) listing the videos to prepare, paths relative to --input")
    p.add_argument("--frames", default="81",
                   help="frame-count buckets, comma list of 4n+1 (default 81); each video gets the largest it has")
    p.add_argument("--buckets", default="480x832",
                   help="(H, W) pixel buckets, comma list of HxW (default 480x832); each video the nearest by aspect "
                        "ratio, resized to cover it and center-cropped")
    p.add_argument("--frame-stride", type=int, default=1, help="take every N-th frame (e.g. 2: 30 fps -> 15 fps)")
    p.add_argument("--i2v", action="store_true",
                   help="also the first-frame condition (cond_latent) and, where the pipeline has an image encoder, "
                        "its CLIP embedding (image_embeds)")
    p.add_argument("--max-sequence-length", type=int, default=512, help="umT5 tokens per caption (Wan: 512)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="VAE and umT5 compute dtype (auto: bfloat16 on CUDA, float32 on CPU); latents are stored "
                        "float32")
    p.add_argument("--vae-tiling", action="store_true", help="diffusers' tiled VAE encode (less memory, 720p+)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="prepare share I of N (0 <= I < N) of the inputs (combines with torchrun's ranks)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader processes decoding videos (default on CUDA: half of this rank's share of the CPUs, "
                        "2 to 8, as the trainer's; 0 on CPU)")
    p.add_argument("--skip-bad-inputs", action="store_true",
                   help="skip unreadable / too short / uncaptioned inputs (listed in skipped.jsonl) instead of "
                        "stopping at the first")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="also encode these validation prompts (one per line) into --prompts-out for the trainer's "
                        "--validation-prompts")
    p.add_argument("--prompts-out", default=None, metavar="FILE",
                   help="where --prompts go (default: <output>/validation/prompts.safetensors)")
    p.add_argument("--negative-prompt", default="", help="the negative prompt stored beside --prompts (default '')")
    add_log_level_arg(p)
    return p


def parse_share(text: Optional[str], rank: int, world: int) -> Share:
    """torchrun's rank / world x --shard I/N -> Share (k = I * world + rank of N * world)."""
    i, n = 0, 1
    if text is not None:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not m or not int(m.group(1)) < int(m.group(2)):
            raise SPConfigError(f"--shard {text!r}: expected I/N with 0 <= I < N (e.g. 0/4)")
        i, n = int(m.group(1)), int(m.group(2))
    return Share(i * world + rank, n * world, rank == 0)


def sample_name(source: str) -> str:
    """A file name for ``source``: its path made safe (80 characters at most) + 10 hex of its SHA-1."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", source).strip("._")[:80] or "video"
    return f"{safe}-{hashlib.sha1(source.encode()).hexdigest()[:10]}.safetensors"


def read_jsonl(path: str) -> list:
    """Rows of a JSON-lines file (a line cut short by a writer still running is skipped)."""
    rows = []
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    return rows


def _parts(out: str) -> list:
    return sorted(os.path.join(out, f) for f in os.listdir(out) if PART.match(f))


def done_sources(out: str) -> set:
    """Sources already prepared: in index.jsonl or a part, and their file present."""
    rows = read_jsonl(os.path.join(out, INDEX)) + [r for p in _parts(out) for r in read_jsonl(p)]
    return {r["source"] for r in rows if "file" in r and os.path.isfile(os.path.join(out, r["file"]))}


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def merge_index(out: str, own_parts: list) -> int:
    """Under the output's lock: index.jsonl = every prepared row (index.jsonl's and every part's, one per source,
    its file present), sorted by source; skipped.jsonl likewise for the inputs left out (not since prepared); then
    ``own_parts`` (this process's, finished) are removed. Returns the number of samples in the index."""
    with open(os.path.join(out, LOCK), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        samples, skipped = {}, {}
        for path in [os.path.join(out, INDEX), os.path.join(out, SKIPPED)] + _parts(out):
            for r in read_jsonl(path):
                if "file" in r:
                    if os.path.isfile(os.path.join(out, r["file"])):
                        samples[r["source"]] = r
                elif "skipped" in r:
                    skipped[r["source"]] = r
        skipped = {s: r for s, r in skipped.items() if s not in samples}
        _write_atomic(os.path.join(out, INDEX), "".join(json.dumps(samples[s]) + "\n" for s in sorted(samples)))
        if skipped or os.path.isfile(os.path.join(out, SKIPPED)):
            _write_atomic(os.path.join(out, SKIPPED), "".join(json.dumps(skipped[s]) + "\n" for s in sorted(skipped)))
        for p in own_parts:
            if os.path.isfile(p):
                os.remove(p)
        fcntl.flock(lock, fcntl.LOCK_UN)
    return len(samples)


def check_settings(out: str, settings: dict) -> None:
    """prepare.json: written on the first run; a resumed run's settings must equal it (SPConfigError naming the
    differing keys otherwise: the files would mix two encodings)."""
    path = os.path.join(out, SETTINGS)
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            what = "; ".join(f"{k}: {old.get(k)!r} then, {settings.get(k)!r} now" for k in diff)
            raise SPConfigError(f"--output {out} was prepared with other settings ({what}): use a new --output, or "
                                f"the same settings to resume")
        return
    _write_atomic(path, json.dumps(settings, indent=2) + "\n")


class ClipReader(torch.utils.data.Dataset):
    """Items -> {"i", "frames": uint8 [F, H, W, 3]} or {"i", "error": message} (read in DataLoader workers)."""

    def __init__(self, items: list, buckets: media.Buckets, stride: int) -> None:
        self.items, self.buckets, self.stride = items, buckets, stride

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        try:
            clip = media.read_clip(self.items[i], self.buckets, self.stride)
        except media.VideoInputError as e:
            return {"i": i, "error": str(e)}
        return {"i": i, "frames": torch.from_numpy(clip.frames_fhwc)}


def encode_sample(enc: E.WanEncoders, item: media.VideoItem, frames_fhwc: torch.Tensor, text_cache: dict) -> tuple:
    """(tensors, metadata, index row without "file") of one clip."""
    if item.caption not in text_cache:
        text_cache.clear()   # consecutive videos often share a caption; no unbounded cache
        text_cache[item.caption] = enc.text(item.caption)
    text, n_tokens = text_cache[item.caption]
    tensors = {"latent": enc.latent(frames_fhwc), "text": text}
    if enc.settings.i2v:
        tensors["cond_latent"] = enc.cond_latent(frames_fhwc)
        if enc.image_encoder is not None:
            tensors["image_embeds"] = enc.image_embeds(frames_fhwc[0].numpy())
    f, h, w = frames_fhwc.shape[:3]
    meta = {"caption": item.caption, "source": item.source, "frames": str(f), "height": str(h), "width": str(w),
            "vae": E.vae_identity(enc.vae_cfg), "format": FORMAT, "text_tokens": str(n_tokens)}
    row = {"source": item.source, "caption": item.caption, "latent_shape": list(tensors["latent"].shape),
           "text_len": int(text.shape[0]), "text_tokens": n_tokens, "has_cond": "cond_latent" in tensors,
           "has_image_embeds": "image_embeds" in tensors, "frames": f, "height": h, "width": w}
    return tensors, meta, row


def write_sample(out: str, name: str, tensors: dict, meta: dict) -> None:
    """``out``/``name`` written whole or not at all (a temporary name, then renamed)."""
    from safetensors.torch import save_file  # noqa: PLC0415
    tmp = os.path.join(out, f".{name}.tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
    os.replace(tmp, os.path.join(out, name))


def prepare_videos(enc: E.WanEncoders, items: list, out: str, share: Share, opts: argparse.Namespace) -> dict:
    """Encode this share's pending ``items`` into ``out``; returns {"written", "skipped", "seconds", "index"}.
    ``opts``: the parsed flags (buckets, frame_stride, num_workers, skip_bad_inputs)."""
    from tqdm import tqdm  # noqa: PLC0415
    done = done_sources(out)
    mine = [it for it in items[share.k::share.count] if it.source not in done]
    part = os.path.join(out, f"index.part-{share.k:05d}.jsonl")
    from training.video_dit.loop import resolve_workers  # noqa: PLC0415
    workers = resolve_workers(opts, enc.settings.device)
    loader = torch.utils.data.DataLoader(ClipReader(mine, opts.buckets, opts.frame_stride), batch_size=None,
                                         num_workers=workers, shuffle=False)
    written, skipped, cache, t0 = 0, 0, {}, time.perf_counter()
    bar = tqdm(total=len(mine), desc=f"prepare {share.k}/{share.count}", disable=not share.show, dynamic_ncols=True)
    with bar, open(part, "a", encoding="utf-8") as index:
        for r in loader:
            item = mine[int(r["i"])]
            if "error" in r:
                if not opts.skip_bad_inputs:
                    raise media.VideoInputError(r["error"])
                logger.warning(f"skipped: {r['error']}")
                index.write(json.dumps({"source": item.source, "skipped": r["error"]}) + "\n")
                skipped += 1
            else:
                tensors, meta, row = encode_sample(enc, item, r["frames"], cache)
                name = sample_name(item.source)
                write_sample(out, name, tensors, meta)
                index.write(json.dumps({"file": name, **row}) + "\n")
                written += 1
            index.flush()
            bar.update(1)
    seconds = time.perf_counter() - t0
    total = merge_index(out, [part])
    return {"written": written, "skipped": skipped, "already": len(items[share.k::share.count]) - len(mine),
            "seconds": seconds, "index": total}


def read_prompts(path: str) -> list:
    """Non-empty lines of ``path`` (--prompts)."""
    if not os.path.isfile(path):
        raise SPConfigError(f"--prompts {path}: no such file (one prompt per line)")
    with open(path, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise SPConfigError(f"--prompts {path}: no prompts in it (one per line)")
    return prompts


def write_prompts(enc: E.WanEncoders, prompts: list, negative: str, path: str) -> str:
    """The validation prompts file: "prompt_embeds" float32 [N, L, D], "negative_embeds" [1, L, D]; metadata
    prompts (a JSON list), negative_prompt, pipeline (absolute), vae, max_sequence_length, format."""
    from safetensors.torch import save_file  # noqa: PLC0415
    embeds = torch.stack([enc.text(p)[0] for p in prompts])
    neg = enc.text(negative)[0][None]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {"prompts": json.dumps(prompts), "negative_prompt": negative, "format": PROMPTS_FORMAT,
            "pipeline": os.path.abspath(enc.settings.pipeline), "vae": E.vae_identity(enc.vae_cfg),
            "max_sequence_length": str(enc.settings.max_sequence_length)}
    save_file({"prompt_embeds": embeds.contiguous(), "negative_embeds": neg.contiguous()}, path, metadata=meta)
    return path


def settings_record(args: argparse.Namespace, enc: E.WanEncoders) -> dict:
    """What changes the files' contents (prepare.json)."""
    return {"format": FORMAT, "pipeline": os.path.abspath(args.pipeline), "vae": E.vae_identity(enc.vae_cfg),
            "frames": list(args.buckets.frames), "buckets": [list(s) for s in args.buckets.sizes],
            "frame_stride": args.frame_stride, "i2v": args.i2v, "max_sequence_length": args.max_sequence_length,
            "dtype": str(enc.settings.dtype).replace("torch.", ""), "vae_tiling": args.vae_tiling,
            "image_encoder": enc.image_encoder is not None}


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.input is None and args.prompts is None:
        p.error("give --input DIR (videos to prepare) and/or --prompts FILE (validation prompts)")
    if args.captions is not None and args.input is None:
        p.error("--captions lists videos relative to --input: give --input too")
    for flag, n, least in (("--frame-stride", args.frame_stride, 1), ("--max-sequence-length",
                                                                     args.max_sequence_length, 1),
                           ("--num-workers", args.num_workers if args.num_workers is not None else 0, 0)):
        if n < least:
            p.error(f"{flag}={n}: must be >= {least}")
    try:
        args.buckets = media.Buckets(tuple(sorted(set(media.parse_counts(args.frames, "--frames")))),
                                     media.parse_sizes(args.buckets))
    except media.VideoInputError as e:
        p.error(str(e))
    try:
        parse_share(args.shard, 0, 1)
    except SPConfigError as e:
        p.error(str(e))
    if args.prompts_out is not None and not args.prompts_out.endswith(".safetensors"):
        p.error(f"--prompts-out {args.prompts_out}: must end with .safetensors")
    return args


def run(args: argparse.Namespace, rank: int = 0, world: int = 1, enc: Optional[E.WanEncoders] = None) -> dict:
    """Prepare (this process's share); returns the summary. ``enc``: ready encoders (the benchmark's), else loaded
    from --pipeline."""
    from training.video_dit.cli import pick_device  # noqa: PLC0415
    share = parse_share(args.shard, rank, world)
    device = pick_device()
    dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = E.vae_config(args.pipeline)
    items = None
    if args.input is not None:   # the inputs' problems before the encoders load
        media.check_buckets(args.buckets, int(cfg.get("scale_factor_temporal", 4)),
                            E.spatial_multiple(args.pipeline, cfg))
        items = media.discover(args.input, args.captions)
    if enc is None:
        enc = E.load_encoders(E.EncoderSettings(args.pipeline, device, dtype, i2v=args.i2v, text=True,
                                                video=args.input is not None,
                                                max_sequence_length=args.max_sequence_length,
                                                vae_tiling=args.vae_tiling))
    summary: dict = {"share": f"{share.k}/{share.count}", "device": str(device), "dtype": str(dtype)}
    if args.prompts is not None and share.k == 0:
        path = args.prompts_out or os.path.join(args.output, "validation", "prompts.safetensors")
        prompts = read_prompts(args.prompts)
        summary["prompts"] = write_prompts(enc, prompts, args.negative_prompt, path)
        logger.info(f"wrote {len(prompts)} validation prompt embeddings to {path}")
    if items is not None:
        os.makedirs(args.output, exist_ok=True)
        check_settings(args.output, settings_record(args, enc))
        summary.update(prepare_videos(enc, items, args.output, share, args))
        logger.info(f"share {share.k}/{share.count}: {summary['written']} written, {summary['already']} already "
                    f"there, {summary['skipped']} skipped in {summary['seconds']:.1f}s; {args.output}/{INDEX} lists "
                    f"{summary['index']}")
    return summary


def main(argv: Optional[list] = None) -> dict:
    args = parse(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    setup_logging(args.log_level, rank)
    return run(args, rank, world)


def run_command(argv: Optional[list] = None) -> int:
    """The command: a bad input or setting ends it with one line naming it (on the rank that met it) and status 1;
    SPX_TRACEBACK=1 shows the traceback too."""
    from megatron_sp_ext.elastic_error import record_user_error  # noqa: PLC0415
    from megatron_sp_ext.errors import UserError  # noqa: PLC0415
    from training.video_dit.faults import wants_tracebacks  # noqa: PLC0415
    try:
        main(argv)
    except UserError as e:
        if wants_tracebacks(argv):
            import traceback  # noqa: PLC0415
            traceback.print_exc()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        line = f"[{WHAT}{' rank ' + os.environ.get('RANK', '0') if world > 1 else ''}] error: {e}"
        print(line, file=sys.stderr, flush=True)
        record_user_error(line)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_command())
