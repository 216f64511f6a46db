"""How the CUDA suite judges its records (tests/gpu/suite_judge.py), on the CPU: a NaN or inf error, a non-finite
tolerance or a refused case fails, also after merging ranks (where ``max`` would drop a NaN); the error helpers of
tests/reference.py never hand a NaN on; a tolerance or divisor derived from a measured reference error
(tests/gpu/cuda_dit_dynamic.bf16_tolerance, tests/gpu/cuda_tp_cp.normalised_errs) refuses a non-finite or over-cap one; and
the dit_dynamic worker itself, dry-run on CPU gloo ranks (SPX_SUITE_DEVICE=cpu), refuses every bf16 case when its
SP=1 bf16 reference has non-finite gradients (the 2 x H100 cuDNN run of 2026-11-25 reported those cases "ok").
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.gpu import cuda_dit_dynamic, cuda_tp_cp
from tests.harness import run_ranks
from tests.reference import curve_err, rel_diff, rel_err, worst
from tests.gpu.suite_judge import checked_reference_err, merge_ranks, verdict, worst_item

INF, NAN = math.inf, math.nan


def _rec(errs: dict, tol=2e-2, **extra) -> dict:
    return {"family": "f", "case": "c", "errs": errs, "tol": tol, **extra}


def test_verdict_passes_only_finite_errors_within_a_finite_tolerance():
    assert verdict(_rec({"out": 1e-3, "dq": 2e-2})) == ""
    assert verdict(_rec({"check": 0.0}, tol=0.0)) == ""
    for errs in ({"out": INF}, {"out": NAN}, {"out": 1e-3, "dq": NAN}, {"out": NAN, "dq": 1e-3}, {"out": -INF},
                 {"out": torch.tensor(1e-3)}, {"out": None}):
        assert verdict(_rec(errs)).startswith("not finite"), errs
    assert verdict(_rec({"out": 3e-2})).startswith("over tol")
    assert verdict(_rec({})) == "no errors recorded"
    for tol in (INF, NAN, None, -1.0, "2e-2"):
        assert "tolerance" in verdict(_rec({"out": 0.0}, tol=tol)), tol
    # the 2026-11-25 dit_dynamic record: sp1 tolerance inf, gradients 2.56e+37 (printed "ok")
    assert verdict(_rec({"loss": 1e-4, "grads": 2.56e37}, tol=INF))
    assert verdict(_rec({"out": 0.0}, refused="SP=1 reference not finite")) == "refused: SP=1 reference not finite"


def test_merge_ranks_keeps_nan_and_every_ranks_verdict():
    ok, nan = _rec({"out": 1e-3, "dq": 1e-3}), _rec({"out": 1e-3, "dq": NAN})
    assert max([1e-3, NAN]) == 1e-3  # why merging needs care: Python's max drops a NaN that is not first
    merged = merge_ranks([[ok], [nan]])
    assert math.isnan(merged[0]["errs"]["dq"]) and not merged[0]["ok"] and merged[0]["why"].startswith("rank 1:")
    assert worst_item(merged[0]["errs"])[0] == "dq"
    refused = merge_ranks([[ok], [_rec({"out": 1e-3, "dq": 1e-3}, refused="no")]])[0]
    assert not refused["ok"] and refused["why"] == "rank 1: refused: no"
    inf_tol = merge_ranks([[_rec({"out": 1e-3}, tol=INF)]])[0]
    assert not inf_tol["ok"] and "tolerance inf" in inf_tol["why"]
    assert merge_ranks([[ok], [ok]])[0]["ok"]
    with pytest.raises(AssertionError, match="different numbers of records"):
        merge_ranks([[ok], []])
    with pytest.raises(AssertionError, match="different case"):
        merge_ranks([[ok], [{**ok, "case": "other"}]])


def test_error_helpers_never_hand_on_a_nan():
    x = torch.ones(4)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[1] = bad
        assert rel_err(y, x) == INF and rel_err(x, y) == INF and rel_err(y, y) == INF, bad
    assert rel_err(x, x) == 0.0
    assert rel_diff(1.0, 1.0) == 0.0 and rel_diff(1.1, 1.0) == pytest.approx(0.1)
    assert rel_diff(NAN, 1.0) == rel_diff(1.0, NAN) == rel_diff(INF, INF) == rel_diff(1.0, 0.0) == INF
    assert math.isnan(worst([1e-3, NAN, 2e-3])) and worst([1e-3, 2e-3]) == 2e-3
    assert curve_err([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert curve_err([1.0], [1.0, 2.0]) == curve_err([], []) == curve_err([1.0, NAN], [1.0, 2.0]) == INF


def test_reference_errors_that_set_a_tolerance_are_checked():
    assert checked_reference_err(1e-2, 5e-2, "ref") == 1e-2
    for err in (INF, NAN, 5.01e-2, -1e-3, None):
        with pytest.raises(ValueError, match=r"^ref: error .* is not a finite number <= 0.05"):
            checked_reference_err(err, 5e-2, "ref")


def test_dit_dynamic_bf16_tolerance_from_a_finite_capped_sp1_error():
    tol = cuda_dit_dynamic.bf16_tolerance
    assert cuda_dit_dynamic.SP1_BF16_CAP == 5e-2
    assert tol(0.0, "auto") == tol(1e-2, "auto") == 2e-2  # the fixed bf16 floor
    assert tol(3e-2, "auto") == pytest.approx(4.5e-2) and tol(5e-2, "cudnn") == pytest.approx(7.5e-2)
    for err in (INF, NAN, 5.1e-2, 2.56e37):
        with pytest.raises(ValueError, match=r"SP=1 bf16 vs SP=1 fp32 on kernel 'cudnn': error .* is not a finite"):
            tol(err, "cudnn")


def test_tp_cp_baseline_divisor_is_checked():
    errs = {"out": 1e-2, "dx": 3e-2}
    assert cuda_tp_cp.normalised_errs(errs, {"out": 5e-3, "dx": 2e-2}) == pytest.approx({"out": 1.0, "dx": 1.5})
    for bad in (INF, NAN, 0.5):  # an inf baseline turned every bf16 error into 0 before
        with pytest.raises(ValueError, match="unsharded bf16 block's dx"):
            cuda_tp_cp.normalised_errs(errs, {"out": 5e-3, "dx": bad})


def _dit_dynamic_on_cpu(monkeypatch, poison=None) -> list:
    """tests/gpu/cuda_dit_dynamic on 2 CPU gloo ranks, ``poison(loss, grads, group, autocast, core)`` applied to every
    step's result; the merged, judged records."""
    monkeypatch.setattr(cuda_dit_dynamic, "DEV", "cpu")
    if poison is not None:
        step = cuda_dit_dynamic.dit_step

        def poisoned(core, group, rank, world, device, autocast, plan=None, watch=None):
            loss, grads = step(core, group, rank, world, device, autocast, plan, watch)
            return poison(loss, grads, group, autocast, core)
        monkeypatch.setattr(cuda_dit_dynamic, "dit_step", poisoned)
    return merge_ranks(run_ranks(cuda_dit_dynamic.dit_dynamic_family, 2, timeout=300))


def test_dit_dynamic_worker_on_cpu_passes(monkeypatch):
    merged = _dit_dynamic_on_cpu(monkeypatch)
    assert len(merged) == 6 and all(m["ok"] for m in merged), [(m["case"], m["why"]) for m in merged]
    bf16 = [m for m in merged if m["case"].split()[2] == "bf16"]
    assert all(math.isfinite(m["sp1_bf16_tol"]) and m["sp1_bf16_tol"] <= 1.5 * cuda_dit_dynamic.SP1_BF16_CAP
               for m in bf16)


def test_dit_dynamic_worker_refuses_a_non_finite_sp1_reference(monkeypatch):
    """SP=1 bf16 with an inf gradient (what cuDNN gave): every bf16 case refused naming the kernel and the error,
    whatever its own errors; a dynamic step whose loss is NaN fails its fp32 case; the other fp32 cases pass."""
    dynamic_steps = []  # per rank (forked): fp32 ulysses, hcms, ring, then bf16

    def poison(loss, grads, group, autocast, core):
        if group is None and autocast is not None:  # the SP=1 bf16 reference
            grads[3] = torch.full_like(grads[3], float("inf"))
        if group is not None:
            dynamic_steps.append(core)
            if len(dynamic_steps) == 3:  # the fp32 ring case
                loss = float("nan")
        return loss, grads
    merged = _dit_dynamic_on_cpu(monkeypatch, poison)
    assert len(merged) == 6
    for m in merged:
        if m["case"].split()[2] == "bf16":
            assert not m["ok"] and m["why"].startswith(
                "rank 0: refused: SP=1 bf16 vs SP=1 fp32 on kernel 'auto': error inf"), m["why"]
            assert m["sp1_bf16_errs"]["grads"] == INF and math.isnan(m["tol"])
    fp32 = {m["case"].split()[1]: m for m in merged if m["case"].split()[2] == "fp32"}
    assert fp32["ulysses"]["ok"] and fp32["hcms2"]["ok"], fp32
    assert not fp32["ring"]["ok"] and fp32["ring"]["why"].endswith("not finite: {'loss': inf}"), fp32["ring"]


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


class _BlowUp(torch.nn.Module):
    def forward(self, x):
        return _InfGrad.apply(x)


def test_non_finite_watch_names_the_module_where_gradients_stop_being_finite():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _BlowUp(), torch.nn.Linear(4, 1))
    watch = cuda_dit_dynamic.NonFiniteWatch()
    watch(model)
    model(torch.randn(3, 4)).sum().backward()
    assert watch.first.startswith("1 (_BlowUp, grad_out [(3, 4)])"), watch.first
    clean = cuda_dit_dynamic.NonFiniteWatch()
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    clean(other)
    other(torch.randn(3, 4)).sum().backward()
    assert clean.first == ""
