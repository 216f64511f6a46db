"""The CUDA suite's per-rank workers: every algorithm's CUDA branches against a float64 reference.

Each worker runs on every rank of a group (``tests/harness.run_ranks(..., device="cuda")``: P ranks on one GPU
over gloo, or one rank per GPU over NCCL), runs its cases in a fixed order (cases of equal shapes one after the
other in different placements / chunkings, so state kept between calls is exercised) and returns one record per
case: {"family", "case", "errs": {name: relative error}, "tol"} (optional "refused": why the case is not judged).
Inputs, reference (float64, on the GPU) and the comparison are tests/sp_check.run_case's. ``tests/gpu/test_cuda.py``
judges the records (tests/gpu/suite_judge.py: finite errors within a finite tolerance) and writes them out.

With gloo on one GPU the ring family's point-to-point hops cannot go through gloo (its send/recv of CUDA
tensors fails); every rank is then declared its own machine (SPX_EMULATED_MACHINE_SIZE=1), so the ring's hops
take the library's host-staged transport (comm/host_staged.py) while the ring's own code is what runs.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.sp.placement import pieces
from megatron_sp_ext.topology.hamiltonian import routing_tables
from tests.reference import TOL, pad_mask, rel_diff
from tests.sp_check import run_case

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# a dry run of the same workers on the CPU (forked gloo ranks) at 1/SPX_SUITE_SHRINK of the sequence lengths
DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
SHRINK = int(os.environ.get("SPX_SUITE_SHRINK", "1"))


def _shard(placement):
    def shard(x, r, w):
        return torch.cat([x[:, a:a + n] for a, n in pieces(placement, r, w, x.shape[1])], dim=1)
    return shard


def _one(records, family, case, attn, rank, world, *, dtype, causal, placement="contiguous", layout="bshd",
         b=1, s, h, hkv, d, seed=0, pad=0):
    errs: dict = {}
    mask = compare_rows = None
    s //= SHRINK
    if pad:  # the last ``pad`` keys are padding: attn gets kv_valid_len=s - pad, padded query rows are not compared
        mask, compare_rows = pad_mask(s, s - pad, causal), s - pad
        case += f" kv_valid_len={s - pad}"
    run_case(attn, rank, world, b=b, s=s, h=h, hkv=hkv, d=d, dtype=dtype, causal=causal, layout=layout,
             seed=seed, shard=_shard(placement), mask=mask, device=DEV, compare_rows=compare_rows, errors=errs)
    records.append({"family": family, "case": f"P={world} {case} {dtype} causal={causal} {placement} {layout} "
                                              f"b={b} s={s} h={h}/{hkv} d={d}", "errs": errs, "tol": TOL[dtype]})


def _valid(q_bshd: torch.Tensor, world: int, pad: int) -> int:
    """kv_valid_len leaving the last ``pad`` tokens of the full sequence as padding (q: this rank's bshd shard)."""
    return q_bshd.shape[1] * world - pad


# (b, S total, h, hkv, d), S divisible by 2 P (P - 1) for tasp_zigzag at P=4: even heads; uneven for P=4 (6) and P=2 (5); GQA; GQA with kv < P and B=2
ULYSSES_SHAPES = [(1, 4608, 8, 8, 64), (1, 4608, 6, 6, 64), (1, 4608, 5, 5, 128), (1, 4608, 12, 4, 64),
                  (2, 2304, 8, 2, 128)]


def ulysses_family(rank: int, world: int) -> list:
    """Ulysses and HCMS (C = 1..4 and auto), every placement, causal and not, both layouts, GQA, uneven heads,
    bf16 (fp16 / fp32 on a subset), key padding, the zero-copy q|k|v views (qkv_contiguous=False)."""
    g, rec, n = dist.group.WORLD, [], 0
    for (b, s, h, hkv, d) in ULYSSES_SHAPES:
        chunk_list = [c for c in (1, 2, 3, 4) if c <= h // world] + ["auto"]
        for causal in (False, True):
            for placement in (("contiguous", "zigzag", "tasp_zigzag") if causal else ("contiguous",)):
                for layout in ("bshd", "sbhd"):
                    for c in chunk_list:
                        if layout == "sbhd" and c not in (1, 2):
                            continue
                        _one(rec, "ulysses", f"C={c}", lambda q, k, v: spx.ulysses_attention(
                            q, k, v, g, head_chunks=c, causal=causal, layout=layout, placement=placement),
                            rank, world, dtype=BF16, causal=causal, placement=placement, layout=layout,
                            b=b, s=s, h=h, hkv=hkv, d=d, seed=n)
                        n += 1
    b, s, h, hkv, d = 1, 2048, 8, 8, 64
    for dtype in (FP16, FP32):
        for causal, placement in ((False, "contiguous"), (True, "zigzag")):
            for c in (1, 2):
                _one(rec, "ulysses", f"C={c}", lambda q, k, v: spx.ulysses_attention(
                    q, k, v, g, head_chunks=c, causal=causal, placement=placement),
                    rank, world, dtype=dtype, causal=causal, placement=placement, s=s, h=h, hkv=hkv, d=d, seed=n)
                n += 1
    for causal, placement in ((False, "contiguous"), (True, "zigzag"), (True, "contiguous")):
        for c in (1, 2):
            _one(rec, "ulysses", f"C={c} qkv_contiguous=False", lambda q, k, v: spx.ulysses_attention(
                q, k, v, g, head_chunks=c, causal=causal, placement=placement, qkv_contiguous=False),
                rank, world, dtype=BF16, causal=causal, placement=placement, s=s, h=h, hkv=hkv, d=d, seed=n)
            _one(rec, "ulysses", f"C={c}", lambda q, k, v: spx.ulysses_attention(
                q, k, v, g, head_chunks=c, causal=causal, placement=placement, kv_valid_len=_valid(q, world, 40)),
                rank, world, dtype=BF16, causal=causal, placement=placement, s=s, h=h, hkv=hkv, d=d, seed=n, pad=40)
            n += 1
    return rec


def call_order(rank: int, world: int) -> list:
    """The 2026-11-24 defect's sequence: causal Ulysses, one head chunk, the same shapes in contiguous then zigzag
    placement, then auto (whose calibration runs other calls), then zigzag again; both layouts, bf16."""
    g, rec = dist.group.WORLD, []
    b, s, h, hkv, d = 1, 4608, 8, 8, 128
    for layout in ("sbhd", "bshd"):
        for placement, c in (("contiguous", 1), ("zigzag", 1), ("zigzag", "auto"), ("tasp_zigzag", 1),
                             ("zigzag", 1), ("contiguous", 2), ("zigzag", 2)):
            _one(rec, "order", f"C={c}", lambda q, k, v: spx.ulysses_attention(
                q, k, v, g, head_chunks=c, causal=True, layout=layout, placement=placement),
                rank, world, dtype=BF16, causal=True, placement=placement, layout=layout, b=b, s=s, h=h, hkv=hkv,
                d=d, seed=5)
    return rec


def packed_family(rank: int, world: int) -> list:
    """Ulysses on pre-packed q|k|v (pack_qkv + packed_ulysses_attention): causal and not, contiguous and
    zigzag, HCMS chunks, GQA, bf16."""
    from megatron_sp_ext.sp.ulysses.packed import packable, packed_head_layout  # noqa: PLC0415
    g, rec, n = dist.group.WORLD, [], 0
    for (b, s, h, hkv, d) in ((1, 4096, 8, 8, 64), (1, 4096, 8, 2, 128), (2, 2048, 12, 4, 64)):
        for causal, placement in ((False, "contiguous"), (True, "zigzag"), (True, "contiguous")):
            for c in (1, 2):
                if not packable(h, hkv, world, c):
                    continue

                def attn(q, k, v, c=c, h=h, hkv=hkv, causal=causal, placement=placement):
                    hl = packed_head_layout(h, hkv, world, c)
                    return spx.packed_ulysses_attention(spx.pack_qkv(q, k, v, hl), g, num_heads=h, num_kv_heads=hkv,
                                                        head_chunks=c, causal=causal, placement=placement)
                _one(rec, "packed", f"C={c}", attn, rank, world, dtype=BF16, causal=causal, placement=placement,
                     b=b, s=s, h=h, hkv=hkv, d=d, seed=n)
                n += 1
    return rec


def use_ring_route() -> None:
    """gloo on one GPU: the ring family's hops through the host-staged transport (see module docstring)."""
    if dist.get_backend() == "gloo":
        os.environ["SPX_EMULATED_MACHINE_SIZE"] = "1"


def ring_family(rank: int, world: int) -> list:
    """Ring and TASP: causal in their zigzag placements and not, both layouts, GQA, bf16 and fp32, padding."""
    use_ring_route()
    g, rec, n = dist.group.WORLD, [], 0
    for variant in ("ring", "tasp"):
        rings = len(routing_tables(world).cycles) if variant == "tasp" else 1
        s = (512 if variant == "ring" else 256) * 2 * rings * world  # float64 reference: ~S^2 H 8 B per rank
        for (b, h, hkv, d) in ((1, 8, 8, 64), (1, 8, 2, 128), (2, 6, 6, 64)):
            for dtype in (BF16, FP32) if h == 8 and hkv == 8 else (BF16,):
                for causal in (False, True):
                    placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
                    for layout in ("bshd", "sbhd"):
                        _one(rec, variant, "", lambda q, k, v: spx.ring_attention(
                            q, k, v, g, variant=variant, causal=causal, placement=spx.balanced_placement(variant,
                                causal), layout=layout),
                            rank, world, dtype=dtype, causal=causal, placement=placement, layout=layout,
                            b=b, s=s, h=h, hkv=hkv, d=d, seed=n)
                        n += 1
        for causal in (False, True):
            placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"
            _one(rec, variant, "", lambda q, k, v: spx.ring_attention(
                q, k, v, g, variant=variant, causal=causal, placement=placement, kv_valid_len=_valid(q, world, 40)),
                rank, world, dtype=BF16, causal=causal, placement=placement, s=s, h=8, hkv=8, d=64, seed=n, pad=40)
            n += 1
    return rec


def mesh_family(rank: int, world: int) -> list:
    """Ulysses x ring meshes at P=4 as 2 simulated machines of 2: usp, tas (hybrid, ring and tasp inside),
    torus, and the mesh's auto placement; causal (zigzag) and not, GQA, bf16."""
    use_ring_route()
    g, rec, n = dist.group.WORLD, [], 0
    s = 2048
    for (h, hkv) in ((8, 8), (8, 2)):
        meshes = {pl: spx.build_sp_mesh(g, num_heads=h, placement=pl, ulysses_size=2, nodes=2) for pl in ("usp", "tas")}
        meshes["auto"] = spx.build_sp_mesh(g, num_heads=h, placement="auto", nodes=2)
        for causal in (False, True):
            placement = "zigzag" if causal else "contiguous"
            for name, mesh in meshes.items():
                for variant, c in (("ring", 1), ("tasp", 2)):
                    _one(rec, f"hybrid-{name}", f"{variant} C={c}", lambda q, k, v: spx.hybrid_attention(
                        q, k, v, mesh, head_chunks=c, ring_variant=variant, causal=causal, placement=placement),
                        rank, world, dtype=BF16, causal=causal, placement=placement, s=s, h=h, hkv=hkv, d=64, seed=n)
                    n += 1
            for layout in ("bshd", "sbhd"):
                _one(rec, "torus", "tas 2x2", lambda q, k, v: spx.torus_attention(
                    q, k, v, meshes["tas"], causal=causal, layout=layout, placement=placement),
                    rank, world, dtype=BF16, causal=causal, placement=placement, layout=layout, s=s, h=h, hkv=hkv,
                    d=64, seed=n)
                n += 1
    return rec


def block_family(rank: int, world: int) -> list:
    """The attention-block forms (async QKV, all-gather QKV): output, input and parameter gradients against the
    float64 block on the full sequence; run in float64 (the CUDA stream schedule) and bf16 (cuDNN kernels)."""
    from tests.blocks import reference_case  # noqa: PLC0415
    rec = []
    for dtype, tol in ((torch.float64, 1e-10), (BF16, 2e-2)):
        for form in ("async", "allgather"):
            for (h, hkv, chunks, qk_norm, causal, placement, kv_valid) in (
                    (8, 8, 1, True, False, "contiguous", None), (8, 2, 2, False, True, "zigzag", None),
                    (8, 4, 2, True, True, "zigzag", 5 * world)):
                if h // world < chunks:
                    continue
                errs = reference_case(rank, world, form, h, hkv, 64, chunks, qk_norm, causal, placement, kv_valid,
                                      device=DEV, dtype=dtype, check=False)
                rec.append({"family": f"block-{form}", "case": f"P={world} {dtype} H={h}/{hkv} C={chunks} "
                            f"norm={qk_norm} causal={causal} {placement} kv_valid={kv_valid}", "errs": errs,
                            "tol": tol})
    return rec


FAMILIES = {"ulysses": ulysses_family, "order": call_order, "packed": packed_family, "ring": ring_family,
            "mesh": mesh_family, "block": block_family}


def dropout_family(rank: int, world: int) -> list:
    """Attention dropout in the Ulysses family on CUDA (the SDPA kernel's own dropout): applied (the output
    differs from p=0) and one mask for forward and backward: for a fixed mask the output is linear in v, so with
    the same seed <dO, out(v + eps u) - out(v)> == eps <dv, u> (summed over ranks). fp32 and bf16."""
    g, rec = dist.group.WORLD, []
    # for a fixed mask the output is exactly linear in v, so eps can be large: eps = 1 keeps bf16 rounding of the
    # outputs (~4e-3 of |out|) far below the signal; a different mask in backward gives errors of order 1
    for dtype, eps, tol in ((FP32, 1.0, 1e-3), (BF16, 1.0, 3e-2)):
        gen = torch.Generator().manual_seed(1 + rank)
        q, k, v, u, go = (torch.randn(1, 1024 // SHRINK, 8, 64, generator=gen).to(DEV, dtype) for _ in range(5))
        for c in (1, 2):
            ref = spx.ulysses_attention(q, k, v, g, head_chunks=c)
            torch.manual_seed(7)
            dropped = spx.ulysses_attention(q, k, v, g, head_chunks=c, dropout_p=0.3)
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            torch.manual_seed(11)
            out = spx.ulysses_attention(qq, kk, vv, g, head_chunks=c, dropout_p=0.3)
            out.backward(go)
            torch.manual_seed(11)
            out2 = spx.ulysses_attention(q, k, v + eps * u, g, head_chunks=c, dropout_p=0.3)
            sums = torch.stack([(go.double() * (out2.double() - out.detach().double())).sum(),
                                eps * (vv.grad.double() * u.double()).sum(),
                                (dropped.double() - ref.double()).abs().max()])
            dist.all_reduce(sums)   # on the tensors' device: NCCL has no CPU backend (2 x H200, 2026-11-29)
            sums = sums.cpu()
            rec.append({"family": "dropout", "case": f"P={world} C={c} dropout_p=0.3 {dtype} s={1024 // SHRINK}",
                        "errs": {"fwd_bwd_mask": rel_diff(sums[0].item(), sums[1].item()),
                                 # not "< 1e-2": a NaN difference would count as applied
                                 "not_applied": float(not sums[2].item() >= 1e-2)}, "tol": tol})
    return rec


FAMILIES["dropout"] = dropout_family


def varlen_family(rank: int, world: int) -> list:
    """Packed variable-length samples (cu_seqlens, B=1): Ulysses and HCMS, contiguous and zigzag per-sample
    placement, causal and not, GQA, both layouts, bf16, sample lengths that divide by P (2P) and that do not
    (padded); against a float64 reference with a block-diagonal mask (padding rows: zero in and out)."""
    g, rec, n = dist.group.WORLD, [], 0
    for placement, ragged in (("contiguous", False), ("zigzag", False), ("contiguous", True), ("zigzag", True)):
        div = world if placement == "contiguous" else 2 * world
        lengths = [m * div * 64 // SHRINK for m in (5, 2, 9)]  # three clip sizes
        if ragged:  # lengths that divide by neither P nor 2P: each sample padded at its tail, padding kept apart
            lengths = [m * 64 // SHRINK + e for m, e in ((5, 1), (2, -3), (9, 7))]
        cu = [0]
        for ln in lengths:
            cu.append(cu[-1] + ln)
        cu_t = torch.tensor(cu, dtype=torch.int32)

        def shard(x, r, w, placement=placement, cu_t=cu_t):
            return spx.shard_sequence(x, g, placement=placement, seq_dim=1, cu_seqlens=cu_t.to(x.device))
        for causal in (False, True):
            for (h, hkv) in (((8, 2),) if ragged else ((8, 8), (8, 2))):
                for c in (1, 2):
                    for layout in (("bshd", "sbhd") if c == 1 and not ragged else ("bshd",)):
                        errs: dict = {}
                        run_case(lambda q, k, v: spx.ulysses_attention(
                            q, k, v, g, head_chunks=c, causal=causal, layout=layout, placement=placement,
                            cu_seqlens=cu_t.to(q.device)), rank, world, b=1, s=cu[-1], h=h, hkv=hkv, d=64,
                            dtype=BF16, causal=causal, layout=layout, seed=n, shard=shard,
                            segments=cu, device=DEV, errors=errs)
                        rec.append({"family": "varlen", "case": f"P={world} C={c} lengths={lengths} {placement} "
                                    f"causal={causal} h={h}/{hkv} {layout} bf16", "errs": errs, "tol": TOL[BF16]})
                        n += 1
    return rec


FAMILIES["varlen"] = varlen_family
