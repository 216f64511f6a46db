"""Every activation-recompute choice of the video DiT (CPU, float64): --recompute-granularity full, selective
core_attn / mlp / both, selective outside_core_attn (everything but the self-attention core recomputed), and
--cpu-offloading, give the loss and every parameter gradient of the run without recompute BIT FOR BIT, at SP=1
and at SP=2 (Ulysses over gloo; the plain and the packed q|k|v path), dense and block-sparse (window and top-k with
its gate); the SP=2 runs also equal the SP=1 reference (to fp32 rounding: the loss is taken in fp32). The attention core runs once per layer in
forward + backward under outside_core_attn (the backward never reruns it) and twice under full (SP=1; at SP=2
the CPU's inner-graph Ulysses backward makes torch's checkpoint rerun it once more); the flag refusals name the
flags."""
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from tests.dit_models import modulated_dit  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from training.video_dit import preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.engine import flow_matching_batch, local_loss, make_core, prepare  # noqa: E402
from training.video_dit.sparse import SparseSpec  # noqa: E402

CFG = preset("tiny")
# (granularity, modules, cpu offloading)
CHOICES = [("full", ["core_attn"], False), ("selective", ["core_attn"], False), ("selective", ["mlp"], False),
           ("selective", ["core_attn", "mlp"], False), ("selective", ["outside_core_attn"], False),
           ("selective", ["outside_core_attn"], True), (None, ["core_attn"], True)]


class CountingCore:
    """Wraps an attention core: counts its calls (the forward's and any recompute's), keeps its attributes."""

    def __init__(self, core):
        self.core, self.calls, self.packed_calls = core, 0, 0
        self.group = getattr(core, "group", None)
        packed = getattr(core, "packed", None)
        if packed is not None:
            self.packed = CountingPacked(packed, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.core(*args, **kwargs)


class CountingPacked:
    def __init__(self, packed, counter):
        self.packed, self.counter = packed, counter

    def layout(self, *args, **kwargs):
        return self.packed.layout(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.counter.calls += 1
        self.counter.packed_calls += 1
        return self.packed(*args, **kwargs)


def _step(group, choice, packed_qkv=False, spec=None, fused=None, num_layers=None, ffn_runs=None):
    """(loss, grads, core calls) of one float64 step of the tiny DiT on this rank under recompute ``choice``
    (--recompute-num-layers ``num_layers``); ``ffn_runs``: a list that gets each block's FFN forward count."""
    granularity, modules, offload = choice
    sp = dist.get_world_size(group) if group is not None else 1
    model = modulated_dit(CFG)
    model.set_sparse_attention(spec)
    if spec is not None and spec.topk is not None:
        with torch.no_grad():  # the coarse branch's gates start at zero: wake them so they count
            for blk in model.blocks:
                blk.attn.sparse_gate.weight.normal_(0.0, 0.05)
    model.double()
    core = CountingCore(make_core("ulysses", group, num_heads=CFG.heads))
    model.set_attention_core(core)
    model.set_packed_qkv(packed_qkv)
    model.set_recompute(granularity, modules, num_layers)
    model.set_cpu_offloading(offload)
    runs = [0] * len(model.blocks)
    for i, blk in enumerate(model.blocks):
        blk.ffn.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    model.set_fused_elementwise(fused)
    data = SyntheticVideoLatents(CFG.in_channels, [4], 8, 8, CFG.text_len, CFG.text_dim, seed=1)
    batch = flow_matching_batch(data, 0, 7, 0, 1, 2, CFG.patch, tile=spec.tile if spec is not None else None)
    inp = prepare({k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()},
                  dist.get_rank(group) if group is not None else 0, sp, "cpu")
    loss_r = local_loss(model, inp)
    (loss_r * sp).backward()
    loss = loss_r.detach().clone()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
            g /= sp
    assert (core.packed_calls > 0) == (packed_qkv and sp > 1), (packed_qkv, sp, core.packed_calls)  # the path ran
    if ffn_runs is not None:
        ffn_runs[:] = runs
    return loss.item(), grads, core.calls


def _equal(got, ref, what):
    assert got[0] == ref[0], f"{what}: loss {got[0]!r} vs {ref[0]!r} without recompute"
    assert got[1].keys() == ref[1].keys()
    for n, g in ref[1].items():
        assert torch.equal(got[1][n], g), f"{what}: grad {n} differs by {float((got[1][n] - g).abs().max())}"


def _close(got, ref, what, tol=1e-6):
    """SP=2 against SP=1: local_loss computes the loss in fp32 (it casts the prediction), so the two placements,
    whose attention sums in other orders, agree to fp32 rounding, not 1e-10 (each choice's bit-identity is the
    check of the recompute)."""
    assert abs(got[0] - ref[0]) <= tol * abs(ref[0]), f"{what}: loss {got[0]} vs SP=1 {ref[0]}"
    for n, g in ref[1].items():
        err = float((got[1][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
        assert err <= tol, f"{what}: grad {n} rel err {err} vs SP=1"


def _check_choices(group, packed_qkv=False, spec=None, choices=CHOICES):
    """Every choice equals no recompute bit for bit; returns the no-recompute result. Core calls per step: L
    without recompute, L under outside_core_attn (kept, never rerun), 2L under full / core_attn."""
    ref = _step(group, (None, ["core_attn"], False), packed_qkv, spec)
    layers = CFG.layers * (2 if spec is not None and spec.topk is not None else 1)  # top-k: a core call per sample
    assert ref[2] == layers, ref[2]
    for choice in choices:
        got = _step(group, choice, packed_qkv, spec)
        _equal(got, ref, f"{choice} packed_qkv={packed_qkv} sparse={spec}")
        reruns = choice[0] == "full" or (choice[0] == "selective" and "core_attn" in choice[1])
        if not reruns:
            assert got[2] == layers, f"{choice}: the core ran {got[2]} times for {layers} layers (want once each)"
        elif group is None:
            assert got[2] == 2 * layers, f"{choice}: the core ran {got[2]} times for {layers} layers (want twice)"
        else:  # SP > 1 on the CPU's SDPA: the Ulysses core's backward differentiates an inner graph (a nested
            # autograd.grad), and torch's checkpoint recomputes once per graph task: a second rerun
            assert got[2] >= 2 * layers, f"{choice}: the core ran {got[2]} times for {layers} layers (want >= 2x)"
    assert ref[1]["blocks.0.attn.qkv.weight"].abs().sum() > 0  # the attention reaches the loss
    return ref


def test_every_recompute_choice_is_bit_identical_sp1():
    _check_choices(None)


def test_compiled_elementwise_regions_keep_core_sp1():
    """The compiled elementwise regions (--fused-elementwise; aot_eager here) inside the two recomputed regions:
    outside_core_attn equals no recompute bit for bit, the core once per layer."""
    ref = _step(None, (None, ["core_attn"], False), fused="aot_eager")
    got = _step(None, ("selective", ["outside_core_attn"], False), fused="aot_eager")
    _equal(got, ref, "outside_core_attn, compiled elementwise regions")
    assert got[2] == ref[2] == CFG.layers


def test_sparse_window_and_topk_keep_core_sp1():
    """Block-sparse self-attention (window; top-k with its gate, whose input the kept region passes on)."""
    keep = [("selective", ["outside_core_attn"], False), ("full", ["core_attn"], False)]
    _check_choices(None, spec=SparseSpec((2, 2, 2), window=(1, 1, 1)), choices=keep)
    ref = _check_choices(None, spec=SparseSpec((2, 2, 2), topk=3), choices=keep)
    assert ref[1]["blocks.0.attn.sparse_gate.weight"].abs().sum() > 0


def _sp2(rank, world):
    g = dist.group.WORLD
    one = _step(None, (None, ["core_attn"], False))
    plain = _check_choices(g)
    _close(plain, one, "SP=2 plain path")
    keep = [("selective", ["outside_core_attn"], False), ("selective", ["outside_core_attn"], True),
            ("full", ["core_attn"], False)]
    packed = _check_choices(g, packed_qkv=True, choices=keep)
    _close(packed, one, "SP=2 packed q|k|v path")


def test_every_recompute_choice_is_bit_identical_sp2():
    run_ranks(_sp2, 2)


def test_recompute_num_layers_reruns_only_the_first_blocks():
    """--recompute-num-layers N (full, and ours for selective outside_core_attn, with and without offloading): the
    loss and every gradient equal no recompute bit for bit; the first N blocks' FFN runs twice (forward and
    recompute), the others' once; under outside_core_attn the core still runs once per layer."""
    ref = _step(None, (None, ["core_attn"], False))
    assert CFG.layers == 2
    for choice in (("selective", ["outside_core_attn"], False), ("selective", ["outside_core_attn"], True),
                   ("full", ["core_attn"], False), ("selective", ["mlp"], False)):
        for n in (0, 1, 2):
            runs = []
            got = _step(None, choice, num_layers=n, ffn_runs=runs)
            _equal(got, ref, f"{choice} --recompute-num-layers {n}")
            assert runs == [2] * n + [1] * (CFG.layers - n), (choice, n, runs)
            if choice[1] == ["outside_core_attn"]:
                assert got[2] == CFG.layers, (choice, n, got[2])


def test_refusals_name_the_flags(capsys):
    from training import pretrain_video_dit
    base = ["--model", "tiny", "--frames", "4", "--latent-size", "6x10"]
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*base, "--recompute-granularity", "selective", "--recompute-modules",
                                  "outside_core_attn", "mlp"])
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*base, "--recompute-granularity", "full", "--cpu-offloading"])
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*base, "--cpu-offloading-num-layers", "1"])
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*base, "--recompute-num-layers", "1"])
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*base, "--recompute-method", "block"])
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*base, "--recompute-granularity", "full", "--recompute-method", "uniform",
                                  "--recompute-num-layers", "2"])
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*base, "--recompute-granularity", "full", "--recompute-method", "block"])
    with pytest.raises(SystemExit):   # uniform with units of one block is every block: full + offload refused
        pretrain_video_dit.parse([*base, "--recompute-granularity", "full", "--recompute-method", "uniform",
                                  "--recompute-num-layers", "1", "--cpu-offloading"])
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*base, "--recompute-granularity", "selective", "--recompute-modules",
                                  "outside_core_attn", "--sp-async-qkv", "on", "--cp-comm-type", "ulysses"])
    err = capsys.readouterr().err
    for flag in ("outside_core_attn already recomputes", "--cpu-offloading with --recompute-granularity full",
                 "add --cpu-offloading", "--recompute-num-layers=1 is set without --recompute-granularity",
                 "--recompute-method block is set without --recompute-granularity",
                 "--recompute-method uniform --recompute-num-layers 2: chunks of several blocks",
                 "--recompute-method block needs --recompute-num-layers N",
                 "--sp-async-qkv on cannot run --recompute-modules outside_core_attn"):
        assert flag in err, (flag, err)
    # Megatron-LM's usual lines: uniform with units of one block is every block; block N is the first N
    uni = pretrain_video_dit.parse([*base, "--recompute-granularity", "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "1"])
    assert uni.recompute_num_layers is None
    blk = pretrain_video_dit.parse([*base, "--recompute-granularity", "full", "--recompute-method", "block",
                                    "--recompute-num-layers", "1"])
    assert blk.recompute_num_layers == 1
    args = pretrain_video_dit.parse([*base, "--recompute-granularity", "selective", "--recompute-modules",
                                     "outside_core_attn", "--cpu-offloading"])
    assert args.recompute_modules == ["outside_core_attn"] and args.cpu_offloading
    model = modulated_dit(CFG)
    with pytest.raises(ValueError, match="outside_core_attn already recomputes"):
        model.set_recompute("selective", ["outside_core_attn", "core_attn"])
    model.set_recompute("full")
    with pytest.raises(ValueError, match="--cpu-offloading with --recompute-granularity full"):
        model.set_cpu_offloading(True)


def test_packed_samples_keep_core_sp1():
    """--pack-samples (cu_seqlens: the core attends per sample): outside_core_attn equals no recompute bit for bit,
    the core once per layer."""
    from training.video_dit.packing import PackPlan, packed_batch, packed_host_inputs
    from training.video_dit.pipeline import to_device
    data = SyntheticVideoLatents(CFG.in_channels, [4, 2], 4, 8, CFG.text_len, CFG.text_dim, seed=1,
                                 sizes=[(4, 8), (6, 10)])
    ids = PackPlan(data, 120, CFG.patch).pack(0)
    assert len(ids) > 1
    res = {}
    for modules in (None, ["outside_core_attn"]):
        model = modulated_dit(CFG).double()
        core = CountingCore(make_core("ulysses", None, num_heads=CFG.heads))
        model.set_attention_core(core)
        model.set_recompute("selective" if modules else None, modules or ["core_attn"])
        batch = packed_batch(data, ids, 7, CFG.patch)
        batch = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
        inp = to_device(packed_host_inputs(batch, 0, 1), "cpu")
        local_loss(model, inp).backward()
        res[bool(modules)] = ([p.grad for p in model.parameters()], core.calls)
    assert res[True][1] == res[False][1] == CFG.layers, (res[True][1], res[False][1])
    assert all(torch.equal(a, b) for a, b in zip(res[True][0], res[False][0]))


def _ds_entry(rank, world, extra):
    import os
    from training import train_deepspeed
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = {"sequence_parallel_size": world, "zero_optimization": {"stage": 1},
           "sequence_parallel_ext": {"mode": "ulysses"}}
    return train_deepspeed.main(["--model", "tiny", "--train-iters", "2", "--frames", "4", "--latent-size", "8x8",
                                 "--quiet", "--num-workers", "0", *extra, "--deepspeed-config",
                                 os.path.join(root, "configs", "deepspeed", "cpu_tiny_hcms.json")],
                                config=cfg)["losses"]


def test_deepspeed_entry_keep_core_and_offload_sp2():
    """The DeepSpeed entry (SP=2, ZeRO-1): outside_core_attn, with and without --cpu-offloading, trains the same
    losses as no recompute, bit for bit, over 2 steps."""
    ref = run_ranks(_ds_entry, 2, [], timeout=300)[0]
    keep = ["--recompute-granularity", "selective", "--recompute-modules", "outside_core_attn"]
    assert run_ranks(_ds_entry, 2, keep, timeout=300)[0] == ref
    assert run_ranks(_ds_entry, 2, [*keep, "--cpu-offloading"], timeout=300)[0] == ref
    assert len(ref) == 2


def test_cuda_recompute_worker_on_cpu(monkeypatch):
    """tests/gpu/cuda_recompute.recompute_family (the CUDA suite's #67 family) on 2 CPU gloo ranks at tiny widths:
    every record passes the suite's judge (here the kernels are deterministic: errors 0)."""
    from tests.gpu import cuda_recompute
    from tests.gpu.suite_judge import merge_ranks
    monkeypatch.setattr(cuda_recompute, "DEV", "cpu")
    monkeypatch.setattr(cuda_recompute, "CFG", CFG)   # tiny widths: bf16 matmuls are slow on the CPU
    monkeypatch.setattr(cuda_recompute, "GRID", (2, 4, 4))
    merged = merge_ranks(run_ranks(cuda_recompute.recompute_family, 2, timeout=300))
    assert len(merged) == 16 and all(m["ok"] for m in merged), [m for m in merged if not m["ok"]]


def _kept_per_token_layer(group, choice, packed_qkv=False) -> float:
    """Tensor elements a block keeps per local token and layer after the forward, in units of dim (live bytes of
    a 4-layer minus a 2-layer forward, fp32), with recompute ``choice``."""
    import dataclasses
    from tests.live_bytes import LiveBytes
    sp = dist.get_world_size(group) if group is not None else 1
    live = {}
    for layers in (2, 4):
        cfg = dataclasses.replace(CFG, layers=layers, dim=64, heads=4)
        model = modulated_dit(cfg)
        model.set_attention_core(make_core("ulysses", group, num_heads=cfg.heads))
        model.set_packed_qkv(packed_qkv)
        model.set_recompute(*choice)
        data = SyntheticVideoLatents(cfg.in_channels, [8], 16, 16, cfg.text_len, cfg.text_dim, seed=1)
        inp = prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, cfg.patch),
                      dist.get_rank(group) if group is not None else 0, sp, "cpu")
        with LiveBytes() as m:
            pred = model(inp.x, inp.t, inp.text, inp.token_ids, inp.grid)
            live[layers] = m.live
        del pred
    return (live[4] - live[2]) / 2 / inp.x.shape[1] / 64 / 4


def _kept_checks(rank, world):
    from training.video_dit import memory_plan as mp
    g = dist.group.WORLD if world > 1 else None
    lse = 4 / 64   # one fp32 log-sum-exp per head (4 heads) and token, in units of dim x 4 B
    want = {"full": mp.KEEP_FULL / 2, "selective": (mp.KEEP_SELECTIVE_SP if world > 1 else mp.KEEP_SELECTIVE_SP1) / 2}
    out = {}
    for name, choice in (("full", ("full", ["core_attn"])), ("selective", ("selective", ["outside_core_attn"]))):
        for packed in ((False, True) if world > 1 else (False,)):
            got = _kept_per_token_layer(g, choice, packed)
            extra = lse if name == "selective" else 0.0
            # the plan's bf16 bytes / 2 = elements (this run is fp32); AdaLN's [B, 6d] per layer adds ~6/S
            assert abs(got - want[name] - extra) < 0.05, (world, name, packed, got, want[name] + extra)
            out[(name, packed)] = got
    return out


def test_kept_tensors_match_the_memory_plan():
    """What a block keeps between forward and backward (CPU live bytes): full its input (1 x dim per token),
    outside_core_attn the input and the core's q, k, v, out (5 x dim) plus lse at SP=1, and the output exchanged
    back too at SP=2 (6 x dim, plain and packed q|k|v): training/video_dit/memory_plan.py's KEEP_* terms.
    (--cpu-offloading moves tensors to host memory: on the CPU that is no change the count can see.)"""
    _kept_checks(0, 1)
    run_ranks(_kept_checks, 2)
