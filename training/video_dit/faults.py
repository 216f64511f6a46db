"""Bounded failure: the collective timeout, and one clear line naming the rank that failed.

A rank that dies (killed, out of memory, NCCL error) must end the whole job in bounded time:
- under torchrun the elastic agent sees the dead worker, stops the others and prints which rank
  failed (its exit code or signal);
- whatever the launcher, every collective carries ``--distributed-timeout-minutes`` (gloo: the
  call raises after it; NCCL: the watchdog aborts the communicator, TORCH_NCCL_ASYNC_ERROR_HANDLING
  defaults to tearing the process down), so a survivor cannot wait forever;
- ``report_failures`` prints "[rank R] failed: ..." before the exception propagates, so each
  rank's log names itself and what it saw.
Checkpoints are never half-visible (checkpoint.py writes a new directory and moves ``latest`` last).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch.distributed as dist


def timeout_of(minutes: float) -> datetime.timedelta:
    """``--distributed-timeout-minutes`` as the timedelta init_process_group takes."""
    if not minutes > 0:
        raise ValueError(f"--distributed-timeout-minutes={minutes}: must be > 0 (Megatron-LM's default is 10)")
    return datetime.timedelta(minutes=minutes)


@contextlib.contextmanager
def report_failures(what: str = "training"):
    """Print one line naming this rank and the error, then re-raise (the launcher ends the job)."""
    try:
        yield
    except BaseException as e:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        if not isinstance(e, (SystemExit, KeyboardInterrupt)):
            hint = (" (a peer rank died or stopped answering; see the launcher's summary for which)"
                    if _looks_like_peer_loss(e) else "")
            print(f"[rank {rank}] {what} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                  f"{hint}", file=sys.stderr, flush=True)
        raise


def _looks_like_peer_loss(e: BaseException) -> bool:
    text = str(e).lower()
    return any(k in text for k in ("connection closed", "connection reset", "timed out", "timeout",
                                   "broken pipe", "nccl", "peer"))
