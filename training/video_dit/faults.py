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

Work only rank 0 does (writing files, videos, plots, loading what only it uses) goes through ``on_rank0``: its
result and its error reach every rank in one broadcast, so a failure there ends every rank at once (``PeerFailed``
on the others) instead of leaving them in the next collective, which rank 0 never reaches (2 x H200, 2026-11-29:
rank 0 of tools/wan_short_run.py failed writing videos while rank 1 waited in a broadcast until the job's limit).

Errors the user caused (``user_error_types()``: a bad setting, data file or checkpoint) are one message
per job instead of a traceback per rank: ``report_failures`` posts them like any failure, and the lowest
rank that holds a message prints it; ``run_entry`` (the entry points' ``__main__``) exits 1 without a
traceback. ``--log-level DEBUG`` or ``SPX_TRACEBACK=1`` prints the tracebacks too. Every other error is a
programming error and keeps its traceback.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
import traceback
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from megatron_sp_ext.elastic_error import record_user_error
from megatron_sp_ext.errors import UserError

T = TypeVar("T")


def timeout_of(minutes: float) -> datetime.timedelta:
    """``--distributed-timeout-minutes`` as the timedelta init_process_group takes."""
    if not minutes > 0:
        from megatron_sp_ext.errors import SPConfigError  # noqa: PLC0415
        raise SPConfigError(f"--distributed-timeout-minutes={minutes}: must be > 0 (Megatron-LM's default is 10)")
    return datetime.timedelta(minutes=minutes)


ROLL_CALL_SECONDS = 10.0  # how long a survivor waits for the other ranks to report, once
USER_ERROR_WAIT_SECONDS = 3.0  # how long a rank with a user error waits to learn which rank prints it
# under torchrun, how long a rank other than 0 with a command-line error waits for rank 0 to print it and end the job
PARSE_ERROR_WAIT_SECONDS = 10.0
TRACEBACK_ENV = "SPX_TRACEBACK"
_KEY = "spx_fault/rank_{}"
ANNOUNCED = "spx_fault/announced"  # set by the rank that printed a user error, after printing it


class PeerFailed(UserError):
    """Rank 0 failed in work only it does (``on_rank0``); raised on the other ranks, which print nothing: rank 0
    reports its own error (one message per job)."""


def on_rank0(what: str, fn: Callable[[], T], group: Optional[dist.ProcessGroup] = None) -> T:
    """``fn()`` on rank 0 of ``group`` (None: the default group), its result to every rank of the group in one
    broadcast that also carries rank 0's error: rank 0 re-raises its own, the others raise ``PeerFailed`` naming it
    and ``what`` ("rank 0 failed in <what>: <error>"), so no rank is left waiting in a later collective that rank 0
    never reaches. Collective over ``group`` once a process group of more than one rank is up (every rank of it must
    call it); without one, just ``fn()``. The result is pickled to every rank: return something small (None, paths,
    rows), not a model."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return fn()
    box: list = [None, None]
    error: Optional[BaseException] = None
    if dist.get_rank(group) == 0:
        try:
            box[0] = fn()
        except (Exception, SystemExit) as e:   # noqa: BLE001 - re-raised below, after the other ranks have it
            error, box[1] = e, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if error is not None:
        raise error
    if box[1] is not None:
        raise PeerFailed(f"rank 0 failed in {what}: {box[1]}")
    return box[0]


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions that report something the user gave (flag, JSON value, data file, checkpoint)."""
    from megatron_sp_ext.errors import SPConfigError, UserError  # noqa: PLC0415

    from .data import LatentFileError  # noqa: PLC0415
    from .safe_load import CheckpointError  # noqa: PLC0415
    return (UserError, SPConfigError, CheckpointError, LatentFileError)


def job_rank() -> int:
    """This process's rank: the default group's, else the launcher's RANK (0 without one)."""
    if dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def launcher_stops_the_others() -> bool:
    """Whether this process runs under torchrun's agent, which stops every other worker as soon as one exits with
    an error (so a rank that exits first can cut off another's message)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def wait_for_rank0_to_report(wait_s: float = PARSE_ERROR_WAIT_SECONDS) -> None:
    """For a rank other than 0 with a command-line error, under torchrun: wait up to ``wait_s`` before exiting, so
    that rank 0, which has the same error (the same argv and environment) and prints the job's one message, ends the
    job first (the agent then stops this rank). Returning means rank 0 did not end it: the error is this rank's
    alone, to be printed here. Without torchrun nothing stops rank 0 and the caller does not wait."""
    time.sleep(wait_s)


def wants_tracebacks(argv: Optional[list] = None) -> bool:
    """``SPX_TRACEBACK=1`` or ``--log-level DEBUG`` on the command line: user errors show their tracebacks."""
    if os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, tok in enumerate(argv):
        value = tok.split("=", 1)[1] if tok.startswith("--log-level=") else (
            argv[i + 1] if tok == "--log-level" and i + 1 < len(argv) else None)
        if value is not None and value.upper() == "DEBUG":
            return True
    return False


def run_entry(main: Callable[[Optional[list]], object], what: str, argv: Optional[list] = None) -> int:
    """Run an entry point's ``main(argv)`` as a command; returns the exit status. A user error ends it
    with status 1 and one message per job (printed by ``report_failures`` on the rank it picked, else by
    rank 0), no traceback unless ``wants_tracebacks``; other errors propagate with their traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        main(argv)
    except user_error_types() as e:
        if wants_tracebacks(argv):
            traceback.print_exc()
        announced = getattr(e, "spx_announced", None)
        if announced is None and job_rank() == 0:
            print(f"[{what}] error: {e}", file=sys.stderr, flush=True)
        record_user_error(f"[{what}] error: {e}")  # torchrun's "Root Cause" shows this line
        return 1
    return 0


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
        rank = job_rank()
        first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        line = f"[rank {rank}] {what} failed: {first}"
        store = _store()
        if store is not None:
            _post(store, rank, first)
        if isinstance(e, PeerFailed):   # rank 0 prints its own error (on_rank0); this rank stays silent, exiting
            e.spx_announced = False     # after rank 0 printed (a launcher stops rank 0 once one rank exits)
            if store is not None:
                _wait_for(store, ANNOUNCED)
            raise
        if isinstance(e, user_error_types()):  # one message per job, no per-rank line
            e.spx_announced = _lowest_with(store, rank, first) if store is not None else rank == 0
            if e.spx_announced:
                print(f"[{what}] error: {e}", file=sys.stderr, flush=True)
                if store is not None:
                    _set(store, ANNOUNCED, first)
            elif store is not None:   # exit after the printing rank printed: a launcher stops it when one exits
                _wait_for(store, ANNOUNCED)
            raise
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


def _lowest_with(store, rank: int, text: str, wait_s: float = USER_ERROR_WAIT_SECONDS) -> bool:
    """Whether this rank is the lowest one that posted ``text``: waits up to ``wait_s`` for every rank
    to post (they do at once when they all hit the same error), then compares. A store that does not
    answer leaves it to rank 0."""
    world = dist.get_world_size()
    keys = [_KEY.format(r) for r in range(world)]
    deadline = time.monotonic() + wait_s
    try:
        while not all(store.check([k]) for k in keys[:rank]) and time.monotonic() < deadline:
            time.sleep(0.05)
        for r in range(rank):
            if store.check([keys[r]]) and store.get(keys[r]).decode(errors="replace") == text:
                return False
        return True
    except Exception:  # noqa: BLE001 - the store host (rank 0 without a launcher agent) may be gone
        return rank == 0


def _post(store, rank: int, text: str) -> None:
    _set(store, _KEY.format(rank), text)


def _set(store, key: str, text: str) -> None:
    try:
        store.set(key, text)
    except Exception:  # noqa: BLE001 - the store host may be the rank that died
        pass


def _wait_for(store, key: str, wait_s: float = USER_ERROR_WAIT_SECONDS) -> None:
    """Wait up to ``wait_s`` until ``key`` is in ``store`` (a store gone ends the wait)."""
    deadline = time.monotonic() + wait_s
    try:
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - the store host (rank 0 without a launcher agent) may be gone
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
