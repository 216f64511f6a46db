"""CUDA-suite worker for block-sparse attention (#45): ``block_sparse_family(rank, world)``.

Ulysses / HCMS (C = 1, 2) with a block mask run the flex_attention path on CUDA (fp16/bf16/fp32; the kernel is
named in each case), the ring runs its skip schedule on the math block kernel: a random per-head mask (one empty
query-tile row) and a 1D window mask, causal (zigzag) and not (contiguous), GQA 8/2 and 8/8, bf16 (fp32 on a
subset), S not a multiple of block_size. out, dq, dk, dv against a float64 masked reference computed on the device.
Records as in tests/gpu/cuda_suite.py: 2 (masks) x 2 (causal) x 2 (head layouts) x 3 (ulysses C=1, hcms C=2, ring) in
bf16 + 2 (causal) x 2 (ulysses C=1, ring) in fp32 = 28; at P=4 also hybrid (usp, C=2) and torus (tas) on 2 simulated
machines of 2, and TASP (tasp_zigzag when causal), causal and not, bf16: 34. Dry run on the CPU: SPX_SUITE_DEVICE=cpu SPX_SUITE_SHRINK=16 (every Ulysses case then runs
the math kernel; tests/test_block_sparse.py runs it).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.attention import backends
from megatron_sp_ext.attention import block_sparse as bsp
from megatron_sp_ext.sp.placement import positions
from tests.gpu.cuda_suite import use_ring_route
from tests.reference import TOL, make_qkv, rel_err
from tests.gpu.suite_judge import progress
from tests.test_block_sparse import keep_tokens, masked_reference, random_mask, window_mask

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
SHRINK = int(os.environ.get("SPX_SUITE_SHRINK", "1"))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")


def record(rec, case, fn, rank, world, *, s, h, hkv, d, bs, bm, causal, placement, dtype, seed,
           family="block_sparse"):
    dev = _device()
    q, k, v, do = (t.to(dev) for t in make_qkv(seed, 1, s, h, hkv, d, torch.float64))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = masked_reference(qr, kr, vr, keep_tokens(bm, s, bs, causal).to(dev))
    ref.backward(do)
    pos = positions(placement, rank, world, s).to(dev)
    mine = [t[:, pos].to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*mine, bm.to(dev))
    out.backward(do[:, pos].to(dtype))
    errs = {"out": rel_err(out, ref[:, pos]), "dq": rel_err(mine[0].grad, qr.grad[:, pos]),
            "dk": rel_err(mine[1].grad, kr.grad[:, pos]), "dv": rel_err(mine[2].grad, vr.grad[:, pos])}
    rec.append({"family": family, "case": f"P={world} {case} {dtype} causal={causal} {placement} s={s} "
                                                  f"bs={bs} h={h}/{hkv} d={d}", "errs": errs, "tol": TOL[dtype]})
    progress(rec[-1], rank)


def block_sparse_family(rank: int, world: int) -> list:
    use_ring_route()
    g, rec, n = dist.group.WORLD, [], 0
    s = 2 * world * 2 * max(4, 250 // SHRINK)  # tasp_zigzag at P=4: 2 rings
    bs, d = (48, 64) if SHRINK == 1 else (7, 16)
    t = bsp.num_tiles(s, bs)
    dev = _device()
    for dtype in (torch.bfloat16, torch.float32):
        kern = bsp.resolve_kernel("auto", dev, dtype)
        for mask_name, bm in (("random", random_mask(world, 8, t)), ("window", window_mask(t, 2))):
            for causal in (False, True):
                placement = "zigzag" if causal else "contiguous"
                for h, hkv in ((8, 2), (8, 8)):
                    if dtype == torch.float32 and (mask_name != "random" or h != hkv):
                        continue  # fp32: one mask, one head layout
                    for name, fn in (
                            (f"ulysses C=1 kernel={kern}", lambda a, b, c, m: spx.ulysses_attention(
                                a, b, c, g, causal=causal, placement=placement, block_mask=m, block_size=bs)),
                            (f"hcms C=2 kernel={kern}", lambda a, b, c, m: spx.ulysses_attention(
                                a, b, c, g, head_chunks=2, causal=causal, placement=placement, block_mask=m,
                                block_size=bs)),
                            ("ring kernel=math", lambda a, b, c, m: spx.ring_attention(
                                a, b, c, g, causal=causal, placement=placement, block_mask=m, block_size=bs))):
                        if dtype == torch.float32 and not name.startswith(("ulysses", "ring")):
                            continue
                        record(rec, f"{name} mask={mask_name}", fn, rank, world, s=s, h=h, hkv=hkv, d=d, bs=bs,
                                bm=bm, causal=causal, placement=placement, dtype=dtype, seed=n)
                        n += 1
    if world == 4:  # meshes as 2 simulated machines of 2 (as cuda_suite.mesh_family): usp (C=2) and torus (tas)
        meshes = {pl: spx.build_sp_mesh(g, num_heads=8, placement=pl, ulysses_size=2, nodes=2) for pl in ("usp", "tas")}
        bm = random_mask(world + 1, 8, t)
        for causal in (False, True):
            placement = "tasp_zigzag" if causal else "contiguous"
            record(rec, "tasp kernel=math mask=random", lambda a, b, c, m: spx.ring_attention(
                a, b, c, g, variant="tasp", causal=causal, placement=placement, block_mask=m, block_size=bs),
                rank, world, s=s, h=8, hkv=2, d=d, bs=bs, bm=bm, causal=causal, placement=placement,
                dtype=torch.bfloat16, seed=n)
            n += 1
            placement = "zigzag" if causal else "contiguous"
            for name, fn in (
                    ("hybrid-usp C=2", lambda a, b, c, m: spx.hybrid_attention(
                        a, b, c, meshes["usp"], head_chunks=2, causal=causal, placement=placement, block_mask=m,
                        block_size=bs)),
                    ("torus tas 2x2", lambda a, b, c, m: spx.torus_attention(
                        a, b, c, meshes["tas"], causal=causal, placement=placement, block_mask=m, block_size=bs))):
                record(rec, f"{name} kernel=math mask=random", fn, rank, world, s=s, h=8, hkv=2, d=d, bs=bs, bm=bm,
                        causal=causal, placement=placement, dtype=torch.bfloat16, seed=n)
                n += 1
    return rec


def fa4_block_sparse_family(rank: int, world: int) -> list:
    """#53: every mode on FlashAttention-4's own block sparsity (backend="fa4" named, so a call FA4 cannot run fails
    instead of moving to another kernel): 128-token tiles (full kernel blocks) and 64-token tiles (partial blocks
    through the mask_mod); masks random per head with an empty query-tile row, a window, all-True; causal (zigzag /
    tasp_zigzag) and not (contiguous); GQA 8/2; bf16. out, dq, dk, dv against float64. P=2: ulysses, hcms (C=2),
    ring, the factory's auto: 2 tiles x (2 masks + all-True at 128) x 2 causal x 4 = 40. P=4 also tasp, usp (C=2),
    torus (tas): 70."""
    s = (2048 if world == 2 else 3072) // SHRINK   # zigzag pieces of 128 at P=2/4; tasp_zigzag: 2P(P-1) | s at P=4
    return named_kernel_family(rank, world, "fa4", "fa4", s=s, d=64, all_true_tiles=(128,))


def cudnn_block_sparse_family(rank: int, world: int) -> list:
    """#69: every mode on cuDNN frontend's block-sparse attention (the backend "auto" with its tile_setting
    "cudnn_block_sparse": every block-sparse call on it, and a call it cannot run fails instead of moving to another
    kernel): 128- and 64-token tiles (its native blocks); masks random
    per head with an empty query-tile row, a window, all-True (at both tiles); causal (zigzag / tasp_zigzag: the
    diagonal blocks on FA4, merged by lse) and not (contiguous); GQA 8/2 (k/v expanded for its MHA backward); bf16,
    head dim 128 (its SM90 backward's). out, dq, dk, dv against float64. P=2: ulysses, hcms (C=2), ring, the
    factory's auto: 2 tiles x 3 masks x 2 causal x 4 = 48. P=4 also tasp, usp (C=2), torus (tas): 84. Every rank's rows stay whole 64-token
    blocks (tasp_zigzag's 2P(P-1) pieces of 128 at P=4; CPU dry runs shrink s to pieces of 64)."""
    s = (2048 if world == 2 else 3072) // (min(SHRINK, 4) if world == 2 else min(SHRINK, 2))
    be = backends.with_tile_kernel("auto", "cudnn_block_sparse")
    return named_kernel_family(rank, world, "cudnn_block_sparse", be, s=s, d=128 if DEV == "cuda" else 16,
                               all_true_tiles=(128, 64))


FAMILY_OF_KERNEL = {"fa4": "fa4_block_sparse", "cudnn_block_sparse": "cudnn_block_sparse"}
# the named-kernel families' cases (CPU dry runs narrow them to stay fast): tile sizes, mask names, (q heads, kv heads)
TILES = (128, 64)
MASKS = ("random", "window", "all")
HEADS = (8, 2)
CAUSAL = (False, True)
MODES = None   # None: every mode of the world size; else the names to run


def _auto(group, h: int, hkv: int, placement: str, backend):
    """The factory's mode "auto" (SPAttention: block-sparse calls calibrated with their mask) on ``backend``."""
    from megatron_sp_ext.config import SPConfig  # noqa: PLC0415
    from megatron_sp_ext.sp.factory import SPResources, make_attention  # noqa: PLC0415
    cfg = SPConfig(mode="auto")
    return make_attention(cfg, group, num_heads=h, num_kv_heads=hkv, placement=placement, backend=backend,
                          resources=SPResources(cfg))


def named_kernel_family(rank: int, world: int, kernel: str, backend, *, s: int, d: int,
                        all_true_tiles: tuple) -> list:
    """Every mode with ``backend`` (whose block-sparse calls run on ``kernel`` alone), block-sparse (the cases of
    ``fa4_block_sparse_family``), records of family ``FAMILY_OF_KERNEL[kernel]``."""
    use_ring_route()
    g = dist.group.WORLD
    rec, n = [], 0
    h, hkv = HEADS
    meshes = {}
    if world == 4:
        meshes = {pl: spx.build_sp_mesh(g, num_heads=h, placement=pl, ulysses_size=2, nodes=2) for pl in ("usp", "tas")}
    for bs in TILES:
        t = bsp.num_tiles(s, bs)
        masks = [("random", random_mask(world + bs, h, t)), ("window", window_mask(t, 2))]
        if bs in all_true_tiles:
            masks.append(("all", torch.ones(1, t, t, dtype=torch.bool)))
        for mask_name, bm in [m for m in masks if m[0] in MASKS]:
            if mask_name == "random":
                bm = bm.clone()
                bm[:, 1] = False   # a query tile with no key: out 0, lse -inf, zero gradients
            for causal in CAUSAL:
                placement = "zigzag" if causal else "contiguous"
                kw = dict(causal=causal, placement=placement, block_size=bs, backend=backend)
                modes = [("ulysses C=1", lambda a, b, c, m: spx.ulysses_attention(a, b, c, g, block_mask=m, **kw)),
                         ("hcms C=2", lambda a, b, c, m: spx.ulysses_attention(a, b, c, g, head_chunks=2,
                                                                                block_mask=m, **kw)),
                         ("ring", lambda a, b, c, m: spx.ring_attention(a, b, c, g, block_mask=m, **kw))]
                # the factory's "auto": over NCCL it times Ulysses/HCMS, the ring and TASP with the mask and runs the
                # fastest (gloo on CUDA has no point-to-point path: its baseline); a fresh one per case
                modes.append(("auto", lambda a, b, c, m, cz=causal, pl=placement, bsz=bs: _auto(
                    g, h, hkv, pl, backend)(a, b, c, causal=cz, block_mask=m, block_size=bsz)))
                if world == 4:
                    tkw = dict(kw, placement="tasp_zigzag" if causal else "contiguous")
                    modes += [("tasp", lambda a, b, c, m: spx.ring_attention(a, b, c, g, variant="tasp",
                                                                             block_mask=m, **tkw)),
                              ("usp C=2", lambda a, b, c, m: spx.hybrid_attention(a, b, c, meshes["usp"],
                                                                                  head_chunks=2, block_mask=m, **kw)),
                              ("torus tas", lambda a, b, c, m: spx.torus_attention(a, b, c, meshes["tas"],
                                                                                   block_mask=m, **kw))]
                for name, fn in [m for m in modes if MODES is None or m[0] in MODES]:
                    pl = "tasp_zigzag" if name == "tasp" and causal else placement
                    record(rec, f"{kernel} {name} mask={mask_name}", fn, rank, world, s=s, h=h, hkv=hkv, d=d, bs=bs,
                           bm=bm, causal=causal, placement=pl, dtype=torch.bfloat16, seed=n,
                           family=FAMILY_OF_KERNEL[kernel])
                    n += 1
    return rec
