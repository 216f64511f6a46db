"""The flag protocol of the kernel-free copy-engine all-to-all, as a pure list of stream operations.

Each rank owns ``slots`` send slots in one symmetric workspace and a fixed block of uint32 flags.
Exchange number n (counted alike on every rank of the group, epoch e = n + 1) uses slot n % slots:

  acquire (main stream, before anything is written into the slot):
      wait DONE[slot][p] >= e - slots  for every peer p   (p finished pulling the slot's last use)
  exchange:
      main:      [stage send -> own slot]; WRITE peer p's READY[slot][me] = e for every peer p;
                 record event "start"
      stream r:  (one per source rank r, own segment included) wait "start";
                 r != me: wait READY[slot][r] >= e (r's data is in its slot);
                 copy r's segment for me (r's slot, or own slot for r == me) -> recv;
                 r != me: WRITE r's DONE[slot][me] = e (r may reuse the slot)
      main:      wait every stream r
No SM work at all: the waits and writes are stream memory operations, the copies run on copy
engines. Flags only grow (epochs), so they are never reset; every wait compares with >=.

Why it cannot deadlock (also when every stream shares one hardware queue): on each rank the READY
writes of exchange n are queued before any wait of exchange n, and every wait of exchange n depends
only on writes of exchanges <= n queued before the peer's own waits of exchange n; by induction on
n every wait is eventually satisfied. ``tests/test_signal_schedule.py`` simulates this across ranks
(separate queues and one shared queue, random interleavings) and checks every copy reads the data of
its own exchange.

Op tuples (stream is "main" or a source rank):
  ("wait_flag", stream, kind, slot, peer, value)       own flag kind[slot][peer] >= value
  ("write_flag", stream, target, kind, slot, value)    target's flag kind[slot][me] = value
  ("stage", "main", slot)                              send -> own slot
  ("record", "main", name) / ("wait_event", stream, name)
  ("copy", stream, src_rank, slot, src_off, dst_off, n) src_rank's slot[src_off:+n] -> recv[dst_off:+n]
  ("join", "main", stream)                             main waits for everything queued on stream
"""
from __future__ import annotations

from typing import Sequence

READY, DONE = 0, 1


def flag_index(kind: int, slot: int, peer: int, slots: int, world: int) -> int:
    """Position of flag kind[slot][peer] in a rank's flag block of 2 * slots * world uint32."""
    return (kind * slots + slot) * world + peer


def acquire_ops(me: int, world: int, epoch: int, slots: int) -> list:
    """Before exchange ``epoch`` writes into its slot: wait until every peer finished the slot's last use."""
    if epoch <= slots:
        return []
    slot = (epoch - 1) % slots
    return [("wait_flag", "main", DONE, slot, p, epoch - slots) for p in range(world) if p != me]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each segment of a buffer cut into ``sizes``."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def exchange_ops(me: int, world: int, epoch: int, slots: int, send_table: Sequence[Sequence[int]],
                 staged: bool) -> list:
    """The stream operations of exchange ``epoch`` (after ``acquire_ops``); sizes in bytes or elements.

    send_table[r][p]: amount rank r sends to rank p. Sources are visited from ``me`` on (own segment
    first, then me+1, ...), so no rank is read by every peer at once."""
    slot = (epoch - 1) % slots
    ops: list = [] if staged else [("stage", "main", slot)]
    ops += [("write_flag", "main", p, READY, slot, epoch) for p in range(world) if p != me]
    ops.append(("record", "main", "start"))
    recv_off = offsets([send_table[r][me] for r in range(world)])
    used = []
    for step in range(world):
        r = (me + step) % world
        n = send_table[r][me]
        ops.append(("wait_event", r, "start"))
        if r != me:
            ops.append(("wait_flag", r, READY, slot, r, epoch))
        if n:
            ops.append(("copy", r, r, slot, offsets(send_table[r])[me], recv_off[r], n))
        if r != me:  # also when nothing was pulled: the peer waits for this before reusing the slot
            ops.append(("write_flag", r, r, DONE, slot, epoch))
        used.append(r)
    ops += [("join", "main", r) for r in used]
    return ops
