"""Is torch's cuDNN backward graph cache (O/dO strides baked in, not in the key) what broke the packed DiT step on
cuDNN? Two "cudnn" kernel calls of one q/k/v key on this GPU, the first with a transposed dO, the second with a
contiguous one (tests/test_cudnn_layouts.py ``two_calls``), each in a fresh process (no graph cached before):
with the library's dO-layout hook (kernels/cudnn.py ``grad_in_own_layout``) and with it taken out. Errors of
out/dq/dk/dv against fp64 math, one JSON file.

    python tools/check_cudnn_do_layout.py --out DIR          (one GPU; DIR/cudnn_do_layout.json)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one(hook: bool) -> dict:
    import torch  # noqa: PLC0415
    from megatron_sp_ext.attention.kernels import cudnn  # noqa: PLC0415
    from tests.test_cudnn_layouts import two_calls  # noqa: PLC0415
    if not hook:
        cudnn.grad_in_own_layout = lambda out: out
    errs = two_calls(torch.device("cuda", 0), torch.bfloat16)
    return {"hook": hook, "first_call_dO_transposed": dict(zip(("out", "dq", "dk", "dv"), errs[0])),
            "second_call_dO_contiguous": dict(zip(("out", "dq", "dk", "dv"), errs[1]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", choices=("hook", "no_hook"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one == "hook")))
        return
    import torch  # noqa: PLC0415
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"), "runs": []}
    for which in ("hook", "no_hook"):
        p = subprocess.run([sys.executable, __file__, "--out", args.out, "--one", which], capture_output=True,
                           text=True, timeout=240)
        try:
            res["runs"].append(json.loads((p.stdout.strip().splitlines() or [""])[-1]))
        except json.JSONDecodeError:
            res["runs"].append({"hook": which == "hook", "error": f"exit {p.returncode}: {p.stderr.strip()[-400:]}"})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cudnn_do_layout.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
