"""The attention-layer forms agree their problem across ranks before any collective of their own (#83 item 1, #85).

async_ulysses_self_attention, allgather_self_attention and tp_cp_self_attention take an ``AttentionProblem`` (or its
settings as keywords) and run its agreement (one collective every rank reaches) on its first call, with each rank's
local refusal folded in: the new user's even-then-uneven script ends in one SPConfigError naming the shapes on every
rank (not a hang in the layer's exchanges), a setting refused on one rank is refused on all, and a problem passed to
N calls is agreed once (the calls' agreements counted by wrapping ``problem.agree_across_ranks``). The DiT's block
forms agree one problem per forward (not per layer), and dynamic SP one per sub-group per pack (not per layer).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext import AttentionProblem, LayerRun, LayerWeights, SPConfigError, TpCpGroups
from megatron_sp_ext.sp import problem as problem_module
from tests.blocks import gathered_prep, local_prep
from tests.harness import run_ranks

H, D, DIM = 4, 8, 16


class Agreements:
    """Counts the cross-rank agreements (``checks.agree_across_ranks`` as ``AttentionProblem.agree`` calls it)."""

    def __enter__(self):
        self.calls, self.real = [], problem_module.agree_across_ranks

        def counting(*a, **kw):
            self.calls.append(a[5] if len(a) > 5 else kw.get("what"))
            return self.real(*a, **kw)
        problem_module.agree_across_ranks = counting
        return self

    def __exit__(self, *exc):
        problem_module.agree_across_ranks = self.real


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return LayerWeights(torch.randn(3 * H * D, DIM, generator=g) * 0.2, torch.randn(DIM, H * D, generator=g) * 0.2)


def _tp_cp_groups(tp: int):
    """(TP group, CP group) of this rank, global rank r = p * tp + t (every rank creates them all)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    made = {}
    for p in range(world // tp):
        g = dist.new_group([p * tp + t for t in range(tp)])
        made["tp"] = g if rank // tp == p else made.get("tp")
    for t in range(tp):
        g = dist.new_group([p * tp + t for p in range(world // tp)])
        made["cp"] = g if rank % tp == t else made.get("cp")
    return made["tp"], made["cp"]


def _layer(form: str, world: int):
    """(call(x, problem=None, **keywords), groups) of one layer form on this rank."""
    w = _weights()
    if form == "async":
        return lambda x, p=None, **kw: spx.async_ulysses_self_attention(
            x, w, dist.group.WORLD, p, num_heads=H, num_kv_heads=H, prep=local_prep(H, H, D), **kw)
    if form == "allgather":
        return lambda x, p=None, **kw: spx.allgather_self_attention(
            x, w, dist.group.WORLD, p, num_heads=H, num_kv_heads=H, prep=gathered_prep(H, H, D), **kw)
    tp, cp = _tp_cp_groups(2)
    groups = TpCpGroups(tp, cp, dist.group.WORLD if form == "tp_cp_tcp" else None)   # WORLD: TP x CP, CP-major
    ht = H // 2   # this TP shard's heads
    wt = LayerWeights(w.w_qkv[: 3 * ht * D], w.w_o[:, : ht * D])
    return lambda x, p=None, **kw: spx.tp_cp_self_attention(
        x, wt, groups, p, num_heads=ht, num_kv_heads=ht, prep=lambda br, y4, nw, gathered: y4, **kw)


def _even_then_uneven(rank, world, form):
    call = _layer(form, world)
    torch.manual_seed(0)
    even = torch.randn(1, 8, DIM)
    call(even, causal=True)   # even: runs
    uneven = torch.randn(1, 8 if rank == 0 else 7, DIM)
    with pytest.raises(SPConfigError) as e:
        call(uneven, causal=True)
    return str(e.value)


@pytest.mark.parametrize("form,world", [("async", 2), ("async", 4), ("allgather", 2), ("allgather", 4),
                                        ("tp_cp", 2), ("tp_cp", 4), ("tp_cp_tcp", 4)])
def test_uneven_after_even_is_refused_on_every_rank(form, world):
    msgs = run_ranks(_even_then_uneven, world, form, timeout=60)
    assert len(msgs) == world
    for m in msgs:   # one message on every rank, naming every rank's shape
        assert "shapes differ across ranks" in m and "(1, 8, 16" in m and "(1, 7, 16" in m, m


def _one_rank_refuses(rank, world, form):
    """kv_valid_len=0 on rank 1 only (a local refusal): every rank raises, none waits in an exchange."""
    call = _layer(form, world)
    with pytest.raises(SPConfigError) as e:
        call(torch.randn(1, 8, DIM), kv_valid_len=0 if rank == 1 else 3)
    return str(e.value)


@pytest.mark.parametrize("form", ["async", "allgather", "tp_cp"])
def test_a_refusal_on_one_rank_reaches_every_rank(form):
    msgs = run_ranks(_one_rank_refuses, 2, form, timeout=60)
    assert "leaves no key to attend" in msgs[1]
    assert "rank 1" in msgs[0] and "leaves no key to attend" in msgs[0], msgs[0]


def _one_agreement_per_problem(rank, world, form):
    """A problem passed to 3 calls runs one agreement (TP x CP without its TP x CP group: CP then TP, one each);
    the outputs equal the keyword form's (one problem, and one agreement, per call)."""
    call = _layer(form, world)
    torch.manual_seed(1 + rank)
    x = torch.randn(1, 8, DIM)
    problem = AttentionProblem(causal=True, placement="zigzag")
    run = LayerRun(head_chunks=1)
    with Agreements() as agreed:
        outs = [call(x, problem, run=run) for _ in range(3)]
    per_problem = 2 if form == "tp_cp" and world == 4 else 1
    assert len(agreed.calls) == per_problem, agreed.calls
    with Agreements() as agreed:
        ref = call(x, causal=True, placement="zigzag")
        ref2 = call(x, causal=True, placement="zigzag")
    assert len(agreed.calls) == 2 * per_problem, agreed.calls
    for o in outs + [ref2]:
        torch.testing.assert_close(o, ref, rtol=0, atol=0)
    with pytest.raises(SPConfigError, match="agreed across ranks for q/k/v shapes"):   # same problem, new shape
        call(x[:, :4], problem)
    return True


@pytest.mark.parametrize("form,world", [("async", 2), ("allgather", 2), ("tp_cp", 2), ("tp_cp", 4),
                                        ("tp_cp_tcp", 4)])
def test_a_problem_passed_to_many_calls_is_agreed_once(form, world):
    assert all(run_ranks(_one_agreement_per_problem, world, form, timeout=90))


def _refusals(rank, world):
    call = _layer("async", world)
    x = torch.randn(1, 8, DIM)
    cases = [({"cu_seqlens": torch.tensor([0, 16])}, "cu_seqlens is not supported by async_ulysses_self_attention"),
             ({"dropout_p": 0.1}, "dropout_p is not supported"),
             ({"casual": True}, "unknown keyword 'casual'"),
             ({"fused": True}, "fused=True does not apply to async_ulysses_self_attention"),
             ({"head_chunks": 0}, "head_chunks=0 is invalid"),
             ({"run": LayerRun(), "transport": "nccl"}, "in the LayerRun or as keywords, not both")]
    for kw, match in cases:
        with pytest.raises(SPConfigError, match=match):
            call(x, **kw)
    with pytest.raises(SPConfigError, match="layout='sbhd' is invalid for async_ulysses_self_attention"):
        call(x, AttentionProblem(layout="sbhd"))
    return True


def test_layer_refusals_name_the_setting():
    assert all(run_ranks(_refusals, 2, timeout=60))


def _dit_one_agreement_per_forward(rank, world, how):
    """The DiT with a block form: one agreement per forward (its first layer), whatever the number of layers; the
    plain core's problems are the engine's own (one per forward too)."""
    from megatron_sp_ext.sp.layers.policy import LayerPolicy
    from training.video_dit import VideoDiT, preset
    from training.video_dit.data import SyntheticVideoLatents
    from training.video_dit.engine import flow_matching_batch, local_loss, make_core, prepare
    CFG = preset("tiny")
    torch.manual_seed(5)
    model = VideoDiT(CFG)
    model.set_attention_core(make_core("ulysses", dist.group.WORLD, num_heads=CFG.heads))
    if how == "policy":
        model.set_layer_policy(dist.group.WORLD, LayerPolicy())
    else:
        model.set_async_attention(dist.group.WORLD, allgather=how == "allgather")
    data = SyntheticVideoLatents(CFG.in_channels, (3,), 6, 10, CFG.text_len, CFG.text_dim, seed=1)
    inp = prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch), rank, world, "cpu")
    counts = []
    for _ in range(2):   # two steps: one agreement each
        with Agreements() as agreed:
            loss = local_loss(model, inp)
            loss.backward()
        counts.append(len(agreed.calls))
    return counts, CFG.layers


@pytest.mark.parametrize("how", ["async", "allgather", "policy"])
def test_dit_block_forms_agree_once_per_forward(how):
    for counts, layers in run_ranks(_dit_one_agreement_per_forward, 2, how, timeout=120):
        assert layers > 1 and counts == [1, 1], (counts, layers)


def _dynamic_once_per_pack(rank, world):
    """Dynamic SP: a pack's PackProblems passed to 3 layer calls agrees each sub-group of more than one rank once;
    the plan + keywords form (one PackProblems per call) agrees them on every call."""
    from megatron_sp_ext.config import SPConfig
    from megatron_sp_ext.sp.dynamic import DynamicAttention, DynamicGroups, DynamicPlan, shard_dynamic
    from tests.reference import make_qkv
    attn = DynamicAttention(SPConfig(mode="ulysses"), DynamicGroups(dist.group.WORLD), num_heads=4)
    plan = DynamicPlan(2, (5, 9, 3, 12), (1, 2, 1, 2), (0, 0, 1, 0))   # one sub-group of 2 ranks, two local samples
    q, k, v, _ = make_qkv(0, 1, sum(plan.lengths), 4, 4, 8, torch.float64)
    loc = [shard_dynamic(t, plan, rank) for t in (q, k, v)]
    problems = attn.problems(plan, causal=True)
    with Agreements() as agreed:
        outs = [attn(*loc, problems) for _ in range(3)]
    once = len(agreed.calls)
    with Agreements() as agreed:
        ref = [attn(*loc, plan, causal=True) for _ in range(3)]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    return once, len(agreed.calls)


def test_dynamic_sp_agrees_once_per_pack():
    for once, per_call in run_ranks(_dynamic_once_per_pack, 2, timeout=60):
        assert (once, per_call) == (1, 3)


def _megatron_auto_uneven(rank, world):
    """Megatron's SPSelfAttention with --sp-async-qkv auto (a FormPolicy timing every form, per shape key): an even
    call, then one where rank 1's shard is shorter. The layer's problem is agreed before the policy runs anything:
    every rank raises naming the layer inputs' shapes [B, S, hidden] (without that agreement the rank whose shape is
    new starts timing alone, and the error, if any, comes from whichever collective the ranks happen to pair)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_sp_ext.megatron import SPTransformerConfig, with_sp_core_attention
    from megatron_sp_ext.sp.layers.policy import FormPolicy
    ps.initialize_model_parallel(context_parallel_size=world)
    try:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        cfg = SPTransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                  context_parallel_size=world, cp_comm_type="ulysses", hidden_dropout=0.0,
                                  attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
                                  masked_softmax_fusion=False, sp_async_qkv="auto", normalization="RMSNorm")
        torch.manual_seed(1234)
        block = TransformerBlock(cfg, with_sp_core_attention(get_gpt_layer_local_spec(normalization="RMSNorm")))
        timed = []
        block.layers[0].self_attention.form_policy = FormPolicy(
            rounds=2, warmup=1, timer=lambda name, step, *a: timed.append(name) or step() or 1.0)
        with Agreements() as agreed:
            block(torch.randn(8, 1, 32), attention_mask=None)   # even: agreed, then timed
        assert timed and agreed.calls, (timed, agreed.calls)
        with pytest.raises(SPConfigError) as e:
            block(torch.randn(8 if rank == 0 else 7, 1, 32), attention_mask=None)
        return str(e.value)
    finally:
        ps.destroy_model_parallel()


def test_megatron_auto_form_uneven_after_even_is_refused_on_every_rank():
    pytest.importorskip("megatron.core")
    for m in run_ranks(_megatron_auto_uneven, 2, timeout=120):
        assert "shapes differ across ranks" in m and "(1, 8, 32" in m and "(1, 7, 32" in m, m
