"""The self-attention processor: diffusers' ``WanAttnProcessor`` math for a self-attention (``attn1``) with its
``dispatch_attention_fn`` swapped for megatron_sp_ext's sequence-parallel attention.

    attn.set_processor(SPWanSelfAttnProcessor(attention, state, layer_index))

Per call on this rank's shard hidden_states [B, S_loc, C]: q, k, v from ``to_q/to_k/to_v`` (or the fused
``to_qkv``), ``norm_q`` / ``norm_k``, unflattened to [B, S_loc, H, D], Wan's RoPE on the sharded (cos, sin)
[1, S_loc, 1, D] (rope.py: one fused kernel per direction on CUDA, bit for bit diffusers' ops); then, with a SparseAttentionPlan, ``mask, extra = plan(layer_index, q, k, v, grid_thw, group)``
(a plan whose ``masks_agreed`` is True builds every mask identically on every rank: the layer's problem declares it
agreed, no cross-rank compare; otherwise each distinct mask is compared once per forward);
``out = attention(q, k, v, problem)`` with the forward's ``AttentionProblem`` (``ForwardContext.problem``; with a mask
``problem.with_mask(mask)``, tile ``plan.block_size``) (+ extra), flattened, ``type_as(q)``, ``to_out``. Under
``keep_attention_checkpointing`` (recompute.py) the attention call goes through ``kept.run``: run and kept in the
forward, answered from that record in the checkpoint's recompute. Everything from the sparse plan to the attention's
output (``attend``) is opaque to ``torch.compile`` (fused.py compiles the block around it). Not an ``nn.Module``: the
model's state_dict is unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import SPConfigError
from ..sp.factory import SPAttention
from .hooks import SequenceState
from .rope import wan_rotary


class SPWanSelfAttnProcessor:
    """One layer's self-attention through ``attention`` (an SPAttention, layout "bshd") over ``state.group``.

    layer_index: the layer's index (the SparseAttentionPlan's layer); original: the processor it replaced
    (``SPHandle.remove`` puts it back); where: the module's name (errors); fused_rope: Wan's RoPE as one kernel per
    direction where it applies (rope.py; the same bits as diffusers' ops), else diffusers' ops."""

    def __init__(self, attention: SPAttention, state: SequenceState, layer_index: int,
                 original: object, where: str = "", fused_rope: bool = True) -> None:
        self.attention, self.state, self.layer_index, self.original = attention, state, layer_index, original
        self.fused_rope = fused_rope
        self.where = where or f"blocks.{layer_index}.attn1"
        self.kept = None   # a recompute.KeptAttention under keep_attention_checkpointing (None: a plain call)

    def __call__(self, attn: torch.nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 rotary_emb: Optional[tuple] = None, **kwargs) -> torch.Tensor:
        where = self.where
        if encoder_hidden_states is not None:
            raise SPConfigError(f"parallelize: {where} is a self-attention but was called with encoder_hidden_states")
        if attention_mask is not None:
            raise SPConfigError(f"parallelize: {where} was called with an attention_mask, which the sequence-parallel "
                                f"attention does not apply (Wan's self-attention takes none)")
        if kwargs:
            raise SPConfigError(f"parallelize: {where} was called with {sorted(kwargs)}, which "
                                f"WanAttnProcessor's self-attention does not take")
        if attn.fused_projections:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q_bshd, k_bshd, v_bshd = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:   # compiled (fuse_elementwise): diffusers' ops, which Inductor fuses itself
            fused = self.fused_rope and not torch.compiler.is_compiling()
            q_bshd = wan_rotary(q_bshd, *rotary_emb, fused=fused)
            k_bshd = wan_rotary(k_bshd, *rotary_emb, fused=fused)
        out_bshd = self.attend(attn.training, q_bshd, k_bshd, v_bshd, rotary_emb)
        out = out_bshd.flatten(2, 3).type_as(q_bshd)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    @torch.compiler.disable(recursive=True)
    def attend(self, training: bool, q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor,
               rotary_emb: Optional[tuple]) -> torch.Tensor:
        """The sequence-parallel attention of q, k, v [B, S_loc, H, D] (the sparse plan's mask and extra branch
        included) -> [B, S_loc, H, D]. Opaque to torch.compile (fused.py compiles the block around it: one graph
        before, one after; collectives, host syncs and the kernels run as they do eagerly)."""
        # the forward that made rotary_emb (a checkpoint recompute: not the latest): its grid and its problem
        ctx = self.state.context_of(rotary_emb[:1] if rotary_emb is not None else ())
        plan, extra, problem = self.state.sparse, None, ctx.problem
        if plan is not None:
            mask, extra = plan(self.layer_index, q_bshd, k_bshd, v_bshd, ctx.grid_thw, self.state.group)
            if mask is not None:   # agreed: equal on every rank by construction (the plan says so), no compare
                agreed = bool(getattr(plan, "masks_agreed", False))
                problem = ctx.problem.cached(("layer mask", id(mask)), lambda: ctx.problem.with_mask(
                    mask, tile=plan.block_size, agreed=agreed))   # a mask shared by layers: compared once
        self.attention.training = training
        if self.kept is not None:   # checkpointing that keeps the attention: recorded, or replayed in a recompute
            out_bshd = self.kept.run(self.attention, q_bshd, k_bshd, v_bshd, problem)
        else:
            out_bshd = self.attention(q_bshd, k_bshd, v_bshd, problem)
        return out_bshd if extra is None else out_bshd + extra
