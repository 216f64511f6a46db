"""Single-GPU check of the local attention kernels with log-sum-exp (the ring's building block).

1. correctness: each kernel of megatron_sp_ext.attention.lse_kernels (cudnn, flash) on a
   ring-step-like case (q block x 2 kv blocks merged by lse, backward per block with the FINAL out/lse,
   kv as strided views of a [S, 2, B, Hkv, D] slot buffer, GQA, causal and not) vs a float64 reference
   (autograd through plain softmax attention); also whether cuDNN takes GQA k/v without expansion.
2. kernel times (bf16, B=1, D=128): each kernel fwd and bwd vs the floor = plain
   F.scaled_dot_product_attention on the same shape (fwd, fwd+bwd).
3. one ring rank's compute, emulated (no exchange): the local calls + lse merges + per-block backward
   that rank 0 of a P=2/4 ring does (non-causal contiguous; causal zigzag: step 0 one causal call over
   the local [chunk r, chunk 2P-1-r], then half-blocks), vs the floor of that rank (H/P heads over the
   full sequence, one SDPA call).
Writes gpu_kernel_check.json to --out. Usage: python3 tests/gpu/gpu_kernel_check.py --out $OUT [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron_sp_ext.attention import lse_kernels as lk  # noqa: E402
from megatron_sp_ext.attention.lse import merge_into  # noqa: E402
from megatron_sp_ext.sp.calibration import time_ms  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16


def timed(fn, iters=5, warmup=2) -> float:
    """Median ms of ``iters`` event-timed calls after ``warmup``."""
    return time_ms(fn, iters, warmup, None, long_ms=None)


def _ref(q, k, v, causal, scale):
    """float64 autograd reference (GQA by repeat)."""
    rep = q.shape[1] // k.shape[1]
    k2, v2 = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k2.transpose(-1, -2)) * scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v2, torch.logsumexp(s, -1)


def check_case(kernel, h, hkv, s, causal, d=128, seed=0):
    """Ring-step-like case: q attends two kv blocks held as strided views of [S, 2, B, Hkv, D] buffers:
    kv1 (earlier positions, fully visible) and kv0 (the diagonal block: causal if ``causal``). Partial
    results merge by lse; each block's backward gets the FINAL out/lse. Returns errors vs float64
    (relative max for out and grads, absolute for lse)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    scale = 1 / math.sqrt(d)
    q = torch.randn(1, h, s, d, device=DEV, generator=g)
    kv0 = torch.randn(s, 2, 1, hkv, d, device=DEV, generator=g)
    kv1 = torch.randn(s, 2, 1, hkv, d, device=DEV, generator=g)
    do = torch.randn(1, h, s, d, device=DEV, generator=g)
    # float64 reference: keys = [kv1 (earlier, all visible), kv0 (diagonal)]
    q64 = q.double().requires_grad_()
    k64 = torch.cat([kv1[:, 0], kv0[:, 0]]).permute(1, 2, 0, 3).double().requires_grad_()
    v64 = torch.cat([kv1[:, 1], kv0[:, 1]]).permute(1, 2, 0, 3).double().requires_grad_()
    rep = h // hkv
    s_ = (q64 @ k64.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    if causal:
        m = torch.ones(s, 2 * s, dtype=torch.bool, device=DEV)
        m[:, s:] = torch.ones(s, s, dtype=torch.bool, device=DEV).tril()
        s_ = s_.masked_fill(~m, float("-inf"))
    lse_ref = torch.logsumexp(s_, -1).detach()
    o_ref = torch.softmax(s_, -1) @ v64.repeat_interleave(rep, 1)
    o_ref.backward(do.double())
    # kernel path in bf16 with strided views of a slot buffer
    qb, dob = q.to(BF16), do.to(BF16)
    buf0, buf1 = kv0.to(BF16), kv1.to(BF16)
    view = lambda b, i: b[:, i].permute(1, 2, 0, 3)  # noqa: E731
    acc = torch.zeros(1, h, s, d, device=DEV)
    lse = torch.full((1, h, s), float("-inf"), device=DEV)
    o0, l0 = lk.forward(kernel, qb, view(buf0, 0), view(buf0, 1), scale, causal)
    o1, l1 = lk.forward(kernel, qb, view(buf1, 0), view(buf1, 1), scale, False)
    merge_into(acc, lse, o0, l0)
    merge_into(acc, lse, o1, l1)
    out = acc.to(BF16)
    g0 = lk.backward(kernel, dob, qb, view(buf0, 0), view(buf0, 1), out, lse, scale, causal)
    g1 = lk.backward(kernel, dob, qb, view(buf1, 0), view(buf1, 1), out, lse, scale, False)
    dq = g0[0].float() + g1[0].float()
    dk = torch.cat([g1[1], g0[1]], 2).float()
    dv = torch.cat([g1[2], g0[2]], 2).float()

    def err(a, b):
        b = b.detach()
        return float((a.detach().double() - b).abs().max() / (b.abs().max() + 1e-12))
    errs = {"out": err(out, o_ref), "lse": float((lse.double() - lse_ref).abs().max()),
            "dq": err(dq, q64.grad), "dk": err(dk, k64.grad), "dv": err(dv, v64.grad)}
    return errs


def slice_case(kernel, h=8, s=2048, d=128):
    """A ring step's q/out/dO are seq-slices of bigger tensors (not contiguous): same results as on copies?"""
    scale = 1 / math.sqrt(d)
    qb, dob = (torch.randn(1, h, 2 * s, d, device=DEV, dtype=BF16) for _ in range(2))
    k, v = (torch.randn(1, h, s, d, device=DEV, dtype=BF16) for _ in range(2))
    q, do = qb[:, :, s:], dob[:, :, s:]
    o1, l1 = lk.forward(kernel, q, k, v, scale, False)
    o2, l2 = lk.forward(kernel, q.contiguous(), k, v, scale, False)
    ob = torch.empty(1, h, 2 * s, d, device=DEV, dtype=BF16)
    ob[:, :, s:] = o1
    lb = torch.empty(1, h, 2 * s, device=DEV)
    lb[:, :, s:] = l1
    g1 = lk.backward(kernel, do, q, k, v, ob[:, :, s:], lb[:, :, s:], scale, False)
    g2 = lk.backward(kernel, do.contiguous(), q.contiguous(), k, v, o2, l2, scale, False)
    errs = [float((a.float() - b.float()).abs().max()) for a, b in zip((o1, l1) + tuple(g1), (o2, l2) + tuple(g2))]
    return max(errs)


def native_gqa_cudnn(h=8, hkv=2, s=512, d=128):
    """Does the cuDNN op accept k/v with fewer heads (no expansion)? Returns (ok, max err vs expanded)."""
    q = torch.randn(1, h, s, d, device=DEV, dtype=BF16)
    k, v = (torch.randn(1, hkv, s, d, device=DEV, dtype=BF16) for _ in range(2))
    try:
        o = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)[0]
    except RuntimeError as e:
        return False, str(e).splitlines()[0]
    o2, _ = lk.forward("cudnn", q, k, v, 1 / math.sqrt(d), False)
    return True, float((o.float() - o2.float()).abs().max())


def kernel_times(h, s, d=128, causal=False, kernels=("cudnn", "flash")):
    scale = 1 / math.sqrt(d)
    q, k, v = (torch.randn(1, h, s, d, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    row = {"H": h, "S": s, "causal": causal}
    with torch.no_grad():
        row["floor_fwd"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))

    def fb():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o.backward(do)
    row["floor_fwdbwd"] = timed(fb)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    for kern in kernels:
        if not lk.available(kern, torch.device(DEV), BF16):
            row[kern] = "unavailable"
            continue
        o, lse = lk.forward(kern, qd, kd, vd, scale, causal)
        f = timed(lambda: lk.forward(kern, qd, kd, vd, scale, causal))
        b = timed(lambda: lk.backward(kern, do, qd, kd, vd, o, lse, scale, causal))
        row[kern] = {"fwd": f, "bwd": b, "fwdbwd": f + b, "fwd_ratio": f / row["floor_fwd"],
                     "fwdbwd_ratio": (f + b) / row["floor_fwdbwd"]}
    return row


def ring_rank_emulation(h, seqlen, world, causal, kernel, d=128, rank=0):
    """Rank ``rank``'s compute in a ``world``-rank ring (zigzag for causal), no exchange. Returns ms."""
    scale = 1 / math.sqrt(d)
    s_loc = seqlen // world
    q = torch.randn(1, h, s_loc, d, device=DEV, dtype=BF16)
    do = torch.randn_like(q)
    bufs = [torch.randn(s_loc, 2, 1, h, d, device=DEV, dtype=BF16) for _ in range(2)]
    view = lambda b: (b[:, 0].permute(1, 2, 0, 3), b[:, 1].permute(1, 2, 0, 3))  # noqa: E731
    half = s_loc // 2
    acc = torch.zeros(1, h, s_loc, d, device=DEV)
    lse = torch.full((1, h, s_loc), float("-inf"), device=DEV)
    dq = torch.zeros(1, h, s_loc, d, device=DEV)
    dkv = torch.zeros(s_loc, 2, 1, h, d, device=DEV)

    def steps():
        """(q row slice, kv row slice, causal) per step for rank ``rank`` (origin = rank - step)."""
        out = []
        for st in range(world):
            o = (rank - st) % world
            if not causal:
                out.append([(slice(None), slice(None), False)])
            elif o == rank:
                out.append([(slice(None), slice(None), True)])
            elif o < rank:
                out.append([(slice(None), slice(0, half), False)])
            else:
                out.append([(slice(half, None), slice(None), False)])
        return out
    plan = steps()

    def fwd():
        acc.zero_()
        lse.fill_(float("-inf"))
        for st, items in enumerate(plan):
            k, v = view(bufs[st % 2])
            for qs, ks, c in items:
                o, l_ = lk.forward(kernel, q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, c)
                merge_into(acc[:, :, qs], lse[:, :, qs], o, l_)
        return acc.to(BF16)

    out = fwd()

    def bwd():
        dq.zero_()
        for st, items in enumerate(plan):
            k, v = view(bufs[st % 2])
            dkv.zero_()
            for qs, ks, c in items:
                gq, gk, gv = lk.backward(kernel, do[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                         out[:, :, qs], lse[:, :, qs], scale, c)
                dq[:, :, qs].add_(gq)
                dkv[ks, 0].add_(gk.permute(2, 0, 1, 3))
                dkv[ks, 1].add_(gv.permute(2, 0, 1, 3))

    tf = timed(fwd, iters=3, warmup=1)
    tb = timed(bwd, iters=3, warmup=1)
    return tf, tb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_kernel_check_out"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    rep = {"date": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()), "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "command": " ".join(sys.argv), "schema_ok": {k: lk.schema_ok(k) for k in lk.KERNELS},
           "available_bf16": {k: lk.available(k, torch.device(DEV), BF16) for k in lk.KERNELS},
           "best_bf16": lk.best(torch.device(DEV), BF16)}
    rep["probe"] = {}
    for kern in ("cudnn", "flash"):   # the availability probe's own verdict or error, for the record
        try:
            rep["probe"][kern] = lk._probe(kern, torch.device(DEV), BF16)
        except Exception as e:  # noqa: BLE001 - recorded
            rep["probe"][kern] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *(torch.randn(1, 2, 128, 128, device=DEV, dtype=BF16) for _ in range(3)), None, True, 0.0, False, False)
    rep["cudnn_lse_shape"] = list(res[1].shape)
    rep["cudnn_lse_stride"] = list(res[1].stride())
    print(json.dumps({k: rep[k] for k in ("device", "torch", "schema_ok", "available_bf16", "probe",
                                          "cudnn_lse_shape")}))
    # 1. correctness
    corr, ok_all = [], True
    tol = {"out": 2e-2, "lse": 2e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2}
    for kern in ("cudnn", "flash"):
        if not rep["available_bf16"][kern]:
            corr.append({"kernel": kern, "skipped": "unavailable"})
            continue
        for (h, hkv, s) in [(8, 8, 1024), (8, 2, 1000), (20, 4, 2048)]:
            for causal in (False, True):
                try:
                    errs = check_case(kern, h, hkv, s, causal)
                    ok = all(errs[k] < tol[k] for k in tol)
                except Exception:  # noqa: BLE001 - recorded in the report
                    errs, ok = {"error": traceback.format_exc(limit=3)}, False
                ok_all &= ok
                corr.append({"kernel": kern, "H": h, "Hkv": hkv, "S": s, "causal": causal, "ok": ok, **errs})
                print(f"[correct] {kern:9s} H{h}/{hkv} S{s} causal={causal}: {'OK' if ok else 'FAIL'} {errs}",
                      flush=True)
    rep["slices"] = {}
    for kern in ("cudnn", "flash"):
        if rep["available_bf16"][kern]:
            try:
                e = slice_case(kern)
                rep["slices"][kern] = {"max_abs_diff_vs_contiguous": e, "ok": e < 2e-2}
            except Exception:  # noqa: BLE001 - recorded in the report
                rep["slices"][kern] = {"error": traceback.format_exc(limit=3), "ok": False}
            ok_all &= rep["slices"][kern]["ok"]
            print(f"[slices] {kern}: {rep['slices'][kern]}", flush=True)
    rep["correctness"], rep["correct_ok"] = corr, ok_all
    rep["cudnn_native_gqa"] = native_gqa_cudnn() if rep["available_bf16"]["cudnn"] else None
    # 2. kernel times
    shapes = [(20, 8192), (40, 16384), (20, 32768)] if args.quick else \
        [(20, 8192), (40, 8192), (20, 16384), (40, 16384), (20, 32768), (40, 32768)]
    rep["kernels"] = []
    for h, s in shapes:
        for causal in (False, True):
            row = kernel_times(h, s, causal=causal)
            rep["kernels"].append(row)
            print("[kernel]", json.dumps(row), flush=True)
    # 3. ring-rank emulation
    rep["ring_emulation"] = []
    cases = [(40, 32768, 2), (40, 32768, 4)] + ([] if args.quick else [(40, 65536, 2)])
    for h, L, P in cases:
        for causal in (False, True):
            q, k, v = (torch.randn(1, h // P, L, 128, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            with torch.no_grad():
                ff = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), iters=3, warmup=1)

            def fb():
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(do)
            ffb = timed(fb, iters=3, warmup=1)
            del q, k, v, do
            row = {"H": h, "L": L, "P": P, "causal": causal, "floor_fwd": ff, "floor_fwdbwd": ffb}
            for kern in ("cudnn", "flash"):
                if rep["available_bf16"][kern]:
                    tf, tb = ring_rank_emulation(h, L, P, causal, kern)
                    row[kern] = {"fwd": tf, "fwdbwd": tf + tb, "fwd_ratio": tf / ff, "fwdbwd_ratio": (tf + tb) / ffb}
            rep["ring_emulation"].append(row)
            print("[ring-rank]", json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    rep["wall_s"] = time.time() - t0
    path = os.path.join(args.out, "gpu_kernel_check.json")
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"correctness {'OK' if ok_all else 'FAIL'}; wrote {path} in {rep['wall_s']:.0f} s")
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
