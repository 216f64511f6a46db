"""Attention dropout (Megatron's --attention-dropout, default 0.1): applied by the Ulysses family (ulysses,
hcms) inside the local attention, with the SAME mask in forward and backward, only in training; refused by
name, while the settings are validated, by every mode that merges partial results (ring family, meshes)."""
import argparse

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.errors import SPConfigError
from tests.harness import run_ranks

H, D = 4, 8
REFUSED = ("ring", "tasp", "usp", "tas", "torus")


def _shards(world, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, H, D, generator=g, dtype=torch.float64) for _ in range(4)]


def _dropout_ulysses(rank, world):
    group = dist.group.WORLD
    q, k, v, u = _shards(world, 1 + rank)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(50 + rank), dtype=q.dtype)
    for chunks in (1, 2):
        ref = spx.ulysses_attention(q, k, v, group, head_chunks=chunks)
        torch.manual_seed(7)
        same = spx.ulysses_attention(q, k, v, group, head_chunks=chunks, dropout_p=0.0)
        assert torch.equal(ref, same)
        torch.manual_seed(7)
        dropped = spx.ulysses_attention(q, k, v, group, head_chunks=chunks, dropout_p=0.3)
        flag = torch.tensor([float((dropped - ref).abs().max() > 1e-3)])
        dist.all_reduce(flag)
        assert flag.item() > 0, f"C={chunks}: dropout changed nothing"
        # forward/backward use the same mask: for a fixed mask out is linear in v, so with the same seed
        # out(v + eps u) - out(v) == eps * (d out / d v) u, i.e. <go, delta_out> == eps * <dv, u> (summed over ranks)
        eps = 1e-3
        torch.manual_seed(11)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = spx.ulysses_attention(qq, kk, vv, group, head_chunks=chunks, dropout_p=0.3)
        out.backward(go)
        torch.manual_seed(11)
        out2 = spx.ulysses_attention(q, k, v + eps * u, group, head_chunks=chunks, dropout_p=0.3)
        lhs = torch.stack([(go * (out2 - out.detach())).sum(), eps * (vv.grad * u).sum()])
        dist.all_reduce(lhs)
        assert abs(lhs[0] - lhs[1]) <= 1e-9 * max(1.0, abs(lhs[1].item())), f"C={chunks}: {lhs.tolist()}"
    # HCMS with dropout 0 stays bit-identical to Ulysses
    assert torch.equal(spx.ulysses_attention(q, k, v, group, head_chunks=2, dropout_p=0.0),
                       spx.ulysses_attention(q, k, v, group, head_chunks=1))
    return True


def test_ulysses_and_hcms_apply_dropout_with_one_mask():
    run_ranks(_dropout_ulysses, 2)


def _megatron_dropout(rank, world):
    """Megatron core attention, CP=2: ulysses/hcms apply --attention-dropout in training and not in eval."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_sp_ext.megatron import SPTransformerConfig
    from megatron_sp_ext.megatron.core_attention import SPDotProductAttention
    ps.initialize_model_parallel(context_parallel_size=world)
    try:
        g = torch.Generator().manual_seed(3 + rank)
        q, k, v = (torch.randn(4, 2, H, D, generator=g) for _ in range(3))
        for mode in ("ulysses", "hcms", "auto"):
            outs = {}
            for p in (0.0, 0.25):
                cfg = SPTransformerConfig(num_layers=1, hidden_size=H * D, num_attention_heads=H,
                                          context_parallel_size=world, cp_comm_type=mode, hcms_head_chunks=2,
                                          attention_dropout=p, hidden_dropout=0.0)
                core = SPDotProductAttention(cfg, 1, AttnMaskType.causal, "self", cp_comm_type=mode)
                for training in (True, False):
                    core.train(training)
                    torch.manual_seed(5)
                    outs[p, training] = core(q, k, v, None)
            assert torch.equal(outs[0.0, True], outs[0.0, False]), mode
            assert torch.equal(outs[0.25, False], outs[0.0, False]), f"{mode}: dropout in eval"
            diff = torch.tensor([float(not torch.equal(outs[0.25, True], outs[0.0, True]))])
            dist.all_reduce(diff)
            assert diff.item() > 0, f"{mode}: --attention-dropout ignored in training"
    finally:
        ps.destroy_model_parallel()
    return True


def test_megatron_core_attention_applies_dropout_in_training_only():
    pytest.importorskip("megatron.core")
    run_ranks(_megatron_dropout, 2)


def _ds_dropout(rank, world):
    from megatron_sp_ext.deepspeed import SPDistributedAttention
    g = torch.Generator().manual_seed(9 + rank)
    q, k, v = (torch.randn(2, 4, H, D, generator=g) for _ in range(3))
    outs = {}
    for p in (0.0, 0.25):
        ds = SPDistributedAttention(None, dist.group.WORLD, 2, 1, mode="hcms", head_chunks=2, dropout_p=p)
        for training in (True, False):
            ds.train(training)
            torch.manual_seed(5)
            outs[p, training] = ds(q, k, v, 0, kv_valid_len=7)  # our kernels (padding path)
    assert torch.equal(outs[0.25, False], outs[0.0, False])
    diff = torch.tensor([float(not torch.equal(outs[0.25, True], outs[0.0, True]))])
    dist.all_reduce(diff)
    assert diff.item() > 0
    return True


def test_deepspeed_applies_dropout_with_our_kernels():
    pytest.importorskip("deepspeed")
    run_ranks(_ds_dropout, 2)


@pytest.mark.parametrize("mode", REFUSED)
def test_megatron_args_refuse_dropout_by_name(mode):
    pytest.importorskip("megatron.core")
    from megatron_sp_ext.megatron.arguments import add_arguments
    parser = add_arguments(argparse.ArgumentParser())
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--num-attention-heads", type=int, default=None)
    extra = ["--sp-nodes", "2"] if mode == "tas" else []
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-dropout", "0.1", "--cp-comm-type", mode, "--context-parallel-size", "4",
                           "--num-attention-heads", "8", *extra])
    from megatron_sp_ext.megatron.arguments import validate_args
    args = argparse.Namespace(cp_comm_type=[mode], hcms_head_chunks=1, sp_ring_variant="ring", sp_placement="auto",
                              sp_ulysses_size=None, sp_nodes=2, sp_attention_backend="auto", attention_dropout=0.1,
                              context_parallel_size=4, num_attention_heads=8, tensor_model_parallel_size=1)
    with pytest.raises(SPConfigError) as e:
        validate_args(args)
    msg = str(e.value)
    assert "--attention-dropout=0.1" in msg and f"--cp-comm-type={mode!r}" in msg, msg
    assert "--attention-dropout 0" in msg and "ulysses or hcms" in msg, msg
    args.attention_dropout = 0.0
    validate_args(args)  # 0 is fine
    for ok in ("ulysses", "hcms", "auto"):
        args.cp_comm_type, args.attention_dropout = [ok], 0.1
        validate_args(args)


def test_megatron_auto_refuses_dropout_where_it_would_not_run_ulysses():
    pytest.importorskip("megatron.core")
    from megatron_sp_ext.megatron.arguments import validate_args
    args = argparse.Namespace(cp_comm_type=["auto"], hcms_head_chunks=1, sp_ring_variant="ring", sp_placement="auto",
                              sp_ulysses_size=None, sp_nodes=None, sp_attention_backend="auto", attention_dropout=0.1,
                              context_parallel_size=4, num_attention_heads=2, tensor_model_parallel_size=1)
    with pytest.raises(SPConfigError, match=r"--attention-dropout=0.1 with --cp-comm-type='auto'"):
        validate_args(args)


def test_megatron_config_refuses_dropout_by_name():
    pytest.importorskip("megatron.core")
    from megatron_sp_ext.megatron import SPTransformerConfig
    with pytest.raises(SPConfigError, match=r"--attention-dropout=0.1 is not supported by --cp-comm-type='ring'"):
        SPTransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, cp_comm_type="ring")


@pytest.mark.parametrize("mode", REFUSED)
def test_deepspeed_json_refuses_dropout_by_name(mode):
    from megatron_sp_ext.deepspeed.initialize import validate_deepspeed_config
    block = {"sequence_parallel_size": 4, "sequence_parallel_ext": {"mode": mode, "dropout_p": 0.1, "nodes": 2}}
    with pytest.raises(SPConfigError) as e:
        validate_deepspeed_config(block, 4, num_heads=8)
    msg = str(e.value)
    assert "sequence_parallel_ext.dropout_p=0.1" in msg and f"sequence_parallel_ext.mode={mode!r}" in msg, msg
    block["sequence_parallel_ext"]["mode"] = "hcms"
    validate_deepspeed_config(block, 4, num_heads=8)


@pytest.mark.parametrize("mode", REFUSED)
def test_python_api_refuses_dropout_by_name(mode):
    with pytest.raises(SPConfigError, match=rf"dropout_p=0.1 is not supported by mode='{mode}'"):
        SPConfig(mode=mode, dropout_p=0.1)
    with pytest.raises(SPConfigError, match="dropout_p=1.5 is invalid"):
        SPConfig(mode="hcms", dropout_p=1.5)


def _factory_call_refuses(rank, world):
    from megatron_sp_ext.sp.factory import make_attention
    attn = make_attention(SPConfig(mode="ring"), dist.group.WORLD, num_heads=H)
    q = torch.randn(1, 4, H, D)
    with pytest.raises(SPConfigError, match="dropout_p=0.1 is not supported by mode='ring'"):
        attn(q, q, q, causal=False, dropout_p=0.1)
    return True


def test_factory_call_refuses_dropout_for_ring():
    run_ranks(_factory_call_refuses, 2)
