"""Local attention of packed variable-length samples (megatron_sp_ext/attention/varlen.py, issue #36 item 2).

Every method (per_sample, grouped, and flash_varlen through CPU stand-ins of torch's varlen flash ops that keep
the ops' layouts) against a float64 per-sample reference: out, lse and dq/dk/dv, causal and not, GQA, odd
sizes, strided inputs, empty samples; the cuDNN branch through tests/fake_cudnn.py (graph cache included);
"per_sample" bit for bit the loop the Ulysses varlen path ran before; which methods each backend offers (no
cuDNN ragged-kernel method); the chooser (settings, errors, "auto" cached per key, call order, a candidate whose
trial raises dropped with a warning, every candidate failing raises, a named method never dropped); the wiring in
sp/ulysses/attend.py.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.attention import blockwise, kernels, varlen
from megatron_sp_ext.attention.backends import LocalAttention, get_backend
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.ulysses import attend
from megatron_sp_ext.sp.ulysses.plan import UlyssesPlan
from tests import fake_cudnn
from tests.harness import run_ranks
from tests.reference import TOL, rel_err

# adjacent equal lengths, scattered equal lengths, an empty sample, odd lengths, one sample
CUS = [(0, 5, 10, 15, 22), (0, 7, 10, 17, 17, 20, 27), (0, 13), (0, 1, 4, 9, 10)]


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def _inputs(cu, h, hkv, d, dtype, seed, strided):
    """q/do [1, H, S, D], k/v [1, Hkv, S, D]; strided: bhsd views of bshd tensors (what attend.py often gets)."""
    g = torch.Generator().manual_seed(seed)
    s = cu[-1]
    shapes = ((h, d), (hkv, d), (hkv, d), (h, d))
    if strided:
        return [torch.randn(1, s, n, dd, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
                for n, dd in shapes]
    return [torch.randn(1, n, s, dd, generator=g, dtype=torch.float64).to(dtype) for n, dd in shapes]


def packed_reference(q, k, v, do, cu, causal, scale):
    """float64 per-sample attention with a block-diagonal mask on q's device: out, lse, dq, dk, dv (also used
    by tests/gpu/cuda_varlen_local.py, on the GPU)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = cu[-1]
    dev = q.device
    sample = torch.zeros(s, dtype=torch.long, device=dev)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        sample[a:b] = i
    mask = sample.view(-1, 1) == sample.view(1, -1)
    if causal:
        mask &= torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    scores = (q @ ke.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ ve
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do.double())
    return out.detach(), lse.detach(), dq, dk, dv


def test_packed_reference_stays_on_the_inputs_device():
    """The reference builds its mask on q's device (the CUDA worker calls it with GPU tensors; a CPU mask failed
    there with "expected self and mask to be on the same device"): meta tensors stand in for another device."""
    q, k = torch.randn(1, 4, 11, 8, device="meta"), torch.randn(1, 2, 11, 8, device="meta")
    for causal in (False, True):
        ref = packed_reference(q, k, k, q, (0, 4, 4, 11), causal, 0.3)
        assert [t.device.type for t in ref] == ["meta"] * 5
        assert [tuple(t.shape) for t in ref] == [(1, 4, 11, 8), (1, 4, 11), (1, 4, 11, 8), (1, 2, 11, 8),
                                                 (1, 2, 11, 8)]


def _check(name, got, ref, dtype):
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert a.shape == b.shape, (name, what, a.shape, b.shape)
        err = rel_err(a, b)
        assert err <= TOL[dtype], f"{name} {what}: relative error {err:.3e} > {TOL[dtype]:.0e} ({dtype})"


def _run_all(method, be, cu, h, hkv, d, dtype, causal, seed, strided):
    """forward_lse + backward_lse, and attention() under autograd, against the float64 reference."""
    q, k, v, do = _inputs(cu, h, hkv, d, dtype, seed, strided)
    scale = 1.0 / math.sqrt(d) * 1.3
    ref = packed_reference(q, k, v, do, cu, causal, scale)
    out, lse = varlen.forward_lse(method, be, q, k, v, cu, causal=causal, scale=scale)
    grads = varlen.backward_lse(method, be, do, q, k, v, out, lse, cu, causal=causal, scale=scale)
    _check(f"{method} explicit {cu} causal={causal}", [out, lse, *grads], ref, dtype)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out2 = varlen.attention(method, be, qg, kg, vg, cu, causal=causal, scale=scale)
    grads2 = torch.autograd.grad(out2, (qg, kg, vg), do)
    _check(f"{method} autograd {cu} causal={causal}", [out2, ref[1], *grads2], ref, dtype)
    return out, lse, grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", ["per_sample", "grouped"])
def test_backend_methods_match_float64(method, dtype):
    """fp64: the math kernel; fp32: torch's CPU flash kernel (what "auto" runs on the CPU), batched for grouped."""
    be = get_backend("auto")
    for i, cu in enumerate(CUS):
        for causal in (False, True):
            for h, hkv in ((3, 3), (4, 2)):
                _run_all(method, be, cu, h, hkv, 5 if dtype == torch.float64 else 8, dtype, causal, i,
                         strided=bool(i % 2))


def test_grouped_batches_equal_lengths():
    """grouped: one backend call per length (B = count), adjacent runs as strided views, scattered as copies."""
    calls = []

    class Counting(type(get_backend("math"))):
        def forward_lse(self, q, k, v, **kw):
            calls.append(tuple(q.shape))
            return super().forward_lse(q, k, v, **kw)

    be = Counting()
    cu = (0, 7, 10, 17, 17, 20, 27)  # lengths 7, 3, 7, (0), 3, 7
    q, k, v, _ = _inputs(cu, 2, 2, 4, torch.float64, 0, strided=False)
    varlen.forward_lse("grouped", be, q, k, v, cu, causal=False, scale=0.5)
    assert calls == [(3, 2, 7, 4), (2, 2, 3, 4)]
    calls.clear()
    varlen.forward_lse("per_sample", be, q, k, v, cu, causal=False, scale=0.5)
    assert len(calls) == 5
    assert varlen.length_groups(cu) == [(7, [0, 10, 20]), (3, [7, 17])]
    x = torch.arange(2 * 27 * 1.0).view(1, 2, 27, 1)
    run = varlen._batched(x, 5, [2, 7, 12])  # adjacent: a view of x's memory
    assert run.data_ptr() == x[0, :, 2].data_ptr() and torch.equal(run[1], x[0, :, 7:12])


def test_per_sample_is_the_old_loop_bit_for_bit():
    """"per_sample" = the per-sample calls attend.py made before varlen.py (same kernel calls, same order)."""
    be = get_backend("auto")
    for cu in CUS:
        q, k, v, do = _inputs(cu, 4, 2, 8, torch.float32, 3, strided=True)
        idx = [(slice(None), slice(None), slice(a, b)) for a, b in zip(cu, cu[1:]) if b > a]
        parts = [be.forward_lse(q[i], k[i], v[i], causal=True, softmax_scale=0.3) for i in idx]
        o_old, lse_old = torch.cat([o for o, _ in parts], 2), torch.cat([x for _, x in parts], 2)
        g_parts = [be.backward_lse(do[i], q[i], k[i], v[i], o_old[i], lse_old[i], causal=True, softmax_scale=0.3)
                   for i in idx]
        g_old = [torch.cat([p[j] for p in g_parts], 2) for j in range(3)]
        o, lse = varlen.forward_lse("per_sample", be, q, k, v, cu, causal=True, scale=0.3)
        g = varlen.backward_lse("per_sample", be, do, q, k, v, o, lse, cu, causal=True, scale=0.3)
        assert torch.equal(o, o_old) and torch.equal(lse, lse_old)
        assert all(torch.equal(a, b) for a, b in zip(g, g_old))
        o_plain = torch.cat([be(q[i], k[i], v[i], causal=True, softmax_scale=0.3) for i in idx], 2)
        assert torch.equal(varlen.attention("per_sample", be, q, k, v, cu, causal=True, scale=0.3), o_plain)


# ---------------------------------------------------------- CPU stand-ins for torch's varlen kernel ops

def _per_sample_math(q_thd, k_thd, v_thd, cu_t, causal, scale):
    """out [T, H, D] (q's layout), lse [H, T] of packed [T, H, D] inputs."""
    cu = cu_t.tolist()
    scale = scale if scale is not None else q_thd.shape[-1] ** -0.5
    assert cu[0] == 0 and all(b > a for a, b in zip(cu, cu[1:])), "the kernels get non-empty samples only"
    assert k_thd.shape[1] == q_thd.shape[1], "k/v are expanded to q's heads before the kernel"
    out = torch.empty_like(q_thd)
    lse = torch.empty(q_thd.shape[1], q_thd.shape[0], dtype=torch.float32 if q_thd.dtype != torch.float64
                      else torch.float64)
    for a, b in zip(cu, cu[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q_thd, k_thd, v_thd))
        o, l_ = blockwise.math_forward(qs, ks, vs, scale, "causal" if causal else None)
        out[a:b] = o[0].transpose(0, 1)
        lse[:, a:b] = l_[0]
    return out, lse


def _per_sample_math_bwd(do, q, k, v, out, lse_ht, cu_t, causal, scale):
    cu = cu_t.tolist()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for a, b in zip(cu, cu[1:]):
        dos, qs, ks, vs, os_ = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (do, q, k, v, out))
        g = blockwise.math_backward(dos, qs, ks, vs, os_, lse_ht[:, a:b].unsqueeze(0), scale,
                                    "causal" if causal else None)
        for dst, src in zip((dq, dk, dv), g):
            dst[a:b] = src[0].transpose(0, 1)
    return dq, dk, dv


class FakeVarlenOps:
    """aten._flash_attention_forward/_backward (lse [H, T]; any token/head strides, stride(-1) == 1) on the
    CPU."""

    def __init__(self):
        self.calls = {"flash": 0}

    def flash_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                  **_):
        assert dropout_p == 0.0 and q.stride(-1) == 1 and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert max_q == max_k == max(lengths)
        self.calls["flash"] += 1
        out, lse = _per_sample_math(q, k, v, cu_q, is_causal, scale)
        z = torch.zeros(2, dtype=torch.int64)
        return out, lse.float(), z, z, torch.empty(0)

    def flash_bwd(self, do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, *,
                  scale=None, **_):
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
        return _per_sample_math_bwd(do.contiguous(), q, k, v, out.contiguous(), lse, cu_q, is_causal, scale)


def _install_fake_varlen(monkeypatch):
    fake = FakeVarlenOps()
    for name, fn in (("_flash_attention_forward", fake.flash_fwd), ("_flash_attention_backward", fake.flash_bwd)):
        monkeypatch.setattr(torch.ops.aten, name, fn, raising=False)
    monkeypatch.setattr(varlen, "kernel_available", lambda method, device, dtype: method in varlen.KERNEL_METHODS)
    monkeypatch.setattr(kernels.get("flash"), "_aux", {})
    return fake


def test_varlen_kernel_glue_matches_float64(monkeypatch):
    """The layouts, cu_seqlens, lse shapes and GQA handling around torch's varlen ops, on CPU stand-ins."""
    fake = _install_fake_varlen(monkeypatch)
    be = get_backend("auto")
    for i, cu in enumerate(CUS):
        for causal in (False, True):
            for h, hkv in ((3, 3), (4, 2)):
                _run_all("flash_varlen", be, cu, h, hkv, 8, torch.float32, causal, i, strided=bool(i % 2))
    assert fake.calls["flash"] > 0
    assert "flash_varlen" in varlen.methods_here(be, torch.zeros(1, 1, 4, 8))


def test_probe_accepts_right_and_refuses_wrong_kernels(monkeypatch):
    """The availability probe (run once per CUDA device/dtype) on the CPU stand-ins: passes them, and refuses one
    whose backward ignores causality."""
    fake = _install_fake_varlen(monkeypatch)
    assert varlen.probe("flash_varlen", torch.device("cpu"), torch.float32)
    wrong = lambda *a, **kw: fake.flash_bwd(*a[:11], False, *a[12:], **kw)  # noqa: E731 - is_causal dropped
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", wrong, raising=False)
    assert not varlen.probe("flash_varlen", torch.device("cpu"), torch.float32)


def test_schema_check_of_this_torch():
    """This torch's varlen ops have the leading arguments varlen.py passes (a renamed one would be refused)."""
    assert varlen.schema_ok("per_sample") and varlen.schema_ok("grouped")
    for method in varlen.KERNEL_METHODS:
        if method == "fa4_varlen":   # FA4's own package, not torch's ops (tests/test_fa4.py)
            continue
        assert varlen.schema_ok(method), f"{method}: torch {torch.__version__} changed the op's arguments"
    assert not varlen.kernel_available("flash_varlen", torch.device("cpu"), torch.bfloat16)  # CUDA only
    assert not varlen.schema_ok("no_such_method")


def test_methods_per_backend_and_no_cudnn_varlen(monkeypatch):
    """flash_varlen where the backend's kernel choice allows it ("auto" on a cuDNN or flash lse kernel,
    "torch_flash"); the fixed "cudnn" backend runs only per_sample / grouped. There is no cudnn_varlen method
    (wrong on torch 2.11 / cuDNN 9.19, then an illegal memory access): naming it is an unknown setting."""
    _install_fake_varlen(monkeypatch)  # flash_varlen "available" on the CPU
    assert varlen.METHODS == ("per_sample", "grouped", "flash_varlen", "fa4_varlen")
    assert varlen.KERNEL_METHODS == ("flash_varlen", "fa4_varlen")   # fa4_varlen: tests/test_fa4.py
    q = torch.zeros(1, 2, 4, 8)
    for name, lse_kernel, want in (("auto", "cudnn", ["per_sample", "grouped", "flash_varlen"]),
                                   ("auto", "flash", ["per_sample", "grouped", "flash_varlen"]),
                                   ("auto", "math", ["per_sample", "grouped"]),
                                   ("torch_flash", "flash", ["per_sample", "grouped", "flash_varlen"]),
                                   ("cudnn", "cudnn", ["per_sample", "grouped"])):
        be = get_backend(name)
        monkeypatch.setattr(be, "kernel_for", lambda q_, k_=lse_kernel: k_)
        assert varlen.methods_here(be, q) == want, (name, lse_kernel)
    ch = varlen.VarlenChooser(timer=_Timer({}))
    with pytest.raises(SPConfigError, match=r"varlen_kernel='cudnn_varlen' is invalid: choose one of "
                                            r"auto, per_sample, grouped, flash_varlen, fa4_varlen$"):
        _choose(ch, "cudnn_varlen")
    with pytest.raises(ValueError, match="unknown varlen method 'cudnn_varlen'"):
        varlen.forward_lse("cudnn_varlen", get_backend("auto"), q, q, q, (0, 4), causal=False, scale=0.5)


def test_cudnn_branch_through_fake_cudnn(monkeypatch):
    """SDPA "auto" on the cuDNN kernel (fake_cudnn: torch's backward graph cache, O/dO strides not in its key):
    per_sample and grouped, strided and contiguous inputs in alternating order, against float64."""
    fake = fake_cudnn.install(monkeypatch)
    be = get_backend("auto")
    cu = (0, 7, 14, 21, 26, 33)  # grouped: a run of three 7s, then 5, then a scattered 7
    for rnd in range(2):
        for method in ("grouped", "per_sample"):
            for strided in (True, False):
                for causal in (False, True):
                    _run_all(method, be, cu, 4, 2, 8, torch.float32, causal, rnd, strided)
    assert fake.backward_calls > 0


# ------------------------------------------------------------------------------------------------ choice

class _Timer:
    def __init__(self, ms):
        self.ms, self.calls = ms, []

    def __call__(self, method, fn):
        fn()  # the measured call runs (it must not fail)
        self.calls.append(method)
        return self.ms[method]


def _choose(ch, setting="auto", cu=(0, 4, 8, 11), dtype=torch.float32, causal=False, scale=0.5, need_grad=True,
            explicit=True, backend="auto"):
    q, k, v, _ = _inputs(cu, 2, 1, 8, dtype, 0, strided=False)
    return ch.method_for(setting, get_backend(backend), q, k, v, cu, causal=causal, scale=scale, need_grad=need_grad,
                     explicit=explicit)


def test_choose_settings_and_errors():
    ch = varlen.VarlenChooser(timer=_Timer({}))
    assert _choose(ch) == "per_sample"  # off CUDA "auto" is the per-sample math, nothing measured
    assert _choose(ch, "grouped") == "grouped"
    with pytest.raises(SPConfigError, match=r"varlen_kernel='bogus' is invalid.*per_sample"):
        _choose(ch, "bogus")
    for method in varlen.KERNEL_METHODS:
        with pytest.raises(SPConfigError, match=rf"varlen_kernel='{method}' does not run here.*per_sample"):
            _choose(ch, method)
    assert ch.timer.calls == [] and not ch.decisions


def test_auto_measures_once_per_key(monkeypatch):
    _install_fake_varlen(monkeypatch)
    ms = {"per_sample": 3.0, "grouped": 2.0, "flash_varlen": 1.0}
    timer = _Timer(ms)
    ch = varlen.VarlenChooser(timer=timer, measure_off_cuda=True)
    assert _choose(ch) == "flash_varlen" and timer.calls == ["per_sample", "grouped", "flash_varlen"]
    assert _choose(ch) == "flash_varlen" and len(timer.calls) == 3  # cached
    # every field of the key is measured on its own
    variants = [dict(cu=(0, 4, 8, 12)), dict(causal=True), dict(scale=0.25), dict(need_grad=False),
                dict(explicit=False), dict(dtype=torch.float64), dict(backend="torch_flash")]
    for kw in variants:
        before = len(timer.calls)
        assert _choose(ch, **kw) in varlen.METHODS
        assert len(timer.calls) > before, kw
    assert len(ch.decisions) == 1 + len(variants)
    # fp64 on CPU: the lse kernel is math, so only the backend methods were timed
    key64 = [k for k in ch.decisions if k[1] == torch.float64][0]
    assert ch.decisions[key64] == "grouped"
    # a fixed-kernel backend offers only its own varlen kernel (torch_flash: flash_varlen)
    assert _choose(ch, backend="torch_flash") == "flash_varlen"
    # ties go to the earlier method in METHODS order
    tie = varlen.VarlenChooser(timer=_Timer(dict.fromkeys(ms, 1.0)), measure_off_cuda=True)
    assert _choose(tie) == "per_sample"


def test_auto_decisions_do_not_depend_on_call_order(monkeypatch):
    _install_fake_varlen(monkeypatch)
    keys = [dict(cu=(0, 4, 8, 11)), dict(cu=(0, 4, 8, 11), causal=True), dict(cu=(0, 3, 11))]
    ms_by_cu = {(0, 4, 8, 11): {"per_sample": 3.0, "grouped": 1.0, "flash_varlen": 2.0},
                (0, 3, 11): {"per_sample": 3.0, "grouped": 5.0, "flash_varlen": 2.0}}

    class ByCu(_Timer):
        cu = None

        def __call__(self, method, fn):
            return ms_by_cu[self.cu][method]

    def run(order):
        t = ByCu({})
        ch = varlen.VarlenChooser(timer=t, measure_off_cuda=True, capacity=2)
        out = {}
        for i in order:
            t.cu = keys[i]["cu"]
            out[i] = _choose(ch, **keys[i])
        return out, ch

    a, ch_a = run([0, 1, 2, 0])
    b, _ = run([2, 1, 0, 2])
    assert a == b == {0: "grouped", 1: "grouped", 2: "flash_varlen"}
    assert len(ch_a.decisions) == 2  # LRU capacity


# torch 2.11's cuDNN backward inside VarlenChooser's trial on an H100 (the retired tools/bench_dynamic_sp.py)
CUDNN_BWD_ERROR = ("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good() to be true, but "
                   "got false.  (Could this error message be improved?  If so, please report an enhancement request "
                   "to PyTorch.)\nException raised from run_cudnn_SDP_bprop_nestedtensor at aten/src/ATen/native/"
                   "cudnn/MHA.cpp:1873 (most recent call first):")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megatron_sp_ext" and r.levelno == logging.WARNING]


def test_auto_drops_a_candidate_whose_trial_raises(monkeypatch, caplog):
    """"auto": a candidate whose fwd+bwd trial raises (flash_varlen's backward, with the cuDNN error an H100 gave) is
    dropped, the fastest of the rest chosen; one warning per key naming the method, the backend and the error's
    first line; the drop kept in ``dropped`` under the decision's key; a cached key neither re-runs nor re-warns."""
    _install_fake_varlen(monkeypatch)

    def failing_bwd(*args, **kwargs):
        raise RuntimeError(CUDNN_BWD_ERROR)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", failing_bwd, raising=False)
    timer = _Timer({"per_sample": 3.0, "grouped": 2.0, "flash_varlen": 1.0})  # the failing one would have won
    ch = varlen.VarlenChooser(timer=timer, measure_off_cuda=True)
    line = "RuntimeError: " + CUDNN_BWD_ERROR.splitlines()[0]
    with caplog.at_level(logging.WARNING, logger="megatron_sp_ext"):
        for explicit in (True, False):  # forward_lse / backward_lse, and attention() under autograd
            for _ in range(2):
                assert _choose(ch, explicit=explicit) == "grouped"
    assert timer.calls == ["per_sample", "grouped"] * 2  # flash_varlen raised before the timer counted it
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings  # once per key (explicit is part of the key)
    for w in warnings:
        assert "dropped flash_varlen" in w and "backend 'auto'" in w and line in w and "MHA.cpp" not in w, w
    assert len(ch.decisions) == 2 and set(ch.decisions.values()) == {"grouped"}
    assert ch.dropped == {key: {"flash_varlen": line} for key in ch.decisions}
    # LRU eviction takes the decision's drop record with it
    small = varlen.VarlenChooser(timer=_Timer({"per_sample": 3.0, "grouped": 2.0}), measure_off_cuda=True,
                                 capacity=1)
    _choose(small)
    _choose(small, causal=True)
    assert list(small.dropped) == list(small.decisions) and len(small.decisions) == 1


class _FailingBackend(LocalAttention):
    """Every call raises (a backend whose kernel fails on every shape)."""

    name = "failing"

    def __call__(self, q, k, v, *, causal, softmax_scale):
        raise RuntimeError("failing kernel: no plain call\nsecond line")

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None, tiles=None):
        raise RuntimeError("failing kernel: no forward\nsecond line")


def test_auto_raises_when_every_candidate_fails_and_a_named_method_is_never_dropped(monkeypatch, caplog):
    """Every candidate's trial raises: "auto" raises the first candidate's own error (each warned), caches nothing.
    A named method is not tried: the chooser returns it and its call raises as before; the same for a named kernel
    method whose backward fails."""
    timer = _Timer({"per_sample": 1.0, "grouped": 1.0})
    ch = varlen.VarlenChooser(timer=timer, measure_off_cuda=True)
    be = _FailingBackend()
    cu = (0, 4, 8, 11)
    q, k, v, do = _inputs(cu, 2, 1, 8, torch.float32, 0, strided=False)
    with caplog.at_level(logging.WARNING, logger="megatron_sp_ext"):
        for explicit in (True, False):
            with pytest.raises(RuntimeError, match="^failing kernel: no (forward|plain call)\nsecond line$"):
                ch.method_for("auto", be, q, k, v, cu, causal=False, scale=0.5, need_grad=True, explicit=explicit)
    warnings = _warnings(caplog)
    assert len(warnings) == 4 and all("backend 'failing'" in w and "second line" not in w for w in warnings)
    assert [w.split("dropped ")[1].split()[0] for w in warnings] == ["per_sample", "grouped"] * 2
    assert timer.calls == [] and not ch.decisions and not ch.dropped
    for method in ("per_sample", "grouped"):  # named: returned untried, its call raises
        assert ch.method_for(method, be, q, k, v, cu, causal=False, scale=0.5, need_grad=True) == method
        with pytest.raises(RuntimeError, match="failing kernel"):
            varlen.forward_lse(method, be, q, k, v, cu, causal=False, scale=0.5)
    _install_fake_varlen(monkeypatch)

    def failing_bwd(*args, **kwargs):
        raise RuntimeError(CUDNN_BWD_ERROR)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", failing_bwd, raising=False)
    assert _choose(ch, "flash_varlen") == "flash_varlen" and timer.calls == []
    out, lse = varlen.forward_lse("flash_varlen", get_backend("auto"), q, k, v, cu, causal=False, scale=0.5)
    with pytest.raises(RuntimeError, match="mha_graph"):
        varlen.backward_lse("flash_varlen", get_backend("auto"), do, q, k, v, out, lse, cu, causal=False, scale=0.5)


# ------------------------------------------------------------------------------------------------ group-wide

class _RankTimer(_Timer):
    """A ``_Timer`` per rank whose ``raises`` methods' trials raise (this rank only)."""

    def __init__(self, ms, raises=()):
        super().__init__(ms)
        self.raises = raises

    def __call__(self, method, fn):
        if method in self.raises:
            raise RuntimeError(f"{method} trial failed on this rank only")
        return super().__call__(method, fn)


# each rank's own clock: alone, rank 0 would pick per_sample and rank 1 grouped; maxed over the group (per_sample
# 4.0, grouped 3.0) every rank picks grouped
_DISAGREEING = ({"per_sample": 1.0, "grouped": 3.0}, {"per_sample": 4.0, "grouped": 2.0})


def _group_chooser_rank(rank, world):
    g = dist.group.WORLD
    cu = (0, 4, 8, 11)
    heads = ("layout", 3, 3, world)   # what names the call's heads the same on every rank (Ulysses: HeadLayout)
    pick = {}
    for where, group in (("alone", None), ("group", g)):
        ch = varlen.VarlenChooser(timer=_RankTimer(_DISAGREEING[rank]), measure_off_cuda=True)
        q, k, v, _ = _inputs(cu, 2, 2, 8, torch.float32, rank, strided=False)
        pick[where] = ch.method_for("auto", get_backend("auto"), q, k, v, cu, causal=False, scale=0.5, need_grad=True,
                                across=varlen.CallGroup(group, heads))
    # this rank's heads differ between its calls and from the other rank's (uneven heads, HCMS chunks): with
    # the group's heads every rank finds or misses the decision together (one trial each, no unmatched all-reduce)
    ch = varlen.VarlenChooser(timer=_RankTimer(_DISAGREEING[rank]), measure_off_cuda=True)
    for h in ((2, 1) if rank == 0 else (1, 1)):
        q, k, v, _ = _inputs(cu, h, 1, 8, torch.float32, rank, strided=False)
        assert ch.method_for("auto", get_backend("auto"), q, k, v, cu, causal=True, scale=0.5, need_grad=True,
                         across=varlen.CallGroup(g, heads)) == "grouped"
    pick["uneven_trials"] = len(ch.timer.calls)
    # a candidate whose trial raises on one rank is dropped on every rank (rank 0 alone would pick grouped)
    ch = varlen.VarlenChooser(timer=_RankTimer({"per_sample": 3.0, "grouped": 1.0},
                                               raises=("grouped",) if rank == 1 else ()), measure_off_cuda=True)
    q, k, v, _ = _inputs(cu, 2, 2, 8, torch.float32, rank, strided=False)
    pick["dropped"] = ch.method_for("auto", get_backend("auto"), q, k, v, cu, causal=False, scale=0.5, need_grad=True,
                                across=varlen.CallGroup(g, heads))
    pick["dropped_why"] = sorted(next(iter(ch.dropped.values())))
    return pick


def test_auto_decides_group_wide_where_the_ranks_clocks_disagree():
    """varlen_kernel="auto" with a group (issue 66): each candidate's time maxed over the group before the argmin,
    as the other "auto" policies decide, so every rank picks the same method although its own clock disagrees."""
    r0, r1 = run_ranks(_group_chooser_rank, 2)
    assert (r0["alone"], r1["alone"]) == ("per_sample", "grouped")   # the clocks disagree
    assert r0["group"] == r1["group"] == "grouped"
    assert r0["uneven_trials"] == r1["uneven_trials"] == 2           # one trial of each method, then cached
    assert r0["dropped"] == r1["dropped"] == "per_sample"
    assert r0["dropped_why"] == r1["dropped_why"] == ["grouped"]


def _ulysses_group_rank(rank, world):
    """ulysses_attention(varlen_kernel="auto") over uneven heads (5 heads on 2 ranks: 3 and 2) in 2 HCMS chunks
    (rank 0's chunks 2 + 1 heads, rank 1's 1 + 1), forward and backward, each rank's clock disagreeing: every
    rank runs the same method, and the result is per_sample's."""
    g = dist.group.WORLD
    timer = _RankTimer(_DISAGREEING[rank])
    varlen._DEFAULT = varlen.VarlenChooser(timer=timer, measure_off_cuda=True)   # this forked rank's own
    cu_list = [0, 6, 12, 16]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    torch.manual_seed(0)
    full = [torch.randn(1, cu_list[-1], 5, 8, dtype=torch.float64) for _ in range(3)]
    shards = [spx.shard_sequence(t, g, cu_seqlens=cu).to(torch.float32).requires_grad_() for t in full]
    out = {}
    for kernel in ("auto", "per_sample"):
        o = spx.ulysses_attention(*shards, g, head_chunks=2, causal=True, cu_seqlens=cu, varlen_kernel=kernel)
        grads = torch.autograd.grad(o, shards, torch.ones_like(o))
        out[kernel] = (o.detach(), *grads)
    for a, b in zip(out["auto"], out["per_sample"]):
        assert rel_err(a, b) <= TOL[torch.float32]
    return sorted(set(varlen._DEFAULT.decisions.values())), len(timer.calls)


def test_ulysses_auto_varlen_is_the_same_method_on_every_rank():
    (m0, n0), (m1, n1) = run_ranks(_ulysses_group_rank, 2)
    assert m0 == m1 == ["grouped"] and n0 == n1 > 0


# ------------------------------------------------------------------------------------------------ wiring

def _plan(method, be, cu, causal, need_grad=True):
    return UlyssesPlan(group=None, rank=0, heads=None, seq_layout="bshd", causal=causal, scale=0.4, backend=be,
                       comm_stream=None, need_grad=need_grad, cu_seqlens=cu, varlen_kernel=method)


@pytest.mark.parametrize("method", ["per_sample", "grouped", "flash_varlen", "auto"])
def test_attend_runs_the_plans_method(monkeypatch, method):
    """attend.attend / attend_backward (explicit kernels and the inner autograd graph) with the plan's method."""
    fake = _install_fake_varlen(monkeypatch)
    cu = (0, 6, 12, 15, 21)
    for explicit, be_name in ((True, "auto"), (False, "auto")):
        be = get_backend(be_name)
        for causal in (False, True):
            q, k, v, do = _inputs(cu, 4, 2, 8, torch.float32, 1, strided=True)
            plan = _plan(method, be, cu, causal)
            if explicit:
                assert attend.explicit_kernels(plan, q)
            before = dict(fake.calls)
            oc, kept = attend.attend(plan, q, k, v, explicit)
            grads = attend.attend_backward(plan, 0, do, [kept])
            ref = packed_reference(q, k, v, do, cu, causal, 0.4)
            _check(f"attend {method} explicit={explicit}", [oc, ref[1], *grads], ref, torch.float32)
            ran_kernel = {k_: fake.calls[k_] - before[k_] for k_ in fake.calls}
            if method == "flash_varlen":
                assert ran_kernel["flash"] > 0
            else:
                assert sum(ran_kernel.values()) == 0  # "auto" off CUDA = per_sample
    # local_attention (the world-1 and inference path) takes the setting too; its default is per_sample
    q, k, v, _ = _inputs(cu, 4, 2, 8, torch.float32, 2, strided=False)
    with torch.no_grad():
        o = attend.local_attention(get_backend("auto"), q, k, v, True, 0.4, None, 0.0, cu, method)
        o_def = attend.local_attention(get_backend("auto"), q, k, v, True, 0.4, None, 0.0, cu)
    assert rel_err(o, packed_reference(q, k, v, q, cu, True, 0.4)[0]) <= TOL[torch.float32]
    assert torch.equal(o_def, varlen.attention("per_sample", get_backend("auto"), q, k, v, cu, causal=True,
                                               scale=0.4))


def test_auto_with_dropout_measures_nothing(monkeypatch):
    """Attention dropout: "auto" runs per_sample without timing (timing would draw masks, moving the RNG)."""
    timer = _Timer(dict.fromkeys(varlen.METHODS, 1.0))
    monkeypatch.setattr(varlen, "_DEFAULT", varlen.VarlenChooser(timer=timer, measure_off_cuda=True))
    cu = (0, 4, 8, 11)
    q, k, v, _ = _inputs(cu, 2, 2, 8, torch.float32, 0, strided=False)
    torch.manual_seed(0)
    o = attend.local_attention(get_backend("auto"), q, k, v, False, 0.4, None, 0.5, cu, "auto")
    torch.manual_seed(0)
    o_ps = attend.local_attention(get_backend("auto"), q, k, v, False, 0.4, None, 0.5, cu, "per_sample")
    assert timer.calls == [] and torch.equal(o, o_ps)
    attend.local_attention(get_backend("auto"), q, k, v, False, 0.4, None, 0.0, cu, "auto")
    assert len(timer.calls) == 2  # without dropout "auto" measures (here: per_sample and grouped)


def test_attend_refuses_a_bad_setting():
    cu = (0, 4, 8)
    q, k, v, _ = _inputs(cu, 2, 2, 8, torch.float32, 0, strided=False)
    with pytest.raises(SPConfigError, match="varlen_kernel='fast'"):
        attend.attend(_plan("fast", get_backend("auto"), cu, False), q, k, v, True)
