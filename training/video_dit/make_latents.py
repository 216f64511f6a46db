r"""Write a directory of latent shards for training/video_dit (one sample per file).

Format: each file holds "latent" [C, T, H, W] float32 and "text" [L, D_text] float32 (see
training/video_dit/data.py). This tool writes the synthetic generator's samples; replace the
generator with your VAE/text-encoder outputs to train on real data.
    python -m training.video_dit.make_latents --out data/latents --num 64 --channels 4 --frames 4,5 --size 6x10 \
        --text-len 8 --text-dim 32 --format safetensors
"""
from __future__ import annotations

import argparse
import os

from training.video_dit.data import SyntheticVideoLatents, write_sample


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--frames", default="4")
    ap.add_argument("--size", default="8x8", help="latent HxW")
    ap.add_argument("--text-len", type=int, default=8)
    ap.add_argument("--text-dim", type=int, default=32)
    ap.add_argument("--format", choices=["pt", "safetensors"], default="pt")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    h, w = (int(x) for x in args.size.lower().split("x"))
    src = SyntheticVideoLatents(args.channels, [int(f) for f in args.frames.split(",")], h, w, args.text_len,
                                args.text_dim, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    for i in range(args.num):
        s = src[i]
        write_sample(os.path.join(args.out, f"sample_{i:06d}.{args.format}"), s["latent"], s["text"], args.format)
    print(f"wrote {args.num} samples to {args.out}")


if __name__ == "__main__":
    main()
