"""The Ulysses layouts' copies as 8-byte words against plain value copies, on one GPU (#68: the copies around the
exchanges were 2.5 ms of the 5.9 ms gap between plain Ulysses and the FA4 floor at 32K, P=2, H=40, 2 x H200,
2026-11-28, run by torch's strided copy kernel at 1.4-1.6 TB/s read+write).

For one row's shapes (L tokens, H heads, D, P ranks, bf16) it times, CUDA events, median of --iters:
  pack        this rank's [1, L/P, H, D] q split per peer into the send buffer [P, L/P, 1, H/P, D] (layout.pack)
  to_kernel   a received [L, 1, 3H/P, D] q|k|v buffer's q columns into the kernel's [1, L, H/P, D] (to_kernel_layout)
  zigzag      the same with the causal zigzag's piece permutation (index_copy, to_kernel_layout with an order)
each as ``copy_`` of the values and as ``layout.copy_bits`` / ``index_copy_bits`` (words), timed alternately after 5
warm-up calls of each, checks the two outputs
bit for bit, and reports ms and GB/s (bytes read + written). One JSON file.

    python tools/bench_word_copies.py --out $OUT                  (L 32768, H 40, D 128, P 2)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext.sp.ulysses.layout import copy_bits, index_copy_bits  # noqa: E402


def _event_ms(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def _pair_ms(plain, words, iters: int, warmup: int = 5) -> tuple:
    """Medians of ``plain`` and ``words`` timed alternately (clock ramps and drift hit both alike)."""
    for _ in range(warmup):
        plain()
        words()
    t_p, t_w = [], []
    for i in range(iters):
        for fn, ts in ((plain, t_p), (words, t_w)) if i % 2 == 0 else ((words, t_w), (plain, t_p)):
            ts.append(_event_ms(fn))
    return statistics.median(t_p), statistics.median(t_w)


def cases(seqlen: int, heads: int, d: int, world: int, device: str = "cuda"):
    """(name, bytes moved one way, plain fn, words fn, plain dst, words dst) per copy of the row."""
    s_loc, h = seqlen // world, heads // world
    q = torch.randn(1, s_loc, heads, d, device=device, dtype=torch.bfloat16)
    src_pack = q.view(1, s_loc, world, h, d).permute(2, 1, 0, 3, 4)
    recv = torch.randn(seqlen, 1, 3 * h, d, device=device, dtype=torch.bfloat16)
    src_k = recv[:, :, :h].transpose(0, 1)
    n = 2 * world
    to_global = torch.tensor([p if j == 0 else n - 1 - p for p in range(world) for j in (0, 1)],
                             device=device)   # the zigzag's pieces: rank p holds pieces p and 2P-1-p
    src_z = recv[:, :, :h].view(n, seqlen // n, 1, h, d).permute(2, 0, 1, 3, 4)
    out = []
    for name, src, shape in (("pack", src_pack, (world, s_loc, 1, h, d)), ("to_kernel", src_k, (1, seqlen, h, d))):
        a, b = (torch.empty(shape, device=device, dtype=torch.bfloat16) for _ in range(2))
        out.append((name, src.numel() * 2, lambda a=a, s=src: a.copy_(s), lambda b=b, s=src: copy_bits(b, s), a, b))
    za, zb = (torch.empty(1, n, seqlen // n, h, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    out.append(("zigzag", src_z.numel() * 2, lambda: za.index_copy_(1, to_global, src_z),
                lambda: index_copy_bits(zb, 1, to_global, src_z), za, zb))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_word_copies_out"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_word_copies: needs a CUDA GPU (the word copies are the GPU path; CPU keeps value copies)")
    rows = []
    for name, nbytes, plain, words, a, b in cases(args.seqlen, args.heads, args.head_dim, args.world):
        t_plain, t_words = _pair_ms(plain, words, args.iters)
        same = bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
        rows.append({"copy": name, "mb": nbytes / 1e6, "plain_ms": t_plain, "words_ms": t_words,
                     "plain_tb_s": 2 * nbytes / t_plain / 1e9, "words_tb_s": 2 * nbytes / t_words / 1e9,
                     "speedup": t_plain / t_words, "bit_identical": same})
        print(f"{name:10s} {nbytes / 1e6:7.1f} MB  values {t_plain:.3f} ms ({rows[-1]['plain_tb_s']:.2f} TB/s)  "
              f"words {t_words:.3f} ms ({rows[-1]['words_tb_s']:.2f} TB/s)  {t_plain / t_words:.2f}x  "
              f"bit-identical {same}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    doc = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "argv": sys.argv[1:]}, "rows": rows}
    with open(os.path.join(args.out, "bench_word_copies.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if not all(r["bit_identical"] for r in rows):
        raise SystemExit("bench_word_copies: a word copy differs from the value copy")


if __name__ == "__main__":
    main()
