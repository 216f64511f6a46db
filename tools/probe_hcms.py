"""Probe where HCMS time goes on N GPUs: component timings and NCCL group options.

Times (P, H, L from args): pack copies, bare exchange, attention on strided vs contiguous views,
unpack, plain Ulysses and HCMS C in {2,4} under process groups created with different NCCL
options (default, high-priority stream, capped CTAs), and checks run-to-run determinism of the
flash backward with and without torch.use_deterministic_algorithms. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.gpu_ranks import init_nccl_rank, spawn  # noqa: E402
import megatron_sp_ext as spx  # noqa: E402
from megatron_sp_ext.comm.exchange import all_to_all_flat  # noqa: E402
from megatron_sp_ext.sp import layout as lay  # noqa: E402
from megatron_sp_ext.sp.heads import head_layout  # noqa: E402
from tools.bench_attention import _time  # noqa: E402



def _groups(world):
    out = {"default": dist.group.WORLD}
    ranks = list(range(world))
    o = dist.ProcessGroupNCCL.Options()
    o.is_high_priority_stream = True
    out["high_prio"] = dist.new_group(ranks, pg_options=o)
    for ctas in (4, 8, 16):
        try:
            o = dist.ProcessGroupNCCL.Options()
            o.is_high_priority_stream = True
            o.config.max_ctas = ctas
            o.config.min_ctas = 1
            out[f"high_prio_ctas{ctas}"] = dist.new_group(ranks, pg_options=o)
        except Exception as e:  # noqa: BLE001
            out.setdefault("errors", []).append(repr(e))
    return out


def _worker(rank, world, port, args, path):
    init_nccl_rank(rank, world, port, timeout_s=120)
    groups = _groups(world)
    errs = groups.pop("errors", [])
    res = {"errors": errs}
    h, L, d = args.heads, args.seqlen, 128
    sl = L // world
    q, k, v = (torch.randn(1, sl, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = dist.group.WORLD
    it, wu = args.iters, 3
    hl = head_layout(h, h, world, 1)
    send = torch.empty(3 * q.numel(), device="cuda", dtype=q.dtype)
    recv = torch.empty_like(send)
    res["pack_qkv"] = _time(lambda: lay.pack((q, k, v), ("q", "kv", "kv"), hl, 0, "bshd", send), it, wu, g)
    res["a2a_qkv"] = _time(lambda: all_to_all_flat(send, recv, g), it, wu, g)
    ws = lay.widths(hl, ("q", "kv", "kv"), rank, 0)
    qc, kc, vc = lay.columns(recv.view(L, 1, sum(ws), d), ws)
    res["attn_strided"] = _time(lambda: F.scaled_dot_product_attention(qc, kc, vc), it, wu, g)
    qq, kk, vv = (t.contiguous() for t in (qc, kc, vc))
    res["attn_contig_bhsd"] = _time(lambda: F.scaled_dot_product_attention(qq, kk, vv), it, wu, g)
    qb, kb, vb = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (qc, kc, vc))
    res["attn_contig_bshd"] = _time(lambda: F.scaled_dot_product_attention(qb, kb, vb), it, wu, g)
    o = F.scaled_dot_product_attention(qc, kc, vc)
    so = o.permute(2, 0, 1, 3).contiguous().view(-1)
    ro = torch.empty_like(so)
    out = torch.empty_like(q)
    res["o_is_seq_major"] = so.data_ptr() == o.data_ptr()
    res["a2a_out"] = _time(lambda: all_to_all_flat(so, ro, g), it, wu, g)
    res["unpack_out"] = _time(lambda: lay.unpack(ro, (out,), ("q",), hl, 0, "bshd"), it, wu, g)
    for gname, grp in groups.items():
        for c in (1, 2, 4, 5):
            with torch.no_grad():
                res[f"fwd_{gname}_C{c}"] = _time(lambda: spx.ulysses_attention(q, k, v, grp, head_chunks=c), it, wu, g)
    for gname in ("default", "high_prio"):
        grp = groups[gname]
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        for c in (1, 2, 4):
            def fb():
                spx.ulysses_attention(qg, kg, vg, grp, head_chunks=c).backward(q)
            res[f"fwdbwd_{gname}_C{c}"] = _time(fb, it, wu, g)
    # determinism of the backward
    for det in (False, True):
        torch.use_deterministic_algorithms(det, warn_only=True)
        grads = []
        for c in (1, 1, 2):
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            spx.ulysses_attention(qg, kg, vg, g, head_chunks=c).backward(q)
            grads.append(qg.grad)
        res[f"dq_repeatable_det{int(det)}"] = bool(torch.equal(grads[0], grads[1]))
        res[f"dq_hcms_equal_det{int(det)}"] = bool(torch.equal(grads[0], grads[2]))
    torch.use_deterministic_algorithms(False)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    path = os.path.join(args.out, f"probe_P{args.world}_H{args.heads}_L{args.seqlen}.json")
    spawn(_worker, args.world, args, path)
    with open(path) as f:
        res = json.load(f)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}, indent=0))


if __name__ == "__main__":
    main()
