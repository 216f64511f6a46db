"""Correctness on CUDA/NCCL: the CPU test cases re-run on GPUs with real streams.

For each world size: every Ulysses/HCMS case of tests/test_ulysses.py against the float64
reference (fp32 and bf16), and HCMS bit-identical to plain Ulysses (bf16, real comm stream),
plus ring/tasp cases when those exist. Prints one line per group of cases and writes
``gpu_check.json`` to --out. Usage: python tools/gpu_check.py --world-sizes 2,4 --out $OUT
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.gpu_ranks import init_nccl_rank, spawn  # noqa: E402



def _bitwise_hcms(rank, world, group):
    """HCMS == Ulysses bit for bit on CUDA with real streams, for out, dk and dv. torch's flash
    backward accumulates dq with atomics, so dq is not repeatable even for plain Ulysses run twice;
    for dq we check that (recorded) and that HCMS's dq is within that run-to-run noise."""
    import megatron_sp_ext as spx  # noqa: PLC0415
    from megatron_sp_ext.sp.heads import head_layout  # noqa: PLC0415
    fails, notes = [], []
    for (h, hkv, causal, sl) in [(40, 40, False, 4096), (40, 40, True, 4096), (24, 8, False, 2048), (6, 6, False, 1024)]:
        if h // world < 2:
            continue
        g = torch.Generator(device="cuda").manual_seed(7)
        q = torch.randn(1, sl, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, sl, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        go = torch.randn_like(q)

        def run(c):
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            o = spx.ulysses_attention(qs, ks, vs, group, head_chunks=c, causal=causal)
            o.backward(go)
            return (o, qs.grad, ks.grad, vs.grad)
        base, again = run(1), run(1)
        dq_noise = ((again[1].float() - base[1].float()).norm() / base[1].float().norm()).item()
        notes.append(f"H={h}/{hkv} causal={causal}: plain Ulysses dq run-to-run rel diff {dq_noise:.2e}"
                     f" (bitwise repeatable: {torch.equal(again[1], base[1])})")
        for c in (2, 3, 4):
            if c > h // world:
                continue
            res = run(c)
            same_kv = head_layout(h, hkv, world, c).kv_repeat == head_layout(h, hkv, world, 1).kv_repeat
            for name, a, b in zip(("out", "dq", "dk", "dv"), res, base):
                if name == "dq":
                    err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                    if not torch.equal(a, b) and (torch.equal(again[1], base[1]) or err > max(5 * dq_noise, 1e-6)):
                        fails.append(f"H={h}/{hkv} causal={causal} C={c} dq differs beyond kernel noise ({err:.2e})")
                elif (same_kv or name == "out") and not torch.equal(a, b):
                    fails.append(f"H={h}/{hkv} causal={causal} C={c} {name} not bitwise equal")
    return fails, notes


def _bitwise_transport(rank, world, group, transport="symm_mem"):
    """A copy-engine transport (symm_mem, copy_engine) gives the NCCL result bit for bit: out, dk, dv for plain
    Ulysses and HCMS (even heads, uneven heads, GQA, causal); dq within the flash kernel's run-to-run
    noise (atomics). Also the async block's output."""
    import megatron_sp_ext as spx  # noqa: PLC0415
    from megatron_sp_ext.sp.async_block import async_ulysses_self_attention  # noqa: PLC0415
    fails, notes = [], []
    for (h, hkv, causal, sl) in [(40, 40, False, 4096), (40, 40, True, 2048), (24, 8, False, 2048), (6, 6, False, 1024)]:
        g = torch.Generator(device="cuda").manual_seed(9)
        q = torch.randn(1, sl, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, sl, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        go = torch.randn_like(q)

        def run(c, tr):
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            o = spx.ulysses_attention(qs, ks, vs, group, head_chunks=c, causal=causal, transport=tr)
            o.backward(go)
            return (o, qs.grad, ks.grad, vs.grad)
        for c in (1, 2, 3):
            if c > max(1, h // world):
                continue
            base, again, res = run(c, "nccl"), run(c, "nccl"), run(c, transport)
            noise = ((again[1].float() - base[1].float()).norm() / base[1].float().norm()).item()
            for name, a, b in zip(("out", "dq", "dk", "dv"), res, base):
                if name == "dq":
                    err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                    # flash's dq atomics: run-to-run noise seen up to 2.6e-5 (sometimes ~0 in one sample)
                    if not torch.equal(a, b) and err > max(5 * noise, 1e-4):
                        fails.append(f"H={h}/{hkv} C={c} {transport} dq beyond kernel noise ({err:.2e} vs {noise:.2e})")
                elif not torch.equal(a, b):
                    fails.append(f"H={h}/{hkv} causal={causal} C={c} {transport} {name} not bitwise equal")
            notes.append(f"H={h}/{hkv} causal={causal} C={c}: checked (dq noise {noise:.1e})")
    dim, h, d, sl = 1536, 12, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, sl, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    w_qkv = torch.randn(3 * h * d, dim, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w_o = torch.randn(dim, h * d, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    outs = [async_ulysses_self_attention(x, w_qkv, None, w_o, None, group, num_heads=h, num_kv_heads=h,
                                         prep=lambda br, y, w: y.view(1, sl, h, d), head_chunks=2, transport=tr)
            for tr in ("nccl", transport)]
    if not torch.equal(outs[0], outs[1]):
        fails.append(f"async block output differs between nccl and {transport}")
    notes.append("async block (C=2) output: checked")
    return fails, notes


def _bitwise_zigzag(rank, world, group, device="cuda", dtype=torch.bfloat16, sizes=None):
    """Causal Ulysses/HCMS in the zigzag and tasp_zigzag layouts run the same kernel on the same global-order
    data as the contiguous layout: out, dk, dv must be bit-identical to contiguous (after the placement's
    permutation), dq within the kernel's run-to-run noise. Also: the zero-copy send path (B=1, NCCL, the
    kernel's results sent in place) == the copying path bit for bit."""
    import megatron_sp_ext as spx  # noqa: PLC0415
    from megatron_sp_ext.sp.placement import divisor, pieces  # noqa: PLC0415
    from tests.test_ulysses_order import CopyingNccl, RecordingNccl  # noqa: PLC0415
    fails, notes = [], []
    for (h, hkv, sl) in sizes or [(40, 40, 4096), (24, 8, 2048), (6, 6, 1024)]:
        if h < world:
            continue
        unit = divisor("tasp_zigzag", world)
        s = sl * world - (sl * world) % unit
        g = torch.Generator(device=device).manual_seed(11)
        q = torch.randn(1, s, h, 128, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(1, s, hkv, 128, device=device, dtype=dtype, generator=g) for _ in range(2))
        go = torch.randn_like(q)

        def shard(x, pl):
            return torch.cat([x[:, a:a + n] for a, n in pieces(pl, rank, world, s)], dim=1)

        def run(pl, c, tr="nccl"):
            qs, ks, vs = (shard(t, pl).clone().requires_grad_() for t in (q, k, v))
            o = spx.ulysses_attention(qs, ks, vs, group, head_chunks=c, causal=True, placement=pl, transport=tr)
            o.backward(shard(go, pl))
            res = [o, qs.grad, ks.grad, vs.grad]
            return [spx.unshard_sequence(t, group, placement=pl) for t in res]  # global order everywhere
        base, again = run("contiguous", 1), run("contiguous", 1)
        noise = ((again[1].float() - base[1].float()).norm() / base[1].float().norm()).item()
        for pl in ("zigzag", "tasp_zigzag"):
            for c in (1, 2):
                if c > h // world:
                    continue
                for name, a, b in zip(("out", "dq", "dk", "dv"), run(pl, c), base):
                    if name == "dq":
                        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                        if not torch.equal(a, b) and err > max(5 * noise, 1e-6):
                            fails.append(f"H={h}/{hkv} {pl} C={c} dq beyond kernel noise ({err:.2e} vs {noise:.2e})")
                    elif not torch.equal(a, b):
                        same_kv = c == 1 or hkv == h  # HCMS may replicate kv heads differently (GQA): order
                        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                        if same_kv or err > 1e-2:
                            fails.append(f"H={h}/{hkv} {pl} C={c} {name} not bitwise equal to contiguous ({err:.1e})")
                notes.append(f"H={h}/{hkv} {pl} C={c}: checked against contiguous (dq noise {noise:.1e})")
        for c in (1, 2):
            if c > h // world:
                continue
            rec = RecordingNccl(group)
            a, b = run("contiguous", c, rec), run("contiguous", c, CopyingNccl(group))
            for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
                if name != "dq" and not torch.equal(x, y):
                    fails.append(f"H={h}/{hkv} C={c} zero-copy send: {name} not bitwise equal to the copying path")
            notes.append(f"H={h}/{hkv} C={c}: zero-copy sends {rec.sends.count(False)}/{len(rec.sends)}")
    return fails, notes


def _worker(rank, world, port, out_dir, only):
    init_nccl_rank(rank, world, port, timeout_s=120)
    group = dist.group.WORLD
    report = {"P": world, "groups": {}}
    import megatron_sp_ext as spx  # noqa: PLC0415
    from tests.sp_check import run_case  # noqa: PLC0415
    from tests import test_ulysses as tu  # noqa: PLC0415

    def section(name, fn):
        if only and not any(name.startswith(o) for o in only):
            return
        try:
            n = fn()
            report["groups"][name] = {"ok": True, "cases": n}
        except Exception:  # noqa: BLE001
            report["groups"][name] = {"ok": False, "error": traceback.format_exc()[-3000:]}

    def ulysses_cases(dtype):
        n = 0
        for (b, sl, h, hkv, d) in tu.SHAPES:
            for causal in (False, True):
                for layout in ("bshd", "sbhd"):
                    for c in (1, 2, 3):
                        if c > h // world:
                            continue
                        run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, group, head_chunks=c, causal=causal,
                                                                       layout=layout),
                                 rank, world, b=b, s=sl * world * 8, h=h, hkv=hkv, d=d, dtype=dtype, causal=causal,
                                 layout=layout, seed=n, device="cuda")
                        n += 1
        return n
    section("ulysses_hcms_fp32_vs_float64", lambda: ulysses_cases(torch.float32))
    section("ulysses_hcms_bf16_vs_float64", lambda: ulysses_cases(torch.bfloat16))

    def bitwise():
        fails, notes = _bitwise_hcms(rank, world, group)
        report["hcms_bitwise_notes"] = notes
        if fails:
            raise AssertionError("; ".join(fails))
        return len(notes)
    section("hcms_bitwise_equals_ulysses_cuda_streams", bitwise)

    def bitwise_tr(transport):
        fails, notes = _bitwise_transport(rank, world, group, transport)
        report[f"{transport}_notes"] = notes
        if fails:
            raise AssertionError("; ".join(fails))
        return len(notes)
    section("symm_mem_bitwise_equals_nccl", lambda: bitwise_tr("symm_mem"))
    section("copy_engine_bitwise_equals_nccl", lambda: bitwise_tr("copy_engine"))

    def zigzag_cases(dtype):
        """Causal Ulysses/HCMS in the zigzag/tasp_zigzag layouts (one causal kernel per chunk) and with key
        padding, vs float64."""
        from megatron_sp_ext.sp.placement import pieces  # noqa: PLC0415
        n = 0
        for placement in ("zigzag", "tasp_zigzag"):
            def shard(x, r, w, placement=placement):
                return torch.cat([x[:, a:a + m] for a, m in pieces(placement, r, w, x.shape[1])], dim=1)
            for (b, h, hkv, d, c, valid) in ((1, 8, 8, 128, 1, None), (2, 12, 4, 64, 2, None), (1, 8, 2, 64, 1, -7),
                                             (1, 6, 6, 64, 2, -64)):
                if h < world or c > h // world:
                    continue
                s = 2 * world * 3 * 64
                kvl = None if valid is None else s + valid
                mask = None
                if kvl is not None:
                    mask = torch.zeros(s, s, dtype=torch.bool)
                    mask[:, :kvl] = True
                    mask &= torch.ones(s, s, dtype=torch.bool).tril()
                run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, group, head_chunks=c, causal=True,
                                                               placement=placement, kv_valid_len=kvl),
                         rank, world, b=b, s=s, h=h, hkv=hkv, d=d, dtype=dtype, causal=True, seed=200 + n,
                         shard=shard, mask=mask, compare_rows=kvl, device="cuda")
                n += 1
        return n
    section("ulysses_zigzag_fp32_vs_float64", lambda: zigzag_cases(torch.float32))
    section("ulysses_zigzag_bf16_vs_float64", lambda: zigzag_cases(torch.bfloat16))

    def bitwise_zz():
        fails, notes = _bitwise_zigzag(rank, world, group)
        report["zigzag_bitwise_notes"] = notes
        if fails:
            raise AssertionError("; ".join(fails))
        return len(notes)
    section("zigzag_bitwise_equals_contiguous", bitwise_zz)

    def allgather_cases():
        """The all-gather QKV block == the plain block on CUDA (torch's fused symm_mem ops where available,
        and the NCCL path), output + every grad; GQA with kv < P, HCMS chunks, causal zigzag."""
        from megatron_sp_ext.sp.gather_block import fused_ops_unavailable_reason  # noqa: PLC0415
        from tests.test_gather_block import _case  # noqa: PLC0415
        why = fused_ops_unavailable_reason(group, torch.device("cuda", rank))
        report["allgather_fused"] = why or "torch.ops.symm_mem fused ops"
        n = 0
        for fused in ((True, False) if why is None else (False,)):
            for (h, hkv, c, causal) in ((8, 8, 1, False), (8, 8, 2, True), (8, 2, 1, False), (12, 4, 2, True)):
                if c > h // world:
                    continue
                pl = "zigzag" if causal else "contiguous"
                for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
                    _case(rank, world, h, hkv, 64, c, True, dtype, causal=causal, placement=pl, device="cuda",
                          fused=fused, tol=tol)
                    n += 1
        return n
    section("allgather_block_equals_plain", allgather_cases)

    def packed_cases(dtype):
        """Packed q|k|v (sp/packed.py, the DiT's --ulysses-packed-qkv) vs float64 on CUDA, key padding included:
        attention reads the received buffer in place (strided views into cuDNN/flash), gradients return in the
        send layout; and
        bit for bit equal to ulysses_attention(qkv_contiguous=False) when P > 1 (same kernels, same values)."""
        from megatron_sp_ext.sp.packed import pack_qkv, packable, packed_head_layout  # noqa: PLC0415
        from megatron_sp_ext.sp.packed import packed_ulysses_attention  # noqa: PLC0415
        n = 0
        for (b, h, hkv, d, c, causal, pad) in ((1, 8, 8, 128, 1, False, 0), (1, 8, 8, 128, 2, True, 0),
                                               (2, 8, 4, 64, 1, True, 0), (1, 40, 40, 128, 1, False, 0),
                                               (1, 8, 8, 128, 2, True, 37), (2, 8, 4, 64, 1, False, 50)):
            if not packable(h, hkv, world, c):
                continue
            hl = packed_head_layout(h, hkv, world, c)
            s = world * 256
            valid = s - pad if pad else None  # key padding: the last ``pad`` keys get no attention
            mask = None
            if valid is not None:
                mask = torch.zeros(s, s, dtype=torch.bool)
                mask[:, :valid] = True
                if causal:
                    mask &= torch.ones(s, s, dtype=torch.bool).tril()

            def attn(q, k, v, hl=hl, h=h, hkv=hkv, c=c, causal=causal, valid=valid):
                return packed_ulysses_attention(pack_qkv(q, k, v, hl), group, num_heads=h, num_kv_heads=hkv,
                                                head_chunks=c, causal=causal, kv_valid_len=valid)
            got = run_case(attn, rank, world, b=b, s=s, h=h, hkv=hkv, d=d, dtype=dtype, causal=causal,
                           seed=300 + n, device="cuda", mask=mask, compare_rows=valid)
            if world > 1 and dtype == torch.bfloat16 and valid is None:
                ref = run_case(lambda q, k, v, c=c, causal=causal: spx.ulysses_attention(
                    q, k, v, group, head_chunks=c, causal=causal, qkv_contiguous=False), rank, world, b=b,
                    s=world * 256, h=h, hkv=hkv, d=d, dtype=dtype, causal=causal, seed=300 + n, device="cuda")
                for name, x, y in zip(("out", "dk", "dv"), (got[0], got[2], got[3]), (ref[0], ref[2], ref[3])):
                    assert torch.equal(x, y), f"packed {name} differs from plain (H={h}/{hkv} C={c})"
            n += 1
        return n
    section("packed_fp32_vs_float64", lambda: packed_cases(torch.float32))
    section("packed_bf16_vs_float64", lambda: packed_cases(torch.bfloat16))

    def ring_cases(dtype):
        from megatron_sp_ext.sp.placement import pieces  # noqa: PLC0415
        from megatron_sp_ext.topology.hamiltonian import routing_tables  # noqa: PLC0415
        n = 0
        for variant in ("ring", "tasp"):
            rings = len(routing_tables(world).cycles) if variant == "tasp" else 1
            for (b, h, hkv, d) in ((1, 8, 8, 128), (1, 8, 2, 64)):
                for causal in (False, True):
                    placement = ("zigzag" if variant == "ring" else "tasp_zigzag") if causal else "contiguous"

                    def shard(x, r, w, placement=placement):
                        return torch.cat([x[:, a:a + m] for a, m in pieces(placement, r, w, x.shape[1])], dim=1)
                    run_case(lambda q, k, v: spx.ring_attention(q, k, v, group, variant=variant, causal=causal),
                             rank, world, b=b, s=2 * rings * world * 64, h=h, hkv=hkv, d=d, dtype=dtype,
                             causal=causal, seed=100 + n, shard=shard, device="cuda")
                    n += 1
        return n
    section("ring_tasp_fp32_vs_float64", lambda: ring_cases(torch.float32))
    section("ring_tasp_bf16_vs_float64", lambda: ring_cases(torch.bfloat16))
    flags = torch.tensor([int(all(g["ok"] for g in report["groups"].values()))], device="cuda")
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0 or not all(g["ok"] for g in report["groups"].values()):
        with open(os.path.join(out_dir, f"gpu_check_P{world}_rank{rank}.json"), "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--only", default="", help="comma list of section-name prefixes to run")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    summary = {}
    for world in [int(x) for x in args.world_sizes.split(",")]:
        if world > torch.cuda.device_count():
            continue
        spawn(_worker, world, args.out, args.only.split(",") if args.only else [])
        part = os.path.join(args.out, f"gpu_check_P{world}_rank0.json")
        with open(part) as f:
            rep = json.load(f)
        os.remove(part)
        summary[world] = rep
        for name, g in rep["groups"].items():
            print(f"[gpu_check P={world}] {name}: {'OK' if g['ok'] else 'FAIL'} {g.get('cases', '')}")
            if not g["ok"]:
                print(g["error"])
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
                   "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
