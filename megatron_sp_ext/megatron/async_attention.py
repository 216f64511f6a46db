"""SPSelfAttention: Megatron SelfAttention whose projections can overlap their Ulysses exchanges.

``with_sp_core_attention`` puts it in the layer spec; ``--sp-async-qkv`` (``sp_async_qkv="on"`` in
SPTransformerConfig, or SPConfig.async_qkv) switches it on, otherwise it is the parent unchanged.
With ``--sp-async-qkv allgather`` it runs the all-gather QKV layer instead (sp/layers/allgather.py:
sequence all-gather fused with the QKV GEMM for this rank's heads; per-head q/k norms, RoPE with the
gathered ranks' freqs; parameter grads are each CP rank's share, summed by the DP x CP grad reduction).
When on, the training forward runs megatron_sp_ext's async Ulysses layer
(sp/layers/async_qkv.py): per-branch Q, K, V GEMMs from ``linear_qkv``'s weight (Megatron's interleaved
per-query-group rows q1..qn k v | ... are regrouped q | k | v on the fly, so checkpoints stay
Megatron's), per-head q/k layernorm and RoPE applied to each branch before its exchange, the
output exchange overlapped with the dO exchange / dW_proj GEMM in backward. Same math as the
parent's forward; the returned (output, bias) follows ``linear_proj``'s skip_bias_add contract.

With --tensor-model-parallel-size > 1 (needs --sequence-parallel; refused by name without it) the
TP x CP layer runs instead (sp/layers/tp_cp.py): ``on`` its pipelined form (TP all-gather pipelined with
the per-chunk QKV GEMMs, CP exchange per head chunk, pipelined TP reduce-scatter), ``allgather`` its mixed
form (MixedComm: one all-gather over the tensor-and-context-parallel group in, one reduce-scatter over it
out, no all-to-all); with one CP rank too.

``--sp-async-qkv auto`` lets a FormPolicy (sp/layers/policy.py) time, on the first call per shape key (shape,
dtype, causal, TP, CP, heads, kv heads, chunks, RoPE, training, the group's ranks), Megatron's own attention
path (the parent's forward: TP all-gather + QKV GEMM, our CP exchange + attention, output GEMM + TP
reduce-scatter; the baseline) against the layer's forms (TP > 1: pipelined, mixed, mixed_in; TP 1: async,
allgather), one fwd (+bwd in training) each on detached copies of the input and parameters (the model's grads,
main_grad included, stay untouched), and keep the baseline unless a form is faster by the margin in a majority
of interleaved rounds, the same decision on every rank of the tensor-and-context-parallel group. Every form is
the same math (to fp rounding). The policy is shared by the layers of one model (it lives on their shared
SPContext), so a shape is timed once.

Runs where the async layer does not apply (inference with a KV cache, cross attention, packed
sequences, attention bias, one CP rank at TP 1) use the parent's forward unchanged, which is the same math.
Settings the async layer cannot honour raise SPConfigError at construction, naming the flag.
Shapes: hidden_states [s_local, b, hidden] (Megatron's sbhd), zigzag CP placement.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator, Optional

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp

from .. import modes
from ..errors import SPConfigError
from ..sp.calibration import group_key
from ..sp.layers.allgather import allgather_self_attention
from ..sp.layers.async_qkv import async_ulysses_self_attention
from ..sp.layers.call import LayerRun, LayerWeights, agree_layer, check_layer
from ..sp.layers.policy import FormPolicy
from ..sp.layers.tp_cp import TP_CP_FORMS, TpCpGroups, tp_cp_self_attention
from ..sp.problem import AttentionProblem
from .compat import parent_kwargs

log = logging.getLogger("megatron_sp_ext")
_FLAG = "--sp-async-qkv"
BASELINE = "megatron"  # the parent's forward: Megatron's own attention path, the policy's baseline
# --sp-async-qkv on / allgather -> the form that runs (TP > 1, TP 1)
FIXED_FORMS = {"on": ("pipelined", "async"), "allgather": ("mixed", "allgather")}


def _real(norm):
    """The q/k norm module, or None where the spec put none (None or IdentityOp)."""
    return None if norm is None or isinstance(norm, IdentityOp) else norm


class SPSelfAttention(SelfAttention):
    """SelfAttention with the async Ulysses layer behind --sp-async-qkv (see module docstring)."""

    def __init__(self, config, submodules, layer_number: int, attn_mask_type=AttnMaskType.padding,
                 cp_comm_type=None, pg_collection=None, **kwargs) -> None:
        # newer megatron-core passes more (name=, pp_layer_offset=): forward what the parent accepts
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection, **parent_kwargs(SelfAttention.__init__, kwargs))
        self._fallback_logged = False
        self._forced_form: Optional[str] = None   # ``running(form)``: the form forward runs
        core = self.core_attention
        sp = getattr(core, "sp", None)
        self.async_qkv = sp.async_qkv if sp is not None else getattr(config, "sp_async_qkv", "off")
        if self.async_qkv == "off":
            return
        if self.async_qkv not in ("on", "allgather", "auto"):
            raise SPConfigError(f"{_FLAG}={self.async_qkv!r} is invalid for Megatron layers: use on, allgather, "
                                f"auto or nothing (off)")
        spec = modes.find(getattr(core, "mode", None))
        if not hasattr(core, "ctx") or spec is None or not spec.all_to_all or spec.auto:
            raise SPConfigError(f"{_FLAG} needs megatron_sp_ext core attention with --cp-comm-type "
                                f"{modes.listing(modes.names(all_to_all=True, auto=False))} "
                                f"(got {getattr(core, 'mode', type(core).__name__)})")
        if not isinstance(spec.chunks(core.sp.head_chunks), int):
            raise SPConfigError(f"{_FLAG} needs an integer --hcms-head-chunks (got {core.sp.head_chunks!r})")
        if self.world_size != 1:  # TP x CP layer (sp/layers/tp_cp.py): needs Megatron's TP sequence parallelism
            if not getattr(config, "sequence_parallel", False):
                raise SPConfigError(f"{_FLAG} with --tensor-model-parallel-size {self.world_size} needs "
                                    f"--sequence-parallel (the TP x CP layer takes sequence-sharded hidden "
                                    f"states); add --sequence-parallel or use --tensor-model-parallel-size 1")
            if config.num_query_groups is not None and config.num_query_groups % self.world_size:
                raise SPConfigError(f"{_FLAG} with --tensor-model-parallel-size {self.world_size} needs "
                                    f"--num-query-groups divisible by it (got {config.num_query_groups})")
        if hasattr(self.linear_qkv, "layer_norm_weight"):
            raise SPConfigError(f"{_FLAG} needs a linear_qkv without a fused input layernorm (use the local layer "
                                f"spec, get_gpt_layer_local_spec, or a TE spec with a separate input_layernorm)")
        for name in ("q_layernorm", "k_layernorm"):
            norm = _real(getattr(self, name))
            if norm is not None and getattr(norm, "bias", None) is not None:
                raise SPConfigError(f"{_FLAG}: {name} has a bias; the async layer supports bias-free q/k norms "
                                    f"(--normalization RMSNorm)")
        if (config.attention_dropout or 0.0) > 0.0:
            raise SPConfigError(f"{_FLAG} needs --attention-dropout 0 (got {config.attention_dropout})")

    # -- weights in q | k | v order --------------------------------------------------------------
    def _qkv_weight(self, t):
        """Megatron's [ng * (hpg + 2) * hn, ...] rows (q1..q_hpg k v per group) -> q rows | k rows | v rows."""
        if t is None:
            return None
        ng = self.num_query_groups_per_partition
        hpg = self.num_attention_heads_per_partition // ng
        hn = self.hidden_size_per_attention_head
        g = t.view(ng, hpg + 2, hn, *t.shape[1:])
        return torch.cat([g[:, :hpg].reshape(-1, *t.shape[1:]), g[:, hpg].reshape(-1, *t.shape[1:]),
                          g[:, hpg + 1].reshape(-1, *t.shape[1:])], dim=0)

    def _unsupported(self, key_value_states, inference_context, packed_seq_params, attention_bias, extra) -> str:
        if self.async_qkv == "off":
            return "off"
        if key_value_states is not None:
            return "cross attention"
        if inference_context is not None:
            return "inference with a KV cache"
        if packed_seq_params is not None:
            return "packed sequences"
        if attention_bias is not None:
            return "attention bias"
        if any(e is not None for e in extra):
            return "precomputed rotary cos/sin"
        group = self.core_attention.cp_group
        if self.world_size == 1 and (group is None or group.size() == 1):
            return "one context-parallel rank"
        return ""

    # -- which form runs -------------------------------------------------------------------------
    def forms(self) -> tuple:
        """The candidates of ``auto``, the baseline (Megatron's own path) first."""
        return (BASELINE,) + (TP_CP_FORMS if self.world_size != 1 else ("async", "allgather"))

    def _groups(self):
        """(cp_group, tcp_group): the CP group and the tensor-and-context-parallel group (CP-major)."""
        from megatron.core import parallel_state as ps  # noqa: PLC0415
        core = self.core_attention
        cp_group = core.cp_group if core.cp_group is not None else ps.get_context_parallel_group()
        if self.world_size == 1:
            return cp_group, cp_group
        tcp_group = getattr(self.pg_collection, "tp_cp", None) or ps.get_tensor_and_context_parallel_group()
        return cp_group, tcp_group

    @property
    def form_policy(self) -> FormPolicy:
        """The FormPolicy of ``auto``, shared by every layer built with the same SPContext (settable, e.g. with an
        injected timer)."""
        return self.core_attention.ctx.form_policy

    @form_policy.setter
    def form_policy(self, policy: FormPolicy) -> None:
        self.core_attention.ctx.form_policy = policy

    def _form_for(self, hidden_states, attention_mask, rotary_pos_emb) -> str:
        if self.async_qkv != "auto":
            return FIXED_FORMS[self.async_qkv][0 if self.world_size != 1 else 1]
        core = self.core_attention
        cp_group, group = self._groups()
        chunks = modes.get(core.mode).chunks(core.sp.head_chunks)
        key = ("sp-layer", tuple(hidden_states.shape), hidden_states.dtype, core._causal(None, attention_mask),
               self.world_size, cp_group.size(), self.num_attention_heads_per_partition,
               self.num_query_groups_per_partition, chunks, rotary_pos_emb is not None, self.training,
               group_key(group))
        steps = {f: functools.partial(self._calibration_step, f, hidden_states, attention_mask, rotary_pos_emb)
                 for f in self.forms()}
        return self.form_policy.fastest(key, steps, group, hidden_states.device)

    def _calibration_step(self, form: str, hidden_states, attention_mask, rotary_pos_emb) -> None:
        """One fwd (+bwd in training, also when the caller runs under no_grad: the first forward of Megatron's
        reentrant activation recompute, whose recompute then finds the same decision) of ``form`` on detached
        copies of the input and of every parameter: the model's .grad and main_grad (a scratch one per copy:
        Megatron's gradient-accumulation fusion writes it) stay untouched, and no grad hook fires."""
        train = self.training
        params = {}
        for name, p in self.named_parameters():
            c = p.detach().requires_grad_(p.requires_grad and train)
            if getattr(p, "main_grad", None) is not None:
                c.main_grad = torch.zeros_like(p.main_grad)
            params[name] = c
        x = hidden_states.detach().requires_grad_(train)
        with torch.set_grad_enabled(train), self.running(form):
            out, _ = torch.func.functional_call(self, params, (x, attention_mask), {"rotary_pos_emb": rotary_pos_emb})
            if train:
                out.backward(torch.ones_like(out))

    @contextlib.contextmanager
    def running(self, form: str) -> Iterator["SPSelfAttention"]:
        """Within the block, ``forward`` runs ``form`` (one of ``forms()``: the policy's calibration, tests and
        benchmarks) instead of what ``--sp-async-qkv`` decides."""
        if form not in self.forms():
            raise SPConfigError(f"form={form!r} is invalid here: choose one of {', '.join(self.forms())}")
        before, self._forced_form = self._forced_form, form
        try:
            yield self
        finally:
            self._forced_form = before

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """Megatron's SelfAttention.forward: the form ``--sp-async-qkv`` decides (``auto``: the FormPolicy, after
        this call's AttentionProblem is agreed across the ranks, so every rank times the same key), or the one of
        ``running(form)``."""
        why = self._unsupported(key_value_states, inference_context or inference_params, packed_seq_params,
                                attention_bias, (rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, sequence_len_offset))
        if why:
            if why != "off" and not self._fallback_logged:
                log.info("megatron_sp_ext: %s: layer %d runs the standard attention path for %s (same math)",
                         _FLAG, self.layer_number, why)
                self._fallback_logged = True
            form = BASELINE
        else:
            form = self._forced_form
        problem = None
        if form is None:
            if self.async_qkv == "auto":   # the policy times forms per key (its shapes): the problem agreed first
                problem = self._agreed_problem(hidden_states, attention_mask)
            form = self._form_for(hidden_states, attention_mask, rotary_pos_emb)
        if form == BASELINE:
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                   rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                   attention_bias, packed_seq_params, sequence_len_offset,
                                   inference_params=inference_params)
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        core = self.core_attention
        group = core.cp_group
        hn = self.hidden_size_per_attention_head
        norms = {"q": _real(self.q_layernorm), "k": _real(self.k_layernorm)}
        weights = {k: getattr(m, "weight", None) if m is not None else None for k, m in norms.items()}
        x_bsd = hidden_states.transpose(0, 1)
        b, s = x_bsd.shape[:2]

        def prep(branch, y, w):  # [B, S, n*hn] -> per-head q/k norm, then RoPE on this rank's positions
            y4 = y.view(b, s, -1, hn)
            if norms[branch] is not None:  # the norm's weight is the layer's leaf w (its grad flows back)
                y4 = torch.func.functional_call(norms[branch], {"weight": w}, (y4,)) if w is not None \
                    else norms[branch](y4)
            if rotary_pos_emb is not None:
                freqs = rotary_pos_emb[0 if branch == "q" else 1]
                y4 = apply_rotary_pos_emb(y4.transpose(0, 1), freqs, config=self.config,
                                          cp_group=group).transpose(0, 1)
            return y4
        gathered = {}

        def prep_full(branch, y, w, shard):  # all-gather layer: this rank's heads, the gathered sequence
            y4 = y.view(b, -1, y.shape[-1] // hn, hn)
            if norms[branch] is not None:  # per-head norms: nothing crosses ranks
                y4 = torch.func.functional_call(norms[branch], {"weight": w}, (y4,)) if w is not None \
                    else norms[branch](y4)
            if rotary_pos_emb is not None:  # this rank's (zigzag) freqs -> the gathered sequence's, rank order
                i = 0 if branch == "q" else 1
                if i not in gathered:
                    gathered[i] = shard.gather_tokens(rotary_pos_emb[i])
                y4 = apply_rotary_pos_emb(y4.transpose(0, 1), gathered[i], config=self.config,
                                          cp_group=group).transpose(0, 1)
            return y4
        problem = problem or self._problem(attention_mask)
        layer_weights = LayerWeights(self._qkv_weight(self.linear_qkv.weight), self.linear_proj.weight,
                                     self._qkv_weight(self.linear_qkv.bias), None, weights["q"], weights["k"])
        if self.world_size != 1:
            return self._tp_cp_forward(x_bsd, norms, layer_weights, rotary_pos_emb, problem, form)
        layer, layer_prep = ((allgather_self_attention, prep_full) if form == "allgather"
                             else (async_ulysses_self_attention, prep))
        out_bsd = layer(x_bsd, layer_weights, group, problem, num_heads=self.num_attention_heads_per_partition,
                        num_kv_heads=self.num_query_groups_per_partition, prep=layer_prep,
                        run=self._layer_run(group, hidden_states.device))
        return out_bsd.transpose(0, 1).contiguous(), self.linear_proj.bias

    def _problem(self, attention_mask) -> AttentionProblem:
        """This call's AttentionProblem: causal per the mask type, the core's softmax scale, Megatron's zigzag
        placement (one per call: Megatron's layers get no per-step object to hold it)."""
        core = self.core_attention
        return AttentionProblem(causal=core._causal(None, attention_mask), softmax_scale=core.softmax_scale,
                                placement="zigzag")

    def _layer_run(self, group, device) -> LayerRun:
        """How the layers run: the core's HCMS chunks, backend, communication stream and transport."""
        core = self.core_attention
        return LayerRun(head_chunks=modes.get(core.mode).chunks(core.sp.head_chunks), backend=core.backend,
                        comm_stream=core.ctx.streams.comm_stream(device),
                        transport=core.ctx.transports.get(core.sp.transport, group, device, "--sp-transport"))

    def _agreed_problem(self, hidden_states, attention_mask) -> AttentionProblem:
        """This call's problem, agreed across the layer's groups (the layers' own checks folded in) before the
        form policy runs anything over them: a rank whose shard differs raises with every other rank, instead of
        one rank timing a shape the others have seen (and waiting in the timing's collectives)."""
        problem = self._problem(attention_mask)
        core = self.core_attention
        x_bsd = hidden_states.transpose(0, 1)
        cp_group, tcp_group = self._groups()
        what = "SPSelfAttention (--sp-async-qkv)"
        run = LayerRun(head_chunks=modes.get(core.mode).chunks(core.sp.head_chunks), backend=core.backend)
        tp = self.world_size
        agree_layer(what, problem, x_bsd, (tcp_group,) if tp != 1 else (cp_group,),
                    lambda: check_layer(what, problem, x_bsd, self.num_attention_heads_per_partition,
                                        self.num_query_groups_per_partition, run, cp_group.size(),
                                        seq_local=x_bsd.shape[1] * tp))
        return problem

    def _tp_cp_forward(self, x_bsd, norms, layer_weights: LayerWeights, rotary_pos_emb, problem: AttentionProblem,
                       form: str):
        """TP > 1 with --sequence-parallel: the TP x CP layer (sp/layers/tp_cp.py) in ``form`` (pipelined, mixed,
        mixed_in) on this rank's [b, s_tp, h] tokens. The CP group may have one rank (TP only)."""
        import torch.distributed as dist  # noqa: PLC0415
        cp_group, tcp_group = self._groups()
        gathered = {}

        def prep(branch, y4, w, cp_gathered):  # per-head q/k norm, then RoPE at these tokens' positions
            if norms[branch] is not None:
                y4 = torch.func.functional_call(norms[branch], {"weight": w}, (y4,)) if w is not None \
                    else norms[branch](y4)
            if rotary_pos_emb is not None:
                i = 0 if branch == "q" else 1
                freqs = rotary_pos_emb[i]
                if cp_gathered and cp_group.size() > 1:  # this CP rank's freqs -> every CP rank's, rank order
                    if i not in gathered:
                        parts = [torch.empty_like(freqs) for _ in range(cp_group.size())]
                        dist.all_gather(parts, freqs.contiguous(), group=cp_group)
                        gathered[i] = torch.cat(parts, dim=0)
                    freqs = gathered[i]
                y4 = apply_rotary_pos_emb(y4.transpose(0, 1), freqs, config=self.config,
                                          cp_group=cp_group).transpose(0, 1)
            return y4
        out_bsd = tp_cp_self_attention(
            x_bsd, layer_weights, TpCpGroups(self.tp_group, cp_group, tcp_group), problem,
            num_heads=self.num_attention_heads_per_partition, num_kv_heads=self.num_query_groups_per_partition,
            prep=prep, form=form, run=self._layer_run(cp_group, x_bsd.device))
        return out_bsd.transpose(0, 1).contiguous(), self.linear_proj.bias
