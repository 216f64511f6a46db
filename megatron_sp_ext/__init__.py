"""megatron_sp_ext: sequence-parallel attention for long-context video DiTs.

Public functional API (layout "bshd" = [batch, seq_local, heads, head_dim] unless layout="sbhd"):
    AttentionProblem (what the attention computes: causal, placement, padding, packed samples, block mask + tile;
    built once per step and passed to every mode: ``ulysses_attention(q, k, v, group, problem)``),
    ulysses_attention, ring_attention, shard_sequence, unshard_sequence, PackedSamples (cu_seqlens with Megatron's
    padded layout),
    build_sp_mesh, hybrid_attention, torus_attention, hamiltonian_cycles,
    SPConfig + make_attention(cfg, group, num_heads=H) (the attention of a mode; runs on shards),
    pack_qkv, packed_ulysses_attention, PackedUlysses (q|k|v written in the exchange's send layout),
    async_ulysses_self_attention, allgather_self_attention, tp_cp_self_attention (whole attention layers:
    ``(x, LayerWeights(...), group, problem, num_heads=, num_kv_heads=, prep=, run=LayerRun(...))``; TpCpGroups)
Framework adapters live in ``megatron_sp_ext.megatron`` and ``megatron_sp_ext.deepspeed`` and are
imported only on demand (``import megatron_sp_ext`` needs torch alone).
"""
from .comm.transport import NcclTransport, SymmMemTransport, TransportPool, default_transports
from .config import SPConfig
from .errors import SPConfigError
from .sp.factory import make_attention
from .sp.problem import AttentionProblem
from .sp.layers.async_qkv import async_ulysses_self_attention
from .sp.layers.allgather import allgather_self_attention
from .sp.layers.call import LayerRun, LayerWeights
from .sp.layers.tp_cp import TpCpGroups, tp_cp_self_attention
from .sp.ring import hybrid_attention, ring_attention, torus_attention
from .config import DEFAULT_PLACEMENT
from .sp.placement import PackedSamples, balanced_placement, shard_sequence, unshard_sequence
from .sp.ulysses import PackedUlysses, pack_qkv, packed_head_layout, packed_ulysses_attention, ulysses_attention
from .topology.hamiltonian import hamiltonian_cycles, routing_tables
from .topology.mesh import SPMesh, build_sp_mesh

__version__ = "0.2.0"

__all__ = ["SPConfig", "SPConfigError", "AttentionProblem", "make_attention", "ulysses_attention", "ring_attention", "shard_sequence",
           "unshard_sequence", "DEFAULT_PLACEMENT", "balanced_placement", "hamiltonian_cycles", "routing_tables", "SPMesh", "build_sp_mesh",
           "hybrid_attention", "torus_attention", "async_ulysses_self_attention", "allgather_self_attention",
           "tp_cp_self_attention", "LayerWeights", "LayerRun", "TpCpGroups", "PackedSamples",
           "pack_qkv", "packed_head_layout", "packed_ulysses_attention", "PackedUlysses", "NcclTransport",
           "SymmMemTransport", "TransportPool", "default_transports"]
