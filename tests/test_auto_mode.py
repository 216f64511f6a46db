"""``auto`` across Ulysses/HCMS, the ring and TASP (sp.factory's SPAttention + sp.calibration's ModePolicy).

Whatever auto picks, its output and every input gradient equal the float64 single-device reference: each branch
is forced through the real calibration (the ModePolicy timing the candidates on gloo, with an injected timer that
makes the branch fastest), causal zigzag and not, P=2,3,4, GQA, key padding, sbhd (Megatron) and bshd (DeepSpeed,
DiT). The decision is identical on every rank even where the ranks' own clocks disagree, the early stop of long
timings is a group-wide decision, the cache key holds the group's global ranks (not ``id``), the calibration's
cost is bounded by its budget and logged, and each entry point (Megatron, DeepSpeed, DiT) runs the calibrated pick.
"""
import logging
import time

import pytest
import torch
import torch.distributed as dist

from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.sp.calibration import ModePolicy, group_key, wall_time_ms
from megatron_sp_ext.sp.factory import SPResources, make_attention
from megatron_sp_ext.sp.placement import pieces
from tests.harness import run_ranks
from tests.reference import pad_mask
from tests.sp_check import run_case
from tests.gpu.suite_judge import verdict


def forcing_timer(pick):
    """A timer that runs the step once (the candidate's real collectives) and reports ``pick`` fastest."""
    def timer(fn, iters, warmup, group):
        fn()
        return 1.0 if fn.mode == pick else 2.0
    return timer


def _shard_fn(placement):
    def shard(x, r, w):
        return torch.cat([x[:, a:a + n] for a, n in pieces(placement, r, w, x.shape[1])], dim=1)
    return shard


def _counting(attn):
    """Wrap the SPAttention's branch runners: which one served the call."""
    ran = []
    uly, ring = attn._ulysses, attn._ring

    def u(*a, **kw):
        ran.append("hcms")
        return uly(*a, **kw)

    def r(q, k, v, variant, *a, **kw):
        ran.append(variant)
        return ring(q, k, v, variant, *a, **kw)
    attn._ulysses, attn._ring = u, r
    return ran


# (layout, placement, causal, kv heads per q head group, padding): Megatron-like, DiT-like, and mixes
CASES = [("sbhd", "zigzag", True, 1, False), ("bshd", "contiguous", False, 2, True),
         ("sbhd", "zigzag", True, 2, True), ("bshd", "contiguous", False, 1, False)]


def _forced_branches(rank, world):
    group = dist.group.WORLD
    h, d, b = 2 * world, 8, 2
    s = 6 * world
    picks = ["hcms", "ring"] + (["tasp"] if world > 2 else [])
    n = 0
    for layout, placement, causal, gqa, padded in CASES:
        hkv = h // gqa
        valid = s - 3 if padded else None
        mask = pad_mask(s, valid, causal) if padded else None
        for pick in picks:
            cfg = SPConfig(mode="auto", head_chunks=2)
            policy = ModePolicy(timer=forcing_timer(pick), timed_devices=("cpu",), rounds=3, warmup=1)
            attn = make_attention(cfg, group, num_heads=h, num_kv_heads=hkv, layout=layout, placement=placement,
                                  resources=SPResources(cfg, mode_policy=policy))
            assert attn.auto and attn.mode == "hcms"
            ran = _counting(attn)

            def fn(q, k, v, attn=attn, causal=causal, valid=valid):
                return attn(q, k, v, causal=causal, kv_valid_len=valid)
            run_case(fn, rank, world, b=b, s=s, h=h, hkv=hkv, d=d, dtype=torch.float32, causal=causal,
                     layout=layout, seed=n, shard=_shard_fn(placement), mask=mask, compare_rows=valid)
            # the calibration ran every candidate, then the call itself ran the pick
            assert set(ran[:-1]) == set(picks) and ran[-1] == pick, (pick, ran)
            cal = next(iter(policy.cache.values()))
            assert cal.chunks == pick and group_key(group) in next(iter(policy.cache))
            # the choice is cached: a second call times nothing
            ran.clear()
            fn(*(torch.zeros((s // world, b, h, d) if layout == "sbhd" else (b, s // world, h, d)) for _ in range(1)),
               *(torch.zeros((s // world, b, hkv, d) if layout == "sbhd" else (b, s // world, hkv, d))
                 for _ in range(2)))
            assert ran == [pick]
            n += 1
    return n


@pytest.mark.parametrize("world", [2, 3, 4])
def test_auto_every_branch_matches_float64(world):
    assert run_ranks(_forced_branches, world, timeout=300)[0] == len(CASES) * (2 + (world > 2))


def _rank_disagreeing_clocks(rank, world):
    """Each rank's own clock prefers a different mode; the group's max makes one decision everywhere."""
    group = dist.group.WORLD
    sleeps = {"hcms": (0.012, 0.001), "ring": (0.001, 0.020)}  # (rank 0, rank 1) seconds

    def step(name):
        def run():
            time.sleep(sleeps[name][rank])
        return run
    pol = ModePolicy(timer=wall_time_ms, timed_devices=("cpu",), rounds=3, warmup=1, iters=2)
    choice = pol.fastest(("k",), {n: step(n) for n in sleeps}, group, torch.device("cpu"))
    cal = pol.cache[("k",)]
    return choice, cal.measured


def test_decision_identical_on_every_rank():
    (c0, m0), (c1, m1) = run_ranks(_rank_disagreeing_clocks, 2)
    assert c0 == c1 == "hcms" and m0 == m1  # max over ranks: hcms 12 ms < ring 20 ms


def _early_stop_together(rank, world):
    """One rank's calls exceed long_ms, the other's do not: both stop after the same number of calls."""
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.015 if rank == 0 else 0.0)
    wall_time_ms(fn, 5, 0, dist.group.WORLD, long_ms=10.0)
    return len(calls)


def test_long_call_early_stop_is_group_wide():
    assert run_ranks(_early_stop_together, 2) == [2, 2]


def _group_keys(rank, world):
    """Same shapes on two groups of different ranks: separate keys (the ranks, not a per-process id)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    pol = ModePolicy(timer=forcing_timer("ring" if rank < 2 else "hcms"), timed_devices=("cpu",), rounds=3,
                     warmup=1)
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 4, 8)
    cands = {"hcms": lambda a, b, c: a * 1.0, "ring": lambda a, b, c: a * 1.0}
    pick = pol.fastest_for(q, k, mine, cands)
    (key,) = pol.cache
    return pick, key[4]


def test_cache_key_holds_the_group_ranks():
    got = run_ranks(_group_keys, 4)
    assert got == [("ring", (0, 1)), ("ring", (0, 1)), ("hcms", (2, 3)), ("hcms", (2, 3))]


def test_calibration_cost_is_bounded_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 2)
    calls = []

    def slow(fn, iters, warmup, group):
        calls.append(fn.mode)
        return 1000.0 if fn.mode == "hcms" else 900.0
    pol = ModePolicy(timer=slow, timed_devices=("cpu",), budget_ms=500.0, min_rounds=3, rounds=5)
    with caplog.at_level(logging.INFO, logger="megatron_sp_ext"):
        assert pol.fastest(("slow",), {"hcms": lambda: None, "ring": lambda: None}, None,
                          torch.device("cpu")) == "ring"
    cal = pol.cache[("slow",)]
    assert len(cal.rounds["hcms"]) == len(cal.rounds["ring"]) == 3 and len(calls) == 6  # budget: 3 of 5 rounds
    assert cal.cost_ms >= 0.0
    assert any("auto mode -> ring" in r.getMessage() and "calibration" in r.getMessage() for r in caplog.records)
    fast = ModePolicy(timer=lambda fn, i, w, g: 1.0, timed_devices=("cpu",), budget_ms=500.0, rounds=5)
    fast.fastest(("fast",), {"hcms": lambda: None, "ring": lambda: None}, None, torch.device("cpu"))
    assert len(fast.cache[("fast",)].rounds["hcms"]) == 5
    # off the timed devices (default: CUDA only): the baseline, untimed
    assert ModePolicy(timer=slow).fastest(("cpu",), {"hcms": lambda: None, "ring": lambda: None}, None,
                                         torch.device("cpu")) == "hcms"


def _entries_run_the_pick(rank, world):
    """Megatron's SPDotProductAttention, DeepSpeed's SPDistributedAttention and the DiT's make_core with
    mode auto: the ModePolicy they share with the factory picks the ring (forced), and the call equals float64."""
    import importlib

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_sp_ext.megatron import SPTransformerConfig
    from megatron_sp_ext.megatron.core_attention import SPDotProductAttention
    from training.video_dit.engine import make_core
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    from megatron_sp_ext.deepspeed import SPDistributedAttention
    ps.initialize_model_parallel(context_parallel_size=world)
    group = ps.get_context_parallel_group()
    h, d, s, b = 8, 8, 4 * world, 2
    try:
        cfg = SPTransformerConfig(num_layers=1, hidden_size=h * d, num_attention_heads=h, context_parallel_size=world,
                                  cp_comm_type="auto", attention_dropout=0.0, hidden_dropout=0.0)
        core = SPDotProductAttention(cfg, 1, AttnMaskType.causal, "self", cp_comm_type="auto")
        core.ctx.mode_policy = ModePolicy(timer=forcing_timer("ring"), timed_devices=("cpu",), rounds=3, warmup=1)
        ran = _counting(core.attention)
        run_case(lambda q, k, v: core(q, k, v, None).view(q.shape), rank, world, b=b, s=s, h=h, hkv=h, d=d,
                 dtype=torch.float32, causal=True, layout="sbhd", shard=_shard_fn("zigzag"))
        assert ran[-1] == "ring", ran
        ds = SPDistributedAttention(None, group, 2, 1, mode="auto", causal=False)
        ds.resources.mode_policy = ModePolicy(timer=forcing_timer("ring"), timed_devices=("cpu",), rounds=3,
                                              warmup=1)
        ran = _counting(ds.attention_for(h, h, "bshd"))
        valid = s - 3
        mask = pad_mask(s, valid, False)
        run_case(lambda q, k, v: ds(q, k, v, 0, kv_valid_len=valid), rank, world, b=b, s=s, h=h, hkv=h, d=d,
                 dtype=torch.float32, causal=False, mask=mask, compare_rows=valid, shard=_shard_fn("contiguous"))
        assert ran[-1] == "ring", ran
        dit = make_core("auto", group, num_heads=h)
        dit.attention.res.mode_policy = ModePolicy(timer=forcing_timer("ring"), timed_devices=("cpu",), rounds=3,
                                                   warmup=1)
        ran = _counting(dit.attention)
        run_case(lambda q, k, v: dit(q, k, v, None), rank, world, b=b, s=s, h=h, hkv=h, d=d, dtype=torch.float32,
                 causal=False, shard=_shard_fn("contiguous"))
        assert ran[-1] == "ring", ran
    finally:
        ps.destroy_model_parallel()
    return True


def test_every_entry_point_runs_the_calibrated_pick():
    pytest.importorskip("megatron.core")
    pytest.importorskip("deepspeed")
    run_ranks(_entries_run_the_pick, 2, timeout=300)


def _suite_on_cpu(monkeypatch):
    import tests.gpu.cuda_auto_copies as mod
    import tests.gpu.cuda_suite as suite
    for m in (mod, suite):
        monkeypatch.setattr(m, "DEV", "cpu")
        monkeypatch.setattr(m, "SHRINK", 16)
    return mod


def test_cuda_auto_worker_runs_on_cpu(monkeypatch):
    """tests/gpu/cuda_auto_copies.auto_family dry-run on CPU gloo ranks (SPX_SUITE_DEVICE=cpu, SPX_SUITE_SHRINK=16)."""
    mod = _suite_on_cpu(monkeypatch)
    for per_rank in run_ranks(mod.auto_family, 2, timeout=300):
        # 2 head layouts x 2 (layout, causal) x 3 picks at P=2, then the user's own make_attention call and the
        # ring-on-this-group check of user_auto_on_the_plain_group
        assert len(per_rank) == 12 + 2 and all(r["family"] == "auto" for r in per_rank)
        assert "user make_attention" in per_rank[12]["case"] and "mode='ring' on gloo with cpu tensors runs" in \
            per_rank[13]["case"], [r["case"] for r in per_rank[12:]]
        for r in per_rank:
            assert not verdict(r), (verdict(r), r)


def _recompute(rank, world):
    """A module in training whose first forward runs under no_grad (reentrant activation recompute): auto keys and
    times fwd+bwd by the module's flag, so the recompute finds the same decision (one key) and the same output."""
    group = dist.group.WORLD
    cfg = SPConfig(mode="auto")
    calls = []

    def timer(fn, iters, warmup, group_):
        calls.append(torch.is_grad_enabled())
        fn()
        return 1.0 if fn.mode == "ring" else 2.0
    policy = ModePolicy(timer=timer, timed_devices=("cpu",), rounds=3, warmup=1)
    attn = make_attention(cfg, group, num_heads=4, layout="sbhd", placement="zigzag",
                          resources=SPResources(cfg, mode_policy=policy))
    attn.training = True
    ran = _counting(attn)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(4, 1, 4, 8, generator=g) for _ in range(3))
    with torch.no_grad():
        first = attn(q, k, v, causal=True)
    (key,) = policy.cache
    n = len(calls)
    again = attn(*(t.clone().requires_grad_() for t in (q, k, v)), causal=True)
    assert len(policy.cache) == 1 and len(calls) == n and key[-1] is True  # one key: fwd+bwd
    assert ran[-1] == ran[-2] == "ring" and torch.equal(first, again.detach())
    attn.training = None  # no module flag: grad mode keys (inference under no_grad is its own key)
    with torch.no_grad():
        attn(q, k, v, causal=True)
    assert len(policy.cache) == 2
    return True


def test_recompute_forward_decides_like_training():
    run_ranks(_recompute, 2)


def _fixed_mode_logged(rank, world, mode, sparse):
    """Two layers of one model, three steps of block-sparse (``sparse``) or plain dense calls in ``mode``: the
    library's auto lines."""
    from tools.benchlib import AutoDecisions
    cfg = SPConfig(mode=mode)
    res = SPResources(cfg)   # two layers of one model: one line between them
    layers = [make_attention(cfg, dist.group.WORLD, num_heads=4, num_kv_heads=2, resources=res) for _ in range(2)]
    s_loc, bs = 8, 4
    t = (s_loc * world + bs - 1) // bs
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, s_loc, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, s_loc, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    tiles = {"block_mask": torch.ones(1, t, t, dtype=torch.bool), "block_size": bs} if sparse else {}
    with AutoDecisions() as d:
        for _ in range(3):
            for attn in layers:
                attn(q, k, v, causal=False, **tiles)
    return d.messages


@pytest.mark.parametrize("mode,sparse,lines", [("auto", True, 0), ("hcms", True, 0), ("auto", False, 0)])
def test_auto_names_its_mode_for_block_mask_calls(mode, sparse, lines):
    """auto calibrates block-sparse calls like dense ones (CPU: its baseline, silently; no "fixed mode" line); a
    fixed mode says nothing."""
    for messages in run_ranks(_fixed_mode_logged, 2, mode, sparse):
        fixed = [m for m in messages if "for calls with" in m]
        assert len(fixed) == lines, messages
        assert all("auto mode -> hcms" in m and "a block mask" in m for m in fixed), messages


def _too_few_heads_logged(rank, world):
    from tools.benchlib import AutoDecisions
    cfg = SPConfig(mode="auto")
    attn = make_attention(cfg, dist.group.WORLD, num_heads=2, num_kv_heads=2, resources=SPResources(cfg))
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with AutoDecisions() as d:
        attn(q, q, q, causal=False)
        attn(q, q, q, causal=False)
    return attn.mode, d.messages


def test_auto_resolved_statically_says_so_once():
    """auto with fewer heads than ranks resolves once (not per shape) and says which mode, once."""
    for mode, messages in run_ranks(_too_few_heads_logged, 4):
        fixed = [m for m in messages if "for calls with" in m]
        assert mode != "hcms" and len(fixed) == 1 and f"auto mode -> {mode}" in fixed[0], messages


def _forced_branches_block_mask(rank, world):
    """auto with a block mask: each candidate forced through the real calibration (timed WITH the mask), then the
    pick serves the call; output and gradients against the float64 masked reference; the choice is keyed by the
    mask's shape and tile size (another mask of that shape reuses it, another tile size calibrates again)."""
    from megatron_sp_ext.attention import block_sparse as bsp
    from tests.test_block_sparse import check_case, random_mask, window_mask
    group = dist.group.WORLD
    s, bs, h, hkv = 2 * world * 7, 9, 2 * world, world
    t = bsp.num_tiles(s, bs)
    picks = ["hcms", "ring"] + (["tasp"] if world > 2 else [])
    n = 0
    for causal, placement in ((False, "contiguous"), (True, "zigzag")):
        for pick in picks:
            cfg = SPConfig(mode="auto", head_chunks=2)
            policy = ModePolicy(timer=forcing_timer(pick), timed_devices=("cpu",), rounds=3, warmup=1)
            attn = make_attention(cfg, group, num_heads=h, num_kv_heads=hkv, placement=placement,
                                  resources=SPResources(cfg, mode_policy=policy))
            ran = _counting(attn)
            masks_seen = []   # the block_mask each branch call was given

            def seeing(fn, at):   # the AttentionProblem is the runner's argument ``at``
                def run(*a, **kw):
                    masks_seen.append(a[at].block_mask)
                    return fn(*a, **kw)
                return run
            attn._ulysses, attn._ring = seeing(attn._ulysses, 3), seeing(attn._ring, 4)
            for i, mask in enumerate((random_mask(3 + n, h, t, keep=0.4), window_mask(t).expand(h, t, t))):
                masks_seen.clear()
                ran.clear()
                check_case(lambda q, k, v, m=mask: attn(q, k, v, causal=causal, block_mask=m, block_size=bs), rank,
                           world, s=s, h=h, hkv=hkv, d=8, bs=bs, block_mask=mask, causal=causal,
                           placement=placement, seed=n)
                # the first mask calibrates every candidate (with the mask), then runs the pick; the second, of the
                # same shape, reuses the choice
                assert (set(ran[:-1]) == set(picks) if i == 0 else ran[:-1] == []) and ran[-1] == pick, (pick, ran)
                # every call, the calibration's too, ran with this mask's values (the calibration on its own copies)
                assert len(masks_seen) == len(ran) and all(m is not None and torch.equal(m, mask) for m in masks_seen)
                assert i == 1 or all(m is not mask for m in masks_seen[:-1])
                n += 1
            assert len(policy.cache) == 1 and any("block_mask" in key for key in policy.cache)
            # another tile size with a mask of the same shape: calibrated again (the tile size is in the key)
            ran.clear()
            bs2 = 8
            assert bsp.num_tiles(s, bs2) == t
            m2 = window_mask(t).expand(h, t, t)
            check_case(lambda q, k, v: attn(q, k, v, causal=causal, block_mask=m2, block_size=bs2),
                       rank, world, s=s, h=h, hkv=hkv, d=8, bs=bs2, block_mask=m2, causal=causal,
                       placement=placement, seed=n)
            assert set(ran[:-1]) == set(picks) and len(policy.cache) == 2
            n += 1
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_auto_block_mask_every_branch_matches_float64(world):
    """#69 item 3: auto picks the mode per block-sparse call shape (Ulysses/HCMS, the ring with its skip tables,
    TASP), timed with the call's mask."""
    assert run_ranks(_forced_branches_block_mask, world, timeout=300)[0] == 2 * (2 + (world > 2)) * 3
