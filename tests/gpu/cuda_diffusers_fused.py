"""CUDA-suite worker: ``megatron_sp_ext.diffusers.fuse_elementwise`` (every Wan block compiled by Inductor, the
attention opaque to it) on diffusers' WanTransformer3DModel, stock at P=1 and through ``parallelize`` at P, against
the stock model at SP=1 in float64 (the same references, sizes and tolerance as tests/gpu/cuda_diffusers.py: max(the
suite's TOL, 1.5 x the SP=1 stock model's own error in that dtype)).

``diffusers_fused_family(rank, world)``: fp32 and bf16; ulysses with the test-only sparse plan (128-token tiles),
with diffusers' gradient checkpointing and with ``keep_attention_checkpointing``; ring; auto with the plan and the
attention kept (issue 86's configuration); I2V; at P=1 also the stock model fused. Each case starts from a fresh
Dynamo state (``torch._dynamo.reset``: no case runs eagerly because an earlier one used up the recompile limit) and
records the graphs Dynamo compiled: a case that compiled none is refused by name (the fused path did not run).
No LoRA here (tests/test_diffusers_fused.py checks it against eager on CPU). SPX_SUITE_DEVICE=cpu runs the same
cases on gloo with the tiny float64-test model's sizes and backend "aot_eager" (tests/test_cuda_diffusers_fused_worker.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.gpu import cuda_diffusers as base
from tests.wan_sp import forward_backward


class FusedFamily(base.Family):
    """cuda_diffusers.Family's references and tolerance, each case's model compiled by fuse_elementwise."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self.backend = "inductor" if base.DEV == "cuda" else "aot_eager"

    def fused_case(self, kind: str, mode: str, dtype: torch.dtype, *, sparse: bool, recompute: str = "none",
                   stock: bool = False) -> None:
        from torch._dynamo.utils import counters  # noqa: PLC0415
        from megatron_sp_ext.diffusers import fuse_elementwise, keep_attention_checkpointing  # noqa: PLC0415
        torch._dynamo.reset()
        counters.clear()
        model = self.model(kind, dtype)
        sp = None if stock else self.parallelize(model, self.group, mode, sparse=self.plan(sparse))
        if recompute == "full":
            model.enable_gradient_checkpointing()
        elif recompute == "keep":
            keep_attention_checkpointing(sp)
        fused = fuse_elementwise(model, self.backend)
        out, grads = forward_backward(model, self.inputs(kind, dtype), None if stock else self.group)
        graphs = int(counters["stats"]["unique_graphs"])
        fused.remove()
        if sp is not None:
            sp.remove()
        ref_out, ref_grads = self.reference(kind, sparse)
        sp1 = self.sp1_error(kind, dtype)
        rec = {"family": "diffusers_fused", "errs": base.errors(out, grads, ref_out, ref_grads), "sp1_err": sp1,
               "graphs": graphs, "worst_param": base.worst_param(grads, ref_grads),
               "case": f"P={1 if stock else self.world} {'stock' if stock else mode} {str(dtype)[6:]} {kind}"
                       f"{' sparse' if sparse else ''} recompute={recompute} fused({self.backend}) vs SP=1 float64"}
        if graphs < 1:
            rec["refused"] = "fuse_elementwise compiled no graph: the case ran eagerly"
        self.record(rec, dtype, sp1)


def diffusers_fused_family(rank: int, world: int) -> list:
    """The family's records (module docstring): 10 cases at P=1, 8 at P > 1."""
    if dist.get_backend() == "gloo" and base.DEV == "cuda":   # one GPU: the ring's hops host-staged
        import os  # noqa: PLC0415
        os.environ["SPX_EMULATED_MACHINE_SIZE"] = "1"
    torch.backends.cudnn.allow_tf32 = False
    fam = FusedFamily(rank, world)
    for dtype in (torch.float32, torch.bfloat16):
        fam.fused_case("t2v", "ulysses", dtype, sparse=True)
        fam.fused_case("t2v", "ulysses", dtype, sparse=True, recompute="full")
        fam.fused_case("t2v", "auto", dtype, sparse=True, recompute="keep")
        if world == 1:
            fam.fused_case("t2v", "stock", dtype, sparse=False, stock=True)
    fam.fused_case("t2v", "ring", torch.float32, sparse=False, recompute="keep")
    fam.fused_case("i2v", "ulysses", torch.float32, sparse=False)
    return fam.records
