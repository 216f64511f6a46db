r"""Compare training-loss curves of runs that should agree (same data, same seed, a changed implementation).

Each run is a ``metrics.jsonl`` written by a training entry point (one JSON row per step, fields ``step`` and
``loss``). The first run named ``--noise`` (or, without it, none) is the yardstick: the gap between two runs that
differ only in precision (e.g. fp32 eager vs bf16 eager) is what "within bf16 noise" means. Writes
``<out>/loss_curves.json`` (per-step losses, each run's max and mean relative gap to the reference, the noise
gap, and ``within_noise`` per run) and ``<out>/loss_curves.png``.

    python tools/loss_curves.py --out runs/curves --ref eager_bf16=runs/a/metrics.jsonl \
        --run fused_bf16=runs/b/metrics.jsonl --noise eager_fp32=runs/c/metrics.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional


def read_losses(path: str) -> dict[int, float]:
    """{step: loss} from a metrics.jsonl (rows without a loss are skipped)."""
    out: dict[int, float] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            if "loss" in row and "step" in row and row["loss"] is not None:
                out[int(row["step"])] = float(row["loss"])
    if not out:
        raise SystemExit(f"{path}: no rows with 'step' and 'loss'")
    return out


def gaps(ref: dict[int, float], other: dict[int, float]) -> dict[str, float]:
    """Max and mean |other - ref| / |ref| over the steps both have."""
    steps = sorted(set(ref) & set(other))
    if not steps:
        raise SystemExit("the runs share no step")
    rel = [abs(other[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in steps]
    return {"steps": len(steps), "max_rel": max(rel), "mean_rel": sum(rel) / len(rel)}


def _named(spec: str, flag: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"{flag} {spec!r}: expected NAME=path/to/metrics.jsonl")
    return name, path


def compare(ref: tuple[str, str], runs: list[tuple[str, str]], noise: Optional[tuple[str, str]],
            out: str) -> dict:
    """Read every run, compute the gaps to ``ref`` and the noise yardstick, write JSON and a plot."""
    curves = {ref[0]: read_losses(ref[1])}
    for name, path in runs + ([noise] if noise else []):
        curves[name] = read_losses(path)
    result: dict = {"reference": ref[0], "files": {n: p for n, p in [ref] + runs + ([noise] if noise else [])},
                    "losses": {n: [c[s] for s in sorted(c)] for n, c in curves.items()}, "runs": {}}
    noise_gap = gaps(curves[ref[0]], curves[noise[0]]) if noise else None
    result["noise"] = {"name": noise[0], **noise_gap} if noise else None
    for name, _ in runs:
        g = gaps(curves[ref[0]], curves[name])
        if noise_gap is not None:
            g["within_noise"] = g["max_rel"] <= noise_gap["max_rel"]
        result["runs"][name] = g
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "loss_curves.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, c in curves.items():
            steps = sorted(c)
            ax.plot(steps, [c[s] for s in steps], label=name, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "loss_curves.png"), dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover - matplotlib is a dependency of the training extras
        print("matplotlib not installed: no plot written", file=sys.stderr)
    return result


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for loss_curves.json / .png")
    p.add_argument("--ref", required=True, help="NAME=metrics.jsonl of the reference run")
    p.add_argument("--run", action="append", default=[], help="NAME=metrics.jsonl of a run to compare (repeat)")
    p.add_argument("--noise", help="NAME=metrics.jsonl of a run differing from --ref only in precision")
    a = p.parse_args(argv)
    res = compare(_named(a.ref, "--ref"), [_named(r, "--run") for r in a.run],
                  _named(a.noise, "--noise") if a.noise else None, a.out)
    for name, g in res["runs"].items():
        print(f"{name} vs {res['reference']}: max rel {g['max_rel']:.3e}, mean {g['mean_rel']:.3e}"
              + (f", within noise ({res['noise']['max_rel']:.3e}): {g['within_noise']}" if res["noise"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
