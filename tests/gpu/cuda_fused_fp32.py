"""CUDA-suite worker: the DiT's compiled elementwise regions (--fused-elementwise) in fp32 at the shapes that broke
(issue #51 item 10: wan-1.3b dims, B=1, 21 frames of 30x52 latents = 8190 tokens, fp32: Triton's mix-order
reduction returned the [1, 1, d] AdaLN modulation gradients as [d]; training/video_dit/fused.py compile_options).

``fused_fp32_family(rank, world)`` (one GPU; ranks > 0 return nothing), family "fused_fp32", 2 records:
  1. the model (2 layers of wan-1.3b dims, random AdaLN modulation so every region counts), one forward and backward
     at B=1 in fp32, eager vs the Inductor-compiled regions: the output and every parameter gradient (norm-wise
     relative error, the worst parameter) within 1e-4;
  2. the DiT entry with the failing command's settings (wan-1.3b, 2 layers, --frames 21 --latent-size 30x52, fp32,
     SP=1, 3 steps, lr 1e-4) with --fused-elementwise on and off: every loss within 1e-4 relative.
Records as in tests/gpu/cuda_suite.py. SPX_SUITE_DEVICE=cpu runs both on the CPU with the tiny model and small clips
(a dry run of the control flow: Inductor's C++ code has no mix-order reduction).
"""
from __future__ import annotations

import os

import torch

from tests.reference import curve_err, rel_err
from tests.dit_models import modulated_dit
from training.video_dit import preset
from training.video_dit.data import SyntheticVideoLatents
from training.video_dit.engine import flow_matching_batch, local_loss, prepare

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
# (model, frames, latent H x W): the failing run's shapes on CUDA, small ones for the CPU dry run
SHAPES = ("wan-1.3b", 21, (30, 52)) if DEV == "cuda" else ("tiny", 4, (8, 8))
TOL = 1e-4


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")


def _model_case(device: torch.device) -> dict:
    name, frames, (h, w) = SHAPES
    cfg = preset(name, 2)
    data = SyntheticVideoLatents(cfg.in_channels, (frames,), h, w, cfg.text_len, cfg.text_dim, seed=1)
    inp = prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, cfg.patch), 0, 1, device)
    results = []
    for fused in (None, "inductor"):
        torch._dynamo.reset()
        model = modulated_dit(cfg, device=device)
        model.set_fused_elementwise(fused)
        loss = local_loss(model, inp)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    bad_shapes = [n for n in grads0 if grads0[n].shape != grads1[n].shape]
    assert not bad_shapes, bad_shapes
    worst = max(grads0, key=lambda n: rel_err(grads1[n], grads0[n]))
    return {"family": "fused_fp32", "case": f"{name} 2 layers, {frames}x{h}x{w} latents, B=1, fp32: model fwd+bwd, "
                                          f"compiled regions vs eager (worst grad: {worst})",
            "errs": {"loss": rel_err(loss1, loss0), "grad": rel_err(grads1[worst], grads0[worst])}, "tol": TOL}


def _entry_case() -> dict:
    from training import pretrain_video_dit  # noqa: PLC0415
    name, frames, (h, w) = SHAPES
    argv = ["--model", name, "--num-layers", "2", "--frames", str(frames), "--latent-size", f"{h}x{w}",
            "--train-iters", "3", "--lr", "1e-4", "--seed", "7", "--context-parallel-size", "1", "--quiet",
            "--ddp-impl", "torch", "--num-workers", "0"]  # the suite's ranks are daemons: no DataLoader workers
    losses = {}
    for fused in ("off", "on"):
        torch._dynamo.reset()
        losses[fused] = pretrain_video_dit.main(argv + ["--fused-elementwise", fused])["losses"]
    assert len(losses["on"]) == len(losses["off"]) == 3, losses
    return {"family": "fused_fp32", "case": f"DiT entry {name} 2 layers, --frames {frames} --latent-size {h}x{w}, "
                                          f"fp32, 3 steps: --fused-elementwise on vs off",
            "errs": {"loss": curve_err(losses["on"], losses["off"])}, "tol": TOL}


def fused_fp32_family(rank: int, world: int) -> list:
    if rank != 0:
        return []
    return [_model_case(_device()), _entry_case()]
