"""SPUlyssesAttentionHF: DeepSpeed's ``UlyssesSPAttentionHF`` (ALST) with our exchange.

Same contract as DeepSpeed's class, which it subclasses: ``forward(module, query, key, value,
attention_mask, *args, **kwargs)`` with this rank's sequence shard in Hugging Face's layout
query [b, h, s/p, d], key/value [b, h_kv, s/p, d], ``position_ids`` in kwargs; returns
``(output [b, s/p, h*d], attn_weights)``. Hugging Face's attention function (``self.attn``, e.g.
``sdpa_attention_forward``) still runs on the gathered sequence with the gathered ``position_ids``;
what changes is the exchange around it: ``ulysses`` (one all-to-all each way, as DeepSpeed) or
``hcms`` (head chunks pipelined). ``attn_weights`` is None (the kernels DeepSpeed supports return none).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

from .. import modes
from ..attention.backends import LocalAttention
from ..comm.streams import StreamPool
from ..comm.transport import TransportPool
from ..config import SPConfig
from ..errors import SPConfigError
from ..sp.ulysses import HCMSPolicy
from ..sp.factory import SPResources, make_attention


class _HFLocalAttention(LocalAttention):
    """Hugging Face's ``attn(module, q, k, v, mask, *args, **kwargs)`` as a [B, H, S, D] backend."""

    name = "hf"

    def __init__(self, attn, module, attention_mask, args, kwargs) -> None:
        self.attn, self.module, self.mask, self.args, self.kwargs = attn, module, attention_mask, args, kwargs

    def __call__(self, q, k, v, *, causal, softmax_scale):
        module = self.module
        had = hasattr(module, "num_key_value_groups")
        saved = getattr(module, "num_key_value_groups", None)
        module.num_key_value_groups = q.shape[1] // k.shape[1]  # this chunk's ratio (kv heads may be replicated)
        try:
            out_bshd, _ = self.attn(module, q, k, v, self.mask, *self.args, **self.kwargs)
        finally:
            if had:
                module.num_key_value_groups = saved
            else:
                del module.num_key_value_groups
        return out_bshd.transpose(1, 2)


class SPUlyssesAttentionHF(UlyssesSPAttentionHF):
    """UlyssesSPAttentionHF whose exchange is megatron_sp_ext's Ulysses / HCMS (see module docstring)."""

    def __init__(self, *args, sp_config: SPConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not modes.get(sp_config.mode).local_attention:
            raise SPConfigError(f"sequence_parallel_ext.mode={sp_config.mode!r} is not available with "
                                f"UlyssesSPAttentionHF: use {modes.listing(modes.names(local_attention=True))}")
        self.cfg = sp_config
        self.calls = 0  # forward calls that ran our exchange
        self.streams, self.policy, self.transports = StreamPool(), HCMSPolicy(), TransportPool()

    @classmethod
    def from_deepspeed(cls, theirs: UlyssesSPAttentionHF, sp_config: SPConfig) -> "SPUlyssesAttentionHF":
        """Ours with the same settings as DeepSpeed's instance ``theirs``."""
        if theirs.core_attn_implementation == "flex_attention":
            raise SPConfigError("sequence_parallel_ext does not support core_attn_implementation='flex_attention' "
                                "(its BlockMask is rebuilt by DeepSpeed's exchange): use 'sdpa' or a flash attention")
        ours = cls(theirs.attn, theirs.batch_size, theirs.attn_head_count, theirs.attn_head_size,
                   theirs.global_kv_head_count, theirs.num_hidden_layers, theirs.process_group,
                   seq_length_is_variable=theirs.seq_length_is_variable, local_seq_length=theirs.local_seq_length,
                   global_seq_length=theirs.global_seq_length, disable_in_eval=theirs.disable_in_eval,
                   sp_config=sp_config)
        ours.core_attn_implementation = theirs.core_attn_implementation
        return ours

    def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
        if not module.training and self.disable_in_eval:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if "position_ids" not in kwargs:
            raise SPConfigError("UlyssesSPAttentionHF needs position_ids in every forward() call (global positions "
                                "of this rank's tokens), as DeepSpeed's Ulysses does")
        b, h, s_loc, d = query.shape
        if not self.seq_length_is_variable and s_loc != self.local_seq_length:
            raise SPConfigError(f"query has {s_loc} local tokens but register_with_transformers was given "
                                f"seq_length={self.global_seq_length} ({self.local_seq_length} per rank)")
        pos = kwargs["position_ids"]
        parts = [torch.empty_like(pos) for _ in range(self.world_size)]
        dist.all_gather(parts, pos.contiguous(), group=self.process_group)
        kwargs["position_ids"] = torch.cat(parts, dim=1)
        q_bshd, k_bshd, v_bshd = (t.transpose(1, 2) for t in (query, key, value))
        backend = _HFLocalAttention(self.attn, module, attention_mask, args, kwargs)
        scale = kwargs.get("scaling") or 1.0 / math.sqrt(d)
        cache = self.__dict__.setdefault("_sp_attention", {})  # (heads, kv heads) -> the factory's attention
        if (h, k_bshd.shape[2]) not in cache:
            cache[(h, k_bshd.shape[2])] = make_attention(
                self.cfg, self.process_group, num_heads=h, num_kv_heads=k_bshd.shape[2], layout="bshd",
                resources=SPResources(self.cfg, streams=self.streams, policy=self.policy, transports=self.transports))
        attn = cache[(h, k_bshd.shape[2])]
        out_bshd = attn(q_bshd, k_bshd, v_bshd, causal=bool(getattr(module, "is_causal", False)), softmax_scale=scale,
                        local_attention=backend)
        self.calls += 1
        return out_bshd.reshape(b, s_loc, h * d), None
