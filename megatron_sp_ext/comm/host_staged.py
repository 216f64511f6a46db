"""Host-staged all-to-all: every byte goes GPU -> pinned host memory -> GPU, as over a NIC.

The emulated machine boundary of a one-box cluster (topology/emulate.py): the exchanges of a group
that spans emulated machines take the path a GPU-to-NIC transfer takes, a device-to-host copy on a
copy engine into a pinned host buffer and a host-to-device copy on the receiver, so they run at
PCIe-class bandwidth (~25-50 GB/s per GPU) while groups inside a machine keep NVLink. Unlike
``NCCL_P2P_DISABLE=1`` (read once per process, so it throttles every group) this is chosen per
process group: pass ``transport="host_staged"`` (or ``link_transport(group)``) for the cross-machine
groups only.

Mechanism. Each rank owns ``slots`` send slots in a shared-memory file (/dev/shm) that every rank of
the group maps (and pins, on CUDA), plus a fixed block of uint32 flags in a second shared file. The
protocol is the copy-engine transport's, unchanged (``signal_schedule``: acquire; stage; READY flags;
per source: wait READY, pull, write DONE; join), so its safety and liveness are the ones simulated in
tests/test_signal_schedule.py. Only the places differ: the slots and flags live in host memory, and
"stage" is a device-to-host copy. On CUDA every op is a driver call queued on the caller's stream and
one stream per source rank (copies on copy engines, flag waits/writes as stream memory operations on
the host-mapped flags): no kernel, nothing blocks the host. On CPU (gloo groups, tests) the same op
list runs in program order on the calling thread, polling the shared flags; that is the one-shared-
queue case the simulation proves live, and it makes the data path testable bit for bit.

Construction and workspace growth are collective (every rank computes the same size from the table).
"""
from __future__ import annotations

import ctypes
import datetime
import os
import time
import uuid
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import SPConfigError
from . import signal_schedule as sig
from . import stream_ops
from .program import ExchangeMemory, ExchangeStreams, ProgramCache, compile_exchange, flag_offset
from ..topology.groups import new_subgroup
from .exchange import Done, exchange_table

SHM_DIR_ENV = "SPX_HOST_STAGED_DIR"   # where the shared files go (default /dev/shm)


def _shm_dir() -> str:
    return os.environ.get(SHM_DIR_ENV, "/dev/shm")


def host_staged_unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
    """Why the host-staged transport cannot run here, or None when it can."""
    d = _shm_dir()
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        return f"its shared-memory directory {d!r} is not writable (set {SHM_DIR_ENV})"
    if device.type == "cuda":
        why = stream_ops.unavailable_reason()
        if why is not None:
            return f"CUDA stream memory operations are unavailable: {why}"
    elif device.type != "cpu":
        return f"it supports CUDA and CPU tensors (got device {device.type})"
    return None


def check_host_staged(group: dist.ProcessGroup, device: torch.device, name: str = "transport") -> None:
    reason = host_staged_unavailable_reason(group, device)
    if reason is not None:
        raise SPConfigError(f"{name}='host_staged' (host-memory staged exchange) cannot run here: {reason}; "
                            f"use 'nccl'")


class _Pinned:
    """Registers host memory with CUDA (pinned + mapped) through the driver; unregisters on release."""

    _lib = None

    @classmethod
    def lib(cls):
        if cls._lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                         ctypes.c_uint]
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
            cls._lib = lib
        return cls._lib

    @classmethod
    def register(cls, t: torch.Tensor) -> int:
        """Pin ``t``'s pages (CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP) and return their device address."""
        lib = cls.lib()
        rc = lib.cuMemHostRegister_v2(t.data_ptr(), t.numel() * t.element_size(), 0x1 | 0x2)
        if rc != 0:
            raise RuntimeError(f"cuMemHostRegister failed with CUresult {rc}")
        dptr = ctypes.c_uint64()
        rc = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), t.data_ptr(), 0)
        if rc != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUresult {rc}")
        return dptr.value

    @classmethod
    def unregister(cls, t: torch.Tensor) -> None:
        cls.lib().cuMemHostUnregister(t.data_ptr())


class HostStagedTransport:
    """All-to-all through shared pinned host memory (see module doc). ``slots`` send slots used in turn."""

    name = "host_staged"
    stream_ordered = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, slots: int = 2,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120)) -> None:
        check_host_staged(group, device)
        self.group, self.device, self.slots = group, device, slots
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.cuda = device.type == "cuda"
        self.timeout_s = timeout.total_seconds()
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        self._prefix = os.path.join(_shm_dir(), f"spx_hs_{token[0]}")
        self._epoch = 0
        self._acquired = 0
        self._slot_bytes = 0
        self._gen = 0                     # workspace generation (file name suffix)
        self._ws: dict[int, torch.Tensor] = {}     # rank -> its workspace as mapped here (uint8)
        self._addr: dict[int, int] = {}            # rank -> device address of that mapping (CUDA)
        self._programs = ProgramCache()
        nflags = 2 * slots * self.world
        self._flag_bytes = (4 * nflags + 4095) // 4096 * 4096  # whole pages (host registration)
        own = self._map(f"{self._prefix}_flags_{self.rank}", self._flag_bytes, create=True)
        own.zero_()
        self._barrier()  # every flag file exists and is zeroed before anyone maps it
        self._flags = {r: own if r == self.rank else self._map(f"{self._prefix}_flags_{r}", self._flag_bytes)
                       for r in range(self.world)}
        self._flag_addr = {r: _Pinned.register(t) for r, t in self._flags.items()} if self.cuda else {}
        if self.cuda:
            self._ops = stream_ops
            self._streams = [torch.cuda.Stream(device=device) for _ in range(self.world)]
            self._start = stream_ops.Event()
            self._joined = [stream_ops.Event() for _ in range(self.world)]
        self._barrier()  # every rank has mapped every flag file: the files can be unlinked
        os.remove(f"{self._prefix}_flags_{self.rank}")

    # -- shared files ----------------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    @staticmethod
    def _map(path: str, nbytes: int, create: bool = False) -> torch.Tensor:
        if create:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        elif not os.path.exists(path):
            raise RuntimeError(f"host_staged: a peer's shared file {path} is missing")
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    def _ensure(self, need_bytes: int) -> None:
        """Grow every slot to ``need_bytes`` (the same value on every rank: collective)."""
        if self._ws and self._slot_bytes >= need_bytes:
            return
        sb = max(need_bytes, 2 * self._slot_bytes)
        sb = (sb + (1 << 20) - 1) >> 20 << 20
        self._gen += 1
        self._barrier()  # no queued copy touches the old workspaces any more
        if self.cuda:
            for t in self._ws.values():
                _Pinned.unregister(t)
        path = f"{self._prefix}_ws{self._gen}_"
        mine = self._map(path + str(self.rank), self.slots * sb, create=True)
        self._barrier()
        ws = {r: mine if r == self.rank else self._map(path + str(r), self.slots * sb) for r in range(self.world)}
        self._barrier()
        os.remove(path + str(self.rank))  # mapped everywhere: the memory lives as long as the mappings
        self._ws, self._slot_bytes = ws, sb
        self._addr = {r: _Pinned.register(t) for r, t in ws.items()} if self.cuda else {}
        self._programs.clear()  # compiled exchanges hold workspace addresses

    # -- protocol --------------------------------------------------------------------------------
    def _flag_pos(self, kind: int, slot: int, peer: int) -> int:
        return flag_offset(kind, slot, peer, self.slots, self.world)

    def _host_wait(self, owner: int, pos: int, value: int, what: str) -> None:
        flag = self._flags[owner][pos:pos + 4].view(torch.int32)
        deadline = time.monotonic() + self.timeout_s
        while int(flag[0]) < value:
            if time.monotonic() > deadline:
                raise RuntimeError(f"host_staged: rank {self.rank} waited {self.timeout_s:.0f}s for {what} "
                                   f">= {value} (a peer stopped or issued a different exchange)")
            time.sleep(5e-5)

    def _host_write(self, owner: int, pos: int, value: int) -> None:
        self._flags[owner][pos:pos + 4].view(torch.int32)[0] = value

    def _acquire(self, epoch: int, stream=None) -> None:
        if self._acquired >= epoch:
            return
        for op in sig.acquire_ops(self.rank, self.world, epoch, self.slots):
            pos = self._flag_pos(op[2], op[3], op[4])
            if self.cuda:
                self._ops.wait_geq(stream, self._flag_addr[self.rank] + pos, op[5])
            else:
                self._host_wait(self.rank, pos, op[5], f"DONE of slot {op[3]} from rank {op[4]}")
        self._acquired = epoch

    def send_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A plain buffer on the caller's device (staging into host memory is always a copy)."""
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, send_splits: Optional[Sequence[int]] = None,
                   recv_splits: Optional[Sequence[int]] = None, async_op: bool = False, table=None):
        world, es = self.world, send.element_size()
        table = exchange_table(type(self).__name__, self.rank, world, send, recv, send_splits, recv_splits, table)
        epoch = self._epoch + 1
        slot = (epoch - 1) % self.slots
        self._ensure(max(sum(row) for row in table) * es)
        table_b = [[n * es for n in row] for row in table]
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            self._acquire(epoch, cur)
            key = (tuple(map(tuple, table_b)), slot, cur.cuda_stream)
            prog = self._programs.get(key, lambda: self._compile(table_b, slot, cur))
            send.record_stream(cur)
            self._ops.run_program(prog, epoch, recv.data_ptr(), send.data_ptr())
        else:
            self._acquire(epoch)
            self._run_host(table_b, epoch, slot, send.view(torch.uint8), recv.view(torch.uint8))
        self._epoch = epoch
        return Done() if async_op else None

    def _run_host(self, table_b, epoch: int, slot: int, send_b: torch.Tensor, recv_b: torch.Tensor) -> None:
        """The op list in program order on this thread (CPU tensors)."""
        base = slot * self._slot_bytes
        for op in sig.exchange_ops(self.rank, self.world, epoch, self.slots, table_b, staged=False):
            kind = op[0]
            if kind == "stage":
                self._ws[self.rank][base:base + send_b.numel()].copy_(send_b)
            elif kind == "write_flag":
                _, _, target, fk, fslot, value = op
                self._host_write(target, self._flag_pos(fk, fslot, self.rank), value)
            elif kind == "wait_flag":
                _, _, fk, fslot, peer, value = op
                self._host_wait(self.rank, self._flag_pos(fk, fslot, peer), value, f"READY of slot {fslot} from rank {peer}")
            elif kind == "copy":
                _, _, src, _, src_off, dst_off, n = op
                recv_b[dst_off:dst_off + n].copy_(self._ws[src][base + src_off:base + src_off + n])
            # record / wait_event / join: program order already gives them

    def _compile(self, table_b, slot: int, cur) -> tuple:
        """``compile_exchange`` on the pinned shared host workspaces and flags (their device addresses)."""
        memory = ExchangeMemory(self.rank, self.world, self.slots, self._slot_bytes, self._addr, self._flag_addr)
        return compile_exchange(memory, slot, table_b, False,
                                ExchangeStreams(self._streams, cur, self._start, self._joined))

    def close(self) -> None:
        """Unpin the mappings (CUDA). The shared files were unlinked once every rank had mapped them."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            for t in list(self._flags.values()) + list(self._ws.values()):
                _Pinned.unregister(t)
        self._ws, self._flag_addr, self._addr = {}, {}, {}


def ring_table(world: int, numel: int, shift: int = 1) -> list[list[int]]:
    """The exchange table of one ring step (rank r sends ``numel`` elements to r + shift): lets a ring
    step run through any transport as an all-to-all with one nonzero entry per row."""
    return [[numel if p == (r + shift) % world else 0 for p in range(world)] for r in range(world)]


class TwoLevelTransport:
    """An all-to-all over a group that spans emulated machines, each segment over its own link: the
    segments between ranks of one machine over the machine's NCCL group (NVLink), the others through
    ``HostStagedTransport`` over the whole group (host memory, NIC-class). What NCCL does on a real
    multi-machine cluster, where an all-to-all's intra-node segments never touch the NIC.

    ``node_of[r]``: machine of group rank r (machine-contiguous). Ranks of a machine are consecutive,
    so its segments are one contiguous range of ``send`` and of ``recv``: they are exchanged in place.
    The cross-machine segments are packed into a compact buffer (a local copy), exchanged with the
    intra-machine entries of the table set to 0, and unpacked.
    """

    name = "two_level"
    stream_ordered = False  # the intra-machine part is an NCCL collective with a work handle

    def __init__(self, group: dist.ProcessGroup, device: torch.device, node_of: Sequence[int],
                 slots: int = 2) -> None:
        self.group, self.device, self.node_of = group, device, tuple(node_of)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if list(self.node_of) != sorted(self.node_of):
            raise SPConfigError(f"two_level transport: the group's ranks are not machine-contiguous ({list(node_of)})")
        mine = self.node_of[self.rank]
        self.local = [r for r in range(self.world) if self.node_of[r] == mine]
        self.intra = None
        if len(self.local) > 1:
            self.intra = new_subgroup([dist.get_global_rank(group, r) for r in self.local], group,
                                      use_local_synchronization=True)
        self.inter = HostStagedTransport(group, device, slots=slots)

    def send_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, send_splits: Optional[Sequence[int]] = None,
                   recv_splits: Optional[Sequence[int]] = None, async_op: bool = False, table=None):
        me, world = self.rank, self.world
        table = exchange_table(type(self).__name__, me, world, send, recv, send_splits, recv_splits, table)
        lo, hi = self.local[0], self.local[-1] + 1
        s_off, r_off = sig.offsets(table[me]), sig.offsets([table[r][me] for r in range(world)])
        work = None
        if self.intra is not None:
            s_lo, r_lo = s_off[lo], r_off[lo]
            s_n = sum(table[me][lo:hi])
            r_n = sum(table[r][me] for r in range(lo, hi))
            work = dist.all_to_all_single(recv.narrow(0, r_lo, r_n), send.narrow(0, s_lo, s_n),
                                          [table[r][me] for r in range(lo, hi)], list(table[me][lo:hi]),
                                          group=self.intra, async_op=True)
        elif table[me][me]:  # alone on its machine: the own segment is a local copy
            recv.narrow(0, r_off[me], table[me][me]).copy_(send.narrow(0, s_off[me], table[me][me]))
        far = [[0 if self.node_of[r] == self.node_of[p] else table[r][p] for p in range(world)] for r in range(world)]
        if any(any(row) for row in far):
            peers = [p for p in range(world) if far[me][p]]
            srcs = [r for r in range(world) if far[r][me]]
            send_far = torch.cat([send.narrow(0, s_off[p], table[me][p]) for p in peers]) if peers else send[:0]
            recv_far = torch.empty(sum(far[r][me] for r in range(world)), dtype=recv.dtype, device=recv.device)
            self.inter.all_to_all(send_far.contiguous(), recv_far, table=far)
            pos = 0
            for r in srcs:
                recv.narrow(0, r_off[r], far[r][me]).copy_(recv_far.narrow(0, pos, far[r][me]))
                pos += far[r][me]
        if work is not None and not async_op:
            work.wait()
            return None
        return work if async_op and work is not None else (Done() if async_op else None)
