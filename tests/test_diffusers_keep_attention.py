"""megatron_sp_ext.diffusers.keep_attention_checkpointing on diffusers' tiny WanTransformer3DModel (float64): every
block recomputed in the backward but its self-attention. The output and every gradient (parameters and latent) equal
diffusers' full gradient checkpointing and no checkpointing bit for bit, at SP=1 and SP=2 (gloo; Ulysses and the
ring), with the test's sparse plan (token order, block mask, gated extra branch) and with two forwards before one
backward; the self-attention (kernel and exchanges) runs once per block per step, while the block's other layers
(to_q, the FFN) run twice: forward and recompute (full checkpointing: everything at least twice)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")

from diffusers import WanTransformer3DModel  # noqa: E402,F401 - imported before forking
from megatron_sp_ext import SPConfigError  # noqa: E402
from megatron_sp_ext.diffusers import keep_attention_checkpointing, parallelize  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.wan_sp import FixedSparsePlan, forward_backward, tiny_wan, wan_inputs  # noqa: E402


class Counts:
    """Calls of every self-attention (the SP attention object the processors run), of attn1.to_q and of the FFN."""

    def __init__(self, model, handle) -> None:
        self.attention = self.to_q = self.ffn = 0
        for proc in handle.processors:
            inner = proc.attention

            def counted(*a, _inner=inner, **kw):
                self.attention += 1
                return _inner(*a, **kw)
            proc.attention = counted
        for blk in model.blocks:
            blk.attn1.to_q.register_forward_hook(lambda *_: self._add("to_q"))
            blk.ffn.register_forward_hook(lambda *_: self._add("ffn"))

    def _add(self, name: str) -> None:
        setattr(self, name, getattr(self, name) + 1)


def _run(stock, inputs, group, recompute: str, mode: str, sparse: bool, forwards: int = 1):
    """(output, grads, Counts) of one step of a copy of ``stock`` parallelized with ``recompute`` (none / full /
    keep); ``forwards`` > 1: that many forwards of the same inputs, one backward of their summed loss."""
    model = copy.deepcopy(stock)
    handle = parallelize(model, group, mode=mode, sparse=FixedSparsePlan() if sparse else None)
    if recompute == "full":
        model.enable_gradient_checkpointing()
    elif recompute == "keep":
        keep_attention_checkpointing(handle)
    counts = Counts(model, handle)
    if forwards == 1:
        out, grads = forward_backward(model, inputs, group)
    else:
        from tests.wan_sp import output_weight  # noqa: PLC0415
        x = inputs["hidden_states"].detach().clone().requires_grad_()
        loss = sum((model(**{**inputs, "hidden_states": x * (i + 1)}).sample.double() * output_weight(inputs)).sum()
                   for i in range(forwards))
        loss.backward()
        out = None
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        grads["input"] = x.grad.detach().clone()
        if group is not None:
            import torch.distributed as dist  # noqa: PLC0415
            for g in grads.values():
                dist.all_reduce(g, group=group)
    return out, grads, counts


def _same(a, b) -> bool:
    (oa, ga, _), (ob, gb, _) = a, b
    return (oa is None or torch.equal(oa, ob)) and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k])
                                                                                 for k in ga)


def _cases(rank, world, modes):
    """Per (mode, sparse, forwards): keep == full == none bit for bit, and the call counts."""
    import torch.distributed as dist  # noqa: PLC0415
    group = dist.group.WORLD if world > 1 else None
    stock, inputs = tiny_wan(), wan_inputs()
    blocks = len(stock.blocks)
    out = {}
    for mode in modes:
        for sparse in (False, True):
            for forwards in ((1, 2) if not sparse else (1,)):
                runs = {r: _run(stock, inputs, group, r, mode, sparse, forwards) for r in ("none", "full", "keep")}
                counts = {r: (c.attention, c.to_q, c.ffn) for r, (_, _, c) in runs.items()}
                n = blocks * forwards
                out[(mode, sparse, forwards)] = {
                    "keep==none": _same(runs["keep"], runs["none"]), "keep==full": _same(runs["keep"], runs["full"]),
                    # full: every block's layers (attention included) rerun; at SP > 1 on CPU twice (the attention's
                    # inner autograd graph is unpacked by a nested backward, a graph task of its own: the checkpoint
                    # recomputes the block for it again), so at least 2n
                    "counts": counts["none"] == (n, n, n) and counts["keep"] == (n, 2 * n, 2 * n)
                    and len(set(counts["full"])) == 1 and counts["full"][0] >= 2 * n,
                    "raw": counts}
    return out


def _check(results):
    for key, r in results.items():
        assert r["keep==none"] and r["keep==full"] and r["counts"], (key, r)


def test_keep_attention_equals_full_and_none_sp1():
    _check(_cases(0, 1, ("ulysses",)))


def test_keep_attention_equals_full_and_none_sp2():
    for rank_results in run_ranks(_cases, 2, ("ulysses", "ring"), timeout=240):
        _check(rank_results)


def test_keep_attention_needs_a_live_handle():
    model = tiny_wan()
    handle = parallelize(model, None)
    handle.remove()
    with pytest.raises(SPConfigError, match="keep_attention_checkpointing"):
        keep_attention_checkpointing(handle)


def test_keep_attention_in_the_first_blocks_only():
    """num_layers=1 of 2: block 0 keeps its attention, block 1 recomputes whole (its attention twice); the numbers
    are the same bits; out-of-range counts are refused by name."""
    stock, inputs = tiny_wan(), wan_inputs()
    ref = _run(stock, inputs, None, "none", "ulysses", False)
    model = copy.deepcopy(stock)
    handle = parallelize(model, None, mode="ulysses")
    keep_attention_checkpointing(handle, num_layers=1)
    assert [p.kept is not None for p in handle.processors] == [True, False]
    counts = Counts(model, handle)
    out, grads = forward_backward(model, inputs, None)
    assert _same((out, grads, None), ref)
    assert (counts.attention, counts.to_q, counts.ffn) == (3, 4, 4)
    with pytest.raises(SPConfigError, match="num_layers=3"):
        keep_attention_checkpointing(handle, num_layers=3)
