"""How the CUDA suite judges its records, and the checks on a reference whose measured error sets a tolerance.

A record (tests/gpu/cuda_suite.py): {"family", "case", "errs": {name: relative error}, "tol", optional "refused": why the
worker would not judge the case}. It passes only when nothing refused it, its tolerance is a finite number >= 0 and
every error is a finite number <= the tolerance. Nothing here lets a NaN pass: ``err <= tol`` is False for a NaN, but
``not err > tol`` is True and ``max([x, nan])`` is x; an inf tolerance (one derived from a reference that was itself
inf) would pass anything finite or infinite.
"""
from __future__ import annotations

import math
import numbers

from tests.reference import nan_worst, worst


def finite_number(x) -> bool:
    """A real number (Python or numpy scalar, not a tensor) that is neither NaN nor +-inf."""
    return isinstance(x, numbers.Real) and math.isfinite(x)


def verdict(rec: dict) -> str:
    """'' when ``rec`` passes, else why not (one line)."""
    if rec.get("refused"):
        return f"refused: {rec['refused']}"
    tol, errs = rec.get("tol"), rec.get("errs")
    if not finite_number(tol) or tol < 0:
        return f"tolerance {tol!r} is not a finite number >= 0"
    if not errs:
        return "no errors recorded"
    bad = {k: e for k, e in errs.items() if not finite_number(e)}
    if bad:
        return f"not finite: {bad}"
    over = {k: e for k, e in errs.items() if e > tol}
    return f"over tol {tol:.3g}: {over}" if over else ""


def merge_ranks(per_rank: list) -> list:
    """One record per case from every rank's records (the same cases in the same order on every rank): the worst
    error of each name over the ranks (a NaN kept), "ok" and "why" (the first failing rank's ``verdict``)."""
    counts = {len(r) for r in per_rank}
    if len(counts) != 1:
        raise AssertionError(f"ranks returned different numbers of records: {[len(r) for r in per_rank]}")
    merged = []
    for i, rec in enumerate(per_rank[0]):
        cases = {r[i]["case"] for r in per_rank}
        if len(cases) != 1:
            raise AssertionError(f"record {i} is a different case on different ranks: {sorted(cases)}")
        errs = {k: worst(r[i]["errs"][k] for r in per_rank) for k in rec["errs"]}
        why = next((f"rank {j}: {v}" if len(per_rank) > 1 else v for j, v in
                    ((j, verdict(r[i])) for j, r in enumerate(per_rank)) if v), "")
        merged.append({**rec, "errs": errs, "ok": not why, "why": why})
    return merged


def worst_item(errs: dict) -> tuple:
    """(name, error) of the largest error, a NaN counting as the largest; ("-", nan) for none."""
    return max(errs.items(), key=lambda kv: nan_worst(kv[1])) if errs else ("-", math.nan)


def checked_reference_err(err: float, cap: float, what: str) -> float:
    """``err``, the measured error of a reference run that will set a tolerance; ValueError naming ``what`` and
    ``err`` when it is not a finite number in [0, ``cap``] (a tolerance derived from it would measure the reference's
    failure, not the rounding it is meant to allow: an inf one passes every case)."""
    if not finite_number(err) or not 0 <= err <= cap:
        raise ValueError(f"{what}: error {err!r} is not a finite number <= {cap:g}; no tolerance is derived from it")
    return float(err)


def progress(rec: dict, rank: int) -> None:
    """Print one rank's record as soon as it is computed ("case ..." lines, rank 0's view; the merged verdict over
    every rank comes at the family's end): a family cut by a time limit keeps in its log what it finished."""
    if rank != 0:
        return
    name, err = worst_item(rec.get("errs") or {})
    why = verdict(rec)
    print(f"case {'ok ' if not why else 'BAD'} {rec.get('family', '?'):<14} {rec.get('case', '?')} (rank 0) max {name} "
          f"{err:.2e}{'' if not why else f'  ({why})'}", flush=True)
