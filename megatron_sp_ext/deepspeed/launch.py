"""Run a stock DeepSpeed training script with the JSON switch on, without an installed ``.pth``.

    torchrun --nproc-per-node 2 -m megatron_sp_ext.deepspeed.launch train.py --deepspeed_config ds.json
    python -m megatron_sp_ext.deepspeed.launch train.py ...   (same, one process)

The script runs as ``__main__`` with its own arguments; ``deepspeed.initialize`` installs our
attention when the config holds a ``"sequence_parallel_ext"`` section (see ``hook``) and is
DeepSpeed's own otherwise.
"""
from __future__ import annotations

import runpy
import sys

from ..elastic_error import record_user_error
from ..errors import SPConfigError, UserError


def main(argv: "list[str] | None" = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    from .hook import activate  # noqa: PLC0415
    activate()
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except (SPConfigError, UserError) as e:  # the traceback stays; torchrun's "Root Cause" shows our line
        record_user_error(f"megatron_sp_ext: {e}")
        raise


if __name__ == "__main__":
    main()
