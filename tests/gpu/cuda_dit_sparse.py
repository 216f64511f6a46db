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
(finite, capped at 5e-2); the worst single parameter is recorded, not judged. In the bf16 top-k cases both SP=1
runs (fp32 reference, bf16 tolerance) replay the SP=P step's own selection (``Selections``): top-k is discontinuous,
and near-tied tile scores flip under bf16 rounding of other GEMM shapes; each flipped row must be such a near-tie
(``NEAR_TIE``), so a selection that SP got wrong still fails. Cases: 3 grids x (3 or 4 modes) x 2
dtypes: 18 at P=2, 24 at P=4 (the CUDA suite runs them all). SPX_SUITE_DEVICE=cpu runs it on gloo (math kernel);
``only=`` (a list of (grid, mode, dtype)) runs a subset, ``small_sizes()`` the same grids at a quarter of the tokens
and width: the CPU dry run (tests/test_cuda_dit_sparse_worker.py) covers every path with a few such cases.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_sp_ext.attention import kernels
from tests.gpu.cuda_dit_dynamic import bf16_tolerance
from tests.dit_models import modulated_dit
from tests.reference import TOL, nan_worst, rel_diff, rel_err, worst
from tests.sp_reduce import loss_and_grads
from tests.gpu.suite_judge import progress
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


def small_sizes() -> dict:
    """Module settings for a CPU dry run: 8 heads x 16, 32-token tiles (2x4x4), grids 4x8x8 (256 tokens, 8 tiles)
    and 3x5x9 (135 tokens: the tile cuts every axis, 5 tiles after compaction, the last 7 tokens); the same
    selections. Returns {name: value} to set on this module (e.g. with monkeypatch.setattr)."""
    tile = (2, 4, 4)
    return {"CFG": dataclasses.replace(preset("tiny"), dim=128, ffn=256), "TILE": tile,
            "CASES": [("topk", SparseSpec(tile, topk=3), 4, (16, 16)),
                      ("window", SparseSpec(tile, window=(0, 1, 0)), 4, (16, 16)),
                      ("topk cut grid", SparseSpec(tile, topk=2), 3, (10, 18))]}


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
    return loss_and_grads(model, local_loss(model, inp, autocast).float(), group)


def normwise(grads, ref) -> float:
    """||grads - ref|| / ||ref|| over every parameter's gradient as one vector (inf when any is not finite)."""
    return rel_err(torch.cat([g.flatten() for g in grads]), torch.cat([r.flatten() for r in ref]))


# A top-k row whose k-th and (k+1)-th tile scores are closer than this (relative to the row's largest score) is a
# near-tie that bf16 rounding upstream may flip: 8 bf16 spacings (2^-8 each). The test's own top-k case has rows
# 7.3e-4 apart (CPU, fp32); on an H200 2 of 128 rows flipped between SP=2 and SP=1 at no cost (SP=2 bf16 vs SP=1
# fp32 4.2e-3 with either selection, 2026-11-26; the 7.2e-2 failures of that day were SP=1's own bf16 step).
NEAR_TIE = 8 * 2.0 ** -8


def score_gaps(q_tiles: torch.Tensor, k_tiles: torch.Tensor, k: int) -> torch.Tensor:
    """[H, nT] relative gap between each query tile's k-th and (k+1)-th key-tile score (inf where k >= nT)."""
    with torch.no_grad(), torch.autocast(q_tiles.device.type, enabled=False):
        scores = torch.matmul(q_tiles.float(), k_tiles.float().transpose(-1, -2))
        if k >= scores.shape[-1]:
            return torch.full(scores.shape[:-1], math.inf, device=scores.device)
        top = scores.topk(k + 1, dim=-1).values
        return (top[..., k - 1] - top[..., k]) / scores.abs().amax(-1).clamp_min(1e-30)


class Selections:
    """Records the top-k tile masks the DiT picks (``training.video_dit.model.topk_tile_mask``, in call order: one
    per layer and sample) with their score gaps; with ``replay`` (another run's masks) the run uses those instead,
    so a reference step runs the selection of the step it is compared with."""

    def __init__(self, replay: Optional[list] = None) -> None:
        self.replay, self.masks, self.gaps = replay, [], []

    def __enter__(self) -> "Selections":
        from training.video_dit import model  # noqa: PLC0415
        self._model, self._real = model, model.topk_tile_mask

        def pick(q_tiles, k_tiles, k):
            own = self._real(q_tiles, k_tiles, k)
            self.masks.append(own)
            self.gaps.append(score_gaps(q_tiles, k_tiles, k))
            return own if self.replay is None else self.replay[len(self.masks) - 1].to(own.device)
        model.topk_tile_mask = pick
        return self

    def __exit__(self, *exc) -> None:
        self._model.topk_tile_mask = self._real


def selection_change(picked: list, own: Selections) -> dict:
    """How the masks ``picked`` (a bf16 SP=P step's) differ from ``own.masks`` (SP=1 fp32's own picks on the same
    batch): rows (layer call, head, query tile) changed, and the largest SP=1 fp32 score gap among them."""
    if len(picked) != len(own.masks):
        return {"rows": -1, "changed": -1, "changed_max_gap": math.inf}
    changed, gap_max, rows = 0, 0.0, 0
    for a, b, gap in zip(picked, own.masks, own.gaps):
        diff = (a.to(b.device) != b).any(-1)                      # [H, nT]
        rows += diff.numel()
        changed += int(diff.sum())
        if bool(diff.any()):
            gap_max = max(gap_max, float(gap[diff].max()))
    return {"rows": rows, "changed": changed, "changed_max_gap": gap_max}


def dit_sparse_family(rank: int, world: int, only: Optional[list] = None) -> list:
    """The family's records (module docstring). bf16 top-k cases: SP=1 (the fp32 reference and the bf16 step that
    sets the tolerance) runs the SP=P step's own top-k selection, and every tile row where that selection differs
    from SP=1 fp32's own must be a near-tie (gap < NEAR_TIE), else the case fails naming the rows. only: the
    (grid, mode, dtype) cases to run, e.g. ("window", "hcms", "bf16") (None: all)."""
    modes = [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {})]
    if world == 4:
        modes.append(("usp", {"nodes": 2, "ulysses_size": 2}))
    picked_cases = {(name, mode, dtype) for name, *_ in CASES for mode, _ in modes for dtype in ("fp32", "bf16")}
    if only is not None:
        unknown = set(map(tuple, only)) - picked_cases
        assert not unknown, f"only= names no case of this family at P={world}: {sorted(unknown)}"
        picked_cases = set(map(tuple, only))
    if dist.get_backend() == "gloo" and DEV == "cuda":  # one GPU: the ring's hops through the host-staged transport
        os.environ["SPX_EMULATED_MACHINE_SIZE"] = "1"
    device, g = _device(), dist.group.WORLD
    names = [n for n, _ in modulated_dit(CFG).named_parameters()]
    records = []
    for name, spec, _, _ in CASES:
        if not any(c[0] == name for c in picked_cases):
            continue
        one = make_core("ulysses", None, num_heads=CFG.heads)
        ref_loss, ref_grads = sparse_step(spec, one, None, device, None)
        for autocast in (None, torch.bfloat16):
            for mode, kw in modes:
                if (name, mode, "bf16" if autocast is not None else "fp32") not in picked_cases:
                    continue
                core = make_core(mode, g, num_heads=CFG.heads, **kw)
                with Selections() as picked:
                    loss, grads = sparse_step(spec, core, g, device, autocast)
                extra, refused = {}, ""
                base_loss, base_grads = ref_loss, ref_grads
                if autocast is not None:
                    with Selections(replay=picked.masks if spec.topk else None) as own:
                        base_loss, base_grads = sparse_step(spec, one, None, device, None)
                    before = dict(kernels.PICKS)
                    with Selections(replay=picked.masks if spec.topk else None):
                        sp1_loss, sp1_grads = sparse_step(spec, one, None, device, torch.bfloat16)
                    sp1 = worst([rel_diff(sp1_loss, base_loss), normwise(sp1_grads, base_grads)])
                    extra["sp1_bf16_kernels"] = {f"{k[0]}/{k[1]}": n - before.get(k, 0)
                                                 for k, n in kernels.PICKS.items() if n != before.get(k, 0)}
                    if spec.topk and os.environ.get("SPX_DIT_SPARSE_DIAG") == "1":   # the replay's diagnosis
                        with Selections(replay=[m.clone() for m in picked.masks]):
                            fl, fg = sparse_step(spec, one, None, device, torch.bfloat16)
                        extra["diag_sp1_bf16_replay_clones"] = normwise(fg, base_grads)
                        with Selections():
                            ol, og = sparse_step(spec, one, None, device, torch.bfloat16)
                        extra["diag_sp1_bf16_own_vs_base"] = normwise(og, base_grads)
                        extra["diag_sp1_bf16_own_vs_ref"] = normwise(og, ref_grads)
                        extra["diag_spp_vs_ref"] = normwise(grads, ref_grads)
                    try:
                        bf16_tol = bf16_tolerance(sp1, "auto")
                    except ValueError as e:
                        bf16_tol, refused = math.nan, str(e)
                    if spec.topk:
                        ch = selection_change(picked.masks, own)
                        extra |= {"selection_rows": ch["rows"], "selection_rows_changed": ch["changed"],
                                 "selection_changed_max_gap": ch["changed_max_gap"]}
                        if ch["rows"] < 0 or not ch["changed_max_gap"] < NEAR_TIE:
                            refused = (f"the SP={world} bf16 step's top-k selection differs from SP=1's beyond bf16 "
                                       f"rounding: {ch['changed']} of {ch['rows']} tile rows changed, one with a "
                                       f"score gap of {ch['changed_max_gap']:.3g} >= {NEAR_TIE:.3g}")
                    extra["sp1_bf16_err"] = sp1
                per = [rel_err(a, b) for a, b in zip(grads, base_grads)]
                worst_i = max(range(len(per)), key=lambda i: nan_worst(per[i]))
                dtype = "bf16" if autocast is not None else "fp32"
                errs = {"loss": rel_diff(loss, base_loss)}
                if autocast is None:
                    errs["grads"] = per[worst_i]
                else:
                    errs["grads_normwise"] = normwise(grads, base_grads)
                rec = {"family": "dit_sparse", "case": f"P={world} {mode}{kw.get('head_chunks', '')} {dtype} {name} "
                       f"tile {TILE} vs SP=1 fp32", "errs": errs, "worst_grad": names[worst_i],
                       "worst_grad_err": per[worst_i], **extra,
                       "tol": bf16_tol if autocast is not None else 5 * TOL[torch.float32]}
                if refused:
                    rec["refused"] = refused
                records.append(rec)
                progress(rec, rank)
    return records
