"""The TP x CP attention block (sp/layers/tp_cp.py), issue #37.

Functional: tp_cp_self_attention on TP2 x CP2 and TP2 x CP1 gloo ranks against a float64 single-device
reference of the whole block (tests/gpu/cuda_tp_cp.tp_cp_case), every form, GQA, HCMS chunks, zigzag causal.
Megatron: a TransformerBlock of attention layers (no MLP: megatron-core's SP MLP needs CUDA) with --sp-async-qkv
on|allgather|auto at TP2 + --sequence-parallel (x CP2, x CP1; auto also at TP1 x CP2) against the same weights at
TP1 x CP1 (standard path): output, input grad, every parameter grad after the reductions Megatron does (sum over
CP of each TP shard, then the TP shards gathered; replicated parameters summed over TP and CP). auto runs with an
injected timer that makes each candidate win in turn, Megatron's own TP-SP layer included.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from megatron_sp_ext.errors import SPConfigError
from tests.gpu.cuda_tp_cp import tp_cp_case
from tests.harness import run_ranks
from tests.reference import rel_err
from tests.gpu.suite_judge import verdict


@pytest.mark.parametrize("world,form,h,hkv,chunks,qk_norm,causal", [
    (4, "pipelined", 8, 8, 1, True, False), (4, "pipelined", 8, 2, 2, True, True),
    (4, "mixed", 8, 4, 1, False, True), (4, "mixed", 8, 2, 2, True, False), (4, "mixed", 12, 6, 2, True, True),
    (4, "mixed_in", 8, 4, 2, True, True), (2, "pipelined", 8, 4, 2, True, True), (2, "mixed", 8, 8, 1, True, False),
    (2, "mixed_in", 8, 2, 1, False, True)])
def test_functional_equals_float64_block(world, form, h, hkv, chunks, qk_norm, causal):
    """TP2 x CP(world/2) in float64 == the float64 block on the full sequence (each error < 1e-10)."""
    for errs in run_ranks(tp_cp_case, world, 2, form=form, h=h, hkv=hkv, chunks=chunks, qk_norm=qk_norm,
                          causal=causal):
        assert max(errs.values()) < 1e-10, errs


def test_cuda_worker_runs_on_cpu(monkeypatch):
    """tests/gpu/cuda_tp_cp.tp_cp_block_family's records, dry-run on CPU gloo ranks (SPX_SUITE_DEVICE=cpu, 1/4 of the
    sequence length: SPX_SUITE_SHRINK=4)."""
    import tests.gpu.cuda_tp_cp as mod
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(mod, "SHRINK", 4)
    recs = run_ranks(mod.tp_cp_block_family, 4, timeout=400)
    for per_rank in recs:
        assert len(per_rank) == 18 and all(r["family"] == "tp-cp-block" for r in per_rank)
        for r in per_rank:  # float64: against the reference; bf16: relative to the unsharded bf16 block's error
            assert not verdict(r), (verdict(r), r)


def test_cuda_megatron_worker_runs_on_cpu(monkeypatch):
    """tests/gpu/cuda_tp_cp.tp_cp_megatron_family's records, dry-run on CPU gloo ranks: each form (and auto) of the
    adapter equals Megatron's own TP-SP layer in the same module."""
    pytest.importorskip("megatron.core")
    import tests.gpu.cuda_tp_cp as mod
    monkeypatch.setattr(mod, "DEV", "cpu")
    for per_rank in run_ranks(mod.tp_cp_megatron_family, 4, timeout=400):
        assert len(per_rank) == 8 and all(r["family"] == "tp-cp-megatron" for r in per_rank)
        for r in per_rank:
            assert len(r["errs"]) >= 8 and max(r["errs"].values()) <= 1e-5, r  # fp32 on CPU: tighter than the tol


def test_mixed_form_needs_cp_major_tcp_group():
    def fn(rank, world):
        from megatron_sp_ext.sp.layers.tp_cp import check_tp_cp_groups
        from tests.gpu.cuda_tp_cp import tp_cp_groups
        tp, cp, tcp = tp_cp_groups(2)
        check_tp_cp_groups(tp, cp, tcp)
        with pytest.raises(SPConfigError, match="CP-major"):
            check_tp_cp_groups(tp, cp, tp)  # not the TP x CP group
        if dist.get_rank(tp) != dist.get_rank(cp):
            with pytest.raises(SPConfigError, match="CP-major"):
                check_tp_cp_groups(cp, tp, tcp)  # TP and CP swapped: the WORLD order is then TP-major
        return True
    run_ranks(fn, 4)


def _gather_tp(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _TorchNormSP:
    """megatron-core's torch norm under --sequence-parallel (it asserts the flag off because it does not tag
    its weights for the TP grad all-reduce; the test sums replicated grads over TP itself)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **kw):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        cfg = copy.copy(config)
        cfg.sequence_parallel = False
        return WrappedTorchNorm(cfg, hidden_size, eps, **kw)


def _cpu_megatron_sp():
    """Megatron's own TP sequence-parallel layers allocate their all-gather / reduce-scatter buffers on
    ``torch.cuda.current_device()`` (no CPU path): on these forked CPU ranks, answer "cpu" (the collectives are
    gloo's, the math Megatron's unchanged)."""
    torch.cuda.current_device = lambda: "cpu"


def _winner_timer(winner):
    """A FormTimer under which ``winner`` is 10% faster than every other form in every round (each step runs)."""
    def timer(name, step, iters, warmup, group):
        step()
        return 9.0 if name == winner else 10.0
    return timer


def _megatron_tp_cp(rank, world, tp, cp, cases):
    """For each (form, causal, groups, qk_norm, rope, chunks): the block at TP x CP with --sequence-parallel and
    --sp-async-qkv ``form`` vs the same weights at TP1 x CP1 (Megatron's standard path, full sequence). form
    "auto:<winner>": --sp-async-qkv auto with a FormPolicy whose injected timer makes <winner> the fastest (every
    candidate, Megatron's own TP-SP path "megatron" included, runs in the calibration; the result must not
    depend on the winner beyond fp rounding)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from megatron_sp_ext.megatron import SPSelfAttention, SPTransformerConfig, with_sp_core_attention
    from megatron_sp_ext.megatron.compat import cp_rank_batch
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    def build(tp_, cp_, form, causal, groups, qk_norm, chunks):
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        cfg = SPTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=groups,
                                  use_cpu_initialization=True, context_parallel_size=cp_,
                                  tensor_model_parallel_size=tp_, sequence_parallel=tp_ > 1,
                                  cp_comm_type="hcms" if chunks > 1 else "ulysses", hcms_head_chunks=chunks,
                                  hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                                  apply_rope_fusion=False, masked_softmax_fusion=False, sp_async_qkv=form,
                                  normalization="RMSNorm", qk_layernorm=qk_norm, add_qkv_bias=True)
        torch.manual_seed(1234)
        spec = with_sp_core_attention(get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm"),
                                      no_mask=not causal)
        sub = spec.submodules  # torch norms refuse sequence parallelism by assertion: see _TorchNormSP
        sub.input_layernorm = _TorchNormSP
        # attention layers only: Megatron's SP MLP allocates its gather buffers on the GPU (no CPU path)
        sub.pre_mlp_layernorm, sub.mlp, sub.mlp_bda = IdentityOp, IdentityOp, IdentityFuncOp
        if qk_norm:
            sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = _TorchNormSP
        return TransformerBlock(cfg, TransformerBlockSubmodules(layer_specs=[spec] * 2, layer_norm=_TorchNormSP))

    import megatron_sp_ext.megatron.async_attention as adapter
    from megatron_sp_ext.sp.layers.policy import FormPolicy
    _cpu_megatron_sp()
    calls, block_fn = [], adapter.tp_cp_self_attention  # count the block's calls (this forked rank only)
    adapter.tp_cp_self_attention = lambda *a, **k: calls.append(k["form"]) or block_fn(*a, **k)
    for form, causal, groups, qk_norm, rope, chunks in cases:
        tag = f"{form} TP={tp} CP={cp} causal={causal} groups={groups} qk_norm={qk_norm} rope={rope} C={chunks}"
        flag, _, winner = form.partition(":")
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        try:
            tp_g, cp_g = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
            t = dist.get_rank(tp_g)
            block = build(tp, cp, flag, causal, groups, qk_norm, chunks)
            assert all(isinstance(layer.self_attention, SPSelfAttention) for layer in block.layers)
            policy = None
            if winner:  # one policy for the model (the layers share it through their SPContext)
                block.layers[0].self_attention.form_policy = policy = FormPolicy(rounds=3, warmup=1,
                                                                                 timer=_winner_timer(winner))
                assert block.layers[1].self_attention.form_policy is policy
            s, b, hn = 8 * cp * tp, 2, 8
            g = torch.Generator().manual_seed(3)
            x_full, dy_full = torch.randn(s, b, 64, generator=g), torch.randn(s, b, 64, generator=g)
            freqs_full = None
            if rope:
                inv = 1.0 / (10000 ** (torch.arange(0, hn, 2).float() / hn))
                f = torch.outer(torch.arange(s).float(), inv)
                freqs_full = torch.cat([f, f], dim=-1)[:, None, None, :]
            cp_split = lambda z: cp_rank_batch({"x": z.transpose(0, 1)})["x"].transpose(0, 1)  # noqa: E731
            s_tp = s // cp // tp
            # this rank's tokens (Megatron's SP: contiguous over TP inside the CP rank's zigzag shard), fixed now:
            # cp_rank_batch reads parallel_state, which the reference below re-initialises
            mine = cp_split(torch.arange(s)[:, None])[t * s_tp:(t + 1) * s_tp, 0]
            split = lambda z: z[mine]  # noqa: E731
            x = split(x_full).clone().requires_grad_()
            rope_cp = cp_split(freqs_full) if rope else None
            passes = 1
            if policy is not None and chunks > 1:  # a no_grad forward first (Megatron's reentrant recompute): the
                with torch.no_grad():               # training key is calibrated there (fwd+bwd), then reused
                    y0 = block(x, attention_mask=None, rotary_pos_emb=rope_cp)
                passes = 2
            y = block(x, attention_mask=None, rotary_pos_emb=rope_cp)
            y.backward(split(dy_full))
            if passes == 2:
                assert rel_err(y0, y.detach()) == 0.0, tag  # the same form ran both times
            y, dx = y.detach(), x.grad.clone()
            if policy is None:
                assert calls == [{"on": "pipelined", "allgather": "mixed"}[form]] * (2 if tp > 1 else 0), calls
            else:  # one calibration (one shape key): every candidate ran; then both layers ran the winner
                (dec,) = policy.cache.values()
                forms = block.layers[0].self_attention.forms()
                assert dec.form == winner and list(dec.rounds) == list(forms), (dec.form, dec.rounds)
                if tp > 1:  # the TP x CP block's forms: warm-up + one timed call per round each, then the winner
                    real = [winner] * 2 * passes if winner != "megatron" else []
                    n_cal = (policy.warmup + policy.rounds) * (len(forms) - 1)
                    assert len(calls) == n_cal + len(real) and calls[n_cal:] == real, calls
                    assert sorted(set(calls[:n_cal])) == sorted(forms[1:]), calls
            calls.clear()
            full_w, full_g = {}, {}
            for n, p in block.named_parameters():
                gr = p.grad.clone()
                dist.all_reduce(gr, group=cp_g)  # DP x CP gradient reduction
                if getattr(p, "tensor_model_parallel", False):  # this TP shard: gather the shards
                    full_w[n] = _gather_tp(p.detach(), p.partition_dim, tp_g)
                    full_g[n] = _gather_tp(gr, p.partition_dim, tp_g)
                else:  # replicated under sequence parallelism: partial over TP too
                    dist.all_reduce(gr, group=tp_g)
                    full_w[n], full_g[n] = p.detach().clone(), gr
        finally:
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
        try:
            ref = build(1, 1, "off", causal, groups, qk_norm, chunks)
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    p.copy_(full_w[n])
            xf = x_full.clone().requires_grad_()
            yf = ref(xf, attention_mask=None, rotary_pos_emb=freqs_full)
            yf.backward(dy_full)
            assert rel_err(y, split(yf)) < 1e-5, f"{tag}: output {rel_err(y, split(yf))}"
            assert rel_err(dx, split(xf.grad)) < 1e-5, f"{tag}: input grad {rel_err(dx, split(xf.grad))}"
            for n, p in ref.named_parameters():
                assert rel_err(full_g[n], p.grad) < 1e-5, f"{tag}: grad of {n}: {rel_err(full_g[n], p.grad)}"
        finally:
            ps.destroy_model_parallel()
    return True


def test_megatron_tp2_cp2():
    pytest.importorskip("megatron.core")
    run_ranks(_megatron_tp_cp, 4, 2, 2, [("on", True, 8, True, True, 1), ("on", False, 2, True, False, 2),
                                         ("allgather", True, 2, True, True, 1),
                                         ("allgather", False, 8, False, False, 2)], timeout=400)


def test_megatron_tp2_cp1():
    pytest.importorskip("megatron.core")
    run_ranks(_megatron_tp_cp, 2, 2, 1, [("on", True, 2, True, True, 2), ("allgather", False, 8, True, True, 1)],
              timeout=400)


def test_megatron_auto_tp2_cp2_every_winner_same_math():
    """--sp-async-qkv auto at TP2 x CP2: whichever form the policy picks (Megatron's own TP-SP path, pipelined,
    mixed, mixed_in), output and every gradient equal TP1 x CP1 within 1e-5, and the calibration left no trace in
    the model's gradients (each candidate ran on detached copies)."""
    pytest.importorskip("megatron.core")
    run_ranks(_megatron_tp_cp, 4, 2, 2, [("auto:megatron", True, 2, True, True, 1),
                                         ("auto:pipelined", False, 8, True, True, 2),
                                         ("auto:mixed", True, 2, True, True, 2),
                                         ("auto:mixed_in", False, 2, False, False, 1)], timeout=400)


def test_megatron_auto_tp2_cp1_and_tp1_cp2():
    pytest.importorskip("megatron.core")
    run_ranks(_megatron_tp_cp, 2, 2, 1, [("auto:mixed", True, 2, True, True, 1),
                                         ("auto:megatron", False, 8, True, True, 2)], timeout=400)
    run_ranks(_megatron_tp_cp, 2, 1, 2, [("auto:allgather", True, 2, True, True, 1),
                                         ("auto:async", False, 8, True, False, 2)], timeout=400)


def test_megatron_tp_without_sequence_parallel_is_refused():
    pytest.importorskip("megatron.core")

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
            with pytest.raises(SPConfigError, match="--tensor-model-parallel-size 2 needs --sequence-parallel"):
                TransformerBlock(cfg, with_sp_core_attention(get_gpt_layer_local_spec()))
        finally:
            ps.destroy_model_parallel()
        return True
    run_ranks(fn, 2)


def test_form_policy_keeps_megatron_on_cpu_for_tp_cp():
    """The TP x CP forms are chosen only where timed faster: on CPU (no injected timer) the policy answers
    Megatron's own path without running any candidate, on the TP x CP group."""
    from megatron_sp_ext.sp.layers.policy import FormPolicy
    from megatron_sp_ext.sp.layers.tp_cp import TP_CP_FORMS

    def fn(rank, world):
        ran = []
        steps = {f: (lambda f=f: ran.append(f)) for f in ("megatron",) + TP_CP_FORMS}
        return FormPolicy().fastest(("tp-cp", 2, 2), steps, dist.group.WORLD, torch.device("cpu")) == "megatron" \
            and not ran
    assert all(run_ranks(fn, 4))


def test_exported():
    import megatron_sp_ext as spx
    from megatron_sp_ext.sp.layers.tp_cp import tp_cp_self_attention
    assert spx.tp_cp_self_attention is tp_cp_self_attention


def _bench_tp_dry_run(rank, world):
    """tools/bench_block.py --tp 2's measuring function on CPU (fp32, tiny): every form's output equals Megatron's
    own TP-SP layer's, and auto (no CUDA: untimed) keeps Megatron's path."""
    from tools.bench_block import TP_MODES, tp_bench
    _cpu_megatron_sp()
    res = tp_bench(2, dim=64, heads=8, kv_heads=4, head_dim=8, seqlen=8 * world, chunks=2 if world == 4 else 1,
                   causal=world == 4, iters=1, dtype=torch.float32, device="cpu")
    assert list(res["modes"]) == list(TP_MODES) and res["cp"] == world // 2
    for m, e in res["modes"].items():
        assert e["rel_diff_vs_megatron"] < 1e-5 and e["fwd_ms"] > 0 and e["fwd_bwd_ms"] > 0, (m, e)
    assert {k: v["form"] for k, v in res["auto_choice"].items()} == {"train": "megatron"}, res["auto_choice"]
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_bench_block_tp_dry_run(world):
    pytest.importorskip("megatron.core")
    assert all(run_ranks(_bench_tp_dry_run, world, timeout=400))
