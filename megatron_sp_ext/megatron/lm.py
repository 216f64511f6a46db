"""Megatron-LM integration without a patch: our settings out of argv, our layer spec through ``--spec``.

Our flags (``--hcms-head-chunks``, ``--sp-arrangement``, ...) are not known to Megatron-LM's parser.
``split_sp_flags`` takes them out of a command line; they travel to every rank in the environment
variable ``MEGATRON_SP_EXT_ARGS`` and ``sp_config_from_env`` reads them back. ``build_gpt_layer_spec``
turns Megatron-LM's arguments into the GPT layer spec with our core attention (see lm_spec.py).
"""
from __future__ import annotations

import argparse
import inspect
import os
import shlex
from typing import Any, Optional

from ..config import SPConfig
from ..errors import SPConfigError

ENV = "MEGATRON_SP_EXT_ARGS"
SPEC = ("megatron_sp_ext.megatron.lm_spec", "gpt")
# our flags (Megatron-LM's own --cp-comm-type stays where it is); value: takes an optional value only
_FLAGS = {"--hcms-head-chunks": False, "--sp-arrangement": False, "--sp-placement": False, "--sp-nodes": False, "--sp-ulysses-size": False,
          "--sp-ring-variant": False, "--sp-attention-backend": False, "--sp-transport": False,
          "--sp-async-qkv": True}


class _FlagParser(argparse.ArgumentParser):
    """Our flags' parser: a bad value raises one SPConfigError naming the flag (no usage text, no program name:
    the caller, the launcher or a rank reading ``MEGATRON_SP_EXT_ARGS``, says who it is)."""

    def error(self, message: str):
        raise SPConfigError(message)


def _our_parser() -> argparse.ArgumentParser:
    from .arguments import add_arguments  # noqa: PLC0415
    p = _FlagParser(prog=ENV, add_help=False, allow_abbrev=False)
    p.add_argument("--cp-comm-type", nargs="+", default=["ulysses"])  # not ours; keeps add_arguments off it
    return add_arguments(p)


def split_sp_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(Megatron-LM's arguments unchanged and in order, our flags) from a command line."""
    rest, ours, i = [], [], 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        if name in _FLAGS:
            ours.append(tok)
            has_value = "=" in tok
            optional = _FLAGS[name]
            if not has_value and i + 1 < len(argv) and not (optional and argv[i + 1].startswith("-")):
                ours.append(argv[i + 1])
                i += 1
            i += 1
            continue
        rest.append(tok)
        i += 1
    return rest, ours


def parse_sp_flags(flags: list[str]) -> argparse.Namespace:
    """Our flags -> namespace (argparse errors name the flag); bad combinations raise SPConfigError."""
    p = _our_parser()
    ns, unknown = p.parse_known_args(flags)
    if unknown:
        raise SPConfigError(f"{ENV}: not megatron_sp_ext flags: {' '.join(unknown)} (ours: {', '.join(_FLAGS)})")
    return ns


# Megatron-LM's flags that our validation reads, with Megatron-LM's defaults (its --attention-dropout is 0.1)
_MEGATRON_LM_FLAGS = (("--context-parallel-size", int, 1), ("--tensor-model-parallel-size", int, 1),
                      ("--num-attention-heads", int, None), ("--attention-dropout", float, 0.1))


def validated_flags(megatron_argv: list[str], flags: list[str]) -> argparse.Namespace:
    """Our flags with the Megatron-LM arguments they depend on (sizes, --cp-comm-type, heads, dropout,
    --dynamic-context-parallel) read from Megatron-LM's command line and checked together by
    ``arguments.validate_args``, the check Megatron-LM's parse and model build run: SPConfigError naming the flag."""
    p = _our_parser()
    p.set_defaults(cp_comm_type=["p2p"])  # Megatron-LM's default (Transformer Engine's ring)
    for flag, kind, default in _MEGATRON_LM_FLAGS:
        p.add_argument(flag, type=kind, default=default)
    ns, _ = p.parse_known_args([*megatron_argv, *flags])  # add_arguments' parse runs validate_args
    return ns


def sp_config_from_flags(flags: list[str]) -> SPConfig:
    ns = parse_sp_flags(flags)
    return SPConfig(head_chunks=ns.hcms_head_chunks, ring_variant=ns.sp_ring_variant, arrangement=ns.sp_arrangement,
                    ulysses_size=ns.sp_ulysses_size, nodes=ns.sp_nodes, backend=ns.sp_attention_backend,
                    transport=ns.sp_transport, async_qkv=ns.sp_async_qkv, source="megatron")


def sp_config_from_env(environ: Optional[dict] = None) -> SPConfig:
    """Our settings from ``MEGATRON_SP_EXT_ARGS`` (empty: the defaults)."""
    env = os.environ if environ is None else environ
    return sp_config_from_flags(shlex.split(env.get(ENV, "")))


def megatron_lm_args() -> Any:
    """Megatron-LM's parsed global arguments (``megatron.training.get_args``)."""
    try:
        from megatron.training import get_args  # noqa: PLC0415
    except ImportError as e:
        raise SPConfigError("--spec megatron_sp_ext.megatron.lm_spec gpt is for Megatron-LM launch scripts "
                            "(pretrain_gpt.py): megatron.training is not importable here") from e
    return get_args()


def _call_filtered(fn, **kwargs):
    names = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in names.values()):  # 0.19 wraps: look at what it forwards to
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in names})


def build_gpt_layer_spec(args: Any):
    """Megatron-LM's default GPT layer spec for ``args`` with megatron_sp_ext core attention."""
    from megatron.core.models.gpt import gpt_layer_specs as specs  # noqa: PLC0415

    from .compat import check_supported  # noqa: PLC0415
    from .core_attention import OUR_CP_TYPES, TE_CP_TYPES, SPContext  # noqa: PLC0415
    from .spec import with_sp_core_attention  # noqa: PLC0415
    check_supported()
    if getattr(args, "num_experts", None):
        raise SPConfigError("--spec megatron_sp_ext.megatron.lm_spec gpt builds dense GPT layers; --num-experts "
                            "(MoE) needs its own spec: call with_sp_core_attention on it")
    cp_types = args.cp_comm_type if isinstance(args.cp_comm_type, (list, tuple)) else [args.cp_comm_type]
    for t in cp_types:
        if t not in OUR_CP_TYPES and t not in TE_CP_TYPES:
            raise SPConfigError(f"--cp-comm-type={t!r} is invalid: choose one of {', '.join(OUR_CP_TYPES)} "
                                f"(megatron_sp_ext) or {', '.join(TE_CP_TYPES)} (Transformer Engine)")
    factory = (specs.get_gpt_layer_local_spec if getattr(args, "transformer_impl", "local") == "local"
               else specs.get_gpt_layer_with_transformer_engine_spec)
    base = _call_filtered(factory, qk_layernorm=getattr(args, "qk_layernorm", False),
                          normalization=getattr(args, "normalization", None),
                          qk_l2_norm=getattr(args, "qk_l2_norm", False))
    return with_sp_core_attention(base, context=SPContext(sp_config_from_env()))
