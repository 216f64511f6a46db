r"""Where the DiT training step's GPU time goes, by category, beside the ceiling set by attention and GEMM speeds.

One command runs the entry point as users do (in-process, like tools/bench_train_step.py) with its profiler on two
steps past warm-up, then sorts every GPU kernel of those steps into a category by the kernel's name and the
operator that launched it (the trace links them by "External id"):
  attention        cuDNN / flash attention kernels of the self-attention (query and key lengths equal)
  cross-attention  the same kernels where the keys are the 512 text tokens
  GEMM             cuBLAS / CUTLASS matrix products (nvjet, gemm, xmma, cutlass kernels; aten::mm/addmm/bmm/linear)
  optimizer        the update, clip and gradient norm (fused/foreach Adam, multi_tensor_apply, foreach norms)
  exchange         NCCL kernels (sequence-parallel exchanges, gradient reduction)
  elementwise      everything else: norms, modulation, RoPE, GELU, residuals, casts, copies (compiled or not)
  idle             the window's length minus the union of all kernels' busy intervals
and writes <out>/<tag>/profile_categories.json and a markdown table (also printed). The ceiling column is the time
attention FLOPs take at --attn-tflops and GEMM FLOPs at --gemm-tflops (FLOPs from the model preset, as the MFU
meter counts them); everything else has a ceiling of 0.

    torchrun --nproc-per-node 1 tools/profile_train_step.py --out $OUT --tag wan14b_32k -- --model wan-14b \
        --num-layers 4 --frames 21 --latent-size 60x104 --bf16 --train-iters 14 --context-parallel-size 1
    python tools/profile_train_step.py --trace profile_rank0.json --steps 2 ...   # categorise an existing trace
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CATEGORIES = ("attention", "cross-attention", "GEMM", "elementwise", "optimizer", "exchange", "idle")
_GEMM_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "s16816", "wgmma")
_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
             "aten::_scaled_mm", "aten::addmm_")
_ATTN_KERNELS = ("fmha", "flash", "cudnn_generated", "sdpa", "attention")
_OPT_MARKS = ("adam", "multi_tensor", "_foreach", "clip_grad")  # operator names of the update / clip / grad norm


def _op_name_dims(op: dict) -> tuple[str, list]:
    return op.get("name", ""), (op.get("args", {}) or {}).get("Input Dims", []) or []


def _is_cross(dims: list, text_len: int) -> bool:
    """An attention op whose 4-D inputs have different sequence lengths, one of them the text length."""
    seqs = {d[2] for d in dims if isinstance(d, list) and len(d) == 4}
    return len(seqs) > 1 and text_len in seqs


def category(kernel: str, op_name: str, dims: list, text_len: int = 512) -> str:
    """The category of one kernel, from its name and its launching operator's name and input shapes."""
    k, o = kernel.lower(), op_name.lower()
    if "nccl" in k or "c10d" in o or "nccl" in o:
        return "exchange"
    if (any(m in o for m in _OPT_MARKS) and not o.startswith("triton_")) or "multi_tensor_apply" in k or "adam" in k:
        return "optimizer"
    attn_op = "attention" in o or "scaled_dot_product" in o or "flash" in o
    if attn_op and not any(g in k for g in ("elementwise", "reduce", "copy", "fill", "vectorized")):
        return "cross-attention" if _is_cross(dims, text_len) else "attention"
    if any(a in k for a in _ATTN_KERNELS) and "gemm" not in k:
        return "attention"
    if any(g in k for g in _GEMM_KERNELS) or op_name in _GEMM_OPS:
        return "GEMM"
    return "elementwise"


def _merged(intervals: list) -> list:
    """Sorted, disjoint [a, b) intervals covering ``intervals``."""
    out: list = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def exposed(intervals: list, others: list) -> float:
    """Length of the union of ``intervals`` not covered by the union of ``others`` (same time unit): e.g. the
    exchange time during which no other kernel runs."""
    cover = _merged(others)
    total, j = 0.0, 0
    for a, b in _merged(intervals):
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        t, k = a, j
        while t < b:
            if k >= len(cover) or cover[k][0] >= b:
                total += b - t
                break
            if cover[k][0] > t:
                total += cover[k][0] - t
            t = max(t, cover[k][1])
            k += 1
    return total


def busy(intervals: list) -> float:
    """Length of the union of ``intervals``."""
    return sum(b - a for a, b in _merged(intervals))


def categorize_trace(path: str, steps: int, text_len: int = 512) -> dict:
    """{category: ms per step} from a torch.profiler Chrome trace of ``steps`` steps, plus window/busy times and
    the exchange's exposed time (NCCL kernels running while no other kernel does) and its time beside other kernels
    (near 0 with a large exposed time: the exchange ran after the compute, not beside it)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    ops = {}
    for e in events:
        if e.get("cat") == "cpu_op" and "External id" in (e.get("args") or {}):
            ops[e["args"]["External id"]] = e
    ms = {c: 0.0 for c in CATEGORIES}
    kernels, top, by_op = [], {}, {}
    comm: list = []   # exchange kernels' intervals
    work: list = []   # every other kernel's
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        op = ops.get((e.get("args") or {}).get("External id"), {})
        name, dims = _op_name_dims(op)
        cat = category(e.get("name", ""), name, dims, text_len)
        ms[cat] += e["dur"] / 1e3
        kernels.append((e["ts"], e["ts"] + e["dur"]))
        (comm if cat == "exchange" else work).append(kernels[-1])
        key = (cat, e.get("name", "")[:90])
        top[key] = top.get(key, 0.0) + e["dur"] / 1e3
        okey = (cat, name or "?", json.dumps(dims)[:160])
        by_op[okey] = by_op.get(okey, 0.0) + e["dur"] / 1e3
    if not kernels:
        raise SystemExit(f"{path}: no GPU kernels in the trace (was it taken on a GPU?)")
    window = (max(b for _, b in kernels) - min(a for a, _ in kernels)) / 1e3
    busy_ms = busy(kernels) / 1e3
    ms["idle"] = window - busy_ms
    per_step = {c: v / steps for c, v in ms.items()}
    top_k = sorted(((v / steps, c, n) for (c, n), v in top.items()), reverse=True)[:25]
    top_ops = sorted(((v / steps, c, n, d) for (c, n, d), v in by_op.items() if c not in ("attention", "GEMM")),
                     reverse=True)[:30]
    return {"ms_per_step": per_step, "window_ms_per_step": window / steps, "busy_ms_per_step": busy_ms / steps,
            "exchange_exposed_ms_per_step": exposed(comm, work) / 1e3 / steps,
            "exchange_beside_ms_per_step": (busy(comm) - exposed(comm, work)) / 1e3 / steps,
            "top_kernels": [{"ms": round(v, 3), "category": c, "kernel": n} for v, c, n in top_k],
            "top_other_ops": [{"ms": round(v, 3), "category": c, "op": n, "input_dims": d} for v, c, n, d in top_ops]}


def ceiling_ms(model: str, layers: int, tokens: int, seqlen: int, attn_tflops: float, gemm_tflops: float,
               world: int = 1) -> dict:
    """One GPU's attention and GEMM time per step at the given rates: the step's FLOPs (as the MFU meter counts
    them, fwd+bwd, ``tokens`` over all ranks, sequences of ``seqlen``) shared by ``world`` GPUs."""
    tokens = tokens / world
    from training.video_dit.config import preset  # noqa: PLC0415
    cfg = preset(model, layers)
    d, f, L = cfg.dim, cfg.ffn, cfg.layers
    dense = 3 * 2 * (4 * d * d + 2 * d * d + 2 * d * f) * L * tokens
    attn = 3 * 2 * 2 * seqlen * d * L * tokens
    cross = 3 * 2 * 2 * cfg.text_len * d * L * tokens
    return {"attention": attn / attn_tflops / 1e9, "cross-attention": cross / attn_tflops / 1e9,
            "GEMM": dense / gemm_tflops / 1e9, "model_tflop_per_step": (dense + attn + cross) / 1e12}


def table(cats: dict, ceil: dict, step_ms: float) -> str:
    rows = ["| category | ms per step | share | ceiling ms |", "|---|---|---|---|"]
    for c in CATEGORIES:
        v = cats["ms_per_step"][c]
        rows.append(f"| {c} | {v:.1f} | {100 * v / step_ms:.1f}% | {ceil.get(c, 0.0):.1f} |")
    floor = sum(ceil.get(c, 0.0) for c in CATEGORIES)
    rows.append(f"| step (window) | {step_ms:.1f} | 100% | {floor:.1f} ({100 * floor / step_ms:.0f}% of the step) |")
    return "\n".join(rows)


def _video_tokens(rest: list, model: str) -> int:
    """Video tokens per sample from the entry's --frames (first value) and --latent-size HxW and the preset's patch."""
    from training.video_dit.config import preset  # noqa: PLC0415
    frames = int(rest[rest.index("--frames") + 1].split(",")[0])
    h, w = (int(x) for x in rest[rest.index("--latent-size") + 1].lower().split("x"))
    pt, ph, pw = preset(model).patch
    return (frames // pt) * (h // ph) * (w // pw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="profile_out")
    ap.add_argument("--tag", default="step")
    ap.add_argument("--trace", help="categorise this existing trace instead of running the entry")
    ap.add_argument("--steps", type=int, default=2, help="steps profiled (the entry's window)")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the profiled ones")
    ap.add_argument("--model", default=None, help="with --trace: the preset (for the ceiling)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="with --trace: tokens per step over all ranks")
    ap.add_argument("--world", type=int, default=1, help="with --trace: GPUs sharing those tokens")
    ap.add_argument("--seqlen", type=int, default=None, help="with --trace: the sequence length attention sees")
    ap.add_argument("--attn-tflops", type=float, default=600.0, help="cuDNN attention rate (H200: 580-620)")
    ap.add_argument("--gemm-tflops", type=float, default=790.0, help="bf16 GEMM rate (H200: ~790)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the entry point's flags")
    args = ap.parse_args()
    out_dir = os.path.join(args.out, args.tag)
    os.makedirs(out_dir, exist_ok=True)
    meta: dict = {"tag": args.tag}
    if args.trace:
        trace = args.trace
        model, layers, tokens, seqlen, world = args.model, args.layers, args.tokens, args.seqlen, args.world
    else:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        from training import pretrain_video_dit as entry  # noqa: PLC0415
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        start = args.warmup
        argv = rest + ["--profile", "--profile-step-start", str(start), "--profile-step-end", str(start + args.steps),
                       "--profile-ranks", "0", "--log-dir", out_dir, "--timing", "--log-interval", "1"]
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        res = entry.main(argv)
        trace = os.path.join(out_dir, "profile_rank0.json")
        rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
        # the entry's own step time and MFU: steps past the warm-up outside the profiled window (median)
        plain = sorted((r for r in rows if r["step"] >= 2 and not start <= r["step"] <= start + args.steps),
                       key=lambda r: r["step_time_s"]) or rows
        mid = plain[len(plain) // 2]
        prof_rows = [r for r in rows if start <= r["step"] < start + args.steps] or rows[-args.steps:]
        meta.update(argv=argv, entry_step_ms=1e3 * mid["step_time_s"], entry_mfu=mid.get("mfu"),
                    peak_mem_gib=mid.get("peak_mem_gib"), losses_tail=res.get("losses", [])[-3:],
                    world=dist.get_world_size(), device=torch.cuda.get_device_name(0) if torch.cuda.is_available()
                    else "cpu")
        last = prof_rows[-1]
        tokens = round(last["tokens_per_s"] * last["step_time_s"])  # over all ranks (data-parallel included)
        model = rest[rest.index("--model") + 1] if "--model" in rest else "tiny"
        layers = int(rest[rest.index("--num-layers") + 1]) if "--num-layers" in rest else None
        seqlen = _video_tokens(rest, model)
        world = dist.get_world_size()
        dist.barrier()
        if dist.get_rank() != 0:
            return
    cats = categorize_trace(trace, args.steps)
    ceil = ceiling_ms(model, layers, tokens, seqlen, args.attn_tflops, args.gemm_tflops, world) \
        if model and tokens else {}
    step_ms = cats["window_ms_per_step"]  # the profiled steps' GPU window (the profiler's own overhead included)
    md = table(cats, ceil, step_ms)
    meta.update(cats, ceiling_ms=ceil, tokens=tokens, seqlen=seqlen, model=model, layers=layers,
                attn_tflops=args.attn_tflops, gemm_tflops=args.gemm_tflops)
    with open(os.path.join(out_dir, "profile_categories.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(out_dir, "profile_categories.md"), "w") as f:
        f.write(md + "\n")
    print(md, flush=True)


if __name__ == "__main__":
    main()
