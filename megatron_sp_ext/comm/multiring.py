"""Multi-ring exchange: every ring advances one hop at once.

A slot buffer holds one block per ring (slot i = ring i's block, rows ``[off[i], off[i]+len[i])``
of dim 0). One step sends slot ``out_ring[r][p]`` to each peer p and receives ring
``in_ring[r][p]``'s block from p into the same slot of the next buffer. With one ring this is a
send/recv pair (ring attention); with several it is ONE all_to_all (TASP, Algorithm 3): on NCCL
the list form (zero-copy views, uneven sizes); on gloo, whose list form needs equal sizes, one
all_to_all_single with split sizes over a packed buffer.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..topology.hamiltonian import RoutingTables
from .host_staged import linked_hop
from .transport import emulated_link


class MultiRingExchange:
    """Moves slot buffers one hop along every ring of ``routing`` (ranks are group ranks)."""

    def __init__(self, routing: RoutingTables, group: dist.ProcessGroup, rank: int,
                 offsets: Sequence[int], lengths: Sequence[int]) -> None:
        self.routing, self.group, self.rank = routing, group, rank
        self.offsets, self.lengths = tuple(offsets), tuple(lengths)
        self.rings = len(routing.cycles)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(routing.n)] if group is not None else None

    def _slot(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf.narrow(0, self.offsets[i], self.lengths[i])

    def start(self, cur: torch.Tensor, nxt: torch.Tensor):
        """Begin one hop: cur (slots) -> nxt (slots). Returns a handle for ``wait``."""
        r, rt = self.rank, self.routing
        link = emulated_link(self.group, cur.device) if self.group is not None else None
        if link is not None:  # emulated machines: this group's hops cross them (comm/host_staged.py)
            return linked_hop(link, rt, r, self.offsets, self.lengths, cur, nxt)
        if self.rings == 1:
            ops = [dist.P2POp(dist.isend, cur, self.global_ranks[rt.nxt[0][r]], self.group),
                   dist.P2POp(dist.irecv, nxt, self.global_ranks[rt.prv[0][r]], self.group)]
            return dist.batch_isend_irecv(ops)
        empty = cur.new_empty((0,) + tuple(cur.shape[1:]))
        send = [self._slot(cur, rt.out_ring[r][p]) if rt.out_ring[r][p] >= 0 else empty for p in range(rt.n)]
        recv = [self._slot(nxt, rt.in_ring[r][p]) if rt.in_ring[r][p] >= 0 else empty for p in range(rt.n)]
        if dist.get_backend(self.group) != "gloo":
            return [dist.all_to_all(recv, send, group=self.group, async_op=True)]
        send_flat = torch.cat([t.reshape(-1) for t in send])
        recv_flat = torch.empty(sum(t.numel() for t in recv), dtype=cur.dtype, device=cur.device)
        work = dist.all_to_all_single(recv_flat, send_flat, [t.numel() for t in recv], [t.numel() for t in send],
                                      group=self.group, async_op=True)
        return [work, (recv_flat, recv)]

    @staticmethod
    def wait(handle) -> None:
        wait_handles(handle)


def wait_handles(handles) -> None:
    """Finish started exchanges: wait each work; a ``(flat, views)`` entry (a flat receive buffer of gloo or of
    an emulated link) is unpacked into ``views`` in order, after the works listed before it."""
    for w in handles:
        if isinstance(w, tuple):
            flat, views = w
            off = 0
            for v in views:
                v.copy_(flat[off:off + v.numel()].view_as(v))
                off += v.numel()
        else:
            w.wait()
