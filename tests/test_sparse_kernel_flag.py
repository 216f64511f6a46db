"""--sparse-attention-kernel (issue #53: loss curves of a sparse run on FA4 against the same run on flex / math): the
megatron entry's choice of the block-sparse self-attention kernel. Its choices are the registry's
(block_sparse.KERNELS), a kernel it cannot run is refused by name at parse time, the choice reaches every place the DiT runs block-sparse
attention (the SP=1 one-device core and the SP>1 factory attention, Ulysses and ring), and on CPU a run on the named
math kernel gives the losses of the same run on "auto" (which picks math there)."""
import pytest
import torch
import torch.distributed as dist

from megatron_sp_ext.attention import block_sparse, kernels
from megatron_sp_ext.attention.backends import get_backend, with_tile_kernel
from megatron_sp_ext.errors import SPConfigError
from training.video_dit import preset
from training.video_dit.engine import make_core
from training.video_dit.sparse import SPARSE_KERNEL_FLAG

CFG = preset("tiny")
TINY = ("--model", "tiny", "--frames", "4", "--latent-size", "8x8", "--quiet")
TILES = ("--sparse-attention", "tiles", "--sparse-tile", "1,2,2")


def _parse(flags):
    pytest.importorskip("megatron.core")
    from training.pretrain_video_dit import parse  # noqa: PLC0415
    return parse([*TINY, *flags])


def test_choices_are_the_registrys_kernels_with_block_sparsity():
    assert block_sparse.KERNELS[0] == "auto"
    for name in block_sparse.KERNELS[1:]:
        assert kernels.by_setting(name).caps.tiles != "none", name
    assert _parse(TILES + ("--sparse-topk", "2")).sparse_attention_kernel == "auto"
    for name in ("auto", "math"):   # those that run on CPU
        assert _parse(TILES + ("--sparse-topk", "2", SPARSE_KERNEL_FLAG, name)).sparse_attention_kernel == name


@pytest.mark.parametrize("flags,match", [
    ((SPARSE_KERNEL_FLAG, "cudnn"),   # a kernel without block sparsity is no choice
     f"argument {SPARSE_KERNEL_FLAG}: invalid choice: 'cudnn' (choose from "
     + ", ".join(repr(k) for k in block_sparse.KERNELS) + ")"),
    ((SPARSE_KERNEL_FLAG, "flex"),    # flex runs on CUDA only
     f"{SPARSE_KERNEL_FLAG}='flex' cannot run here (cpu, torch.float32): it does not run on cpu; use 'auto' "
     f"(kernels that run it here: math)"),
    ((SPARSE_KERNEL_FLAG, "fa4"), f"{SPARSE_KERNEL_FLAG}='fa4' cannot run here (cpu, torch.float32)"),
])
def test_a_kernel_that_cannot_run_is_refused_by_name(flags, match, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(TILES + ("--sparse-topk", "2") + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and match in err and len(err.strip().splitlines()) == 1, err


def test_a_named_kernel_without_tiles_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _parse((SPARSE_KERNEL_FLAG, "math"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{SPARSE_KERNEL_FLAG} math set with --sparse-attention none" in err, err


def test_with_tile_kernel_copies_and_refuses_unknown_names():
    base = get_backend("auto", "--sp-attention-backend")
    assert with_tile_kernel(base, "auto") is base
    fixed = with_tile_kernel(base, "math", SPARSE_KERNEL_FLAG)
    assert fixed is not base and type(fixed) is type(base) and base.tile_setting == "auto"
    assert fixed.tile_setting == "math" and get_backend("auto", "--sp-attention-backend").tile_setting == "auto"
    with pytest.raises(SPConfigError, match=f"{SPARSE_KERNEL_FLAG}='cudnn' is invalid: choose one of auto"):
        with_tile_kernel(base, "cudnn", SPARSE_KERNEL_FLAG)


def _sparse_call(core, s_local, world):
    """One block-sparse call of the core on [1, s_local, H, D] rows (8 tokens per block, every block selected)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, s_local, CFG.heads, CFG.head_dim, requires_grad=True) for _ in range(3))
    blocks = -(-s_local * world // 8)
    mask = torch.ones(1, blocks, blocks, dtype=torch.bool)
    return core(q, k, v, None, block_mask=mask, block_size=8)


def test_sp1_core_runs_the_named_kernel():
    """SP=1: the one-device core passes the flag's kernel on (flex cannot run on CPU: refused naming the flag; math
    gives auto's output, auto picking math on CPU)."""
    with pytest.raises(SPConfigError, match=f"{SPARSE_KERNEL_FLAG}='flex' cannot run here"):
        _sparse_call(make_core("ulysses", None, num_heads=CFG.heads, tile_setting="flex"), 32, 1)
    auto = _sparse_call(make_core("ulysses", None, num_heads=CFG.heads), 32, 1)
    named = _sparse_call(make_core("ulysses", None, num_heads=CFG.heads, tile_setting="math"), 32, 1)
    assert torch.equal(auto, named)


def _sp_core_runs_the_named_kernel(rank, world, mode):
    group = dist.group.WORLD
    auto = _sparse_call(make_core(mode, group, num_heads=CFG.heads), 16, world)
    core = make_core(mode, group, num_heads=CFG.heads, tile_setting="math")
    named = _sparse_call(core, 16, world)
    carried = core.attention.backend.tile_setting, core.attention.backend.tile_setting_name
    refused = ""
    if mode == "ulysses":   # refused before any exchange (a ring refuses mid-exchange: its group is then unusable)
        try:
            _sparse_call(make_core(mode, group, num_heads=CFG.heads, tile_setting="flex"), 16, world)
        except SPConfigError as e:
            refused = str(e)
    return refused, torch.equal(auto, named), carried


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_sp2_factory_attention_runs_the_named_kernel(mode):
    """SP=2: the factory's attention (its backend with the flag's block kernel) passes it on, in the Ulysses and the
    ring block-sparse paths (math named: auto's output, auto picking math on CPU; flex named: refused by name)."""
    from tests.harness import run_ranks  # noqa: PLC0415
    for refused, same, carried in run_ranks(_sp_core_runs_the_named_kernel, 2, mode):
        assert same and carried == ("math", SPARSE_KERNEL_FLAG)
        if mode == "ulysses":
            assert f"{SPARSE_KERNEL_FLAG}='flex' cannot run here" in refused, refused


def test_a_ring_refuses_a_kernel_without_log_sum_exp_by_name():
    """The ring's block-sparse steps need forward-with-lse: flex (plain calls only) is refused naming the flag."""
    be = with_tile_kernel("auto", "flex", SPARSE_KERNEL_FLAG, "--sp-attention-backend")
    q = torch.randn(1, 2, 16, 8)
    ts = block_sparse.full_sequence_slice(torch.ones(1, 2, 2, dtype=torch.bool), 8, 16, None, q.device)
    with pytest.raises(SPConfigError, match=f"{SPARSE_KERNEL_FLAG}='flex' cannot run here"):
        be.forward_lse(q, q, q, causal=False, softmax_scale=0.3, tiles=ts)


def _entry_run(rank, world, sparse, kernel, sp=1, mode="ulysses", steps=3):
    from training import pretrain_video_dit  # noqa: PLC0415
    argv = ["--model", "tiny", "--train-iters", str(steps), "--frames", "4,3", "--latent-size", "8x8", "--quiet",
            "--sparse-attention", "tiles", "--sparse-tile", "1,2,2", *sparse, SPARSE_KERNEL_FLAG, kernel,
            "--context-parallel-size", str(sp), "--cp-comm-type", mode]
    return pretrain_video_dit.main(argv)["losses"]


SPARSE = {"topk": ("--sparse-topk", "3"), "window": ("--sparse-window", "1,0,1")}


@pytest.mark.parametrize("kind", ["topk", "window"])
@pytest.mark.parametrize("sp,mode", [(1, "ulysses"), (2, "ulysses"), (2, "ring")])
def test_entry_math_kernel_gives_autos_losses(kind, sp, mode):
    """A short CPU run (tiny preset, 3 steps) on --sparse-attention-kernel math gives the losses of the same run on
    auto (the same kernel on CPU: identical up to fp32 rounding), at SP=1 and SP=2."""
    pytest.importorskip("megatron.core")
    from tests.harness import run_ranks  # noqa: PLC0415
    auto = run_ranks(_entry_run, sp, SPARSE[kind], "auto", sp, mode)
    math = run_ranks(_entry_run, sp, SPARSE[kind], "math", sp, mode)
    for a, m in zip(auto, math):
        assert len(a) == 3 and all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a, m)), (kind, sp, mode, a, m)
