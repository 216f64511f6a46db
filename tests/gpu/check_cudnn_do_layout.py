"""Is torch's cuDNN backward graph cache (O/dO strides baked in, not in the key) what broke the packed DiT step on
cuDNN? Two "cudnn" kernel calls of one q/k/v key on this GPU, the first with a transposed dO, the second with a
contiguous one (tests/test_cudnn_layouts.py ``two_calls``), each in a fresh process (no graph cached before):
with the library's dO-layout hook (kernels/cudnn.py ``grad_in_own_layout``) and with it taken out. Errors of
out/dq/dk/dv against fp64 math, one JSON file.

    python tests/gpu/check_cudnn_do_layout.py --out DIR          (one GPU; DIR/cudnn_do_layout.json)
    python tests/gpu/check_cudnn_do_layout.py --out DIR --device cpu    (the flow on the CPU stand-in,
                                                                        tests/fake_cudnn.py)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class _Setattr:
    """What ``tests.fake_cudnn.install`` needs of pytest's monkeypatch (this process ends right after)."""

    @staticmethod
    def setattr(obj, name, value, raising=True) -> None:
        setattr(obj, name, value)


def one(hook: bool, device: str) -> dict:
    import torch  # noqa: PLC0415
    from megatron_sp_ext.attention.kernels import cudnn  # noqa: PLC0415
    from tests.test_cudnn_layouts import two_calls  # noqa: PLC0415
    if device == "cpu":
        from tests import fake_cudnn  # noqa: PLC0415
        fake_cudnn.install_sdpa(_Setattr())
    if not hook:
        cudnn.grad_in_own_layout = lambda out: out
    dev, dtype = (torch.device("cuda", 0), torch.bfloat16) if device == "cuda" else (torch.device("cpu"), torch.float64)
    errs = two_calls(dev, dtype)
    return {"hook": hook, "first_call_dO_transposed": dict(zip(("out", "dq", "dk", "dv"), errs[0])),
            "second_call_dO_contiguous": dict(zip(("out", "dq", "dk", "dv"), errs[1]))}


def _env() -> dict:
    """The child's environment: this checkout first on its import path (it imports ``tests``)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the CPU stand-in of cuDNN")
    ap.add_argument("--one", choices=("hook", "no_hook"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one == "hook", args.device)))
        return {}
    import torch  # noqa: PLC0415
    res = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (tests/fake_cudnn.py)",
           "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"), "runs": []}
    for which in ("hook", "no_hook"):
        p = subprocess.run([sys.executable, __file__, "--out", args.out, "--device", args.device, "--one", which],
                           capture_output=True, text=True, timeout=240, env=_env())
        try:
            res["runs"].append(json.loads((p.stdout.strip().splitlines() or [""])[-1]))
        except json.JSONDecodeError:
            res["runs"].append({"hook": which == "hook", "error": f"exit {p.returncode}: {p.stderr.strip()[-400:]}"})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cudnn_do_layout.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
