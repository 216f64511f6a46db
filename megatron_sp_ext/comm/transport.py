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
CPU-tested with simulated peer buffers).
"""
from __future__ import annotations

import datetime
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import SPConfigError
from .exchange import all_to_all_flat

TRANSPORT_NAMES = ("nccl", "symm_mem")


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


def _offsets(splits: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in splits:
        out.append(acc)
        acc += s
    return out


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
        import torch.distributed._symmetric_memory as symm  # noqa: PLC0415
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
        assert send.dim() == 1 and recv.dim() == 1 and send.is_contiguous() and recv.is_contiguous()
        assert send.dtype == recv.dtype
        world, es = self.world, send.element_size()
        if table is None:
            even = all(s is None or len(set(s)) == 1 for s in (send_splits, recv_splits))
            if not even:
                raise ValueError("SymmMemTransport.all_to_all: an uneven exchange needs table= (rank r -> p sizes)")
            table = [[send.numel() // world] * world for _ in range(world)]
        assert sum(table[self.rank]) == send.numel() and sum(r[self.rank] for r in table) == recv.numel()
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
        return _Done() if async_op else None


class _Done:
    """Work handle of a stream-ordered exchange: already queued on the stream, nothing to wait for."""

    def wait(self) -> bool:
        return True


def symm_mem_unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
    """Why the copy-engine transport cannot run here, or None when it can."""
    if device.type != "cuda":
        return f"it needs CUDA tensors (got device {device.type})"
    if "nccl" not in str(dist.get_backend(group)):
        return f"it needs an NCCL process group (got {dist.get_backend(group)})"
    try:
        import torch.distributed._symmetric_memory as symm  # noqa: PLC0415,F401
    except ImportError as e:  # pragma: no cover - torch builds without symmetric memory
        return f"this torch build has no symmetric memory ({e})"
    return None


def check_symm_mem(group: dist.ProcessGroup, device: torch.device, name: str = "transport") -> None:
    reason = symm_mem_unavailable_reason(group, device)
    if reason is not None:
        raise SPConfigError(f"{name}='symm_mem' (copy-engine exchange) cannot run here: {reason}; use 'nccl'")


class TransportPool:
    """One transport object per (name, group, device), created on first use and reused."""

    def __init__(self) -> None:
        self._cache: dict = {}

    def get(self, name: "str | object", group: dist.ProcessGroup, device: torch.device, setting: str = "transport"):
        if not isinstance(name, str):
            return name  # already a transport object
        if name not in TRANSPORT_NAMES:
            raise SPConfigError(f"{setting}={name!r} is invalid: choose one of {', '.join(TRANSPORT_NAMES)}")
        if name == "nccl":
            key = ("nccl", id(group))
        else:
            check_symm_mem(group, device, setting)
            key = ("symm_mem", id(group), device.index)
        if key not in self._cache:
            self._cache[key] = NcclTransport(group) if name == "nccl" else SymmMemTransport(group, device)
        return self._cache[key]


_DEFAULT_POOL = TransportPool()


def default_transports() -> TransportPool:
    """The process-wide pool used when the caller passes a transport by name."""
    return _DEFAULT_POOL
