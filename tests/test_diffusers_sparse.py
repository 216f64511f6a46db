"""megatron_sp_ext.diffusers.sparse.BlockSparsePlan on diffusers' WanTransformer3DModel (tiny, float64, gloo).

The plan alone: its token order is the latent grid's tile order (a permutation), its window / top-k masks are
``video_tiles``' functions of the grid / of the pooled q, k (the DiT's), the top-k mask is the same on every rank,
bad settings are refused by keyword. On the model: the coarse branch's gate contributes exactly 0 at init (so a
pretrained model starts as its fine top-k attention) yet gets a gradient; a window covering every tile equals the
dense model; the gates round-trip through save_pretrained and a reload (from_pretrained where accelerate is
installed, which diffusers needs for Wan; else the saved config and safetensors) + ``load_gates``. At SP=2 and SP=4
(ulysses, hcms, ring; usp mesh at 4; ring with gradient checkpointing at 2), window and top-k with the gated coarse
branch: the output and every parameter's gradient (summed over the SP ranks) and the latent's equal SP=1 (the same
plan, group=None) and a float64 single-device reference (``reference_sparse_attention`` over the tile order plus an
independent coarse branch) within 1e-10 (diffusers' float32 islands within 1e-6, tests/test_diffusers_wan.py).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")

from diffusers import WanTransformer3DModel  # noqa: E402 - imported before forking
from megatron_sp_ext import SPConfigError  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from megatron_sp_ext.diffusers import parallelize  # noqa: E402
from megatron_sp_ext.diffusers.sparse import GATE_NAME, BlockSparsePlan  # noqa: E402
from megatron_sp_ext.video_tiles import tile_order, topk_tile_mask, window_tile_mask  # noqa: E402
from tests import wan_sparse  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.reference import rel_err  # noqa: E402
from tests.test_diffusers_wan import TOL_FP32_ISLAND, fp32_islands  # noqa: E402
from tests.wan_sp import forward_backward, tiny_wan, wan_inputs  # noqa: E402
from tests.wan_sparse import RecordingPlan, set_gates  # noqa: E402

TOL64 = 1e-10
LATENT = (1, 4, 4, 8, 8)          # -> patch grid 4 x 4 x 4 = 64 tokens
GRID = (4, 4, 4)
TILE = (2, 2, 2)                  # 8 tokens per tile, 8 tiles
PLANS = {"window": dict(window=(1, 0, 1)), "topk": dict(topk=3)}
MODES = {2: [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {})],
         4: [("ulysses", {}), ("hcms", {"head_chunks": "auto"}), ("ring", {}),
             ("usp", {"ulysses_size": 2, "nodes": 2})]}


def reference_model(stock, kind: str):
    return wan_sparse.reference_model(stock, GRID, TILE, **PLANS[kind])


def run_plan(stock, inputs, kind: str, group, mode: str = "auto", *, checkpoint: bool = False, **settings):
    """(output, grads, per-layer masks) of ``stock``'s copy parallelized over ``group`` with a fresh plan
    (``checkpoint``: diffusers' gradient checkpointing, the blocks rerun in the backward)."""
    model = copy.deepcopy(stock)
    if checkpoint:
        model.enable_gradient_checkpointing()
    plan = RecordingPlan(BlockSparsePlan(TILE, **PLANS[kind]))
    sp = parallelize(model, group, mode, sparse=plan, **settings)
    if kind == "topk":
        set_gates(model)
    out, grads = forward_backward(model, inputs, group)
    sp.remove()
    return out, grads, plan.masks


def errors(out, grads, ref_out, ref_grads, islands) -> dict:
    assert grads.keys() == ref_grads.keys()
    exact = [n for n in grads if n not in islands]
    worst = max(exact, key=lambda n: rel_err(grads[n], ref_grads[n]))
    worst_island = max(islands, key=lambda n: rel_err(grads[n], ref_grads[n]))
    return {"output": rel_err(out, ref_out), f"grad {worst}": rel_err(grads[worst], ref_grads[worst]),
            f"fp32 island grad {worst_island} (scaled)":
                rel_err(grads[worst_island], ref_grads[worst_island]) * TOL64 / TOL_FP32_ISLAND}


# ---- the plan alone ---------------------------------------------------------------------------------------------

def test_token_order_is_the_tile_order_and_cached():
    plan = BlockSparsePlan(TILE, window=(1, 1, 1))
    order = plan.token_order(GRID, "cpu")
    assert torch.equal(order.sort().values, torch.arange(64)) and torch.equal(order, tile_order(GRID, TILE)[0])
    assert plan.token_order(GRID, torch.device("cpu")) is order and plan.block_size == 8
    # a grid the tile cuts: still a permutation, whole blocks first
    odd = plan.token_order((3, 5, 4), "cpu")
    assert torch.equal(odd.sort().values, torch.arange(60))
    assert BlockSparsePlan(topk=4).block_size == 128   # the default tile 4x4x8, as the DiT's


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "exactly one of window"), (dict(window=(1, 1, 1), topk=2), "exactly one of window"),
    (dict(tile=(0, 2, 2), topk=2), "tile=0,2,2 is invalid"), (dict(tile=(2, 2), topk=2), "tile=2,2 is invalid"),
    (dict(window=(1, -1, 1)), r"window=\(1, -1, 1\)\) is invalid: give 3 integers >= 0"),
    (dict(window=(1, 1)), r"window=\(1, 1\)\) is invalid"),
    (dict(topk=0), r"topk=0\) is invalid: give an integer >= 1"),
    (dict(topk=2.5), r"topk=2.5\) is invalid"), (dict(topk=2, coarse="yes"), r"coarse='yes'\) is invalid")])
def test_bad_settings_are_refused_by_keyword(kwargs, match):
    with pytest.raises(SPConfigError, match=match):
        BlockSparsePlan(**kwargs)


def test_masks_equal_the_dit_functions_at_sp1():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 4, 16, generator=g, dtype=torch.float64) for _ in range(3))
    mask, extra = BlockSparsePlan(TILE, window=(1, 0, 1))(0, q, k, v, GRID, None)
    assert extra is None and torch.equal(mask, window_tile_mask(GRID, TILE, (1, 0, 1)))
    mask, extra = BlockSparsePlan(TILE, topk=3, coarse=False)(1, q, k, v, GRID, None)
    pooled = [t.view(1, 8, 8, 4, 16).mean(2)[0].transpose(0, 1) for t in (q, k)]   # [H, nT, D]
    assert extra is None and mask.shape == (4, 8, 8) and torch.equal(mask, topk_tile_mask(*pooled, 3))
    assert (mask.sum(-1) == 3).all()
    with pytest.raises(SPConfigError, match="batch 1 per forward"):
        BlockSparsePlan(TILE, topk=3, coarse=False)(0, *(torch.cat([t, t]) for t in (q, k, v)), GRID, None)
    with pytest.raises(SPConfigError, match="do not hold the latent grid"):
        BlockSparsePlan(TILE, topk=3, coarse=False)(0, q, k, v, (4, 4, 8), None)


def _masks_on_ranks(rank, world):
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 64, 4, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    s = 64 // world
    local = [t[:, rank * s:(rank + 1) * s] for t in full]
    mask, _ = BlockSparsePlan(TILE, topk=3, coarse=False)(0, *local, GRID, dist.group.WORLD)
    want, _ = BlockSparsePlan(TILE, topk=3, coarse=False)(0, *full, GRID, None)
    return torch.equal(mask, want), mask.tolist()   # a list: tensors do not outlive the forked rank


def test_topk_mask_same_on_every_rank():
    results = run_ranks(_masks_on_ranks, 4, timeout=120)
    assert all(same for same, _ in results)
    assert all(m == results[0][1] for _, m in results)


# ---- on the model (one rank) ------------------------------------------------------------------------------------

def test_gate_is_zero_at_init_but_learns_and_full_window_is_dense():
    stock, inputs = tiny_wan(), wan_inputs(latent=LATENT)
    dense_out, dense_grads = forward_backward(copy.deepcopy(stock), inputs, None)
    # a window over every tile: the dense model
    model = copy.deepcopy(stock)
    sp = parallelize(model, None, sparse=BlockSparsePlan(TILE, window=(9, 9, 9)))
    out, grads = forward_backward(model, inputs, None)
    sp.remove()
    assert max(errors(out, grads, dense_out, dense_grads, fp32_islands(stock)).values()) <= TOL64
    # top-k with the coarse branch at init (gates zero) == top-k without it, exactly; the gates get gradients
    outs = {}
    for coarse in (True, False):
        model = copy.deepcopy(stock)
        plan = BlockSparsePlan(TILE, topk=3, coarse=coarse)
        sp = parallelize(model, None, sparse=plan)
        gates = {n for n in model.state_dict() if GATE_NAME in n}
        assert len(gates) == (4 if coarse else 0)
        outs[coarse] = forward_backward(model, inputs, None)
        sp.remove()
        assert not any(GATE_NAME in n for n in model.state_dict())     # detach removed them
    assert torch.equal(outs[True][0], outs[False][0])
    assert all(outs[True][1][n].abs().max() > 0 for n in outs[True][1] if GATE_NAME in n)
    assert rel_err(outs[True][0], dense_out) > 1e-3                     # top-3 of 8 tiles is not dense


def _from_pretrained(path):
    pytest.importorskip("accelerate", reason="diffusers' WanTransformer3DModel.from_pretrained needs accelerate "
                                             "(its _keep_in_fp32_modules force low_cpu_mem_usage)")
    return WanTransformer3DModel.from_pretrained(path, torch_dtype=torch.float32)


def _from_config_and_weights(path):
    """What from_pretrained does without accelerate: the saved config, then every saved tensor the model has
    (strict: the model's own keys all present; the gates, unknown to a fresh model, dropped)."""
    from safetensors.torch import load_file  # noqa: PLC0415
    model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(path)).float()
    saved = {}
    for file in sorted(path.glob("*.safetensors")):
        saved.update(load_file(file))
    assert any(GATE_NAME in n for n in saved)                          # save_pretrained carried the gates
    model.load_state_dict({n: t for n, t in saved.items() if n in model.state_dict()}, strict=True)
    return model


@pytest.mark.parametrize("load", [_from_pretrained, _from_config_and_weights], ids=["from_pretrained", "from_config"])
def test_gates_round_trip_through_save_pretrained(tmp_path, load):
    # float32 throughout: from_pretrained keeps the model's _keep_in_fp32_modules in float32 whatever torch_dtype
    # asks, so a float64 model would not come back bit for bit
    stock, inputs = tiny_wan(dtype=torch.float32), wan_inputs(latent=LATENT, dtype=torch.float32)
    plan = BlockSparsePlan(TILE, topk=3)
    sp = parallelize(stock, None, sparse=plan)
    set_gates(stock)
    want, _ = forward_backward(stock, inputs, None)
    stock.save_pretrained(tmp_path, max_shard_size="20KB")             # sharded: the index names the files
    sp.remove()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load(tmp_path)
    assert not any(GATE_NAME in n for n in loaded.state_dict())        # a stock model has no gates
    plan2 = BlockSparsePlan(TILE, topk=3)
    sp = parallelize(loaded, None, sparse=plan2)
    assert plan2.load_gates(loaded, str(tmp_path)) == 4
    got, _ = forward_backward(loaded, inputs, None)
    same = torch.equal if load is _from_config_and_weights else \
        (lambda x, y: rel_err(x, y) < 1e-6)   # diffusers' own loader (accelerate's path): fp32 rounding only
    assert same(got, want)
    # a checkpoint without gates, a path that is neither: refused by name
    gates = {n: t.clone() for n, t in loaded.state_dict().items() if GATE_NAME in n}
    sp.remove()
    loaded.save_pretrained(tmp_path / "plain", max_shard_size="20KB")
    sp = parallelize(loaded, None, sparse=BlockSparsePlan(TILE, topk=3))
    with pytest.raises(SPConfigError, match="4 of 4 gate tensors are not in the checkpoint"):
        sp.sparse.load_gates(loaded, str(tmp_path / "plain"))
    with pytest.raises(SPConfigError, match="not a diffusers model directory"):
        sp.sparse.load_gates(loaded, str(tmp_path / "missing"))
    # gates in a file beside a sharded checkpoint that its index does not list: found there
    save_file(gates, str(tmp_path / "plain" / "gates.safetensors"))
    assert sp.sparse.load_gates(loaded, str(tmp_path / "plain")) == 4
    assert same(forward_backward(loaded, inputs, None)[0], want)
    sp.remove()
    with pytest.raises(SPConfigError, match="the model has no gates"):
        BlockSparsePlan(TILE, window=(1, 1, 1)).load_gates(loaded, str(tmp_path))


# ---- SP=N == SP=1 == the single-device reference ----------------------------------------------------------------

def _sp_case(rank, world):
    stock, inputs = tiny_wan(), wan_inputs(latent=LATENT)
    islands = fp32_islands(stock)
    out = {}
    for kind in PLANS:
        ref_out, ref_grads = forward_backward(reference_model(stock, kind), inputs, None)
        one_out, one_grads, one_masks = run_plan(stock, inputs, kind, None)
        if rank == 0:
            out[f"{kind} SP=1 vs reference"] = errors(one_out, one_grads, ref_out, ref_grads, islands)
        for mode, settings in MODES[world]:
            got, grads, masks = run_plan(stock, inputs, kind, dist.group.WORLD, mode, **settings)
            assert masks.keys() == one_masks.keys() and all(torch.equal(masks[i], one_masks[i]) for i in masks)
            out[f"{kind} {mode} vs SP=1"] = errors(got, grads, one_out, one_grads, islands)
            out[f"{kind} {mode} vs reference"] = errors(got, grads, ref_out, ref_grads, islands)
        if world == 2:
            got, grads, _ = run_plan(stock, inputs, kind, dist.group.WORLD, "ring", checkpoint=True)
            out[f"{kind} ring checkpointing vs reference"] = errors(got, grads, ref_out, ref_grads, islands)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sp_equals_sp1_and_reference(world):
    per_rank = run_ranks(_sp_case, world, timeout=240)
    assert len(per_rank[0]) == len(PLANS) * (1 + 2 * len(MODES[world]) + (world == 2))
    bad = {(r, c): e for r, res in enumerate(per_rank) for c, e in res.items() if not max(e.values()) <= TOL64}
    assert not bad, bad
