"""Dynamic SP's Ulysses path on FlashAttention-4 in bf16, on the CPU stand-in (tests/fake_fa4.py, strict where the
real interface is): the tiny DiT's packed step with a hand-written plan (samples on one rank, on pairs, on all ranks;
padding rows) under bf16 autocast, against SP=1 on the same stand-in, each against SP=1 in fp32. Every parameter's
gradient error must stay within 1.5x SP=1's own bf16 error of that parameter (plus a small floor): the bf16
rounding, not the plan, sets it. Also: FA4's backward ran, and every out it got was in its own [B, S, H, D] order.

Written after the CUDA family dit_dynamic missed on 2 x H100 (FA4 4.0.0b36; ulysses/hcms bf16: dq off, worst
blocks.1.attn.norm_q.weight 5.9e-2 vs SP=1's 1.3e-2); this CPU test does NOT reproduce that miss (see
docs/dynamic_sp.md), it pins what the glue hands the kernel.
"""
import collections

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_sp_ext.config import SPConfig  # noqa: E402
from megatron_sp_ext.sp.dynamic import DynamicPlan  # noqa: E402
from tests import fake_fa4  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.gpu.cuda_dit_dynamic import SP1_BF16_CAP  # noqa: E402
from tests.reference import rel_diff, rel_err  # noqa: E402
from tests.dit_models import modulated_dit  # noqa: E402
from tests.sp_reduce import loss_and_grads  # noqa: E402
from tests.gpu.suite_judge import checked_reference_err  # noqa: E402
from training.video_dit import preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.dynamic import make_dynamic_core  # noqa: E402
from training.video_dit.engine import local_loss, make_core  # noqa: E402
from training.video_dit.packing import packed_batch, packed_host_inputs  # noqa: E402
from training.video_dit.pipeline import to_device  # noqa: E402

CFG = preset("tiny")
FRAMES, SIZES = [1, 3, 4, 1, 6], [(4, 8), (6, 10), (8, 8)]   # tokens 8, 45, 64, 8, 90, 16, 24
IDS = [0, 1, 2, 3, 4, 5, 6]
PLANS = {2: ((1, 2, 2, 1, 2, 1, 1), (0, 0, 0, 1, 0, 1, 0)), 4: ((1, 2, 4, 1, 4, 2, 1), (0, 2, 0, 1, 0, 0, 3))}
FLOOR = 2e-3   # per-parameter slack on top of 1.5x SP=1's bf16 error (parameters whose bf16 error is tiny)


def _data():
    return SyntheticVideoLatents(CFG.in_channels, FRAMES, 4, 8, CFG.text_len, CFG.text_dim, seed=1, sizes=SIZES)


def _step(core, group, rank, world, autocast, plan=None):
    torch.manual_seed(0)
    model = modulated_dit(CFG)
    model.set_attention_core(core)
    inp = to_device(packed_host_inputs(packed_batch(_data(), IDS, 7, CFG.patch), rank, world, plan), "cpu")
    return loss_and_grads(model, local_loss(model, inp, autocast), group)


def _family(rank, world, fake, modes):
    import torch.distributed as dist
    g = dist.group.WORLD
    cu = packed_batch(_data(), IDS, 7, CFG.patch)["cu_seqlens"]
    plan = DynamicPlan(world, tuple(b - a for a, b in zip(cu, cu[1:])), *PLANS[world])
    ref = _step(make_core("ulysses", None, num_heads=CFG.heads, backend="auto"), None, 0, 1, None)
    sp1 = _step(make_core("ulysses", None, num_heads=CFG.heads, backend="auto"), None, 0, 1, torch.bfloat16)
    n_sp1 = len(fake.calls)
    out = {"sp1": [rel_err(a, b) for a, b in zip(sp1[1], ref[1])],
           "sp1_loss": rel_diff(sp1[0], ref[0]), "sp1_fa4": n_sp1}
    for mode, kw in modes:
        core = make_dynamic_core(SPConfig(mode=mode, backend="auto", **kw), g, num_heads=CFG.heads)
        start, logged = len(fake.calls), len(fake.calls_log)
        loss, grads = _step(core, g, rank, world, torch.bfloat16, plan)
        out[mode + str(kw.get("head_chunks", ""))] = {
            "grads": [rel_err(a, b) for a, b in zip(grads, ref[1])], "loss": rel_diff(loss, ref[0]),
            "calls": collections.Counter(c[0] for c in fake.calls[start:]),
            "out_orders": collections.Counter(d["out_own_order"] for d in fake.calls_log[logged:])}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_dynamic_ulysses_bf16_on_fa4_matches_sp1_on_fa4(monkeypatch, world):
    fake = fake_fa4.install(monkeypatch, dtypes=(torch.bfloat16,))
    modes = [("ulysses", {}), ("hcms", {"head_chunks": 2})]
    names = [n for n, _ in modulated_dit(CFG).named_parameters()]
    res = run_ranks(_family, world, fake, modes, timeout=300)
    for r in res:
        assert r["sp1_fa4"] > 0, "SP=1 did not run on the FA4 stand-in"
        # the SP=1 errors set the tolerances: each finite and <= SP1_BF16_CAP (an inf one would pass anything)
        for name, e in [("loss", r["sp1_loss"])] + list(zip(names, r["sp1"])):
            checked_reference_err(e, SP1_BF16_CAP, f"SP=1 bf16 {name} on the FA4 stand-in")
        for key in ("ulysses", "hcms2"):
            got = r[key]
            assert got["calls"]["bwd"] > 0, f"{key}: FA4's backward never ran"
            assert set(got["out_orders"]) == {True}, f"{key}: FA4's backward got out in another order"
            assert got["loss"] <= 1.5 * r["sp1_loss"] + 1e-4
            bad = [(names[i], e, s) for i, (e, s) in enumerate(zip(got["grads"], r["sp1"]))
                   if not e <= 1.5 * s + FLOOR]  # not "e > ...": a NaN would pass that
            assert not bad, f"{key}: gradients past 1.5x SP=1's bf16 error: {bad}"
