"""Timed trials inside a checkpointed forward (megatron_sp_ext.trials): the auto policies (ModePolicy, head_chunks
auto, varlen_kernel auto, the block policies) time their candidates fwd+bwd inside the caller's forward the first
time a shape is seen. Under torch's non-reentrant activation checkpoint those trials' saved tensors used to go
through the checkpoint's saved-tensor hooks, so the first forward saved more tensors than its recompute (the
decision is cached then) and the backward raised CheckpointError (2 x H100, wan-14b --recompute-granularity full,
CP=2, auto mode). Here every policy times on CPU (gloo, 2 ranks); forward+backward under checkpoint, non-reentrant
and reentrant, give the gradients of the same model run without checkpoint."""
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import megatron_sp_ext as spx
from megatron_sp_ext.attention import varlen
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.sp.calibration import ModePolicy
from megatron_sp_ext.sp.factory import SPResources, make_attention
from megatron_sp_ext.sp.ulysses import HCMSPolicy
from megatron_sp_ext.trials import isolated_trial
from tests.harness import run_ranks

H, D = 4, 8
CHECKPOINTS = ["off", "non_reentrant", "reentrant"]


def forcing_timer(pick):
    """A ModePolicy timer that runs the step once (fwd+bwd, its real collectives) and reports ``pick`` fastest."""
    def timer(fn, iters, warmup, group):
        fn()
        return 1.0 if fn.mode == pick else 2.0
    return timer


def running_timer(calls):
    """A timer that runs the step once and reports every candidate alike (ties keep the baseline)."""
    def timer(fn, *args):
        calls.append(torch.is_grad_enabled())
        fn()
        return 1.0
    return timer


class Block(torch.nn.Module):
    """QKV projection -> ``attend(q, k, v)`` on [B, S_loc, H, D] -> output projection; the same weights on every
    rank."""

    def __init__(self, attend):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.qkv, self.out = torch.nn.Linear(H * D, 3 * H * D), torch.nn.Linear(H * D, H * D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        self.attend = attend

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, H, D) for t in self.qkv(x).chunk(3, dim=-1))
        return self.out(self.attend(q, k, v).reshape(b, s, H * D))


def train_step(rank, make_attend, ckpt, s_loc, steps=2):
    """``steps`` forward+backward passes of a fresh Block (``make_attend()``: a fresh attention and policy) with
    ``ckpt`` checkpointing; returns (the per-step outputs, x's grad, the parameters' grads) after the last step."""
    block = Block(make_attend())
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, s_loc, H * D, generator=gen).requires_grad_()
    go = torch.randn(1, s_loc, H * D, generator=gen)
    outs = []
    for _ in range(steps):
        block.zero_grad()
        x.grad = None
        if ckpt == "off":
            y = block(x)
        else:
            y = checkpoint(block, x, use_reentrant=ckpt == "reentrant")
        y.backward(go)
        outs.append(y.detach())
    return outs, x.grad, [p.grad for p in block.parameters()]


def assert_same(got, want, what):
    (outs_g, dx_g, dp_g), (outs_w, dx_w, dp_w) = got, want
    for a, b in zip(outs_g + [dx_g] + dp_g, outs_w + [dx_w] + dp_w):
        assert a is not None and b is not None, what
        assert torch.equal(a, b), f"{what}: max diff {(a - b).abs().max().item():.3g}"


def test_isolated_trial_bypasses_outer_hooks_and_frees_its_graph():
    """Inside: an outer pair of saved-tensor hooks (a checkpoint's) sees nothing, the trial's own backward and a
    pair pushed inside it (a checkpoint within the trial) work, and a graph dropped without backward is freed (the
    packed value holds no reference back to its tensor)."""
    import weakref
    outer = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: outer.append(t) or t, lambda t: t):
        a = torch.randn(5, requires_grad=True)
        with isolated_trial():
            (a.exp() * a).sum().backward()
            inner = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: inner.append(1) or t.detach(), lambda t: t):
                (a * a).sum().backward()
            dropped = a.exp()  # saves its own output
            ref = weakref.ref(dropped)
            del dropped
        assert not outer and inner and ref() is None
        a.sin()
    with torch.no_grad():
        torch.testing.assert_close(a.grad, a.exp() * (1 + a) + 2 * a)
    assert len(outer) == 1  # outside the trial the outer hooks apply again


# --------------------------------------------------------------------------------------- auto mode (ModePolicy)

def _mode_auto(rank, world, ckpt, pick):
    group = dist.group.WORLD
    cfg = SPConfig(mode="auto")
    policies = []

    def make_attend():
        policy = ModePolicy(timer=forcing_timer(pick), timed_devices=("cpu",), rounds=3, warmup=1)
        policies.append(policy)
        attn = make_attention(cfg, group, num_heads=H, layout="bshd", placement="contiguous",
                              resources=SPResources(cfg, mode_policy=policy))
        assert attn.auto
        return lambda q, k, v: attn(q, k, v, causal=False)
    got = train_step(rank, make_attend, ckpt, 6)
    # reentrant: the no_grad forward (a fwd-only key: no module flag here) and the recompute in the backward each
    # calibrate; otherwise one key
    assert [c.chunks for c in policies[0].cache.values()] == [pick] * (2 if ckpt == "reentrant" else 1)
    # the reference: no checkpoint, the same pick (forced, untimed)
    attn = make_attention(cfg, group, num_heads=H, layout="bshd", placement="contiguous")
    attn.chooser = lambda *a: pick
    assert_same(got, train_step(rank, lambda: lambda q, k, v: attn(q, k, v, causal=False), "off", 6),
                f"auto mode -> {pick}, checkpoint {ckpt}")
    return True


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
@pytest.mark.parametrize("pick", ["ring", "hcms"])
def test_auto_mode_trial_under_checkpoint(ckpt, pick):
    run_ranks(_mode_auto, 2, ckpt, pick)


# ------------------------------------------------------------------------- head_chunks="auto" (HCMSPolicy)

def _hcms_auto(rank, world, ckpt):
    group = dist.group.WORLD
    calls, policies = [], []

    def make_attend():
        policy = HCMSPolicy(timer=running_timer(calls), timed_devices=("cpu",), rounds=3, warmup=1)
        policies.append(policy)
        return lambda q, k, v: spx.ulysses_attention(q, k, v, group, head_chunks="auto", policy=policy)
    got = train_step(rank, make_attend, ckpt, 6)
    cal = next(iter(policies[0].cache.values()))
    assert cal.chunks == 1 and set(cal.rounds) == {1, 2} and calls, (cal, calls)  # C=1 and C=2 both ran
    assert len(policies[0].cache) == (2 if ckpt == "reentrant" else 1)  # reentrant: no_grad forward, recompute
    want = train_step(rank, lambda: lambda q, k, v: spx.ulysses_attention(q, k, v, group, head_chunks=1), "off", 6)
    assert_same(got, want, f"head_chunks=auto, checkpoint {ckpt}")
    return True


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_head_chunks_auto_trial_under_checkpoint(ckpt):
    run_ranks(_hcms_auto, 2, ckpt)


# ---------------------------------------------------------------------- varlen_kernel="auto" (VarlenChooser)

CU = torch.tensor([0, 8, 20, 24])  # packed samples, every length a multiple of 2P: no padding


def _varlen_auto(rank, world, ckpt, backend):
    group = dist.group.WORLD
    timed = []

    def timer(method, fn):
        timed.append(method)
        fn()
        return 1.0  # a tie: the first method, per_sample
    chooser = varlen.default_chooser()  # the process-wide one the attention uses (this forked rank's)
    chooser.timer, chooser.measure_off_cuda = timer, True

    def attend(setting):
        return lambda q, k, v: spx.ulysses_attention(q, k, v, group, cu_seqlens=CU, varlen_kernel=setting,
                                                     backend=backend)
    got = train_step(rank, lambda: attend("auto"), ckpt, 12)
    assert set(timed) == {"per_sample", "grouped"} and set(chooser.decisions.values()) == {"per_sample"}, \
        (timed, chooser.decisions)
    assert_same(got, train_step(rank, lambda: attend("per_sample"), "off", 12), f"varlen auto, checkpoint {ckpt}")
    return True


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
@pytest.mark.parametrize("backend", ["math", "auto"])
def test_varlen_auto_trial_under_checkpoint(ckpt, backend):
    """backend "math": the inner-graph path, whose trials run fwd+bwd under autograd (what saved tensors through
    the checkpoint's hooks); "auto" (CPU flash lse kernel): the explicit-kernel path, trials under no_grad."""
    run_ranks(_varlen_auto, 2, ckpt, backend)


# ------------------------------------------------------------------------------- the DiT entry point, end to end

DIT = ["--model", "tiny", "--frames", "4", "--latent-size", "6x10", "--train-iters", "2", "--quiet",
       "--context-parallel-size", "2"]
DIT_CASES = {  # what times inside the DiT's forward: the auto mode, the HCMS chunk count, the block form
    "mode_auto": ["--cp-comm-type", "auto"],
    "head_chunks_auto": ["--cp-comm-type", "hcms", "--hcms-head-chunks", "auto"],
    "block_auto": ["--cp-comm-type", "hcms", "--sp-async-qkv", "auto"],
}


def _dit(rank, world, case):
    """training/pretrain_video_dit.py with --recompute-granularity full (every block under non-reentrant
    checkpoint) and without: the same losses. Every policy times on CPU (this forked rank's entry only)."""
    import functools

    import megatron_sp_ext.sp.layers.policy as layer_policy
    import training.video_dit.engine as engine
    from training import pretrain_video_dit
    made = []

    def resources(cfg):
        res = SPResources(cfg, mode_policy=ModePolicy(timer=forcing_timer("ring"), timed_devices=("cpu",), rounds=2,
                                                      warmup=1),
                          policy=HCMSPolicy(timer=running_timer([]), timed_devices=("cpu",), rounds=2, warmup=1))
        made.append(res)
        return res

    def host_clock_policy(cls, **kw):  # the host clock; a margin nothing meets: every rank keeps plain, deterministically
        pol = cls(timed_devices=("cpu",), rounds=2, warmup=1, margin=0.99, **kw)
        made.append(pol)
        return pol
    engine.SPResources = resources
    layer_policy.LayerPolicy = functools.partial(host_clock_policy, layer_policy.LayerPolicy)
    losses = {}
    for recompute in (False, True):
        made.clear()
        extra = ["--recompute-granularity", "full"] if recompute else []
        losses[recompute] = pretrain_video_dit.main([*DIT, *DIT_CASES[case], *extra])["losses"]
        if case == "mode_auto":
            assert [c.chunks for c in made[0].mode_policy.cache.values()] == ["ring"], made[0].mode_policy.cache
        elif case == "head_chunks_auto":
            assert [c.chunks for c in made[0].policy.cache.values()] == [1] and made[0].policy.cache
        else:
            assert made[-1].cache and all(d.measured_ms for d in made[-1].cache.values()), made[-1].cache
    return losses


@pytest.mark.parametrize("case", list(DIT_CASES))
def test_dit_recompute_full_with_auto_policies(case):
    pytest.importorskip("megatron.core")
    for losses in run_ranks(_dit, 2, case, timeout=300):
        assert len(losses[True]) == 2
        assert losses[True] == losses[False], losses


# ------------------------------------------------- Megatron's --sp-async-qkv auto (FormPolicy, the forms' trials)

def _megatron_forms(rank, world, ckpt, winner):
    """A 2-layer Megatron TransformerBlock with --sp-async-qkv auto on 2 CP ranks (a FormPolicy whose timer makes
    ``winner`` fastest; every form runs fwd+bwd in its trial) under torch's checkpoint, non-reentrant or reentrant
    (the mechanism of Megatron's own --recompute-granularity full, whose CheckpointFunction needs CUDA's RNG: its
    first forward under no_grad, the recompute with grad in the backward): the output and every gradient equal those
    of the same block, winner fixed, without checkpoint."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_sp_ext.megatron import SPTransformerConfig, with_sp_core_attention
    from megatron_sp_ext.sp.layers.policy import FormPolicy

    def timer(name, step, iters, warmup, group):
        step()
        return 9.0 if name == winner else 10.0
    ps.initialize_model_parallel(context_parallel_size=world)
    try:
        def run(how, form):
            tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            cfg = SPTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, use_cpu_initialization=True,
                                      context_parallel_size=world, cp_comm_type="ulysses", hidden_dropout=0.0,
                                      attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
                                      masked_softmax_fusion=False, sp_async_qkv=form, normalization="RMSNorm",
                                      qk_layernorm=True)
            torch.manual_seed(1234)
            block = TransformerBlock(cfg, with_sp_core_attention(
                get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")))
            policy = None
            if form == "auto":
                block.layers[0].self_attention.form_policy = policy = FormPolicy(rounds=2, warmup=1, timer=timer)
            g = torch.Generator().manual_seed(3 + rank)
            x = torch.randn(8, 2, 64, generator=g).requires_grad_()
            dy = torch.randn(8, 2, 64, generator=g)
            if how != "off":
                y = checkpoint(lambda t: block(t, attention_mask=None), x, use_reentrant=how == "reentrant")
            else:
                y = block(x, attention_mask=None)
            y.backward(dy)
            if policy is not None:
                assert [d.form for d in policy.cache.values()] == [winner] * len(policy.cache), policy.cache
            return [y.detach(), x.grad] + [p.grad for p in block.parameters()]
        fixed = {"async": "on", "allgather": "allgather", "megatron": "off"}[winner]
        for a, b in zip(run(ckpt, "auto"), run("off", fixed)):
            assert torch.equal(a, b), (ckpt, winner, (a - b).abs().max().item())
    finally:
        ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("winner", ["async", "megatron"])
def test_megatron_block_forms_trial_under_checkpoint(ckpt, winner):
    pytest.importorskip("megatron.core")
    run_ranks(_megatron_forms, 2, ckpt, winner)
