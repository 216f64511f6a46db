"""SPDotProductAttention: Megatron-core core attention running our sequence-parallel algorithms.

Megatron builds it with ``(config, layer_number, attn_mask_type, attention_type, cp_comm_type,
softmax_scale, pg_collection)`` and calls ``forward(query, key, value, attention_mask,
attn_mask_type, attention_bias, packed_seq_params)`` with [s, b, heads, head_dim] tensors of this
CP rank (Megatron's zigzag split when it comes from ``get_batch_on_this_cp_rank``); it returns
[s, b, heads * head_dim]. ``cp_comm_type`` picks the algorithm:
  ulysses, hcms      Ulysses / HCMS over the CP group (``--hcms-head-chunks``)
  ring, tasp         ring / TASP multi-ring over the CP group
  usp, tas, torus    2D mesh over the CP group (``--sp-placement``, ``--sp-nodes``, ``--sp-ulysses-size``);
                     usp reuses Megatron's groups when ``--hierarchical-context-parallel-sizes`` built two levels
  auto               hcms when every rank gets a head (then, on GPUs, Ulysses/HCMS or the ring per shape from
                     its own calibration: sp.policy.ModePolicy), else a usp mesh, else ring
  p2p, a2a, all_gather, a2a+p2p   Transformer Engine's own CP (needs TE; delegated unchanged)
Causal masks follow Megatron's zigzag placement; DiTs use AttnMaskType.no_mask.
"""
from __future__ import annotations

import copy
import importlib.util
from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from ..attention.backends import get_backend
from ..comm.streams import StreamPool
from ..comm.transport import TransportPool
from ..config import SPConfig, resolve_auto_mode
from ..errors import SPConfigError
from ..sp.hybrid import hybrid_attention
from ..sp.policy import HCMSPolicy, ModePolicy
from ..sp.ring import ring_attention
from ..sp.torus import torus_attention
from ..sp.ulysses import ulysses_attention
from ..topology.mesh import SPMesh, build_sp_mesh, mesh_from_hierarchical_groups
from .config import sp_config_from

OUR_CP_TYPES = ("ulysses", "hcms", "ring", "tasp", "usp", "tas", "torus", "auto")
TE_CP_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")


class SPContext:
    """State shared by every layer of one model: settings, comm streams, HCMS policy, meshes."""

    def __init__(self, sp_config: Optional[SPConfig] = None) -> None:
        self.sp_config = sp_config
        self.streams = StreamPool()
        self.policy = HCMSPolicy()
        self.mode_policy = ModePolicy()
        self.transports = TransportPool()
        self._meshes: dict = {}

    def mesh(self, group, num_heads: int, cfg: SPConfig, placement: Optional[str] = None) -> SPMesh:
        key = (id(group), num_heads, placement or cfg.placement, cfg.ulysses_size, cfg.nodes)
        if key not in self._meshes:
            self._meshes[key] = build_sp_mesh(
                group, num_heads=num_heads, placement=placement or cfg.placement, ulysses_size=cfg.ulysses_size,
                nodes=cfg.nodes, names={"placement": "--sp-placement", "ulysses_size": "--sp-ulysses-size",
                                        "nodes": "--sp-nodes"})
        return self._meshes[key]


class SPDotProductAttention(DotProductAttention):
    """Core attention with megatron_sp_ext context parallelism (see module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Optional[ProcessGroupCollection] = None,
                 sp_context: Optional[SPContext] = None) -> None:
        # The parent asserts context_parallel_size == 1 (its own math is single-device); hand it a
        # shallow copy that says so, keep the user's config untouched.
        local_cfg = copy.copy(config)
        local_cfg.context_parallel_size = 1
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "hcp"])
        super().__init__(local_cfg, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection)
        self.config = config
        self.cp_group = getattr(pg_collection, "cp", None)
        cp = self.cp_group.size() if self.cp_group is not None else 1
        mode = cp_comm_type or "ulysses"
        if mode in TE_CP_TYPES:
            self._te = self._build_te(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                                      softmax_scale, cp_comm_type, pg_collection)
            self.mode = mode
            return
        self._te = None
        if mode not in OUR_CP_TYPES:
            raise SPConfigError(f"--cp-comm-type={mode!r} is invalid: choose one of "
                                f"{', '.join(OUR_CP_TYPES + TE_CP_TYPES)}")
        heads = self.num_attention_heads_per_partition
        self.mode = resolve_auto_mode(heads, cp) if mode == "auto" else mode
        self.auto_ring = mode == "auto" and self.mode == "hcms"  # may still pick the ring per shape
        self.ctx = sp_context or SPContext()
        self.sp = self.ctx.sp_config or sp_config_from(config)
        if self.mode in ("ulysses", "hcms") and cp > 1 and heads < cp:
            raise SPConfigError(f"--cp-comm-type={mode} needs at least one attention head per CP rank: "
                                f"{heads} heads (per tensor-parallel rank) < context-parallel size {cp}; "
                                f"use ring, tasp, usp or auto")
        self.backend = get_backend(self.sp.backend, "--sp-attention-backend")
        self.mesh = None
        hcp = getattr(pg_collection, "hcp", None)
        if self.mode == "usp" and cp > 1 and hcp and len(hcp) == 2 and self.sp.ulysses_size in (None, hcp[0].size()):
            # Megatron already built the two levels (--hierarchical-context-parallel-sizes): reuse them
            self.mesh = mesh_from_hierarchical_groups(self.cp_group, hcp[0], hcp[1])
        elif self.mode in ("usp", "tas", "torus") and cp > 1:
            placement = None if self.mode == "torus" else self.mode
            self.mesh = self.ctx.mesh(self.cp_group, heads, self.sp, placement)

    @staticmethod
    def _build_te(config, *args):
        if importlib.util.find_spec("transformer_engine") is None:
            raise SPConfigError(f"--cp-comm-type={args[5]} is Transformer Engine's own context parallelism and "
                                f"needs transformer-engine, which is not installed; use one of "
                                f"{', '.join(OUR_CP_TYPES)} instead")
        from megatron.core.extensions.transformer_engine import TEDotProductAttention  # noqa: PLC0415
        return TEDotProductAttention(config, *args)

    def _causal(self, attn_mask_type: Optional[AttnMaskType], attention_mask) -> bool:
        kind = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if kind in (AttnMaskType.causal,):
            return True
        if kind == AttnMaskType.no_mask:
            return False
        raise SPConfigError(f"attn_mask_type={kind} is not supported by megatron_sp_ext core attention "
                            f"(supported: no_mask, causal)")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query/key/value: [s_local, b, heads, head_dim]. Returns [s_local, b, heads * head_dim]."""
        if self._te is not None:
            return self._te(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise SPConfigError("packed sequences and attention_bias are not supported by megatron_sp_ext "
                                "core attention")
        causal = self._causal(attn_mask_type, attention_mask)
        out = self.attend(query, key, value, causal)
        s, b = out.shape[:2]
        return out.reshape(s, b, -1)

    def _auto_mode(self, q, k, causal: bool) -> str:
        """``auto``: Ulysses/HCMS ("hcms", the baseline) or the ring for this shape (calibrated once per key)."""
        group, scale, stream = self.cp_group, self.softmax_scale, self.ctx.streams.comm_stream(q.device)
        tr = self.ctx.transports.get(self.sp.transport, group, q.device, "--sp-transport") \
            if q.device.type == "cuda" else None
        return self.ctx.mode_policy.choose_for(q, k, group, {
            "hcms": lambda qs, ks, vs: ulysses_attention(
                qs, ks, vs, group, head_chunks=self.sp.head_chunks, causal=causal, softmax_scale=scale, layout="sbhd",
                backend=self.backend, comm_stream=stream, policy=self.ctx.policy, placement="zigzag", transport=tr),
            "ring": lambda qs, ks, vs: ring_attention(qs, ks, vs, group, variant="ring", causal=causal,
                                                      softmax_scale=scale, layout="sbhd", placement="zigzag",
                                                      backend=self.backend),
        }, extra_key=(causal,))

    def attend(self, q, k, v, causal: bool):
        """The algorithm of ``self.mode`` on sbhd tensors in Megatron's zigzag placement."""
        group, scale = self.cp_group, self.softmax_scale
        cp = group.size() if group is not None else 1
        stream = self.ctx.streams.comm_stream(q.device)
        if cp == 1:
            qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            return self.backend(qb, kb, vb, causal=causal, softmax_scale=scale).permute(2, 0, 1, 3)
        mode = self._auto_mode(q, k, causal) if self.auto_ring else self.mode
        if mode == "ring" and self.auto_ring:
            return ring_attention(q, k, v, group, variant="ring", causal=causal, softmax_scale=scale, layout="sbhd",
                                  placement="zigzag", backend=self.backend)
        if self.mode in ("ulysses", "hcms"):
            chunks = 1 if self.mode == "ulysses" else self.sp.head_chunks
            return ulysses_attention(q, k, v, group, head_chunks=chunks, causal=causal, softmax_scale=scale,
                                     layout="sbhd", backend=self.backend, comm_stream=stream, policy=self.ctx.policy,
                                     placement="zigzag",
                                     transport=self.ctx.transports.get(self.sp.transport, group, q.device,
                                                                       "--sp-transport"))
        if self.mode in ("ring", "tasp"):
            return ring_attention(q, k, v, group, variant=self.mode, causal=causal, softmax_scale=scale,
                                  layout="sbhd", placement="zigzag", backend=self.backend)
        if self.mode == "torus":
            return torus_attention(q, k, v, self.mesh, causal=causal, softmax_scale=scale, layout="sbhd",
                                   ring_variant=self.sp.ring_variant, placement="zigzag", backend=self.backend)
        return hybrid_attention(q, k, v, self.mesh, head_chunks=self.sp.head_chunks,
                                ring_variant=self.sp.ring_variant, causal=causal, softmax_scale=scale,
                                layout="sbhd", placement="zigzag", backend=self.backend)
