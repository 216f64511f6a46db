"""One exchange of the flag protocol (``signal_schedule``) compiled to a ``stream_ops`` program.

    memory = ExchangeMemory(me, world, slots, slot_bytes, workspaces, flags)     # the transport's, fixed
    order = ExchangeStreams(streams, main=cur, start=start_event, joined=joined_events)
    prog = compile_exchange(memory, slot, table_b, staged, order)
    stream_ops.run_program(prog, epoch, recv_ptr, send_ptr)

The op list of ``signal_schedule.exchange_ops`` resolved to driver calls on addresses, stream and event
handles. One translator for both stream-ordered transports of the protocol: the copy-engine transport
(the peers' workspaces and flags in symmetric device memory) and the host-staged one (in shared pinned host
memory); they differ only in the addresses they pass. Flag values are stored relative to the first epoch
that uses the slot (``run_program`` adds the epoch), so a program is reused by every exchange of the same
table, slot and stream (``ProgramCache``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

from . import signal_schedule as sig
from . import stream_ops

FLAG_BYTES = 4   # one uint32 flag


def flag_offset(kind: int, slot: int, peer: int, slots: int, world: int) -> int:
    """Byte offset of flag kind[slot][peer] in a rank's flag block."""
    return FLAG_BYTES * sig.flag_index(kind, slot, peer, slots, world)


@dataclass(frozen=True)
class ExchangeMemory:
    """Where one transport's exchanges live, as mapped on rank ``me`` of ``world``: workspaces[r] / flags[r] are
    the addresses of rank r's workspace (``slots`` send slots of ``slot_bytes``) and of its flag block."""

    me: int
    world: int
    slots: int
    slot_bytes: int
    workspaces: Mapping[int, int]
    flags: Mapping[int, int]


@dataclass(frozen=True)
class ExchangeStreams:
    """The streams and events of one exchange: streams[r] copies rank r's segment; main: the current stream; the
    copies start after main's ``start`` (a ``stream_ops.Event``) and main joins stream r through joined[r]."""

    streams: Sequence
    main: object
    start: object
    joined: Sequence


def compile_exchange(memory: ExchangeMemory, slot: int, table_b: Sequence[Sequence[int]], staged: bool,
                     order: ExchangeStreams) -> tuple:
    """The program of one exchange through send slot ``slot`` of ``memory`` (table in bytes, ``table_b[r][p]``: r
    to p), on ``order``'s streams and events. staged: the send data is already in this rank's slot (no staging
    copy)."""
    me, world, slots = memory.me, memory.world, memory.slots
    workspaces, flags, start, joined = memory.workspaces, memory.flags, order.start, order.joined
    slot_bytes = memory.slot_bytes
    so = stream_ops
    handle = {r: s.cuda_stream for r, s in enumerate(order.streams)}
    handle["main"] = order.main.cuda_stream
    slot_off = slot * slot_bytes
    e0 = slot + 1  # an epoch that uses this slot; flag values are stored relative to it
    prog = []
    for op in sig.exchange_ops(me, world, e0, slots, table_b, staged):
        kind, h = op[0], handle[op[1]]
        if kind == "copy":
            _, _, src, _, src_off, dst_off, n = op
            prog.append((so.COPY, h, dst_off, workspaces[src] + slot_off + src_off, n))
        elif kind == "wait_flag":
            _, _, fk, fslot, peer, value = op
            prog.append((so.WAIT, h, flags[me] + flag_offset(fk, fslot, peer, slots, world), value - e0, 0))
        elif kind == "write_flag":
            _, _, target, fk, fslot, value = op
            prog.append((so.WRITE, h, flags[target] + flag_offset(fk, fslot, me, slots, world), value - e0, 0))
        elif kind == "record":
            prog.append((so.EVENT_RECORD, h, start.handle.value, 0, 0))
        elif kind == "wait_event":
            prog.append((so.EVENT_WAIT, h, start.handle.value, 0, 0))
        elif kind == "join":
            ev = joined[op[2]].handle.value
            prog += [(so.EVENT_RECORD, handle[op[2]], ev, 0, 0), (so.EVENT_WAIT, h, ev, 0, 0)]
        elif kind == "stage":
            prog.append((so.STAGE, h, workspaces[me] + slot_off, sum(table_b[me]), 0))
    return tuple(prog)


class ProgramCache:
    """Compiled exchanges by key (table, slot, stream, ...). ``clear()`` when the workspace moves (programs
    hold its addresses); past ``limit`` distinct keys it starts over rather than grow without bound."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._programs: dict = {}

    def get(self, key: Hashable, build: Callable[[], tuple]) -> tuple:
        prog = self._programs.get(key)
        if prog is None:
            if len(self._programs) > self.limit:
                self._programs.clear()
            prog = self._programs[key] = build()
        return prog

    def clear(self) -> None:
        self._programs.clear()

    def __len__(self) -> int:
        return len(self._programs)
