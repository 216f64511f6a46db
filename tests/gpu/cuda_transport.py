"""CUDA-suite worker for the copy-engine transports and torch's fused symm_mem matmuls (#70 item 5):
``transport_family(rank, world)``, one rank per GPU over NCCL (what these paths need: CUDA tensors, an NCCL group,
torch symmetric memory).

Ported from tools/gpu_check.py (removed in f734073; its symm_mem / copy_engine / fused all-gather sections ran on
4 x H200 on 2026-11-21/22 and were never in the suite):
  ulysses   for each transport ("symm_mem": copy-engine pulls between barrier kernels; "copy_engine": pulls ordered
            by stream-memory flags, no kernel) and each shape (even heads, causal zigzag with HCMS chunks, GQA,
            uneven heads at P=4), bf16: three records
              vs float64     out / dq / dk / dv against the float64 reference (tests/sp_check.run_case), tol 2e-2
              bitwise        out of the transport against NCCL's, tol 0, and dk / dv where a second NCCL run gives
                             the same bits as the first (``*_nccl_rerun`` beside them)
              dq             the transport's dq against NCCL's, tol max(5 x NCCL's own run-to-run difference,
                             1e-4) (the attention backward accumulates dq with atomics), and dk / dv where NCCL's
                             own rerun differs (FA4's GQA backward sums a group's q heads with atomics)
  async     the async QKV block (HCMS C=2) through each transport: output bitwise equal to NCCL's
  allgather the all-gather QKV block with torch's fused all-gather / reduce-scatter matmuls (fused=True) against
            the float64 block (tests/blocks.reference_case: output, input and every parameter gradient), GQA with
            kv < P, HCMS chunks, causal zigzag; fp32 (tol 1e-4) and bf16 (tol 3e-2)
A path that cannot run here (the library's own reason: CPU tensors, a gloo group, NCCL_P2P_DISABLE=1, no stream
memory operations) gives records with "refused": the suite judges them failed, so over NCCL they must run.

Dry run on the CPU (tests/test_cuda_transport_worker.py): SPX_SUITE_DEVICE=cpu SPX_SUITE_SHRINK=16; every record
refused with its reason, or with SPX_TRANSPORT_STAND_IN=nccl the NCCL path standing in for every transport and
fused=False for the fused matmuls (the worker's control flow and judging, not the transports).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from tests.reference import TOL, rel_err
from tests.sp_check import run_case

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
SHRINK = int(os.environ.get("SPX_SUITE_SHRINK", "1"))
TRANSPORTS = ("symm_mem", "copy_engine")
# (h, hkv, causal, chunks, S): even heads; causal zigzag with HCMS chunks; GQA; uneven heads at P=4 (6 over 4)
SHAPES = ((8, 8, False, 1, 4096), (8, 8, True, 2, 4096), (12, 4, False, 2, 2048), (6, 6, False, 1, 2048))


def _stand_in() -> Optional[str]:
    return os.environ.get("SPX_TRANSPORT_STAND_IN") or None


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")


def why_not(name: str, group, device: torch.device) -> Optional[str]:
    """The library's reason why transport ``name`` ("symm_mem", "copy_engine") or the fused matmuls ("fused")
    cannot run here; None when they can."""
    from megatron_sp_ext.comm.transport import copy_engine_unavailable_reason, symm_mem_unavailable_reason
    from megatron_sp_ext.sp.layers.allgather import fused_ops_unavailable_reason
    return {"symm_mem": symm_mem_unavailable_reason, "copy_engine": copy_engine_unavailable_reason,
            "fused": fused_ops_unavailable_reason}[name](group, device)


def _ulysses(rec: list, rank: int, world: int, group, dev: torch.device, transport: str, why: Optional[str],
             seed: int) -> None:
    use = _stand_in() or transport
    d = 128 if SHRINK == 1 else 16
    for i, (h, hkv, causal, chunks, s) in enumerate(SHAPES):
        if chunks > max(1, h // world):
            continue
        s //= SHRINK
        s -= s % (2 * world)
        placement = "zigzag" if causal else "contiguous"
        tag = (f"P={world} {transport} ulysses C={chunks} bf16 H={h}/{hkv} causal={causal} {placement} s={s} "
               f"d={d}")
        names = [f"{tag}: vs float64", f"{tag}: out (dk/dv if deterministic) bitwise vs nccl",
                 f"{tag}: dq (dk/dv if not) vs nccl"]
        if why is not None:
            rec.extend({"family": "transport", "case": n, "errs": {}, "tol": 0.0, "refused": why} for n in names)
            continue
        from tests.gpu.cuda_suite import _shard

        def run(tr, errors=None):
            return run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, group, head_chunks=chunks, causal=causal,
                                                                  placement=placement, transport=tr),
                            rank, world, b=1, s=s, h=h, hkv=hkv, d=d, dtype=torch.bfloat16, causal=causal,
                            seed=seed + i, shard=_shard(placement), device=str(dev), errors=errors)
        errs: dict = {}
        base, again, got = run("nccl"), run("nccl"), run(use, errs)
        rec.append({"family": "transport", "case": names[0], "errs": errs, "tol": TOL[torch.bfloat16]})
        # bitwise: out, and dk / dv where NCCL's own rerun is bitwise; a dk / dv the kernel accumulates with atomics
        # (FA4's GQA backward sums the q heads of a group: its rerun differs, H100 2026-11-27) is judged like dq
        bitwise, loose, noise = {}, {"dq": rel_err(got[1], base[1])}, {"dq": rel_err(again[1], base[1])}
        for j, name in ((0, "out"), (2, "dk"), (3, "dv")):
            rerun = rel_err(again[j], base[j])
            if name == "out" or rerun == 0.0:
                bitwise[name], bitwise[f"{name}_nccl_rerun"] = rel_err(got[j], base[j]), rerun
            else:
                loose[name], noise[name] = rel_err(got[j], base[j]), rerun
        rec.append({"family": "transport", "case": names[1], "errs": bitwise, "tol": 0.0})
        rec.append({"family": "transport", "case": names[2], "errs": loose, "tol": max(5 * max(noise.values()), 1e-4),
                    "nccl_rerun": noise})


def _async_block(rec: list, world: int, group, dev: torch.device, transport: str, why: Optional[str]) -> None:
    dim, h, d, sl = (1536, 12, 128, 2048) if SHRINK == 1 else (48, 12, 16, 32)
    case = f"P={world} {transport} async block C=2 bf16 H={h} d={d} S_local={sl}: output bitwise vs nccl"
    if why is not None:
        rec.append({"family": "transport", "case": case, "errs": {}, "tol": 0.0, "refused": why})
        return
    g = torch.Generator(device=dev).manual_seed(3 + dist.get_rank())
    x = torch.randn(1, sl, dim, device=dev, dtype=torch.bfloat16, generator=g)
    w_qkv = torch.randn(3 * h * d, dim, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    w_o = torch.randn(dim, h * d, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    outs = [spx.async_ulysses_self_attention(x, spx.LayerWeights(w_qkv, w_o), group, num_heads=h, num_kv_heads=h,
                                             prep=lambda br, y, w: y.view(1, sl, h, d), head_chunks=2, transport=tr)
            for tr in ("nccl", "nccl", _stand_in() or transport)]
    rec.append({"family": "transport", "case": case,
                "errs": {"out": rel_err(outs[2], outs[0]), "out_nccl_rerun": rel_err(outs[1], outs[0])}, "tol": 0.0})


def _allgather_fused(rec: list, rank: int, world: int, dev: torch.device, why: Optional[str]) -> None:
    from tests.blocks import reference_case
    fused = False if _stand_in() else True
    for (h, hkv, c, causal) in ((8, 8, 1, False), (8, 8, 2, True), (8, 2, 1, False), (12, 4, 2, True)):
        if c > h // world:
            continue
        placement = "zigzag" if causal else "contiguous"
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            case = (f"P={world} all-gather block, fused symm_mem matmuls, {dtype} H={h}/{hkv} C={c} causal={causal} "
                    f"{placement}: vs float64")
            if why is not None:
                rec.append({"family": "allgather-fused", "case": case, "errs": {}, "tol": tol, "refused": why})
                continue
            errs = reference_case(rank, world, "allgather", h, hkv, 64, c, True, causal, placement, device=str(dev),
                                  dtype=dtype, check=False, fused=fused)
            rec.append({"family": "allgather-fused", "case": case, "errs": errs, "tol": tol})


def transport_family(rank: int, world: int) -> list:
    group, dev, rec = dist.group.WORLD, _device(), []
    for n, transport in enumerate(TRANSPORTS):
        why = None if _stand_in() else why_not(transport, group, dev)
        _ulysses(rec, rank, world, group, dev, transport, why, seed=100 * n)
        _async_block(rec, world, group, dev, transport, why)
    _allgather_fused(rec, rank, world, dev, None if _stand_in() else why_not("fused", group, dev))
    return rec
