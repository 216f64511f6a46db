"""FlashAttention-4 as the local kernel ("fa4"): what "auto" and "fa4" pick, what is refused by name, and every mode
on it against float64 (output and every input gradient). On the CPU FA4's block calls are tests/fake_fa4.py's (the
library's own fa4 glue, dispatch, GQA handling and varlen calls run for real); the CUDA suite's fa4 family runs the
real kernel on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.attention import backends, lse_kernels, varlen
from megatron_sp_ext.attention.kernels import fa4
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.factory import make_attention
from megatron_sp_ext.sp.placement import pieces
from tests import fake_cudnn, fake_fa4
from tests.harness import run_ranks
from tests.reference import TOL, pad_mask
from tests.sp_check import run_case
from tests.gpu.suite_judge import verdict

F32 = torch.float32
MESH_MODES = ("usp", "tas", "torus")


def _shard(placement):
    def shard(x, r, w):
        return torch.cat([x[:, a:a + n] for a, n in pieces(placement, r, w, x.shape[1])], dim=1)
    return shard


# ------------------------------------------------------------------------------------------- refusals

def test_not_installed_is_refused_naming_the_setting_and_the_install(monkeypatch):
    monkeypatch.setattr(fa4, "installed", lambda: False)
    monkeypatch.setattr(backends, "_REGISTRY", backends.BackendRegistry())
    for setting in ("--sp-attention-backend", "sequence_parallel_ext.backend", "backend"):
        with pytest.raises(SPConfigError, match=rf"{setting}='fa4' needs the package 'flash-attn-4'.*"
                                                r"pip install 'megatron_sp_ext\[fa4\]'"):
            backends.get_backend("fa4", setting)
    assert "fa4" not in backends.available_backends()
    assert not lse_kernels.available("fa4", torch.device("cpu"), torch.bfloat16)
    assert lse_kernels.best(torch.device("cpu"), torch.bfloat16, 64) == "flash"   # auto: today's kernels


def test_why_not_names_device_dtype_and_head_dim(monkeypatch):
    monkeypatch.setattr(fa4, "installed", lambda: True)
    cpu = torch.device("cpu")
    assert "NVIDIA GPUs only" in fa4.why_not(cpu, torch.bfloat16)
    assert fa4.head_dim_ok(128, cpu) and fa4.head_dim_ok(256, cpu) and fa4.head_dim_ok(64, cpu)
    assert not fa4.head_dim_ok(100, cpu) and not fa4.head_dim_ok(512, cpu) and not fa4.head_dim_ok(4, cpu)
    # its backward was measured wrong at 8 and 16 on an H100 (2026-11-25): refused below MIN_HEAD_DIM
    assert not fa4.head_dim_ok(8, cpu) and not fa4.head_dim_ok(16, cpu) and not fa4.head_dim_ok(32, cpu)
    fake_fa4.install(monkeypatch, dtypes=(torch.bfloat16,), head_dims=(16,))
    q16, q32 = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 32)
    for q, why in ((q16, r"takes bf16 or fp16, not torch.float32"), (q32.bfloat16(), r"head dim 32")):
        be = backends.get_backend("fa4", "--sp-attention-backend")
        with pytest.raises(SPConfigError, match=rf"--sp-attention-backend='fa4' cannot run here.*{why}.*use 'auto'"):
            be(q, q, q, causal=False, softmax_scale=0.25)
        with pytest.raises(SPConfigError, match=r"--sp-attention-backend='fa4' cannot run here"):
            be.forward_lse(q, q, q, causal=False, softmax_scale=0.25)


def test_attention_dropout_is_refused_by_name():
    with pytest.raises(SPConfigError, match=r"--attention-dropout=0.1 is not supported by "
                                            r"--sp-attention-backend='fa4'.*no attention dropout"):
        spx.SPConfig(backend="fa4", dropout_p=0.1, source="megatron")
    with pytest.raises(SPConfigError, match=r"sequence_parallel_ext.dropout_p=0.1 is not supported by "
                                            r"sequence_parallel_ext.backend='fa4'"):
        spx.SPConfig(backend="fa4", dropout_p=0.1, source="deepspeed")
    assert spx.SPConfig(backend="fa4", source="deepspeed").backend == "fa4"
    assert spx.SPConfig(backend="fa4", source="megatron").backend == "fa4"


def _dropout_worker(rank, world):
    q = torch.randn(1, 4, 4, 16, dtype=torch.bfloat16)
    try:
        spx.ulysses_attention(q, q, q, dist.group.WORLD, backend="fa4", dropout_p=0.1)
    except SPConfigError as e:
        return str(e)
    return "no error"


def test_functional_dropout_with_fa4_is_refused(monkeypatch):
    fake_fa4.install(monkeypatch)
    for msg in run_ranks(_dropout_worker, 2):
        assert "backend='fa4' cannot apply attention dropout (dropout_p=0.1)" in msg


# ------------------------------------------------------------------------------------------- dispatch

def test_auto_takes_fa4_for_plain_and_block_calls_and_keeps_gqa_unexpanded(monkeypatch):
    fake = fake_fa4.install(monkeypatch)
    be = backends.get_backend("auto")
    q = torch.randn(1, 8, 24, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, 24, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    assert be.kernel_for(q) == "fa4"   # after its probe against math (calls to the fake, dropped here)
    fake.calls.clear()
    out = be(q, k, v, causal=True, softmax_scale=0.25)
    out.float().sum().backward()
    assert [c[0] for c in fake.calls] == ["fwd", "bwd"]
    assert all(c[1:] == (8, 2) for c in fake.calls)           # k/v reach FA4 with their 2 heads
    assert be.chosen() == {("cpu", torch.bfloat16, 16): "fa4"}
    o, lse = be.forward_lse(q.detach(), k.detach(), v.detach(), causal=False, softmax_scale=0.25)
    assert o.shape == (1, 8, 24, 16) and lse.shape == (1, 8, 24) and lse.dtype == F32
    assert [c[0] for c in fake.calls][-1] == "fwd"


def test_auto_falls_back_where_fa4_cannot_run_and_fixed_kernels_stay_fixed(monkeypatch):
    fake = fake_fa4.install(monkeypatch, dtypes=(torch.bfloat16,), head_dims=(16,))
    be = backends.get_backend("auto")
    for q in (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 24, dtype=torch.bfloat16)):   # fp32; head dim 24
        be.forward_lse(q, q, q, causal=False, softmax_scale=0.25)
        be(q, q, q, causal=False, softmax_scale=0.25)
    assert fake.calls == []
    assert set(be.chosen().values()) == {"flash"}
    fake_cudnn.install(monkeypatch)
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    backends.get_backend("cudnn").forward_lse(q, q, q, causal=False, softmax_scale=0.25)
    assert fake.calls == []                                    # "cudnn" never runs FA4


def test_varlen_methods_with_fa4(monkeypatch):
    fake_fa4.install(monkeypatch)
    q = torch.randn(1, 4, 20, 16)
    fa4_be, auto_be = backends.get_backend("fa4"), backends.get_backend("auto")
    cu = (0, 7, 7, 20)
    assert varlen.methods_here(fa4_be, q, cu) == ["per_sample", "grouped", "fa4_varlen"]
    assert varlen.methods_here(auto_be, q, cu)[-1] == "fa4_varlen"
    assert "fa4_varlen" not in varlen.methods_here(fa4_be, q, (0, 1, 20))   # a one-token sample: per-sample math
    assert "fa4_varlen" not in varlen.methods_here(backends.get_backend("math"), q, cu)


# ------------------------------------------------------------------------------------ every mode on FA4

def _every_mode(rank, world, fake, causal, placement, modes):
    g, out = dist.group.WORLD, []
    b, s, h, hkv, d = 1, 48, 8, 4, 16
    for mode in modes:
        cfg = spx.SPConfig(mode=mode, backend="fa4", head_chunks=2, nodes=2 if mode in MESH_MODES else None)
        attn = make_attention(cfg, g, num_heads=h, num_kv_heads=hkv, placement=placement)
        before, errs = len(fake.calls), {}
        run_case(lambda q, k, v: attn(q, k, v, causal=causal), rank, world, b=b, s=s, h=h, hkv=hkv, d=d, dtype=F32,
                 causal=causal, shard=_shard(placement), errors=errs, seed=len(out))
        out.append((mode, errs, {c[0] for c in fake.calls[before:]}))
    return out


@pytest.mark.parametrize("world,causal,placement", [(2, False, "contiguous"), (2, True, "zigzag"),
                                                    (4, True, "contiguous"), (4, True, "zigzag")])
def test_every_mode_on_fa4_matches_float64(monkeypatch, world, causal, placement):
    fake = fake_fa4.install(monkeypatch)
    modes = ("ulysses", "hcms", "ring", "tasp") + (MESH_MODES if world == 4 else ())
    for rank_result in run_ranks(_every_mode, world, fake, causal, placement, modes, timeout=300):
        for mode, errs, kinds in rank_result:
            assert kinds >= {"fwd", "bwd"}, (mode, kinds)       # the mode ran its blocks on FA4
            assert max(errs.values()) < TOL[F32], (mode, errs)


def _padded_and_packed(rank, world, fake):
    g, res = dist.group.WORLD, []
    b, s, h, hkv, d, pad = 1, 32, 4, 2, 16, 5
    mask = pad_mask(s, s - pad, True)
    for name, fn in (("ulysses kv_valid_len", lambda q, k, v: spx.ulysses_attention(
            q, k, v, g, causal=True, backend="fa4", kv_valid_len=s - pad)),
                     ("ring kv_valid_len", lambda q, k, v: spx.ring_attention(
            q, k, v, g, causal=True, backend="fa4", kv_valid_len=s - pad, placement="contiguous"))):
        errs = {}
        run_case(fn, rank, world, b=b, s=s, h=h, hkv=hkv, d=d, dtype=F32, causal=True, mask=mask,
                 compare_rows=s - pad, errors=errs)
        res.append((name, errs))
    cu_list = [0, 8, 12, 24, 32]   # every sample divides by P=2 (contiguous)
    cu = torch.tensor(cu_list)
    for name, fn in (("ulysses fa4_varlen", lambda q, k, v: spx.ulysses_attention(
            q, k, v, g, causal=True, backend="fa4", cu_seqlens=cu, varlen_kernel="fa4_varlen")),
                     ("ulysses per_sample", lambda q, k, v: spx.ulysses_attention(
            q, k, v, g, causal=False, backend="fa4", cu_seqlens=cu)),
                     ("ring packed", lambda q, k, v: spx.ring_attention(
            q, k, v, g, causal=True, backend="fa4", cu_seqlens=cu, placement="contiguous"))):
        errs = {}
        causal = name != "ulysses per_sample"
        shard = lambda x, r, w: torch.cat([x[:, a + r * (e - a) // w:a + (r + 1) * (e - a) // w]  # noqa: E731
                                           for a, e in zip(cu_list, cu_list[1:])], dim=1)
        run_case(fn, rank, world, b=b, s=s, h=h, hkv=hkv, d=d, dtype=F32, causal=causal, shard=shard,
                 segments=cu_list, errors=errs)
        res.append((name, errs))
    return res, sorted({c[0] for c in fake.calls})


def test_key_padding_and_packed_samples_on_fa4(monkeypatch):
    fake = fake_fa4.install(monkeypatch)
    for results, kinds in run_ranks(_padded_and_packed, 2, fake):
        assert {"fwd", "bwd", "varlen_fwd", "varlen_bwd"} <= set(kinds)
        for name, errs in results:
            assert max(errs.values()) < TOL[F32], (name, errs)


def _interleaved(rank, world):
    """FA4 and cuDNN calls of equal shapes in one process, both orders, other placements between them."""
    g, res = dist.group.WORLD, []
    for backend, placement, c in (("fa4", "zigzag", 1), ("cudnn", "zigzag", 1), ("fa4", "contiguous", 2),
                                  ("cudnn", "contiguous", 1), ("fa4", "zigzag", 2), ("auto", "zigzag", 1)):
        errs = {}
        run_case(lambda q, k, v: spx.ulysses_attention(q, k, v, g, head_chunks=c, causal=True, backend=backend,
                                                       placement=placement),
                 rank, world, b=1, s=32, h=4, hkv=4, d=16, dtype=F32, causal=True, shard=_shard(placement), errors=errs)
        res.append((backend, placement, c, errs))
    return res


def test_fa4_and_cudnn_calls_interleaved(monkeypatch):
    fake_cudnn.install(monkeypatch)   # makes cuDNN the only fused kernel: FA4 joins it below
    fake_fa4.install(monkeypatch)
    monkeypatch.setattr(lse_kernels, "available", lambda kernel, device, dtype, head_dim=None: kernel in
                        ("fa4", "cudnn", "math"))
    monkeypatch.setattr(lse_kernels, "best", lambda device, dtype, head_dim=None: "fa4")
    for rank_result in run_ranks(_interleaved, 2):
        for backend, placement, c, errs in rank_result:
            assert max(errs.values()) < TOL[F32], (backend, placement, c, errs)


def test_cuda_fa4_family_dry_run_on_cpu(monkeypatch):
    """The CUDA suite's fa4 family (tests/gpu/cuda_fa4.py) on CPU ranks at 1/16 of its lengths, FA4 and cuDNN faked: the
    family's own cases and counts, so a GPU run checks kernels, not the family's code."""
    from tests.gpu import cuda_fa4  # noqa: PLC0415
    fake_cudnn.install(monkeypatch)
    fake_fa4.install(monkeypatch)
    monkeypatch.setattr(lse_kernels, "available", lambda kernel, device, dtype, head_dim=None: kernel in
                        ("fa4", "cudnn", "math"))
    monkeypatch.setattr(cuda_fa4, "DEV", "cpu")
    monkeypatch.setattr(cuda_fa4, "SHRINK", 16)
    records = run_ranks(cuda_fa4.fa4_family, 2, timeout=300)[0]
    assert len(records) == 50
    for r in records:
        assert not verdict(r), (verdict(r), r)


def test_the_user_line_names_the_kernel_and_the_flag(monkeypatch):
    pytest.importorskip("megatron.core")
    from training.video_dit.engine import attention_kernel_line  # noqa: PLC0415
    cpu = torch.device("cpu")
    assert attention_kernel_line("auto", "--sp-attention-backend", cpu, torch.float32, 64) == \
        "attention kernel: FlashAttention-2 (torch SDPA) on cpu/float32; change with --sp-attention-backend"
    fake_fa4.install(monkeypatch, dtypes=(torch.bfloat16,), head_dims=(64, 128))
    assert attention_kernel_line("auto", "--sp-attention-backend", cpu, torch.bfloat16, 128).startswith(
        "attention kernel: FlashAttention-4 on cpu/bfloat16")
    assert "FlashAttention-2" in attention_kernel_line("auto", "x", cpu, torch.bfloat16, 96)   # a head dim FA4 refuses


def test_block_lists_match_a_sort_of_each_row():
    """FA4's block-sparse index lists (counts, then every column: the selected ones ascending, then the rest
    ascending, full width, int32, contiguous) equal a stable sort of each row, on masks from empty to full."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 1, 1), (3, 5, 7), (2, 40, 33, 33), (1, 4, 1, 256)]:
        for p in (0.0, 0.1, 0.5, 1.0):
            sel = torch.rand(shape, generator=gen) < p
            col = torch.arange(shape[-1])
            want = torch.argsort((~sel).long() * shape[-1] + col, dim=-1).to(torch.int32)
            counts, idx = fa4.block_lists(sel)
            assert torch.equal(counts, sel.sum(-1, dtype=torch.int32))
            assert torch.equal(idx, want) and idx.dtype == torch.int32 and idx.is_contiguous()


def test_backward_runs_fa4s_deterministic_form_under_torchs_switch(monkeypatch):
    """--deterministic-mode turns torch's deterministic algorithms on: FA4's dense and varlen backwards are then called
    with deterministic=True (its fixed-order dq sum), and without the switch with False; the block-sparse backward,
    which has no deterministic form here, refuses to run under the switch, naming it."""
    fake = fake_fa4.install(monkeypatch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for on in (True, False):
            torch.use_deterministic_algorithms(on)
            out, lse = fa4.forward(q, k, v, 0.125, causal=True)
            dq, dk, dv = fa4.backward(torch.ones_like(out), q, k, v, out, lse, 0.125, True)
            assert fake.calls_log[-1]["deterministic"] is on and dq.shape == q.shape
            out_p, lse_p = fa4.varlen_forward(q, k, v, (0, 12, 32), 0.125, causal=False)
            fa4.varlen_backward(torch.ones_like(out_p), q, k, v, out_p, lse_p, (0, 12, 32), 0.125, False)
            assert fake.calls_log[-1]["deterministic"] is on
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="--deterministic-mode"):
            fa4.tile_backward(None, q, k, v, None, None, 0.125, False, None)
    finally:
        torch.use_deterministic_algorithms(was)
