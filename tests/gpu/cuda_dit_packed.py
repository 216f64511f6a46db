"""CUDA-suite worker: the video DiT on packed mixed-size samples (--pack-samples) against one-at-a-time runs.

``dit_packed_family(rank, world)``: the tiny DiT (fp32, random AdaLN modulation so every block counts) takes one
packed step of three clips of different frame counts and latent sizes (B=1, cu_seqlens; Ulysses / HCMS over all
``world`` ranks, the sequence sharded per sample) and each clip alone at SP=1 (plain path); the packed loss and
every parameter gradient (summed / averaged over the SP ranks) must equal the average over the clips. Cases:
ulysses and hcms C=2, eager and with the compiled elementwise regions (inductor on CUDA, aot_eager on the CPU dry
run), and ulysses on clips whose token counts divide by neither 2 nor 4 (padded per sample): 6 records, family
"dit_packed". Records as in tests/gpu/cuda_suite.py; SPX_SUITE_DEVICE=cpu runs it on gloo.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.reference import TOL, rel_diff, rel_err
from tests.dit_models import modulated_dit
from training.video_dit import preset
from training.video_dit.data import SyntheticVideoLatents
from training.video_dit.engine import flow_matching_batch, local_loss, make_core, prepare
from training.video_dit.packing import packed_batch, packed_host_inputs
from training.video_dit.pipeline import to_device

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
CFG = preset("tiny")
# frames 8, 4, 6 x latents 8x8, 6x10, 4x8: 128, 60, 48 tokens (each divisible by 2 and 4)
FRAMES, SIZES = [8, 4, 6], [(8, 8), (6, 10), (4, 8)]


def _device() -> torch.device:
    if DEV == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model(device, fused):
    model = modulated_dit(CFG, device=device)
    model.set_fused_elementwise(fused)
    return model


# and frames 3, 5, 1 x latent 6x10: 45, 75, 15 tokens (divisible by neither 2 nor 4: each sample padded)
ODD_FRAMES, ODD_SIZES = [3, 5, 1], [(6, 10)] * 3


def _data(frames=FRAMES, sizes=SIZES):
    return SyntheticVideoLatents(CFG.in_channels, frames, 8, 8, CFG.text_len, CFG.text_dim, seed=1, sizes=sizes)


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def dit_packed_family(rank: int, world: int) -> list:
    device = _device()
    group = dist.group.WORLD if world > 1 else None
    ids = [0, 1, 2]
    fused_backend = "inductor" if device.type == "cuda" else "aot_eager"
    records = []
    cases = [(FRAMES, SIZES, fused, (("ulysses", {}), ("hcms", {"head_chunks": 2}))) for fused in (None, fused_backend)]
    cases += [(ODD_FRAMES, ODD_SIZES, fused, (("ulysses", {}),)) for fused in (None, fused_backend)]
    for frames, sizes, fused, modes in cases:
        data = _data(frames, sizes)
        ref_model = _model(device, fused)
        ref_loss, ref_grads = 0.0, None
        for i in ids:  # one clip at a time, SP=1
            ref_model.zero_grad(set_to_none=True)
            inp = prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch, base=i), 0, 1, device)
            lo = local_loss(ref_model, inp)
            lo.backward()
            ref_loss += lo.item() / len(ids)
            g = _grads(ref_model)
            ref_grads = g if ref_grads is None else [a + b for a, b in zip(ref_grads, g)]
        ref_grads = [g / len(ids) for g in ref_grads]
        for mode, kw in modes:
            model = _model(device, fused)
            model.set_attention_core(make_core(mode, group, num_heads=CFG.heads, **kw))
            inp = to_device(packed_host_inputs(packed_batch(data, ids, 7, CFG.patch), rank, world), device)
            loss_r = local_loss(model, inp)
            (loss_r * world).backward()
            loss = loss_r.detach().clone()
            grads = _grads(model)
            if group is not None:
                dist.all_reduce(loss, group=group)
                for g in grads:
                    dist.all_reduce(g, group=group)
                    g /= world
            errs = {"loss": rel_diff(loss.item(), ref_loss),
                    "grads": max(rel_err(g, r) for g, r in zip(grads, ref_grads))}
            records.append({"family": "dit_packed", "case": f"P={world} {mode}{kw.get('head_chunks', '')} "
                            f"fused={fused} clips={list(zip(frames, sizes))} packed vs one-at-a-time fp32",
                            "errs": errs, "tol": 5 * TOL[torch.float32]})
    return records
