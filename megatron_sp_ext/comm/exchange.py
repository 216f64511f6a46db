"""Flat all-to-all exchange: one collective moves every peer's segment of one buffer.

Also the pieces every transport shares: ``exchange_table`` (checks the buffers of a table-driven
exchange, returns its rank r -> p sizes) and ``Done`` (the work handle of a stream-ordered one).
Buffers are 1-D and contiguous (gloo silently corrupts non-contiguous a2a outputs); segment p of
``send`` goes to rank p, segment p of ``recv`` comes from rank p. Equal segments use the plain
all_to_all_single; unequal ones pass split sizes (in elements).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


def all_to_all_flat(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup,
                    send_splits: Optional[Sequence[int]] = None,
                    recv_splits: Optional[Sequence[int]] = None, async_op: bool = False):
    """Exchange ``send`` -> ``recv`` (both 1-D contiguous). Returns the Work if ``async_op``."""
    assert send.dim() == 1 and recv.dim() == 1 and send.is_contiguous() and recv.is_contiguous()
    even = (send_splits is None or len(set(send_splits)) == 1) and (recv_splits is None or len(set(recv_splits)) == 1)
    if even:
        return dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    world = dist.get_world_size(group)
    if send_splits is None:
        send_splits = [send.numel() // world] * world
    if recv_splits is None:
        recv_splits = [recv.numel() // world] * world
    return dist.all_to_all_single(recv, send, output_split_sizes=list(recv_splits),
                                  input_split_sizes=list(send_splits), group=group, async_op=async_op)


def exchange_table(who: str, rank: int, world: int, send: torch.Tensor, recv: torch.Tensor,
                   send_splits: Optional[Sequence[int]], recv_splits: Optional[Sequence[int]], table) -> list:
    """Check a copy-engine exchange's buffers and return its table (rank r -> p sizes, elements); an
    even exchange may omit it, an uneven one must give it (it is never learned by a hidden collective)."""
    assert send.dim() == 1 and recv.dim() == 1 and send.is_contiguous() and recv.is_contiguous()
    assert send.dtype == recv.dtype
    if table is None:
        if not all(s is None or len(set(s)) == 1 for s in (send_splits, recv_splits)):
            raise ValueError(f"{who}.all_to_all: an uneven exchange needs table= (rank r -> p sizes)")
        table = [[send.numel() // world] * world for _ in range(world)]
    assert sum(table[rank]) == send.numel() and sum(r[rank] for r in table) == recv.numel()
    return table


class Done:
    """Work handle of a stream-ordered exchange: already queued on the stream, nothing to wait for."""

    def wait(self) -> bool:
        return True
