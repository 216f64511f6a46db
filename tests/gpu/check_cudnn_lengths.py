"""Which sequence lengths cuDNN's attention (torch SDPA, cuDNN backend: what the "cudnn" kernel runs) gets right in
bf16, forward and backward, against fp32 math; each case in its own process (an illegal memory access ends the
process's CUDA context, not the check).

    python tests/gpu/check_cudnn_lengths.py --out DIR [--lengths 8,16,...] [--head-dims 64,128]

Why: the DiT's packed step on cuDNN (samples of 8-90 tokens, head dim 8 on an H100 and 64 on an H200) gave
non-finite bf16 gradients at SP=1, and a batch of 20 samples of 1,560 tokens (H=5, head dim 128) failed cuDNN's
graph and then an illegal memory access (2026-11-25). Writes DIR/cudnn_lengths.jsonl as cases end and
DIR/cudnn_lengths.json at the end: per case the relative errors of out, dq, dk, dv, "non-finite", or the error raised.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def one_case(b: int, h: int, s: int, d: int, contiguous: bool, seq_major: bool = False, do_exp: int = 0) -> dict:
    """One case: q/k/v [b, h, s, d] bf16 as strided per-sample views of a packed head-major [b, h, S, d] tensor, or
    (``seq_major``) of a [b, S, h, d] one as the DiT's q.transpose(1, 2) is; ``contiguous``: copied first; the
    incoming gradient scaled by 10^``do_exp`` (a small loss gives small dO: cuDNN bug reports name tiny dO)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(b, h, s + 8, d, device="cuda", generator=g, dtype=torch.bfloat16)
    if seq_major:
        base = [torch.randn(b, s + 8, h, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(3)]
    else:
        base = [torch.randn(b, h, s + 8, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]
    q, k, v = (t[:, :, 4:4 + s] for t in base)        # strided views of a packed tensor, as per-sample slices are
    if contiguous:
        q, k, v = (t.contiguous() for t in (q, k, v))
    do = (big[:, :, :s].float() * 10.0 ** do_exp).to(torch.bfloat16).contiguous()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        of = F.scaled_dot_product_attention(qf, kf, vf)
    refs = torch.autograd.grad(of, (qf, kf, vf), do.float())
    torch.cuda.synchronize()
    rec = {}
    for name, a, r in (("out", o, of), ("dq", grads[0], refs[0]), ("dk", grads[1], refs[1]), ("dv", grads[2], refs[2])):
        a = a.float()
        rec[name] = float((a - r).norm() / r.norm().clamp_min(1e-30)) if bool(torch.isfinite(a).all()) else "non-finite"
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="8,16,45,64,90,128,320,1560")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--small-do", action="store_true", help="the DiT pack's lengths, seq-major and head-major views, "
                    "dO scaled by 1, 1e-6, 1e-8, 1e-10")
    ap.add_argument("--in-process", action="store_true", help="every case in this process (fast; a crash ends all)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        b, h, s, d, c, sm, e = (int(x) for x in args.case.split(","))
        try:
            print(json.dumps(one_case(b, h, s, d, bool(c), bool(sm), e)))
        except Exception as e:  # noqa: BLE001 - reported as the case's result
            print(json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}))
        return
    if args.small_do:   # the dit_dynamic pack's samples (8-90 tokens, head dim 64) as the DiT lays them out, dO small
        cases = [(1, 8, s, 64, 0, sm, e) for e in (0, -6, -8, -10) for sm in (1, 0) for s in (8, 16, 24, 45, 64, 90)]
    else:
        cases = [(1, 8, s, d, 0, 0, 0) for d in map(int, args.head_dims.split(","))
                 for s in map(int, args.lengths.split(","))]
        cases += [(1, 8, s, 64, 1, 0, 0) for s in (8, 45, 90)]   # the same lengths contiguous: is it the view?
        cases += [(20, 5, 1560, 128, 1, 0, 0), (20, 5, 1560, 128, 0, 0, 0),
                  (4, 5, 8190, 128, 1, 0, 0)]   # the grouped packs of the bench
    res = []
    os.makedirs(args.out, exist_ok=True)
    partial = open(os.path.join(args.out, "cudnn_lengths.jsonl"), "w")   # each case as it ends (a cut run keeps them)
    for b, h, s, d, c, sm, e in cases:
        t0 = time.time()
        if args.in_process:
            try:
                rec = one_case(b, h, s, d, bool(c), bool(sm), e)
            except Exception as err:  # noqa: BLE001 - reported as the case's result
                rec = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        else:
            p = subprocess.run([sys.executable, __file__, "--out", args.out, "--case", f"{b},{h},{s},{d},{c},{sm},{e}"],
                               capture_output=True, text=True, timeout=120)
            line = (p.stdout.strip().splitlines() or [""])[-1]
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = {"error": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}
        rec.update(batch=b, heads=h, seqlen=s, head_dim=d, contiguous=bool(c), seq_major=bool(sm), do_scale=10.0 ** e,
                   seconds=round(time.time() - t0, 1))
        print(json.dumps(rec), flush=True)
        partial.write(json.dumps(rec) + "\n")
        partial.flush()
        res.append(rec)
    partial.close()
    import torch  # noqa: PLC0415
    with open(os.path.join(args.out, "cudnn_lengths.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"), "cases": res}, f,
                  indent=1)


if __name__ == "__main__":
    main()
