"""The video DiT on PACKED mixed-size samples (--pack-samples, issue #36 item 4), CPU / gloo, fp32.

A packed step (clips of different frame counts AND latent sizes in one sequence, B=1, cu_seqlens) gives
the average of one-sample-at-a-time runs of the same samples: the loss and every parameter gradient, at
SP=1 (local per-sample attention), SP=2 (Ulysses, HCMS, auto; the sequence sharded per sample as
``shard_sequence(cu_seqlens=)`` does) and SP=4 (every mode), with recompute and with the compiled elementwise
regions. Both entry points: a packed step's loss at lr 0 equals the mean of unpacked steps over the same
samples (SP=2, and DP=2: the mean over packs); SP=2 equals SP=1 over 4 real steps; a packed run resumes
exactly; on-disk shards of differing shapes train as the synthetic ones; clips whose token count does not divide
by the SP size are padded per sample and give the same loss and gradients. Refusals name the flag.
"""
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

import megatron_sp_ext as spx  # noqa: E402
from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from tests.harness import RankFailure, run_ranks  # noqa: E402
from tests.reference import rel_err  # noqa: E402
from tests.sp_reduce import loss_and_grads  # noqa: E402
from tests.dit_models import modulated_dit  # noqa: E402
from training.video_dit import preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.engine import flow_matching_batch, local_loss, make_core, prepare  # noqa: E402
from training.video_dit.model import patchify, unpatchify_packed  # noqa: E402
from training.video_dit.packing import PackPlan, packed_batch, packed_host_inputs  # noqa: E402
from training.video_dit.pipeline import to_device  # noqa: E402

CFG = preset("tiny")
# frames cycle 4,2,6 and sizes 4x8, 6x10 independently: tokens 32, 30, 48, 60, 16, 90 (all even: SP=2 works)
FRAMES, SIZES = [4, 2, 6], [(4, 8), (6, 10)]
BUDGET = 120  # pack 0 = samples 0, 1, 2 (32 + 30 + 48 = 110 tokens: three token counts, two grids)


def _data(frames=FRAMES, sizes=SIZES):
    return SyntheticVideoLatents(CFG.in_channels, frames, 4, 8, CFG.text_len, CFG.text_dim, seed=1, sizes=sizes)


def _model():
    return modulated_dit(CFG)


def _one_at_a_time(ids, data=None):
    """Reference: each sample alone (SP=1, unpacked), loss and gradients averaged over the samples."""
    model, data = _model(), data or _data()
    loss, grads = 0.0, [torch.zeros_like(p) for p in model.parameters()]
    for i in ids:
        model.zero_grad(set_to_none=True)
        lo = local_loss(model, prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch, base=i), 0, 1, "cpu"))
        lo.backward()
        loss += lo.item() / len(ids)
        for g, p in zip(grads, model.parameters()):
            g += p.grad / len(ids)
    return loss, grads


def _packed(group, ids, mode="ulysses", recompute=None, fused=None, data=None, **kw):
    """The packed step of samples ``ids`` on this rank: (SP-summed loss, SP-averaged gradients, inputs)."""
    sp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    model, data = _model(), data or _data()
    model.set_attention_core(make_core(mode, group, num_heads=CFG.heads, **kw))
    model.set_recompute(recompute, ["core_attn", "mlp"] if recompute == "selective" else ["core_attn"])
    model.set_fused_elementwise(fused)
    batch = packed_batch(data, ids, 7, CFG.patch)
    inp = to_device(packed_host_inputs(batch, rank, sp), "cpu")
    loss, grads = loss_and_grads(model, local_loss(model, inp), group)
    return loss, grads, batch, inp


def _check(got, ref, what):
    loss, grads = got[0], got[1]
    assert abs(loss - ref[0]) <= 2e-6 * abs(ref[0]), f"{what}: loss {loss} vs one-at-a-time {ref[0]}"
    for i, (g, r) in enumerate(zip(grads, ref[1])):
        assert rel_err(g, r) < 2e-5, f"{what}: grad {i} rel err {rel_err(g, r)}"


def test_plan_packs_mixed_sizes():
    plan = PackPlan(_data(), BUDGET, CFG.patch)
    assert [plan.tokens(i) for i in range(6)] == [32, 30, 48, 60, 16, 90]
    assert [plan.pack(k) for k in range(3)] == [[0, 1, 2], [3, 4], [5]]  # 60 + 16 (+ 90 > 120); 90 (+ 32 > 120)
    assert plan.consumed_samples(2, 1) == 5 and plan.index(3, 1, 2) == 7
    resumed = PackPlan(_data(), BUDGET, CFG.patch, first=plan.first_sample(2), start_step=2)
    assert resumed.pack(resumed.index(2, 0, 1)) == plan.pack(2)


def test_packed_step_equals_one_at_a_time_sp1():
    ids = PackPlan(_data(), BUDGET, CFG.patch).pack(0)
    ref = _one_at_a_time(ids)
    got = _packed(None, ids)
    assert len({b - a for a, b in zip(got[2]["cu_seqlens"], got[2]["cu_seqlens"][1:])}) == 3
    _check(got, ref, "SP=1")
    _check(_packed(None, ids, recompute="full"), ref, "SP=1 full recompute")
    _check(_packed(None, ids, fused="aot_eager"), ref, "SP=1 compiled elementwise regions (aot_eager)")
    # per-sample unpatchify rebuilds each clip of the packed target
    data = _data()
    clips = unpatchify_packed(got[2]["x"], CFG.patch, CFG.in_channels, got[2]["cu_seqlens"], got[2]["grids"])
    for i, clip in zip(ids, clips):
        assert clip.shape == data[i]["latent"].shape
        assert torch.equal(patchify(clip[None], CFG.patch), got[2]["x"][:, got[2]["cu_seqlens"][ids.index(i)]:
                                                                       got[2]["cu_seqlens"][ids.index(i) + 1]])


def _sp2(rank, world):
    g = dist.group.WORLD
    plan = PackPlan(_data(), BUDGET, CFG.patch, sp_world=world)
    for k in (0, 1):
        ids = plan.pack(k)
        ref = _one_at_a_time(ids)
        got = _packed(g, ids)
        cu = torch.tensor(got[2]["cu_seqlens"], dtype=torch.int32)
        assert torch.equal(got[3].x, spx.shard_sequence(got[2]["x"], g, cu_seqlens=cu))  # the library's placement
        _check(got, ref, f"SP=2 ulysses pack {k}")
    ids = plan.pack(0)
    ref = _one_at_a_time(ids)
    _check(_packed(g, ids, "hcms", head_chunks=2), ref, "SP=2 hcms C=2")
    _check(_packed(g, ids, "auto"), ref, "SP=2 auto")
    _check(_packed(g, ids, recompute="selective"), ref, "SP=2 selective recompute")
    # token counts that do not divide by P (45, 75, 15): each sample padded at its tail (zero loss weight)
    odd = _data([3, 5, 1], [(6, 10)])
    ref = _one_at_a_time([0, 1, 2], odd)
    got = _packed(g, [0, 1, 2], data=odd)
    cu = torch.tensor(got[2]["cu_seqlens"], dtype=torch.int32)
    assert torch.equal(got[3].x, spx.shard_sequence(got[2]["x"], g, cu_seqlens=cu))  # the library's padding
    assert got[3].x.shape[1] == (46 + 76 + 16) // world  # padding rows at each sample's tail: on the last rank
    assert int(got[3].valid.sum()) == (23 + 38 + 8 if rank == 0 else 22 + 37 + 7), got[3].valid
    _check(got, ref, "SP=2 ulysses, samples padded")
    _check(_packed(g, [0, 1, 2], "ring", data=odd), ref, "SP=2 ring, samples padded")
    return True


def test_packed_step_equals_one_at_a_time_sp2():
    assert all(run_ranks(_sp2, 2))


def _sp4_every_mode(rank, world):
    data = _data([8, 4, 6], [(8, 8), (6, 10), (4, 8)])  # 128, 60, 48 tokens: each divisible by 4
    ref = _one_at_a_time([0, 1, 2], data)
    mesh = {"nodes": 2, "ulysses_size": 2}
    for mode, kw in [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {}), ("tasp", {}), ("usp", mesh),
                     ("tas", mesh), ("torus", {**mesh, "placement": "tas"}), ("auto", {})]:
        _check(_packed(dist.group.WORLD, [0, 1, 2], mode, data=data, **kw), ref, f"SP=4 {mode}")
    odd = _data([3, 5, 1], [(6, 10)])  # 45, 75, 15 tokens: padded to 48, 76, 16
    ref = _one_at_a_time([0, 1, 2], odd)
    for mode, kw in [("hcms", {"head_chunks": 2}), ("tasp", {}), ("usp", mesh), ("torus", {**mesh, "placement": "tas"})]:
        _check(_packed(dist.group.WORLD, [0, 1, 2], mode, data=odd, **kw), ref, f"SP=4 {mode}, samples padded")
    return True


def test_packed_step_every_mode_sp4():
    """Every --cp-comm-type mode takes the packed step (the factory runs cu_seqlens per sample)."""
    assert all(run_ranks(_sp4_every_mode, 4))


def test_plan_refusals():
    with pytest.raises(SPConfigError, match=r"--max-tokens-per-step=40: synthetic sample 2 alone has 48"):
        PackPlan(_data(), 40, CFG.patch).pack(2)


# ---- both entry points ----

ARGS = ["--model", "tiny", "--frames", "4,2,6", "--latent-size", "4x8,6x10", "--quiet"]
PACK = ("--pack-samples", "--max-tokens-per-step", str(BUDGET))


def _mg(rank, world, extra=()):
    from training import pretrain_video_dit
    return pretrain_video_dit.main([*ARGS, "--context-parallel-size", str(world), "--cp-comm-type", "ulysses",
                                    *extra])


def _ds(rank, world, extra=()):
    from training import train_deepspeed
    cfg = {"sequence_parallel_size": world, "zero_optimization": {"stage": 1},
           "sequence_parallel_ext": {"mode": "hcms", "head_chunks": 2}}
    return train_deepspeed.main([*ARGS, *extra], config=cfg)  # the built-in config: AdamW at --lr


@pytest.mark.parametrize("entry", [_mg, _ds])
def test_entry_packed_step_is_mean_of_single_steps(entry):
    """lr 0: a packed step's loss is the mean of the unpacked steps' losses over the same samples; SP=2."""
    single = run_ranks(lambda r, w: entry(r, w, ("--train-iters", "5", "--lr", "0"))["losses"], 1)[0]
    res = run_ranks(lambda r, w: entry(r, w, ("--train-iters", "2", "--lr", "0", *PACK))["rows"], 2)[0]
    packed = [row["loss"] for row in res]
    expect = [sum(single[:3]) / 3, sum(single[3:5]) / 2]  # packs [0, 1, 2] and [3, 4]
    for a, b in zip(packed, expect):
        assert abs(a - b) <= 1e-5 * abs(b), (packed, expect)
    assert [row["samples"] for row in res] == [3, 2] and [row["tokens"] for row in res] == [110, 76]


def test_megatron_entry_packed_sp2_matches_sp1_and_resumes(tmp_path):
    steps = ("--train-iters", "4", *PACK)
    sp1 = run_ranks(lambda r, w: _mg(r, w, steps)["losses"], 1)[0]
    sp2 = run_ranks(lambda r, w: _mg(r, w, steps)["losses"], 2)[0]
    for a, b in zip(sp2, sp1):
        assert abs(a - b) <= 1e-5 * abs(b), (sp2, sp1)
    ck = str(tmp_path / "ck")
    first = run_ranks(lambda r, w: _mg(r, w, ("--train-iters", "2", *PACK, "--save", ck))["losses"], 2)[0]
    rest = run_ranks(lambda r, w: _mg(r, w, ("--train-iters", "4", *PACK, "--load", ck))["losses"], 2)[0]
    assert first + rest == sp2, (first, rest, sp2)


@pytest.mark.parametrize("flags,match", [
    (PACK[:1], "--pack-samples needs --max-tokens-per-step"),
    (("--max-tokens-per-step", "100"), "--max-tokens-per-step is the budget of a packed step: add --pack-samples"),
    (PACK + ("--micro-batch-size", "2"), "use --micro-batch-size 1"),
    (PACK + ("--ulysses-packed-qkv", "on"), "--ulysses-packed-qkv on cannot run --pack-samples"),
    (PACK + ("--sp-async-qkv", "on"), "--sp-async-qkv on cannot run --pack-samples"),
])
def test_entry_refusals(flags, match, capsys):
    from training import pretrain_video_dit
    with pytest.raises(SystemExit) as e:
        pretrain_video_dit.parse([*ARGS, "--cp-comm-type", "ulysses", *flags])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_entry_packed_sample_not_divisible_by_sp():
    """SP=2, 45-token clips (3 frames of 3 x 5 patches; 3 frames of 2 x 4: 24): each clip padded per sample; at lr 0
    a packed step's loss is the mean of the unpacked steps' losses over the same samples."""
    odd = ("--frames", "3", "--latent-size", "6x10,4x8", "--lr", "0")
    single = run_ranks(lambda r, w: _mg(r, w, (*odd, "--train-iters", "4"))["losses"], 1)[0]
    res = run_ranks(lambda r, w: _mg(r, w, (*odd, "--train-iters", "2", "--pack-samples", "--max-tokens-per-step",
                                            "69"))["rows"], 2)[0]
    packed = [row["loss"] for row in res]
    expect = [sum(single[:2]) / 2, sum(single[2:4]) / 2]  # packs [0, 1] and [2, 3] (45 + 24 tokens each)
    for a, b in zip(packed, expect):
        assert abs(a - b) <= 1e-5 * abs(b), (packed, expect)
    assert [row["tokens"] for row in res] == [69, 69]


def test_model_refuses_packed_qkv_path():
    """The model never silently falls back: the packed q|k|v path set on a packed step is refused by name."""
    model, data = _model(), _data()
    model.set_packed_qkv(True)
    inp = to_device(packed_host_inputs(packed_batch(data, [0, 1], 7, CFG.patch), 0, 1), "cpu")
    with pytest.raises(SPConfigError, match="--ulysses-packed-qkv"):
        local_loss(model, inp)


def test_on_disk_mixed_shapes_pack_like_synthetic(tmp_path):
    """Latent shards of differing shapes (.pt and .safetensors) pack from their headers and train exactly as the
    same samples generated synthetically."""
    from training.video_dit.data import LatentShardDataset, write_sample
    src = SyntheticVideoLatents(CFG.in_channels, FRAMES, 4, 8, CFG.text_len, CFG.text_dim, seed=1234, sizes=SIZES)
    out = tmp_path / "lat"
    out.mkdir()
    for i in range(6):
        fmt = "pt" if i % 2 == 0 else "safetensors"
        write_sample(str(out / f"sample_{i:06d}.{fmt}"), src[i]["latent"], src[i]["text"], fmt)
    ds = LatentShardDataset(str(out), channels=CFG.in_channels, text_dim=CFG.text_dim, patch=CFG.patch, check_up_to=2)
    assert [ds.shape_of(i) for i in range(6)] == [src.shape_of(i) for i in range(6)]  # headers past check_up_to too
    steps = ("--train-iters", "2", *PACK)
    synthetic = run_ranks(lambda r, w: _mg(r, w, steps)["losses"], 2)[0]
    disk = run_ranks(lambda r, w: _mg(r, w, (*steps, "--data-path", str(out)))["losses"], 2)[0]
    assert disk == synthetic, (disk, synthetic)


def test_megatron_entry_packed_data_parallel():
    """DP=2 (CP=1): the ranks take packs 0 and 1 of the stream; the step's loss is the mean over the packs."""
    from training import pretrain_video_dit
    single = run_ranks(lambda r, w: _mg(r, w, ("--train-iters", "5", "--lr", "0"))["losses"], 1)[0]
    got = run_ranks(lambda r, w: pretrain_video_dit.main([*ARGS, "--context-parallel-size", "1", "--cp-comm-type",
                                                          "ulysses", "--train-iters", "1", "--lr", "0", *PACK]),
                    2)[0]
    expect = (sum(single[:3]) / 3 + sum(single[3:5]) / 2) / 2
    assert abs(got["losses"][0] - expect) <= 1e-5 * expect, (got["losses"], expect)
