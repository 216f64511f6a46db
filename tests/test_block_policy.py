"""LayerPolicy and FormPolicy decisions (the timing is replaced by fixed numbers; the real one needs CUDA events)."""
import torch
import torch.distributed as dist

from megatron_sp_ext.sp.layers.policy import PLAIN, LayerChoice, LayerPolicy
from tests.harness import run_ranks


class _Scripted(LayerPolicy):
    """Timings from a script: first call = the calibration rounds, second = the confirmation."""

    def __init__(self, scripts, **kw):
        super().__init__(**kw)
        self.scripts, self.runs = list(scripts), 0

    def _timed_rounds(self, run, cands, rounds, group, device=None):
        table = self.scripts.pop(0)
        return {c: table.get(c.label, 10.0) for c in cands}


ASYNC2 = LayerChoice(True, 2, "nccl")


def test_candidates_skip_what_cannot_run_here():
    pol = LayerPolicy()

    def body(rank, world):
        cands = pol.candidates(heads_per_rank=1, group=dist.group.WORLD, device=torch.device("cpu"))
        assert [c.label for c in cands] == ["plain", "async", "allgather"]  # C=2 needs 2 heads; symm_mem: CUDA
        cands = pol.candidates(heads_per_rank=4, group=dist.group.WORLD, device=torch.device("cpu"))
        assert [c.label for c in cands] == ["plain", "plain_hcms2", "async", "async_hcms2", "allgather",
                                            "allgather_hcms2"]
        no_ag = LayerPolicy(allgather=False).candidates(heads_per_rank=4, group=dist.group.WORLD,
                                                        device=torch.device("cpu"))
        assert [c.label for c in no_ag] == ["plain", "plain_hcms2", "async", "async_hcms2"]
        return True
    run_ranks(body, 2)


def test_decisions_margin_and_confirmation():
    # clear win, confirmed
    dec = _Scripted([{"plain": 10.0, "async_hcms2": 9.0}, {"plain": 10.0, "async_hcms2": 9.1}])._calibrate(
        None, [PLAIN, ASYNC2], None)
    assert dec.choice == ASYNC2 and dec.confirm == (10.0, 9.1)
    # within the 2% margin: plain, no confirmation needed
    pol = _Scripted([{"plain": 10.0, "async_hcms2": 9.85}])
    dec = pol._calibrate(None, [PLAIN, ASYNC2], None)
    assert dec.choice == PLAIN and "within 2%" in dec.reason and not pol.scripts
    # looked faster, lost the confirmation: plain
    dec = _Scripted([{"plain": 10.0, "async_hcms2": 9.0}, {"plain": 10.0, "async_hcms2": 9.9}])._calibrate(
        None, [PLAIN, ASYNC2], None)
    assert dec.choice == PLAIN and "lost the interleaved confirmation" in dec.reason
    # a tie at the top goes to plain
    dec = _Scripted([{"plain": 10.0, "async_hcms2": 10.0}])._calibrate(None, [PLAIN, ASYNC2], None)
    assert dec.choice == PLAIN


# --- FormPolicy: named forms, the first the baseline (the Megatron adapter's --sp-async-qkv auto) --------------

FORMS = ("megatron", "pipelined", "mixed")


def _scripted_timer(table, calls):
    """A FormTimer: runs the step once (so a candidate that cannot run fails the test) and answers
    table[name][round] for this rank (table: name -> per-round ms, or a function of the rank)."""
    seen = {}

    def timer(name, step, iters, warmup, group):
        step()
        calls.append(name)
        r = seen[name] = seen.get(name, -1) + 1
        t = table[name]
        return (t(dist.get_rank()) if callable(t) else t)[r]
    return timer


def _form_policy_case(rank, world, table, **kw):
    import logging

    from megatron_sp_ext.sp.layers.policy import FormPolicy
    calls, ran, logged = [], [], []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("megatron_sp_ext")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    pol = FormPolicy(timer=_scripted_timer(table, calls), **kw)
    cands = {n: (lambda n=n: ran.append(n)) for n in FORMS}
    form = pol.fastest(("k", 1), cands, dist.group.WORLD, torch.device("cpu"))
    n_ran = len(ran)
    assert pol.fastest(("k", 1), cands, dist.group.WORLD, torch.device("cpu")) == form  # cached: nothing runs
    assert len(ran) == n_ran
    assert len(logged) == 1 and f"layer form -> {form} for ('k', 1)" in logged[0], logged  # logged once per key
    dec = pol.cache[("k", 1)]
    return form, dec.reason, dec.rounds, ran, calls



def test_form_policy_needs_a_majority_of_rounds_and_the_margin():
    r = lambda *ts: list(ts)  # noqa: E731
    # mixed 10% faster in every round: chosen; every form ran its warm-up calls and one timed call per round
    form, reason, rounds, ran, calls = run_ranks(_form_policy_case, 2, {
        "megatron": r(10, 10, 10, 10, 10), "pipelined": r(10, 9.9, 10, 10, 10), "mixed": r(9, 9, 9, 9, 9)})[0]
    assert form == "mixed" and "won 5/5" in reason, reason
    assert sorted(calls) == sorted(list(FORMS) * 5) and len(ran) == 3 * 2 + 15
    assert calls[:3] == ["megatron", "pipelined", "mixed"] and calls[3:6] == ["pipelined", "mixed", "megatron"]
    # faster by median but in only 2 of 5 rounds: the baseline
    form, reason, *_ = run_ranks(_form_policy_case, 2, {
        "megatron": r(10, 10, 10, 10, 10), "pipelined": r(11, 11, 11, 11, 11), "mixed": r(9, 9, 10, 10, 10)})[0]
    assert form == "megatron" and "won 2/5" in reason, reason
    # within the 2% margin: the baseline; a tie: the baseline
    for mixed in (r(9.9, 9.9, 9.9, 9.9, 9.9), r(10, 10, 10, 10, 10)):
        form, *_ = run_ranks(_form_policy_case, 2, {"megatron": r(10, 10, 10, 10, 10),
                                                    "pipelined": r(11, 11, 11, 11, 11), "mixed": mixed})[0]
        assert form == "megatron"
    # the baseline's own spread over the rounds (its slowest round left out) above max_noise: the baseline,
    # whatever the others did
    form, reason, *_ = run_ranks(_form_policy_case, 2, {
        "megatron": r(10, 12, 10, 12, 10), "pipelined": r(5, 5, 5, 5, 5), "mixed": r(5, 5, 5, 5, 5)})[0]
    assert form == "megatron" and "spread without the slowest round 20.0% > 10%" in reason, reason


def test_form_policy_decides_alike_on_every_rank():
    """Each round's time is the max over the group: a form faster on one rank only is not chosen anywhere, and
    every rank holds the same table."""
    fast0 = lambda rank: [8.0] * 5 if rank == 0 else [10.5] * 5  # noqa: E731
    out = run_ranks(_form_policy_case, 4, {"megatron": [10.0] * 5, "pipelined": fast0, "mixed": [10.1] * 5})
    assert {o[0] for o in out} == {"megatron"} and all(o[2] == out[0][2] for o in out)
    assert out[0][2]["pipelined"] == [10.5] * 5
    fast_all = lambda rank: [8.0 + 0.1 * rank] * 5  # noqa: E731
    out = run_ranks(_form_policy_case, 4, {"megatron": [10.0] * 5, "pipelined": fast_all, "mixed": [10.1] * 5})
    assert {o[0] for o in out} == {"pipelined"} and out[0][2]["pipelined"] == [8.3] * 5


def test_form_policy_untimed_baseline_without_cuda_or_timer():
    from megatron_sp_ext.sp.layers.policy import FormPolicy

    def fn(rank, world):
        ran = []
        cands = {n: (lambda n=n: ran.append(n)) for n in FORMS}
        pol = FormPolicy()  # no timer: CUDA events, and off CUDA the baseline untimed
        assert pol.fastest("k", cands, dist.group.WORLD, torch.device("cpu")) == "megatron" and not ran
        assert "no CUDA" in pol.cache["k"].reason
        solo = FormPolicy(timer=lambda *a: 1.0)  # one candidate: nothing to time
        assert solo.fastest("k", {"megatron": cands["megatron"]}, dist.group.WORLD, torch.device("cpu")) == \
            "megatron" and not ran
        return True
    assert all(run_ranks(fn, 2))
