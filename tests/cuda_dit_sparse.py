"""CUDA-suite worker: the video DiT's block-sparse step (--sparse-attention tiles) at SP=P against SP=1.

``dit_sparse_family(rank, world)``: the tiny DiT's width at head dim 64 (8 heads; FA4 runs no smaller head dim), its
VSA gate and AdaLN modulation woken (random, so the coarse branch and every block count), takes one step on a grid in
tile order with 128-token tiles (2x8x8: FA4's kernel block) under three selections: top-k (the pooled tiles summed
over the SP group, ``TileRun``'s reshapes, ``gated_spread``), a window, and top-k on a grid the tile cuts (edge
blocks compacted, a shorter last tile). Each at SP=P in the modes ulysses, hcms (C=2), ring (and usp at P=4), fp32
and bf16 autocast on the local kernel "auto" (FA4's block sparsity in bf16 where it runs), against SP=1 fp32 on the
same batch: the loss and the parameter gradients (summed loss; gradients averaged over the SP ranks). fp32: every
parameter's gradient on its own, tol 5e-5. bf16: the gradients norm-wise (all parameters as one vector; a bias
whose gradient nearly cancels over the tokens, e.g. norm2's, is off by 0.17 relative in bf16 at SP=1 already, with
CPU's one-thread bf16 sums), tol ``cuda_dit_dynamic.bf16_tolerance`` of the SP=1 bf16 step's own norm-wise error
(finite, capped at 5e-2); the worst single parameter is recorded, not judged. Cases: 3 grids x (3 or 4 modes) x 2
dtypes: 18 at P=2, 24 at P=4. SPX_SUITE_DEVICE=cpu runs it on gloo (math kernel).
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.distributed as dist

from tests.cuda_dit_dynamic import bf16_tolerance
from tests.dit_models import modulated_dit
from tests.reference import TOL, nan_worst, rel_diff, rel_err, worst
from tests.suite_judge import progress
from training.video_dit import preset
from training.video_dit.data import SyntheticVideoLatents
from training.video_dit.engine import flow_matching_batch, local_loss, make_core, prepare
from training.video_dit.sparse import SparseSpec

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
CFG = dataclasses.replace(preset("tiny"), dim=512, ffn=1024)   # 8 heads x 64
TILE = (2, 8, 8)
# (selection, frames, latent h x w): patches (1, 2, 2) -> grids 4x16x16 (1,024 tokens, 8 tiles) and 3x10x18 (540
# tokens: the tile cuts H and W, 5 tiles, the last 28 tokens)
CASES = [("topk", SparseSpec(TILE, topk=3), 4, (32, 32)), ("window", SparseSpec(TILE, window=(0, 1, 0)), 4, (32, 32)),
         ("topk cut grid", SparseSpec(TILE, topk=2), 3, (20, 36))]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")


def sparse_step(spec, core, group, device, autocast):
    """(loss, grads) of one sparse step on this rank's shard (group None: SP=1); loss summed, grads averaged."""
    model = modulated_dit(CFG, device=device)
    model.set_sparse_attention(spec)
    with torch.no_grad():   # wake the VSA gate (zero at init) so the coarse branch counts
        for blk in model.blocks:
            if blk.attn.sparse_gate is not None:
                blk.attn.sparse_gate.weight.normal_(0.0, 0.05, generator=torch.Generator(device).manual_seed(3))
    model.set_attention_core(core)
    sp = dist.get_world_size(group) if group is not None else 1
    name, _, frames, size = next(c for c in CASES if c[1] is spec)
    data = SyntheticVideoLatents(CFG.in_channels, (frames,), size[0], size[1], CFG.text_len, CFG.text_dim, seed=1)
    batch = flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch, tile=spec.tile)
    inp = prepare(batch, dist.get_rank(group) if group is not None else 0, sp, device)
    loss_r = local_loss(model, inp, autocast)
    (loss_r * sp).backward()
    loss = loss_r.detach().float().clone()
    grads = [p.grad.detach().float().clone() for p in model.parameters()]
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads:
            dist.all_reduce(g, group=group)
            g /= sp
    return loss.item(), grads


def normwise(grads, ref) -> float:
    """||grads - ref|| / ||ref|| over every parameter's gradient as one vector (inf when any is not finite)."""
    return rel_err(torch.cat([g.flatten() for g in grads]), torch.cat([r.flatten() for r in ref]))


def dit_sparse_family(rank: int, world: int) -> list:
    if dist.get_backend() == "gloo" and DEV == "cuda":  # one GPU: the ring's hops through the host-staged transport
        os.environ["SPX_EMULATED_MACHINE_SIZE"] = "1"
    device, g = _device(), dist.group.WORLD
    modes = [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {})]
    if world == 4:
        modes.append(("usp", {"nodes": 2, "ulysses_size": 2}))
    names = [n for n, _ in modulated_dit(CFG).named_parameters()]
    records = []
    for name, spec, _, _ in CASES:
        one = make_core("ulysses", None, num_heads=CFG.heads)
        ref_loss, ref_grads = sparse_step(spec, one, None, device, None)
        sp1_loss, sp1_grads = sparse_step(spec, one, None, device, torch.bfloat16)
        sp1 = worst([rel_diff(sp1_loss, ref_loss), normwise(sp1_grads, ref_grads)])
        try:
            bf16_tol, refused = bf16_tolerance(sp1, "auto"), ""
        except ValueError as e:
            bf16_tol, refused = math.nan, str(e)
        for autocast in (None, torch.bfloat16):
            for mode, kw in modes:
                core = make_core(mode, g, num_heads=CFG.heads, **kw)
                loss, grads = sparse_step(spec, core, g, device, autocast)
                per = [rel_err(a, b) for a, b in zip(grads, ref_grads)]
                worst_i = max(range(len(per)), key=lambda i: nan_worst(per[i]))
                dtype = "bf16" if autocast is not None else "fp32"
                errs = {"loss": rel_diff(loss, ref_loss)}
                if autocast is None:
                    errs["grads"] = per[worst_i]
                else:
                    errs["grads_normwise"] = normwise(grads, ref_grads)
                rec = {"family": "dit_sparse", "case": f"P={world} {mode}{kw.get('head_chunks', '')} {dtype} {name} "
                       f"tile {TILE} vs SP=1 fp32", "errs": errs, "worst_grad": names[worst_i],
                       "worst_grad_err": per[worst_i], "sp1_bf16_err": sp1,
                       "tol": bf16_tol if autocast is not None else 5 * TOL[torch.float32]}
                if autocast is not None and refused:
                    rec["refused"] = refused
                records.append(rec)
                progress(rec, rank)
    return records
