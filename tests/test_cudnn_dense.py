"""cuDNN gets contiguous q/k/v (megatron_sp_ext/attention/kernels/cudnn.py: its bf16 backward went wrong on the
DiT's strided per-sample views on an H200, 2026-11-26): on the CPU stand-in (tests/fake_cudnn.py) the ops see
contiguous inputs whatever views the caller passes, and the gradients reach the views right."""
from __future__ import annotations

import torch

from megatron_sp_ext.attention import kernels
from megatron_sp_ext.attention.kernels.cudnn import dense
from tests import fake_cudnn
from tests.reference import rel_err


def test_dense_copies_only_views():
    x = torch.randn(1, 6, 4, 8)
    assert dense(x)[0] is x
    view = x.transpose(1, 2)
    out = dense(view)[0]
    assert out.is_contiguous() and torch.equal(out, view)


def test_cudnn_ops_see_contiguous_inputs_from_strided_views(monkeypatch):
    fake = fake_cudnn.install(monkeypatch)
    seen = []
    fwd, bwd = fake.forward, fake.backward

    def forward(q, k, v, *a, **kw):
        seen.append(("fwd", q.is_contiguous(), k.is_contiguous(), v.is_contiguous()))
        return fwd(q, k, v, *a, **kw)

    def backward(do, q, k, v, out, *a, **kw):
        seen.append(("bwd", q.is_contiguous(), k.is_contiguous(), v.is_contiguous()))
        return bwd(do, q, k, v, out, *a, **kw)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", forward, raising=False)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", backward, raising=False)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, 40, 3 * 4 * 16, generator=g, dtype=torch.float64)   # a fused projection [B, S, 3*H*D]
    q, k, v = (t.view(1, 40, 4, 16).transpose(1, 2) for t in qkv.chunk(3, dim=-1))   # strided [B, H, S, D]
    sample = slice(8, 29)                                                            # one packed sample's rows
    views = [t[:, :, sample].detach().requires_grad_() for t in (q, k, v)]
    kern = kernels.get("cudnn")
    out = kernels.LseFunction.apply(*views, kern, False, 0.25, None)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, views, do)
    ref_views = [t.detach().clone().requires_grad_() for t in views]
    ref = torch.softmax(ref_views[0] @ ref_views[1].transpose(-1, -2) * 0.25, -1) @ ref_views[2]
    refs = torch.autograd.grad(ref, ref_views, do)
    assert seen and all(all(flags[1:]) for flags in seen), seen
    errs = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(grads, refs)]
    assert errs[0] < 1e-12 and max(errs[1:]) < 1e-6, errs   # the backward takes lse in fp32 (kernels.cudnn)


def test_torch_sdpa_inputs_leave_cpu_tensors_alone():
    """The auto backend's torch-SDPA calls copy only on CUDA (where torch may pick cuDNN)."""
    q = torch.randn(1, 5, 2, 8).transpose(1, 2)
    assert all(a is b for a, b in zip(kernels.torch_sdpa_inputs(q, q, q), (q, q, q)))
