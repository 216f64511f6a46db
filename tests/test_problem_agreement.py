"""The problem as the argument: every cross-rank check is reached by every rank (#83 item 1, #85).

The new user's script: an even call, then an uneven one. Before, each rank cached the shapes it had checked, so the
rank whose uneven shard matched a shape it had seen skipped the collective the other rank waited in: a hang. Now the
agreement is one collective per AttentionProblem object, which every rank reaches whatever it saw before; the uneven
call ends in one SPConfigError naming the shapes on every rank, within the harness's timeout.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext import AttentionProblem, SPConfig, SPConfigError
from tests.harness import run_ranks

from tests.reference import reference_attention


def _even_then_uneven(rank, world, how):
    g = dist.group.WORLD
    torch.manual_seed(0)
    h = 8
    a = spx.shard_sequence(torch.randn(1, 16 * world, h, 16), g)
    b = torch.randn(1, 16 * world - 1, h, 16).tensor_split(world, dim=1)[rank]
    attn = spx.make_attention(SPConfig(mode="auto" if how == "auto" else "hcms", head_chunks=2), g, num_heads=h)
    call = {"ulysses": lambda x: spx.ulysses_attention(x, x, x, g),
            "ring": lambda x: spx.ring_attention(x, x, x, g),
            "tasp": lambda x: spx.ring_attention(x, x, x, g, variant="tasp"),
            "make_attention": lambda x: attn(x, x, x, causal=False),
            "auto": lambda x: attn(x, x, x, causal=True)}[how]
    call(a)   # even: runs
    with pytest.raises(SPConfigError) as e:
        call(b)
    return str(e.value)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("how", ["ulysses", "ring", "tasp", "make_attention", "auto"])
def test_uneven_after_even_is_refused_on_every_rank(world, how):
    if how == "tasp" and world == 2:
        pytest.skip("tasp's rings differ from the ring only beyond 2 ranks (the same refusal path as ring)")
    msgs = run_ranks(_even_then_uneven, world, how, timeout=60)
    assert len(msgs) == world
    for m in msgs:   # one message on every rank, naming the shapes of every rank
        assert "shapes differ across ranks" in m, m
        assert "16" in m and "15" in m, m


def _packed_uneven(rank, world):
    g = dist.group.WORLD
    h = 4
    x = spx.shard_sequence(torch.randn(1, 8 * world, h, 8), g)
    sends = spx.pack_qkv(x, x, x, spx.packed_head_layout(h, h, world, 1))
    spx.packed_ulysses_attention(sends, g, num_heads=h, num_kv_heads=h)
    y = torch.randn(1, 8 * world - 1, h, 8).tensor_split(world, dim=1)[rank]
    sends = spx.pack_qkv(y, y, y, spx.packed_head_layout(h, h, world, 1))
    with pytest.raises(SPConfigError, match="shapes differ across ranks"):
        spx.packed_ulysses_attention(sends, g, num_heads=h, num_kv_heads=h)


def test_packed_uneven_after_even_is_refused_on_every_rank():
    run_ranks(_packed_uneven, 2, timeout=60)


def _one_rank_refuses(rank, world):
    """A setting refused on one rank only (kv_valid_len=0 there): every rank raises, none waits in an exchange."""
    g = dist.group.WORLD
    x = spx.shard_sequence(torch.randn(1, 8 * world, 2, 8), g)
    with pytest.raises(SPConfigError) as e:
        spx.ulysses_attention(x, x, x, g, kv_valid_len=0 if rank == 1 else 3)
    return str(e.value)


def test_a_refusal_on_one_rank_reaches_every_rank():
    msgs = run_ranks(_one_rank_refuses, 2, timeout=60)
    assert "leaves no key to attend" in msgs[1]
    assert "rank 1" in msgs[0] and "leaves no key to attend" in msgs[0]


def _settings_differ(rank, world):
    g = dist.group.WORLD
    x = spx.shard_sequence(torch.randn(1, 8 * world, 2, 8), g)
    with pytest.raises(SPConfigError, match="the problem's causal differs across ranks"):
        spx.ring_attention(x, x, x, g, causal=rank == 0)


def test_settings_that_differ_are_named():
    run_ranks(_settings_differ, 2, timeout=60)


def _one_collective_per_problem(rank, world):
    """A problem built once and passed to many calls is agreed once: later calls run no check collective (counted
    by wrapping the agreement), and their results equal the keyword form's."""
    g = dist.group.WORLD
    torch.manual_seed(1)
    x = spx.shard_sequence(torch.randn(1, 8 * world, 4, 8, dtype=torch.float64), g)
    problem = AttentionProblem(causal=True)
    from megatron_sp_ext.sp import problem as problem_mod
    calls = []
    real = problem_mod.agree_across_ranks

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    problem_mod.agree_across_ranks = counting
    try:
        outs = [spx.ulysses_attention(x, x, x, g, problem) for _ in range(3)]
        outs += [spx.ring_attention(x, x, x, g, problem) for _ in range(2)]
    finally:
        problem_mod.agree_across_ranks = real
    assert len(calls) == 1, calls
    ref = spx.ulysses_attention(x, x, x, g, causal=True)
    for o in outs:
        torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    full = spx.unshard_sequence(ref, g)
    xf = spx.unshard_sequence(x, g)
    torch.testing.assert_close(full, reference_attention(xf, xf, xf, causal=True), rtol=1e-9, atol=1e-9)
    # the same problem with other shapes: refused on this rank, naming the agreed shapes
    with pytest.raises(SPConfigError, match="agreed across ranks for q/k/v shapes"):
        spx.ulysses_attention(x[:, :4], x[:, :4], x[:, :4], g, problem)


def test_one_collective_per_problem():
    run_ranks(_one_collective_per_problem, 2, timeout=60)


def _with_mask_agreed(rank, world):
    """A per-layer mask derived with ``with_mask(agreed=True)`` costs no collective once the step's problem is agreed;
    a mask that is not declared agreed is compared, and a per-rank mask refused by name on every rank."""
    g = dist.group.WORLD
    torch.manual_seed(2)
    x = spx.shard_sequence(torch.randn(1, 8 * world, 2, 8, dtype=torch.float64), g)
    step = AttentionProblem(tile=4)
    spx.ulysses_attention(x, x, x, g, step)
    t = 8 * world // 4
    from megatron_sp_ext.sp import problem as problem_mod
    calls = []
    real = problem_mod.agree_across_ranks
    problem_mod.agree_across_ranks = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        for layer in range(3):
            m = torch.rand(1, t, t, generator=torch.Generator().manual_seed(layer)) < 0.5
            m |= torch.eye(t, dtype=torch.bool)
            spx.ulysses_attention(x, x, x, g, step.with_mask(m, agreed=True))
    finally:
        problem_mod.agree_across_ranks = real
    assert calls == []
    bad = torch.eye(t, dtype=torch.bool).unsqueeze(0)
    if rank == 1:
        bad = bad.clone()
        bad[0, 0, -1] = True
    with pytest.raises(SPConfigError, match="block_mask differs between ranks"):
        spx.ulysses_attention(x, x, x, g, step.with_mask(bad))


def test_with_mask_agreed_runs_no_collective_and_undeclared_masks_are_compared():
    run_ranks(_with_mask_agreed, 2, timeout=60)


def test_problem_validates_its_settings_by_name():
    with pytest.raises(SPConfigError, match="layout='bsdh' is invalid"):
        AttentionProblem(layout="bsdh")
    with pytest.raises(SPConfigError, match="placement='zig' is invalid"):
        AttentionProblem(placement="zig")
    with pytest.raises(SPConfigError, match="tile=0"):
        AttentionProblem(tile=0)
    with pytest.raises(SPConfigError, match="dropout_p=1.5"):
        AttentionProblem(dropout_p=1.5)


def test_keyword_form_refuses_unknown_and_mixed_keywords():
    x = torch.randn(1, 8, 2, 8)
    with pytest.raises(SPConfigError, match="unknown keyword 'casual'"):
        spx.ulysses_attention(x, x, x, None, casual=True)
    with pytest.raises(SPConfigError, match="not both"):
        spx.ulysses_attention(x, x, x, None, AttentionProblem(), causal=True)
    with pytest.raises(SPConfigError, match="name the same setting"):
        spx.ulysses_attention(x, x, x, None, tile=4, block_size=4)


def test_kv_valid_len_past_the_sequence_is_refused():
    x = torch.randn(1, 8, 2, 8)
    with pytest.raises(SPConfigError, match=r"kv_valid_len=9 is larger than the sequence \(8 tokens"):
        spx.ulysses_attention(x, x, x, None, kv_valid_len=9)
    out = spx.ulysses_attention(x, x, x, None, kv_valid_len=8)   # == S: no padding, as None
    torch.testing.assert_close(out, spx.ulysses_attention(x, x, x, None))


def _dit_agreements_per_step(rank, world):
    """The video DiT builds its problems once per forward (engine.core_of's begin_step): a dense step agrees one
    problem across ranks (its first layer), not one per layer; a top-k step's per-layer masks are declared agreed
    (no collective for them); a window step's one mask object is compared once, with the shapes (the layers share
    the derived problem). Counted at the collective."""
    from megatron_sp_ext.sp import problem as problem_mod
    from tests.test_sparse_dit import CFG, _step
    from training.video_dit.sparse import SparseSpec
    seen = []
    real = problem_mod.agree_across_ranks

    def counting(*a, **kw):
        seen.append(a[5])   # what
        return real(*a, **kw)
    problem_mod.agree_across_ranks = counting
    counts = {}
    try:
        for name, spec in (("dense", None), ("topk", SparseSpec((2, 2, 2), topk=3)),
                           ("window", SparseSpec((2, 2, 2), window=(0, 1, 0)))):
            seen.clear()
            _step(spec, dist.group.WORLD)
            counts[name] = len(seen)
    finally:
        problem_mod.agree_across_ranks = real
    assert CFG.layers >= 2
    return counts


def test_the_dit_agrees_its_problem_once_per_step():
    for counts in run_ranks(_dit_agreements_per_step, 2, timeout=120):
        assert counts == {"dense": 1, "topk": 1, "window": 1}, counts


def _parent_mask_after_agreed_child(rank, world, first):
    """A problem with its own block mask, bound after (or before) a child derived with ``with_mask(agreed=True)``:
    the child's agreement covers the shapes only (its mask is declared agreed), so the parent's own mask must still
    be compared on its first bind, whatever was bound first. Rank 1's parent mask differs: refused on every rank."""
    g = dist.group.WORLD
    torch.manual_seed(3)
    x = spx.shard_sequence(torch.randn(1, 8 * world, 2, 8, dtype=torch.float64), g)
    t = 8 * world // 4
    window = torch.eye(t, dtype=torch.bool).unsqueeze(0)
    if rank == 1:
        window = window.clone()
        window[0, 0, -1] = True
    step = AttentionProblem(block_mask=window, tile=4)
    layer = step.with_mask(torch.ones(1, t, t, dtype=torch.bool), agreed=True)   # equal on every rank
    if first == "child":
        spx.ulysses_attention(x, x, x, g, layer)
    with pytest.raises(SPConfigError, match="block_mask differs between ranks"):
        spx.ulysses_attention(x, x, x, g, step)
    if first == "parent":   # the parent's refusal does not leave the child's shapes unagreed
        spx.ulysses_attention(x, x, x, g, layer)
    return True


@pytest.mark.parametrize("first", ["child", "parent"])
def test_a_parents_own_mask_is_compared_whatever_was_bound_first(first):
    assert all(run_ranks(_parent_mask_after_agreed_child, 2, first, timeout=60))


def _call_orders(rank, world):
    """One step's problem through a mix of call orders: dense, a declared-agreed child mask, a mask-less child, the
    same problem over a second group (its own agreement), a compared child mask over both groups. Each agreement
    runs where every rank runs it (counted per call), and every result equals the float64 reference (dense causal,
    or causal AND the mask): nothing derived for one call leaks into another."""
    from tests.test_block_sparse import keep_tokens, masked_reference
    g1, g2 = dist.group.WORLD, dist.new_group(list(range(world)))
    torch.manual_seed(4)
    xf = torch.randn(1, 8 * world, 2, 8, dtype=torch.float64)
    x = spx.shard_sequence(xf, g1)
    t = 8 * world // 4
    m = (torch.rand(1, t, t, generator=torch.Generator().manual_seed(9)) < 0.4) | torch.eye(t, dtype=torch.bool)
    step = AttentionProblem(causal=True, tile=4)
    masked = step.with_mask(m)
    from megatron_sp_ext.sp import problem as problem_mod
    real, counts, outs = problem_mod.agree_across_ranks, [], []
    seen = []
    problem_mod.agree_across_ranks = lambda *a, **kw: seen.append(1) or real(*a, **kw)
    try:
        for fn, grp, p in ((spx.ulysses_attention, g1, step), (spx.ulysses_attention, g1, step.with_mask(m, agreed=True)),
                           (spx.ulysses_attention, g1, step.with_mask(None)), (spx.ring_attention, g2, step),
                           (spx.ring_attention, g2, step.with_mask(m, agreed=True)), (spx.ulysses_attention, g1, masked),
                           (spx.ring_attention, g2, masked), (spx.ring_attention, g1, masked)):
            n = len(seen)
            outs.append(spx.unshard_sequence(fn(x, x, x, grp, p), g1))
            counts.append(len(seen) - n)
    finally:
        problem_mod.agree_across_ranks = real
    assert counts == [1, 0, 0, 1, 0, 1, 1, 0], counts
    dense = reference_attention(xf, xf, xf, causal=True)
    sparse = masked_reference(xf, xf, xf, keep_tokens(m, 8 * world, 4, True))
    for i, o in enumerate(outs):
        torch.testing.assert_close(o, sparse if i in (1, 4, 5, 6, 7) else dense, rtol=1e-9, atol=1e-9,
                                   msg=lambda s: f"call {i}: {s}")
    return True


def test_call_orders_agree_where_every_rank_does_and_match_the_reference():
    assert all(run_ranks(_call_orders, 2, timeout=60))
