"""megatron_sp_ext.diffusers.fuse_elementwise on diffusers' tiny WanTransformer3DModel (float64, backend
"aot_eager": the compiled graphs run op by op, so the fused path's numbers differ from eager only by the order in
which autograd sums a gradient's parts): the output and every gradient (parameters or LoRA adapters, and the latent)
equal the eager path's to 1e-10 relative, stock and parallelized, at SP=1 and SP=2 (gloo), with and without the
sparse plan's tiles, with diffusers' gradient checkpointing and with keep_attention_checkpointing; the compiled
graphs run (counted) and their number does not grow with the blocks; on / off / on again in any call order; refusals
by name. One small Inductor case (float32, C++ on the CPU) checks the real fusing backend to float32 rounding."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")

from diffusers import WanTransformer3DModel  # noqa: E402,F401 - imported before forking
from megatron_sp_ext import SPConfigError  # noqa: E402
from megatron_sp_ext.diffusers import fuse_elementwise, keep_attention_checkpointing, parallelize  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.wan_sp import FixedSparsePlan, forward_backward, tiny_wan, wan_inputs  # noqa: E402

RTOL = 1e-10   # float64: only the summation order of a gradient's parts may differ


class Counting:
    """A compile backend: "aot_eager" (autograd through the graph, each op as eager runs it), counting the graphs
    compiled and the calls of them."""

    def __init__(self) -> None:
        self.graphs = self.calls = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        inner = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return inner(*args)
        return run


def _lora(model) -> None:
    """A rank-4 peft LoRA on Wan's attention and FFN linears, its B weights non-zero (so every adapter gradient
    counts); the base frozen."""
    from peft import LoraConfig  # noqa: PLC0415
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0",
                                                                    "ffn.net.0.proj", "ffn.net.2"]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p))


def _step(stock, inputs, group, *, ours: bool, recompute: str, sparse: bool, lora: bool, backend=None):
    """(output, grads) of one step of a copy of ``stock``: parallelized (``ours``) over ``group``, ``recompute``
    (none / full: diffusers' / keep), sparse plan, LoRA, then ``fuse_elementwise(backend)`` (None: eager)."""
    model = copy.deepcopy(stock)
    if lora:
        _lora(model)
    handle = parallelize(model, group, mode="ulysses", sparse=FixedSparsePlan() if sparse else None) if ours else None
    if recompute == "full":
        model.enable_gradient_checkpointing()
    elif recompute == "keep":
        keep_attention_checkpointing(handle)
    if backend is not None:
        fuse_elementwise(model, backend)
    out, grads = forward_backward(model, inputs, group)
    trained = {n for n, p in model.named_parameters() if p.requires_grad} | {"input"}
    return out, {k: v for k, v in grads.items() if k in trained}


def _diff(a, b) -> float:
    """The largest difference of outputs and gradients, relative to each tensor's largest magnitude."""
    (oa, ga), (ob, gb) = a, b
    assert ga.keys() == gb.keys()
    pairs = [(oa, ob)] + [(ga[k], gb[k]) for k in ga]
    return max(((x - y).abs().max() / x.abs().max().clamp_min(1e-300)).item() for x, y in pairs)


CASES = [   # (ours, recompute, sparse, lora)
    (False, "none", False, False), (False, "full", False, True),
    (True, "none", False, False), (True, "full", False, False), (True, "keep", False, False),
    (True, "none", True, False), (True, "keep", True, False), (True, "keep", False, True), (True, "full", True, True),
]


def _cases(rank, world, cases, layers):
    """Per case: (relative difference fused vs eager, graphs compiled, graph calls)."""
    import torch.distributed as dist  # noqa: PLC0415
    group = dist.group.WORLD if world > 1 else None
    stock, inputs = tiny_wan(num_layers=layers), wan_inputs()
    out = {}
    for ours, recompute, sparse, lora in cases:
        kw = dict(ours=ours, recompute=recompute, sparse=sparse, lora=lora)
        torch.compiler.reset()
        counting = Counting()
        eager = _step(stock, inputs, group, **kw)
        fused = _step(stock, inputs, group, backend=counting, **kw)
        out[(ours, recompute, sparse, lora)] = (_diff(eager, fused), counting.graphs, counting.calls)
    return out


def _check(results, layers, sp=1):
    for key, (diff, graphs, calls) in results.items():
        ours, recompute = key[0], key[1]
        assert diff <= RTOL, (key, diff)
        # stock: one graph per block; ours: the graph break at the attention splits each frame on the way (the
        # block's forward, WanAttention's, the processor's) into a graph before and one after, 4 in all; the same
        # graphs for every block at any depth (they share their code, parameters are inputs)
        # (at SP > 1 under checkpointing blocks.0's input is a strided view of the full latent's tokens, so the
        # outer two frames compile once more for it: 6)
        per_block = 4 if ours else 1
        assert graphs == per_block or (sp > 1 and recompute != "none" and graphs == 6), (key, graphs)
        # each block's graphs run in the forward and again in a checkpoint's recompute
        # (diffusers' full checkpointing at SP > 1 may recompute a block more than once: the attention's inner
        # autograd graph is unpacked by a nested backward, a graph task of its own; tests/test_diffusers_keep_attention)
        per_block *= 2 if recompute != "none" else 1
        assert calls == layers * per_block or (sp > 1 and recompute == "full" and calls > layers * per_block), \
            (key, calls)


def test_fused_equals_eager_sp1():
    _check(_cases(0, 1, CASES, 3), 3)


def test_fused_equals_eager_sp2():
    cases = [(True, "none", False, False), (True, "keep", True, False), (True, "full", False, True)]
    for rank_results in run_ranks(_cases, 2, cases, 2, timeout=240):
        _check(rank_results, 2, sp=2)


def test_fused_on_off_in_any_call_order():
    """eager, fused, removed (eager again: no compiled graph runs), fused again: the same numbers each time."""
    torch.compiler.reset()
    stock, inputs = tiny_wan(), wan_inputs()
    model = copy.deepcopy(stock)
    handle = parallelize(model, None, mode="ulysses", sparse=FixedSparsePlan())
    keep_attention_checkpointing(handle)
    ref = forward_backward(model, inputs, None)
    counting = Counting()
    fused = fuse_elementwise(model, counting)
    assert _diff(ref, forward_backward(model, inputs, None)) <= RTOL and counting.calls == 2 * 4 * 2
    fused.remove()
    fused.remove()   # idempotent
    assert _diff(ref, forward_backward(model, inputs, None)) == 0 and counting.calls == 16
    fuse_elementwise(model, counting)
    assert _diff(ref, forward_backward(model, inputs, None)) <= RTOL and counting.calls == 32
    handle.remove()   # the stock processors back under the compiled blocks: diffusers' own forward, compiled anew
    stock_ref = forward_backward(copy.deepcopy(stock), inputs, None)
    assert _diff(stock_ref, forward_backward(model, inputs, None)) <= 1e-6   # SDPA's order differs from ours


def test_fused_refusals_by_name():
    with pytest.raises(SPConfigError, match="Linear is not a diffusers model with repeated blocks"):
        fuse_elementwise(torch.nn.Linear(2, 2))
    model = tiny_wan()
    with pytest.raises(SPConfigError, match="backend='fast'"):
        fuse_elementwise(model, "fast")
    fused = fuse_elementwise(model, "aot_eager")
    with pytest.raises(SPConfigError, match="2 WanTransformerBlock of this WanTransformer3DModel are already compiled"):
        fuse_elementwise(model, "aot_eager")
    fused.remove()
    model.compile_repeated_blocks(backend="aot_eager")   # diffusers' own call: refused too, not compiled twice
    with pytest.raises(SPConfigError, match="already compiled"):
        fuse_elementwise(model, "aot_eager")


def test_fused_inductor_float32():
    """Inductor (C++ kernels on the CPU) fuses the tiny model's blocks (parallelized, kept attention): float32
    output and gradients within float32 rounding of eager."""
    torch.compiler.reset()
    stock, inputs = tiny_wan(dtype=torch.float32), wan_inputs(dtype=torch.float32)
    kw = dict(ours=True, recompute="keep", sparse=False, lora=False)
    eager = _step(stock, inputs, None, **kw)
    fused = _step(stock, inputs, None, backend="inductor", **kw)
    assert _diff(eager, fused) <= 1e-4


def test_fused_vace_equals_eager():
    """WanVACETransformer3DModel (its _repeated_blocks: the main and the VACE blocks), parallelized, the attention
    kept: compiled graphs run, the numbers are eager's."""
    torch.compiler.reset()
    stock, inputs = tiny_wan("vace"), wan_inputs("vace")

    def step(backend):
        model = copy.deepcopy(stock)
        keep_attention_checkpointing(parallelize(model, None, mode="ulysses"))
        if backend is not None:
            fuse_elementwise(model, backend)
        return forward_backward(model, inputs, None)
    counting = Counting()
    assert _diff(step(None), step(counting)) <= RTOL and counting.calls > 0
