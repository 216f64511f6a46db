"""SPDotProductAttention: Megatron-core core attention running our sequence-parallel algorithms.

Megatron builds it with ``(config, layer_number, attn_mask_type, attention_type, cp_comm_type,
softmax_scale, pg_collection)`` and calls ``forward(query, key, value, attention_mask,
attn_mask_type, attention_bias, packed_seq_params)`` with [s, b, heads, head_dim] tensors of this
CP rank (Megatron's zigzag split when it comes from ``get_batch_on_this_cp_rank``); it returns
[s, b, heads * head_dim]. ``cp_comm_type`` picks the algorithm:
  ulysses, hcms      Ulysses / HCMS over the CP group (``--hcms-head-chunks``)
  ring, tasp         ring / TASP multi-ring over the CP group
  usp, tas, torus    2D mesh over the CP group (``--sp-arrangement``, ``--sp-nodes``, ``--sp-ulysses-size``);
                     usp reuses Megatron's groups when ``--hierarchical-context-parallel-sizes`` built two levels
  auto               hcms when every rank gets a head (then, on GPUs, Ulysses/HCMS, the ring or TASP beyond 2
                     ranks per shape, from its own calibration on this CP group: sp.calibration says what that
                     guarantees), else a usp mesh, else ring
  p2p, a2a, all_gather, a2a+p2p   Transformer Engine's own CP (needs TE; delegated unchanged)
Causal masks follow Megatron's zigzag placement; DiTs use AttnMaskType.no_mask. Ulysses' copies per call: the pack
of q|k|v (one pass when they are views of one linear_qkv output), their kernel layout, the output's unpack; with
B == 1 the zigzag permutation rides on the exchanges (tests/test_adapter_copies.py counts them).
Packed samples (``packed_seq_params`` with qkv_format "thd", [t, heads, head_dim] tensors, Megatron's per-sample
zigzag split): every one of our types (auto stays on ulysses/hcms), each sample attending within itself; returns
[t, heads * head_dim].
"""
from __future__ import annotations

import copy
import importlib.util
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from .. import modes
from ..errors import SPConfigError
from ..sp.factory import SPAttention, SPResources, make_attention
from ..sp.placement import PackedSamples
from ..topology.mesh import mesh_from_hierarchical_groups
from .config import sp_config_from

OUR_CP_TYPES = modes.NAMES   # the mode registry's
TE_CP_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")

# State shared by every layer of one model (settings, comm streams, HCMS and mode policies, transports, meshes):
# the factory's SPResources under its historical Megatron name.
SPContext = SPResources


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
        self.ctx = sp_context or SPContext()
        base = self.ctx.sp_config or sp_config_from(config)
        p = attention_dropout if attention_dropout is not None else (getattr(config, "attention_dropout", 0.0) or 0.0)
        # this layer's settings: its --cp-comm-type and --attention-dropout (validated here, naming the flags)
        self.sp = base.for_mode(mode, dropout_p=p)
        self.dropout_p = self.sp.dropout_p
        mesh = None
        hcp = getattr(pg_collection, "hcp", None)
        spec = modes.get(mode)   # a mesh with Ulysses inside machines is what Megatron's two levels are
        if spec.arrangement and not spec.ulysses_across and cp > 1 and hcp and len(hcp) == 2 and self.sp.ulysses_size in (None, hcp[0].size()):
            # Megatron already built the two levels (--hierarchical-context-parallel-sizes): reuse them
            mesh = mesh_from_hierarchical_groups(self.cp_group, hcp[0], hcp[1])
        self.attention: SPAttention = make_attention(
            self.sp, self.cp_group if cp > 1 else None, num_heads=heads,
            num_kv_heads=self.num_query_groups_per_partition, layout="sbhd", placement="zigzag",
            backend=self.sp.backend, resources=self.ctx, mesh=mesh)
        self.attention.chooser = self._auto_mode
        self._batch_problems = WeakIdKeyDictionary()   # a batch's packed_seq_params (by identity) -> its problems
        self.mode = self.attention.mode
        self.mesh = self.attention.mesh

    @property
    def backend(self):
        """The local attention kernel (the factory attention's; settable)."""
        return self.attention.backend

    @backend.setter
    def backend(self, be) -> None:
        self.attention.backend = be

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
        if attention_bias is not None:
            raise SPConfigError("attention_bias is not supported by megatron_sp_ext core attention")
        if packed_seq_params is not None:
            return self._forward_thd(query, key, value, self._causal(attn_mask_type, attention_mask),
                                     packed_seq_params)
        causal = self._causal(attn_mask_type, attention_mask)
        out = self.attend(query, key, value, causal)
        s, b = out.shape[:2]
        return out.reshape(s, b, -1)

    def _forward_thd(self, q, k, v, causal: bool, params) -> torch.Tensor:
        """Packed samples: q [t, H, D], k/v [t, Hkv, D] (this CP rank's per-sample zigzag shards) -> [t, H * D].
        The samples: ``cu_seqlens_q`` (real lengths) placed as ``cu_seqlens_q_padded`` (each padded to a multiple
        of 2 * CP); padding rows form segments of their own."""
        q, k, v = (t.unsqueeze(1) for t in (q, k, v))  # [t, 1, heads, D] sbhd
        problem = self._batch_problem(params, causal, self._dropout())
        self.attention.training = self.training
        with _model_parallel_rng(q):
            out = self.attention(q, k, v, problem)
        return out.reshape(out.shape[0], -1)

    def _batch_problem(self, params, causal: bool, dropout_p: float):
        """The batch's AttentionProblem of ``packed_seq_params`` (its samples read once per batch, not per layer:
        kept while the batch's params object lives, and rebuilt when its cu_seqlens tensors are other objects), per
        (causal, dropout, scale) of the calling layer."""
        tensors = (params.cu_seqlens_q, params.cu_seqlens_kv, params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded)
        entry = self._batch_problems.get(params)
        if entry is None or len(entry[0]) != len(tensors) or any(a is not b for a, b in zip(entry[0], tensors)):
            entry = (tensors, {})
            self._batch_problems[params] = entry
        key = (causal, dropout_p, self.softmax_scale)
        if key not in entry[1]:
            entry[1][key] = self.attention.problem(causal=causal, softmax_scale=self.softmax_scale,
                                                   dropout_p=dropout_p, cu_seqlens=self._thd_samples(params))
        return entry[1][key]

    @staticmethod
    def _thd_samples(params) -> PackedSamples:
        """The checks of ``packed_seq_params`` (the THD format, self-attention); returns the packed samples (real
        lengths ``cu_seqlens_q``, placed as ``cu_seqlens_q_padded`` when given)."""
        if params.qkv_format != "thd":
            raise SPConfigError(f"packed_seq_params.qkv_format={params.qkv_format!r} is not supported by "
                                f"megatron_sp_ext core attention: use 'thd'")
        pairs = [(params.cu_seqlens_q, params.cu_seqlens_kv), (params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded)]
        if params.cu_seqlens_q is None or any(b is not None and (a is None or not torch.equal(a.cpu(), b.cpu()))
                                              for a, b in pairs):
            raise SPConfigError("packed_seq_params: cu_seqlens_q must be given, and cu_seqlens_kv(_padded) must equal "
                                "cu_seqlens_q(_padded) (self-attention)")
        real = tuple(int(x) for x in params.cu_seqlens_q.tolist())
        padded = params.cu_seqlens_q_padded
        return PackedSamples(real, real if padded is None else tuple(int(x) for x in padded.tolist()))

    def _auto_mode(self, q, k, problem) -> str:
        """``auto``: Ulysses/HCMS ("hcms", the baseline) or the ring for this shape (the factory's calibration,
        once per key; a hook tests may replace)."""
        chooser, self.attention.chooser = self.attention.chooser, None
        try:
            return self.attention.mode_for(q, k, problem)
        finally:
            self.attention.chooser = chooser

    def _dropout(self) -> float:
        """This call's attention dropout: --attention-dropout in training, 0 in eval."""
        return self.dropout_p if self.training else 0.0

    def attend(self, q, k, v, causal: bool):
        """This layer's algorithm (the factory's) on sbhd tensors in Megatron's zigzag placement."""
        self.attention.training = self.training  # auto: recompute's no_grad forward decides like training
        with _model_parallel_rng(q):   # one rank: the factory's one-rank path (the kernel's own dropout)
            return self.attention(q, k, v, causal=causal, softmax_scale=self.softmax_scale, dropout_p=self._dropout())


def _model_parallel_rng(q: torch.Tensor):
    """Megatron's model-parallel CUDA RNG (as its own attention dropout uses) when initialised, else a no-op."""
    import contextlib  # noqa: PLC0415
    if q.device.type != "cuda":
        return contextlib.nullcontext()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: PLC0415
    tracker = get_cuda_rng_tracker()
    return tracker.fork() if tracker.is_initialized() else contextlib.nullcontext()
