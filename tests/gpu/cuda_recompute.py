"""CUDA-suite worker (#67): the DiT's recompute choices on the GPU's attention kernels (FA4 / cuDNN: forward with
log-sum-exp, explicit backward from out + lse) against the same model without recompute, under bf16 autocast.

``recompute_family(rank, world)``: the DiT (head dim 64: every kernel takes it), SP = ``world`` (Ulysses over the
world group; one rank: the local core), the plain and (SP > 1) the packed q|k|v path; choices full, selective
outside_core_attn, outside_core_attn with --cpu-offloading (pinned host memory), and outside_core_attn on the
first block only (--recompute-num-layers 1). Records: the loss and every
parameter gradient against no recompute (bf16 tolerance: the GPU's backward kernels need not be deterministic), and
the attention core's call count (once per layer under outside_core_attn: the backward never reruns the kernel;
twice under full), as an error |calls - expected| with tolerance 0. SPX_SUITE_DEVICE=cpu runs it on gloo.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.dit_models import modulated_dit
from tests.reference import TOL, rel_diff, rel_err
from training.video_dit.config import DiTConfig
from training.video_dit.engine import make_core

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
CFG = DiTConfig(dim=512, heads=8, ffn=1024, layers=2, in_channels=4, text_dim=32, text_len=8, freq_dim=32)
GRID = (4, 8, 8)   # 256 tokens
# (granularity, modules, cpu offloading, --recompute-num-layers)
CHOICES = {"full": ("full", ["core_attn"], False, None),
           "outside_core_attn": ("selective", ["outside_core_attn"], False, None),
           "outside_core_attn + cpu offloading": ("selective", ["outside_core_attn"], True, None),
           "outside_core_attn, first block only (--recompute-num-layers 1)": ("selective", ["outside_core_attn"],
                                                                              False, 1)}


class _Counting:
    """An attention core that counts its calls (plain and packed entries), keeping ``group`` / ``packed``."""

    def __init__(self, core):
        self.core, self.calls, self.group = core, 0, getattr(core, "group", None)
        if getattr(core, "packed", None) is not None:
            outer = self

            class Packed:
                def layout(self, *a, **k):
                    return core.packed.layout(*a, **k)

                def __call__(self, *a, **k):
                    outer.calls += 1
                    return core.packed(*a, **k)
            self.packed = Packed()

    def __call__(self, *a, **k):
        self.calls += 1
        return self.core(*a, **k)


def _step(device, group, choice, packed_qkv: bool) -> tuple:
    """(loss, {name: grad}, core calls) of one bf16-autocast step on this rank's shard (SP-averaged gradients)."""
    granularity, modules, offload, num_layers = choice
    sp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    model = modulated_dit(CFG, seed=11, device=device)
    core = _Counting(make_core("ulysses", group, num_heads=CFG.heads))
    model.set_attention_core(core)
    model.set_packed_qkv(packed_qkv)
    model.set_recompute(granularity, modules, num_layers)
    model.set_cpu_offloading(offload)
    g = torch.Generator().manual_seed(7)
    s = GRID[0] * GRID[1] * GRID[2]
    x = torch.randn(1, s, CFG.patch_volume, generator=g)
    target = torch.randn(1, s, CFG.patch_volume, generator=g)
    t, text = torch.rand(1, generator=g), torch.randn(1, CFG.text_len, CFG.text_dim, generator=g)
    lo, hi = rank * s // sp, (rank + 1) * s // sp
    with torch.autocast(device.type, dtype=torch.bfloat16):
        pred = model(x[:, lo:hi].to(device), t.to(device), text.to(device), torch.arange(lo, hi, device=device),
                     GRID)
    loss = (pred.float() - target[:, lo:hi].to(device)).pow(2).mean() / sp
    loss.backward()
    loss = loss.detach()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if group is not None:
        dist.all_reduce(loss, group=group)
        for gr in grads.values():
            dist.all_reduce(gr, group=group)
    return loss.item(), grads, core.calls


def recompute_family(rank: int, world: int) -> list:
    device = torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")
    group = dist.group.WORLD if world > 1 else None
    records = []
    for packed_qkv in ((False, True) if world > 1 else (False,)):
        ref = _step(device, group, (None, ["core_attn"], False, None), packed_qkv)
        for name, choice in CHOICES.items():
            got = _step(device, group, choice, packed_qkv)
            errs = {"loss": rel_diff(got[0], ref[0])}
            errs.update({f"grad {n}": rel_err(g, ref[1][n]) for n, g in got[1].items()})
            records.append({"family": "recompute", "case": f"P={world} {name} vs no recompute, bf16 autocast, "
                            f"{'packed' if packed_qkv else 'plain'} q|k|v", "errs": errs, "tol": TOL[torch.bfloat16]})
            want = CFG.layers * (2 if choice[0] == "full" else 1)
            # one rank: exactly; SP > 1 on an inner-graph backend a full recompute may rerun it once more
            over = got[2] - want if (world == 1 or choice[0] != "full") else min(0, got[2] - want)
            records.append({"family": "recompute", "case": f"P={world} {name} attention core calls "
                            f"({got[2]} for {CFG.layers} layers, want {want}), {'packed' if packed_qkv else 'plain'}",
                            "errs": {"calls over expected": float(abs(over))}, "tol": 0.0})
    return records
