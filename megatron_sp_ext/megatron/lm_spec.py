"""The GPT layer spec Megatron-LM's ``--spec`` flag loads: Megatron's own spec with our core attention.

    --spec megatron_sp_ext.megatron.lm_spec gpt

Megatron-LM (0.16-0.19) reads ``vars(module)[name]`` after it parsed its arguments, so ``gpt`` is
built when this module is imported, from Megatron-LM's global args: the local spec for
``--transformer-impl local``, the Transformer Engine spec otherwise, with the same ``--qk-layernorm``
and ``--normalization``; its self-attention core becomes ``SPDotProductAttention``, which runs
the algorithm named by ``--cp-comm-type`` (and delegates TE's own p2p/a2a/... to TE). Our other
settings come from the environment variable ``MEGATRON_SP_EXT_ARGS`` (the launcher
``python -m megatron_sp_ext.megatron.launch`` fills it from our flags), so Megatron-LM's stock
argument parser never sees them.
"""
from __future__ import annotations

from .lm import build_gpt_layer_spec, megatron_lm_args

gpt = build_gpt_layer_spec(megatron_lm_args())
