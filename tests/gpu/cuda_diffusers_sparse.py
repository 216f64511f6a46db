"""CUDA-suite worker: ``megatron_sp_ext.diffusers.sparse.BlockSparsePlan`` on diffusers' WanTransformer3DModel at
SP=P through ``parallelize`` against a float64 single-device reference (tests/wan_sparse.py: the plan's attention
from scratch, ``reference_sparse_attention`` plus an independent coarse branch).

``diffusers_sparse_family(rank, world)``: the CUDA suite's small Wan (tests/gpu/cuda_diffusers.py: 4 heads x 64, 2
blocks, a 4x16x16 patch grid = 1,024 tokens) with the plan's default tile 4x4x8 (128 tokens, FA4's block; 8 tiles),
window (0, 1, 0) and top-k 3 with the gated coarse branch (gates set non-zero), in ulysses, hcms C=2 and ring (P=4
adds usp on 2 simulated machines), fp32 and bf16 (the whole model cast). Top-k's selection depends on the pooled
scores' rounding, so its reference takes the masks the run picked (recorded per layer) and the selection is checked
on its own: every rank's masks equal rank 0's (``mask_ranks``, 0 or inf); the mask entries unlike the float64
reference's own selection are recorded (``mask_entries_unlike_fp64``, not judged: near-ties flip). Each record:
output, latent gradient and all parameter gradients (one vector, summed over the SP ranks) against float64;
tolerance per dtype as tests/gpu/cuda_diffusers.py (``tolerance``: max(the suite's, 1.5 x the SP=1 stock model's own
error in that dtype)). Cases: 12 at P=2, 16 at P=4. SPX_SUITE_DEVICE=cpu runs it on gloo with the tiny float64
test model's sizes and tile 2x2x2 (tests/test_cuda_diffusers_sparse_worker.py).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.gpu import cuda_diffusers
from tests.wan_sp import TINY, forward_backward
from tests.wan_sparse import RecordingPlan, reference_model, set_gates

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
CUDA_TILE = (4, 4, 8)
CPU_TILE = (2, 2, 2)
PLANS = {"window": dict(window=(0, 1, 0)), "topk": dict(topk=3)}


def _modes(world: int) -> list:
    modes = [("ulysses", {}), ("hcms", {"head_chunks": cuda_diffusers.hcms_chunks(world)}), ("ring", {})]
    return modes + ([("usp", {"ulysses_size": 2, "nodes": 2})] if world == 4 else [])


def _same_on_every_rank(masks: dict, group) -> float:
    """0.0 when every rank's per-layer masks equal rank 0's, else inf."""
    flat = torch.cat([masks[i].flatten().to(torch.uint8) for i in sorted(masks)])   # recorded on the CPU
    on_gpu = DEV == "cuda" and dist.get_backend(group) == "nccl"
    mine = flat.to(torch.device("cuda", torch.cuda.current_device())) if on_gpu else flat
    first = mine.clone()
    dist.broadcast(first, 0, group=group)
    return 0.0 if torch.equal(mine, first) else float("inf")


class SparseFamily(cuda_diffusers.Family):
    """tests/gpu/cuda_diffusers.py's Family (sizes, models, inputs, SP=1 stock errors) with BlockSparsePlan cases."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)    # sizes and device from tests/gpu/cuda_diffusers.py's DEV
        self.tile = CUDA_TILE if DEV == "cuda" else CPU_TILE
        self.plan_refs, self.picked = {}, {}

    def grid(self) -> tuple:
        return tuple(n // p for n, p in zip(self.latent[2:], TINY["patch_size"]))

    def run(self, kind: str, mode: str, settings: dict, dtype: torch.dtype, group):
        from megatron_sp_ext.diffusers.sparse import BlockSparsePlan  # noqa: PLC0415
        model = self.model("t2v", dtype)
        plan = RecordingPlan(BlockSparsePlan(self.tile, **PLANS[kind]))
        sp = self.parallelize(model, group, mode, sparse=plan, **settings)
        if kind == "topk":
            set_gates(model)
        out, grads = forward_backward(model, self.inputs("t2v", dtype), group)
        sp.remove()
        return out, grads, plan.masks

    def sparse_reference(self, kind: str, masks=None):
        """float64 reference: the plan's own selection (window; top-k picked in float64, kept in ``picked``), or
        the given top-k masks."""
        if masks is None and kind in self.plan_refs:
            return self.plan_refs[kind]
        picked = self.picked.setdefault(kind, {}) if masks is None else None
        ref = reference_model(self.model("t2v", torch.float64), self.grid(), self.tile, masks=masks, picked=picked,
                              **PLANS[kind])
        got = forward_backward(ref, self.inputs("t2v", torch.float64), None)
        if masks is None:
            self.plan_refs[kind] = got
        return got

    def sparse_case(self, kind: str, mode: str, settings: dict, dtype: torch.dtype) -> None:
        out, grads, masks = self.run(kind, mode, settings, dtype, self.group)
        errs, info = {}, {}
        if kind == "topk":
            errs["mask_ranks"] = _same_on_every_rank(masks, self.group)
            self.sparse_reference(kind)                       # the float64 selection, for the record
            want = self.picked[kind]
            info["mask_entries_unlike_fp64"] = sum((masks[i] != want[i]).sum().item() for i in want)
            ref_out, ref_grads = self.sparse_reference(kind, masks)
        else:
            ref_out, ref_grads = self.sparse_reference(kind)
        errs.update(cuda_diffusers.errors(out, grads, ref_out, ref_grads))
        sp1 = self.sp1_error("t2v", dtype)
        rec = {"family": "diffusers_sparse", "errs": errs, "sp1_err": sp1, **info,
               "worst_param": cuda_diffusers.worst_param(grads, ref_grads),
               "case": f"P={self.world} {mode}{settings.get('head_chunks', '')} {str(dtype)[6:]} {kind} "
                       f"tile {'x'.join(map(str, self.tile))} vs float64 reference"}
        self.record(rec, dtype, sp1)


def diffusers_sparse_family(rank: int, world: int) -> list:
    """The family's records (module docstring)."""
    if dist.get_backend() == "gloo" and DEV == "cuda":  # one GPU: the ring's hops through the host-staged transport
        os.environ["SPX_EMULATED_MACHINE_SIZE"] = "1"
    torch.backends.cudnn.allow_tf32 = False   # the patch embedding's Conv3d: fp32 cases compute in fp32
    fam = SparseFamily(rank, world)
    for kind in PLANS:
        for mode, kw in _modes(world):
            for dtype in (torch.float32, torch.bfloat16):
                fam.sparse_case(kind, mode, kw, dtype)
    return fam.records
