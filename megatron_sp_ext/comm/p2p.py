"""Point-to-point batches of the ring family (ring and TASP steps, their dK|dV returns, torus's stages): one path.

``start(ops, group, table=)`` begins one batch ``[("send" | "recv", tensor, group rank of the peer), ...]`` and
returns handles for ``wait_handles``:
  * a group spanning emulated machines (comm/transport.emulated_link): ONE all-to-all over the group's link (every
    rank of the group calls it, even with nothing to move); per peer, the tensors in list order. ``table``
    (elements, [sender][receiver], the same on every rank) is given by callers that know every rank's ops (the
    ring's tables), else gathered with one small all-gather (torus); the received flat buffer is unpacked by
    ``wait_handles``. A table of zeros moves nothing and calls nothing (the same decision on every rank).
  * gloo with CUDA tensors (gloo's send/recv of CUDA tensors fails): the same batch through host copies, the
    received ones copied back by ``wait_handles``.
  * otherwise (NCCL, gloo with CPU tensors): one ``batch_isend_irecv`` (NCCL runs it on its own stream).
Ops to the same peer keep their list order on both ends (the receiver lists them in the sender's order).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .transport import emulated_link

Op = tuple  # ("send" | "recv", tensor, group rank of the peer)


class _Keep:
    """Holds tensors (the host copies being sent) until the batch is waited."""

    def __init__(self, tensors: list) -> None:
        self.tensors = tensors

    def wait(self) -> None:
        self.tensors = []


def start(ops: Sequence[Op], group: Optional[dist.ProcessGroup], *, like: Optional[torch.Tensor] = None,
          table: Optional[list] = None) -> list:
    """Begin ``ops`` (see module docstring) on ``group``; returns handles for ``wait_handles`` ([] for nothing).
    ``like``: a tensor of the batch's device and dtype (default: the first op's), for a rank with no ops of its own
    in a linked all-to-all."""
    if group is None or dist.get_world_size(group) == 1:
        return []
    like = like if like is not None else (ops[0][1] if ops else None)
    if like is None:
        return []
    link = emulated_link(group, like.device)
    if link is not None:
        return _start_linked(link, ops, table, like)
    if not ops:
        return []
    if needs_host_staging(group, like):
        return _start_staged(ops, group)
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, dist.get_global_rank(group, peer), group)
           for kind, t, peer in ops]
    return dist.batch_isend_irecv(p2p)


def needs_host_staging(group: dist.ProcessGroup, like: torch.Tensor) -> bool:
    """Whether ``group``'s point-to-point ops on tensors like ``like`` go through host copies (gloo, CUDA)."""
    return like.is_cuda and dist.get_backend(group) == "gloo"


def _start_staged(ops: Sequence[Op], group: dist.ProcessGroup) -> list:
    """gloo with CUDA tensors: send host copies, receive into host buffers copied back by ``wait_handles``."""
    p2p, keep, copies = [], [], []
    for kind, t, peer in ops:
        if kind == "send":
            host = t.detach().reshape(-1).cpu()
            keep.append(host)
        else:
            host = torch.empty(t.numel(), dtype=t.dtype)
            copies.append((host, [t]))
        p2p.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, host,
                              dist.get_global_rank(group, peer), group))
    return list(dist.batch_isend_irecv(p2p)) + [_Keep(keep)] + copies


def _start_linked(link, ops: Sequence[Op], table: Optional[list], like: torch.Tensor) -> list:
    """The batch as one all-to-all over ``link``: per peer, its tensors in list order."""
    world, me = link.world, link.rank
    if table is None:  # every rank's send sizes: one small all-gather (the emulation measures links, not this)
        row = [0] * world
        for kind, t, peer in ops:
            if kind == "send":
                row[peer] += t.numel()
        mine = torch.tensor(row, dtype=torch.int64, device=like.device if like.is_cuda else "cpu")
        every = torch.empty(world * world, dtype=torch.int64, device=mine.device)
        dist.all_gather_into_tensor(every, mine, group=link.group)
        table = every.view(world, world).tolist()
        recv_sizes = [sum(t.numel() for k, t, p in ops if k == "recv" and p == r) for r in range(world)]
        if recv_sizes != [table[r][me] for r in range(world)]:
            raise RuntimeError(f"point-to-point batch: rank {me} expects other sizes than its peers send ({table})")
    if not any(any(row) for row in table):
        return []
    by_peer = lambda kd: sorted((o for o in ops if o[0] == kd), key=lambda o: o[2])  # noqa: E731 (stable)
    sends = [t.reshape(-1) for _, t, _ in by_peer("send")]
    send = torch.cat(sends) if sends else like.new_empty(0)
    recv = torch.empty(sum(table[r][me] for r in range(world)), dtype=like.dtype, device=like.device)
    work = link.all_to_all(send, recv, table[me], [table[r][me] for r in range(world)], async_op=True, table=table)
    views = [t for _, t, _ in by_peer("recv")]
    return ([work] if work is not None else []) + [(recv, views)]


def wait_handles(handles) -> None:
    """Finish started batches: wait each work; a ``(flat, views)`` entry (a flat receive buffer of an emulated link
    or of gloo's host staging) is unpacked into ``views`` in order, after the works listed before it."""
    for w in handles:
        if isinstance(w, tuple):
            flat, views = w
            off = 0
            for v in views:
                v.copy_(flat[off:off + v.numel()].view_as(v))
                off += v.numel()
        else:
            w.wait()
