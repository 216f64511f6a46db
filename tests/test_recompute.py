"""Activation checkpointing around Ulysses / HCMS / packed attention and the async block (gloo, CPU): torch's non-reentrant
checkpoint drops the attention state after the forward (it used to stay alive on the autograd Function's
context) and recomputes the call exactly once in the backward (it used to re-run once per HCMS chunk); the
gradients equal the un-checkpointed ones bit for bit."""
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import megatron_sp_ext as spx
from megatron_sp_ext.attention.backends import AutoBackend
from tests.harness import run_ranks
from tests.live_bytes import LiveBytes


class CountingSDPA(AutoBackend):
    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward_lse(self, q, k, v, *, causal, softmax_scale, mask=None):
        self.forwards += 1
        return super().forward_lse(q, k, v, causal=causal, softmax_scale=softmax_scale, mask=mask)


def _case(rank, world, form, chunks):
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    be = CountingSDPA()
    h, d, sl = 8, 16, 64

    w_qkv = torch.randn(3 * h * d, h * d, generator=gen) * 0.05
    w_o = torch.randn(h * d, h * d, generator=gen) * 0.05

    def attn(t):
        q, k, v = t * 1.0, t * 2.0, t.sin()
        if form == "async":  # the async block (projections overlapped with their exchanges)
            y = spx.async_ulysses_self_attention(t.reshape(1, sl, h * d), spx.LayerWeights(w_qkv, w_o), g,
                                                 num_heads=h, num_kv_heads=h, prep=lambda br, y, w: y.view(1, sl, h, d),
                                                 head_chunks=chunks, backend=be)
            return y.view(1, sl, h, d)
        if form == "packed":
            hl = spx.packed_head_layout(h, h, world, chunks)
            o = spx.packed_ulysses_attention(spx.pack_qkv(q, k, v, hl), g, num_heads=h, num_kv_heads=h,
                                             head_chunks=chunks, backend=be)
        else:
            o = spx.ulysses_attention(q, k, v, g, head_chunks=chunks, backend=be)
        return o * 1.0

    x0 = torch.randn(1, sl, h, d, generator=gen)
    go = torch.randn(1, sl, h, d, generator=gen)
    res = {}
    for ckpt in (False, True):
        x = x0.clone().requires_grad_()
        be.forwards = 0
        with LiveBytes() as m:
            ys = [checkpoint(attn, x, use_reentrant=False) if ckpt else attn(x) for _ in range(3)]
            live = m.live / (x.numel() * 4)
        fwd_calls = be.forwards
        sum((y * go).sum() for y in ys).backward()
        res[ckpt] = (live, fwd_calls, be.forwards - fwd_calls, x.grad)
    (live0, f0, b0, g0), (live1, f1, b1, g1) = res[False], res[True]
    assert f0 == f1 == 3 * chunks and b0 == 0, (f0, f1, b0)
    assert b1 == 3 * chunks, f"checkpointed backward recomputed {b1} chunk forwards, want {3 * chunks} (once)"
    assert live1 < 0.5 * live0, (live1, live0)  # the attention state is dropped after each forward
    assert torch.equal(g0, g1)
    return live0, live1


@pytest.mark.parametrize("form,chunks", [("ulysses", 1), ("ulysses", 2), ("packed", 2), ("async", 2)])
def test_checkpoint_frees_attention_state_and_recomputes_once(form, chunks):
    run_ranks(_case, 2, form, chunks)
