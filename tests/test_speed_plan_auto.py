"""``auto`` on a group across machines (issue 84 item 4: sp/factory.py's hook into speed_plan.auto.AutoRanker): the
speed plan ranks the candidates, only those it cannot separate are timed, the pick and its predicted time are logged
once, and whatever runs equals the float64 reference (output and every input gradient). Machines from ``nodes``
(``--sp-nodes``) and from the emulation (``SPX_EMULATED_MACHINE_SIZE``); inside one machine nothing is narrowed."""
import logging

import pytest
import torch
import torch.distributed as dist

from megatron_sp_ext import modes
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.sp.calibration import ModePolicy
from megatron_sp_ext.sp.factory import SPResources, make_attention
from megatron_sp_ext.sp.speed_plan.auto import shape_of
from tests.harness import run_ranks
from tests.sp_check import run_case

H, D, B = 8, 8, 1


def _auto_across(rank, world, nodes, margin):
    group = dist.group.WORLD
    s = 6 * world
    timed, said = [], []

    def timer(fn, iters, warmup, group_):
        timed.append(fn.mode)
        fn()
        return 1.0
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("megatron_sp_ext").addHandler(handler)
    logging.getLogger("megatron_sp_ext").setLevel(logging.INFO)
    cfg = SPConfig(mode="auto", head_chunks=1, nodes=nodes)
    policy = ModePolicy(timer=timer, timed_devices=("cpu",), rounds=3, warmup=1)
    attn = make_attention(cfg, group, num_heads=H, layout="bshd", placement="contiguous",
                          resources=SPResources(cfg, mode_policy=policy))
    attn.res.speed_plan.margin = margin
    served = []
    uly, ring = attn._ulysses, attn._ring
    attn._ulysses = lambda *a, **kw: served.append(attn.mode) or uly(*a, **kw)
    attn._ring = lambda q, k, v, variant, *a, **kw: served.append(variant) or ring(q, k, v, variant, *a, **kw)
    run_case(lambda q, k, v: attn(q, k, v, causal=False), rank, world, b=B, s=s, h=H, hkv=H, d=D,
             dtype=torch.float32, causal=False)
    cluster = attn.res.speed_plan.cluster(group, nodes)
    shape = shape_of((B, s // world, H, D), (B, s // world, H, D), "bshd", world, False, 1, None, "")
    names = [attn.mode] + list(modes.names(ring_variant=True))
    kept, _ = attn.res.speed_plan.narrow({n: None for n in names}, shape, cluster)
    logging.getLogger("megatron_sp_ext").removeHandler(handler)
    return (None if cluster is None else (cluster.machines, cluster.per_machine)), sorted(set(timed)), list(kept), \
        served[-1], [m for m in said if "speed plan" in m]


@pytest.mark.parametrize("nodes,margin", [(2, 0.0), (2, 10.0), (None, 0.0)])
def test_auto_across_machines_times_only_what_the_plan_cannot_separate(monkeypatch, nodes, margin):
    if nodes is None:
        monkeypatch.setenv("SPX_EMULATED_MACHINE_SIZE", "2")
    out = run_ranks(_auto_across, 4, nodes, margin, timeout=300)
    assert all(o[:4] == out[0][:4] for o in out)   # one decision on every rank
    machines, timed, kept, served, said = out[0]
    assert machines == (2, 2)
    if len(kept) == 1:   # the plan separated one: nothing timed, the plan's pick ran
        assert timed == [] and served == kept[0]
    else:                # the rest is timed, and only that
        assert timed == sorted(kept) and served in kept
    assert len(kept) == (1 if margin == 0.0 else 3)
    assert len(said) == 1 and "speed plan on 2 x 2 GPUs" in said[0] and f"auto picked {served}" in said[0]


def _one_machine(rank, world):
    timed = []

    def timer(fn, iters, warmup, group_):
        timed.append(fn.mode)
        fn()
        return 1.0
    cfg = SPConfig(mode="auto", head_chunks=1)
    attn = make_attention(cfg, dist.group.WORLD, num_heads=H, layout="bshd", resources=SPResources(
        cfg, mode_policy=ModePolicy(timer=timer, timed_devices=("cpu",), rounds=3, warmup=1)))
    run_case(lambda q, k, v: attn(q, k, v, causal=True), rank, world, b=B, s=6 * world, h=H, hkv=H, d=D,
             dtype=torch.float32, causal=True)
    return attn.mode, sorted(set(timed))


def test_auto_inside_one_machine_times_every_candidate():
    mode, timed = run_ranks(_one_machine, 4)[0]
    assert timed == sorted([mode] + list(modes.names(ring_variant=True)))


def _plan_off(rank, world):
    timed = []

    def timer(fn, iters, warmup, group_):
        timed.append(fn.mode)
        fn()
        return 1.0
    cfg = SPConfig(mode="auto", head_chunks=1, nodes=2)
    res = SPResources(cfg, mode_policy=ModePolicy(timer=timer, timed_devices=("cpu",), rounds=3, warmup=1))
    res.speed_plan = None
    attn = make_attention(cfg, dist.group.WORLD, num_heads=H, layout="bshd", resources=res)
    run_case(lambda q, k, v: attn(q, k, v, causal=False), rank, world, b=B, s=6 * world, h=H, hkv=H, d=D,
             dtype=torch.float32, causal=False)
    return attn.mode, sorted(set(timed))


def test_auto_across_machines_with_the_plan_off_times_every_candidate():
    mode, timed = run_ranks(_plan_off, 4)[0]
    assert timed == sorted([mode] + list(modes.names(ring_variant=True)))
