"""The video DiT under dynamic sequence parallelism (--dynamic-context-parallel), CPU / gloo, float64.

A mixed pack (single images, short and long clips of different latent sizes) run with each sample on its own
aligned sub-group (megatron_sp_ext.sp.dynamic) gives the loss and EVERY parameter gradient of SP=1 on the same pack:
at P=2 and P=4, for ulysses, hcms, ring and usp, with hand-written plans that mix samples on one rank, on pairs and
on all ranks (lengths that do not divide by their sub-group: padding rows), and with the packer's own plan.
"""
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron_sp_ext.config import SPConfig  # noqa: E402
from megatron_sp_ext.sp.dynamic import CostModel, DynamicPlan, plan_pack  # noqa: E402
from tests.harness import RankFailure, run_ranks  # noqa: E402
from tests.reference import rel_err  # noqa: E402
from tests.sp_reduce import loss_and_grads  # noqa: E402
from tests.dit_models import modulated_dit  # noqa: E402
from training.video_dit import preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.dynamic import make_dynamic_core  # noqa: E402
from training.video_dit.engine import local_loss, make_core  # noqa: E402
from training.video_dit.packing import packed_batch, packed_host_inputs  # noqa: E402
from training.video_dit.pipeline import to_device  # noqa: E402

CFG = preset("tiny")
# sample i: frames[i % 5] x sizes[i % 3]: tokens 8, 45, 64, 8, 90, 16, 24 (images of 4x8 and 8x8 latents, clips of
# 3-6 frames of 4x8, 6x10 and 8x8 latents; 45 divides by neither 2 nor 4)
FRAMES, SIZES = [1, 3, 4, 1, 6], [(4, 8), (6, 10), (8, 8)]
IDS = [0, 1, 2, 3, 4, 5, 6]


def _data():
    return SyntheticVideoLatents(CFG.in_channels, FRAMES, 4, 8, CFG.text_len, CFG.text_dim, seed=1, sizes=SIZES)


def _model():
    return modulated_dit(CFG).double()


def _step(core, group, rank, world, plan=None):
    model = _model()
    model.set_attention_core(core)
    batch = packed_batch(_data(), IDS, 7, CFG.patch)
    inp = to_device(packed_host_inputs(batch, rank, world, plan), "cpu")
    inp.x, inp.target, inp.t, inp.text = (t.double() for t in (inp.x, inp.target, inp.t, inp.text))
    return loss_and_grads(model, local_loss(model, inp), group), batch


def _tokens():
    cu = packed_batch(_data(), IDS, 7, CFG.patch)["cu_seqlens"]
    return [b - a for a, b in zip(cu, cu[1:])]


def _plans(world):
    n = _tokens()  # [8, 45, 64, 8, 90, 16, 24]
    if world == 2:
        hand = DynamicPlan(2, tuple(n), (1, 2, 2, 1, 2, 1, 1), (0, 0, 0, 1, 0, 1, 0))
    else:
        hand = DynamicPlan(4, tuple(n), (1, 2, 4, 1, 4, 2, 1), (0, 2, 0, 1, 0, 0, 3))
    return [hand, plan_pack(n, world, cost=CostModel())]  # attention-only work: the long clips get split


def _check(got, ref, what):
    (loss, grads), (rloss, rgrads) = got, ref
    assert abs(loss - rloss) <= 1e-10 * abs(rloss), f"{what}: loss {loss} vs SP=1 {rloss}"
    for i, (g, r) in enumerate(zip(grads, rgrads)):
        # 1e-6: the model's RMS norms compute in float32 (fused.rms_norm), which turns float64's 1e-16 differences
        # of summation order into ~1e-8 (uniform SP on the same pack: 1.4e-7); a wrong attention is off by >1e-2
        assert rel_err(g, r) < 1e-6, f"{what}: grad {i} rel err {rel_err(g, r)}"


def _every_mode(rank, world):
    g = dist.group.WORLD
    ref, _ = _step(make_core("ulysses", None, num_heads=CFG.heads), None, 0, 1)
    plans = _plans(world)
    assert len(set(plans[0].sizes)) == (2 if world == 2 else 3) and any(
        n % d for n, d in zip(plans[0].lengths, plans[0].sizes)), plans
    usp = {"ulysses_size": 2}
    checked = 0
    for mode, kw in [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {}), ("usp", usp)]:
        core = make_dynamic_core(SPConfig(mode=mode, **kw), g, num_heads=CFG.heads)
        for k, plan in enumerate(plans):
            got, _ = _step(core, g, rank, world, plan)
            _check(got, ref, f"P={world} {mode} plan {k} {plan}")
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_dynamic_step_equals_sp1(world):
    assert run_ranks(_every_mode, world, timeout=400) == [8] * world


# ---- both entry points: switched on as users expect, refused by name, checkpoints across dynamic and fixed SP ----

ARGS = ["--model", "tiny", "--frames", "1,3,4,1,6", "--latent-size", "4x8,6x10,8x8", "--quiet"]
PACK = ("--pack-samples", "--max-tokens-per-step", "160")
DYN = ("--dynamic-context-parallel",)


def _mg(rank, world, extra=(), mode="ulysses"):
    from training import pretrain_video_dit
    return pretrain_video_dit.main([*ARGS, "--context-parallel-size", str(world), "--cp-comm-type", mode, *extra])


def _ds(rank, world, extra=(), dynamic=True):
    from training import train_deepspeed
    cfg = {"sequence_parallel_size": world, "zero_optimization": {"stage": 1},
           "sequence_parallel_ext": {"mode": "ring", "dynamic": dynamic}}
    return train_deepspeed.main([*ARGS, *extra], config=cfg)


def test_entries_dynamic_equal_sp1():
    """4 real steps: CP=2 dynamic (megatron-core entry, ring; DeepSpeed JSON "dynamic": true, ring) gives the
    same entry's SP=1 losses on the same packs (each entry its own optimizer)."""
    steps = ("--train-iters", "4", *PACK)
    for entry, flags in ((_mg, (*steps, *DYN)), (_ds, steps)):
        sp1 = run_ranks(lambda r, w: entry(r, w, steps)["losses"], 1)[0]
        kw = {"mode": "ring"} if entry is _mg else {}
        got = run_ranks(lambda r, w: entry(r, w, flags, **kw), 2)[0]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got["losses"], sp1)) and len(sp1) == 4, \
            (entry.__name__, got["losses"], sp1)


def test_checkpoint_resume_across_dynamic_and_fixed(tmp_path):
    """Saved under dynamic SP and resumed under fixed SP (and the other way round): the resumed steps give the
    uninterrupted run's losses (the checkpoint holds full parameters; the sample stream continues)."""
    steps = ("--train-iters", "4", *PACK)
    whole = run_ranks(lambda r, w: _mg(r, w, steps)["losses"], 1)[0]
    for first, then in ((DYN, ()), ((), DYN)):
        ck = str(tmp_path / f"ck{len(first)}")
        a = run_ranks(lambda r, w: _mg(r, w, ("--train-iters", "2", *PACK, *first, "--save", ck))["losses"], 2)[0]
        b = run_ranks(lambda r, w: _mg(r, w, ("--train-iters", "4", *PACK, *then, "--load", ck))["losses"], 2)[0]
        got = a + b
        assert len(got) == 4 and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(got, whole)), (first, got, whole)


@pytest.mark.parametrize("flags,match", [
    (DYN, "--dynamic-context-parallel places each sample of a packed step on its own ranks: add --pack-samples"),
    (PACK + DYN + ("--cp-comm-type", "torus"), "--cp-comm-type='torus' cannot run with --dynamic-context-parallel"),
    (PACK + DYN + ("--min-dynamic-context-parallel-size", "3"),
     "--min-dynamic-context-parallel-size=3 is invalid: use a divisor of --context-parallel-size 4"),
    (PACK + ("--min-dynamic-context-parallel-size", "2"),
     "--min-dynamic-context-parallel-size applies to --dynamic-context-parallel: add it"),
])
def test_entry_refusals(flags, match, capsys, monkeypatch):
    from training import pretrain_video_dit
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as e:
        pretrain_video_dit.parse([*ARGS, "--context-parallel-size", "4", "--cp-comm-type", "ulysses", *flags])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_deepspeed_refuses_dynamic_without_packing():
    with pytest.raises(RankFailure, match=r"sequence_parallel_ext.dynamic=true places each sample .* add "
                                          r"--pack-samples"):
        run_ranks(lambda r, w: _ds(r, w, ("--train-iters", "1")), 2)


def test_dynamic_with_fsdp2_and_data_parallel():
    """FSDP2 (parameters sharded over data x context ranks) and DP=2 x CP=2 under dynamic SP give the losses of the
    same runs without context parallelism (Megatron-LM's version refuses FSDP; ours does not need to)."""
    from training import pretrain_video_dit
    steps = ("--train-iters", "3", *PACK)

    def run(cp, extra):
        return lambda r, w: pretrain_video_dit.main([*ARGS, "--context-parallel-size", str(cp), "--cp-comm-type",
                                                     "ulysses", *steps, *extra])["losses"]
    fsdp = ("--use-torch-fsdp2",)
    ref = run_ranks(run(1, fsdp), 1)[0]
    got = run_ranks(run(2, (*fsdp, *DYN)), 2)[0]
    assert len(got) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref)), ("fsdp2", got, ref)
    ref = run_ranks(run(1, ()), 2)[0]  # DP=2
    got = run_ranks(run(2, DYN), 4)[0]  # DP=2 x CP=2
    assert len(got) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref)), ("dp2 x cp2", got, ref)


def _two_sp_groups(rank, world):
    """8 ranks as DP=2 x SP=4 (SP groups {0,2,4,6} and {1,3,5,7}): every process creates every SP group's pairs; each
    rank's sub-groups hold the right ranks, and a plan with pairs and single ranks runs in both SP groups at once."""
    from megatron_sp_ext.sp.dynamic import DynamicAttention, DynamicGroups, shard_dynamic
    from tests.reference import make_qkv, reference_attention
    mine = [r for r in range(world) if r % 2 == rank % 2]
    groups = [dist.new_group(list(range(p, world, 2))) for p in (0, 1)]
    sp = groups[rank % 2]
    dyn = DynamicGroups(sp)
    pair = dyn.get(dyn.rank // 2 * 2, 2)
    assert dist.get_process_group_ranks(pair) == mine[dyn.rank // 2 * 2: dyn.rank // 2 * 2 + 2]
    plan = DynamicPlan(4, (6, 9, 5, 7), (1, 2, 1, 4), (0, 2, 1, 0))
    q, k, v, _ = make_qkv(rank % 2, 1, 27, 4, 4, 8, torch.float64)
    out = DynamicAttention(SPConfig(mode="ulysses"), dyn, num_heads=4)(
        *(shard_dynamic(t, plan, dyn.rank) for t in (q, k, v)), plan)
    mask = torch.zeros(27, 27, dtype=torch.bool)
    for a, b in zip(plan.cu_seqlens, plan.cu_seqlens[1:]):
        mask[a:b, a:b] = True
    real = shard_dynamic(torch.ones(1, 27, 1, 1), plan, dyn.rank) > 0
    assert rel_err(out * real, shard_dynamic(reference_attention(q, k, v, mask=mask), plan, dyn.rank)) < 1e-10
    return True


def test_sub_groups_of_several_sp_groups():
    assert all(run_ranks(_two_sp_groups, 8, timeout=300))


def test_plan_logged_once_in_words():
    import logging
    from training.video_dit.dynamic import DynamicSP, PlanLog
    dyn = DynamicSP(8, preset("wan-14b"))
    plan = dyn.plan([0, 1560, 3120, 43120, 83120, 84680, 86240, 87800, 89360, 90920, 92480])
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    logger, keep = logging.getLogger("video_dit"), Keep()
    logger.addHandler(keep)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        log = PlanLog(True, dyn.cost)
        for _ in range(3):
            log.see(plan)
    finally:
        logger.removeHandler(keep)
        logger.setLevel(old)
    assert len(seen) == 1 and seen[0].startswith("dynamic SP over 8 ranks: "), seen
    assert seen[0].endswith("(first pack; each step's pack gets its own plan)")


# ---- sampling after a dynamic run: unpacked clips run the uniform SP attention of the same settings ----

def _sample_dynamic_vs_sp1(rank, world):
    """sample_latents through the dynamic core (ulysses, hcms, ring; 45 tokens: padded) equals SP=1 sampling (fp32),
    and the attention matters for the result (a rank-local model's sample differs)."""
    from tests.test_sample import sample_model
    from training.video_dit.sample import sample_latents
    data = SyntheticVideoLatents(CFG.in_channels, [3], 6, 10, CFG.text_len, CFG.text_dim, seed=1)
    text = torch.stack([data[i]["text"] for i in (0, 1)])
    shape = (CFG.in_channels, 3, 6, 10)
    ref = sample_latents(sample_model(None, "ulysses"), text, shape, steps=3, seed=11)
    errs = []
    for mode, kw in [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {})]:
        model = sample_model(None, "ulysses")
        model.set_attention_core(make_dynamic_core(SPConfig(mode=mode, **kw), dist.group.WORLD, num_heads=CFG.heads))
        out = sample_latents(model, text, shape, steps=3, seed=11, group=dist.group.WORLD)
        errs.append((out - ref).abs().max().item())
        assert errs[-1] < 1e-5, f"dynamic {mode} P={world}: max |sample - SP1| = {errs[-1]}"
    from tests.test_sample import rank_local_model
    local = sample_latents(rank_local_model(), text, shape, steps=3, seed=11, group=dist.group.WORLD)
    assert (local - ref).abs().max().item() > 1e-3, "attention does not influence the sample"
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_dynamic_core_samples_equal_sp1(world):
    assert len(run_ranks(_sample_dynamic_vs_sp1, world, timeout=120)) == world


def test_entries_sample_after_dynamic_run(tmp_path):
    """Both entries train 2 dynamic steps at CP=2 and then sample (--sample-steps): samples.png is written (the
    sampler's unpacked clips ran through the dynamic core)."""
    for entry in (_mg, _ds):
        log_dir = tmp_path / entry.__name__
        flags = ("--train-iters", "2", *PACK, "--sample-steps", "2", "--log-dir", str(log_dir))
        flags = (*flags, *DYN) if entry is _mg else flags
        got = run_ranks(lambda r, w: entry(r, w, flags), 2, timeout=120)[0]
        assert len(got["losses"]) == 2 and (log_dir / "samples.png").is_file(), (entry.__name__, got["losses"])
