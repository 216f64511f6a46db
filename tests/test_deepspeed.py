"""DeepSpeed integration: SPDistributedAttention vs DeepSpeed's own DistributedAttention, the JSON
block, and deepspeed.initialize through our helper (ZeRO 1-3, SP 2 and 4) vs SP=1 (gloo, CPU)."""
import importlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("deepspeed")

from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.reference import assert_close, rel_err  # noqa: E402


def _ds_init():
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")


def _local_attn(bdim):
    def fn(q, k, v, *args, **kwargs):  # DeepSpeed-style local attention in the caller's layout
        to = (lambda t: t.transpose(1, 2)) if bdim == 0 else (lambda t: t.permute(1, 2, 0, 3))
        o = F.scaled_dot_product_attention(to(q), to(k), to(v), enable_gqa=k.shape[2] != q.shape[2])
        return o.transpose(1, 2) if bdim == 0 else o.permute(2, 0, 1, 3)
    return fn


def _vs_deepspeed(rank, world, cases):
    _ds_init()
    from deepspeed.sequence.layer import DistributedAttention

    from megatron_sp_ext.deepspeed import SPDistributedAttention, build_sequence_parallel_groups
    mpu = build_sequence_parallel_groups(world).install()  # DeepSpeed's uneven-heads path needs the SP rank
    g = mpu.get_sequence_parallel_group()
    for (h, hkv, bdim, mode, chunks, rope) in cases:
        scatter, gather = 2, (1 if bdim == 0 else 0)
        gen = torch.Generator().manual_seed(h * 100 + hkv)
        s, b, d = 4 * world, 2, 16
        full = [torch.randn(b, s, n, d, generator=gen) for n in (h, hkv, hkv, h)]
        sl = s // world
        mine = [t[:, rank * sl:(rank + 1) * sl] for t in full]
        if bdim == 1:
            mine = [t.transpose(0, 1) for t in mine]
        rot = None
        if rope:
            ang = torch.randn(1, s, 1, d, generator=gen)
            rot = (ang.cos(), ang.sin())
        outs = []
        for cls, kw in ((DistributedAttention, {}), (SPDistributedAttention, dict(mode=mode, head_chunks=chunks))):
            attn = cls(_local_attn(bdim), g, scatter, gather, None, hkv if h % world else None, **kw)
            q, k, v = (t.clone().requires_grad_() for t in mine[:3])
            o = attn(q, k, v, bdim, rot)
            o.backward(mine[3])
            outs.append((o.detach(), q.grad, k.grad, v.grad))
        tag = f"H={h}/{hkv} bdim={bdim} {mode} C={chunks} rope={rope}"
        for name, ours, theirs in zip(("out", "dq", "dk", "dv"), outs[1], outs[0]):
            assert ours.shape == theirs.shape, f"{tag} {name} shape"
            if mode == "ulysses":
                assert rel_err(ours, theirs) < 1e-6, f"{tag} {name}: {rel_err(ours, theirs)}"
            else:
                assert_close(f"{tag} {name}", ours, theirs, torch.float32)
    return True


CASES = [(h, hkv, bdim, mode, chunks, rope)
         for (h, hkv) in ((8, 8), (6, 6), (8, 4))
         for bdim in (0, 1)
         for (mode, chunks, rope) in (("ulysses", 1, False), ("hcms", 2, False), ("ulysses", 1, True),
                                      ("hcms", 2, True), ("ring", 1, False), ("tasp", 1, False))
         if not (rope and bdim == 0)]  # DeepSpeed's own RoPE path supports [s, b, h, d] only


@pytest.mark.parametrize("world", [2, 4])
def test_subclass_matches_deepspeed(world):
    cases = [c for c in CASES if not (c[0] % world and c[3] == "hcms" and c[0] // world < 2)
             and not (c[0] % world and c[1] != c[0])]  # DeepSpeed: uneven heads only without GQA
    run_ranks(_vs_deepspeed, world, cases, timeout=400)


class _TinyAttentionModel(torch.nn.Module):
    """x [b, s_local, 32] -> qkv -> sequence-parallel attention -> proj; opts in via the protocol."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(32, 96)
        self.proj = torch.nn.Linear(32, 32)
        self.attn = None

    def configure_sequence_parallel(self, make_attention):
        self.attn = make_attention(_local_attn(0), scatter_idx=2, gather_idx=1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).unbind(2)
        return self.proj(self.attn(q, k, v, 0).reshape(b, s, 32))


def _train(rank, world, sp, stage, mode):
    _ds_init()
    from megatron_sp_ext.deepspeed import initialize
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "sequence_parallel_size": sp,
           "sequence_parallel_ext": {"mode": mode, "head_chunks": 2 if (mode == "hcms" and sp == 2) else 1}}
    engine, *_ = initialize(model=_TinyAttentionModel(), config=cfg, num_heads=4)
    gen = torch.Generator().manual_seed(3)
    s = 16
    x_full, y_full = torch.randn(1, s, 32, generator=gen), torch.randn(1, s, 32, generator=gen)
    sl = s // sp
    r = dist.get_rank() % sp
    x, y = x_full[:, r * sl:(r + 1) * sl], y_full[:, r * sl:(r + 1) * sl]
    losses = []
    for _ in range(3):
        out = engine(x)
        local = ((out - y) ** 2).sum()
        engine.backward(local * sp / (s * 32))  # DeepSpeed averages grads over the sp x dp ranks
        engine.step()
        tot = local.detach().clone()
        dist.all_reduce(tot, group=engine.seq_parallel_group if sp > 1 else None)
        losses.append(tot.item() / (s * 32))
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_initialize_zero_stages_match_sp1(stage):
    ref = run_ranks(_train, 1, 1, stage, "ulysses", timeout=300)[0]
    for sp, mode in ((2, "hcms"), (4, "ring" if stage == 2 else "hcms")):
        got = run_ranks(_train, sp, sp, stage, mode, timeout=300)
        for r in range(sp):
            for a, b in zip(got[r], ref):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"ZeRO-{stage} SP={sp} {mode}: {got[r]} vs {ref}"
        assert ref[2] < ref[0]  # it trains


def _bad(rank, world, block, sp):
    _ds_init()
    from megatron_sp_ext.deepspeed import initialize
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "sequence_parallel_size": sp, "sequence_parallel_ext": block}
    try:
        initialize(model=_TinyAttentionModel(), config=cfg, num_heads=4)
    except SPConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("block,sp,key", [
    ({"mode": "bogus"}, 2, "sequence_parallel_ext.mode='bogus'"),
    ({"mode": "hcms", "head_chunks": 0}, 2, "sequence_parallel_ext.head_chunks=0"),
    ({"mode": "hcms"}, 3, "sequence_parallel_size=3 does not divide the world size 2"),
    ({"mode": "tas"}, 2, "needs a multi-machine mesh"),
    ({"mode": "hcms", "chunks": 2}, 2, "sequence_parallel_ext.chunks is not a known setting"),
])
def test_bad_json_fails_before_training(block, sp, key):
    msg = run_ranks(_bad, 2, block, sp)[0]
    assert key in msg, msg
    assert "\n" not in msg


def test_example_configs_are_valid():
    import glob
    import os

    from megatron_sp_ext.deepspeed import validate_deepspeed_config
    files = glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "deepspeed", "*.json"))
    assert files
    for f in files:
        with open(f) as fh:
            cfg = json.load(fh)
        validate_deepspeed_config(cfg, world_size=max(8, cfg.get("sequence_parallel_size", 1)), num_heads=12)
