r"""Run a Megatron-LM launch script with megatron_sp_ext attention, its own arguments untouched.

    torchrun --nproc-per-node 8 -m megatron_sp_ext.megatron.launch pretrain_gpt.py \
        <Megatron-LM arguments> --context-parallel-size 4 --cp-comm-type hcms --hcms-head-chunks auto

Our flags (``--hcms-head-chunks``, ``--sp-arrangement`` (``--sp-placement``), ``--sp-nodes``, ``--sp-ulysses-size``,
``--sp-ring-variant``, ``--sp-attention-backend``, ``--sp-transport``, ``--sp-async-qkv``) are taken
out of the command line and handed to every rank in ``MEGATRON_SP_EXT_ARGS``; ``--spec
megatron_sp_ext.megatron.lm_spec gpt`` is added (Megatron-LM's own hook for a custom layer spec, in
every supported release); then the script runs as ``__main__`` exactly as ``python pretrain_gpt.py``
would. Supported: Megatron-LM core_v0.16.x - core_v0.19.x and main (megatron-core 0.16-0.19).
"""
from __future__ import annotations

import os
import runpy
import shlex
import sys

from ..elastic_error import record_user_error
from ..errors import SPConfigError
from .lm import ENV, SPEC, parse_sp_flags, split_sp_flags, validated_flags


def prepare(argv: list[str], environ: dict) -> list[str]:
    """Megatron-LM's argv for the script (our flags out, ``--spec`` in); ``environ[ENV]`` set. Raises
    SPConfigError for a command line that cannot work: our flags' values, and their combinations with
    Megatron-LM's sizes, types and dropout (``arguments.validate_args``, as at model build), before any rank
    starts Megatron-LM."""
    rest, ours = split_sp_flags(argv)
    parse_sp_flags(ours)  # our flags alone: the error names the flag (not the combined parser's wording)
    validated_flags(rest, ours)
    if "--spec" in rest:
        raise SPConfigError("--spec is set by megatron_sp_ext.megatron.launch (it installs "
                            f"'{' '.join(SPEC)}'); remove your --spec, or use with_sp_core_attention on your own spec")
    for i, tok in enumerate(rest):
        if tok.split("=", 1)[0] == "--attention-backend":
            value = tok.split("=", 1)[1] if "=" in tok else (rest[i + 1] if i + 1 < len(rest) else "")
            if value == "local":
                raise SPConfigError("--attention-backend local replaces the core attention of any --spec in "
                                    "Megatron-LM 0.19+: leave --attention-backend at its default (our core "
                                    "attention picks its own local kernel: --sp-attention-backend)")
    environ[ENV] = " ".join(shlex.quote(t) for t in ours)
    return rest + ["--spec", *SPEC]


PROG = "megatron_sp_ext.megatron.launch"


def main(argv: list[str] | None = None) -> None:
    """Check the command line (one line under ``PROG`` on a mistake, before megatron.core is imported), then run
    the script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        sys.stderr.write(f"usage: python -m {PROG} <pretrain_gpt.py> [Megatron-LM and megatron_sp_ext arguments]\n")
        raise SystemExit(2)
    script = os.path.abspath(argv[0])
    try:
        if not os.path.isfile(script):
            raise SPConfigError(f"no such script: {argv[0]}")
        rest = prepare(argv[1:], os.environ)
        sys.path.insert(0, os.path.dirname(script))
        from .compat import check_supported  # noqa: PLC0415  (the checkout's megatron.core)
        check_supported()
    except SPConfigError as e:
        record_user_error(f"{PROG}: {e}")  # torchrun's "Root Cause" shows this line
        sys.stderr.write(f"{PROG}: {e}\n")
        raise SystemExit(2) from None  # argparse's status for a bad command line
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
