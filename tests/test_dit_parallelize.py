"""The DiT's one sequence-parallel call (training/video_dit/parallel.py ``parallelize``): both entries build their
attention through it (a source scan and a spy on each entry at SP=1 and SP=2: one call, the same core family),
parallelize at SP=2 equals SP=1 (float64 model: loss and every parameter gradient), and the handle's remove()
puts the model back as built."""
import ast
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron_sp_ext import SPConfig, SPConfigError  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.reference import rel_err  # noqa: E402
from tests.sp_reduce import loss_and_grads  # noqa: E402
from training.video_dit import VideoDiT, preset  # noqa: E402
from training.video_dit.data import SyntheticVideoLatents  # noqa: E402
from training.video_dit.engine import flow_matching_batch, local_loss, prepare  # noqa: E402
from training.video_dit.model import local_core  # noqa: E402
from training.video_dit.parallel import DiTParallelConfig, parallelize  # noqa: E402
from training.video_dit.sparse import SparseSpec  # noqa: E402

CFG = preset("tiny")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES = ("training/pretrain_video_dit.py", "training/train_deepspeed.py")
# what parallelize does in one place: no caller outside training/video_dit/parallel.py in the training package
STEPS = {"set_sparse_attention", "set_recompute", "set_cpu_offloading", "set_fused_elementwise", "set_packed_qkv",
         "set_attention_core", "set_async_attention", "set_layer_policy", "make_core", "core_of",
         "make_dynamic_core"}


def _calls(path: str) -> list:
    """Names of every function / method called in ``path``."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return [n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
            for n in ast.walk(tree) if isinstance(n, ast.Call)]


def test_entries_call_parallelize_once_and_no_step():
    for path in ENTRIES:
        calls = _calls(path)
        assert calls.count("parallelize") == 1, path
        assert not STEPS & set(calls), (path, STEPS & set(calls))
    training = os.path.join(ROOT, "training")
    for dirpath, _, files in os.walk(training):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
            if f.endswith(".py") and rel not in ("training/video_dit/parallel.py", "training/video_dit/engine.py",
                                                 "training/video_dit/model.py"):
                assert not STEPS & set(_calls(rel)), (rel, STEPS & set(_calls(rel)))


def _spy_run(rank, world, entry: str, sp: int):
    import training.video_dit.parallel as par
    if entry == "megatron":
        from training import pretrain_video_dit as mod
        argv = ["--model", "tiny", "--context-parallel-size", str(sp), "--cp-comm-type", "ulysses"]
        run = lambda a: mod.main(a)  # noqa: E731
    else:
        from training import train_deepspeed as mod
        argv = ["--deepspeed-config", os.path.join(ROOT, "configs", "deepspeed", "cpu_tiny_hcms.json"),
                "--model", "tiny"]
        cfg = {"sequence_parallel_size": sp, "zero_optimization": {"stage": 1},
               "sequence_parallel_ext": {"mode": "ulysses"}}
        run = lambda a: mod.main(a, config=cfg)  # noqa: E731
    seen, real, real_core = [], mod.parallelize, par.core_of
    cores = []

    def spy(model, group, config):
        handle = real(model, group, config)
        seen.append((handle.sp_size, handle.core.__qualname__, handle.core.group is None,
                     all(b.attn.core is handle.core for b in model.blocks)))
        return handle

    def core_spy(*a, **kw):
        cores.append(1)
        return real_core(*a, **kw)
    mod.parallelize, par.core_of = spy, core_spy
    try:
        run(argv + ["--train-iters", "1", "--frames", "4", "--latent-size", "6x10", "--quiet"])
    finally:
        mod.parallelize, par.core_of = real, real_core
    return seen, len(cores)


@pytest.mark.parametrize("entry", ["megatron", "deepspeed"])
@pytest.mark.parametrize("sp", [1, 2])
def test_entry_builds_attention_through_parallelize(entry, sp):
    """Each entry calls parallelize once; its core comes from engine.core_of (one family for both entries): the
    factory's attention at SP=1 (its one-rank path) and at SP=2, installed in every block."""
    for seen, n_core in run_ranks(_spy_run, sp, entry, sp, timeout=120):
        assert n_core == 1 and len(seen) == 1, (seen, n_core)
        size, qualname, one_rank, everywhere = seen[0]
        assert size == sp and everywhere and one_rank == (sp == 1)
        assert qualname == "core_of.<locals>.core", qualname


def _step(group, config):
    """(loss, gradients, output) of one float64 step of the tiny DiT made parallel over ``group``."""
    torch.manual_seed(5)
    model = VideoDiT(CFG).double()
    handle = parallelize(model, group, config)
    data = SyntheticVideoLatents(CFG.in_channels, (4,), 6, 10, CFG.text_len, CFG.text_dim, seed=1)
    batch = flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch)
    batch.update(x=batch["x"].double(), target=batch["target"].double(), t=batch["t"].double(),
                 text=batch["text"].double())
    sp = dist.get_world_size(group) if group is not None else 1
    inp = prepare(batch, dist.get_rank(group) if group is not None else 0, sp, "cpu")
    loss, grads = loss_and_grads(model, local_loss(model, inp), group)
    assert handle.sp_size == sp
    return loss, grads


def _sp_vs_sp1(rank, world, mode, async_qkv):
    cfg = DiTParallelConfig(sp=SPConfig(mode=mode, head_chunks=2 if mode == "hcms" else 1, async_qkv=async_qkv),
                            recompute_granularity="selective", recompute_modules=("core_attn",))
    ref_loss, ref_grads = _step(None, DiTParallelConfig(recompute_granularity="selective"))
    loss, grads = _step(dist.group.WORLD, cfg)
    # float64 model, but the DiT's RMSNorm computes in float32 (fused.rms_norm): the orders agree to float32 rounding (~1e-7), not 1e-10
    assert abs(loss - ref_loss) <= 1e-7 * abs(ref_loss), (loss, ref_loss)
    assert sum(int(r.abs().sum() > 0) for r in ref_grads) > len(ref_grads) // 2   # adaLN-zero: some start at 0
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        if r.abs().sum() > 0:
            assert rel_err(g, r) < 1e-6, (i, rel_err(g, r))
        else:
            assert g.abs().max() <= 1e-12, (i, g.abs().max())
    return len(grads)


@pytest.mark.parametrize("mode,async_qkv", [("ulysses", "off"), ("hcms", "on")])
def test_parallelize_sp2_matches_sp1_float64(mode, async_qkv):
    assert run_ranks(_sp_vs_sp1, 2, mode, async_qkv, timeout=120) == [len(list(VideoDiT(CFG).parameters()))] * 2


def _forward(model):
    torch.manual_seed(3)
    x = torch.randn(1, 12, CFG.patch_volume)
    ids = torch.arange(12)
    return model(x, torch.rand(1), torch.randn(1, CFG.text_len, CFG.text_dim), ids, (1, 3, 4))


def test_remove_restores_the_model():
    torch.manual_seed(5)
    model = VideoDiT(CFG)
    names = [n for n, _ in model.named_parameters()]
    before = _forward(model)
    handle = parallelize(model, None, DiTParallelConfig(
        sparse=SparseSpec((1, 1, 2), topk=1), recompute_granularity="selective",
        recompute_modules=("outside_core_attn",), cpu_offloading=True, packed_qkv=True))
    assert all(b.attn.core is handle.core and b.attn.sparse_gate is not None for b in model.blocks)
    assert all(b.recompute_outside_core and b.cpu_offload and b.attn.packed_qkv for b in model.blocks)
    with pytest.raises(SPConfigError, match="already parallelized"):
        parallelize(model, None)
    handle.remove()
    handle.remove()  # idempotent
    assert [n for n, _ in model.named_parameters()] == names and model.sparse is None
    for b in model.blocks:
        assert b.attn.core is local_core and b.attn.sp_layer is None and b.attn.sparse_gate is None
        assert not (b.recompute_block or b.recompute_mlp or b.recompute_outside_core or b.attn.recompute_core
                    or b.cpu_offload or b.attn.packed_qkv)
        assert b.ops is model.ops and model.ops.backend is None
    assert torch.equal(_forward(model), before)
    parallelize(model, None).remove()  # a removed model can be parallelized again


def test_refuses_attention_dropout_by_its_setting():
    for source, name in (("deepspeed", "sequence_parallel_ext.dropout_p"), ("megatron", "--attention-dropout")):
        cfg = SPConfig(dropout_p=0.1, source=source)
        with pytest.raises(SPConfigError, match=name.replace(".", r"\.") + r"=0\.1: the video DiT"):
            parallelize(VideoDiT(CFG), None, DiTParallelConfig(sp=cfg))
