"""SPDistributedAttention: a drop-in subclass of DeepSpeed's Ulysses ``DistributedAttention``.

Same constructor (``local_attention, sequence_process_group, scatter_idx, gather_idx, sp_stream,
num_kv_heads``) and forward (``query, key, value, batch_dim_idx, rotary_pos_emb=None, *args,
**kwargs``): inputs are this rank's sequence shard, [b, s/p, h, d] (batch_dim_idx=0) or
[s/p, b, h, d] (batch_dim_idx=1); the output has the input's layout. Extra keyword settings
select the algorithm (``mode``) as the JSON section does:
  ulysses / hcms: the user's ``local_attention`` runs on the gathered sequence exactly as in
      DeepSpeed (RoPE from ``rotary_pos_emb`` applied after the exchange, with DeepSpeed's own
      function); hcms pipelines it per head chunk.
  ring / tasp / usp / tas / torus: these need partial results with log-sum-exp, which a user
      callable does not return, so they use megatron_sp_ext's LSE backends (``backend``) and
      ``causal``; ``local_attention`` is not called. RoPE (if given for the full sequence) is
      applied to this rank's own tokens before the ring starts.
  auto: per attention, as in the other entries (megatron_sp_ext.sp.factory): hcms when every rank gets a
      head (with the user's callable, or on CUDA with our kernels Ulysses/HCMS, the ring or TASP beyond 2 ranks
      per shape from its own calibration: sp.calibration), else a usp mesh or the ring.
``dropout_p`` (JSON ``sequence_parallel_ext.dropout_p``): attention dropout of our kernels in training
(ulysses/hcms; the user's callable applies its own); the ring family refuses it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from deepspeed.sequence.layer import DistributedAttention, apply_rotary_pos_emb

from ..attention.backends import LocalAttention
from ..config import SPConfig
from ..errors import SPConfigError
from ..sp.factory import SPAttention, SPResources, make_attention, packed_entry
from ..sp.ulysses import PackedUlysses


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
                 sp_stream=None, num_kv_heads: Optional[int] = None, *, sp_config: Optional[SPConfig] = None,
                 causal: bool = False, softmax_scale: Optional[float] = None, **settings) -> None:
        """DeepSpeed's arguments, then ours: ``sp_config`` (an SPConfig) or its ``settings`` as keywords (mode,
        head_chunks, ring_variant, placement, ulysses_size, nodes, backend, transport, dropout_p; default mode
        "ulysses"), ``causal`` and ``softmax_scale`` of our kernels."""
        super().__init__(local_attention, sequence_process_group, scatter_idx, gather_idx, None, num_kv_heads)
        if sp_config is not None and settings:
            raise SPConfigError(f"SPDistributedAttention: give sp_config or its settings ({', '.join(settings)}), "
                                f"not both")
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(SPConfig)} - {"source"})
        if unknown:
            raise SPConfigError(f"SPDistributedAttention got unknown settings {unknown}: the settings are SPConfig's "
                                f"fields ({', '.join(f.name for f in dataclasses.fields(SPConfig) if f.name != 'source')})")
        self.cfg = sp_config or SPConfig(**{"mode": "ulysses", **settings, "source": "deepspeed"})
        self.causal, self.softmax_scale = causal, softmax_scale
        # comm streams, HCMS/mode policies, transports, meshes (DeepSpeed's sp_stream path is not used)
        self.resources = SPResources(self.cfg)
        self._attention: dict = {}  # (heads, kv heads, layout) -> the factory's SPAttention
        self.calls = 0  # forward calls (lets a script or test see that this attention ran)

    def attention_for(self, num_heads: int, num_kv_heads: int, layout: str) -> SPAttention:
        """The factory's attention for this head count and layout (built once, collectively, at first use)."""
        key = (num_heads, num_kv_heads, layout)
        if key not in self._attention:
            self._attention[key] = make_attention(
                self.cfg, self.spg, num_heads=num_heads, num_kv_heads=num_kv_heads, layout=layout,
                placement="contiguous", backend=self.cfg.backend, resources=self.resources)
        return self._attention[key]

    def packed_entry(self) -> Optional[PackedUlysses]:
        """For a model that writes q|k|v itself (the DiT's --ulysses-packed-qkv): a packed Ulysses / HCMS entry
        with this layer's group, chunk count (``auto``: this layer's policy) and backend, or None where it would
        not be the plain path's math or resources: the ring and mesh modes and ``auto`` (which may pick the
        ring), attention dropout, a ``softmax_scale`` or ``causal`` set on this module (the plain path leaves
        the mask to the user's callable), a transport other than NCCL (its workspace belongs to this module's
        pool). It runs ``sequence_parallel_ext.backend``, not the user's local attention: only for callers whose
        local attention is that backend's math (softmax attention, default scale)."""
        if self.softmax_scale is not None or self.causal or self.cfg.transport != "nccl":
            return None
        return packed_entry(self.cfg, self.spg, self.resources)

    def forward(self, query, key, value, batch_dim_idx: int, rotary_pos_emb=None, *args,
                kv_valid_len: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None, **kwargs):
        """DeepSpeed's forward; ``kv_valid_len`` (ours): keys at global positions >= it are padding.
        With padding, ulysses/hcms use our LSE backend (a user callable cannot take the mask).
        ``cu_seqlens`` (ours): packed variable-length samples (B=1, shards from ``shard_sequence(cu_seqlens=)``),
        every mode on our kernels, each sample within itself; apply RoPE before the call (per-sample positions).
        ``sequence_parallel_ext.dropout_p`` applies to our kernels in training (the user's callable keeps its own)."""
        if batch_dim_idx not in (0, 1):
            raise SPConfigError(f"batch_dim_idx={batch_dim_idx} is invalid: use 0 ([b, s, h, d]) or 1 ([s, b, h, d])")
        layout = "bshd" if batch_dim_idx == 0 else "sbhd"
        self.calls += 1
        attn = self.attention_for(query.shape[2], key.shape[2], layout)
        attn.training = self.training  # auto: a no_grad forward under activation recompute decides like training
        if cu_seqlens is not None:
            if rotary_pos_emb is not None:
                raise SPConfigError("rotary_pos_emb with cu_seqlens: rotate q and k at their per-sample positions "
                                    "before the call (this forward's RoPE assumes one sequence)")
            self._check_call_causal(kwargs)
            return attn(query, key, value, causal=self.causal, softmax_scale=self.softmax_scale,
                        kv_valid_len=kv_valid_len, dropout_p=self.cfg.dropout_p if self.training else 0.0,
                        cu_seqlens=cu_seqlens)
        if attn.takes_local_attention and kv_valid_len is None:  # the user's callable masks and scales itself
            be = _UserLocalAttention(self.local_attn, batch_dim_idx, rotary_pos_emb, args, kwargs)
            scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
            return attn(query, key, value, causal=False, softmax_scale=scale, local_attention=be)
        self._check_call_causal(kwargs)
        if rotary_pos_emb is not None:
            query, key = self._local_rope(query, key, rotary_pos_emb, batch_dim_idx)
        return attn(query, key, value, causal=self.causal, softmax_scale=self.softmax_scale,
                    kv_valid_len=kv_valid_len, dropout_p=self.cfg.dropout_p if self.training else 0.0)

    def _check_call_causal(self, kwargs: dict) -> None:
        """Our kernels run with ``self.causal``: a ``causal=`` / ``is_causal=`` the caller meant for its local
        attention (DeepSpeed passes them through to it) must agree, else SPConfigError naming both."""
        setting = "sequence_parallel_ext.causal" if self.cfg.source == "deepspeed" else "causal="
        for key in ("causal", "is_causal"):
            if isinstance(kwargs.get(key), bool) and kwargs[key] != bool(self.causal):
                raise SPConfigError(f"this call passes {key}={kwargs[key]} for the local attention, but "
                                    f"{self.cfg.name('mode')}={self.cfg.mode!r} runs megatron_sp_ext's kernels with "
                                    f"{setting} {bool(self.causal)}: make them agree")

    def _local_rope(self, query, key, rope, batch_dim_idx):
        """Rotate this rank's contiguous tokens by their global positions (full-length cos/sin given)."""
        rank = torch.distributed.get_rank(self.spg)
        sl = query.shape[0] if batch_dim_idx == 1 else query.shape[1]
        cos, sin = (r.permute(1, 0, 2, 3)[rank * sl:(rank + 1) * sl] for r in rope)
        if batch_dim_idx == 0:
            q, k = query.transpose(0, 1), key.transpose(0, 1)
            return apply_rotary_pos_emb(q, cos, sin).transpose(0, 1), apply_rotary_pos_emb(k, cos, sin).transpose(0, 1)
        return apply_rotary_pos_emb(query, cos, sin), apply_rotary_pos_emb(key, cos, sin)
