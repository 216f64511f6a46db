"""SPDistributedAttention: a drop-in subclass of DeepSpeed's Ulysses ``DistributedAttention``.

Same constructor (``local_attention, sequence_process_group, scatter_idx, gather_idx, sp_stream,
num_kv_heads``) and forward (``query, key, value, batch_dim_idx, rotary_pos_emb=None, *args,
**kwargs``): inputs are this rank's sequence shard, [b, s/p, h, d] (batch_dim_idx=0) or
[s/p, b, h, d] (batch_dim_idx=1); the output has the input's layout. Extra keyword settings
select the algorithm (``mode``) as the JSON block does:
  ulysses / hcms: the user's ``local_attention`` runs on the gathered sequence exactly as in
      DeepSpeed (RoPE from ``rotary_pos_emb`` applied after the exchange, with DeepSpeed's own
      function); hcms pipelines it per head chunk.
  ring / tasp / usp / tas / torus: these need partial results with log-sum-exp, which a user
      callable does not return, so they use megatron_sp_ext's LSE backends (``backend``) and
      ``causal``; ``local_attention`` is not called. RoPE (if given for the full sequence) is
      applied to this rank's own tokens before the ring starts.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from deepspeed.sequence.layer import DistributedAttention, apply_rotary_pos_emb

from ..attention.backends import LocalAttention, get_backend
from ..comm.streams import StreamPool
from ..comm.transport import TransportPool
from ..config import SPConfig
from ..errors import SPConfigError
from ..sp.hybrid import hybrid_attention
from ..sp.packed import PackedUlysses
from ..sp.policy import HCMSPolicy
from ..sp.ring import ring_attention
from ..sp.torus import torus_attention
from ..sp.ulysses import ulysses_attention
from ..topology.mesh import build_sp_mesh


class _UserLocalAttention(LocalAttention):
    """Calls DeepSpeed-style ``local_attention(q, k, v, *args, **kwargs)`` in the caller's layout."""

    def __init__(self, fn, batch_dim_idx: int, rope, args, kwargs) -> None:
        self.fn, self.bdim, self.rope, self.args, self.kwargs = fn, batch_dim_idx, rope, args, kwargs
        self.name = "user"

    def _to(self, x_bhsd):  # bhsd -> [b, s, h, d] or [s, b, h, d]
        return x_bhsd.transpose(1, 2) if self.bdim == 0 else x_bhsd.permute(2, 0, 1, 3)

    def __call__(self, q, k, v, *, causal, softmax_scale):
        q_, k_, v_ = self._to(q), self._to(k), self._to(v)
        if self.rope is not None:
            cos, sin = self.rope[0].permute(1, 0, 2, 3), self.rope[1].permute(1, 0, 2, 3)
            q_, k_ = apply_rotary_pos_emb(q_, cos, sin), apply_rotary_pos_emb(k_, cos, sin)
        out = self.fn(q_, k_, v_, *self.args, **self.kwargs)
        return out.transpose(1, 2) if self.bdim == 0 else out.permute(1, 2, 0, 3)


class SPDistributedAttention(DistributedAttention):
    """DeepSpeed DistributedAttention with megatron_sp_ext algorithms (see module docstring)."""

    def __init__(self, local_attention, sequence_process_group, scatter_idx: int = 2, gather_idx: int = 0,
                 sp_stream=None, num_kv_heads: Optional[int] = None, *, mode: str = "ulysses",
                 head_chunks=1, ring_variant: str = "ring", placement: str = "auto",
                 ulysses_size: Optional[int] = None, nodes: Optional[int] = None, backend: str = "sdpa",
                 causal: bool = False, softmax_scale: Optional[float] = None,
                 sp_config: Optional[SPConfig] = None, transport: str = "nccl") -> None:
        super().__init__(local_attention, sequence_process_group, scatter_idx, gather_idx, None, num_kv_heads)
        self.cfg = sp_config or SPConfig(mode=mode, head_chunks=head_chunks, ring_variant=ring_variant,
                                         placement=placement, ulysses_size=ulysses_size, nodes=nodes,
                                         backend=backend, transport=transport, source="deepspeed")
        if self.cfg.mode == "auto":
            raise SPConfigError("sequence_parallel_ext.mode='auto' is resolved by megatron_sp_ext.deepspeed.initialize; "
                                "pass a concrete mode to SPDistributedAttention")
        self.causal, self.softmax_scale = causal, softmax_scale
        self.sp_stream_pool = StreamPool()  # our comm streams (DeepSpeed's sp_stream path is not used)
        self.policy = HCMSPolicy()
        self.transports = TransportPool()
        self._meshes: dict = {}
        self.calls = 0  # forward calls (lets a script or test see that this attention ran)

    def packed_entry(self) -> Optional[PackedUlysses]:
        """For a model that writes q|k|v itself (the DiT's --ulysses-packed-qkv): a packed Ulysses / HCMS entry
        with this block's group, chunk count (``auto``: this block's policy) and backend, or None where it would
        not be the plain path's math or resources: the ring and mesh modes, a ``softmax_scale`` or ``causal`` set
        on this module (the plain path leaves the mask to the user's callable), a transport other than NCCL (its
        workspace belongs to this module's pool). It runs ``sequence_parallel_ext.backend``, not the user's local
        attention: only for callers whose local attention is that backend's math (softmax attention, default scale)."""
        if (self.cfg.mode not in ("ulysses", "hcms") or self.softmax_scale is not None or self.causal
                or self.cfg.transport != "nccl"):
            return None
        return PackedUlysses(self.spg, 1 if self.cfg.mode == "ulysses" else self.cfg.head_chunks,
                             backend=self.cfg.backend, policy=self.policy)

    def _mesh(self, num_heads: int):
        if num_heads not in self._meshes:
            placement = self.cfg.mode if self.cfg.mode in ("usp", "tas") else self.cfg.placement  # torus: any mesh
            self._meshes[num_heads] = build_sp_mesh(
                self.spg, num_heads=num_heads, placement=placement,
                ulysses_size=self.cfg.ulysses_size, nodes=self.cfg.nodes,
                names={"placement": "sequence_parallel_ext.placement", "ulysses_size": "sequence_parallel_ext.ulysses_size",
                       "nodes": "sequence_parallel_ext.nodes"})
        return self._meshes[num_heads]

    def forward(self, query, key, value, batch_dim_idx: int, rotary_pos_emb=None, *args,
                kv_valid_len: Optional[int] = None, **kwargs):
        """DeepSpeed's forward; ``kv_valid_len`` (ours): keys at global positions >= it are padding.
        With padding, ulysses/hcms use our LSE backend (a user callable cannot take the mask)."""
        if batch_dim_idx not in (0, 1):
            raise SPConfigError(f"batch_dim_idx={batch_dim_idx} is invalid: use 0 ([b, s, h, d]) or 1 ([s, b, h, d])")
        layout = "bshd" if batch_dim_idx == 0 else "sbhd"
        mode = self.cfg.mode
        self.calls += 1
        scale = self.softmax_scale
        if mode in ("ulysses", "hcms"):
            if kv_valid_len is None:
                be = _UserLocalAttention(self.local_attn, batch_dim_idx, rotary_pos_emb, args, kwargs)
            else:
                if rotary_pos_emb is not None:
                    query, key = self._local_rope(query, key, rotary_pos_emb, batch_dim_idx)
                be = get_backend(self.cfg.backend, "sequence_parallel_ext.backend")
            chunks = 1 if mode == "ulysses" else self.cfg.head_chunks
            return ulysses_attention(query, key, value, self.spg, head_chunks=chunks, layout=layout, backend=be,
                                     softmax_scale=scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]),
                                     comm_stream=self.sp_stream_pool.comm_stream(query.device), policy=self.policy,
                                     causal=self.causal and kv_valid_len is not None, kv_valid_len=kv_valid_len,
                                     transport=self.transports.get(self.cfg.transport, self.spg, query.device,
                                                                   "sequence_parallel_ext.transport"))
        if rotary_pos_emb is not None:
            query, key = self._local_rope(query, key, rotary_pos_emb, batch_dim_idx)
        be = get_backend(self.cfg.backend, "sequence_parallel_ext.backend")
        if mode in ("ring", "tasp"):
            return ring_attention(query, key, value, self.spg, variant=mode, causal=self.causal, softmax_scale=scale,
                                  layout=layout, backend=be, placement="contiguous", kv_valid_len=kv_valid_len)
        mesh = self._mesh(query.shape[2])
        if mode == "torus":
            return torus_attention(query, key, value, mesh, causal=self.causal, softmax_scale=scale, layout=layout,
                                   ring_variant=self.cfg.ring_variant, backend=self.cfg.backend,
                                   placement="contiguous", kv_valid_len=kv_valid_len)
        return hybrid_attention(query, key, value, mesh, head_chunks=self.cfg.head_chunks,
                                ring_variant=self.cfg.ring_variant, causal=self.causal, softmax_scale=scale,
                                layout=layout, backend=self.cfg.backend, placement="contiguous",
                                kv_valid_len=kv_valid_len)

    def _local_rope(self, query, key, rope, batch_dim_idx):
        """Rotate this rank's contiguous tokens by their global positions (full-length cos/sin given)."""
        rank = torch.distributed.get_rank(self.spg)
        sl = query.shape[0] if batch_dim_idx == 1 else query.shape[1]
        cos, sin = (r.permute(1, 0, 2, 3)[rank * sl:(rank + 1) * sl] for r in rope)
        if batch_dim_idx == 0:
            q, k = query.transpose(0, 1), key.transpose(0, 1)
            return apply_rotary_pos_emb(q, cos, sin).transpose(0, 1), apply_rotary_pos_emb(k, cos, sin).transpose(0, 1)
        return apply_rotary_pos_emb(query, cos, sin), apply_rotary_pos_emb(key, cos, sin)
