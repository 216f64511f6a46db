"""A CPU stand-in for torch's cuDNN attention ops that keeps torch's graph-cache behaviour.

torch (aten/src/ATen/native/cudnn/MHA.cpp) builds one cuDNN backward graph per key and reuses it; the key
holds the shapes and the q/k/v strides, causal and dropout, but NOT the strides of O and dO, which the graph
bakes in. A later call with the same key and differently laid-out O/dO is read with the first call's strides:
right outputs, wrong gradients (what the CUDA runs of 2026-11-24 showed for causal zigzag Ulysses after a
contiguous call; through torch's SDPA, the cause of a packed DiT step's non-finite gradients on 2026-11-26,
confirmed on an H200 the same day: kernels/cudnn.py).
``install(monkeypatch)`` puts ops with exactly that cache on ``torch.ops.aten`` and makes
``lse_kernels`` pick "cudnn" on the CPU, so the library's cuDNN branch (its explicit kernels, hold/saved
tensors, the layouts it feeds the ops) runs in CPU tests and a layout that varies under one key shows up as
wrong gradients; ``install_sdpa`` also routes ``F.scaled_dot_product_attention`` to them (torch's SDPA autograd on
the cuDNN backend, whose dO is whatever the caller's backward hands it). The math is
blockwise.math_forward/backward in fp32 (fp64 for fp64).
"""
from __future__ import annotations

import torch

from megatron_sp_ext.attention import backends, blockwise, kernels, lse_kernels


class FakeCudnn:
    """The two ops, with torch's backward graph cache (``graphs``: key -> (O strides, dO strides))."""

    def __init__(self) -> None:
        self.graphs: dict = {}
        self.backward_calls = 0

    @staticmethod
    def _key(q, k, v, causal, dropout):
        return (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.stride(), k.stride(), v.stride(), bool(causal),
                float(dropout), q.dtype)

    def forward(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *,
                scale=None):
        assert attn_bias is None and dropout_p == 0.0
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        o, lse = blockwise.math_forward(q, k, v, scale, "causal" if is_causal else None)
        out = torch.empty_like(q)  # the forward allocates O in q's layout (alloc_with_matching_layout)
        out.copy_(o)
        b, h, sq, _ = q.shape
        seed = torch.zeros((), dtype=torch.int64)
        return (out, lse.float().reshape(b, h, sq, 1), None, None, sq, k.shape[2], seed, seed, None)

    def backward(self, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                 cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        self.backward_calls += 1
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        if grad_out.stride()[-1] != 1:  # torch re-lays dO out like O only when its innermost stride is not 1
            grad_out = torch.empty_like(out).copy_(grad_out)
        key_ = self._key(query, key, value, is_causal, dropout_p)
        if key_ not in self.graphs:  # "build the graph": O's and dO's strides are baked in
            self.graphs[key_] = (out.stride(), grad_out.stride())
        o_st, do_st = self.graphs[key_]
        o_seen = _as_graph_reads(out, o_st, "O")
        do_seen = _as_graph_reads(grad_out, do_st, "dO")
        lse = logsumexp.reshape(query.shape[:3])
        dq, dk, dv = blockwise.math_backward(do_seen, query, key, value, o_seen, lse, scale,
                                             "causal" if is_causal else None)
        return (torch.empty_like(query).copy_(dq), torch.empty_like(key).copy_(dk), torch.empty_like(value).copy_(dv))


class _FakeSDPAFn(torch.autograd.Function):
    """torch's SDPA on the cuDNN backend: the forward op, and under autograd the backward op with whatever dO
    autograd hands it (torch re-lays dO out only when its innermost stride is not 1: ``FakeCudnn.backward``)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, fake):
        out, lse = fake.forward(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, fake)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, fake = ctx.args
        sq, sk = q.shape[2], k.shape[2]
        dq, dk, dv = fake.backward(do, q, k, v, out, lse, None, None, None, None, None, sq, sk, 0.0, causal,
                                   scale=scale)
        return dq, dk, dv, None, None, None


def fake_sdpa(fake: FakeCudnn):
    """An ``F.scaled_dot_product_attention`` stand-in that runs ``fake``'s ops (no mask, no dropout, no GQA)."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert attn_mask is None and dropout_p == 0.0 and k.shape[1] == q.shape[1]
        return _FakeSDPAFn.apply(q, k, v, is_causal, scale, fake)
    return sdpa


def _as_graph_reads(t: torch.Tensor, strides: tuple, name: str) -> torch.Tensor:
    """``t``'s memory read with the cached graph's strides (what cuDNN does with a stale graph)."""
    if t.stride() == tuple(strides):
        return t
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, strides))
    assert last < t.untyped_storage().nbytes() // t.element_size(), \
        f"a cached cuDNN graph would read {name} past its memory"
    return t.as_strided(t.shape, strides)


def install(monkeypatch) -> FakeCudnn:
    """Route the library's "cudnn" kernel to a ``FakeCudnn`` on the CPU (every dtype); returns it."""
    fake = FakeCudnn()
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", fake.forward, raising=False)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", fake.backward,
                        raising=False)
    monkeypatch.setattr(lse_kernels, "best", lambda device, dtype, head_dim=None: "cudnn")
    monkeypatch.setattr(lse_kernels, "available", lambda kernel, device, dtype, head_dim=None: kernel in ("cudnn", "math"))
    monkeypatch.setattr(kernels.get("cudnn"), "aux", {})
    # backends already made in this process (get_backend's registry) remember the kernel they chose per
    # (device, dtype): start from a fresh registry so "auto" / "sdpa" choose again, now "cudnn"
    monkeypatch.setattr(backends, "_REGISTRY", backends.BackendRegistry())
    return fake


def install_sdpa(monkeypatch) -> FakeCudnn:
    """``install``, and torch's SDPA routed to the same ``FakeCudnn`` (the "cudnn" kernel's plain calls go there)."""
    fake = install(monkeypatch)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake_sdpa(fake))
    return fake
