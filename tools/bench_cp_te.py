r"""Transformer Engine's context parallelism, timed: the TE side of ``tools/bench_cp.py --peers`` (its own torchrun).

bench_cp.py starts this script after its own rows (one job per link regime; TE imported only in these processes)
and merges the rows it writes (``--out-json``). For each (H, L, causal) and each peer (te_p2p, te_a2a,
te_all_gather = TE's ``cp_comm_type`` p2p / a2a / all_gather): ``transformer_engine.pytorch.DotProductAttention``
(bf16, bshd, dropout 0) with ``set_context_parallel_group(WORLD, ranks, stream, cp_comm_type)`` on this rank's
shard in TE's load-balanced dual-chunk split (rank r holds chunks r and 2P-1-r of 2P = our "zigzag"; used for
non-causal rows too, as Megatron's ``get_batch_on_this_cp_rank`` does); forward and forward+backward ms (median of
--iters, max over ranks); output and q/k/v gradients gathered to the full sequence and compared with ONE
full-sequence call on rank 0 (tools/full_reference.py, the same tensors as bench_cp's rows).

    torchrun --nproc-per-node 2 tools/bench_cp_te.py --peers te_p2p,te_a2a,te_all_gather --heads 40 \
        --seqlens 32768,65536 --causal no,yes --links nvlink --out-json $OUT/te_rows.json
    torchrun --nproc-per-node 2 tools/bench_cp_te.py --peers te --heads 8 --seqlens 8192 --iters 2 --require-ok \
        --out-json $OUT/te_smoke.json       # the install check: exit 1 when a peer errs or differs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.benchlib import cp_grid, init_world, median_ms  # noqa: E402
from tools.full_reference import TOL, full_inputs, full_reference, rel_errs, within  # noqa: E402
from tools.te_peer import TE_PEERS, cudnn_after_te, parse_peers, share_torch_cudnn  # noqa: E402
from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from training.video_dit.faults import on_rank0  # noqa: E402

PLACEMENT = "zigzag"   # TE's CPLoadBalancingStrategy.DUAL_CHUNK_SWAP


def te_attention(te, h: int, d: int, causal: bool, comm_type: str, group, stream):
    """TE's DotProductAttention over ``group`` with ``comm_type``: bshd in ([B, S_loc, H, D]), [B, S_loc, H*D] out."""
    attn = te.DotProductAttention(h, d, num_gqa_groups=h, attention_dropout=0.0, qkv_format="bshd",
                                  attn_mask_type="causal" if causal else "no_mask")
    attn.set_context_parallel_group(group, dist.get_process_group_ranks(group), stream, cp_comm_type=comm_type)
    return attn


def run_peer(te, name, shards, group, stream, h, d, causal, args):
    """Time one peer on this rank's shards; returns (entry, [out, dq, dk, dv] gathered to the full sequence)."""
    import megatron_sp_ext as spx  # noqa: PLC0415
    attn = te_attention(te, h, d, causal, TE_PEERS[name], group, stream)
    q, k, v, do = shards
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd(a=q, b=k, c=v):
        return attn(a, b, c)

    def fb():
        qg.grad = kg.grad = vg.grad = None
        o = attn(qg, kg, vg)
        o.backward(do.reshape(o.shape))
        return o
    with torch.no_grad():
        t_f = median_ms(fwd, args.iters, args.warmup, group)
    t_fb = median_ms(fb, args.iters, args.warmup, group)
    o = fb().detach().view(q.shape)
    got = [spx.unshard_sequence(t.contiguous(), group, placement=PLACEMENT, seq_dim=1)
           for t in (o, qg.grad, kg.grad, vg.grad)]
    return {"fwd_ms": t_f, "fwd_bwd_ms": t_fb, "placement": PLACEMENT, "cp_comm_type": TE_PEERS[name],
            "impl": "transformer_engine"}, got


def te_row(te, group, stream, h, seqlen, causal, peers, args) -> dict:
    """One row: every peer's entry (or its error), checked against the full-sequence reference on rank 0."""
    import megatron_sp_ext as spx  # noqa: PLC0415
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    full = full_inputs(seqlen, h, args.head_dim)
    ref = full_reference(*full, causal=causal) if rank == 0 else None
    shards = [spx.shard_sequence(t, group, placement=PLACEMENT, seq_dim=1).contiguous() for t in full]
    row = {"P": world, "H": h, "L": seqlen, "D": args.head_dim, "causal": causal, "links": args.links, "modes": {}}
    for name in peers:
        torch.cuda.empty_cache()
        try:
            entry, got = run_peer(te, name, shards, group, stream, h, args.head_dim, causal, args)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this row is reported, not fatal
            row["modes"][name] = {"error": f"{type(e).__name__}: {e}"}
            if rank == 0:
                print(f"[bench_cp_te] {name} failed: {e}", flush=True)
            continue
        if rank == 0:
            entry["rel_err_vs_full"] = rel_errs(got, ref)
            entry["ok"] = within(entry["rel_err_vs_full"])
        row["modes"][name] = entry
        del got
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="te", help="comma list of " + ", ".join(TE_PEERS) + " (te: all three)")
    ap.add_argument("--heads", default="40")
    ap.add_argument("--seqlens", default="32768,65536")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", default="no,yes", help="comma list of no/yes")
    ap.add_argument("--links", choices=("nvlink", "host"), default="nvlink",
                    help="host: NCCL_P2P_DISABLE=1 (set here, before NCCL starts)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out-json", required=True, help="where rank 0 writes {meta, rows}")
    ap.add_argument("--require-ok", action="store_true", help="exit 1 when a peer errs or differs from the reference")
    args = ap.parse_args()
    try:
        peers = parse_peers(args.peers)
    except SPConfigError as e:
        print(f"bench_cp_te: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if args.links == "host":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    init_world("nccl", timeout_s=600)
    cudnn_before = share_torch_cudnn(os.environ)   # TE loads the cuDNN torch loaded, not the image's (te_peer)
    if cudnn_before["replaced"] and dist.get_rank() == 0:
        print(f"[bench_cp_te] CUDNN_HOME {cudnn_before['replaced']} -> {cudnn_before['CUDNN_HOME']} (a link to the "
              f"cuDNN torch loaded: {cudnn_before['mapped'][0]})", flush=True)
    failed = cudnn_before.get("parts", {}).get("failed")
    if failed and dist.get_rank() == 0:   # shown before TE's import, which they may break
        print(f"[bench_cp_te] cuDNN parts that did not load before TE: {failed}", flush=True)
    import transformer_engine  # noqa: PLC0415 - only in this process (it changes torch SDPA's cuDNN choice)
    import transformer_engine.pytorch as te  # noqa: PLC0415
    group, stream = dist.group.WORLD, torch.cuda.Stream()
    rows = []
    for h, L, causal in cp_grid(args):
        t0 = time.time()
        r = te_row(te, group, stream, h, L, causal, peers, args)
        rows.append(r)
        if dist.get_rank() == 0:
            brief = " ".join(f"{n}={e['fwd_bwd_ms']:.1f}{'' if e.get('ok') else ' DIFFERS'}"
                             if "error" not in e else f"{n}=error" for n, e in r["modes"].items())
            print(f"[bench_cp_te P={r['P']} H={h} L={L} causal={causal} {time.time() - t0:.0f}s] {brief}",
                  flush=True)
    # rank 0 alone holds the checks ("ok"): its verdict goes to every rank, so all exit alike
    verdict = [[(r["L"], r["causal"], n) for r in rows for n, e in r["modes"].items() if not e.get("ok")]]
    dist.broadcast_object_list(verdict, src=0)
    bad = verdict[0]

    def report() -> None:
        meta = {"transformer_engine": getattr(transformer_engine, "__version__", "?"),
                "transformer_engine_file": transformer_engine.__file__,
                "cudnn": {"before_te": cudnn_before, "after": cudnn_after_te()},
                "tolerance": TOL, "reference": "torch SDPA, FLASH_ATTENTION backend, full sequence, bf16",
                "env": {k: v for k, v in os.environ.items() if k.startswith("NVTE_") or k in ("NCCL_P2P_DISABLE", "CUDNN_HOME")}}
        os.makedirs(os.path.dirname(os.path.abspath(args.out_json)), exist_ok=True)
        with open(args.out_json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        if bad:
            print(f"[bench_cp_te] errors or differences from the full reference beyond {TOL}: {bad}", flush=True)
    on_rank0(f"writing {args.out_json}", report, group)   # rank 0; its failure ends every rank (not a barrier hang)
    dist.barrier()
    dist.destroy_process_group()
    if args.require_ok and bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
