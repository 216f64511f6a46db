r"""Video-DiT training-step benchmark with the attention-block forms side by side in ONE process.

Every repetition times one forward+backward step (bf16 autocast, fp32 master weights, the real
flow-matching batch) of each form in turn (interleaved, so clock and allocator drift hit all
alike): plain Ulysses, HCMS, the async block, the all-gather QKV block, and "auto" (LayerPolicy,
calibrated in the warm-up). The optimizer step is left out (identical for every form). Reports the
median per form (max over ranks), the speedup vs plain, and each form's loss (they must agree).

    torchrun --nproc-per-node 4 tools/bench_dit_step.py --model wan-1.3b --num-layers 4 --frames 21 \
        --latent-size 60x104 --forms plain,plain_hcms2,async,allgather,auto --out $OUT
(``python tools/bench_dit_step.py --world-sizes 2,4`` still starts its ranks itself with multiprocessing spawn;
that launch measured 310-360 ms where torchrun sees 82-86 ms on the same shape: compare forms with torchrun.)
The whole training step as the entry point runs it (data, optimizer, guard, metrics) is measured by
tools/bench_train_step.py.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.benchlib import (finish_worker, init_nccl_rank, interleaved_ms, launch, links_option,  # noqa: E402
                            run_meta, write_results)
from megatron_sp_ext.sp.layers.policy import LayerChoice, LayerPolicy  # noqa: E402
from training.video_dit import VideoDiT, preset  # noqa: E402
from training.video_dit.fused import resolve_fused  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.engine import flow_matching_batch, local_loss, make_core, prepare  # noqa: E402



CORE_FORMS = ("core", "packed")  # the model's attention core (Ulysses) as the entry runs it; packed q|k|v or not


def parse_form(label: str) -> LayerChoice:
    """'plain', 'async_hcms2', 'allgather_symm', ... -> LayerChoice ('auto' is handled by the caller)."""
    parts = label.split("_")
    form = parts[0]
    if form not in ("plain", "async", "allgather"):
        raise SystemExit(f"--forms: unknown form {label!r} (plain|async|allgather[_hcmsC][_symm|_ce], or auto)")
    chunks = next((int(p[4:]) for p in parts if p.startswith("hcms")), 1)
    tr = "symm_mem" if "symm" in parts else ("copy_engine" if "ce" in parts else "nccl")
    return LayerChoice(form == "async", chunks, tr, form == "allgather")


def _worker(rank, world, port, args, path):
    init_nccl_rank(rank, world, port, timeout_s=300)
    group = dist.group.WORLD
    cfg = preset(args.model, args.num_layers)
    torch.manual_seed(1)
    model = VideoDiT(cfg).cuda()
    with torch.no_grad():  # AdaLN-zero starts every block as the identity, which would hide attention from the
        for _, p in model.modulation_parameters():  # loss: small random modulation weights make the loss check
            p.normal_(0.0, 0.02)                     # see every block
    model.set_attention_core(make_core("ulysses", group, num_heads=cfg.heads))
    model.set_fused_elementwise(resolve_fused(args.fused_elementwise, torch.device("cuda")))  # as the entry runs
    model.set_layer_policy(group, LayerPolicy(chunk_candidates=(1, 2)))  # installs the shared RoPE memo too
    policy = model.layer_policy
    frames = [int(f) for f in args.frames.split(",")]
    h, w = (int(v) for v in args.latent_size.split("x"))
    data = SyntheticVideoLatents(cfg.in_channels, frames, h, w, cfg.text_len, cfg.text_dim, seed=1)
    inp = prepare(flow_matching_batch(data, 0, 1, 0, 1, 1, cfg.patch), rank, world, torch.device("cuda"))
    forms = {lab: (policy if lab == "auto" else lab if lab in CORE_FORMS else parse_form(lab)) for lab in args.forms}

    def step(how):
        model.set_packed_qkv(how == "packed")
        for blk in model.blocks:  # the core forms: the entry point's default path (no block form installed)
            blk.attn.sp_layer = None if how in CORE_FORMS else (group, how)
        model.zero_grad(set_to_none=True)
        loss = local_loss(model, inp, torch.bfloat16)
        (loss * world).backward()
        return loss.detach()

    losses = {}
    for lab, how in forms.items():  # warm-up; auto calibrates here
        for _ in range(2):
            losses[lab] = step(how)
    step_ms, = interleaved_ms([{lab: (lambda how=how: step(how)) for lab, how in forms.items()}], args.iters,
                              group, barrier_each=True)  # each form leads equally often
    res = {"P": world, "model": args.model, "layers": cfg.layers, "tokens": inp.n_valid, "forms": {}}
    for lab in forms:
        ls = losses[lab].clone()
        dist.all_reduce(ls)
        res["forms"][lab] = {"step_ms": step_ms[lab], "loss": float(ls)}
    base = res["forms"][args.forms[0]]
    for e in res["forms"].values():
        e["speedup"] = base["step_ms"] / e["step_ms"]
        e["loss_rel_diff"] = abs(e["loss"] - base["loss"]) / abs(base["loss"])
    res["auto_choice"] = {str(k): {"choice": d.choice.label, "reason": d.reason, "confirm": d.confirm,
                                   "measured_ms": {c.label: t for c, t in d.measured_ms.items()}}
                          for k, d in policy.cache.items()}
    if rank == 0:
        print(f"[dit P={world}] " + " ".join(f"{lab}={e['step_ms']:.1f}ms ({e['speedup']:.3f}x)"
                                             for lab, e in res["forms"].items()) + f" | auto: {res['auto_choice']}",
              flush=True)
    finish_worker(rank, path, res)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="4")
    ap.add_argument("--model", default="wan-1.3b")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--frames", default="21")
    ap.add_argument("--latent-size", default="60x104")
    ap.add_argument("--forms", default="plain,plain_hcms2,async,allgather,auto",
                    help="first one is the baseline of the speedups; also 'core' (the entry point's default path: "
                         "the model's Ulysses core) and 'packed' (the same with --ulysses-packed-qkv on)")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--fused-elementwise", choices=["auto", "on", "off"], default="auto",
                    help="as the entry points' flag (auto: torch.compile'd elementwise regions on CUDA)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="dit_step_out")
    links_option(ap)  # --links nvlink|host|emu<M> (tools/gpu_ranks.py)
    args = ap.parse_args()
    args.forms = args.forms.split(",")
    for lab in args.forms:
        if lab != "auto" and lab not in CORE_FORMS:
            parse_form(lab)
    results = launch(_worker, [int(w) for w in args.world_sizes.split(",")], args, args.out, "dit")
    if results is None:  # a torchrun rank other than 0
        return
    meta = run_meta()
    lines = [f"{meta['device']} x P, {meta['date']}; DiT fwd+bwd step ms, interleaved (speedup vs "
             f"{args.forms[0]}; loss rel. diff)", "", "| P | model | layers | tokens | form | step ms | speedup | "
             "loss diff |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for lab, e in r["forms"].items():
            lines.append(f"| {r['P']} | {r['model']} | {r['layers']} | {r['tokens']} | {lab} | {e['step_ms']:.1f} | "
                         f"{e['speedup']:.3f}x | {e['loss_rel_diff']:.1e} |")
    write_results(args.out, "dit_step" + (f"_{args.tag}" if args.tag else ""), {"meta": meta, "results": results},
                  lines)


if __name__ == "__main__":
    main()
