"""The plan of one Ulysses-family call: what the exchange engine and the chunk attention read.

``AttendPlan`` is the interface (a Protocol): every Ulysses-family plan provides its fields (``UlyssesPlan``
here, ``PackedPlan`` in packed.py, ``AsyncPlan`` / ``GatherPlan`` of the attention layers), so the engine
reads typed fields instead of probing with getattr. ``local_order`` turns a placement into the permutation
of the gathered sequence (and the padding cut) a plan carries; ``varlen_order`` does so for packed samples
(``cu_seqlens``), whose attention runs per sample over each sample's global range (attend.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from ...attention.backends import LocalAttention
from ...attention.tiles import TileSlice
from ..checks import valid_kv_len
from ..heads import HeadLayout
from ..placement import pieces, varlen_pieces
from . import layout as lay


class AttendPlan(Protocol):
    """Fields the exchange engine (engine.py) and the chunk attention (attend.py) read."""

    group: dist.ProcessGroup
    rank: int                    # this rank in ``group``
    heads: HeadLayout            # heads per rank and per HCMS chunk
    seq_layout: str              # "bshd" or "sbhd" of the caller's tensors
    causal: bool
    scale: float
    backend: LocalAttention
    transport: Optional[object]  # comm.transport object (None: the group's own all_to_all)
    need_grad: bool              # keep what the backward needs
    kv_valid_len: Optional[int]  # keys at global positions >= this are padding (None: none)
    order: Optional[lay.SeqOrder]  # gathered (rank) order -> global order; None: already global
    dropout_p: float             # attention dropout inside each chunk's kernel


@dataclass
class UlyssesPlan:
    """Everything one call needs that depends only on shapes and settings."""

    group: dist.ProcessGroup
    rank: int
    heads: HeadLayout
    seq_layout: str
    causal: bool
    scale: float
    backend: LocalAttention
    comm_stream: Optional["torch.cuda.Stream"]
    need_grad: bool = True
    qkv_contiguous: bool = True  # hand the kernel contiguous q/k/v and exchange grads one tensor at a time
    transport: Optional[object] = None  # comm.transport object (None: the group's own all_to_all)
    order: Optional[lay.SeqOrder] = None  # gathered (rank) order -> global order; None: already global
    kv_valid_len: Optional[int] = None  # keys at global positions >= this are padding (0 < it < S)
    dropout_p: float = 0.0  # attention dropout inside each chunk's kernel (forces the inner-graph path)
    cu_seqlens: Optional[tuple[int, ...]] = None  # packed samples: cumulative lengths (global order), or None
    varlen_kernel: str = "per_sample"  # packed samples' local method (attention/varlen.py SETTINGS)
    tiles: Optional[TileSlice] = None  # the block mask's whole-sequence slice (the problem's, ``tiles.problem_slice``)
    tile_setting: str = "math"  # the block-sparse kernel the backend names for this device/dtype (each call picks per slice)


def local_order(placement: str, world: int, s_loc: int, causal: bool,
                kv_valid_len: Optional[int]) -> tuple[Optional[lay.SeqOrder], Optional[int]]:
    """(order, valid) for one call: the piece permutation that puts the gathered sequence in global order
    (None when it already is, or when nothing depends on positions: non-causal without padding), and the
    padding cut (None: no key is padding). Raises SPConfigError for a bad placement or kv_valid_len."""
    seqlen = s_loc * world
    kv_valid_len = valid_kv_len(kv_valid_len, seqlen)
    if not causal and kv_valid_len is None:
        return None, None
    return _seq_order(placement, world, seqlen), kv_valid_len


@lru_cache(maxsize=256)
def _seq_order(placement: str, world: int, seqlen: int) -> Optional[lay.SeqOrder]:
    return lay.seq_order([pieces(placement, p, world, seqlen) for p in range(world)])


@lru_cache(maxsize=256)
def varlen_order(placement: str, world: int, cu: tuple[int, ...]) -> Optional[lay.SeqOrder]:
    """The permutation that puts the gathered packed sequence (rank order; each rank holds its pieces of every
    sample, ``varlen_pieces``) in global order, so every sample is one contiguous range [cu[i], cu[i+1]); None
    when it already is. Pieces of different samples differ in length: the permutation moves runs of their
    greatest common divisor. Raises SPConfigError for a placement or sample length cu_seqlens cannot use."""
    flat = [r for p in range(world) for r in varlen_pieces(placement, p, world, cu)]
    unit = 0
    for _, n in flat:
        unit = math.gcd(unit, n)
    to_global = [a // unit + j for a, n in flat for j in range(n // unit)]
    if to_global == list(range(len(to_global))):
        return None
    return lay.SeqOrder(unit, to_global)
