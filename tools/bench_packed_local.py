"""The local work of one Ulysses rank around its exchanges: the plain core vs packed q|k|v, on ONE GPU.

What one rank of a P-way Ulysses group computes besides attention and the exchanges themselves (those
are the same in both paths), for the DiT's self-attention (fused QKV output y [1, T, 3*H*D] in, bf16):
  plain   QK-norm + RoPE of q and k (compiled, as the entry runs it), pack q|k|v into the send buffer,
          the received buffer copied into the kernel's layout (ulysses_attention's default); backward:
          the received dq|dk|dv unpacked into the local layout, then the QK-norm/RoPE backward.
  packed  one compiled function writes q|k|v into the send layout (sp/packed.py); the received buffer is
          read in place; backward: the compiled function's backward reads the received gradients as they are.
The received buffers are stood in by same-sized buffers (no exchange runs), so this needs no second GPU;
the send layout is the P-rank one (--world). Interleaved repetitions, median, CUDA events.

    python tools/bench_packed_local.py --heads 40 --head-dim 128 --tokens 8192 --world 4 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext.sp.ulysses import layout as lay  # noqa: E402
from megatron_sp_ext.sp.ulysses.packed import packed_head_layout  # noqa: E402
from tools.benchlib import interleaved_ms, write_json  # noqa: E402
from training.video_dit.fused import ElementwiseOps  # noqa: E402

_QKV = ("q", "kv", "kv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=8192, help="this rank's tokens (T = sequence / P)")
    ap.add_argument("--world", type=int, default=4, help="P: the send layout's number of ranks")
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="packed_local_out")
    args = ap.parse_args()
    h, d, t, p = args.heads, args.head_dim, args.tokens, args.world
    dev, dt = torch.device("cuda"), torch.bfloat16
    hl = packed_head_layout(h, h, p, args.chunks)
    ops = ElementwiseOps("inductor")
    g = torch.Generator(device=dev).manual_seed(0)
    y0 = torch.randn(1, t, 3 * h * d, device=dev, dtype=dt, generator=g)
    wq = 1 + 0.1 * torch.randn(h * d, device=dev, generator=g)
    wk = 1 + 0.1 * torch.randn(h * d, device=dev, generator=g)
    angles = torch.randn(t, d // 2, device=dev, dtype=torch.float64, generator=g)
    widths = [sum(lay.widths(hl, _QKV, 0, c)) for c in range(hl.chunks)]
    grads_in = [torch.randn(p * t * w * d, device=dev, dtype=dt, generator=g) for w in widths]

    def plain(backward: bool):
        y = y0.detach().requires_grad_(backward)
        q, k, v = y.chunk(3, dim=-1)
        q, k = ops.qk_prep(q, wq, 1e-6, angles, h), ops.qk_prep(k, wk, 1e-6, angles, h)
        v = v.reshape(1, t, h, d)
        for c, w in enumerate(widths):
            send = torch.empty(p * t * w * d, device=dev, dtype=dt)
            lay.pack((q, k, v), _QKV, hl, c, "bshd", send)
            recv = send  # stands in for the received buffer: copied into the kernel's layout
            for col in lay.columns_sbhd(recv.view(p * t, 1, w, d), lay.widths(hl, _QKV, 0, c)):
                lay.to_kernel_layout(col, None)
        if backward:
            dq, dk, dv = (torch.empty(1, t, h, d, device=dev, dtype=dt) for _ in range(3))
            for c in range(hl.chunks):
                lay.unpack(grads_in[c], (dq, dk, dv), _QKV, hl, c, "bshd")
            torch.autograd.backward((q, k, v), (dq, dk, dv))

    def packed(backward: bool):
        y = y0.detach().requires_grad_(backward)
        sends = ops.qkv_pack(hl)(y, wq, wk, 1e-6, 1e-6, angles, h)
        if backward:
            torch.autograd.backward(sends, [gi.view(s.shape) for gi, s in zip(grads_in, sends)])

    cases = {f"{name}_{kind}": (fn, kind == "fwd_bwd") for name, fn in (("plain", plain), ("packed", packed))
             for kind in ("fwd", "fwd_bwd")}
    for fn, bwd in cases.values():  # compile and warm up
        for _ in range(3):
            fn(bwd)
    med, = interleaved_ms([{name: (lambda fn=fn, bwd=bwd: fn(bwd)) for name, (fn, bwd) in cases.items()}], args.iters)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": h, "head_dim": d,
           "tokens": t, "world": p, "chunks": args.chunks, "median_ms": med,
           "speedup_fwd": med["plain_fwd"] / med["packed_fwd"],
           "speedup_fwd_bwd": med["plain_fwd_bwd"] / med["packed_fwd_bwd"]}
    print(json.dumps(res), flush=True)
    write_json(os.path.join(args.out, f"packed_local_H{h}_T{t}_P{p}_C{args.chunks}.json"), res)


if __name__ == "__main__":
    main()
