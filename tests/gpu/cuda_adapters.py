"""The CUDA suite's adapter workers: the framework integrations on CUDA, each against its own baseline.

- ``megatron_family``: a megatron-core TransformerBlock with our core attention at CP=P against the same weights
  at CP=1 (the parent's single-device path) on the full sequence, Megatron's zigzag split: output, input grad and
  every parameter grad (CP-reduced); fp32 (tol 1e-5) and bf16 (tol 2e-2), every CP type of ours.
- ``deepspeed_family``: ``SPDistributedAttention`` against DeepSpeed's own ``DistributedAttention`` (same local
  attention callable): output and q/k/v grads; ulysses, hcms, ring, tasp; both batch layouts.
- ``dit_family``: the DiT entry point (training/pretrain_video_dit.py) at SP=P against SP=1 for 5 steps: losses.
Records as in tests/gpu/cuda_suite.py. Ring-family hops on one GPU over gloo take the host-staged route
(``cuda_suite.use_ring_route``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp_ext import make_attention

from tests.gpu.cuda_suite import DEV, use_ring_route
from tests.reference import rel_err

MODES = {2: [("ulysses", 1, None, False), ("hcms", 2, None, True), ("ring", 1, None, True), ("tasp", 1, None, False),
             ("usp", 1, 2, False), ("tas", 1, 2, True), ("torus", 1, 2, True), ("auto", 1, None, True)],
         4: [("hcms", 2, None, False), ("hcms", 1, None, True), ("ring", 1, None, True), ("tasp", 1, None, True),
             ("usp", 1, 2, True), ("tas", 1, 2, False), ("torus", 1, 2, False), ("auto", "auto", None, True)]}


def _block(cp_comm_type, cp, chunks, nodes, causal, dtype):
    from megatron.core import tensor_parallel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.transformer.transformer_block import TransformerBlock  # noqa: PLC0415

    from megatron_sp_ext.megatron import SPTransformerConfig, with_sp_core_attention  # noqa: PLC0415
    if DEV == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    cfg = SPTransformerConfig(num_layers=2, hidden_size=512, num_attention_heads=8, use_cpu_initialization=True,
                              context_parallel_size=cp, cp_comm_type=cp_comm_type, hidden_dropout=0.0,
                              attention_dropout=0.0, hcms_head_chunks=chunks, sp_nodes=nodes,
                              bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
                              params_dtype=dtype, bf16=dtype == torch.bfloat16)
    torch.manual_seed(1234)
    spec = with_sp_core_attention(get_gpt_layer_local_spec(), no_mask=not causal)
    return TransformerBlock(cfg, spec).to(DEV, dtype)  # every parameter in dtype (CUDA layer_norm wants one dtype)


def megatron_family(rank: int, world: int) -> list:
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    from megatron_sp_ext.megatron.compat import cp_rank_batch  # noqa: PLC0415
    use_ring_route()
    ps.initialize_model_parallel(context_parallel_size=world)
    cp_group, rec = ps.get_context_parallel_group(), []
    try:
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for mode, chunks, nodes, causal in MODES[world]:
                block = _block(mode, world, chunks, nodes, causal, dtype)
                s, b = 1024 * world // 2, 2
                g = torch.Generator().manual_seed(7)
                x_full, dy_full = (torch.randn(s, b, 512, generator=g).to(DEV, dtype) for _ in range(2))
                split = lambda t: cp_rank_batch({"x": t.transpose(0, 1)})["x"].transpose(0, 1)  # noqa: E731
                x = split(x_full).clone().requires_grad_()
                y = block(x, attention_mask=None)
                y.backward(split(dy_full))
                grads = {n: p.grad.float() for n, p in block.named_parameters()}
                for gr in grads.values():  # Megatron's CP gradient reduction (DDP over dp x cp)
                    dist.all_reduce(gr, group=cp_group)
                dx = x.grad.clone()
                block.zero_grad(set_to_none=True)
                for layer in block.layers:  # the same weights at CP=1 on the full sequence
                    ca = layer.self_attention.core_attention
                    ca.cp_group = None
                    ca.attention = make_attention(ca.sp, None, num_heads=ca.attention.num_heads,
                                                  num_kv_heads=ca.attention.num_kv_heads, layout="sbhd",
                                                  placement="zigzag")
                xf = x_full.clone().requires_grad_()
                yf = block(xf, attention_mask=None)
                yf.backward(dy_full)
                errs = {"out": rel_err(y, split(yf)), "dx": rel_err(dx, split(xf.grad))}
                named = list(block.named_parameters())
                # fp32: every parameter's grad; bf16: all of them as one vector (a LayerNorm bias grad is a sum of
                # dy over tokens that cancels: two bf16 runs of it differ by 40% with both far from the truth)
                errs["dparams"] = (max(rel_err(grads[n], p.grad) for n, p in named) if dtype == torch.float32 else
                                   rel_err(torch.cat([grads[n].flatten() for n, _ in named]),
                                           torch.cat([p.grad.flatten() for _, p in named])))
                rec.append({"family": "megatron", "case": f"CP={world} vs CP=1 {mode} C={chunks} causal={causal} "
                            f"{dtype} s={s} b={b}", "errs": errs, "tol": tol})
    finally:
        ps.destroy_model_parallel()
    return rec


def deepspeed_family(rank: int, world: int) -> list:
    import importlib  # noqa: PLC0415

    import torch.nn.functional as F  # noqa: PLC0415
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed  # noqa: PLC0415
    from deepspeed.sequence.layer import DistributedAttention  # noqa: PLC0415

    from megatron_sp_ext.deepspeed import SPDistributedAttention, build_sequence_parallel_groups  # noqa: PLC0415
    use_ring_route()
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    g = build_sequence_parallel_groups(world).install().get_sequence_parallel_group()

    def local(bdim):
        def fn(q, k, v, *args, **kwargs):
            to = (lambda t: t.transpose(1, 2)) if bdim == 0 else (lambda t: t.permute(1, 2, 0, 3))
            o = F.scaled_dot_product_attention(to(q), to(k), to(v), enable_gqa=k.shape[2] != q.shape[2])
            return o.transpose(1, 2) if bdim == 0 else o.permute(2, 0, 1, 3)
        return fn
    rec = []
    for (h, hkv) in ((8, 8), (8, 4)):
        for bdim in (0, 1):
            for mode, chunks in (("ulysses", 1), ("hcms", 2), ("ring", 1), ("tasp", 1)):
                if mode == "hcms" and h // world < 2:
                    continue
                gen = torch.Generator().manual_seed(h * 100 + hkv)
                s, b, d = 1024 * world, 1, 128
                full = [torch.randn(b, s, n, d, generator=gen).to(DEV, torch.bfloat16) for n in (h, hkv, hkv, h)]
                sl = s // world
                mine = [t[:, rank * sl:(rank + 1) * sl] for t in full]
                if bdim == 1:
                    mine = [t.transpose(0, 1).contiguous() for t in mine]
                outs = []
                for cls, kw in ((DistributedAttention, {}), (SPDistributedAttention, dict(mode=mode, head_chunks=chunks))):
                    attn = cls(local(bdim), g, 2, 1 if bdim == 0 else 0, None, None, **kw)
                    q, k, v = (t.clone().requires_grad_() for t in mine[:3])
                    o = attn(q, k, v, bdim)
                    o.backward(mine[3])
                    outs.append((o.detach(), q.grad, k.grad, v.grad))
                errs = {n: rel_err(a, b_) for n, a, b_ in zip(("out", "dq", "dk", "dv"), outs[1], outs[0])}
                rec.append({"family": "deepspeed", "case": f"P={world} SPDistributedAttention {mode} C={chunks} vs "
                            f"DistributedAttention H={h}/{hkv} batch_dim_idx={bdim} bf16 s={s}", "errs": errs,
                            "tol": 2e-2})
    return rec


DIT_ARGS = ["--model", "tiny", "--train-iters", "5", "--frames", "4,3", "--latent-size", "8x12", "--quiet",
            "--ddp-impl", "torch", "--lr", "1e-3", "--seed", "3", "--fused-elementwise", "off",
            "--num-workers", "0"]  # the suite's ranks are daemon processes: no DataLoader worker processes
DIT_MODES = ("ulysses", "hcms", "ring", "tasp", "usp", "auto")


def dit_losses(rank: int, world: int, modes=DIT_MODES) -> dict:
    """The DiT entry point (fp32, 5 steps) at SP=world for each mode: {mode: losses}. The test compares them with
    a one-rank run (SP=1, same data)."""
    from training import pretrain_video_dit  # noqa: PLC0415
    use_ring_route()
    extra = {"hcms": ("--hcms-head-chunks", "2"), "usp": ("--sp-nodes", "2", "--sp-ulysses-size", "2")}
    got = {mode: pretrain_video_dit.main(DIT_ARGS + ["--context-parallel-size", str(world), "--cp-comm-type", mode,
                                                     *extra.get(mode, ())])["losses"]
           for mode in modes if not (mode == "usp" and world < 4)}
    if world > 1 and torch.cuda.is_available() and dist.get_backend() == "nccl":   # megatron-core's DDP reducing
        # during the backward (CUDA, NCCL: its coalesced all-reduce takes no CUDA tensors over gloo);
        # what the SP > 1 step rows time beside --ddp-impl torch (stage r17_69overlap,
        # results/README.md)
        got["ulysses megatron-ddp --overlap-grad-reduce"] = pretrain_video_dit.main(
            DIT_ARGS + ["--context-parallel-size", str(world), "--cp-comm-type", "ulysses", "--ddp-impl", "megatron",
                        "--overlap-grad-reduce"])["losses"]
    return got


def dit_fused_losses(rank: int, world: int) -> dict:
    """The DiT entry (bf16, 8 steps, ulysses at SP=world) with its compiled elementwise regions on and off:
    {"on": losses, "off": losses}; the test holds them within bf16 noise of each other."""
    from training import pretrain_video_dit  # noqa: PLC0415
    argv = [a for a in DIT_ARGS if a not in ("--fused-elementwise", "off")]
    argv[argv.index("5")] = "8"  # --train-iters
    return {f: pretrain_video_dit.main(argv + ["--bf16", "--context-parallel-size", str(world), "--cp-comm-type",
                                               "ulysses", "--fused-elementwise", f])["losses"] for f in ("on", "off")}

