"""One dO layout per cuDNN graph key (megatron_sp_ext/attention/kernels/cudnn.py): torch caches a cuDNN backward
graph per q/k/v key with O's and dO's strides baked in, so the "cudnn" kernel's plain calls (torch SDPA under
autograd) hand dO on in the output's own layout whatever the caller's backward produced. On the CPU stand-in
(tests/fake_cudnn.py, torch's cache kept) a call whose dO is a transposed view and one of the same key with a
contiguous dO, in either order, causal or not, give wrong gradients without that, right ones with it; on CUDA the
same calls on the real cuDNN (skipped without CUDA: it needs the GPU's cuDNN)."""
from __future__ import annotations

import pytest
import torch

from megatron_sp_ext.attention import kernels
from megatron_sp_ext.attention.kernels import cudnn
from tests import fake_cudnn
from tests.reference import rel_err


def test_relaid_gives_exact_strides():
    x = torch.randn(1, 4, 6, 8)
    assert cudnn.relaid(x, x.stride()) is x
    odd_batch = x.as_strided(x.shape, (999,) + x.stride()[1:])            # size-1 batch dim, another stride
    v = cudnn.relaid(odd_batch, x.stride())
    assert v.stride() == x.stride() and v.data_ptr() == x.data_ptr() and torch.equal(v, x)   # a view, no copy
    bshd = x.transpose(1, 2).contiguous().transpose(1, 2)                  # same values, head-minor memory
    c = cudnn.relaid(bshd, x.stride())
    assert c.stride() == x.stride() and torch.equal(c, x) and c.data_ptr() != bshd.data_ptr()
    assert cudnn.in_layout_of(bshd, x).stride() == x.stride()


def _reference(q, k, v, scale, causal):
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def two_calls(device, dtype, order=("bshd", "bhsd"), causal=False):
    """Errors of (out, dq, dk, dv) vs fp64 math of two "cudnn" kernel calls of one key, in ``order``: "bshd", a call
    whose dO is a transposed view (its consumer is [B, S, H, D]); "bhsd", one whose dO is contiguous."""
    g = torch.Generator().manual_seed(3)
    kern = kernels.get("cudnn")
    errs = []
    for consumer in order:
        qkv = [torch.randn(1, 4, 48, 64, generator=g, dtype=torch.float64) for _ in range(3)]
        leaves = [t.to(device, dtype).requires_grad_() for t in qkv]
        out = kern.attention(*leaves, causal, 0.125)
        w = torch.randn(1, 48, 4, 64, generator=g, dtype=torch.float64)
        if consumer == "bshd":   # dO arrives as w.transpose(1, 2): strides of a [B, S, H, D] tensor
            loss = (out.transpose(1, 2) * w.to(device, dtype)).sum()
        else:
            loss = (out * w.transpose(1, 2).contiguous().to(device, dtype)).sum()
        grads = torch.autograd.grad(loss, leaves)
        ref_in = [t.clone().requires_grad_() for t in qkv]
        ref = _reference(*ref_in, 0.125, causal)
        refs = torch.autograd.grad((ref * w.transpose(1, 2)).sum(), ref_in)
        errs.append([rel_err(out.double().cpu(), ref.detach())]
                    + [rel_err(a.double().cpu(), b) for a, b in zip(grads, refs)])
    return errs


ORDERS = [("bshd", "bhsd"), ("bhsd", "bshd")]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_plain_cudnn_calls_of_one_key_get_one_do_layout(monkeypatch, order, causal):
    fake = fake_cudnn.install_sdpa(monkeypatch)
    errs = two_calls("cpu", torch.float64, order, causal)
    assert fake.backward_calls == 2 and len(fake.graphs) == 1   # one key: the second call reused the graph
    assert max(e[0] for e in errs) < 1e-12, errs
    assert max(max(e[1:]) for e in errs) < 1e-6, errs   # the backward takes lse in fp32 (as torch's does)


@pytest.mark.parametrize("order", ORDERS)
def test_without_the_layout_hook_the_stand_in_goes_wrong(monkeypatch, order):
    """The stand-in reproduces the failure the hook prevents, in either order: with the hook taken out, the second
    call's dO is read with the first call's strides."""
    fake_cudnn.install_sdpa(monkeypatch)
    monkeypatch.setattr(cudnn, "grad_in_own_layout", lambda out: out)
    errs = two_calls("cpu", torch.float64, order)
    assert max(errs[0]) < 1e-6, errs            # the first call built the graph with its own layout: right
    assert errs[1][0] < 1e-12, errs             # outputs stay right
    assert min(errs[1][1:]) > 1e-2, errs        # every gradient of the second call is wrong


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU's cuDNN and its graph cache)")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_cuda_plain_cudnn_calls_of_one_key_get_one_do_layout(order, causal):
    dev = torch.device("cuda", torch.cuda.current_device())
    if kernels.why_not("cudnn", kernels.KernelCall.of(torch.empty(1, 4, 48, 64, device=dev,
                                                                  dtype=torch.bfloat16))) is not None:
        pytest.skip("cuDNN attention does not run on this GPU build")
    errs = two_calls(dev, torch.bfloat16, order, causal)
    assert max(max(e) for e in errs) < 2e-2, errs
