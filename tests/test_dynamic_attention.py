"""Dynamic-SP attention (megatron_sp_ext.sp.dynamic.DynamicAttention), gloo on CPU, float64: the output rows and
the q/k/v gradients of every rank against a float64 single-device reference over the full pack (block-diagonal,
causal within each sample), for ulysses, hcms, ring, tasp, usp and auto at P=2 and P=4; plans mixing samples on one
rank, on pairs and on all ranks, sample lengths that do not divide by their sub-group (padding), GQA, causal and not;
per-sample block masks; the packer's own plan; refusals by name."""
import pytest
import torch
import torch.distributed as dist

from megatron_sp_ext.attention.block_sparse import token_mask
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.dynamic import DynamicAttention, DynamicGroups, DynamicPlan, plan_pack, shard_dynamic
from tests.harness import run_ranks
from tests.reference import make_qkv, reference_attention, rel_err

PLANS = {
    2: [DynamicPlan(2, (5, 9, 3, 12), (1, 2, 1, 2), (0, 0, 1, 0)),
        DynamicPlan(2, (4, 7), (1, 1), (1, 0)),
        DynamicPlan(2, (6, 9, 4), (2, 2, 2), (0, 0, 0))],   # every sample on every rank: one call, its rows as views
    4: [DynamicPlan(4, (7, 13, 4, 10, 6, 3), (1, 4, 1, 2, 2, 1), (0, 0, 1, 2, 0, 3)),
        DynamicPlan(4, (9, 5, 6, 11), (2, 1, 1, 4), (0, 3, 2, 0)),
        DynamicPlan(4, (8, 13, 5), (4, 4, 4), (0, 0, 0))],
}
MODES = [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {}), ("tasp", {}), ("usp", {"ulysses_size": 2}),
         ("auto", {})]


def _mask(plan, causal, masks=None, block=4):
    """[S, S] keep-mask of the full pack: within each sample (causal: j <= i), and its block mask if given."""
    s = plan.cu_seqlens[-1]
    m = torch.zeros(s, s, dtype=torch.bool)
    for i, (a, b) in enumerate(zip(plan.cu_seqlens, plan.cu_seqlens[1:])):
        blk = torch.ones(b - a, b - a, dtype=torch.bool)
        if causal:
            blk = blk.tril()
        if masks is not None and masks[i] is not None:
            pos = torch.arange(b - a)
            blk = blk & token_mask(masks[i], pos, pos, block, slice(None))[0]
        m[a:b, a:b] = blk
    return m


def _case(attn, plan, rank, h, hkv, causal, seed, masks=None):
    s = plan.cu_seqlens[-1]
    q, k, v, do = make_qkv(seed, 1, s, h, hkv, 8, torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = reference_attention(q, k, v, mask=_mask(plan, causal, masks))
    ref.backward(do)
    loc = [shard_dynamic(t.detach(), plan, rank).requires_grad_() for t in (q, k, v)]
    out = attn(*loc, plan, causal=causal, tile_masks=masks, block_size=4)
    out.backward(shard_dynamic(do, plan, rank))
    real = shard_dynamic(torch.ones(1, s, 1, 1), plan, rank) > 0  # padding rows carry nothing
    for name, got, want in [("out", out, ref.detach()), ("dq", loc[0].grad, q.grad), ("dk", loc[1].grad, k.grad),
                            ("dv", loc[2].grad, v.grad)]:
        err = rel_err(got * real, shard_dynamic(want, plan, rank))
        assert err < 1e-10, f"{name} rel err {err} (plan {plan}, causal {causal}, h {h}/{hkv})"


def _every_mode(rank, world):
    groups = DynamicGroups(dist.group.WORLD)
    n = 0
    plans = PLANS[world] + [plan_pack([3, 17, 5, 2, 30, 8, 6], world)]
    for mode, kw in MODES:
        for h, hkv in ((8, 8), (8, 2)):  # MHA and GQA (kv heads < P at P=4)
            attn = DynamicAttention(SPConfig(mode=mode, **kw), groups, num_heads=h, num_kv_heads=hkv)
            for plan in plans:
                for causal in (False, True):
                    _case(attn, plan, rank, h, hkv, causal, n)
                    n += 1
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_dynamic_attention_every_mode(world):
    assert run_ranks(_every_mode, world, timeout=400)[0] == len(MODES) * 2 * 4 * 2


def _tile_masks(rank, world):
    groups = DynamicGroups(dist.group.WORLD)
    plan = PLANS[2][0]  # lengths 5 (one rank), 9 (pair), 3 (one rank), 12 (pair): tiles of 4
    g = torch.Generator().manual_seed(3)
    masks = [torch.rand(1, -(-n // 4), -(-n // 4), generator=g) < 0.6 for n in plan.lengths]
    for m in masks:
        m[0].fill_diagonal_(True)  # every query keeps a key
    masks[2] = None  # a dense sample beside masked ones
    for mode in ("ulysses", "ring"):
        _case(DynamicAttention(SPConfig(mode=mode), groups, num_heads=4), plan, rank, 4, 4, False, 9, masks)
    return True


def test_dynamic_attention_tile_masks():
    assert all(run_ranks(_tile_masks, 2))


def _refusals(rank, world):
    groups = DynamicGroups(dist.group.WORLD)
    with pytest.raises(SPConfigError, match=r"--cp-comm-type='torus' cannot run with --dynamic-context-parallel"):
        DynamicAttention(SPConfig(mode="torus", source="megatron"), groups, num_heads=4)
    with pytest.raises(SPConfigError, match=r"sequence_parallel_ext.mode='tas' cannot run with "
                                            r"sequence_parallel_ext.dynamic: .* use ulysses, hcms, ring, tasp, usp"):
        SPConfig.from_dict({"mode": "tas", "dynamic": True}, source="deepspeed")
    with pytest.raises(SPConfigError, match=r"sequence_parallel_ext.dynamic='yes' is invalid: use true or false"):
        SPConfig.from_dict({"dynamic": "yes"}, source="deepspeed")
    attn = DynamicAttention(SPConfig(mode="ulysses"), groups, num_heads=4)
    with pytest.raises(SPConfigError, match="the plan is for 4 ranks"):
        attn(*(torch.zeros(1, 3, 4, 8) for _ in range(3)), DynamicPlan(4, (3,), (1,), (0,)))
    return True


def test_dynamic_attention_refusals():
    assert all(run_ranks(_refusals, 2))
