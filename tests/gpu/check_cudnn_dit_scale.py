"""Does cuDNN's bf16 attention backward go non-finite on SMALL incoming gradients? The CUDA suite's dit_dynamic
pack at SP=1 (tests/gpu/cuda_dit_dynamic.py: the tiny DiT, 7 packed samples of 8-90 tokens, head dim 64, loss ~3e-4) gave
non-finite bf16 gradients on cuDNN (H100 and H200, 2026-11-25/26; the first non-finite module in backward: a block's
self-attention), while isolated cuDNN calls of those lengths with unit-scale dO were right. This runs that step with
the loss multiplied by 1, 1e2, 1e4, 1e6 (the gradients divided back) on cuDNN and on "auto", against SP=1 fp32.

    python tests/gpu/check_cudnn_dit_scale.py --out DIR          (one GPU; writes DIR/cudnn_dit_scale.json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.gpu import cuda_dit_dynamic as worker  # noqa: E402
from tests.gpu.cuda_dit_sparse import normwise  # noqa: E402
from training.video_dit.engine import make_core  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", default="cudnn,auto")
    ap.add_argument("--scales", default="1,1e2,1e4,1e6")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the flow (kernels math / auto)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    core = lambda kernel: make_core("ulysses", None, num_heads=worker.CFG.heads, backend=kernel)  # noqa: E731
    ref_loss, ref_grads = worker.dit_step(core("auto"), None, 0, 1, dev, None)
    real = worker.local_loss
    rows = []
    for kernel in args.kernels.split(","):
        for scale in (float(s) for s in args.scales.split(",")):
            worker.local_loss = lambda *a, s=scale: real(*a) * s
            try:
                loss, grads = worker.dit_step(core(kernel), None, 0, 1, dev, torch.bfloat16)
            finally:
                worker.local_loss = real
            grads = [g / scale for g in grads]
            bad = [i for i, g in enumerate(grads) if not bool(torch.isfinite(g).all())]
            row = {"kernel": kernel, "loss_scale": scale, "loss": float(loss) / scale, "ref_loss": float(ref_loss),
                   "non_finite_params": len(bad), "grads_normwise_err": None if bad else normwise(grads, ref_grads)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cudnn_dit_scale.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                   "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
