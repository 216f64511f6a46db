"""Which torch SDPA call of a DiT step goes wrong in bf16? Records every ``F.scaled_dot_product_attention`` call of
one SP=1 bf16 step (inputs with their strides, the incoming gradient of its output), then replays each call alone
(same data, same strides, torch's default backend choice) against fp32 math: out and dq/dk/dv errors, non-finite
flags, shapes and strides per call; and reruns the whole step with cuDNN left out of SDPA's backends.

Steps: "dynamic" (tests/gpu/cuda_dit_dynamic.py's pack at SP=1 on the cudnn kernel: non-finite bf16 gradients on an H100
and an H200, 2026-11-25/26) and "sparse" (tests/gpu/cuda_dit_sparse.py's top-k case at SP=1 on auto: 7.2e-2 off fp32 on
an H200, 2026-11-26, while SP=2 was 4.2e-3 off).

    python tests/gpu/check_sdpa_calls.py --out DIR [--steps dynamic,sparse]      (one GPU; DIR/sdpa_calls.json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.gpu.cuda_dit_sparse import normwise  # noqa: E402
from tests.reference import rel_err  # noqa: E402
from training.video_dit.engine import make_core  # noqa: E402

REAL = F.scaled_dot_product_attention


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class Recorder:
    """Wraps F.scaled_dot_product_attention: keeps each call's q/k/v (strided copies), kwargs and dO."""

    def __init__(self) -> None:
        self.calls: list = []

    def __enter__(self):
        def sdpa(q, k, v, *args, **kwargs):
            out = REAL(q, k, v, *args, **kwargs)
            rec = {"qkv": [strided_copy(t.detach()) for t in (q, k, v)], "args": args,
                   "kwargs": {n: (x.detach().clone() if torch.is_tensor(x) else x) for n, x in kwargs.items()},
                   "dout": None, "backends": [str(b) for b in torch._C._get_sdp_backends()]
                   if hasattr(torch._C, "_get_sdp_backends") else None}
            if out.requires_grad:
                out.register_hook(lambda g, rec=rec: rec.__setitem__("dout", g.detach().clone()))
            self.calls.append(rec)
            return out
        F.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = REAL


def replay(rec: dict) -> dict:
    q, k, v = rec["qkv"]
    row = {"q": [list(q.shape), list(q.stride())], "k": [list(k.shape), list(k.stride())],
           "v": [list(v.shape), list(v.stride())], "dtype": str(q.dtype),
           "kwargs": {n: (list(x.shape) if torch.is_tensor(x) else x) for n, x in rec["kwargs"].items()},
           "has_dout": rec["dout"] is not None}
    if q.dtype not in (torch.bfloat16, torch.float16):
        return row
    qs, ks, vs = (strided_copy(t).requires_grad_() for t in (q, k, v))
    out = REAL(qs, ks, vs, *rec["args"], **rec["kwargs"])
    kw32 = {n: (x.float() if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in rec["kwargs"].items()}
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = REAL(qf, kf, vf, *rec["args"], **kw32)
    row["out"] = rel_err(out.float(), ref) if bool(torch.isfinite(out).all()) else "non-finite"
    if rec["dout"] is not None:
        d = rec["dout"]
        row["dout_absmax"] = float(d.float().abs().max())
        row["dout"] = [list(d.shape), list(d.stride())]
        grads = torch.autograd.grad(out, (qs, ks, vs), d)
        refs = torch.autograd.grad(ref, (qf, kf, vf), d.float())
        for n, a, r in zip(("dq", "dk", "dv"), grads, refs):
            row[n] = rel_err(a.float(), r) if bool(torch.isfinite(a).all()) else "non-finite"
    return row


def errors_of(q, k, v, dout, args, kwargs) -> dict:
    """out/dq/dk/dv errors of one bf16 call (default backend) against fp32 math on the same tensors."""
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out = REAL(qs, ks, vs, *args, **kwargs)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = REAL(qf, kf, vf, *args, **kwargs)
    grads = torch.autograd.grad(out, (qs, ks, vs), dout)
    refs = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    fin = lambda a, r: rel_err(a.float(), r) if bool(torch.isfinite(a).all()) else "non-finite"  # noqa: E731
    return {"out": fin(out, ref), **{n: fin(a, r) for n, a, r in zip(("dq", "dk", "dv"), grads, refs)}}


def random_like_call(rec: dict) -> dict:
    """The call's errors on random data of the same shapes and strides (this process: its cached graphs)."""
    g = torch.Generator(device=rec["qkv"][0].device).manual_seed(0)
    q, k, v = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(
        torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype)) for t in rec["qkv"])
    dout = torch.randn(rec["dout"].shape, generator=g, device=q.device, dtype=q.dtype)
    return errors_of(q, k, v, dout, rec["args"], rec["kwargs"])


def fresh_process(rec: dict, path: str) -> dict:
    """The call's errors on its own data in a new process (no cached cuDNN graphs)."""
    import subprocess  # noqa: PLC0415
    torch.save({"qkv": [t.cpu() for t in rec["qkv"]], "strides": [t.stride() for t in rec["qkv"]],
                "dout": rec["dout"].cpu(),
                "kwargs": {n: x for n, x in rec["kwargs"].items() if not torch.is_tensor(x)}},
               path)
    p = subprocess.run([sys.executable, __file__, "--out", os.path.dirname(path), "--replay-file", path],
                       capture_output=True, text=True, timeout=120)
    try:
        return json.loads((p.stdout.strip().splitlines() or [""])[-1])
    except json.JSONDecodeError:
        return {"error": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}


def replay_file(path: str) -> None:
    """Each saved call of ``path`` (comma-separated files) in order, each twice, in this fresh process: one JSON line
    of errors per run (is a cached cuDNN graph wrong when reused?)."""
    dev = torch.device("cuda", 0)
    rows = []
    for one in path.split(","):
        d = torch.load(one, weights_only=True)   # tensors and plain values only: loading runs no code
        q, k, v = (torch.empty_strided(t.shape, st, dtype=t.dtype, device=dev).copy_(t)
                   for t, st in zip(d["qkv"], d["strides"]))
        for run in (1, 2):
            rows.append({"file": os.path.basename(one), "run": run,
                         **errors_of(q, k, v, d["dout"].to(dev), (), d["kwargs"])})
    print(json.dumps({"runs": rows}))



def step(which: str, dev, autocast):
    if which == "dynamic":
        from tests.gpu import cuda_dit_dynamic as w  # noqa: PLC0415
        kernel = "cudnn" if autocast and dev.type == "cuda" else "auto"
        core = make_core("ulysses", None, num_heads=w.CFG.heads, backend=kernel)
        return w.dit_step(core, None, 0, 1, dev, autocast)
    from tests.gpu import cuda_dit_sparse as w  # noqa: PLC0415
    _, spec, _, _ = w.CASES[0]
    return w.sparse_step(spec, make_core("ulysses", None, num_heads=w.CFG.heads), None, dev, autocast)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="dynamic,sparse")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the flow")
    ap.add_argument("--replay-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replay_file:
        replay_file(args.replay_file)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    res = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(),
           "date": time.strftime("%Y-%m-%d"), "steps": {}}
    for which in args.steps.split(","):
        _, ref = step(which, dev, None)
        with Recorder() as r:
            _, g16 = step(which, dev, torch.bfloat16)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            _, g_nocudnn = step(which, dev, torch.bfloat16)
        finite = lambda gs: all(bool(torch.isfinite(g).all()) for g in gs)  # noqa: E731
        entry = {"step_bf16_vs_fp32": normwise(g16, ref) if finite(g16) else "non-finite",
                 "step_bf16_no_cudnn_sdpa_vs_fp32": normwise(g_nocudnn, ref) if finite(g_nocudnn) else "non-finite",
                 "calls": []}
        if which == "sparse":   # VSA's coarse branch in the input dtype (bf16), as before 2026-11-26
            from training.video_dit import model  # noqa: PLC0415
            fp32_coarse = model.coarse_tiles
            model.coarse_tiles = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
            try:
                _, g_old = step(which, dev, torch.bfloat16)
            finally:
                model.coarse_tiles = fp32_coarse
            entry["step_bf16_coarse_in_bf16_vs_fp32"] = normwise(g_old, ref) if finite(g_old) else "non-finite"
        for i, rec in enumerate(r.calls):
            try:
                row = replay(rec)
            except Exception as e:  # noqa: BLE001 - recorded
                row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            row["index"] = i
            bad = any(row.get(n) == "non-finite" or (isinstance(row.get(n), float) and row[n] > 0.05)
                      for n in ("out", "dq", "dk", "dv"))
            if bad and rec["dout"] is not None and sum(1 for c in entry["calls"] if "fresh_process" in c) < 4:
                row["random_data_same_layout"] = random_like_call(rec)
                os.makedirs(args.out, exist_ok=True)
                row["fresh_process"] = fresh_process(rec, os.path.join(args.out, f"call_{which}_{i}.pt"))
            entry["calls"].append(row)
            print(which, json.dumps(row), flush=True)
        saved = sorted(f for f in os.listdir(args.out) if f.startswith(f"call_{which}_") and f.endswith(".pt")) \
            if os.path.isdir(args.out) else []
        if saved:   # the bad calls one after another in one fresh process, each run twice
            import subprocess  # noqa: PLC0415
            p = subprocess.run([sys.executable, __file__, "--out", args.out, "--replay-file",
                                ",".join(os.path.join(args.out, f) for f in saved)],
                               capture_output=True, text=True, timeout=300)
            try:
                entry["fresh_process_sequence"] = json.loads((p.stdout.strip().splitlines() or [""])[-1])
            except json.JSONDecodeError:
                entry["fresh_process_sequence"] = {"error": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}
            print(which, "sequence", json.dumps(entry["fresh_process_sequence"]), flush=True)
        res["steps"][which] = entry
        print(which, {k: v for k, v in entry.items() if k != "calls"}, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sdpa_calls.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
