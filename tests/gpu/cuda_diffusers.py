"""CUDA-suite worker: the diffusers client (``megatron_sp_ext.diffusers.parallelize``) on diffusers'
WanTransformer3DModel at SP=P against the stock model (diffusers' own processors) at SP=1 in float64.

``diffusers_family(rank, world)``: a small Wan (4 heads x 64, 2 blocks, a 4x16x16 patch grid = 1,024 tokens; the
test-only SparseAttentionPlan of tests/wan_sp.py with 128-token tiles, FA4's kernel block) in every mode at P (P=2:
ulysses, hcms C=2, ring, tasp, auto; P=4 adds usp, tas and torus on 2 simulated machines), fp32 and bf16 (the whole
model cast), with the plan (token order, block mask, gated extra branch: the reference is the dense masked processor
in float64) and, for ulysses and ring, without it (the reference is stock diffusers in float64); and in fp32: I2V
(Wan 2.1's image tokens), a TI2V per-token timestep, WanVACETransformer3DModel, gradient checkpointing. Each record:
the output's, the latent's and all parameter gradients' (one vector, summed over the SP ranks) relative errors
against float64. Tolerance per dtype: max(the suite's (fp32 1e-5, bf16 2e-2), 1.5 x the SP=1 stock model's own error
in that dtype against float64) (``tolerance``: that SP=1 error must be finite and at most 1e-3 in fp32, 5e-2 in
bf16, else the case is refused naming it). fp32 is fp32: cuDNN's TF32 convolutions (the patch embedding) are turned
off in the worker. Cases: 17 at P=2, 23 at P=4. SPX_SUITE_DEVICE=cpu runs it on gloo with the tiny float64 test
model's sizes (tests/test_cuda_diffusers_worker.py).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.reference import TOL, rel_err, worst
from tests.gpu.suite_judge import checked_reference_err, progress
from tests.wan_sp import (TINY, FixedSparsePlan, LATENT, forward_backward, reference_with_plan, tiny_wan,
                          wan_inputs)

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
CUDA_MODEL = dict(attention_head_dim=64, ffn_dim=512)    # 4 heads x 64 (FA4 runs no smaller head dim)
CUDA_LATENT = (1, 4, 4, 32, 32)                          # patch (1, 2, 2) -> 4 x 16 x 16 = 1,024 tokens
CUDA_TILE = 128
SP1_CAP = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def _sizes() -> tuple:
    """(model overrides, latent, tile) for the device: the CUDA sizes, or the tiny CPU test model's."""
    if DEV == "cuda":
        return CUDA_MODEL, CUDA_LATENT, CUDA_TILE
    return {}, LATENT, 8


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")


def tolerance(dtype: torch.dtype, sp1_err: float) -> float:
    """max(TOL[dtype], 1.5 x ``sp1_err``): ``sp1_err`` is the SP=1 stock model's worst error in ``dtype`` against
    float64 (output, latent gradient, parameter gradients norm-wise); ValueError unless finite and <= SP1_CAP."""
    err = checked_reference_err(sp1_err, SP1_CAP[dtype], f"SP=1 stock {dtype} vs float64")
    return max(TOL[dtype], 1.5 * err)


def errors(out, grads, ref_out, ref_grads) -> dict:
    """Relative errors: output, the latent's gradient, every parameter's gradient as one vector (norm-wise)."""
    names = [n for n in ref_grads if n != "input"]
    return {"output": rel_err(out, ref_out), "input_grad": rel_err(grads["input"], ref_grads["input"]),
            "grads_normwise": rel_err(torch.cat([grads[n].flatten().double() for n in names]),
                                      torch.cat([ref_grads[n].flatten() for n in names]))}


def worst_param(grads, ref_grads) -> tuple:
    per = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads if n != "input"}
    name = max(per, key=lambda n: per[n])
    return name, per[name]


def hcms_chunks(world: int) -> int:
    """HCMS's head chunks at P=world on the 4-head test model: 2 where each rank has 2 heads, else 1 (P=4: one head
    a rank; 2 chunks would be refused by name)."""
    return max(1, min(2, TINY["num_attention_heads"] // world))


def _modes(world: int) -> list:
    modes = [("ulysses", {}), ("hcms", {"head_chunks": hcms_chunks(world)}), ("ring", {}), ("tasp", {}), ("auto", {})]
    if world == 4:
        modes += [(m, {"ulysses_size": 2, "nodes": 2}) for m in ("usp", "tas", "torus")]
    return modes


class Family:
    """One rank's cases, each SP=1 float64 reference and SP=1 stock error per dtype computed once."""

    def __init__(self, rank: int, world: int) -> None:
        from megatron_sp_ext.diffusers import parallelize  # noqa: PLC0415
        self.parallelize, self.rank, self.world = parallelize, rank, world
        self.group, self.device = dist.group.WORLD, _device()
        self.over, self.latent, self.tile = _sizes()
        self.refs, self.sp1, self.records = {}, {}, []

    def plan(self, sparse: bool):
        return FixedSparsePlan(block_size=self.tile) if sparse else None

    def model(self, kind: str, dtype: torch.dtype):
        return tiny_wan(kind, dtype=dtype, device=self.device, **self.over)

    def inputs(self, kind: str, dtype: torch.dtype) -> dict:
        return wan_inputs(kind, dtype=dtype, device=self.device, latent=self.latent)

    def reference(self, kind: str, sparse: bool):
        if (kind, sparse) not in self.refs:
            stock = self.model(kind, torch.float64)
            grid = tuple(n // p for n, p in zip(self.latent[2:], stock.config.patch_size))
            ref = reference_with_plan(stock, self.plan(True), grid) if sparse else stock
            self.refs[(kind, sparse)] = forward_backward(ref, self.inputs(kind, torch.float64), None)
        return self.refs[(kind, sparse)]

    def sp1_error(self, kind: str, dtype: torch.dtype) -> float:
        """The stock SP=1 model's worst error in ``dtype`` against float64 (the tolerance's basis)."""
        if (kind, dtype) not in self.sp1:
            out, grads = forward_backward(self.model(kind, dtype), self.inputs(kind, dtype), None)
            self.sp1[(kind, dtype)] = worst(errors(out, grads, *self.reference(kind, False)).values())
        return self.sp1[(kind, dtype)]

    def case(self, kind: str, mode: str, settings: dict, dtype: torch.dtype, *, sparse: bool,
             checkpoint: bool = False) -> None:
        model = self.model(kind, dtype)
        if checkpoint:
            model.enable_gradient_checkpointing()
        sp = self.parallelize(model, self.group, mode, sparse=self.plan(sparse), **settings)
        out, grads = forward_backward(model, self.inputs(kind, dtype), self.group)
        sp.remove()
        ref_out, ref_grads = self.reference(kind, sparse)
        sp1 = self.sp1_error(kind, dtype)
        rec = {"family": "diffusers", "errs": errors(out, grads, ref_out, ref_grads), "sp1_err": sp1,
               "worst_param": worst_param(grads, ref_grads),
               "case": f"P={self.world} {mode}{settings.get('head_chunks', '')} {str(dtype)[6:]} {kind}"
                       f"{' sparse' if sparse else ''}{' checkpointing' if checkpoint else ''} vs SP=1 float64"}
        self.record(rec, dtype, sp1)

    def record(self, rec: dict, dtype: torch.dtype, sp1: float) -> None:
        """``rec`` with its tolerance (``tolerance``; a refusal naming why where the SP=1 error is unusable) kept and
        printed."""
        try:
            rec["tol"] = tolerance(dtype, sp1)
        except ValueError as e:
            rec["tol"], rec["refused"] = float("nan"), str(e)
        self.records.append(rec)
        progress(rec, self.rank)


def diffusers_family(rank: int, world: int) -> list:
    """The family's records (module docstring)."""
    if dist.get_backend() == "gloo" and DEV == "cuda":  # one GPU: the ring's hops through the host-staged transport
        os.environ["SPX_EMULATED_MACHINE_SIZE"] = "1"
    torch.backends.cudnn.allow_tf32 = False   # the patch embedding's Conv3d: fp32 cases compute in fp32
    fam = Family(rank, world)
    for mode, kw in _modes(world):
        for dtype in (torch.float32, torch.bfloat16):
            fam.case("t2v", mode, kw, dtype, sparse=True)
    for mode in ("ulysses", "ring"):
        fam.case("t2v", mode, {}, torch.float32, sparse=False)
    fam.case("i2v", "ulysses", {}, torch.float32, sparse=False)
    fam.case("vace", "ring", {}, torch.float32, sparse=False)
    fam.case("ti2v", "ulysses", {}, torch.float32, sparse=True)
    fam.case("t2v", "ring", {}, torch.float32, sparse=True, checkpoint=True)
    fam.case("t2v", "auto", {}, torch.bfloat16, sparse=False, checkpoint=True)
    return fam.records
