"""CUDA-suite worker for packed variable-length samples (cu_seqlens) in the ring family: ring and TASP (causal in
the per-sample zigzag placement, non-causal contiguous), bf16 (fp32 on a subset), GQA, both layouts; at P=4 also
hybrid (usp with the ring, tas with TASP) and torus (tas) as 2 emulated machines x 2. Against the float64 reference
with a block-diagonal (per-sample, causal inside) mask (tests/sp_check.run_case); also sample lengths that divide
by neither P nor 2P (padded per sample). Family "ring_varlen": 20 cases at P=2, 28 at P=4.

Records follow tests/gpu/cuda_suite.py: {"family", "case", "errs": {name: rel_err}, "tol"}. With gloo on one GPU
every rank is its own emulated machine (the ring's hops take the host-staged transport, as cuda_suite's ring
family does); SPX_SUITE_DEVICE=cpu SPX_SUITE_SHRINK=16 runs the same worker on forked gloo ranks.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from tests.reference import TOL
from tests.packed_reference import sharder
from tests.sp_check import run_case

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
SHRINK = int(os.environ.get("SPX_SUITE_SHRINK", "1"))
BF16, FP32 = torch.bfloat16, torch.float32
MULTS = (5, 2, 9, 1)  # sample lengths in units of (divisor * 32 / SHRINK): three clip sizes and a short one


def packed_cu(world: int, placement: str) -> list:
    div = world if placement == "contiguous" else 2 * world
    cu = [0]
    for m in MULTS:
        cu.append(cu[-1] + m * div * max(1, 32 // SHRINK))
    return cu


def ragged_cu() -> list:
    """Sample lengths that divide by neither P nor 2P (each padded at its tail; the padding kept apart)."""
    cu = [0]
    for m, e in ((5, 1), (2, -3), (9, 7), (0, 1), (1, 5)):  # (0, 1): a one-token sample
        cu.append(cu[-1] + m * 64 // SHRINK + e)
    return cu


def _one(rec: list, case: str, attn, rank: int, world: int, *, causal: bool, dtype, h: int, hkv: int,
         layout: str, seed: int, ragged: bool = False) -> None:
    placement = "zigzag" if causal else "contiguous"
    cu = ragged_cu() if ragged else packed_cu(world, placement)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    errs: dict = {}
    run_case(lambda q, k, v: attn(q, k, v, cu_t.to(q.device)), rank, world, b=1, s=cu[-1], h=h, hkv=hkv, d=64,
             dtype=dtype, causal=causal, layout=layout, seed=seed, shard=sharder(cu, placement), segments=cu,
             device=DEV, errors=errs)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    rec.append({"family": "ring_varlen", "case": f"P={world} {case} lengths={lengths} {placement} causal={causal} "
                f"h={h}/{hkv} {layout} {dtype}", "errs": errs, "tol": TOL[dtype]})


def ring_varlen_family(rank: int, world: int) -> list:
    if dist.get_backend() == "gloo":  # one GPU: the ring's hops through the host-staged transport
        os.environ["SPX_EMULATED_MACHINE_SIZE"] = "1"
    g, rec, n = dist.group.WORLD, [], 0
    for variant in ("ring", "tasp"):
        for causal in (False, True):
            cases = [(BF16, 8, 8, "bshd", False), (BF16, 8, 2, "bshd", False), (BF16, 8, 8, "sbhd", False),
                     (FP32, 8, 8, "bshd", False), (BF16, 8, 2, "bshd", True)]
            for dtype, h, hkv, layout, ragged in cases:
                _one(rec, variant, lambda q, k, v, c, variant=variant, causal=causal, layout=layout:
                     spx.ring_attention(q, k, v, g, variant=variant, causal=causal,
                                        placement=spx.balanced_placement(variant, causal, packed=True), layout=layout,
                                            cu_seqlens=c),
                     rank, world, causal=causal, dtype=dtype, h=h, hkv=hkv, layout=layout, seed=n, ragged=ragged)
                n += 1
    if world == 4:  # 2 emulated machines x 2
        for causal in (False, True):
            for pl, variant in (("usp", "ring"), ("tas", "tasp")):
                mesh = spx.build_sp_mesh(g, num_heads=8, placement=pl, ulysses_size=2, nodes=2)
                _one(rec, f"hybrid-{pl} {variant} C=2", lambda q, k, v, c, mesh=mesh, variant=variant, causal=causal:
                     spx.hybrid_attention(q, k, v, mesh, head_chunks=2, ring_variant=variant, causal=causal,
                                          placement=spx.balanced_placement("ring", causal),
                                          cu_seqlens=c),
                     rank, world, causal=causal, dtype=BF16, h=8, hkv=2, layout="bshd", seed=n)
                n += 1
            mesh = spx.build_sp_mesh(g, num_heads=8, placement="tas", ulysses_size=2, nodes=2)
            for ragged in (False, True):
                _one(rec, "torus tas 2x2", lambda q, k, v, c, mesh=mesh, causal=causal:
                     spx.torus_attention(q, k, v, mesh, causal=causal, placement=spx.balanced_placement("ring",
                                         causal), layout="sbhd", cu_seqlens=c),
                     rank, world, causal=causal, dtype=BF16, h=8, hkv=8, layout="sbhd", seed=n, ragged=ragged)
                n += 1
    return rec


if __name__ == "__main__":  # CPU dry run: SPX_SUITE_DEVICE=cpu SPX_SUITE_SHRINK=16 python -m tests.gpu.cuda_ring_varlen
    from tests.harness import run_ranks
    from tests.gpu.suite_judge import merge_ranks, worst_item
    for w in (2, 4):
        merged = merge_ranks(run_ranks(ring_varlen_family, w, timeout=600))
        for m in merged:
            print(("ok " if m["ok"] else "BAD"), m["case"], f"{worst_item(m['errs'])[1]:.2e}", m["why"])
        print(f"P={w}: {len(merged)} records")
