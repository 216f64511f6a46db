"""The Ulysses family: sequence-sharded <-> head-sharded all-to-all around local attention.

Modules (each one idea; below them ``sp.checks``, ``sp.heads``, ``sp.placement``):
  layout    where each head chunk's tokens sit in the exchange buffers (pack / unpack, sequence orders)
  plan      ``AttendPlan`` (the typed interface every Ulysses-family plan provides), ``UlyssesPlan``, ``local_order``
  attend    one HCMS chunk's local attention, forward / backward, and what it keeps in between
  engine    the exchange engine: every chunk's input exchange in flight, attention, output exchange per chunk
  policy    ``head_chunks="auto"``: ``HCMSPolicy`` (given the attention function to time)
  function  the autograd Function and the public ``ulysses_attention`` (Ulysses, HCMS)
  packed    Ulysses on q|k|v written in the exchange's send layout (``pack_qkv``, ``packed_ulysses_attention``)
The attention layers (``sp.layers.async_qkv``, ``sp.layers.allgather``) build on ``engine`` and ``attend``.
"""
from .attend import attend_backward, explicit_kernels, local_attention
from .engine import alloc, attend_and_send, exchange_all_chunks, send_head_major, transport_of
from .function import ulysses_attention
from .layout import SeqOrder
from .packed import PackedUlysses, pack_qkv, packable, packed_head_layout, packed_ulysses_attention
from .plan import AttendPlan, UlyssesPlan, local_order
from .policy import ChunkPolicy, HCMSPolicy, default_policy

__all__ = ["ulysses_attention", "UlyssesPlan", "AttendPlan", "local_order", "SeqOrder", "attend_and_send",
           "attend_backward", "exchange_all_chunks", "send_head_major", "alloc", "transport_of", "explicit_kernels",
           "local_attention", "PackedUlysses", "pack_qkv", "packable", "packed_head_layout",
           "packed_ulysses_attention", "ChunkPolicy", "HCMSPolicy", "default_policy"]
