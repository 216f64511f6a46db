"""Local backends, blockwise (out, lse) kernels and LSE merging against the float64 reference."""
import subprocess
import sys

import pytest
import torch

from megatron_sp_ext.attention import blockwise, get_backend, merge
from megatron_sp_ext.attention.backends import AutoBackend, available_backends
from megatron_sp_ext.errors import SPConfigError
from tests.reference import assert_close, make_qkv, reference_attention


def test_import_needs_torch_only():
    code = ("import sys, megatron_sp_ext as m; "
            "bad = [n for n in ('megatron.core', 'deepspeed', 'transformer_engine', 'flash_attn') if n in sys.modules]; "
            "assert not bad, bad; print(m.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip()


@pytest.mark.parametrize("name", ["sdpa", "math"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 2])
def test_backend_forward_backward(name, causal, hkv):
    q, k, v, do = make_qkv(1, 2, 9, 4, hkv, 16)
    be = get_backend(name)
    qs, ks, vs = (t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
    out = be(qs, ks, vs, causal=causal, softmax_scale=0.25)
    out.backward(do.transpose(1, 2))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal, softmax_scale=0.25)
    ref.backward(do.double())
    assert_close("out", out.transpose(1, 2), ref, torch.float32)
    for g, r in ((qs.grad, qr.grad), (ks.grad, kr.grad), (vs.grad, vr.grad)):
        assert_close("grad", g.transpose(1, 2), r, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_split_kv_blocks_merge_to_full_attention(dtype, causal):
    """Attention over two kv halves, merged by LSE, equals full attention; backward with final out/lse too."""
    q, k, v, do = make_qkv(2, 1, 12, 4, 2, 16, dtype)
    qb, kb, vb, dob = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    scale = 0.25
    for be in (get_backend("sdpa"), get_backend("math")):
        # block 0: keys [0, 6) ; block 1: keys [6, 12). Causal: q rows see keys <= row.
        m0 = torch.ones(12, 6, dtype=torch.bool).tril() if causal else None
        m1 = torch.ones(12, 12, dtype=torch.bool).tril()[:, 6:] if causal else None
        o0, l0 = be.forward_lse(qb, kb[:, :, :6], vb[:, :, :6], causal=False, softmax_scale=scale, mask=m0)
        o1, l1 = be.forward_lse(qb, kb[:, :, 6:], vb[:, :, 6:], causal=False, softmax_scale=scale, mask=m1)
        out, lse = merge([o0, o1], [l0, l1])
        out = out.to(dtype)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference_attention(qr, kr, vr, causal=causal, softmax_scale=scale)
        ref.backward(do.double())
        assert_close(f"{be.name} merged out", out.transpose(1, 2), ref, dtype)
        g0 = be.backward_lse(dob, qb, kb[:, :, :6], vb[:, :, :6], out, lse, causal=False, softmax_scale=scale, mask=m0)
        g1 = be.backward_lse(dob, qb, kb[:, :, 6:], vb[:, :, 6:], out, lse, causal=False, softmax_scale=scale, mask=m1)
        dq = g0[0].float() + g1[0].float()
        dk = torch.cat([g0[1], g1[1]], dim=2)
        dv = torch.cat([g0[2], g1[2]], dim=2)
        assert_close(f"{be.name} dq", dq.transpose(1, 2), qr.grad, dtype)
        assert_close(f"{be.name} dk", dk.transpose(1, 2), kr.grad, dtype)
        assert_close(f"{be.name} dv", dv.transpose(1, 2), vr.grad, dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_block_kernels_match_math(causal):
    q, k, v, do = make_qkv(3, 1, 8, 4, 4, 16)
    qb, kb, vb, dob = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    o_f, l_f = blockwise.fused_forward(qb, kb, vb, 0.3, causal)
    o_m, l_m = blockwise.math_forward(qb, kb, vb, 0.3, "causal" if causal else None)
    assert_close("out", o_f, o_m, torch.float32)
    assert_close("lse", l_f, l_m, torch.float32)
    gf = blockwise.fused_backward(dob, qb, kb, vb, o_m, l_m, 0.3, causal)
    gm = blockwise.math_backward(dob, qb, kb, vb, o_m, l_m, 0.3, "causal" if causal else None)
    for a, b in zip(gf, gm):
        assert_close("grad", a, b, torch.float32)


def test_backend_registry_errors():
    assert isinstance(get_backend("sdpa"), AutoBackend)
    assert "sdpa" in available_backends() and "math" in available_backends()
    with pytest.raises(SPConfigError, match="backend='nope'"):
        get_backend("nope")
    if "flash_attn" not in available_backends():
        with pytest.raises(SPConfigError, match="needs the package 'flash_attn'"):
            get_backend("flash_attn")


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 5), (5, 1)])
def test_one_row_calls_run_on_math(monkeypatch, sq, sk):
    """A block with one query or one key row never reaches the fused kernels (their 1 x 1 blocks crashed or were
    wrong on an H100): forward and backward run on math, equal to the float64 reference."""
    from megatron_sp_ext.attention import lse_kernels

    def refuse(*a, **k):
        raise AssertionError("a one-row block reached a fused kernel")
    monkeypatch.setattr(blockwise, "fused_forward", refuse)
    monkeypatch.setattr(blockwise, "fused_backward", refuse)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, sq, 8, generator=g)
    k, v = torch.randn(1, 2, sk, 8, generator=g), torch.randn(1, 2, sk, 8, generator=g)
    do = torch.randn(1, 4, sq, 8, generator=g)
    out, lse = lse_kernels.forward("flash", q, k, v, 0.3, False)
    dq, dk, dv = lse_kernels.backward("flash", do, q, k, v, out, lse, 0.3, False)
    qr, kr, vr = (t.double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, softmax_scale=0.3)
    ref.backward(do.double().transpose(1, 2))
    for name, got, want in (("out", out, ref.transpose(1, 2)), ("dq", dq, qr.grad.transpose(1, 2)),
                            ("dk", dk, kr.grad.transpose(1, 2)), ("dv", dv, vr.grad.transpose(1, 2))):
        assert_close(name, got, want, torch.float32)


def test_the_plain_route_is_asked_of_the_backend(monkeypatch):
    """The DiT's reference route asks the backend (``plain_via_torch_sdpa``), which asks the one kernel choice: "auto"
    whose blocks run on a kernel of torch's SDPA dispatch (flash on the CPU) goes through it; a named kernel, or FA4
    where "auto" picks it, runs its own plain call."""
    from megatron_sp_ext.attention import backends  # noqa: PLC0415
    from tests import fake_fa4  # noqa: PLC0415
    q = torch.randn(1, 2, 8, 16)
    assert get_backend("auto").plain_via_torch_sdpa(q) and get_backend("sdpa").plain_via_torch_sdpa(q)
    assert not get_backend("torch_flash").plain_via_torch_sdpa(q)   # the same kernel, named: its own call
    fake_fa4.install(monkeypatch, dtypes=(torch.bfloat16,))   # FA4's CPU stand-in, bf16: "auto" picks it
    assert isinstance(backends.get_backend("auto"), AutoBackend)
    assert not backends.get_backend("auto").plain_via_torch_sdpa(q.bfloat16())
    assert backends.get_backend("auto").plain_via_torch_sdpa(q.double()) is True   # math: torch's dispatch
