"""Video-DiT training under sequence parallelism (CPU, fp32): every SP mode equals SP=1 on the full
sequence (loss and gradients at step 0, losses over 3 optimizer steps), both entry points, exact
resume, and padding that changes nothing."""
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from tests.harness import run_ranks  # noqa: E402
from tests.sp_reduce import loss_and_grads  # noqa: E402
from tests.reference import rel_err  # noqa: E402
from training.video_dit import VideoDiT, preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.engine import flow_matching_batch, local_loss, make_core, prepare  # noqa: E402

CFG = preset("tiny")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _loss_and_grads(group, mode, frames=(4,), size=(6, 10), **kw):
    torch.manual_seed(5)
    model = VideoDiT(CFG)
    sp = dist.get_world_size(group) if group is not None else 1
    model.set_attention_core(make_core(mode, group, num_heads=CFG.heads, **kw))
    data = SyntheticVideoLatents(CFG.in_channels, frames, size[0], size[1], CFG.text_len, CFG.text_dim, seed=1)
    batch = flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch)
    inp = prepare(batch, dist.get_rank(group) if group is not None else 0, sp, "cpu")
    loss, grads = loss_and_grads(model, local_loss(model, inp), group)
    return loss, grads, inp.n_pad - inp.n_valid


MODES = [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {}), ("tasp", {}),
         ("usp", {"nodes": 2, "ulysses_size": 2}), ("tas", {"nodes": 2, "ulysses_size": 2}),
         ("torus", {"nodes": 2, "ulysses_size": 2, "placement": "tas"}), ("auto", {})]


class _Forced:
    """A LayerPolicy stand-in that always answers ``choice`` (counts its calls)."""

    def __init__(self, choice):
        self.choice, self.calls = choice, 0

    def form_for(self, key, run, group, device, heads_per_rank):
        self.calls += 1
        return self.choice


def _async_vs_plain(rank, world, frames, chunks, how="async"):
    """The DiT with the async Ulysses block (or a block form picked through the policy hook) equals the
    plain DiT (loss and every gradient), padding included."""
    from megatron_sp_ext.sp.layers.policy import LayerChoice, LayerPolicy
    out = []
    for use_async in (False, True):
        torch.manual_seed(5)
        model = VideoDiT(CFG)
        model.set_attention_core(make_core("hcms", dist.group.WORLD, num_heads=CFG.heads, head_chunks=chunks))
        if use_async and how == "async":
            model.set_async_attention(dist.group.WORLD, chunks)
        elif use_async and how == "allgather":
            model.set_async_attention(dist.group.WORLD, chunks, allgather=True)
        elif use_async and how == "policy":  # the real policy on CPU: plain, decided once per shape
            model.set_layer_policy(dist.group.WORLD, LayerPolicy())
        elif use_async:  # every form the policy can pick runs the same math
            forced = _Forced(LayerChoice(how == "forced_async", chunks, "nccl", how == "forced_allgather"))
            model.set_layer_policy(dist.group.WORLD, forced)
        data = SyntheticVideoLatents(CFG.in_channels, frames, 6, 10, CFG.text_len, CFG.text_dim, seed=1)
        inp = prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch), rank, world, "cpu")
        loss = local_loss(model, inp)
        (loss * world).backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = out
    assert rel_err(l1, l0) < 1e-6, (l1, l0)
    if "allgather" in how:  # its per-rank parameter grads split differently; the CP-reduced ones agree
        for t in g0 + g1:
            dist.all_reduce(t)
    for i, (a, b) in enumerate(zip(g1, g0)):
        assert rel_err(a, b) < 1e-5, f"grad {i}: {rel_err(a, b)}"
    if how == "policy":
        (dec,) = model.layer_policy.cache.values()  # one shape, one decision, shared by every block
        assert dec.choice.label == "plain" and "no CUDA streams" in dec.reason
    elif how.startswith("forced"):
        assert forced.calls == CFG.layers
    return True


@pytest.mark.parametrize("frames,chunks", [((4,), 1), ((3,), 2)])  # 3 frames: 45 tokens, padded
def test_async_block_dit_equals_plain(frames, chunks):
    run_ranks(_async_vs_plain, 4, frames, chunks)


@pytest.mark.parametrize("frames,chunks", [((4,), 1), ((3,), 2)])  # 3 frames: 45 tokens, padded
def test_allgather_block_dit_equals_plain(frames, chunks):
    run_ranks(_async_vs_plain, 4, frames, chunks, "allgather")


@pytest.mark.parametrize("how,chunks", [("policy", 1), ("forced_async", 2), ("forced_plain", 2),
                                        ("forced_allgather", 2)])
def test_block_policy_forms_equal_plain(how, chunks):
    run_ranks(_async_vs_plain, 4, (3,), chunks, how)


def _packed_vs_plain(rank, world, frames, chunks, recompute):
    """--ulysses-packed-qkv: q|k|v written into the exchange's send layout give the plain core's loss and
    every gradient (padding included, with and without activation checkpointing of the core)."""
    out = []
    for packed in (False, True):
        torch.manual_seed(5)
        model = VideoDiT(CFG)
        core = make_core("hcms", dist.group.WORLD, num_heads=CFG.heads, head_chunks=chunks)
        calls = []
        if packed:
            entry = core.packed
            core.packed = type("Counting", (), {"layout": staticmethod(entry.layout),
                                                "__call__": lambda self, *a: calls.append(1) or entry(*a)})()
        model.set_attention_core(core)
        model.set_packed_qkv(packed)
        model.set_recompute(recompute, ["core_attn"])
        data = SyntheticVideoLatents(CFG.in_channels, frames, 6, 10, CFG.text_len, CFG.text_dim, seed=1)
        inp = prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch), rank, world, "cpu")
        loss = local_loss(model, inp)
        (loss * world).backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        if packed:  # every block took the packed path (twice per block under recompute)
            assert len(calls) == CFG.layers * (2 if recompute else 1), len(calls)
    (l0, g0), (l1, g1) = out
    assert rel_err(l1, l0) < 1e-6, (l1, l0)
    for i, (a, b) in enumerate(zip(g1, g0)):
        assert rel_err(a, b) < 1e-5, f"grad {i}: {rel_err(a, b)}"
    return True


@pytest.mark.parametrize("frames,chunks,recompute", [((4,), 1, None), ((3,), 2, None), ((3,), 2, "selective"),
                                                     ((4,), "auto", None)])
def test_packed_qkv_dit_equals_plain(frames, chunks, recompute):
    run_ranks(_packed_vs_plain, 4, frames, chunks, recompute)


def _step0(rank, world, frames):
    out = {}
    ref_loss, ref_grads, _ = _loss_and_grads(None, "ulysses", frames)
    for mode, kw in MODES:
        loss, grads, pad = _loss_and_grads(dist.group.WORLD, mode, frames, **kw)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"{mode}: loss {loss} vs {ref_loss}"
        for i, (g, r) in enumerate(zip(grads, ref_grads)):
            assert rel_err(g, r) < 1e-5, f"{mode}: grad {i} {rel_err(g, r)}"
        out[mode] = pad
    return out


def test_every_mode_equals_sp1_at_step0():
    run_ranks(_step0, 4, (4,))


def test_padding_changes_nothing():
    # 3 frames x (3 x 5) patches = 45 tokens: not divisible by 4 (nor 2 x SP); padded to 48
    pads = run_ranks(_step0, 4, (3,))[0]
    assert all(p == 3 for p in pads.values()), pads


def _megatron_run(rank, world, cp, mode, steps, extra=()):
    from training import pretrain_video_dit
    argv = ["--model", "tiny", "--context-parallel-size", str(cp), "--cp-comm-type", mode, "--train-iters", str(steps),
            "--frames", "4,3", "--latent-size", "6x10", "--quiet", *extra]
    return pretrain_video_dit.main(argv)["losses"]


def _ds_run(rank, world, sp, mode, steps, extra=(), zero=1):
    from training import train_deepspeed
    argv = ["--deepspeed-config", os.path.join(ROOT, "configs", "deepspeed", "cpu_tiny_hcms.json"), "--model", "tiny",
            "--train-iters", str(steps), "--frames", "4,3", "--latent-size", "6x10", "--quiet", *extra]
    block = {"mode": mode, **({"head_chunks": 2} if mode == "hcms" else {})}
    if mode in ("usp", "tas", "torus"):
        block.update(nodes=2, ulysses_size=2, **({"placement": "tas"} if mode == "torus" else {}))
    cfg = {"sequence_parallel_size": sp, "zero_optimization": {"stage": zero}, "sequence_parallel_ext": block}
    return train_deepspeed.main(argv, config=cfg)["losses"]


MESH_FLAGS = ("--sp-nodes", "2", "--sp-ulysses-size", "2")
ENTRY_MODES = ["ulysses", "hcms", "ring", "tasp", "usp", "tas", "torus", "auto"]


@pytest.mark.parametrize("mode", ENTRY_MODES)
def test_megatron_entry_3_steps_match_sp1(mode):
    ref = run_ranks(_megatron_run, 1, 1, "ulysses", 3)[0]
    extra = {"hcms": ("--hcms-head-chunks", "2"), "usp": MESH_FLAGS, "tas": MESH_FLAGS,
             "torus": MESH_FLAGS + ("--sp-placement", "tas")}.get(mode, ())
    got = run_ranks(_megatron_run, 4, 4, mode, 3, extra)
    for r in range(4):
        for a, b in zip(got[r], ref):
            assert abs(a - b) <= 1e-4 * abs(b), f"{mode}: {got[r]} vs {ref}"


@pytest.mark.parametrize("flags", [("--hcms-head-chunks", "2", "--sp-async-qkv"), ("--sp-async-qkv", "auto"),
                                   ("--hcms-head-chunks", "2", "--sp-async-qkv", "allgather")])
def test_megatron_entry_async_qkv_matches_sp1(flags):
    ref = run_ranks(_megatron_run, 1, 1, "ulysses", 3)[0]
    got = run_ranks(_megatron_run, 4, 4, "hcms", 3, flags)
    for r in range(4):
        for a, b in zip(got[r], ref):
            assert abs(a - b) <= 1e-4 * abs(b), f"async {flags}: {got[r]} vs {ref}"


def _counting_packed(rank, world, entry_run, *args):
    """Run an entry with every packed attention call counted: (losses, calls)."""
    from megatron_sp_ext.sp.ulysses import packed
    calls, real = [], packed.packed_ulysses_attention

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    packed.packed_ulysses_attention = counted
    try:
        return entry_run(rank, world, *args), len(calls)
    finally:
        packed.packed_ulysses_attention = real


@pytest.mark.parametrize("entry", ["megatron", "deepspeed"])
def test_entry_packed_qkv_matches_sp1(entry):
    """--ulysses-packed-qkv on: every block's attention runs packed (both entry points) and 3 steps give the
    SP=1 losses."""
    run = _megatron_run if entry == "megatron" else _ds_run
    flags = ("--ulysses-packed-qkv", "on") + (("--hcms-head-chunks", "2") if entry == "megatron" else ())
    ref = run_ranks(run, 1, 1, "ulysses", 3)[0]
    got = run_ranks(_counting_packed, 4, run, 4, "hcms", 3, flags)
    for r in range(4):
        losses, calls = got[r]
        assert calls >= 3 * CFG.layers, calls  # fwd per block and step (the loop's own probes may add more)
        for a, b in zip(losses, ref):
            assert abs(a - b) <= 1e-4 * abs(b), f"{entry} packed: {losses} vs {ref}"


@pytest.mark.parametrize("mode", ENTRY_MODES)
def test_deepspeed_entry_3_steps_match_sp1(mode):
    ref = run_ranks(_ds_run, 1, 1, "ulysses", 3)[0]
    got = run_ranks(_ds_run, 4, 4, mode, 3)
    for r in range(4):
        for a, b in zip(got[r], ref):
            assert abs(a - b) <= 1e-4 * abs(b), f"{mode}: {got[r]} vs {ref}"


def test_deepspeed_entry_zero3_matches_zero1():
    """The DiT under ZeRO-3 (parameters partitioned, gathered by DeepSpeed's hooks; the blocks read some norm
    weights directly) gives ZeRO-1's losses."""
    z1 = run_ranks(_ds_run, 2, 2, "hcms", 3)[0]
    z3 = run_ranks(_ds_run, 2, 2, "hcms", 3, (), 3)
    for r in range(2):
        for a, b in zip(z3[r], z1):
            assert abs(a - b) <= 1e-5 * abs(b), f"ZeRO-3 {z3[r]} vs ZeRO-1 {z1}"


def test_megatron_resume_is_exact(tmp_path):
    straight = run_ranks(_megatron_run, 4, 4, "hcms", 6, ("--hcms-head-chunks", "2"))[0]
    ck = str(tmp_path / "ck")
    first = run_ranks(_megatron_run, 4, 4, "hcms", 4, ("--hcms-head-chunks", "2", "--save", ck))[0]
    rest = run_ranks(_megatron_run, 4, 4, "hcms", 6, ("--hcms-head-chunks", "2", "--load", ck))[0]
    assert first + rest == straight, (first, rest, straight)


def test_deepspeed_resume_is_exact(tmp_path):
    straight = run_ranks(_ds_run, 2, 2, "hcms", 6)[0]
    ck = str(tmp_path / "ck")
    first = run_ranks(_ds_run, 2, 2, "hcms", 4, ("--save", ck))[0]
    rest = run_ranks(_ds_run, 2, 2, "hcms", 6, ("--load", ck))[0]
    assert first + rest == straight, (first, rest, straight)


def test_metrics_and_plot_written(tmp_path):
    log = str(tmp_path / "log")

    def fn(rank, world):
        from training import pretrain_video_dit
        return pretrain_video_dit.main(["--context-parallel-size", "2", "--cp-comm-type", "hcms", "--train-iters", "3",
                                        "--latent-size", "6x10", "--log-dir", log, "--quiet"])
    res = run_ranks(fn, 2)[0]
    import json
    rows = [json.loads(x) for x in open(os.path.join(log, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["loss"] == pytest.approx(res["losses"][0])
    assert os.path.getsize(os.path.join(log, "loss.png")) > 1000


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_on_disk_latents_roundtrip(tmp_path, fmt):
    from training.video_dit.make_latents import main as make
    from training.video_dit.data import LatentShardDataset
    out = str(tmp_path / "lat")
    make(["--out", out, "--num", "3", "--frames", "4,5", "--size", "6x10", "--format", fmt])
    ds = LatentShardDataset(out)
    src = SyntheticVideoLatents(4, [4, 5], 6, 10, 8, 32, seed=1234)
    assert len(ds) == 3
    for i in range(3):
        assert torch.equal(ds[i]["latent"], src[i]["latent"]) and torch.equal(ds[i]["text"], src[i]["text"])
    assert ds[1]["latent"].shape == (4, 5, 6, 10)
    with pytest.raises(FileNotFoundError, match="--data-path"):
        LatentShardDataset(str(tmp_path / "empty"))


def _autocast_bf16(rank, world):
    """Mixed precision as on GPU (bf16 autocast), here on CPU: one step runs and is finite."""
    torch.manual_seed(5)
    model = VideoDiT(CFG)
    model.set_attention_core(make_core("hcms", dist.group.WORLD, num_heads=CFG.heads, head_chunks=2))
    data = SyntheticVideoLatents(CFG.in_channels, (3,), 6, 10, CFG.text_len, CFG.text_dim, seed=1)
    inp = prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch), rank, world, "cpu")
    loss = local_loss(model, inp, torch.bfloat16)
    (loss * world).backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    return float(loss)


def test_bf16_autocast_step():
    run_ranks(_autocast_bf16, 2)
