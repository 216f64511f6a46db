"""Megatron-core integration: a TransformerBlock with our core attention under real parallel_state
(CP=2, CP=4, TP=2 x CP=2) equals the same block on the full sequence with CP=1, for the output and
every parameter gradient (after the CP gradient all-reduce); plus flag parsing and validation."""
import argparse

import pytest
import torch

from megatron_sp_ext import make_attention
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.reference import rel_err  # noqa: E402


def _block(cp_comm_type, cp, tp, chunks, nodes, causal, layers=2):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_sp_ext.megatron import SPTransformerConfig, with_sp_core_attention
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    cfg = SPTransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=8, use_cpu_initialization=True,
                              context_parallel_size=cp, tensor_model_parallel_size=tp, cp_comm_type=cp_comm_type,
                              hidden_dropout=0.0, attention_dropout=0.0, hcms_head_chunks=chunks, sp_nodes=nodes,
                              bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False)
    torch.manual_seed(1234)
    spec = with_sp_core_attention(get_gpt_layer_local_spec(), no_mask=not causal)
    return TransformerBlock(cfg, spec)


def _assert_equals_full_sequence(block, x_full, dy_full, split, y, dx, grads, tag, **fwd_kwargs):
    """The same block run by one rank on the whole sequence (CP off, the parent's forward) must give this
    rank's shard of the output and input grad, and every parameter grad (already CP-reduced in ``grads``)."""
    for layer in block.layers:
        ca = layer.self_attention.core_attention
        ca.cp_group = None
        ca.attention = make_attention(ca.sp, None, num_heads=ca.attention.num_heads,
                                      num_kv_heads=ca.attention.num_kv_heads, layout="sbhd", placement="zigzag")
    xf = x_full.clone().requires_grad_()
    yf = block(xf, attention_mask=None, **fwd_kwargs)
    yf.backward(dy_full)
    assert rel_err(y, split(yf)) < 1e-5, f"{tag}: output {rel_err(y, split(yf))}"
    assert rel_err(dx, split(xf.grad)) < 1e-5, f"{tag}: input grad"
    for n, p in block.named_parameters():
        assert rel_err(grads[n], p.grad) < 1e-5, f"{tag}: grad of {n}: {rel_err(grads[n], p.grad)}"


def _megatron_equiv(rank, world, tp, cp, modes, hierarchical=None):
    from megatron.core import parallel_state as ps
    from megatron_sp_ext.megatron.compat import cp_rank_batch as get_batch_on_this_cp_rank
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 hierarchical_context_parallel_sizes=hierarchical)
    cp_group = ps.get_context_parallel_group()
    try:
        for mode, chunks, nodes, causal in modes:
            block = _block(mode, cp, tp, chunks, nodes, causal)
            if hierarchical:  # usp runs on Megatron's own two-level groups, no new communicators
                hcp = ps.get_hierarchical_context_parallel_groups()
                mesh = block.layers[0].self_attention.core_attention.mesh
                assert mesh.ulysses_group is hcp[0] and mesh.ring_group is hcp[1]
            s, b = 8 * cp, 2
            g = torch.Generator().manual_seed(7)
            x_full = torch.randn(s, b, 64, generator=g)
            dy_full = torch.randn(s, b, 64, generator=g)
            split = lambda t: get_batch_on_this_cp_rank({"x": t.transpose(0, 1)})["x"].transpose(0, 1)  # noqa: E731
            x = split(x_full).clone().requires_grad_()
            y = block(x, attention_mask=None)
            y.backward(split(dy_full))
            grads = {n: p.grad.clone() for n, p in block.named_parameters()}
            for gr in grads.values():  # Megatron's CP gradient reduction (DDP over dp x cp)
                dist.all_reduce(gr, group=cp_group)
            dx = x.grad.clone()
            block.zero_grad(set_to_none=True)
            # reference: the same weights, CP=1 on the full sequence
            _assert_equals_full_sequence(block, x_full, dy_full, split, y, dx, grads,
                                         f"{mode} C={chunks} TP={tp} CP={cp} causal={causal}")
    finally:
        ps.destroy_model_parallel()
    return True


MODES_CP2 = [("ulysses", 1, None, False), ("hcms", 2, None, True), ("ring", 1, None, True), ("tasp", 1, None, False),
             ("usp", 1, 2, False), ("tas", 1, 2, True), ("torus", 1, 2, True), ("auto", 1, None, False)]
MODES_CP4 = [("hcms", 2, None, False), ("hcms", 1, None, True), ("ring", 1, None, True), ("tasp", 1, None, True),
             ("usp", 1, 2, True), ("tas", 1, 2, False), ("torus", 1, 2, False)]


def test_block_cp2_all_modes():
    run_ranks(_megatron_equiv, 2, 1, 2, MODES_CP2, timeout=400)


def test_block_cp4():
    run_ranks(_megatron_equiv, 4, 1, 4, MODES_CP4, timeout=400)


def test_block_usp_on_hierarchical_cp_groups():
    run_ranks(_megatron_equiv, 4, 1, 4, [("usp", 1, None, False), ("usp", 1, None, True)], [2, 2], timeout=400)


def test_block_tp2_cp2():
    run_ranks(_megatron_equiv, 4, 2, 2, [("hcms", 2, None, True), ("ring", 1, None, False), ("usp", 1, 2, False)],
              timeout=400)


def _parser():
    from megatron_sp_ext.megatron import add_arguments
    p = argparse.ArgumentParser()
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--cp-comm-type", nargs="+", default=["p2p"])  # Megatron-LM's own flag
    add_arguments(p)
    add_arguments(p)  # idempotent
    return p


def test_flags_parse_and_land_in_config():
    from megatron_sp_ext.megatron import SPTransformerConfig
    args = _parser().parse_args(["--cp-comm-type", "hcms", "--hcms-head-chunks", "auto", "--sp-placement", "usp",
                                 "--sp-nodes", "2", "--context-parallel-size", "4"])
    assert args.cp_comm_type == ["hcms"] and args.hcms_head_chunks == "auto" and args.sp_nodes == 2
    fields = {k: getattr(args, k) for k in ("hcms_head_chunks", "sp_arrangement", "sp_nodes", "sp_ulysses_size",
                                             "sp_ring_variant", "sp_attention_backend")}
    cfg = SPTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=16, use_cpu_initialization=True,
                              context_parallel_size=4, cp_comm_type="hcms", **fields)
    assert cfg.hcms_head_chunks == "auto" and cfg.sp_arrangement == "usp"   # --sp-placement: the older name
    a2 = _parser().parse_args(["--hcms-head-chunks", "3", "--context-parallel-size", "4"])
    assert a2.hcms_head_chunks == 3


@pytest.mark.parametrize("argv,flag", [
    (["--cp-comm-type", "hcms", "--hcms-head-chunks", "5", "--context-parallel-size", "4"], "--hcms-head-chunks=5"),
    (["--cp-comm-type", "hcms", "--context-parallel-size", "4", "--num-attention-heads", "2"], "--cp-comm-type=hcms"),
    (["--cp-comm-type", "tas", "--context-parallel-size", "4"], "tas needs a multi-machine mesh"),
    (["--cp-comm-type", "bogus"], "--cp-comm-type='bogus'"),
    (["--hcms-head-chunks", "0"], "--hcms-head-chunks=0"),
    (["--sp-ulysses-size", "3", "--context-parallel-size", "4"], "--sp-ulysses-size=3"),
])
def test_bad_flags_fail_at_parse_time(argv, flag, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in err, err


def test_te_types_need_te():
    import importlib.util
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer-engine installed: TE types are delegated, not rejected")

    def fn(rank, world):
        from megatron.core import parallel_state as ps
        ps.initialize_model_parallel(context_parallel_size=2)
        try:
            _block("a2a", 2, 1, 1, None, False, layers=1)
        except SPConfigError as e:
            return str(e)
        finally:
            ps.destroy_model_parallel()
        return "no error"
    msg = run_ranks(fn, 2)[0]
    assert "--cp-comm-type=a2a" in msg and "needs transformer-engine" in msg


def test_runtime_patch_is_explicit_idempotent_reversible():
    from megatron.core.models.gpt import gpt_layer_specs as mod

    from megatron_sp_ext.megatron import SPDotProductAttention
    from megatron_sp_ext.megatron import patch
    orig = mod.get_gpt_layer_local_spec
    assert not patch.is_applied()
    assert mod.get_gpt_layer_local_spec().submodules.self_attention.submodules.core_attention is not \
        SPDotProductAttention
    try:
        assert patch.apply() is True and patch.apply() is False
        spec = mod.get_gpt_layer_local_spec()
        assert spec.submodules.self_attention.submodules.core_attention.module is SPDotProductAttention
    finally:
        assert patch.remove() is True and patch.remove() is False
    assert mod.get_gpt_layer_local_spec is orig


def _async_equiv(rank, world, cp, causal, qk_norm, rope, groups, chunks, form="on"):
    """SPSelfAttention with --sp-async-qkv on CP ranks == the same weights on the full sequence (CP=1,
    standard path): output, input grad and every parameter grad; GQA, per-head q/k RMSNorm, RoPE."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron_sp_ext.megatron.compat import cp_rank_batch as get_batch_on_this_cp_rank

    from megatron_sp_ext.megatron import SPSelfAttention, SPTransformerConfig, with_sp_core_attention
    ps.initialize_model_parallel(context_parallel_size=cp)
    cp_group = ps.get_context_parallel_group()
    try:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        cfg = SPTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=groups,
                                  use_cpu_initialization=True, context_parallel_size=cp,
                                  cp_comm_type="hcms" if chunks > 1 else "ulysses", hcms_head_chunks=chunks,
                                  hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                                  apply_rope_fusion=False, masked_softmax_fusion=False, sp_async_qkv=form,
                                  normalization="RMSNorm", qk_layernorm=qk_norm, add_qkv_bias=True)
        torch.manual_seed(1234)
        spec = with_sp_core_attention(get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm"),
                                      no_mask=not causal)
        block = TransformerBlock(cfg, spec)
        assert all(isinstance(layer.self_attention, SPSelfAttention) for layer in block.layers)
        s, b, hn = 8 * cp, 2, 8
        g = torch.Generator().manual_seed(3)
        x_full, dy_full = torch.randn(s, b, 64, generator=g), torch.randn(s, b, 64, generator=g)
        split = lambda t: get_batch_on_this_cp_rank({"x": t.transpose(0, 1)})["x"].transpose(0, 1)  # noqa: E731
        freqs_full = None
        if rope:
            inv = 1.0 / (10000 ** (torch.arange(0, hn, 2).float() / hn))
            f = torch.outer(torch.arange(s).float(), inv)
            freqs_full = torch.cat([f, f], dim=-1)[:, None, None, :]
        x = split(x_full).clone().requires_grad_()
        y = block(x, attention_mask=None, rotary_pos_emb=split(freqs_full) if rope else None)
        y.backward(split(dy_full))
        grads = {n: p.grad.clone() for n, p in block.named_parameters()}
        for gr in grads.values():
            dist.all_reduce(gr, group=cp_group)
        dx = x.grad.clone()
        block.zero_grad(set_to_none=True)
        _assert_equals_full_sequence(
            block, x_full, dy_full, split, y, dx, grads,
            f"{form} CP={cp} causal={causal} qk_norm={qk_norm} rope={rope} groups={groups} C={chunks}",
            rotary_pos_emb=freqs_full)
    finally:
        ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("cp,causal,qk_norm,rope,groups,chunks", [
    (2, True, True, True, 8, 2), (2, False, False, False, 2, 1), (4, True, True, True, 2, 1),
    (4, False, True, False, 8, 2)])
def test_async_self_attention_equals_standard(cp, causal, qk_norm, rope, groups, chunks):
    run_ranks(_async_equiv, cp, cp, causal, qk_norm, rope, groups, chunks)


@pytest.mark.parametrize("cp,causal,qk_norm,rope,groups,chunks", [
    (2, True, True, True, 8, 2), (4, True, True, True, 2, 1), (4, False, False, False, 8, 2)])
def test_allgather_self_attention_equals_standard(cp, causal, qk_norm, rope, groups, chunks):
    """--sp-async-qkv allgather: the all-gather QKV block in Megatron layers (zigzag placement, RoPE with the
    gathered ranks' freqs, per-head q/k norm, GQA with kv < CP) == the standard path on the full sequence."""
    run_ranks(_async_equiv, cp, cp, causal, qk_norm, rope, groups, chunks, "allgather")


def test_async_self_attention_rejects_what_it_cannot_do():
    def fn(rank, world):
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_block import TransformerBlock

        from megatron_sp_ext.megatron import SPTransformerConfig, with_sp_core_attention
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            cfg = SPTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, use_cpu_initialization=True,
                                      tensor_model_parallel_size=2, sp_async_qkv="on", attention_dropout=0.0)
            with pytest.raises(SPConfigError, match="--sp-async-qkv with --tensor-model-parallel-size 2 needs --sequence-parallel"):
                TransformerBlock(cfg, with_sp_core_attention(get_gpt_layer_local_spec()))
            cfg = SPTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, use_cpu_initialization=True,
                                      tensor_model_parallel_size=2, sp_async_qkv="auto", attention_dropout=0.0)
            with pytest.raises(SPConfigError, match="--sp-async-qkv with --tensor-model-parallel-size 2 needs --sequence-parallel"):
                TransformerBlock(cfg, with_sp_core_attention(get_gpt_layer_local_spec()))
        finally:
            ps.destroy_model_parallel()
        return True
    run_ranks(fn, 2)
