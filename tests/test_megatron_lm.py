"""Megatron-LM integration without a patch: the launcher's argv handling, the env hand-off of our settings,
the --spec layer spec built from Megatron-LM-style args, and the release check (megatron-core 0.16-0.20)."""
import argparse
import os

import pytest

pytest.importorskip("megatron.core")

from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from megatron_sp_ext.megatron import compat, launch, lm  # noqa: E402

MEGATRON_ARGS = ["--num-layers", "2", "--cp-comm-type", "hcms", "--context-parallel-size", "2", "--bf16"]


def test_split_keeps_megatron_args_in_order():
    argv = MEGATRON_ARGS[:4] + ["--hcms-head-chunks", "2", "--sp-async-qkv", "--sp-nodes=2"] + MEGATRON_ARGS[4:]
    rest, ours = lm.split_sp_flags(argv)
    assert rest == MEGATRON_ARGS
    assert ours == ["--hcms-head-chunks", "2", "--sp-async-qkv", "--sp-nodes=2"]


def test_prepare_adds_spec_and_hands_settings_over_env():
    env: dict = {}
    rest = launch.prepare(MEGATRON_ARGS + ["--hcms-head-chunks", "2", "--sp-ring-variant", "tasp"], env)
    assert rest == MEGATRON_ARGS + ["--spec", "megatron_sp_ext.megatron.lm_spec", "gpt"]
    cfg = lm.sp_config_from_env(env)
    assert cfg.head_chunks == 2 and cfg.ring_variant == "tasp" and cfg.source == "megatron"
    assert lm.sp_config_from_env({}).head_chunks == 1  # nothing given: the defaults


@pytest.mark.parametrize("argv, needle", [
    (["--hcms-head-chunks", "0"], "--hcms-head-chunks"),
    (["--sp-ring-variant", "spiral"], "--sp-ring-variant"),
    (["--spec", "my.mod", "fn"], "--spec"),
    (["--attention-backend", "local"], "--attention-backend local"),
])
def test_prepare_rejects_with_the_flag_named(argv, needle, capsys):
    with pytest.raises((SPConfigError, SystemExit)) as e:
        launch.prepare(MEGATRON_ARGS + argv, {})
    text = str(e.value) + capsys.readouterr().err
    assert needle in text


def test_prepare_accepts_what_megatron_lm_accepts():
    """tests/gpu/check_megatron_lm.py's command (one --hcms-head-chunks for every type, dropout 0) and per-layer types
    pass the launcher's checks of our flags with Megatron-LM's (tests/test_launch_errors.py: what they refuse)."""
    for types in (["ring"], ["hcms", "ring"], ["ulysses"]):
        theirs = ["--num-attention-heads", "8", "--context-parallel-size", "2", "--cp-comm-type", *types,
                  "--attention-dropout", "0"]
        assert launch.prepare(theirs + ["--hcms-head-chunks", "2"], {}) == theirs + ["--spec", *lm.SPEC]


def test_launcher_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        launch.main([])
    assert e.value.code == 2 and "usage" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        launch.main(["/nonexistent/pretrain_gpt.py"])
    assert e.value.code == 2 and "no such script" in capsys.readouterr().err


def _lm_args(**kw):
    base = dict(cp_comm_type=["hcms"], transformer_impl="local", qk_layernorm=True, normalization="RMSNorm",
                qk_l2_norm=False, num_experts=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_layer_spec_holds_our_attention(monkeypatch):
    from megatron_sp_ext.megatron import SPDotProductAttention, SPSelfAttention
    monkeypatch.setenv(lm.ENV, "--hcms-head-chunks 2")
    spec = lm.build_gpt_layer_spec(_lm_args())
    sub = spec.submodules.self_attention
    assert sub.module is SPSelfAttention
    assert sub.submodules.core_attention.module is SPDotProductAttention
    assert sub.submodules.core_attention.params["sp_context"].sp_config.head_chunks == 2
    assert sub.submodules.q_layernorm is not None  # --qk-layernorm reached Megatron's own spec factory


@pytest.mark.parametrize("kw, needle", [(dict(num_experts=8), "--num-experts"),
                                        (dict(cp_comm_type=["zigzag"]), "--cp-comm-type")])
def test_layer_spec_errors(kw, needle):
    with pytest.raises(SPConfigError, match=needle):
        lm.build_gpt_layer_spec(_lm_args(**kw))


def test_release_range():
    assert compat.check_supported(compat.megatron_core_version())  # the installed one (CI: 0.16.1 and 0.19.2)
    for ok in ("0.16.1", "0.18.2", "0.19.2", "0.20.0rc0"):
        assert compat.check_supported(ok) == ok
    for bad in ("0.15.3", "0.21.0", "1.0.0"):
        with pytest.raises(SPConfigError, match=r"megatron-core .* is not supported.*>=0\.16,<0\.21"):
            compat.check_supported(bad)


def test_parent_kwargs_filters_by_signature():
    def plain(a, b=1):
        return a, b

    def open_(a, **kw):
        return a, kw
    assert compat.parent_kwargs(plain, {"b": 2, "name": "x"}) == {"b": 2}
    assert compat.parent_kwargs(open_, {"b": 2, "name": "x"}) == {"b": 2, "name": "x"}


def test_spec_module_needs_megatron_lm():
    # pip megatron-core has no megatron.training: the --spec module says what it is for
    if os.environ.get("MEGATRON_LM_CHECKOUT"):
        pytest.skip("a Megatron-LM checkout is on the path")
    try:
        import megatron.training  # noqa: F401
        pytest.skip("megatron.training importable here")
    except ImportError:
        pass
    with pytest.raises(SPConfigError, match="Megatron-LM launch scripts"):
        import megatron_sp_ext.megatron.lm_spec  # noqa: F401
