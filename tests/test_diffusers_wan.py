"""megatron_sp_ext.diffusers.parallelize on diffusers' WanTransformer3DModel (tiny, float64, gloo): at SP=2 and SP=4,
every mode's output and every parameter gradient (and the latent's; summed over the SP ranks) equal the stock SP=1
model's (diffusers' own processors) within 1e-10; with the test-only SparseAttentionPlan (tests/wan_sp.py: a token
permutation, a random block mask, a gated extra branch) they equal the dense masked reference; I2V, a TI2V per-token
timestep, WanVACETransformer3DModel (its vace blocks' self-attentions too), gradient checkpointing and fused
projections at SP=2; remove() gives back the untouched model; bad input is
refused by name. A 20-step fp32 AdamW run at SP=2 matches SP=1 within 1e-5.

Float32 islands: diffusers' Wan block computes in float32 on purpose even in a float64 model: ``temb.float()`` (the
time embedding's modulation) and ``FP32LayerNorm`` (norm2's affine weight and bias; the I2V image embedder, whose
gradients all pass through its output FP32LayerNorm). The gradients that reach them
are sums over the tokens rounded to float32 (``.float()``'s backward), so a sum taken in another order (per SP shard,
then all-reduced) may round to the neighbouring float32: those parameters (``FP32_ISLANDS``) are held to
``TOL_FP32_ISLAND`` (1e-6; measured 1.4e-7 at SP=2), every other gradient, the latent's and the output to 1e-10."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")

from diffusers import WanTransformer3DModel, WanVACETransformer3DModel  # noqa: E402,F401 - imported before forking
from megatron_sp_ext import SPConfig, SPConfigError   # noqa: E402
from megatron_sp_ext.diffusers import parallelize     # noqa: E402
from tests.harness import run_ranks                   # noqa: E402
from tests.reference import rel_err                   # noqa: E402
from tests.wan_sp import (LATENT, TINY, FixedSparsePlan, forward_backward, grid_of, reference_with_plan,  # noqa: E402
                          tiny_wan, wan_inputs)

TOL64 = 1e-10
TOL_FP32_ISLAND = 1e-6
# beside every FP32LayerNorm's parameters: the time embedding (temb.float()) and the I2V image embedder (its output
# FP32LayerNorm's backward runs in float32, so every gradient inside it is float32-rounded)
FP32_ISLANDS = ("condition_embedder.time_embedder.", "condition_embedder.time_proj.",
                "condition_embedder.image_embedder.")
MODES = {2: [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {}), ("tasp", {}), ("auto", {})],
         4: [("ulysses", {}), ("hcms", {"head_chunks": "auto"}), ("ring", {}), ("tasp", {}), ("auto", {}),
             ("usp", {"ulysses_size": 2, "nodes": 2}), ("tas", {"ulysses_size": 2, "nodes": 2}),
             ("torus", {"ulysses_size": 2, "nodes": 2})]}
# the modes also run without the plan (the plan's runs cover every mode's path plus the token order and the mask)
PLAIN_TOO = {2: [m for m, _ in MODES[2]], 4: ["ulysses", "ring", "usp", "torus"]}


def fp32_islands(model) -> set:
    """Names of the parameters whose gradient diffusers rounds to float32 after a sum over tokens: every
    FP32LayerNorm's (norm2, the I2V image embedder's norms) and the time embedding's (``temb.float()``)."""
    from diffusers.models.normalization import FP32LayerNorm
    names = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, FP32LayerNorm)
             for p, _ in mod.named_parameters()}
    return names | {n for n, _ in model.named_parameters() if n.startswith(FP32_ISLANDS)}


class Cases:
    """One rank's cases: each (kind, sparse, fused) builds its stock model and SP=1 reference once; every case then
    parallelizes that same model, runs it and removes the parallelization again (so each case also checks that
    ``remove()`` gives back a model that the next case's reference still matches)."""

    def __init__(self, group) -> None:
        self.group, self.made = group, {}

    def setup(self, kind: str, sparse: bool, fused: bool):
        key = (kind, sparse, fused)
        if key not in self.made:
            stock = tiny_wan(kind)
            if fused:
                for blk in stock.blocks:
                    blk.attn1.fuse_projections()
                    blk.attn2.fuse_projections()
            inputs = wan_inputs(kind)
            ref = reference_with_plan(stock, FixedSparsePlan(), grid_of()) if sparse else stock
            self.made[key] = (copy.deepcopy(stock), inputs, *forward_backward(ref, inputs, None), fp32_islands(stock))
        return self.made[key]

    def errors(self, kind: str, mode: str, settings: dict, *, sparse: bool = False, checkpoint: bool = False,
               fused: bool = False) -> dict:
        """{output, worst gradient, worst float32-island gradient (scaled): rel err} of the parallelized model
        against its SP=1 reference (stock diffusers; with ``sparse`` the dense masked reference of the same plan)."""
        model, inputs, ref_out, ref_grads, island = self.setup(kind, sparse, fused)
        if checkpoint:
            model.enable_gradient_checkpointing()
        sp = parallelize(model, self.group, mode, sparse=FixedSparsePlan() if sparse else None, **settings)
        out, grads = forward_backward(model, inputs, self.group)
        sp.remove()
        model.disable_gradient_checkpointing()
        assert grads.keys() == ref_grads.keys() and len(island) >= 8, island
        exact = [n for n in grads if n not in island]
        worst = max(exact, key=lambda n: rel_err(grads[n], ref_grads[n]))
        worst_island = max(island, key=lambda n: rel_err(grads[n], ref_grads[n]))
        return {"output": rel_err(out, ref_out), f"grad {worst}": rel_err(grads[worst], ref_grads[worst]),
                # scaled so that every entry is judged against TOL64
                f"fp32 island grad {worst_island} (scaled by 1e-4)":
                    rel_err(grads[worst_island], ref_grads[worst_island]) * TOL64 / TOL_FP32_ISLAND}


def case_errors(kind: str, group, mode: str, settings: dict, **kw) -> dict:
    return Cases(group).errors(kind, mode, settings, **kw)


def gather_backward_errors(group) -> dict:
    """gather_tokens' forward is the full sequence in raster order and its backward hands this rank exactly its own
    rows of the full gradient (with and without a token order): rel errors against the expected tensors."""
    from megatron_sp_ext import shard_sequence
    from megatron_sp_ext.diffusers.sequence import ForwardContext, gather_tokens, split_tokens
    full = torch.randn(2, 48, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weight = torch.randn(2, 48, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = {}
    for plan in (None, FixedSparsePlan()):
        ctx = ForwardContext.of((3, 4, 4), plan, full.device, torch.distributed.get_world_size(group))
        x_loc = split_tokens(full, group, 1, ctx).detach().requires_grad_()
        y = gather_tokens(x_loc, group, 1, ctx)
        (y * weight).sum().backward()
        permuted = weight if ctx.order is None else weight.index_select(1, ctx.order)
        out[f"gather forward order={plan is not None}"] = rel_err(y, full)
        out[f"gather backward order={plan is not None}"] = rel_err(x_loc.grad, shard_sequence(permuted, group))
        # view=True (a full input kept anyway): the same shard; in raster order a view of the full, no copy
        viewed = split_tokens(full, group, 1, ctx, view=True)
        out[f"split view order={plan is not None}"] = rel_err(viewed, split_tokens(full, group, 1, ctx))
        shares = viewed.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        out[f"split view shares the full's storage order={plan is not None}"] = float(shares != (plan is None))
    return out


def blocks0_view_errors(group) -> dict:
    """What blocks.0 receives as hidden_states in a parallelized training forward: with diffusers' gradient
    checkpointing a view of the full input (no copy; checkpointing keeps the full for the recompute), without it a
    tensor of its own (the full may be freed). 0 where so, 1 where not."""
    model, inputs = tiny_wan("t2v"), wan_inputs("t2v")
    seen = []
    out = {}
    for checkpoint in (True, False):
        if checkpoint:
            model.enable_gradient_checkpointing()
        sp = parallelize(model, group, "ulysses")
        # registered after parallelize's own pre-hook: sees the shard it hands the block
        h = model.blocks[0].register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("hidden_states", a[0])),
                                                      with_kwargs=True)
        forward_backward(model, inputs, group)
        h.remove()
        sp.remove()
        model.disable_gradient_checkpointing()
        shard = seen[0]
        seen.clear()
        out[f"blocks.0 shard is a view, checkpointing={checkpoint}"] = float((shard._base is not None) != checkpoint)
    # batch 2: the view is not contiguous (rows of two samples); output and gradients still equal stock SP=1
    inputs2 = wan_inputs("t2v", latent=(2, *LATENT[1:]))
    ref_out, ref_grads = forward_backward(copy.deepcopy(model), inputs2, None)
    island = fp32_islands(model)
    model.enable_gradient_checkpointing()
    sp = parallelize(model, group, "ulysses")
    got_out, grads = forward_backward(model, inputs2, group)
    sp.remove()
    model.disable_gradient_checkpointing()
    out["batch 2 checkpointing output"] = rel_err(got_out, ref_out)
    out["batch 2 checkpointing worst grad"] = max(rel_err(grads[n], ref_grads[n]) for n in grads if n not in island)
    out["batch 2 checkpointing worst fp32 island grad (scaled by 1e-4)"] = max(
        rel_err(grads[n], ref_grads[n]) for n in island) * TOL64 / TOL_FP32_ISLAND
    return out


def _modes_case(rank, world):
    cases, out = Cases(torch.distributed.group.WORLD), {"gather": gather_backward_errors(torch.distributed.group.WORLD)}
    if world == 2:
        out["blocks.0 view"] = blocks0_view_errors(torch.distributed.group.WORLD)
    for mode, kw in MODES[world]:
        for sparse in (False, True) if mode in PLAIN_TOO[world] else (True,):
            out[f"{mode} sparse={sparse}"] = cases.errors("t2v", mode, kw, sparse=sparse)
    out["ring checkpointing sparse"] = cases.errors("t2v", "ring", {}, sparse=True, checkpoint=True)
    if world == 2:
        out["ulysses i2v"] = cases.errors("i2v", "ulysses", {})
        out["ulysses ti2v"] = cases.errors("ti2v", "ulysses", {})
        out["ring ti2v sparse"] = cases.errors("ti2v", "ring", {}, sparse=True)
        out["ulysses checkpointing"] = cases.errors("t2v", "ulysses", {}, checkpoint=True)
        out["ulysses vace"] = cases.errors("vace", "ulysses", {})
        out["ring vace checkpointing"] = cases.errors("vace", "ring", {}, checkpoint=True)
        out["hcms fused projections i2v"] = cases.errors("i2v", "hcms", {"head_chunks": 2}, fused=True)
        out["auto checkpointing fused sparse"] = cases.errors("t2v", "auto", {}, sparse=True, checkpoint=True,
                                                              fused=True)
    else:   # one machine, no nodes=: torus runs (docs/diffusers.md), its mesh one Ulysses group of all the ranks
        out["torus without nodes"] = cases.errors("t2v", "torus", {})
    return out


def test_full_input_kept_decides_view_or_copy():
    """An input split is a view only where the full input lives through the call anyway: the model's own inputs,
    no autograd, a layer under diffusers' gradient checkpointing; a layer with autograd and no checkpointing copies
    (a view saved for backward would keep the whole full tensor)."""
    from megatron_sp_ext.diffusers.hooks import full_input_kept
    model = tiny_wan("t2v")
    block = model.blocks[0]
    assert full_input_kept(model, model) and not full_input_kept(model, block)
    with torch.no_grad():
        assert full_input_kept(model, block)
    model.enable_gradient_checkpointing()
    assert full_input_kept(model, block)
    model.disable_gradient_checkpointing()
    assert not full_input_kept(model, block)


@pytest.mark.parametrize("world", [2, 4])
def test_every_mode_equals_stock_sp1(world):
    per_rank = run_ranks(_modes_case, world, timeout=240)
    want = 1 + len(MODES[world]) + len(PLAIN_TOO[world]) + 1 + (9 if world == 2 else 1)
    assert len(per_rank[0]) == want
    bad = {(r, c): e for r, res in enumerate(per_rank) for c, e in res.items() if not max(e.values()) <= TOL64}
    assert not bad, bad


def test_sp1_same_code_path_and_sparse_reference():
    """group None: the parallelized model equals stock without a plan and the masked reference with one; the plan's
    token order alone (all-true mask, no extra) leaves the output unchanged, and the mask changes it."""
    for mode in ("auto", "ring", "torus"):
        e = case_errors("t2v", None, mode, {})
        assert max(e.values()) <= TOL64, (mode, e)
    e = case_errors("t2v", None, "ulysses", {}, sparse=True)
    assert max(e.values()) <= TOL64, e
    stock, inputs = tiny_wan(), wan_inputs()
    ref = stock(**inputs).sample
    plan = FixedSparsePlan(gated=False, density=2.0)       # every tile selected: only the token order acts
    model = copy.deepcopy(stock)
    sp = parallelize(model, None, sparse=plan)
    assert rel_err(model(**inputs).sample, ref) <= TOL64
    positional = model(inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"]).sample
    assert rel_err(positional, ref) <= TOL64
    sp.remove()
    sp = parallelize(model, None, sparse=FixedSparsePlan(gated=False))
    assert rel_err(model(**inputs).sample, ref) > 1e-3
    sp.remove()


def _state_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _no_hooks(model) -> bool:
    return all(not (m._forward_pre_hooks or m._forward_hooks) for m in model.modules())


def test_remove_restores_the_model_bit_for_bit():
    stock, inputs = tiny_wan(), wan_inputs()
    model = copy.deepcopy(stock)
    originals = [blk.attn1.processor for blk in model.blocks]
    sp = parallelize(model, None, "ring", sparse=FixedSparsePlan())
    assert [type(p).__name__ for p in sp.processors] == ["SPWanSelfAttnProcessor"] * 2 and sp.sp_size == 1
    assert "blocks.0.attn1.sparse_test_gate.weight" in model.state_dict()
    model(**inputs).sample.sum().backward()
    sp.remove()
    sp.remove()   # idempotent
    model.zero_grad(set_to_none=True)
    assert _no_hooks(model) and _state_equal(model, stock)
    assert all(blk.attn1.processor is p for blk, p in zip(model.blocks, originals))
    assert all(type(blk.attn2.processor).__name__ == "WanAttnProcessor" for blk in model.blocks)
    assert torch.equal(model(**inputs).sample, stock(**inputs).sample)
    sp = parallelize(model, None)   # parallelizable again
    sp.remove()


def test_bad_input_is_refused_by_name():
    model = tiny_wan()
    with pytest.raises(SPConfigError, match=r"parallelize supports WanTransformer3DModel, WanVACETransformer3DModel "
                                            r"\(diffusers; .*\); got Linear"):
        parallelize(torch.nn.Linear(2, 2), None)

    class MyWan(WanTransformer3DModel):   # a subclass may change forward: refused too
        pass
    with pytest.raises(SPConfigError, match=r"; got MyWan"):
        parallelize(MyWan(**TINY), None)
    with pytest.raises(SPConfigError, match=r"sparse= .* is not available for WanVACETransformer3DModel"):
        parallelize(tiny_wan("vace"), None, sparse=FixedSparsePlan())
    with pytest.raises(SPConfigError, match=r"mode='bogus' is invalid"):
        parallelize(model, None, "bogus")
    with pytest.raises(SPConfigError, match=r"head_chunk is not a known setting"):
        parallelize(model, None, "hcms", head_chunk=2)
    with pytest.raises(SPConfigError, match=r"either config= or mode/settings"):
        parallelize(model, None, "ring", config=SPConfig(mode="ulysses"))
    for mode in ("auto", "ulysses"):   # any explicit mode beside config=, the default's name included
        with pytest.raises(SPConfigError, match=rf"either config= or mode/settings, not both \(got config= and "
                                                rf"mode='{mode}'\)"):
            parallelize(model, None, mode=mode, config=SPConfig(mode="ring"))
    with pytest.raises(SPConfigError, match=r"got config= and head_chunks"):
        parallelize(model, None, config=SPConfig(mode="hcms"), head_chunks=2)
    for kw, want in (({}, "auto"), ({"mode": "auto"}, "auto"), ({"config": SPConfig(mode="ring")}, "ring")):
        sp = parallelize(model, None, **kw)   # the default, an explicit "auto", config= alone
        assert sp.config.mode == want, (kw, sp.config)
        sp.remove()
    with pytest.raises(SPConfigError, match=r"parallelize: rope='triton'; valid: 'fused', 'eager'"):
        parallelize(model, None, rope="triton")
    with pytest.raises(SPConfigError, match=r"dropout_p=0.1: diffusers' WanAttnProcessor"):
        parallelize(model, None, "ulysses", dropout_p=0.1)
    with pytest.raises(SPConfigError, match=r"sparse= must be a SparseAttentionPlan .*lacks .*token_order"):
        parallelize(model, None, sparse=object())
    model._parallel_config = object()   # what enable_parallelism records
    with pytest.raises(SPConfigError, match=r"already has diffusers' own context parallelism"):
        parallelize(model, None)
    model._parallel_config = None
    drop = tiny_wan()
    drop.blocks[1].attn1.to_out[1].p = 0.1
    with pytest.raises(SPConfigError, match=r"blocks\.1\.attn1\.to_out\.1 is Dropout\(p=0.1\)"):
        parallelize(drop, None)
    drop = tiny_wan()   # any dropout of the model, e.g. the FFN's, or a subclass of torch's
    drop.blocks[0].ffn.net[1].p = 0.2
    with pytest.raises(SPConfigError, match=r"blocks\.0\.ffn\.net\.1 is Dropout\(p=0.2\); on sharded tokens"):
        parallelize(drop, None)

    class MyDropout(torch.nn.Dropout):
        pass
    drop = tiny_wan()
    drop.blocks[1].attn2.to_out[1] = MyDropout(0.3)
    with pytest.raises(SPConfigError, match=r"blocks\.1\.attn2\.to_out\.1 is MyDropout\(p=0.3\)"):
        parallelize(drop, None)
    assert _no_hooks(drop) and all(type(a.processor) is type(model.blocks[0].attn1.processor)
                                   for a in (drop.blocks[0].attn1, drop.blocks[1].attn1))
    from megatron_sp_ext.diffusers.hooks import SequenceState, install_plan
    with pytest.raises(SPConfigError, match=r"_cp_plan\['proj_out'\] = 3 is not a plan entry"):
        install_plan(model, {"proj_out": 3}, SequenceState(None, 1))
    assert _no_hooks(model)
    sp = parallelize(model, None)
    with pytest.raises(SPConfigError, match=r"ran outside the model's forward"):
        model.blocks[0](torch.zeros(1, 48, 64, dtype=torch.float64), torch.zeros(1, 7, 64, dtype=torch.float64),
                        torch.zeros(1, 6, 64, dtype=torch.float64), None)
    with pytest.raises(SPConfigError, match=r"blocks.0.attn1 was called with an attention_mask"):
        model.blocks[0].attn1(torch.zeros(1, 48, 64, dtype=torch.float64), None, torch.ones(1, 1, 48, 48), None)
    with pytest.raises(SPConfigError, match=r"already parallelized"):
        parallelize(model, None)
    sp.remove()


def _refusals_at_4(rank, world):
    g = torch.distributed.group.WORLD
    msgs = []
    two_heads = tiny_wan(num_attention_heads=2, attention_head_dim=32)
    for mode in ("ulysses", "hcms"):
        try:
            parallelize(two_heads, g, mode)
        except SPConfigError as e:
            msgs.append(str(e))
    model = tiny_wan()
    sp = parallelize(model, g, "ring")
    try:
        model(**wan_inputs(latent=(1, 4, 3, 6, 10)))      # 3 x 3 x 5 = 45 tokens
    except SPConfigError as e:
        msgs.append(str(e))
    sp.remove()
    try:   # tas on one machine without nodes= (docs/diffusers.md: it needs several; nodes= simulates them)
        parallelize(model, g, "tas")
    except SPConfigError as e:
        msgs.append(str(e))
    return msgs


def test_refusals_on_four_ranks():
    msgs = run_ranks(_refusals_at_4, 4, timeout=120)[0]
    assert len(msgs) == 4, msgs
    assert "'tas' needs a multi-machine mesh" in msgs[3] and "set nodes" in msgs[3], msgs[3]
    assert all("needs at least one attention head per rank: 2 heads < sp_size 4" in m for m in msgs[:2]), msgs
    assert "patch grid 3x3x5" in msgs[2] and "45 tokens, not divisible by the sequence-parallel size 4" in msgs[2] \
        and "(3, 5, 9, 15, 45)" in msgs[2], msgs[2]


def _train(rank, world, steps=20):
    """20 AdamW steps in fp32 on a flow-matching-like target; returns the losses (SP ranks all-reduce SUM the grads)."""
    g = torch.distributed.group.WORLD if world > 1 else None
    model = tiny_wan(dtype=torch.float32)
    sp = parallelize(model, g, "ulysses", sparse=FixedSparsePlan())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        inputs = wan_inputs(seed=step, dtype=torch.float32)
        target = wan_inputs(seed=1000 + step, dtype=torch.float32)["hidden_states"].detach()
        loss = torch.nn.functional.mse_loss(model(**inputs).sample, target)
        opt.zero_grad()
        loss.backward()
        if g is not None:
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad, group=g)
        opt.step()
        losses.append(loss.item())
    sp.remove()
    return losses


def test_training_20_steps_sp2_matches_sp1():
    one = _train(0, 1)
    two = run_ranks(_train, 2, timeout=240)
    assert two[0] == two[1]
    assert max(abs(a - b) / abs(b) for a, b in zip(two[0], one)) <= 1e-5, (two[0], one)
    assert one[-1] < one[0]


def test_rope_eager_is_diffusers_and_fused_falls_back_off_cuda():
    """rope="fused" and rope="eager" give the same bits on CPU, and the stock model's output and gradients (float64,
    1e-10): the fused kernels do not apply off CUDA (rope.fused_applies says why;
    tests/gpu/test_cuda.py::test_wan_rope_fused_bitwise checks the kernels against the eager ops on a GPU)."""
    from megatron_sp_ext.diffusers import rope
    x = torch.randn(1, 6, 2, 8)
    cos, sin = torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    assert rope.fused_applies(x, cos, sin) in ("triton is not installed", "x is on cpu")
    assert rope.fused_applies(x, cos.double(), sin) is not None
    stock, inputs = tiny_wan(), wan_inputs()
    want_out, want = forward_backward(stock, inputs, None)
    got = {}
    for choice in ("fused", "eager"):
        model = copy.deepcopy(stock)
        sp = parallelize(model, None, "ulysses", rope=choice)
        assert all(p.fused_rope is (choice == "fused") for p in sp.processors)
        got[choice] = forward_backward(model, inputs, None)
        assert rel_err(got[choice][0], want_out) < 1e-10
        assert all(rel_err(got[choice][1][k], want[k]) < 1e-10 for k in want), choice
    assert torch.equal(got["fused"][0], got["eager"][0])
    assert all(torch.equal(got["fused"][1][k], got["eager"][1][k]) for k in want)


def test_diffusers_extra_installs_what_from_pretrained_needs():
    """``pip install ".[diffusers]"`` brings accelerate: diffusers' from_pretrained refuses WanTransformer3DModel
    (``_keep_in_fp32_modules`` forces low_cpu_mem_usage) without it ("low_cpu_mem_usage cannot be False when
    keep_in_fp32_modules is True"), and the README, docs/diffusers.md and --save-pretrained tell users to call it."""
    tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python >= 3.11's tomllib")
    import os
    import re
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {x: {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in extras[x]} for x in ("diffusers", "dev")}
    assert WanTransformer3DModel._keep_in_fp32_modules, "from_pretrained would not need accelerate for this model"
    assert {"diffusers", "accelerate"} <= names["diffusers"] and {"diffusers", "accelerate"} <= names["dev"], names


def _input_checks(rank, world):
    """Per-rank results of forwards whose inputs differ between the SP ranks in one place each."""
    from megatron_sp_ext.diffusers import hooks
    g = torch.distributed.group.WORLD
    results = {}

    def run(name, kind="t2v", check_inputs=True, **change):
        model = tiny_wan(kind)
        sp = parallelize(model, g, "ulysses", check_inputs=check_inputs)
        inputs = wan_inputs(kind)
        inputs.update({k: f(rank, inputs[k]) for k, f in change.items()})
        try:
            out = model(**inputs).sample
            results[name] = ("ok", float(out.detach().abs().sum()))
        except SPConfigError as e:
            results[name] = ("refused", str(e))
        sp.remove()

    run("same")
    run("same i2v", "i2v")
    run("noise per rank", hidden_states=lambda r, x: wan_inputs(seed=r)["hidden_states"])
    run("timestep per rank", timestep=lambda r, t: t + r)
    run("text per rank", encoder_hidden_states=lambda r, x: x + r)
    run("image per rank", "i2v", encoder_hidden_states_image=lambda r, x: x * (1 + r))
    calls = []
    real = hooks.check_same_inputs
    hooks.check_same_inputs = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        run("noise per rank, check off", check_inputs=False,
            hidden_states=lambda r, x: wan_inputs(seed=r)["hidden_states"])
        off_calls = len(calls)
        run("same, check on (counted)")
    finally:
        hooks.check_same_inputs = real
    results["collectives with the check off / on"] = (off_calls, len(calls) - off_calls)
    try:
        parallelize(tiny_wan(), g, "ulysses", check_inputs="yes")
    except SPConfigError as e:
        results["bad check_inputs"] = str(e)
    return results


def test_inputs_differing_between_ranks_are_refused_on_every_rank():
    """#83 item 6: every forward checks that the SP ranks were given the same latent, timestep, text (and image)
    embeddings; per-rank noise (or any one of them differing) is one SPConfigError on EVERY rank naming it; equal
    inputs pass; check_inputs=False skips the check (no collective) and returns the mixed output as before."""
    per_rank = run_ranks(_input_checks, 2, timeout=180)
    for rank, res in enumerate(per_rank):
        assert res["same"][0] == "ok" and res["same i2v"][0] == "ok", (rank, res)
        for case, name in (("noise per rank", "hidden_states"), ("timestep per rank", "timestep"),
                           ("text per rank", "encoder_hidden_states"), ("image per rank",
                                                                        "encoder_hidden_states_image")):
            status, msg = res[case]
            assert status == "refused" and msg.startswith(f"parallelize: {name} differ between SP ranks (rank 1 != "
                                                          f"rank 0") and "check_inputs=False" in msg, (rank, case, msg)
        assert res["noise per rank, check off"][0] == "ok", (rank, res)
        assert res["collectives with the check off / on"] == (0, 1), (rank, res)
        assert "check_inputs='yes'" in res["bad check_inputs"], (rank, res)
    assert per_rank[0]["same"] == per_rank[1]["same"]   # the full output on every rank
    assert per_rank[0]["noise per rank, check off"] == per_rank[1]["noise per rank, check off"]
