"""The kernel-free copy-engine all-to-all's flag protocol (comm/signal_schedule.py), simulated on CPU.

A small GPU model runs every rank's queued operations: flags in each rank's memory, send slots
stamped with the exchange that last wrote them, events, per-stream FIFO queues (or one FIFO per rank,
as with CUDA_DEVICE_MAX_CONNECTIONS=1). A random scheduler picks any runnable queue head. The model
fails if a copy reads a slot that holds another exchange's data (a slot reused too early), if a
consumer reads its receive buffer before every segment arrived, if a flag ever goes backwards, or
if no queue can move while work remains (deadlock). The CUDA transport executes exactly these ops.
"""
import random

import pytest

from megatron_sp_ext.comm import signal_schedule as sig


class Deadlock(AssertionError):
    pass


def _host_program(me, world, slots, tables, staged):
    """Every op rank ``me`` queues for the exchanges, in host order, tagged with the epoch."""
    prog = []
    for n, table in enumerate(tables):
        e = n + 1
        prog += [(e, op) for op in sig.acquire_ops(me, world, e, slots)]
        if staged[n]:  # the caller packs straight into the slot after acquiring it
            prog.append((e, ("stage", "main", (e - 1) % slots)))
        prog += [(e, op) for op in sig.exchange_ops(me, world, e, slots, table, staged[n])]
        prog.append((e, ("consume", "main")))  # the caller reads recv on its stream
    return prog


def simulate(world, slots, tables, staged, shared_queue, seed):
    rng = random.Random(seed)
    flags = [dict() for _ in range(world)]                  # owner -> {(kind, slot, peer): value}
    slot_epoch = [[0] * slots for _ in range(world)]        # which exchange's data each slot holds
    arrived = [dict() for _ in range(world)]                # rank -> {epoch: set(src)}
    events = set()
    queues, joins = {}, {}
    for me in range(world):
        for idx, (e, op) in enumerate(_host_program(me, world, slots, tables, staged)):
            stream = "main" if shared_queue else op[1]
            q = queues.setdefault((me, stream), [])
            if op[0] == "join" and not shared_queue:  # main waits for what stream op[2] has queued so far
                joins[(me, e, op[2], idx)] = len(queues.get((me, op[2]), []))
                op = op + (idx,)
            q.append((e, op))
    done = {k: 0 for k in queues}

    def runnable(me, e, op):
        kind = op[0]
        if kind == "wait_flag":
            return flags[me].get((op[2], op[3], op[4]), 0) >= op[5]
        if kind == "wait_event":
            return (me, e, op[2]) in events
        if kind == "join":  # (one shared queue: everything queued before it has run already)
            return len(op) < 4 or done.get((me, op[2]), 0) >= joins[(me, e, op[2], op[3])]
        return True

    def execute(me, e, op):
        kind = op[0]
        if kind == "stage":
            slot_epoch[me][op[2]] = e
        elif kind == "write_flag":
            key = (op[3], op[4], me)
            assert op[5] > flags[op[2]].get(key, 0), f"flag {key} of rank {op[2]} went backwards"
            flags[op[2]][key] = op[5]
        elif kind == "record":
            events.add((me, e, op[2]))
        elif kind == "copy":
            src, slot = op[2], op[3]
            assert slot_epoch[src][slot] == e, (f"rank {me} exchange {e} read rank {src}'s slot {slot} holding "
                                                f"exchange {slot_epoch[src][slot]}'s data")
            arrived[me].setdefault(e, set()).add(src)
        elif kind == "consume":
            want = {r for r in range(world) if tables[e - 1][r][me]}
            got = arrived[me].get(e, set())
            assert got == want, f"rank {me} exchange {e} consumed before {sorted(want - got)} arrived"

    while any(done[k] < len(q) for k, q in queues.items()):
        heads = [k for k, q in queues.items() if done[k] < len(q) and runnable(k[0], *q[done[k]])]
        if not heads:
            stuck = {k: q[done[k]] for k, q in queues.items() if done[k] < len(q)}
            raise Deadlock(f"no queue can move: {stuck}")
        k = rng.choice(heads)
        e, op = queues[k][done[k]]
        execute(k[0], e, op)
        done[k] += 1
    return True


def _tables(world, count, seed, even):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if even:
            n = rng.randint(1, 4)
            out.append([[n] * world for _ in range(world)])
        else:
            out.append([[rng.randint(0, 3) for _ in range(world)] for _ in range(world)])
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("shared_queue", [False, True])
def test_protocol_is_safe_and_live(world, slots, shared_queue):
    for seed in range(12):
        tables = _tables(world, 7, seed, even=seed % 2 == 0)
        staged = [random.Random(seed * 31 + n).random() < 0.5 for n in range(len(tables))]
        simulate(world, slots, tables, staged, shared_queue, seed)


def _failing_seeds(slots, staged, world=3, exchanges=6):
    """How many of 40 random interleavings the model rejects (with a broken protocol patched in)."""
    failures = 0
    for seed in range(40):
        try:
            simulate(world, slots, _tables(world, exchanges, seed, even=True), [staged] * exchanges, False, seed)
        except AssertionError:
            failures += 1
    return failures


def test_simulator_catches_slot_reuse_without_acquire(monkeypatch):
    """The model is not vacuous: with the acquire waits removed, some interleaving overwrites a slot
    a peer has not finished reading (or consumes early), and the model fails."""
    monkeypatch.setattr(sig, "acquire_ops", lambda *a, **k: [])
    assert _failing_seeds(slots=1, staged=False) > 0


def test_simulator_catches_a_missing_ready_wait(monkeypatch):
    orig = sig.exchange_ops
    monkeypatch.setattr(sig, "exchange_ops", lambda *a, **k: [op for op in orig(*a, **k) if op[0] != "wait_flag"])
    assert _failing_seeds(slots=2, staged=True) > 0


def test_flag_layout_is_a_bijection():
    world, slots = 4, 3
    idx = {sig.flag_index(k, s, p, slots, world) for k in (sig.READY, sig.DONE) for s in range(slots)
           for p in range(world)}
    assert idx == set(range(2 * slots * world))


def test_exchange_ops_visit_own_segment_first_and_release_every_peer():
    table = [[1, 0, 2], [3, 1, 0], [0, 2, 5]]
    ops = sig.exchange_ops(1, 3, 4, 2, table, staged=False)
    assert ops[0] == ("stage", "main", 1)
    copies = [op for op in ops if op[0] == "copy"]
    assert [c[2] for c in copies] == [1, 2]  # rank 0 sends nothing to rank 1: no copy from it
    assert copies[0] == ("copy", 1, 1, 1, 3, 0, 1) and copies[1] == ("copy", 2, 2, 1, 0, 1, 2)
    released = {op[2] for op in ops if op[0] == "write_flag" and op[3] == sig.DONE}
    assert released == {0, 2}  # also rank 0, whose segment was empty


def test_compiled_exchange_addresses_every_segment_and_flag():
    """CopyEngineTransport._compile resolves the op list to driver-call arguments: every copy reads
    the right peer address and lands at the right receive offset, flags hit the right words."""
    import types

    from megatron_sp_ext.comm import stream_ops as so
    from megatron_sp_ext.comm.transport import CopyEngineTransport

    world, me, slots, slot, sb = 3, 1, 2, 1, 1000
    table_b = [[8, 4, 0], [2, 6, 10], [12, 16, 4]]
    tr = object.__new__(CopyEngineTransport)
    tr.rank, tr.world, tr.slots, tr._slot_bytes, tr._ops = me, world, slots, sb, so
    tr._base = {r: 10_000 * (r + 1) for r in range(world)}
    tr._flag_base = {r: 1_000_000 * (r + 1) for r in range(world)}
    tr._streams = [types.SimpleNamespace(cuda_stream=100 + r) for r in range(world)]
    tr._start = types.SimpleNamespace(handle=types.SimpleNamespace(value=7))
    tr._joined = [types.SimpleNamespace(handle=types.SimpleNamespace(value=70 + r)) for r in range(world)]
    cur = types.SimpleNamespace(cuda_stream=99)
    prog = tr._compile(table_b, False, slot, cur)
    copies = sorted((op[2], op[3], op[4], op[1]) for op in prog if op[0] == so.COPY)
    # recv layout: from rank 0 (4 bytes), rank 1 (6), rank 2 (16); source offsets inside each slot
    assert copies == [(0, 10_000 + slot * sb + 8, 4, 100), (4, 20_000 + slot * sb + 2, 6, 101),
                      (10, 30_000 + slot * sb + 12, 16, 102)]
    stage = [op for op in prog if op[0] == so.STAGE]
    assert stage == [(so.STAGE, 99, 20_000 + slot * sb, 18, 0)]
    ready = {op[2] for op in prog if op[0] == so.WRITE and op[1] == 99}
    assert ready == {1_000_000 * (p + 1) + 4 * sig.flag_index(sig.READY, slot, me, slots, world) for p in (0, 2)}
    waits = {(op[1], op[2]) for op in prog if op[0] == so.WAIT}
    assert waits == {(100 + r, 1_000_000 * (me + 1) + 4 * sig.flag_index(sig.READY, slot, r, slots, world))
                     for r in (0, 2)}
    done = {(op[1], op[2]) for op in prog if op[0] == so.WRITE and op[1] != 99}
    assert done == {(100 + r, 1_000_000 * (r + 1) + 4 * sig.flag_index(sig.DONE, slot, me, slots, world))
                    for r in (0, 2)}
    assert all(op[3] == 0 for op in prog if op[0] in (so.WAIT, so.WRITE))  # value = this exchange's epoch
    joins = [op for op in prog if op[0] == so.EVENT_WAIT and op[1] == 99]
    assert sorted(op[2] for op in joins) == [70, 71, 72]


def test_both_transports_share_one_translator():
    """HostStagedTransport._compile and CopyEngineTransport._compile are one translator (comm/program.py): on the
    same addresses, streams and events they give the same program (host-staged never has its send staged)."""
    import types

    from megatron_sp_ext.comm import stream_ops as so
    from megatron_sp_ext.comm.host_staged import HostStagedTransport
    from megatron_sp_ext.comm.transport import CopyEngineTransport

    world, slots, sb = 4, 2, 4096
    table_b = [[(3 * r + p) % 5 * 8 for p in range(world)] for r in range(world)]
    streams = [types.SimpleNamespace(cuda_stream=200 + r) for r in range(world)]
    start = types.SimpleNamespace(handle=types.SimpleNamespace(value=5))
    joined = [types.SimpleNamespace(handle=types.SimpleNamespace(value=50 + r)) for r in range(world)]
    ws = {r: 1 << (20 + r) for r in range(world)}
    flags = {r: 1 << (30 + r) for r in range(world)}
    for me in range(world):
        ce, hs = object.__new__(CopyEngineTransport), object.__new__(HostStagedTransport)
        for tr in (ce, hs):
            tr.rank, tr.world, tr.slots, tr._slot_bytes, tr._ops = me, world, slots, sb, so
            tr._streams, tr._start, tr._joined = streams, start, joined
        ce._base, ce._flag_base = ws, flags
        hs._addr, hs._flag_addr = ws, flags
        for slot in range(slots):
            cur = types.SimpleNamespace(cuda_stream=99)
            got = hs._compile(table_b, slot, cur)
            assert got == ce._compile(table_b, False, slot, cur)
            assert [op for op in got if op[0] == so.STAGE] == [(so.STAGE, 99, ws[me] + slot * sb, sum(table_b[me]), 0)]
