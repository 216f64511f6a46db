"""CUDA-suite worker: the local attention of packed samples (attention/varlen.py) by every method that runs.

``varlen_local_family(rank, world)`` (one GPU; ranks > 0 return nothing): q/k/v [1, H, S, D] as bhsd views of
[S, H, D]-contiguous memory (what the Ulysses exchange leaves) over packed samples of lengths 300, 128, 128, 128,
77, 3 (an adjacent equal-length run, odd lengths, a three-token sample) and 640, 200, 33; bf16 and fp16, causal and
not, 8 q heads on 2 kv heads (GQA) and 5 on 5; each method of ``varlen.methods_here`` (per_sample, grouped, and
flash_varlen where its probe passed) plus what "auto" picks: out, lse, dq, dk, dv against a float64 per-sample
reference computed on the device (packed_reference builds its mask there). Family "varlen_local": 16
configurations x (per_sample, grouped, flash_varlen where its probe passed, auto) = 64 records if flash_varlen's
probe passes, 48 if not.
Records as in tests/gpu/cuda_suite.py; SPX_SUITE_DEVICE=cpu runs per_sample / grouped / auto (= per_sample) on the
CPU at 1/SPX_SUITE_SHRINK of the lengths.
"""
from __future__ import annotations

import os

import torch

from megatron_sp_ext.attention import varlen
from megatron_sp_ext.attention.backends import get_backend
from tests.reference import TOL, rel_err
from tests.test_varlen_local import packed_reference

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
SHRINK = int(os.environ.get("SPX_SUITE_SHRINK", "1"))
LENGTHS = ([300, 128, 128, 128, 77, 3], [640, 200, 33])


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")


def varlen_local_family(rank: int, world: int) -> list:
    if rank != 0:
        return []
    dev, rec = _device(), []
    be = get_backend("auto")
    chooser = varlen.VarlenChooser()
    for dtype in (torch.bfloat16, torch.float16):
        for lengths in LENGTHS:
            lengths = [max(1, n // SHRINK) for n in lengths]
            cu = tuple([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
            s = cu[-1]
            for h, hkv in ((8, 2), (5, 5)):
                for causal in (False, True):
                    g = torch.Generator().manual_seed(len(rec))
                    q, k, v, do = (torch.randn(1, s, n, 64, generator=g, dtype=torch.float64).to(dev, dtype)
                                   .transpose(1, 2) for n in (h, hkv, hkv, h))
                    scale = 64 ** -0.5
                    ref = packed_reference(q, k, v, do, cu, causal, scale)  # on q's device
                    here = varlen.methods_here(be, q)
                    auto = chooser.method_for("auto", be, q, k, v, cu, causal=causal, scale=scale, need_grad=True)
                    for method in here + ["auto"]:
                        m = auto if method == "auto" else method
                        out, lse = varlen.forward_lse(m, be, q, k, v, cu, causal=causal, scale=scale)
                        grads = varlen.backward_lse(m, be, do, q, k, v, out, lse, cu, causal=causal, scale=scale)
                        errs = {n: rel_err(a, b) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"),
                                                                    [out, lse, *grads], ref)}
                        name = f"auto={auto}" if method == "auto" else method
                        rec.append({"family": "varlen_local",
                                    "case": f"{name} {dtype} causal={causal} lengths={lengths} h={h}/{hkv} d=64",
                                    "errs": errs, "tol": TOL[dtype]})
    return rec
