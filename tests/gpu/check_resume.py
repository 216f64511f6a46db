"""Whether a resumed training run continued bit for bit: the losses of the steps a resumed run logged against the
same steps of the uninterrupted run (each run's metrics.jsonl, written by the entry's --log-dir on rank 0; run
both with --log-interval 1 so every step has its loss), and optionally the saving run's steps too.

    python tests/gpu/check_resume.py --straight $W/straight --resumed $W/resumed [--first $W/first] --out $W/resume.json

Exit 0 when every compared step's loss is identical (float equality of the logged values) and the resumed run
logged at least one step; else 1, naming the steps. With ``--rtol R`` (a resume at another SP size, whose
reductions round differently) a step passes when its relative difference is <= R instead; ``bit_identical`` is
still reported. JSON: per step the losses, equal or not, the counts and the
largest relative difference. The saving run's steps (``--first``) are the control: they repeat the uninterrupted
run's first steps with no checkpoint involved, so a difference there is the GPU step's own run-to-run
nondeterminism (docs/checkpoints.md measured one on 2026-11-23), not the resume's; the resumed steps should then
differ by no more than that.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def losses_of(log_dir: str) -> dict[int, float]:
    """step -> loss of ``log_dir``/metrics.jsonl (rows without a loss left out)."""
    path = os.path.join(log_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path}: no metrics.jsonl (run the entry with --log-dir {log_dir})")
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                if row.get("loss") is not None:
                    out[int(row["step"])] = float(row["loss"])
    return out


def compare(straight: dict, other: dict, what: str, rtol: "float | None" = None) -> dict:
    """Every step of ``other`` against ``straight``: rows, equal steps, and the problems (named): a step that is
    not identical, or with ``rtol`` one whose relative difference exceeds it."""
    rows, problems = [], []
    for step in sorted(other):
        ref = straight.get(step)
        same = ref is not None and ref == other[step]
        rows.append({"step": step, "straight": ref, what: other[step], "identical": same})
        if ref is None:
            problems.append(f"{what} step {step}: the uninterrupted run has no loss for it")
        elif not same and (rtol is None or not abs(other[step] - ref) <= rtol * abs(ref)):
            problems.append(f"{what} step {step}: loss {other[step]!r} vs uninterrupted {ref!r} "
                            f"(rel {abs(other[step] - ref) / max(abs(ref), 1e-30):.3g})")
    if not other:
        problems.append(f"{what}: no step logged")
    rel = [abs(r[what] - r["straight"]) / max(abs(r["straight"]), 1e-30) for r in rows if r["straight"] is not None]
    return {"rows": rows, "steps": len(rows), "identical": sum(r["identical"] for r in rows),
            "max_rel_diff": max(rel, default=None), "rtol": rtol, "problems": problems}


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--straight", required=True, help="--log-dir of the uninterrupted run")
    ap.add_argument("--resumed", required=True, help="--log-dir of the run started with --load")
    ap.add_argument("--first", default=None, help="--log-dir of the run that saved the checkpoint (optional)")
    ap.add_argument("--out", default=None, help="write the comparison here (JSON)")
    ap.add_argument("--rtol", type=float, default=None,
                    help="pass a step within this relative difference instead of bit for bit (a resume at another SP "
                         "size); bit_identical is still reported")
    a = ap.parse_args(argv)
    straight = losses_of(a.straight)
    result = {"resumed": compare(straight, losses_of(a.resumed), "resumed", a.rtol)}
    if a.first:
        result["first"] = compare(straight, losses_of(a.first), "first", a.rtol)
    problems = [p for part in result.values() for p in part["problems"]]
    result["bit_identical"] = all(part["identical"] == part["steps"] > 0 for part in result.values())
    result["passed"] = not problems
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    for name, part in result.items():
        if isinstance(part, dict):
            print(f"[check_resume] {name}: {part['identical']} of {part['steps']} steps bit-identical to the "
                  f"uninterrupted run (largest relative difference {part['max_rel_diff']}"
                  + (f"; passing within rtol {a.rtol:g}: {not part['problems']})" if a.rtol is not None else ")"))
    for p in problems:
        print(f"[check_resume] DIFFERS: {p}", file=sys.stderr)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
