"""CUDA-suite worker: training/train_wan_diffusers.py's ``--fused-elementwise on`` (every Wan block compiled by
Inductor, our attention opaque to it) against ``off`` on one GPU: the tiny preset, LoRA rank 2, the attention kept
(``--recompute-granularity selective``), fp32 and ``--bf16``. Each run starts from a fresh Dynamo state and records
the graphs Dynamo compiled (a fused run that compiled none did not take the path under test)."""
from __future__ import annotations

import torch

BASE = ["--model", "tiny", "--frames", "4", "--latent-size", "8x8", "--quiet", "--lr", "1e-3", "--train-iters", "3",
        "--num-workers", "0", "--lora-rank", "2", "--recompute-granularity", "selective"]


def fused_trainer_runs(rank: int, world: int, data: str) -> dict:
    """{"fp32" | "bf16": {"off" | "on": {"losses", "params" (name -> float64 numpy array: tensors through the
    result queue would pass file descriptors), "graphs"}}}."""
    from torch._dynamo.utils import counters  # noqa: PLC0415
    from training import train_wan_diffusers as entry  # noqa: PLC0415
    out: dict = {}
    for form, extra in (("fp32", []), ("bf16", ["--bf16"])):
        out[form] = {}
        for choice in ("off", "on"):
            torch._dynamo.reset()
            counters.clear()
            res = entry.main([*BASE, *extra, "--data-path", data, "--fused-elementwise", choice], return_params=True)
            out[form][choice] = {"losses": list(res["losses"]), "graphs": int(counters["stats"]["unique_graphs"]),
                                 "params": {n: p.detach().double().cpu().numpy() for n, p in res["params"].items()}}
    return out
