"""CUDA-suite worker for the one ring (#50): ``one_ring_family(rank, world)``.

The block-masked ring and TASP run through the same plan, Function and point-to-point path as the dense ring: a
random per-head mask in bf16, the SAME device mask tensor changed in place between calls (the plan cache must not
serve the old plan), a dense call between two masked ones, and the mask on the host while q is on the GPU (the
plan keeps its own device copy). out, dq, dk, dv against the float64 masked reference on the device
(``cuda_block_sparse.record``; its SPX_SUITE_DEVICE / SPX_SUITE_SHRINK). Records: ring and TASP x (masked, changed
in place, dense, masked again, host mask) = 10. Dry run on the CPU: SPX_SUITE_DEVICE=cpu SPX_SUITE_SHRINK=16
(tests/test_one_ring.py runs it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.attention import block_sparse as bsp
from megatron_sp_ext.topology.hamiltonian import routing_tables
from tests.gpu import cuda_block_sparse as cbs
from tests.gpu.cuda_suite import use_ring_route
from tests.test_block_sparse import random_mask


def one_ring_family(rank: int, world: int) -> list:
    use_ring_route()
    g, rec, n = dist.group.WORLD, [], 0
    dev = torch.device("cuda", torch.cuda.current_device()) if cbs.DEV == "cuda" else torch.device("cpu")
    bs, d = (48, 64) if cbs.SHRINK == 1 else (7, 16)
    for variant, causal, placement in (("ring", True, "zigzag"), ("tasp", False, "contiguous")):
        rings = len(routing_tables(world).cycles) if variant == "tasp" else 1
        s = 2 * world * rings * max(4, 250 // cbs.SHRINK)
        t = bsp.num_tiles(s, bs)
        bm = random_mask(world + 7, 8, t).to(dev)  # one device tensor for the whole sequence of calls

        def run(case, mask, ref_mask):
            nonlocal n
            cbs.record(rec, f"one-ring {variant} {case} kernel=math", lambda a, b, c, _m: spx.ring_attention(
                a, b, c, g, variant=variant, causal=causal, placement=placement, block_mask=mask, block_size=bs),
                rank, world, s=s, h=8, hkv=2, d=d, bs=bs, bm=ref_mask.cpu(), causal=causal, placement=placement,
                dtype=torch.bfloat16, seed=n)
            n += 1
        run("masked", bm, bm.clone())
        bm.copy_(random_mask(world + 8, 8, t).to(dev))  # in place: same tensor, new contents
        run("mask changed in place", bm, bm.clone())
        run("dense between", None, torch.ones(1, t, t, dtype=torch.bool))
        bm[:, :, : t // 2] = False
        run("masked again (changed)", bm, bm.clone())
        host = random_mask(world + 9, 8, t)  # on the host, q on the device
        run("host mask", host, host.clone())
    return rec
