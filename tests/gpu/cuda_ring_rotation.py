"""CUDA-suite worker for the ring backward's dK|dV return (sp/ring/rotation.py): ring and TASP, causal in their
zigzag placements and not, with each schedule: the previous traveling fp32 accumulator ("travel"), partials
straight home in one chunk ("home C=1") and with the last step in 4 head chunks ("home C=4"), against the
float64 reference (tests/sp_check.run_case). Family "ring_rotation": 14 cases per world size.

Records follow tests/gpu/cuda_suite.py: {"family", "case", "errs": {name: rel_err}, "tol"}. With gloo on one GPU
every rank is its own emulated machine (the ring's hops take the host-staged transport, as cuda_suite's ring
family does); SPX_SUITE_DEVICE=cpu SPX_SUITE_SHRINK=16 runs the same worker on forked gloo ranks.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.sp.placement import pieces
from megatron_sp_ext.sp.ring.rotation import DKV_CHUNKS_ENV, DKV_ROUTE_ENV
from megatron_sp_ext.topology.hamiltonian import routing_tables
from tests.reference import TOL
from tests.sp_check import run_case

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
SHRINK = int(os.environ.get("SPX_SUITE_SHRINK", "1"))
SCHEDULES = (("travel", "1"), ("home", "1"), ("home", "4"))


def _shard(placement):
    def shard(x, r, w):
        return torch.cat([x[:, a:a + n] for a, n in pieces(placement, r, w, x.shape[1])], dim=1)
    return shard


def ring_rotation_family(rank: int, world: int) -> list:
    if dist.get_backend() == "gloo" and DEV == "cuda":
        os.environ["SPX_EMULATED_MACHINE_SIZE"] = "1"
    g, rec, n = dist.group.WORLD, [], 0
    h, hkv, d = 8, 4, 128
    try:
        for variant in ("ring", "tasp"):
            rings = len(routing_tables(world).cycles) if variant == "tasp" else 1
            s = (512 if variant == "ring" else 256) * 2 * rings * world // SHRINK
            for causal in (False, True):
                placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
                cases = [(torch.bfloat16,) + sc for sc in SCHEDULES] + ([(torch.float32, "home", "4")] if causal else [])
                for dtype, route, chunks in cases:
                    os.environ[DKV_ROUTE_ENV], os.environ[DKV_CHUNKS_ENV] = route, chunks
                    errs: dict = {}
                    run_case(lambda q, k, v: spx.ring_attention(q, k, v, g, variant=variant, causal=causal,
                                                                placement=spx.balanced_placement(variant, causal)),
                             rank, world, b=1, s=s, h=h, hkv=hkv, d=d, dtype=dtype, causal=causal, seed=n,
                             shard=_shard(placement), device=DEV, errors=errs)
                    rec.append({"family": "ring_rotation",
                                "case": f"P={world} {variant} dkv={route} C={chunks} {dtype} causal={causal} "
                                        f"{placement} s={s} h={h}/{hkv} d={d}", "errs": errs, "tol": TOL[dtype]})
                    n += 1
    finally:
        os.environ.pop(DKV_ROUTE_ENV, None)
        os.environ.pop(DKV_CHUNKS_ENV, None)
    return rec
