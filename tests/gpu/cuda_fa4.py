"""The CUDA suite's fa4 family: every mode with ``backend="fa4"`` named (the real FlashAttention-4 kernel), against a
float64 reference (output and every input gradient), with FA4 and cuDNN calls of equal shapes interleaved in one
process (the call-order check: state kept between calls must not leak across kernels).

Modes: Ulysses and HCMS (C = 1, 2, both layouts, zero-copy q|k|v views), ring and TASP (causal in their zigzag
placements and not, both dK|dV schedules: traveling accumulator and rotation), the usp/tas meshes and torus (P=4 as
2 machines of 2), key padding (kv_valid_len), packed samples (per_sample and fa4_varlen), GQA and uneven heads, bf16
and fp16. Records as in tests/gpu/cuda_suite.py. Needs flash-attn-4 on an SM90/SM100 GPU: tests/gpu/test_cuda.py skips it
with that reason unless SPX_REQUIRE_FA4=1 (set by tools/gpu_run.sh when it installed FA4), where a missing FA4 fails.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.attention import backends
from megatron_sp_ext.sp.placement import pieces
from tests.gpu.cuda_suite import DEV, SHRINK, use_ring_route
from tests.reference import TOL, pad_mask
from tests.sp_check import run_case

BF16, FP16 = torch.bfloat16, torch.float16


def _shard(placement):
    def shard(x, r, w):
        return torch.cat([x[:, a:a + n] for a, n in pieces(placement, r, w, x.shape[1])], dim=1)
    return shard


def _case(rec, name, attn, rank, world, *, dtype=BF16, causal, placement="contiguous", layout="bshd", s, h=8, hkv=8,
          d=128, seed=0, pad=0, segments=None, shard=None):
    s //= SHRINK
    errs, mask, rows = {}, None, None
    if pad:
        mask, rows = pad_mask(s, s - pad, causal), s - pad
    run_case(attn, rank, world, b=1, s=s, h=h, hkv=hkv, d=d, dtype=dtype, causal=causal, layout=layout, seed=seed,
             shard=shard or _shard(placement), mask=mask, device=DEV, compare_rows=rows, segments=segments,
             errors=errs)
    rec.append({"family": "fa4", "case": f"P={world} {name} {dtype} causal={causal} {placement} {layout} s={s} "
                                         f"h={h}/{hkv} d={d}{f' kv_valid_len={s - pad}' if pad else ''}",
                "errs": errs, "tol": TOL[dtype]})


def fa4_family(rank: int, world: int) -> list:
    use_ring_route()
    g, rec, n = dist.group.WORLD, [], 0
    s = 4096   # float64 reference: S^2 H 8 bytes per rank
    # the plain differentiable call (what the one-device DiT core makes), every rank on the full sequence
    for causal, (h, hkv) in ((False, (8, 8)), (True, (8, 2))):
        _case(rec, "plain fa4 call", lambda q, k, v: backends.get_backend("fa4")(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=None).transpose(1, 2),
            rank, world, causal=causal, s=s, h=h, hkv=hkv, seed=n, shard=lambda x, r, w: x)
        n += 1
    # Ulysses / HCMS, FA4 and cuDNN interleaved on equal shapes (both layouts, chunkings, zero-copy views)
    for (h, hkv) in ((8, 8), (12, 4)):
        for causal, placement in ((False, "contiguous"), (True, "zigzag"), (True, "contiguous")):
            for backend, layout, c, contig in (("fa4", "bshd", 1, True), ("cudnn", "bshd", 1, True),
                                               ("fa4", "sbhd", 2, True), ("fa4", "bshd", 2, False)):
                _case(rec, f"ulysses C={c} {backend} qkv_contiguous={contig}", lambda q, k, v: spx.ulysses_attention(
                    q, k, v, g, head_chunks=c, causal=causal, layout=layout, placement=placement, backend=backend,
                    qkv_contiguous=contig), rank, world, causal=causal, placement=placement, layout=layout, s=s,
                    h=h, hkv=hkv, seed=n)
                n += 1
    _case(rec, "ulysses C=1 fa4 fp16", lambda q, k, v: spx.ulysses_attention(q, k, v, g, causal=True, backend="fa4"),
          rank, world, dtype=FP16, causal=True, s=s, seed=n)
    # ring / TASP, both backward schedules
    for variant in ("ring", "tasp"):
        rs = 4096   # 2,048 * P until 2026-11-28: at P=4 (8,192 tokens) the four ranks' float64 references
        # (S^2 H 8 bytes each, and their backward) overran one 80 GB H100 (OOM in r11_66a); 1,024 per rank at P=4
        for causal in (False, True):
            placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
            for (h, hkv), backend, route in (((8, 8), "fa4", "home"), ((8, 8), "cudnn", "home"),
                                             ((8, 2), "fa4", "travel")):
                os.environ["SPX_RING_DKV"] = route   # the dK|dV schedule (sp/ring/rotation.py)
                _case(rec, f"{variant} {backend} dkv={route}", lambda q, k, v: spx.ring_attention(
                    q, k, v, g, variant=variant, causal=causal, placement=placement, backend=backend),
                    rank, world, causal=causal, placement=placement, s=rs, h=h, hkv=hkv, seed=n)
                os.environ.pop("SPX_RING_DKV")
                n += 1
            _case(rec, f"{variant} fa4 kv padding", lambda q, k, v: spx.ring_attention(
                q, k, v, g, variant=variant, causal=causal, placement=placement, backend="fa4",
                kv_valid_len=q.shape[1] * world - 40), rank, world, causal=causal, placement=placement, s=rs, seed=n,
                pad=40)
            n += 1
    # meshes at P=4 as 2 x 2
    if world == 4:
        for (h, hkv) in ((8, 2),):
            meshes = {pl: spx.build_sp_mesh(g, num_heads=h, placement=pl, ulysses_size=2, nodes=2)
                      for pl in ("usp", "tas")}
            for causal in (False, True):
                placement = "zigzag" if causal else "contiguous"
                for name, mesh in meshes.items():
                    _case(rec, f"hybrid-{name} fa4", lambda q, k, v: spx.hybrid_attention(
                        q, k, v, mesh, causal=causal, placement=placement, backend="fa4"),
                        rank, world, causal=causal, placement=placement, s=2048, h=h, hkv=hkv, seed=n)
                    n += 1
                _case(rec, "torus tas fa4", lambda q, k, v: spx.torus_attention(
                    q, k, v, meshes["tas"], causal=causal, placement=placement, backend="fa4"),
                    rank, world, causal=causal, placement=placement, s=2048, h=h, hkv=hkv, seed=n)
                n += 1
    # key padding and packed samples through Ulysses
    _case(rec, "ulysses fa4 kv padding", lambda q, k, v: spx.ulysses_attention(
        q, k, v, g, causal=True, backend="fa4", kv_valid_len=q.shape[1] * world - 40), rank, world, causal=True,
        s=s, seed=n, pad=40)
    lengths = [m * world * 64 // SHRINK for m in (5, 2, 9)]
    cu = [0]
    for m in lengths:
        cu.append(cu[-1] + m)
    cu_t = torch.tensor(cu)
    shard = lambda x, r, w: torch.cat([x[:, a + r * (e - a) // w:a + (r + 1) * (e - a) // w]  # noqa: E731
                                       for a, e in zip(cu, cu[1:])], dim=1)
    for causal in (False, True):
        for method in ("per_sample", "fa4_varlen"):
            _case(rec, f"ulysses packed {method}", lambda q, k, v: spx.ulysses_attention(
                q, k, v, g, causal=causal, backend="fa4", cu_seqlens=cu_t, varlen_kernel=method),
                rank, world, causal=causal, s=cu[-1] * SHRINK, h=8, hkv=2, seed=n, segments=cu, shard=shard)
            n += 1
        _case(rec, "ring packed fa4", lambda q, k, v: spx.ring_attention(
            q, k, v, g, causal=causal, backend="fa4", cu_seqlens=cu_t, placement="contiguous"),
            rank, world, causal=causal, s=cu[-1] * SHRINK, h=8, hkv=2, seed=n, segments=cu, shard=shard)
        n += 1
    return rec
