"""CUDA-suite worker: the video DiT under dynamic SP (--dynamic-context-parallel) against SP=1 on the same pack.

``dit_dynamic_family(rank, world)``: the tiny DiT (random AdaLN modulation so every block counts) takes one packed
step of single images, short and long clips (B=1) with each sample on its plan's aligned sub-group of the ``world``
ranks (hand-written plans mixing one rank, pairs and all ranks; a clip whose token count divides by neither 2 nor 4,
padded) and the same pack at SP=1; the loss and every parameter gradient (loss summed, gradients averaged over the
SP ranks) must match: fp32 (tol 5e-5 against SP=1 fp32) and bf16 autocast (against SP=1 in fp32: within 1.5x the
error of SP=1 under the same autocast, and at least 2e-2: bf16's own rounding, not the plan, sets it). Modes:
ulysses, hcms C=2, ring (on one GPU over gloo every rank is its own emulated machine: the ring's hops take the
host-staged transport), and usp (Ulysses 2) at P=4. Records as in tests/cuda_suite.py; SPX_SUITE_DEVICE=cpu runs it
on forked gloo ranks. Cases: 2 dtypes x 3 modes at P=2 (6), 2 x 4 at P=4 (8).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_sp_ext.attention import varlen
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.sp.dynamic import DynamicPlan
from tests.reference import TOL, rel_err
from tests.dit_models import modulated_dit
from tests.sp_reduce import loss_and_grads
from training.video_dit import preset
from training.video_dit.data import SyntheticVideoLatents
from training.video_dit.dynamic import make_dynamic_core
from training.video_dit.engine import local_loss, make_core
from training.video_dit.packing import packed_batch, packed_host_inputs
from training.video_dit.pipeline import to_device

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
# the local kernel of BOTH sides (SP=1 and dynamic SP) in the bf16 cases: what a user's SP=1 run would pick ("auto"),
# or one named; the fp32 cases (and the fp32 SP=1 reference) stay on "auto" (a named cuDNN was refused for fp32 on
# a GPU, and FA4 takes no fp32)
KERNEL = os.environ.get("SPX_SUITE_KERNEL", "auto")

CFG = preset("tiny")
# sample i: frames[i % 5] x latent sizes[i % 3]: tokens 8 (image), 45 (3 frames), 64, 8 (image), 90, 16, 24
FRAMES, SIZES = [1, 3, 4, 1, 6], [(4, 8), (6, 10), (8, 8)]
IDS = [0, 1, 2, 3, 4, 5, 6]
PLANS = {2: ((1, 2, 2, 1, 2, 1, 1), (0, 0, 0, 1, 0, 1, 0)), 4: ((1, 2, 4, 1, 4, 2, 1), (0, 2, 0, 1, 0, 0, 3))}


def _kernel(autocast) -> str:
    return KERNEL if autocast is not None else "auto"


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")


def _model(device):
    return modulated_dit(CFG, device=device)


def _step(core, group, rank, world, device, autocast, plan=None):
    model = _model(device)
    model.set_attention_core(core)
    data = SyntheticVideoLatents(CFG.in_channels, FRAMES, 4, 8, CFG.text_len, CFG.text_dim, seed=1, sizes=SIZES)
    inp = to_device(packed_host_inputs(packed_batch(data, IDS, 7, CFG.patch), rank, world, plan), device)
    return loss_and_grads(model, local_loss(model, inp, autocast), group)


def dit_dynamic_family(rank: int, world: int) -> list:
    if dist.get_backend() == "gloo" and DEV == "cuda":  # one GPU: the ring's hops through the host-staged transport
        os.environ["SPX_EMULATED_MACHINE_SIZE"] = "1"
    device, g = _device(), dist.group.WORLD
    records = []
    modes = [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {})]
    if world == 4:
        modes.append(("usp", {"ulysses_size": 2}))
    data = SyntheticVideoLatents(CFG.in_channels, FRAMES, 4, 8, CFG.text_len, CFG.text_dim, seed=1, sizes=SIZES)
    cu = packed_batch(data, IDS, 7, CFG.patch)["cu_seqlens"]
    plan = DynamicPlan(world, tuple(b - a for a, b in zip(cu, cu[1:])), *PLANS[world])
    one = lambda autocast: make_core("ulysses", None, num_heads=CFG.heads, backend=_kernel(autocast))  # noqa: E731
    ref_loss, ref_grads = _step(one(None), None, 0, 1, device, None)
    one_bf16 = _step(one(torch.bfloat16), None, 0, 1, device, torch.bfloat16)
    sp1_methods = sorted(set(varlen.default_chooser().decisions.values()))  # what "auto" chose for SP=1's packs
    names = [n for n, _ in _model(device).named_parameters()]
    bf16_tol = max(TOL[torch.bfloat16], 1.5 * max(abs(one_bf16[0] - ref_loss) / abs(ref_loss),
                                                  max(rel_err(a, b) for a, b in zip(one_bf16[1], ref_grads))))
    for autocast in (None, torch.bfloat16):
        for mode, kw in modes:
            core = make_dynamic_core(SPConfig(mode=mode, backend=_kernel(autocast), **kw), g, num_heads=CFG.heads)
            loss, grads = _step(core, g, rank, world, device, autocast, plan)
            per = [rel_err(a, b) for a, b in zip(grads, ref_grads)]
            worst = max(range(len(per)), key=per.__getitem__)
            errs = {"loss": abs(loss - ref_loss) / abs(ref_loss), "grads": per[worst]}
            dtype = "bf16" if autocast is not None else "fp32"
            records.append({"family": "dit_dynamic", "case": f"P={world} {mode}{kw.get('head_chunks', '')} {dtype} "
                            f"plan sizes={plan.sizes} dynamic vs SP=1 fp32 same pack, kernel {_kernel(autocast)}",
                            "errs": errs, "worst_grad": names[worst], "sp1_bf16_tol": bf16_tol,
                            "sp1_varlen_methods": sp1_methods,
                            "tol": bf16_tol if autocast is not None else 5 * TOL[torch.float32]})
    return records
