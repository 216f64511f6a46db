"""Wan-style video DiT whose self-attention runs sequence-parallel.

Tokens: latents [B, C, T, H, W] are cut into patches (pt, ph, pw) -> N = T'H'W' tokens of
C*pt*ph*pw values; each rank embeds only its own tokens (a Linear on patch vectors, equal to the
usual Conv3d). Blocks: AdaLN-zero modulated self-attention (QK RMSNorm, 3D RoPE at global
positions, the injected sequence-parallel core), cross-attention to replicated text embeddings
(queries sharded: no exchange), GELU-tanh FFN. The head predicts the flow-matching velocity per
patch; ``unpatchify`` rebuilds [B, C, T, H, W] from all tokens.

Packed steps (``pack=``, a ``varlen.PackInfo``): B=1 and the sequence holds several clips of different sizes
(``cu_seqlens``). Self-attention runs per sample (the core gets ``cu_seqlens``), every sample has its own 3D
RoPE grid, its own timestep (AdaLN modulation expanded per token) and its own text: its video tokens
cross-attend only to its own text tokens (block-diagonal). ``unpatchify_packed`` rebuilds each clip.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_sp_ext.attention import kernels
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.problem import AttentionProblem

from .config import DiTConfig
from .fused import ElementwiseOps, linear_input_dtype, rms_norm
from .rope import RopeCache, apply_rope
from .sparse import (SPARSE_FLAG, SparseSpec, SparseStep, SparseStepCache, coarse_tiles, gated_spread, pad_tile_mask,
                     pool_tiles, reference_sparse_attention, topk_tile_mask)
from .varlen import PackInfo

# --recompute-modules values (Megatron-LM's names) for --recompute-granularity selective
RECOMPUTE_MODULES = ("core_attn", "mlp", "outside_core_attn")
# ours (no Megatron-LM module of that meaning): recompute the whole block except the self-attention core
KEEP_CORE_MODULE = "outside_core_attn"

# core(q, k, v, kv_valid_len) -> out, all [B, S_local, H, D]; installed by parallel.parallelize (engine.core_of, or
# dynamic.make_dynamic_core), the one call both entries make. Packed steps call
# core(q, k, v, None, cu_seqlens=cu) with cu the int32 cumulative sample lengths over the full sequence (B=1).
# Sparse steps (--sparse-attention tiles) call core(q, k, v, kv_valid_len, block_mask=m, block_size=n): m bool
# [H or 1, nT, nT] over query x key blocks of n tokens of the full (tile-ordered) sequence, the same on every rank.
# A core's ``group`` attribute (None or absent: one rank) is the SP group its attention runs over; a core whose
# ``takes_agreed_masks`` is True takes ``mask_agreed=True``: the block mask is equal on every rank by construction
# (top-k masks from tiles all-reduced over the group: no cross-rank compare); its ``begin_step`` (absent: none) starts a forward: the core's AttentionProblems are built once
# per forward (agreed across ranks at the first layer) and reused by every layer and recompute. Dynamic SP
# (--dynamic-context-parallel) steps pass the pack's DynamicPlan as cu_seqlens (dynamic.make_dynamic_core).
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[int]], torch.Tensor]

PACK_FLAG = "--pack-samples"


def local_core(q, k, v, kv_valid_len=None, cu_seqlens=None, block_mask=None, block_size=None):
    """Single-device attention (no sequence parallelism) with key padding; with ``cu_seqlens`` (packed
    samples, B=1) each sample attends only within itself (one SDPA per sample); with ``block_mask`` /
    ``block_size`` block-sparse (``sparse.reference_sparse_attention``, the reference of the SP modes' masks)."""
    if block_mask is not None:
        if cu_seqlens is not None:
            raise SPConfigError(f"{PACK_FLAG} cannot run {SPARSE_FLAG} tiles (one block mask per sequence)")
        return reference_sparse_attention(q, k, v, block_mask, block_size, kv_valid_len)
    if cu_seqlens is not None:
        if kv_valid_len is not None:
            raise SPConfigError("packed samples (cu_seqlens) carry no padding: kv_valid_len must be None")
        cu = [int(c) for c in cu_seqlens.tolist()]
        outs = [local_core(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in zip(cu, cu[1:]) if b > a]
        return torch.cat(outs, dim=1)
    mask = None
    if kv_valid_len is not None and kv_valid_len < k.shape[1]:
        mask = torch.zeros(k.shape[1], dtype=torch.bool, device=q.device)
        mask[:kv_valid_len] = True
    o = kernels.torch_sdpa().call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask)
    return o.transpose(1, 2)


def patchify(latent: torch.Tensor, patch: tuple) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, N, C*pt*ph*pw] in (frame, row, column) token order."""
    b, c, t, h, w = latent.shape
    pt, ph, pw = patch
    x = latent.view(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, (t // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, patch: tuple, channels: int, grid: tuple) -> torch.Tensor:
    """Inverse of ``patchify``: [B, N, C*pt*ph*pw] -> [B, C, T, H, W]."""
    b = tokens.shape[0]
    pt, ph, pw = patch
    tn, hn, wn = grid
    x = tokens.view(b, tn, hn, wn, channels, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, channels, tn * pt, hn * ph, wn * pw)


def unpatchify_packed(tokens: torch.Tensor, patch: tuple, channels: int, cu_seqlens: Sequence[int],
                      grids: Sequence[tuple]) -> list:
    """A packed sequence [1, N_total, C*pt*ph*pw] (full, global order) -> one [C, T, H, W] per sample."""
    cu = [int(c) for c in cu_seqlens]
    return [unpatchify(tokens[:, a:b], patch, channels, tuple(g))[0] for a, b, g in zip(cu, cu[1:], grids)]


def per_token(values: torch.Tensor, pack: Optional[PackInfo]) -> torch.Tensor:
    """Per-sample rows [B, k] -> what broadcasts over the tokens: [B, 1, k] (one sample per batch row), or
    with ``pack`` each local token's sample's row, [1, S_local, k]."""
    if pack is None:
        return values[:, None]
    return values.index_select(0, pack.sample_of_token)[None]


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled by 1000), [B] -> [B, dim] float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class StepProblems:
    """The attention-layer forms' AttentionProblem of one forward, per key padding, shared by the model's blocks
    (set_async_attention / set_layer_policy): built at a forward's first layer (agreed across the SP group there:
    one collective), reused by the other layers and by a checkpoint's recompute (it travels as an argument).
    ``begin()`` starts a forward (the model's forward calls it on every rank); before the first, one per call."""

    def __init__(self) -> None:
        self.memo: Optional[dict] = None

    def begin(self) -> None:
        self.memo = {}

    def get(self, kv_valid_len: Optional[int]) -> AttentionProblem:
        if self.memo is None:
            return AttentionProblem(kv_valid_len=kv_valid_len)
        if kv_valid_len not in self.memo:
            self.memo[kv_valid_len] = AttentionProblem(kv_valid_len=kv_valid_len)
        return self.memo[kv_valid_len]


class SelfAttention(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads, self.hd = cfg.heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.norm_q, self.norm_k = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.core: AttentionCore = local_core
        # (group, LayerChoice) runs that block form; (group, LayerPolicy) lets the policy pick per shape
        self.sp_layer = None
        self.rope_memo: dict = {}  # the all-gather block's global RoPE table (shared by the model's blocks)
        self.layer_problems = StepProblems()  # the block forms' problem per forward (shared by the model's blocks)
        self.recompute_core = False  # activation checkpointing of the attention core (selective core_attn)
        self.ops = ElementwiseOps()  # eager; VideoDiT.set_fused_elementwise shares one compiled set
        self.packed_qkv = False  # write q|k|v in the core's send layout when it has a packed entry (set_packed_qkv)
        # --sparse-topk: the VSA gate of the coarse branch, Linear(dim, dim) per token, head and channel; zero
        # at init (VideoDiT.set_sparse_attention), so a model starts as its fine block-sparse attention alone
        self.sparse_gate: Optional[nn.Linear] = None

    def _params(self):
        return (self.qkv.weight, self.qkv.bias, self.out.weight, self.out.bias, self.norm_q.weight,
                self.norm_k.weight)

    def _run(self, choice, group, x, angles, problem: AttentionProblem, params):
        """The block in form ``choice`` (megatron_sp_ext LayerChoice) with explicit parameters, on ``problem``
        (agreed over ``group`` for x's shape: ``_agreed_problem``)."""
        from megatron_sp_ext.sp.layers.call import LayerRun, LayerWeights  # noqa: PLC0415
        b, s, _ = x.shape
        w_qkv, b_qkv, w_o, b_o, nq, nk = params
        run = LayerRun(head_chunks=choice.head_chunks, transport=choice.transport)
        if choice.allgather:
            return self._run_allgather(group, x, angles, problem, LayerWeights(w_qkv, w_o, b_qkv, b_o, nq, nk), run)
        if choice.async_qkv:
            from megatron_sp_ext.sp.layers.async_qkv import async_ulysses_self_attention  # noqa: PLC0415

            def prep(branch, y, w):  # QK-norm (weight w) + RoPE at global positions, per branch
                eps = (self.norm_q if branch == "q" else self.norm_k).eps
                return apply_rope(rms_norm(y, w, eps).view(b, s, self.heads, self.hd), angles)
            return async_ulysses_self_attention(x, LayerWeights(w_qkv, w_o, b_qkv, b_o, nq, nk), group, problem,
                                                num_heads=self.heads, num_kv_heads=self.heads, prep=prep, run=run)
        from megatron_sp_ext.sp.ulysses import ulysses_attention  # noqa: PLC0415
        q, k, v = F.linear(x, w_qkv, b_qkv).chunk(3, dim=-1)
        q, k = rms_norm(q, nq, self.norm_q.eps), rms_norm(k, nk, self.norm_k.eps)
        q, k, v = (t.reshape(b, s, self.heads, self.hd) for t in (q, k, v))
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        # q, k, v follow from the agreed x by the same projection on every rank: agreed by construction
        o = ulysses_attention(q, k, v, group, problem.cached(("qkv",), problem.inner), head_chunks=choice.head_chunks,
                              transport=choice.transport)
        return F.linear(o.reshape(b, s, -1), w_o, b_o)

    def _agreed_problem(self, group, x, kv_valid_len) -> AttentionProblem:
        """This forward's problem of the block forms (``layer_problems``), agreed across ``group`` for x's shape
        (the layers' checks folded in) before anything else runs over the group: the first layer of a forward runs
        the one collective, the others none; a rank whose shard differs raises with every other rank (before the
        layer policy could time a shape only some ranks have seen)."""
        from megatron_sp_ext.sp.layers.call import LayerRun, agree_layer, check_layer  # noqa: PLC0415
        problem = self.layer_problems.get(kv_valid_len)
        what = "the DiT's self-attention layer"
        agree_layer(what, problem, x, (group,), lambda: check_layer(what, problem, x, self.heads, self.heads,
                                                                    LayerRun(), group.size()))
        return problem

    def _run_allgather(self, group, x, angles, problem: AttentionProblem, weights, run):
        """The all-gather QKV block: this rank's heads over the whole sequence (QK-norm over all heads via
        a cross-rank sum of squares, RoPE at every gathered token's global position)."""
        from megatron_sp_ext.sp.layers.allgather import allgather_self_attention  # noqa: PLC0415
        width, hd = self.heads * self.hd, self.hd

        def prep(branch, y, w, shard):
            y4 = y.view(y.shape[0], y.shape[1], -1, hd)
            eps = (self.norm_q if branch == "q" else self.norm_k).eps
            r = torch.rsqrt(shard.sum_sq(y4, branch) / width + eps)
            y4 = (y4.float() * r * shard.norm_weight(w, branch, hd).float()).to(y.dtype)
            return apply_rope(y4, self._global_angles(angles, shard))
        return allgather_self_attention(x, weights, group, problem, num_heads=self.heads, num_kv_heads=self.heads,
                                        prep=prep, run=run)

    def _global_angles(self, angles, shard):
        """RoPE angles of the gathered sequence; gathered once per forward (the model's blocks share the memo)."""
        memo = self.rope_memo
        if memo.get("local") is not angles:
            memo["local"], memo["full"] = angles, shard.gather_tokens(angles)
        return memo["full"]

    def _calibration_step(self, choice, group, x, angles, problem: AttentionProblem):
        """One fwd(+bwd) of ``choice`` on detached copies: the model's .grad stays untouched."""
        params = [p.detach().requires_grad_(p.requires_grad) for p in self._params()]
        xs = x.detach().requires_grad_(x.requires_grad)
        y = self._run(choice, group, xs, angles, problem, params)
        if torch.is_grad_enabled() and y.requires_grad:
            y.backward(torch.ones_like(y))

    def _sparse_attend(self, q, k, v, x, kv_valid_len, step: SparseStep):
        """--sparse-attention tiles: block-sparse attention of this rank's q, k, v [B, S_local, H, D] (tile order)
        over the window mask, or VSA: each sample's top-k key tiles per query tile and head (from the pooled tiles
        of the whole sequence) plus the gated coarse branch (gate = ``sparse_gate(x)``, x the block's input)."""
        b, s = q.shape[:2]
        block = step.spec.block_size

        def fine(qs, ks, vs, mask, agreed=False):
            kw = {"mask_agreed": True} if agreed and getattr(self.core, "takes_agreed_masks", False) else {}
            run = functools.partial(self.core, block_mask=mask, block_size=block, **kw)
            if self.recompute_core and torch.is_grad_enabled():
                return checkpoint(run, qs, ks, vs, kv_valid_len, use_reentrant=False)
            return run(qs, ks, vs, kv_valid_len)
        if step.window_mask is not None:
            return fine(q, k, v, step.window_mask)
        q_tiles, k_tiles, v_tiles = (pool_tiles(t, step.tile_index, step.num_tiles, step.group, step.run)
                                     for t in (q, k, v))
        outs = []
        for i in range(b):  # a block mask is one sample's (its own top-k), agreed: every rank's top-k of the same
            # all-reduced tiles (no cross-rank compare per layer)
            mask = pad_tile_mask(topk_tile_mask(q_tiles[i], k_tiles[i], step.spec.topk), step.num_padded_tiles)
            outs.append(fine(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask, agreed=step.group is not None))
        gate = self.sparse_gate(x).view(b, s, self.heads, self.hd)
        fine_out = outs[0] if b == 1 else torch.cat(outs)   # no copy of the one sample's output
        return fine_out + gated_spread(gate, coarse_tiles(q_tiles, k_tiles, v_tiles), step.tile_index, step.run)

    def forward(self, x, angles, kv_valid_len, cu_seqlens=None, sparse: Optional[SparseStep] = None):
        b, s, _ = x.shape
        self.check_path(cu_seqlens, sparse)
        if self.sp_layer is not None:
            group, how = self.sp_layer
            choice = how
            problem = self._agreed_problem(group, x, kv_valid_len)
            if hasattr(how, "form_for"):  # a LayerPolicy
                key = (tuple(x.shape), x.dtype, kv_valid_len, torch.is_grad_enabled())
                choice = how.form_for(key, lambda ch: self._calibration_step(ch, group, x, angles, problem),
                                      group, x.device, self.heads // group.size())
            if self.recompute_core and torch.is_grad_enabled():  # the fused block forms: recompute the whole block
                return checkpoint(self._run, choice, group, x, angles, problem, self._params(), use_reentrant=False)
            return self._run(choice, group, x, angles, problem, self._params())
        layout = self.packed_layout(x)
        parts = self.project(x, angles, layout, sparse)
        return self.out(self.attend(parts, layout, kv_valid_len, cu_seqlens, sparse).reshape(b, s, -1))

    def check_path(self, cu_seqlens=None, sparse: Optional[SparseStep] = None) -> None:
        """Refuse (SPConfigError, naming the flags) a step the configured path cannot run."""
        if sparse is not None and (self.sp_layer is not None or self.packed_qkv or cu_seqlens is not None):
            raise SPConfigError(f"{SPARSE_FLAG} tiles runs the plain self-attention path: use --sp-async-qkv off, "
                                f"--ulysses-packed-qkv off or auto, and no {PACK_FLAG}")
        if cu_seqlens is not None and self.sp_layer is not None:
            raise SPConfigError(f"{PACK_FLAG}: the async / all-gather self-attention block forms (--sp-async-qkv) "
                                f"take no packed samples; use --sp-async-qkv off")
        if cu_seqlens is not None and self.packed_qkv:
            raise SPConfigError(f"{PACK_FLAG}: the packed q|k|v path (--ulysses-packed-qkv on) takes no packed "
                                f"samples; use --ulysses-packed-qkv off or auto")

    def packed_layout(self, x: torch.Tensor):
        """The packed exchange's HeadLayout for the block input ``x`` [B, S, d] when q|k|v go straight into its
        send layout (``set_packed_qkv`` and a core with a packed entry), else None (the plain q, k, v path)."""
        packed = getattr(self.core, "packed", None) if self.packed_qkv else None
        if packed is None:
            return None
        b, s, _ = x.shape
        dev = x.device.type  # q's dtype: the QKV projection's output (autocast's, else its weight's)
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.qkv.weight.dtype
        return packed.layout(self.heads, self.heads, x.new_empty((), dtype=dtype).expand(b, s, self.heads, self.hd))

    def project(self, x: torch.Tensor, angles: torch.Tensor, layout=None,
                sparse: Optional[SparseStep] = None) -> tuple:
        """Everything of the plain path before the attention core: the QKV projection, QK-norm and RoPE of
        ``x`` [B, S_local, d]. Returns the core's inputs: (q, k, v) [B, S_local, H, D]; with ``layout`` (the
        packed exchange) its send buffers (q|k|v per HCMS chunk); a top-k sparse step adds ``x`` (its gate's
        input)."""
        b, s, _ = x.shape
        y = self.qkv(x)
        if layout is not None:  # q|k|v straight into the exchange's send layout (see megatron_sp_ext.sp.ulysses.packed)
            return tuple(self.ops.qkv_pack(layout)(y, self.norm_q.weight, self.norm_k.weight, self.norm_q.eps,
                                                   self.norm_k.eps, angles, self.heads))
        q, k, v = y.chunk(3, dim=-1)
        q = self.ops.qk_prep(q, self.norm_q.weight, self.norm_q.eps, angles, self.heads)
        k = self.ops.qk_prep(k, self.norm_k.weight, self.norm_k.eps, angles, self.heads)
        v = v.reshape(b, s, self.heads, self.hd)
        return (q, k, v, x) if sparse is not None and sparse.spec.topk is not None else (q, k, v)

    def attend(self, parts: tuple, layout, kv_valid_len, cu_seqlens=None,
               sparse: Optional[SparseStep] = None) -> torch.Tensor:
        """The attention core on ``project``'s output (same ``layout`` and ``sparse``) -> out [B, S_local, H, D]
        (the packed exchange: [B, S_local, H*D]); with selective core_attn under activation checkpointing."""
        if layout is not None:
            problem_for = getattr(self.core, "problem_for", None)   # the forward's problem: agreed once
            run = functools.partial(self.core.packed, self.heads, self.heads,
                                    kv_valid_len if problem_for is None else problem_for(kv_valid_len))
            if self.recompute_core and torch.is_grad_enabled():
                return checkpoint(run, *parts, use_reentrant=False)
            return run(*parts)
        if sparse is not None:
            q, k, v = parts[:3]
            return self._sparse_attend(q, k, v, parts[3] if len(parts) > 3 else None, kv_valid_len, sparse)
        q, k, v = parts
        core = self.core if cu_seqlens is None else functools.partial(self.core, cu_seqlens=cu_seqlens)
        if self.recompute_core and torch.is_grad_enabled():
            return checkpoint(core, q, k, v, kv_valid_len, use_reentrant=False)
        return core(q, k, v, kv_valid_len)


class CrossAttention(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads, self.hd = cfg.heads, cfg.head_dim
        self.q, self.kv = nn.Linear(cfg.dim, cfg.dim), nn.Linear(cfg.dim, 2 * cfg.dim)
        self.norm_q, self.norm_k = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.ops = ElementwiseOps()

    def forward(self, x, ctx, pack: Optional[PackInfo] = None):
        """x [B, S, d] to ctx [B, L, d]; with ``pack`` (B=1) the tokens of sample i attend only to its text
        ctx[:, cu_text[i]:cu_text[i+1]] (block-diagonal: one SDPA per sample)."""
        b, s, _ = x.shape
        q = self.ops.rms_norm(self.q(x), self.norm_q.weight, self.norm_q.eps).view(b, s, self.heads, self.hd)
        q = q.transpose(1, 2)
        k, v = self.kv(ctx).chunk(2, dim=-1)
        k = self.norm_k(k).view(b, -1, self.heads, self.hd).transpose(1, 2)
        v = v.reshape(b, -1, self.heads, self.hd).transpose(1, 2)
        sdpa = kernels.torch_sdpa().call   # torch's SDPA dispatch, through the kernel registry
        if pack is None:
            o = sdpa(q, k, v)
        else:
            o = torch.cat([sdpa(q[:, :, a:e], k[:, :, c:d], v[:, :, c:d])
                           for (a, e), (c, d) in zip(pack.local_ranges(), pack.text_ranges()) if e > a], dim=2)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.attn = SelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=True)
        self.cross = CrossAttention(cfg)
        self.norm3 = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn, cfg.dim))
        # AdaLN-zero: the modulation starts at zero, so the gated self-attention and FFN add nothing at init (the
        # cross-attention is ungated, as in Wan; config.MODULATIONS)
        self.linear_modulation = cfg.modulation == "linear"
        if self.linear_modulation:
            self.modulation = nn.Linear(cfg.dim, 6 * cfg.dim)
            nn.init.zeros_(self.modulation.weight)
            nn.init.zeros_(self.modulation.bias)
        else:  # "wan": VideoDiT.time_proj's output plus this table ([6d]: 1-D, so exempt from weight decay where
            # biases are, as Megatron's optimizer does)
            self.scale_shift_table = nn.Parameter(torch.zeros(6 * cfg.dim))
        self.recompute_block = False  # --recompute-granularity full: keep only the block's input
        self.recompute_mlp = False    # selective mlp: recompute the FFN (its [S, ffn] activations)
        # selective outside_core_attn: recompute all of the block but the self-attention core (which keeps q, k, v,
        # its output and log-sum-exp): two checkpoint regions, before and after the core
        self.recompute_outside_core = False
        self.cpu_offload = False  # --cpu-offloading: the saved tensors outside recomputed regions wait on the host
        self.ops = ElementwiseOps()

    def forward(self, x, t_emb, ctx, angles, kv_valid_len, pack: Optional[PackInfo] = None, cu=None,
                sparse: Optional[SparseStep] = None):
        """x [B, S_local, d]; t_emb: the step's timestep input, [B, 6d] (modulation "wan": the shared time
        projection) or [B, d] ("linear": the time embedding); ctx [B, L, d] text."""
        if self.cpu_offload and torch.is_grad_enabled():
            with torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda):
                return self._dispatch(x, t_emb, ctx, angles, kv_valid_len, pack, cu, sparse)
        return self._dispatch(x, t_emb, ctx, angles, kv_valid_len, pack, cu, sparse)

    def _dispatch(self, x, t_emb, ctx, angles, kv_valid_len, pack=None, cu=None, sparse=None):
        if self.recompute_block and torch.is_grad_enabled():
            return checkpoint(self._forward, x, t_emb, ctx, angles, kv_valid_len, pack, cu, sparse,
                              use_reentrant=False)
        if self.recompute_outside_core and torch.is_grad_enabled():
            return self._forward_keep_core(x, t_emb, ctx, angles, kv_valid_len, pack, cu, sparse)
        return self._forward(x, t_emb, ctx, angles, kv_valid_len, pack, cu, sparse)

    def modulation_rows(self, t_emb: torch.Tensor) -> torch.Tensor:
        """The block's AdaLN rows [B, 6d] in t_emb's dtype: "linear": its Linear of SiLU(t_emb [B, d]); "wan": the
        shared projection t_emb [B, 6d] plus the block's table, summed in fp32 or wider (config.MODULATIONS)."""
        if self.linear_modulation:
            return self.modulation(F.silu(t_emb))
        acc = torch.promote_types(t_emb.dtype, torch.float32)   # fp32 at least (fp64 stays fp64)
        return (t_emb.to(acc) + self.scale_shift_table.to(acc)).to(t_emb.dtype)

    def _modulations(self, mod: torch.Tensor, pack: Optional[PackInfo]) -> tuple:
        """The six AdaLN chunks (shift, scale, gate of the attention; of the FFN) of ``mod`` [B, 6d]."""
        if pack is None:
            return mod[:, None].chunk(6, dim=-1)
        # each chunk expanded on its own: the shifts' [S, d] copies are freed after use, not saved
        return tuple(per_token(m, pack) for m in mod.chunk(6, dim=-1))

    def _before_core(self, x, mod, angles, layout, pack, sparse):
        """Selective outside_core_attn, region 1 (recomputed in the backward): AdaLN, the QKV projection, QK-norm
        and RoPE -> the attention core's inputs."""
        sh1, sc1, _, _, _, _ = self._modulations(mod, pack)
        y = self.ops.ln_modulate(x, sc1, sh1, self.norm1.eps, linear_input_dtype(x))
        parts = self.attn.project(y, angles, layout, sparse)
        if layout is None and getattr(self.attn.core, "group", None) is None:
            # one rank: the core keeps v itself, a view of the QKV projection's whole [S, 3d] output; its own
            # copy keeps [S, d] (an exchange at SP > 1 copies it anyway)
            parts = (parts[0], parts[1], parts[2].contiguous(), *parts[3:])
        return parts

    def _after_core(self, x, mod, o, ctx, pack):
        """Region 2 (recomputed in the backward): the output projection and gated residual, the cross-attention
        and the FFN, from the block input ``x`` and the core's output ``o``."""
        ops, act = self.ops, linear_input_dtype(x)
        _, _, g1, sh2, sc2, g2 = self._modulations(mod, pack)
        b, s, _ = x.shape
        x = ops.gated_residual(x, g1, self.attn.out(o.reshape(b, s, -1)))
        x = x + self.cross(ops.layer_norm(x, self.norm2.weight, self.norm2.bias, self.norm2.eps, act), ctx, pack)
        h = ops.ln_modulate(x, sc2, sh2, self.norm3.eps, act)
        return ops.gated_residual(x, g2, self.ffn(h))

    def _forward_keep_core(self, x, t_emb, ctx, angles, kv_valid_len, pack=None, cu=None, sparse=None):
        """The block with everything but the self-attention core recomputed in the backward: the core's inputs
        (q, k, v) and its own saved tensors (output, log-sum-exp) are kept, so the backward reruns norms,
        modulation, projections, cross-attention and FFN, never the attention kernel. The modulation [B, 6d] is
        computed once outside both regions (same gradient summation as without recompute: bit-identical)."""
        if self.attn.sp_layer is not None:
            raise SPConfigError("--recompute-modules outside_core_attn splits the block around the attention core: "
                                "the fused async / all-gather block forms (--sp-async-qkv on / allgather / auto) have "
                                "no such split; use --sp-async-qkv off, or --recompute-modules core_attn")
        self.attn.check_path(cu, sparse)
        mod = self.modulation_rows(t_emb)
        layout = self.attn.packed_layout(x)
        parts = checkpoint(self._before_core, x, mod, angles, layout, pack, sparse, use_reentrant=False)
        o = self.attn.attend(parts, layout, kv_valid_len, cu, sparse)
        return checkpoint(self._after_core, x, mod, o, ctx, pack, use_reentrant=False)

    def _forward(self, x, t_emb, ctx, angles, kv_valid_len, pack=None, cu=None, sparse=None):
        """pack: a packed step's PackInfo (per-token modulation, block-diagonal cross-attention); cu: its
        cu_seqlens tensor for the self-attention core; sparse: a sparse step's SparseStep (block-sparse
        self-attention, --sparse-attention tiles; the cross-attention stays dense)."""
        ops = self.ops
        act = linear_input_dtype(x)  # the norms' outputs feed Linears: their autocast cast happens in the region
        mod = self.modulation_rows(t_emb)
        sh1, sc1, g1, sh2, sc2, g2 = self._modulations(mod, pack)
        y = ops.ln_modulate(x, sc1, sh1, self.norm1.eps, act)
        if sparse is not None:
            x = ops.gated_residual(x, g1, self.attn(y, angles, kv_valid_len, sparse=sparse))
        else:
            x = ops.gated_residual(x, g1, self.attn(y, angles, kv_valid_len) if cu is None else
                                   self.attn(y, angles, kv_valid_len, cu))
        x = x + self.cross(ops.layer_norm(x, self.norm2.weight, self.norm2.bias, self.norm2.eps, act), ctx, pack)
        h = ops.ln_modulate(x, sc2, sh2, self.norm3.eps, act)
        if self.recompute_mlp and torch.is_grad_enabled():
            return ops.gated_residual(x, g2, checkpoint(self.ffn, h, use_reentrant=False))
        return ops.gated_residual(x, g2, self.ffn(h))


class VideoDiT(nn.Module):
    """The ``set_*`` methods are the steps of ``parallel.parallelize`` (the entries' one call; its handle's
    ``remove()`` undoes them); tests call them one at a time.

    forward(patches [B, S_local, C*pt*ph*pw], t [B], text [B, L, text_dim], token_ids [S_local],
    grid (T', H', W'), kv_valid_len) -> velocity per patch [B, S_local, C*pt*ph*pw].

    Packed (``pack=PackInfo``): patches [1, S_local, P] of N samples, t [N], text [1, sum L_i, text_dim],
    token_ids = each local token's position in its own sample, grid ignored (``pack.grids``)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.patch_volume, cfg.dim)
        self.text_embed = nn.Sequential(nn.Linear(cfg.text_dim, cfg.dim), nn.GELU(approximate="tanh"),
                                        nn.Linear(cfg.dim, cfg.dim))
        self.time_embed = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        if cfg.modulation == "linear":  # config.MODULATIONS
            self.mod_out = nn.Linear(cfg.dim, 2 * cfg.dim)
            nn.init.zeros_(self.mod_out.weight)
            nn.init.zeros_(self.mod_out.bias)
        else:  # "wan": one projection for every block (each adds its table); the head adds its table to t_emb
            self.time_proj = nn.Linear(cfg.dim, 6 * cfg.dim)
            nn.init.zeros_(self.time_proj.weight)  # AdaLN-zero with the blocks' zero tables
            nn.init.zeros_(self.time_proj.bias)
            self.scale_shift_table = nn.Parameter(torch.zeros(2 * cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm_out = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(cfg.dim, cfg.patch_volume)
        self.rope_cache = RopeCache()
        self.ops = ElementwiseOps()
        self.sparse: Optional[SparseSpec] = None  # --sparse-attention tiles (set_sparse_attention)
        self.sparse_cache = SparseStepCache()  # the forward's SparseStep, built once per shape (not per step)

    def set_sparse_attention(self, spec: Optional[SparseSpec]) -> None:
        """--sparse-attention tiles (``spec``; None: dense, the default). The caller feeds tokens in tile order
        (``engine.flow_matching_batch(tile=...)``, sharded contiguously: neighbouring tiles on one rank) with their
        row-major ids as ``token_ids`` (RoPE unchanged per token). With top-k (VSA) every block gets the coarse
        branch's gate, Linear(dim, dim) (per token, head and channel, as VSA's gate_compress), zero-initialised so
        the model starts as its fine block-sparse attention; call before building the optimizer (new parameters)."""
        self.sparse = spec
        param = next(self.parameters())
        for blk in self.blocks:
            gate = None
            if spec is not None and spec.topk is not None:
                gate = nn.Linear(self.cfg.dim, self.cfg.dim, device=param.device, dtype=param.dtype)
                nn.init.zeros_(gate.weight)
                nn.init.zeros_(gate.bias)
            blk.attn.sparse_gate = gate

    def set_recompute(self, granularity: Optional[str], modules=("core_attn",),
                      num_layers: Optional[int] = None) -> None:
        """Activation checkpointing (Megatron-LM's --recompute-granularity / --recompute-modules /
        --recompute-num-layers): 'full' recomputes whole blocks in the backward; 'selective' recomputes only
        ``modules``: 'core_attn' (the attention core; with the fused async/all-gather block forms the whole
        self-attention block) and/or 'mlp' (the FFN), or 'outside_core_attn' alone (ours: everything of the block
        but the self-attention core, whose inputs q, k, v and its output and log-sum-exp are kept: the backward
        never reruns the attention kernel). Either applies to the first ``num_layers`` blocks (default all; the
        others keep every activation, as without recompute: Megatron-LM's block method for full, ours for
        selective, where Megatron-LM recomputes every layer). None: off."""
        if granularity not in (None, "full", "selective"):
            raise ValueError(f"--recompute-granularity={granularity!r}: use full or selective")
        bad = [m for m in modules if m not in RECOMPUTE_MODULES]
        if bad:
            raise ValueError(f"--recompute-modules {bad}: valid are {', '.join(RECOMPUTE_MODULES)}")
        if KEEP_CORE_MODULE in modules and len(set(modules)) > 1:
            raise ValueError(f"--recompute-modules {' '.join(modules)}: {KEEP_CORE_MODULE} already recomputes the "
                             f"FFN and keeps the attention core; give it alone")
        n = len(self.blocks) if num_layers is None else num_layers
        if not 0 <= n <= len(self.blocks):
            raise ValueError(f"--recompute-num-layers={num_layers}: the model has {len(self.blocks)} layers")
        for i, blk in enumerate(self.blocks):
            selective = granularity == "selective" and i < n
            blk.recompute_block = granularity == "full" and i < n
            blk.recompute_mlp = selective and "mlp" in modules
            blk.attn.recompute_core = selective and "core_attn" in modules
            blk.recompute_outside_core = selective and KEEP_CORE_MODULE in modules
            if blk.recompute_block and blk.cpu_offload:
                raise ValueError(f"--cpu-offloading with --recompute-granularity full (block {i}): the blocks keep "
                                 f"only their inputs, held by the checkpoint, so nothing is left to offload; use "
                                 f"--recompute-granularity selective --recompute-modules {KEEP_CORE_MODULE}")

    def set_cpu_offloading(self, on: bool, num_layers: Optional[int] = None) -> None:
        """Activation offloading (Megatron-LM's --cpu-offloading / --cpu-offloading-num-layers): the tensors the
        first ``num_layers`` blocks (default all) save for the backward, outside their recomputed regions, wait in
        pinned host memory (``torch.autograd.graph.save_on_cpu``) and come back in the backward. With
        outside_core_attn that is the attention core's q, k, v, output and log-sum-exp; the recomputed regions'
        inputs (block input, core output) stay on the GPU. Not with full recompute (call after set_recompute)."""
        n = len(self.blocks) if num_layers is None else num_layers
        if not 0 <= n <= len(self.blocks):
            raise ValueError(f"--cpu-offloading-num-layers={num_layers}: the model has {len(self.blocks)} layers")
        for i, blk in enumerate(self.blocks):
            blk.cpu_offload = bool(on) and i < n
            if blk.cpu_offload and blk.recompute_block:
                raise ValueError(f"--cpu-offloading with --recompute-granularity full (block {i}): the blocks keep "
                                 f"only their inputs, held by the checkpoint, so nothing is left to offload; use "
                                 f"--recompute-granularity selective --recompute-modules {KEEP_CORE_MODULE}")

    def set_fused_elementwise(self, backend: Optional[str]) -> None:
        """Fuse the blocks' elementwise regions with ``torch.compile(backend=...)`` (None: eager; see fused.py).
        One shared set of compiled regions serves every block (compiled once per shape)."""
        ops = ElementwiseOps(backend)
        self.ops = ops
        for blk in self.blocks:
            blk.ops = blk.attn.ops = blk.cross.ops = ops

    def set_packed_qkv(self, on: bool) -> None:
        """Let every block write q|k|v in the attention core's send layout when the core has a packed entry
        (``engine.core_of``'s Ulysses / HCMS, any chunk count or auto; heads divisible by the SP size); other
        cores and sizes keep the plain path. Same math as the plain path."""
        for blk in self.blocks:
            blk.attn.packed_qkv = on

    def set_attention_core(self, core: AttentionCore) -> None:
        """Install the sequence-parallel attention used by every block."""
        for blk in self.blocks:
            blk.attn.core = core

    def set_async_attention(self, group, head_chunks: int = 1, transport: str = "nccl",
                            allgather: bool = False) -> None:
        """Use the async Ulysses block (projections overlapped with their exchanges) in every block, or
        with ``allgather`` the all-gather QKV block (sequence all-gather fused with the QKV GEMM)."""
        from megatron_sp_ext.sp.layers.policy import LayerChoice  # noqa: PLC0415
        memo: dict = {}
        problems = StepProblems()
        for blk in self.blocks:
            blk.attn.sp_layer = (group, LayerChoice(not allgather, head_chunks, transport, allgather))
            blk.attn.rope_memo, blk.attn.layer_problems = memo, problems

    def set_layer_policy(self, group, policy=None) -> None:
        """Let one runtime policy pick plain/async/allgather, HCMS chunks and transport per shape (all blocks
        share the policy, so a shape is calibrated once)."""
        from megatron_sp_ext.sp.layers.policy import LayerPolicy  # noqa: PLC0415
        policy = policy or LayerPolicy()
        memo: dict = {}
        problems = StepProblems()
        for blk in self.blocks:
            blk.attn.sp_layer = (group, policy)
            blk.attn.rope_memo, blk.attn.layer_problems = memo, problems
        self.layer_policy = policy

    def forward(self, patches, t, text, token_ids, grid, kv_valid_len=None, pack: Optional[PackInfo] = None):
        begin = getattr(self.blocks[0].attn.core, "begin_step", None) if len(self.blocks) else None
        if begin is not None:   # the attention problems of this forward: built once, at its first layer
            begin()
        for problems in {id(b.attn.layer_problems): b.attn.layer_problems for b in self.blocks}.values():
            problems.begin()   # the block forms' problems too (shared by set_async_attention / set_layer_policy)
        x = self.patch_embed(patches)
        t_emb = self.time_embed(timestep_embedding(t, self.cfg.freq_dim).to(x.dtype))
        t_blocks = t_emb if self.cfg.modulation == "linear" else self.time_proj(F.silu(t_emb))
        ctx = self.text_embed(text)
        if pack is None and self.sparse is not None:
            angles = self.rope_cache.get(token_ids, grid, self.cfg.head_dim, x.device)
            step = self.sparse_cache.get(self.sparse, token_ids, grid,
                                         getattr(self.blocks[0].attn.core, "group", None), x.device)
            for blk in self.blocks:
                x = blk(x, t_blocks, ctx, angles, kv_valid_len, sparse=step)
        elif pack is None:
            angles = self.rope_cache.get(token_ids, grid, self.cfg.head_dim, x.device)
            for blk in self.blocks:
                x = blk(x, t_blocks, ctx, angles, kv_valid_len)
        else:
            if self.sparse is not None:
                raise SPConfigError(f"{PACK_FLAG} cannot run {SPARSE_FLAG} tiles (one block mask per sequence)")
            if patches.shape[0] != 1 or kv_valid_len is not None:
                raise SPConfigError(f"{PACK_FLAG}: a packed step is one sequence (B=1) without padding; got "
                                    f"B={patches.shape[0]}, kv_valid_len={kv_valid_len}")
            angles = self.rope_cache.get_packed(token_ids, pack.local_lens, pack.grids, self.cfg.head_dim, x.device)
            cu = pack.cu_tensor() if pack.dynamic is None else pack.dynamic  # dynamic SP: the core takes the plan
            for blk in self.blocks:
                x = blk(x, t_blocks, ctx, angles, None, pack, cu)
        shift, scale = per_token(self.head_modulation(t_emb), pack).chunk(2, dim=-1)
        return self.head(self.ops.ln_modulate(x, scale, shift, self.norm_out.eps))

    def head_modulation(self, t_emb: torch.Tensor) -> torch.Tensor:
        """The head's shift | scale [B, 2d] from the time embedding t_emb [B, d] (config.MODULATIONS): "wan" adds
        the head's table to t_emb itself (summed in fp32 or wider, t_emb's dtype), "linear" runs its Linear on
        SiLU(t_emb)."""
        if self.cfg.modulation == "linear":
            return self.mod_out(F.silu(t_emb))
        acc = torch.promote_types(t_emb.dtype, torch.float32)   # fp32 at least (fp64 stays fp64)
        return (t_emb.to(acc).repeat(1, 2) + self.scale_shift_table.to(acc)).to(t_emb.dtype)

    def modulation_parameters(self) -> list:
        """(name, parameter) of every AdaLN-zero modulation parameter (config.MODULATIONS; all zero at init, so the
        gated branches add nothing): tests and benchmarks give them random values so every block reaches the loss."""
        keys = ("modulation.", "mod_out.", "time_proj.", "scale_shift_table")
        return [(n, p) for n, p in self.named_parameters() if any(k in n for k in keys)]
