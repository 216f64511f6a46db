"""Bounded failure: the collective timeout, and one clear line naming the rank that failed.

A rank that dies or hangs (killed, out of memory, NCCL error, stopped) must end the whole job in
bounded time:
- under torchrun the elastic agent sees the dead worker, stops the others and prints which rank
  failed (its exit code or signal);
- whatever the launcher, every collective carries ``--distributed-timeout-minutes``: the default
  group, megatron-core's groups and this library's sub-groups (gloo: the call raises after it; NCCL:
  the watchdog aborts the communicator), so a survivor cannot wait forever;
- ``report_failures`` prints "[rank R] failed: ..." and posts it to the job's rendezvous store.
  A rank that failed because a peer went away then holds a short roll call on that store and
  names the ranks that never reported (dead or hung) and what the others reported, so the logs
  name the culprit under any launcher (srun, mpirun, a bare script).
Checkpoints are never half-visible (checkpoint.py writes a new directory and moves ``latest`` last).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from typing import Optional

import torch.distributed as dist


def timeout_of(minutes: float) -> datetime.timedelta:
    """``--distributed-timeout-minutes`` as the timedelta init_process_group takes."""
    if not minutes > 0:
        raise ValueError(f"--distributed-timeout-minutes={minutes}: must be > 0 (Megatron-LM's default is 10)")
    return datetime.timedelta(minutes=minutes)


ROLL_CALL_SECONDS = 10.0  # how long a survivor waits for the other ranks to report, once
_KEY = "spx_fault/rank_{}"


@contextlib.contextmanager
def report_failures(what: str = "training", roll_call_s: float = ROLL_CALL_SECONDS):
    """Print one line naming this rank and the error, then re-raise (the launcher ends the job).
    When the error looks like a lost peer, first wait up to ``roll_call_s`` for every rank to post
    its state to the rendezvous store and name those that did not."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, (SystemExit, KeyboardInterrupt)):
            raise
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        line = f"[rank {rank}] {what} failed: {first}"
        store = _store()
        if store is not None:
            _post(store, rank, first)
        lost_peer = _looks_like_peer_loss(e)
        if lost_peer:
            line += " (a peer rank died or stopped answering)"
        print(line, file=sys.stderr, flush=True)  # first, in case a launcher stops this process meanwhile
        if lost_peer and store is not None:
            print(f"[rank {rank}] roll call: {roll_call(store, rank, dist.get_world_size(), roll_call_s)}",
                  file=sys.stderr, flush=True)
        raise


def _store():
    """The default group's store (a private accessor of torch.distributed), or None."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=5))
        return store
    except Exception:  # noqa: BLE001 - no store, no roll call; the line above still names this rank
        return None


def _post(store, rank: int, text: str) -> None:
    try:
        store.set(_KEY.format(rank), text)
    except Exception:  # noqa: BLE001 - the store host may be the rank that died
        pass


def roll_call(store, rank: int, world: int, wait_s: float) -> str:
    """Wait up to ``wait_s`` until every rank posted to ``store``; say who did not and what the others
    reported (their own failures, not lost peers). Rank 0, which hosts the store when no launcher
    agent does, stays 2 s longer so that the other survivors finish theirs."""
    keys = [_KEY.format(r) for r in range(world)]
    deadline = time.monotonic() + wait_s
    missing, own = None, []
    try:
        while True:
            missing = [r for r in range(world) if not store.check([keys[r]])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        for r in range(world):
            if r != rank and r not in missing:
                text = store.get(keys[r]).decode(errors="replace")
                if not _looks_like_peer_loss_text(text):
                    own.append(f"rank {r}: {text}")
    except Exception as e:  # noqa: BLE001
        if missing is None:
            return (f"the rendezvous store is unreachable ({type(e).__name__}), so the rank hosting it "
                    f"(rank 0 without a launcher agent) most likely died")
    if rank == 0:
        time.sleep(2.0)
    said = (f"rank(s) {', '.join(map(str, missing))} did not report within {wait_s:.0f} s (died or hung)"
            if missing else "every rank reported")
    return said + (f"; failed on their own: {'; '.join(own)}" if own else "")


def _looks_like_peer_loss(e: BaseException) -> bool:
    return _looks_like_peer_loss_text(str(e))


def _looks_like_peer_loss_text(text: Optional[str]) -> bool:
    text = (text or "").lower()
    return any(k in text for k in ("connection closed", "connection reset", "timed out", "timeout",
                                   "broken pipe", "nccl", "peer"))
