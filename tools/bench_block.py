r"""Attention-block benchmark: plain (fused QKV GEMM -> Ulysses/HCMS -> out GEMM) vs the async block
(per-branch GEMMs overlapped with their exchanges) vs the all-gather QKV block (sequence all-gather
fused with the local-head QKV GEMM) vs packed q|k|v ("packed", "packed_hcms<C>": the compiled QK-norm
writes the exchange's send layout; "plain_fused" is the plain block with the same compiled QK-norm), beside the same block on DeepSpeed's DistributedAttention ("deepspeed",
speedup_*_vs_deepspeed and peak_mem_vs_deepspeed per form), forward and forward+backward, interleaved timing.

    python tools/bench_block.py --world-sizes 2,4 --models wan-1.3b,wan-14b --tokens-per-gpu 16384 --out $OUT
    python tools/bench_block.py --world-sizes 4 --models wan-1.3b --seqlen 32768 --out $OUT   # strong scaling
    python tools/bench_block.py --links host --world-sizes 2,4 --models wan-14b --chunks 2,4,5 --out $OUT  # slow links

Writes block.json and block.md (ratios vs the plain block in the same run).

Tensor parallelism (``--tp T``, issue #37): Megatron's own TP sequence-parallel self-attention ("megatron": TP
all-gather + QKV GEMM, our Ulysses/HCMS over CP, output GEMM + TP reduce-scatter; megatron-core's local layers)
against the TP x CP block's forms ("pipelined", "mixed", "mixed_in") and "auto" (the FormPolicy, CUDA events),
one SPSelfAttention module and its weights for all (``with attn.running(form): attn(...)``), CP = world / T, bf16,
fwd and fwd+bwd interleaved, each form's output relative to Megatron's (rel_diff_vs_megatron). Launch with
torchrun (one process per GPU, as training is launched):

    torchrun --nproc-per-node 2 tools/bench_block.py --tp 2 --models wan-1.3b,wan-14b --tokens-per-gpu 16384 --out $OUT
    torchrun --nproc-per-node 2 tools/bench_block.py --tp 2 --models wan-1.3b,wan-14b --tokens-per-gpu 16384 \
        --links host --tag host --out $OUT

Writes block_tp<T>[_tag].json and .md (speedups vs "megatron").
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.floor import add_ratios, floor_ms  # noqa: E402
from tools.benchlib import (finish_worker, init_nccl_rank, interleaved_ms, launch, links_option,  # noqa: E402
                            no_grad, run_meta, transports_for_links, write_results)
import megatron_sp_ext as spx  # noqa: E402
from tools.bench_attention import TRANSPORT_SUFFIXES  # noqa: E402
from training.video_dit.config import preset  # noqa: E402



def _rms(y, w):
    return (y.float() * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(y.dtype)


def bench(rank, world, group, cfg, seqlen, args):
    h, d, dim = cfg.heads, cfg.head_dim, cfg.dim
    sl = seqlen // world
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, sl, dim, device=dev, dtype=dt, generator=g).requires_grad_()
    w_qkv = (torch.randn(3 * h * d, dim, device=dev, dtype=dt, generator=g) * 0.02).requires_grad_()
    b_qkv = torch.zeros(3 * h * d, device=dev, dtype=dt, requires_grad=True)
    w_o = (torch.randn(dim, h * d, device=dev, dtype=dt, generator=g) * 0.02).requires_grad_()
    b_o = torch.zeros(dim, device=dev, dtype=dt, requires_grad=True)
    nq = torch.ones(h * d, device=dev, dtype=dt, requires_grad=True)
    nk = torch.ones(h * d, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(1, sl, dim, device=dev, dtype=dt, generator=g)

    def prep(branch, y, w):
        return _rms(y, w).view(1, sl, h, d)

    def prep_full(branch, y, w, shard):  # the same norm over all heads, for this rank's heads of every token
        y4 = y.view(1, -1, y.shape[-1] // d, d)
        r = torch.rsqrt(shard.sum_sq(y4, branch) / (h * d) + 1e-6)
        return (y4.float() * r * shard.norm_weight(w, branch, d).float()).to(y.dtype)

    weights = spx.LayerWeights(w_qkv, w_o, b_qkv, b_o, nq, nk)
    # each form's AttentionProblem is built once (as a step builds it): agreed across ranks at its first call, so
    # no timed call pays the agreement (a step pays it once, not per layer)

    def plain(c, tr="nccl"):
        problem = spx.AttentionProblem()

        def run():
            qkv = x @ w_qkv.t() + b_qkv
            q, k, v = qkv.split(h * d, dim=-1)
            o = spx.ulysses_attention(prep("q", q, nq), prep("k", k, nk), v.reshape(1, sl, h, d), group, problem,
                                      head_chunks=c, transport=tr)
            return o.reshape(1, sl, h * d) @ w_o.t() + b_o
        return run

    def plain_fused():
        """The plain block with its QK-norm compiled (as the DiT runs it with --fused-elementwise)."""
        preps = torch.compile(lambda q, k, a, b: (prep("q", q, a), prep("k", k, b)), fullgraph=True)
        problem = spx.AttentionProblem()

        def run():
            qkv = x @ w_qkv.t() + b_qkv
            q, k, v = qkv.split(h * d, dim=-1)
            o = spx.ulysses_attention(*preps(q, k, nq, nk), v.reshape(1, sl, h, d), group, problem)
            return o.reshape(1, sl, h * d) @ w_o.t() + b_o
        return run

    def packed(c):
        """Packed q|k|v (the DiT's --ulysses-packed-qkv): the compiled QK-norm writes the send layout."""
        hl = spx.packed_head_layout(h, h, world, c)

        def produce(qkv, a, b):
            q, k, v = qkv.split(h * d, dim=-1)
            return spx.pack_qkv(prep("q", q, a), prep("k", k, b), v.reshape(1, sl, h, d), hl)
        produce = torch.compile(produce, fullgraph=True)
        problem = spx.AttentionProblem()

        def run():
            sends = produce(x @ w_qkv.t() + b_qkv, nq, nk)
            o = spx.packed_ulysses_attention(sends, group, problem, num_heads=h, num_kv_heads=h, head_chunks=c)
            return o.reshape(1, sl, h * d) @ w_o.t() + b_o
        return run

    def deepspeed_block():
        """The same plain block with DeepSpeed's DistributedAttention (SDPA inside) as the attention core."""
        try:
            import deepspeed  # noqa: PLC0415
            from deepspeed.sequence.layer import DistributedAttention  # noqa: PLC0415
            deepspeed.init_distributed(dist_backend=dist.get_backend(group))
        except Exception as e:  # noqa: BLE001 - the GPU image may lack deepspeed: reported, not fatal
            print(f"[bench_block] deepspeed form skipped: {e}", flush=True)
            return None
        from tools.bench_attention import _sdpa_bshd  # noqa: PLC0415
        ds = DistributedAttention(_sdpa_bshd, group, scatter_idx=2, gather_idx=1)

        def run():
            qkv = x @ w_qkv.t() + b_qkv
            q, k, v = qkv.split(h * d, dim=-1)
            o = ds(prep("q", q, nq), prep("k", k, nk), v.reshape(1, sl, h, d), 0)
            return o.reshape(1, sl, h * d) @ w_o.t() + b_o
        return run

    def asynch(c, tr="nccl"):
        problem, run = spx.AttentionProblem(), spx.LayerRun(head_chunks=c, transport=tr)
        return lambda: spx.async_ulysses_self_attention(x, weights, group, problem, num_heads=h, num_kv_heads=h,
                                                        prep=prep, run=run)

    def allgather(c, tr="nccl", fused=None):
        problem, run = spx.AttentionProblem(), spx.LayerRun(head_chunks=c, transport=tr, fused=fused)
        return lambda: allgather_self_attention(x, weights, group, problem, num_heads=h, num_kv_heads=h,
                                                prep=prep_full, run=run)
    from megatron_sp_ext.sp.layers.async_qkv import make_async_plan, project_and_exchange  # noqa: PLC0415
    from megatron_sp_ext.sp.layers.allgather import allgather_self_attention, make_gather_plan, project_gathered  # noqa
    from megatron_sp_ext.sp.layers.policy import LayerPolicy  # noqa: PLC0415

    def pre(fused, c, tr="nccl"):
        """Pre-attention part only: projections + prep + exchanges until q, k, v have all arrived."""
        plan = make_async_plan(group, spx.AttentionProblem(), num_heads=h, num_kv_heads=h, head_dim=d, prep=prep,
                               seq_local=sl, device=x.device, run=spx.LayerRun(head_chunks=c, transport=tr))

        def run():
            _, events, _ = project_and_exchange(x, w_qkv, b_qkv, nq, nk, plan, fused=fused)
            for evs in events.values():
                for ev in evs:
                    torch.cuda.current_stream().wait_event(ev)
        return run

    def pre_gather(tr="nccl"):
        """Pre-attention part of the all-gather block: gather+GEMM and prep until q, k, v are ready."""
        plan = make_gather_plan(group, spx.AttentionProblem(), num_heads=h, num_kv_heads=h, head_dim=d,
                                prep=prep_full, seq_local=sl, device=x.device, run=spx.LayerRun(transport=tr))
        return lambda: project_gathered(x, w_qkv, b_qkv, nq, nk, plan)
    policy = LayerPolicy(chunk_candidates=[1] + [c for c in args.chunks if c <= h // world],
                         transports=args.transports)
    forms = {}

    def auto():
        def one(ch):
            key = ch
            if key not in forms:
                make = allgather if ch.allgather else (asynch if ch.async_qkv else plain)
                forms[key] = make(ch.head_chunks, ch.transport)
            return forms[key]()

        def step(ch):
            y = one(ch)
            if torch.is_grad_enabled():
                y.backward(dy)
        ch = policy.form_for(("block", sl, torch.is_grad_enabled()), step, group, x.device, h // world)
        return one(ch)
    modes = {}
    for tr in args.transports:
        sfx = "" if tr == "nccl" else {**{v: k for k, v in TRANSPORT_SUFFIXES.items()}, "host_staged": "_hs"}[tr]
        gather = tr != "copy_engine"  # the all-gather block has no copy_engine form (its NCCL path is "allgather")
        modes[f"plain{sfx}"], modes[f"async{sfx}"] = plain(1, tr), asynch(1, tr)
        if gather:
            modes[f"allgather{sfx}"] = allgather(1, tr)
        for c in args.chunks:
            if c <= h // world:
                modes[f"plain_hcms{c}{sfx}"], modes[f"async_hcms{c}{sfx}"] = plain(c, tr), asynch(c, tr)
                if gather:
                    modes[f"allgather_hcms{c}{sfx}"] = allgather(c, tr)
    modes["auto"] = auto
    modes["plain_fused"], modes["packed"] = plain_fused(), packed(1)
    for c in args.chunks:
        if c <= h // world:
            modes[f"packed_hcms{c}"] = packed(c)
    if "deepspeed" in args.baselines:
        ds_run = deepspeed_block()
        if ds_run is not None:
            modes["deepspeed"] = ds_run
    pre_modes = {"pre_plain": pre(True, 1), "pre_async": pre(False, 1), "pre_allgather": pre_gather()}
    for tr in args.transports[1:]:
        pre_modes[f"pre_plain_{tr}"], pre_modes[f"pre_async_{tr}"] = pre(True, 1, tr), pre(False, 1, tr)
        if tr != "copy_engine":
            pre_modes[f"pre_allgather_{tr}"] = pre_gather(tr)
    peak = {}
    for n, fn in modes.items():  # warm-up (auto calibrates here, for training and for inference), then the
        for _ in range(2):        # peak memory of one fwd+bwd above what was allocated before it
            fn().backward(dy)
            with torch.no_grad():
                fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn().backward(dy)
        torch.cuda.synchronize()
        peak[n] = (torch.cuda.max_memory_allocated() - base) / 2**30
    for fn in pre_modes.values():
        with torch.no_grad():
            fn()
    t_pre, t_f, t_fb = interleaved_ms([{n: no_grad(fn) for n, fn in pre_modes.items()},
                                       {n: no_grad(fn) for n, fn in modes.items()},
                                       {n: (lambda fn=fn: fn().backward(dy)) for n, fn in modes.items()}],
                                      args.iters, group)
    res = {"P": world, "model": cfg.dim, "heads": h, "L": seqlen, "modes": {}}
    for n in modes:
        res["modes"][n] = {"fwd_ms": t_f[n], "fwd_bwd_ms": t_fb[n], "peak_mem_gib": peak[n]}
    p = res["modes"]["plain"]
    # the attention floor of this block (its projections come on top): one SDPA call of this rank's heads
    res["floor"] = floor_ms(group, h, seqlen, d, False, iters=args.iters, warmup=2)
    for e in res["modes"].values():
        e["speedup_fwd"], e["speedup_fwd_bwd"] = p["fwd_ms"] / e["fwd_ms"], p["fwd_bwd_ms"] / e["fwd_bwd_ms"]
        add_ratios(e, res["floor"])
        if "deepspeed" in res["modes"]:
            ds_e = res["modes"]["deepspeed"]
            e["speedup_fwd_vs_deepspeed"] = ds_e["fwd_ms"] / e["fwd_ms"]
            e["speedup_fwd_bwd_vs_deepspeed"] = ds_e["fwd_bwd_ms"] / e["fwd_bwd_ms"]
            e["peak_mem_vs_deepspeed"] = e["peak_mem_gib"] / ds_e["peak_mem_gib"] if ds_e["peak_mem_gib"] else None
    res["pre_attention"] = {n: {"ms": t_pre[n]} for n in pre_modes}
    for n, e in res["pre_attention"].items():
        base = res["pre_attention"]["pre_plain"]["ms"]
        e["speedup_vs_pre_plain"] = base / e["ms"]
    res["auto_choice"] = {str(k): {"choice": d.choice.label, "reason": d.reason, "confirm": d.confirm,
                                   "measured_ms": {c.label: t for c, t in d.measured_ms.items()}}
                          for k, d in policy.cache.items()}
    return res


def _worker(rank, world, port, args, path):
    init_nccl_rank(rank, world, port, timeout_s=300)
    out = []
    for name in args.models:
        cfg = preset(name)
        L = args.seqlen or args.tokens_per_gpu * world
        out.append(bench(rank, world, dist.group.WORLD, cfg, L, args))
        if rank == 0:
            r = out[-1]
            print(f"[block P={world} {name} L={L}] " + " ".join(
                f"{n}={e['fwd_ms']:.2f}/{e['fwd_bwd_ms']:.2f}" for n, e in r["modes"].items())
                + " | pre-attention " + " ".join(f"{n}={e['ms']:.3f}" for n, e in r["pre_attention"].items())
                + f" | auto: {r['auto_choice']}", flush=True)
    finish_worker(rank, path, out)


# -- --tp T: the TP x CP block against Megatron's own TP-SP self-attention ---------------------------------

TP_MODES = ("megatron", "pipelined", "mixed", "mixed_in", "auto")


class _QKNorm:
    """megatron-core's torch norm as the per-head q/k norm under --sequence-parallel: it asserts the flag off only
    because it does not tag its weight for the TP grad all-reduce (per-head norms see whole heads). A class (not a
    function) so that Megatron's build_module instantiates it."""

    def __new__(cls, config, hidden_size, eps=1e-5, **kw):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: PLC0415
        cfg = copy.copy(config)
        cfg.sequence_parallel = False
        return WrappedTorchNorm(cfg, hidden_size, eps, **kw)


def build_tp_attention(tp: int, cp: int, *, dim: int, heads: int, kv_heads: int, chunks: int, causal: bool,
                       qk_norm: bool, dtype: torch.dtype, device: str):
    """One SPSelfAttention (megatron-core local layers, --sequence-parallel, --sp-async-qkv auto) at TP ``tp`` x
    CP ``cp``; parallel_state must be initialised with those sizes."""
    from megatron.core import tensor_parallel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: PLC0415
    from megatron.core.transformer.spec_utils import build_module  # noqa: PLC0415

    from megatron_sp_ext.megatron import SPTransformerConfig, with_sp_core_attention  # noqa: PLC0415
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(1234)
    cp_type = "hcms" if chunks > 1 else "ulysses"
    cfg = SPTransformerConfig(num_layers=1, hidden_size=dim, num_attention_heads=heads, num_query_groups=kv_heads,
                              use_cpu_initialization=True, tensor_model_parallel_size=tp, context_parallel_size=cp,
                              sequence_parallel=True, cp_comm_type=cp_type, hcms_head_chunks=chunks,
                              sp_async_qkv="auto", hidden_dropout=0.0, attention_dropout=0.0,
                              bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
                              normalization="RMSNorm", qk_layernorm=qk_norm, add_qkv_bias=True,
                              params_dtype=dtype, bf16=dtype == torch.bfloat16)
    spec = with_sp_core_attention(get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm"),
                                  no_mask=not causal)
    sub = spec.submodules.self_attention
    if qk_norm:
        sub.submodules.q_layernorm = sub.submodules.k_layernorm = _QKNorm
    attn = build_module(sub, config=cfg, layer_number=1, cp_comm_type=cp_type,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    return attn.to(device, dtype)


def zigzag_freqs(seqlen: int, head_dim: int, cp_rank: int, cp: int, device) -> torch.Tensor:
    """RoPE freqs [S_cp, 1, 1, D] of this CP rank's tokens (Megatron's zigzag split)."""
    from megatron_sp_ext.sp.placement import pieces  # noqa: PLC0415
    pos = torch.tensor([i for a, n in pieces("zigzag", cp_rank, cp, seqlen) for i in range(a, a + n)])
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    f = torch.outer(pos.float(), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :].to(device)


def tp_bench(tp: int, *, dim: int, heads: int, head_dim: int, seqlen: int, chunks: int = 1, kv_heads=None,
             causal: bool = False, qk_norm: bool = True, iters: int = 10, modes=TP_MODES,
             dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> dict:
    """Megatron's own TP-SP self-attention vs the TP x CP block's forms on this rank (every rank calls it; the
    world is TP x CP with CP = world / tp). Returns {"modes": {mode: fwd_ms, fwd_bwd_ms, speedup_*,
    rel_diff_vs_megatron}, "auto_choice": ...}; times are medians over ``iters`` interleaved rounds, max over
    ranks (CUDA events; on CPU the host clock: a dry run)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    world = dist.get_world_size()
    cp = world // tp
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        attn = build_tp_attention(tp, cp, dim=dim, heads=heads, kv_heads=kv_heads or heads, chunks=chunks,
                                  causal=causal, qk_norm=qk_norm, dtype=dtype, device=device)
        assert attn.hidden_size_per_attention_head == head_dim, (attn.hidden_size_per_attention_head, head_dim)
        s_tp = seqlen // world
        g = torch.Generator().manual_seed(7 + dist.get_rank())
        x = torch.randn(s_tp, 1, dim, generator=g).to(device, dtype).requires_grad_()
        dy = torch.randn(s_tp, 1, dim, generator=g).to(device, dtype)
        freqs = zigzag_freqs(seqlen, head_dim, ps.get_context_parallel_rank(), cp, device)

        def call(mode):
            with contextlib.nullcontext() if mode == "auto" else attn.running(mode):
                return attn(x, None, rotary_pos_emb=freqs)[0]

        def fwd(mode):
            with torch.no_grad():
                return call(mode)

        def fwd_bwd(mode):
            call(mode).backward(dy)
        outs = {}
        for m in modes:  # warm-up (auto calibrates here, timing fwd+bwd: the module is in training); outputs kept
            for _ in range(2):
                fwd_bwd(m)
                outs[m] = fwd(m).float()
        t_f, t_fb = interleaved_ms([{m: (lambda m=m: fwd(m)) for m in modes},
                                    {m: (lambda m=m: fwd_bwd(m)) for m in modes}], iters, dist.group.WORLD,
                                   clock="wall", device=device)  # the host clock: this also runs on CPU
        res = {"tp": tp, "cp": cp, "dim": dim, "heads": heads, "L": seqlen, "chunks": chunks, "causal": causal,
               "modes": {}}
        ref = outs.get("megatron")
        for m in modes:
            diff = torch.tensor([0.0 if ref is None else float((outs[m] - ref).norm() / ref.norm())],
                                dtype=torch.float64, device=device)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            res["modes"][m] = {"fwd_ms": t_f[m], "fwd_bwd_ms": t_fb[m], "rel_diff_vs_megatron": float(diff)}
        base = res["modes"].get("megatron", next(iter(res["modes"].values())))
        for e in res["modes"].values():
            e["speedup_fwd"], e["speedup_fwd_bwd"] = base["fwd_ms"] / e["fwd_ms"], base["fwd_bwd_ms"] / e["fwd_bwd_ms"]
        res["auto_choice"] = {"train" if k[-2] else "eval": {"form": d.form, "reason": d.reason,
                                                             "measured_ms": d.measured_ms}
                              for k, d in attn.form_policy.cache.items()}  # one key: the module is in training
        return res
    finally:
        ps.destroy_model_parallel()


def _tp_worker(rank, world, port, args, path):
    init_nccl_rank(rank, world, port, timeout_s=300)
    out = []
    for name in args.models:
        cfg = preset(name)
        seqlen = args.seqlen or args.tokens_per_gpu * world
        for causal in args.causal:
            r = tp_bench(args.tp, dim=cfg.dim, heads=cfg.heads, head_dim=cfg.head_dim, seqlen=seqlen,
                         chunks=args.tp_chunks, causal=causal, iters=args.iters)
            r["model"] = name
            out.append(r)
            if rank == 0:
                print(f"[block TP={r['tp']} CP={r['cp']} {name} L={seqlen} causal={causal}] " + " ".join(
                    f"{m}={e['fwd_ms']:.2f}/{e['fwd_bwd_ms']:.2f}" for m, e in r["modes"].items())
                    + f" | auto: {r['auto_choice']}", flush=True)
    finish_worker(rank, path, out)


def _rows(worker, args, stem: str) -> Optional[list]:
    """Every world size's rows in one list (``launch``: torchrun or spawned ranks); None on torchrun ranks > 0."""
    per_world = launch(worker, [int(w) for w in args.world_sizes.split(",")], args, args.out, stem)
    return None if per_world is None else [r for rs in per_world for r in rs]


def write_tables(args, stem: str, meta: dict, results: list, lines: list) -> None:
    """<out>/<stem>[_<tag>].json (meta + results) and .md (the table ``lines``); the table printed too."""
    write_results(args.out, stem + (f"_{args.tag}" if args.tag else ""), {"meta": meta, "results": results}, lines)


def tp_main(args) -> None:
    """``--tp T``: under torchrun one world (this process's rank); else spawned ranks per --world-sizes."""
    stem = f"block_tp{args.tp}"
    results = _rows(_tp_worker, args, stem)
    if results is None:  # a torchrun rank other than 0
        return
    meta = run_meta()
    lines = [f"{meta['device']}, {meta['date']}, bf16, links {meta.get('links', 'nvlink')}; fwd ms / fwd+bwd ms "
             "(speedup vs megatron: Megatron's own TP-SP self-attention); output rel. diff vs megatron", "",
             "| TP | CP | model | L | causal | mode | fwd | fwd+bwd | rel diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for m, e in r["modes"].items():
            lines.append(f"| {r['tp']} | {r['cp']} | {r['model']} | {r['L'] // 1024}K | {r['causal']} | {m} | "
                         f"{e['fwd_ms']:.2f} ({e['speedup_fwd']:.2f}x) | {e['fwd_bwd_ms']:.2f} "
                         f"({e['speedup_fwd_bwd']:.2f}x) | {e['rel_diff_vs_megatron']:.1e} |")
        lines.append(f"| {r['tp']} | {r['cp']} | {r['model']} | {r['L'] // 1024}K | {r['causal']} | auto chose | "
                     + ", ".join(f"{k}: {v['form']}" for k, v in r["auto_choice"].items()) + " | | |")
    write_tables(args, stem, meta, results, lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="4")
    ap.add_argument("--models", default="wan-1.3b")
    ap.add_argument("--tokens-per-gpu", type=int, default=16384)
    ap.add_argument("--seqlen", type=int, default=None, help="fixed global length (strong scaling)")
    ap.add_argument("--chunks", default="2")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--transports", default=None,
                    help="comma list (default nccl,symm_mem, without symm_mem under --links host; host_staged: _hs)")
    links_option(ap)
    ap.add_argument("--baselines", default="deepspeed",
                    help="comma list of peer blocks timed beside ours: deepspeed (the plain block with DeepSpeed's "
                         "DistributedAttention, when deepspeed imports), or empty")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel size: > 1 benchmarks the TP x CP block's forms against Megatron's own TP-SP "
                         "self-attention (CP = world / TP; see the module docstring), not the TP 1 blocks")
    ap.add_argument("--causal", default="0", help="--tp: comma list of 0/1 (causal mask, Megatron's zigzag split)")
    ap.add_argument("--tp-chunks", type=int, default=1, help="--tp: HCMS head chunks (--hcms-head-chunks)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="block_out")
    args = ap.parse_args()
    args.models = args.models.split(",")
    if args.tp > 1:
        args.causal = [c.strip() in ("1", "true", "True") for c in args.causal.split(",")]
        return tp_main(args)
    args.baselines = [b for b in args.baselines.split(",") if b]
    args.chunks = [int(c) for c in args.chunks.split(",")]
    args.transports = (args.transports.split(",") if args.transports
                       else transports_for_links(["nccl", "symm_mem"]))
    results = _rows(_worker, args, "block")
    if results is None:  # a torchrun rank other than 0
        return
    meta = run_meta()
    lines = [f"{meta['device']} x P, {meta['date']}, bf16; fwd ms / fwd+bwd ms (speedup vs plain) [ratio to the "
             "attention floor: one SDPA call of ceil(H/P) heads over L, same job; the block adds its GEMMs]", "",
             "| P | dim | heads | L | mode | fwd | fwd+bwd | floor fwd / fwd+bwd | peak GiB (fwd+bwd) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for n, e in r["modes"].items():
            lines.append(f"| {r['P']} | {r['model']} | {r['heads']} | {r['L'] // 1024}K | {n} | {e['fwd_ms']:.2f} "
                         f"({e['speedup_fwd']:.2f}x) [{e['ratio_fwd']:.2f}] | {e['fwd_bwd_ms']:.2f} "
                         f"({e['speedup_fwd_bwd']:.2f}x) [{e['ratio_fwd_bwd']:.2f}] | {e['floor_fwd_ms']:.2f} / "
                         f"{e['floor_fwd_bwd_ms']:.2f} | {e['peak_mem_gib']:.2f} |")
        lines.append(f"| {r['P']} | {r['model']} | {r['heads']} | {r['L'] // 1024}K | pre-attention | " + ", ".join(
            f"{n} {e['ms']:.3f} ms ({e['speedup_vs_pre_plain']:.2f}x)" for n, e in r["pre_attention"].items()) + " | | | |")
    write_tables(args, "block", meta, results, lines)


if __name__ == "__main__":
    main()
