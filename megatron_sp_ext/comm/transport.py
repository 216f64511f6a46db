"""Exchange transports: who moves the bytes of a flat all-to-all.

Every exchange of the package goes through ``Transport.all_to_all(send, recv, send_splits,
recv_splits, table=...)``: 1-D contiguous buffers, segment p of ``send`` goes to rank p, segment p of
``recv`` comes from rank p (element counts; None = equal segments). It is issued on the current
stream. ``table[r][p]`` (elements rank r sends to rank p) is the whole exchange; callers that know
it pass it (Ulysses does: ``table_seq_to_head`` / ``table_head_to_seq``). The copy-engine transport
needs it for uneven exchanges; it never learns it with a hidden collective, whose cache hits could
differ between ranks and deadlock.

``NcclTransport`` ("nccl", default): one ``all_to_all_single`` of the group's backend (NCCL on
GPUs, gloo on CPU). NCCL runs it as a kernel, which competes with attention for SMs.

``SymmMemTransport`` ("symm_mem"): a copy-engine all-to-all over torch symmetric memory. Each rank
owns one symmetric workspace; an exchange stages ``send`` into it (skipped when the caller packed
straight into ``send_buffer()``), then a barrier, then every rank pulls its segment from each
peer's workspace with ``copy_`` (cudaMemcpyAsync over NVLink: copy engines, no SMs), then a second
barrier so no rank restages before its peers finished reading. Pulls from different peers run on
separate streams so several copy engines work at once. Segment offsets inside a peer's buffer come
from the table. Workspaces grow collectively (rendezvous) to the largest row sum of the table,
which every rank computes alike. The pull schedule itself is ``pull_all_to_all`` (pure indexing;
CPU-tested with simulated peer buffers). Its two barriers are kernels: next to a long attention
kernel they wait for a free SM, which is why it barely overlaps (README).

``CopyEngineTransport`` ("copy_engine"): the same pulls with no kernel at all. Instead of barriers
it uses flags written and awaited by CUDA stream memory operations (``stream_ops``) in a small
symmetric flag block, and ``slots`` send slots used in turn, so a rank never waits for all peers
at once: it waits only for the peer whose data it pulls next, and before reusing a slot for the
peers that pulled from it. The protocol is ``signal_schedule`` (pure, CPU-simulated).
"""
from __future__ import annotations

import datetime
import os
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import SPConfigError
from ..topology.emulate import emulated_machine_size, machines_of
from . import signal_schedule as sig
from . import stream_ops
from .program import ExchangeMemory, ExchangeStreams, ProgramCache, compile_exchange, flag_offset
from .signal_schedule import offsets as _offsets
from .exchange import Done, all_to_all_flat, exchange_table
from .host_staged import HostStagedTransport, TwoLevelTransport, check_host_staged

TRANSPORT_NAMES = ("nccl", "symm_mem", "copy_engine", "host_staged")


class NcclTransport:
    """The group's own all_to_all (NCCL kernel on GPUs, gloo on CPU)."""

    name = "nccl"
    stream_ordered = False  # async work handles; the caller waits on them

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, send_splits: Optional[Sequence[int]] = None,
                   recv_splits: Optional[Sequence[int]] = None, async_op: bool = False, table=None):
        return all_to_all_flat(send, recv, self.group, send_splits, recv_splits, async_op=async_op)


def table_seq_to_head(send_splits: Sequence[int]) -> list[list[int]]:
    """Every rank sends segment p (sized by p's heads) to p: all rows equal ``send_splits``."""
    return [list(send_splits) for _ in send_splits]


def table_head_to_seq(recv_splits: Sequence[int]) -> list[list[int]]:
    """Rank r sends the same amount (its heads) to everyone: row r is ``recv_splits[r]`` repeated."""
    return [[int(n)] * len(recv_splits) for n in recv_splits]


def pull_all_to_all(me: int, world: int, send_table: Sequence[Sequence[int]], recv: torch.Tensor,
                    own_send: torch.Tensor, peer_buffer: Callable[[int], torch.Tensor],
                    copy: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
    """The pull half of a copy-engine all-to-all (after staging + barrier, before the final barrier).

    send_table[r][p]: elements rank r sends to rank p. ``peer_buffer(r)`` is rank r's staged send
    buffer (1-D, any length >= its total); ``own_send`` is this rank's send buffer. ``copy(peer, dst,
    src)`` performs one copy (a CUDA stream per peer on GPUs). Peers are visited starting at me+1 so
    that no rank is read by everyone at once.
    """
    recv_splits = [send_table[r][me] for r in range(world)]
    recv_off = _offsets(recv_splits)
    for step in range(world):
        r = (me + step) % world
        n = recv_splits[r]
        if n == 0:
            continue
        src_off = _offsets(send_table[r])[me]
        src = own_send if r == me else peer_buffer(r)
        copy(r, recv.narrow(0, recv_off[r], n), src.narrow(0, src_off, n))


class SymmMemTransport:
    """Copy-engine all-to-all through torch symmetric memory (CUDA + NCCL groups; see module doc)."""

    name = "symm_mem"
    stream_ordered = True  # everything is queued on the current stream; nothing to wait on

    def __init__(self, group: dist.ProcessGroup, device: torch.device, parallel_pulls: bool = True,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120)) -> None:
        check_symm_mem(group, device)
        import torch.distributed._symmetric_memory as symm  # noqa: PLC0415  (optional in torch builds)
        self._symm = symm
        self.group, self.device = group, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.parallel_pulls = parallel_pulls
        self.timeout_ms = int(timeout.total_seconds() * 1000)
        self._buf: Optional[torch.Tensor] = None   # local workspace (uint8)
        self._hdl = None
        self._peers: dict[int, torch.Tensor] = {}
        self._streams = [torch.cuda.Stream(device=device) for _ in range(self.world)] if parallel_pulls else []
        self._last: Optional[torch.cuda.Event] = None
        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(group.group_name)

    # -- workspace -------------------------------------------------------------------------------
    def _ensure(self, need_bytes: int) -> None:
        """Grow the workspace to ``need_bytes`` (same value on every rank: collective rendezvous)."""
        if self._buf is not None and self._buf.numel() >= need_bytes:
            return
        size = max(need_bytes, 2 * (self._buf.numel() if self._buf is not None else 0))
        size = (size + (1 << 20) - 1) >> 20 << 20
        torch.cuda.synchronize(self.device)  # no queued copy may still touch the old workspace
        self._peers.clear()
        self._buf = self._symm.empty(size, dtype=torch.uint8, device=self.device)
        self._hdl = self._symm.rendezvous(self._buf, self.group)
        self._peers = {r: self._hdl.get_buffer(r, [size], torch.uint8, 0) for r in range(self.world)
                       if r != self.rank}

    def send_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A send buffer inside the local workspace (packing into it skips the staging copy), or a
        plain tensor while the workspace is still too small (it grows inside ``all_to_all``, where
        every rank agrees on the size). Valid until the next exchange on this transport; the current
        stream is ordered after the previous exchange, so packing cannot overwrite data peers read."""
        nbytes = numel * like.element_size()
        if self._buf is None or self._buf.numel() < nbytes:
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        if self._last is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last)
        return self._buf[:nbytes].view(like.dtype)

    # -- exchange --------------------------------------------------------------------------------
    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, send_splits: Optional[Sequence[int]] = None,
                   recv_splits: Optional[Sequence[int]] = None, async_op: bool = False, table=None):
        world, es = self.world, send.element_size()
        table = exchange_table(type(self).__name__, self.rank, world, send, recv, send_splits, recv_splits, table)
        need = max(sum(row) for row in table) * es
        staged = self._buf is not None and send.data_ptr() == self._buf.data_ptr()
        if staged and self._buf.numel() < need:  # a peer needs a larger workspace: keep our packed data
            send, staged = send.clone(), False
        self._ensure(need)
        cur = torch.cuda.current_stream(self.device)
        if self._last is not None:
            cur.wait_event(self._last)
        send_b, recv_b = send.view(torch.uint8), recv.view(torch.uint8)
        table_b = [[n * es for n in row] for row in table]
        if not staged:
            self._buf[: send_b.numel()].copy_(send_b)
        self._hdl.barrier(channel=0, timeout_ms=self.timeout_ms)
        own = self._buf if staged else send_b
        if self.parallel_pulls:
            start = torch.cuda.Event()
            start.record(cur)
            used = []

            def copy(r, dst, src):
                s = self._streams[r]
                s.wait_event(start)
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
                used.append(s)
            pull_all_to_all(self.rank, world, table_b, recv_b, own, self._peers.__getitem__, copy)
            for s in used:
                cur.wait_stream(s)
                recv_b.record_stream(s)
        else:
            pull_all_to_all(self.rank, world, table_b, recv_b, own, self._peers.__getitem__,
                            lambda r, dst, src: dst.copy_(src, non_blocking=True))
        self._hdl.barrier(channel=0, timeout_ms=self.timeout_ms)
        if not staged:
            send.record_stream(cur)
        self._last = torch.cuda.Event()
        self._last.record(cur)
        return Done() if async_op else None


class CopyEngineTransport:
    """Kernel-free copy-engine all-to-all: symmetric-memory pulls ordered by stream-memory flags
    (CUDA + NCCL groups; see module doc and ``signal_schedule``). ``slots`` send slots are used in
    turn (workspace = slots x the largest exchange). Every op is one driver call (``stream_ops``):
    copies, flags and events, no tensor views or stream guards, so the host cost stays a few tens of
    microseconds per exchange. Contract as for every stream-ordered transport: afterwards the current
    stream is ordered after all writes into ``recv``."""

    name = "copy_engine"
    stream_ordered = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, slots: int = 2) -> None:
        check_copy_engine(group, device)
        import torch.distributed._symmetric_memory as symm  # noqa: PLC0415  (optional in torch builds)
        self._symm, self._ops = symm, stream_ops
        self.group, self.device, self.slots = group, device, slots
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(group.group_name)
        self._epoch = 0          # exchanges issued (the same count on every rank)
        self._acquired = 0       # the last epoch whose slot has been acquired
        self._slot_bytes = 0
        self._buf: Optional[torch.Tensor] = None
        self._base: dict[int, int] = {}  # rank -> address of its workspace (mapped here)
        self._programs = ProgramCache()
        self._streams = [torch.cuda.Stream(device=device) for _ in range(self.world)]  # one per source rank
        self._start = stream_ops.Event()
        self._joined = [stream_ops.Event() for _ in range(self.world)]
        # the flag block: fixed for the transport's life (epochs never restart), zeroed before any peer
        # can learn its address (the rendezvous below is collective)
        nflags = 2 * slots * self.world
        self._flags = symm.empty(4 * nflags, dtype=torch.uint8, device=device)
        self._flags.zero_()
        torch.cuda.synchronize(device)
        self._flag_hdl = symm.rendezvous(self._flags, group)
        self._flag_base = {r: (self._flags.data_ptr() if r == self.rank else
                               self._flag_hdl.get_buffer(r, [4 * nflags], torch.uint8, 0).data_ptr())
                           for r in range(self.world)}

    def _flag(self, owner: int, kind: int, slot: int, peer: int) -> int:
        return self._flag_base[owner] + flag_offset(kind, slot, peer, self.slots, self.world)

    def _ensure(self, need_bytes: int) -> None:
        """Grow every slot to ``need_bytes`` (the same value on every rank: collective rendezvous)."""
        if self._buf is not None and self._slot_bytes >= need_bytes:
            return
        sb = max(need_bytes, 2 * self._slot_bytes)
        sb = (sb + (1 << 20) - 1) >> 20 << 20
        torch.cuda.synchronize(self.device)  # our queued pulls from peers' old slots are done
        buf = self._symm.empty(self.slots * sb, dtype=torch.uint8, device=self.device)
        hdl = self._symm.rendezvous(buf, self.group)  # returns once every peer has synchronized too
        self._base = {r: (buf.data_ptr() if r == self.rank else
                          hdl.get_buffer(r, [self.slots * sb], torch.uint8, 0).data_ptr()) for r in range(self.world)}
        self._buf, self._hdl, self._slot_bytes = buf, hdl, sb
        self._programs.clear()  # compiled exchanges hold workspace addresses

    def _compile(self, table_b, staged: bool, slot: int, cur: "torch.cuda.Stream") -> tuple:
        """``compile_exchange`` on the symmetric workspaces and flags (device addresses)."""
        memory = ExchangeMemory(self.rank, self.world, self.slots, self._slot_bytes, self._base, self._flag_base)
        return compile_exchange(memory, slot, table_b, staged,
                                ExchangeStreams(self._streams, cur, self._start, self._joined))

    def _acquire(self, stream: "torch.cuda.Stream", epoch: int) -> None:
        if self._acquired < epoch:
            for op in sig.acquire_ops(self.rank, self.world, epoch, self.slots):
                self._ops.wait_geq(stream, self._flag(self.rank, op[2], op[3], op[4]), op[5])
            self._acquired = epoch

    def send_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The next exchange's slot (packing into it skips the staging copy), acquired on the current
        stream; a plain tensor while the slots are too small (they grow inside ``all_to_all``)."""
        nbytes = numel * like.element_size()
        if self._buf is None or self._slot_bytes < nbytes:
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        epoch = self._epoch + 1
        self._acquire(torch.cuda.current_stream(self.device), epoch)
        slot = (epoch - 1) % self.slots
        return self._buf.narrow(0, slot * self._slot_bytes, nbytes).view(like.dtype)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, send_splits: Optional[Sequence[int]] = None,
                   recv_splits: Optional[Sequence[int]] = None, async_op: bool = False, table=None):
        world, es = self.world, send.element_size()
        table = exchange_table(type(self).__name__, self.rank, world, send, recv, send_splits, recv_splits, table)
        epoch = self._epoch + 1
        slot = (epoch - 1) % self.slots
        need = max(sum(row) for row in table) * es
        staged = self._buf is not None and send.data_ptr() == self._base[self.rank] + slot * self._slot_bytes
        if staged and self._slot_bytes < need:  # a peer needs larger slots: keep our packed data
            send, staged = send.clone(), False
        self._ensure(need)
        cur = torch.cuda.current_stream(self.device)
        self._acquire(cur, epoch)
        key = (tuple(map(tuple, table)), es, staged, slot, cur.cuda_stream)
        prog = self._programs.get(key, lambda: self._compile([[n * es for n in row] for row in table], staged,
                                                             slot, cur))
        if not staged:  # the staging copy reads send on cur: the caller may free it on its allocating stream
            send.record_stream(cur)
        self._ops.run_program(prog, epoch, recv.data_ptr(), send.data_ptr())
        self._epoch = epoch
        return Done() if async_op else None


def p2p_disabled_reason() -> Optional[str]:
    """The slow-link regime: NCCL_P2P_DISABLE=1 sends NCCL's exchanges through host memory, and a
    copy-engine transport (NVLink pulls) would silently bypass it."""
    if os.environ.get("NCCL_P2P_DISABLE", "0").strip().lower() in ("1", "true", "yes"):
        return ("NCCL_P2P_DISABLE=1 is set (the host-memory link regime, e.g. a benchmark's --links host): "
                "copy-engine pulls over NVLink would bypass it")
    return None


def symm_mem_unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
    """Why the copy-engine transport cannot run here, or None when it can."""
    if p2p_disabled_reason() is not None:
        return p2p_disabled_reason()
    if device.type != "cuda":
        return f"it needs CUDA tensors (got device {device.type})"
    if "nccl" not in str(dist.get_backend(group)):
        return f"it needs an NCCL process group (got {dist.get_backend(group)})"
    try:
        import torch.distributed._symmetric_memory as symm  # noqa: PLC0415,F401
    except ImportError as e:  # pragma: no cover - torch builds without symmetric memory
        return f"this torch build has no symmetric memory ({e})"
    return None


def copy_engine_unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
    """Why the kernel-free copy-engine transport cannot run here, or None when it can."""
    reason = symm_mem_unavailable_reason(group, device)
    if reason is None:
        reason = stream_ops.unavailable_reason()
        if reason is not None:
            reason = f"CUDA stream memory operations are unavailable: {reason}"
    return reason


def check_copy_engine(group: dist.ProcessGroup, device: torch.device, name: str = "transport") -> None:
    reason = copy_engine_unavailable_reason(group, device)
    if reason is not None:
        raise SPConfigError(f"{name}='copy_engine' (kernel-free copy-engine exchange) cannot run here: {reason}; "
                            f"use 'nccl'")


def check_symm_mem(group: dist.ProcessGroup, device: torch.device, name: str = "transport") -> None:
    reason = symm_mem_unavailable_reason(group, device)
    if reason is not None:
        raise SPConfigError(f"{name}='symm_mem' (copy-engine exchange) cannot run here: {reason}; use 'nccl'")


class TransportPool:
    """One transport object per (name, group, device), created on first use and reused while the group lives.

    "nccl" is not cached (``NcclTransport`` is a stateless wrapper of the group). The stateful ones are, and
    entries of groups that ``destroy_process_group`` removed are dropped at the next ``get``: a cached
    transport keeps its group (and gloo's worker threads) alive, and a group alive at interpreter exit
    aborted the process ("terminate called without an active exception": a worker thread releasing a
    finished exchange needs the GIL while Python is finalizing)."""

    def __init__(self) -> None:
        self._cache: dict = {}

    def clear(self) -> None:
        """Drop every cached transport (and with it the pool's references to process groups)."""
        self._cache.clear()

    def get(self, name: "str | object", group: dist.ProcessGroup, device: torch.device, setting: str = "transport"):
        if not isinstance(name, str):
            return name  # already a transport object
        if name not in TRANSPORT_NAMES:
            raise SPConfigError(f"{setting}={name!r} is invalid: choose one of {', '.join(TRANSPORT_NAMES)}")
        _drop_destroyed(self._cache)
        if name == "nccl":
            emulated = emulated_link(group, device)
            return emulated if emulated is not None else NcclTransport(group)
        if name == "host_staged":
            check_host_staged(group, device, setting)
            key = (name, id(group), device.type, device.index)
        else:
            (check_symm_mem if name == "symm_mem" else check_copy_engine)(group, device, setting)
            key = (name, id(group), device.index)
        if key not in self._cache:
            if name == "host_staged":
                cls = HostStagedTransport
            else:
                cls = {"symm_mem": SymmMemTransport, "copy_engine": CopyEngineTransport}[name]
            self._cache[key] = cls(group, device)
        return self._cache[key]


def _registered(group) -> bool:
    """Whether ``group`` is still a live process group (not yet destroyed)."""
    if group is None or not dist.is_initialized():
        return False
    pgs = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return pgs is None or group in pgs


def _drop_destroyed(cache: dict) -> None:
    """Remove the entries of ``cache`` whose transport's group was destroyed (also frees the id for reuse)."""
    for key in [k for k, tr in cache.items() if not _registered(getattr(tr, "group", None))]:
        del cache[key]


def emulated_link(group: dist.ProcessGroup, device: torch.device):
    """With emulated machines (SPX_EMULATED_MACHINE_SIZE, topology/emulate.py) a group that spans them
    exchanges over two levels (comm/host_staged.TwoLevelTransport: NCCL inside a machine, host-staged
    across), one per group, cached; None for every other group (and without emulation)."""
    m = emulated_machine_size()
    if m is None:
        return None
    node_of = machines_of(group, m)
    if len(set(node_of)) == 1:
        return None
    key = ("two_level", id(group), device.type, device.index)
    _drop_destroyed(_EMULATED)
    if key not in _EMULATED:
        check_host_staged(group, device, "SPX_EMULATED_MACHINE_SIZE")
        _EMULATED[key] = TwoLevelTransport(group, device, node_of)
    return _EMULATED[key]


_EMULATED: dict = {}
_DEFAULT_POOL = TransportPool()


def default_transports() -> TransportPool:
    """The process-wide pool used when the caller passes a transport by name."""
    return _DEFAULT_POOL
