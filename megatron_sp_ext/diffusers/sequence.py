"""The sequence operations at a diffusers model's ``_cp_plan`` split and gather points: the token order of one
forward (an optional permutation of the raster token order), this rank's shard of it, and the differentiable gather.

    ctx = ForwardContext.of(grid_thw, sparse_plan, device)     # once per model forward
    x_loc = split_tokens(x, group, seq_dim, ctx)               # full [.., S, ..] in raster order -> this rank's shard
    x = gather_tokens(x_loc, group, seq_dim, ctx)              # shards -> full [.., S, ..] in raster order

``group`` None: one rank (the permutation still applies, so SP=1 runs the same token order as SP=N). The shards are
``shard_sequence``'s "contiguous" placement (``PLACEMENT``) of the permuted sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import SPConfigError
from ..sp.placement import pieces, shard_sequence, unshard_sequence
from ..sp.problem import AttentionProblem


PLACEMENT = "contiguous"   # the shards' placement: one run of rows per rank (a view of the full where asked)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` > 1, ascending (for error messages)."""
    return [d for d in range(2, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ForwardContext:
    """One model forward's token order. grid_thw: (frames, height, width) in patches; seq_len = their product;
    order: LongTensor [S] (new position i holds raster token order[i]) or None; inverse: its inverse permutation."""

    grid_thw: tuple[int, int, int]
    seq_len: int
    order: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]
    # the forward's attention problem (non-causal, "bshd", contiguous shards): built once per forward, agreed across
    # ranks at the first layer's call; each layer's block mask is derived from it (``problem.with_mask``)
    problem: AttentionProblem = field(default_factory=AttentionProblem, compare=False, repr=False)

    @classmethod
    def of(cls, grid_thw: tuple[int, int, int], sparse: Any, device: torch.device, sp_size: int) -> "ForwardContext":
        """The context of a forward on a ``grid_thw`` patch grid; ``sparse`` (a SparseAttentionPlan or None) gives
        the token order. Raises SPConfigError when the token count does not divide by ``sp_size`` or the order is
        not a permutation of the tokens."""
        seq_len = grid_thw[0] * grid_thw[1] * grid_thw[2]
        if seq_len % sp_size != 0:
            fits = ", ".join(str(d) for d in divisors(seq_len)[:8]) or "none > 1"
            raise SPConfigError(
                f"parallelize: the latent's patch grid {grid_thw[0]}x{grid_thw[1]}x{grid_thw[2]} (frames x height x "
                f"width after patch_size) has {seq_len} tokens, not divisible by the sequence-parallel size "
                f"{sp_size} (the group's ranks); use a group size that divides {seq_len} ({fits}) or a latent whose "
                f"token count is a multiple of {sp_size}")
        order = None if sparse is None else sparse.token_order(grid_thw, device)
        inverse = None
        if order is not None:
            if (not isinstance(order, torch.Tensor) or order.dtype != torch.long or order.dim() != 1
                    or order.numel() != seq_len):
                raise SPConfigError(
                    f"sparse.token_order({grid_thw}) must return None or a LongTensor [{seq_len}] (a permutation of "
                    f"the {seq_len} tokens); got {type(order).__name__} "
                    f"{getattr(order, 'dtype', '')} {list(getattr(order, 'shape', []))}")
            order = order.to(device)
            counts = torch.bincount(order.clamp(0, seq_len - 1), minlength=seq_len)
            if int(order.min()) < 0 or int(order.max()) >= seq_len or not bool((counts == 1).all()):
                raise SPConfigError(
                    f"parallelize(sparse=...): the plan's token_order({grid_thw}) is not a permutation of the "
                    f"{seq_len} tokens (values {int(order.min())}..{int(order.max())}, "
                    f"{int((counts != 1).sum())} tokens missing or repeated): it must hold each of 0..{seq_len - 1} "
                    f"exactly once")
            inverse = order.argsort()
        return cls(tuple(grid_thw), seq_len, order, inverse)


class _GatherTokens(torch.autograd.Function):
    """All-gather of the shards; backward: this rank's slice of the full gradient (every rank computes the same
    loss on the gathered output, so each rank's tokens get their gradient from the rank that holds them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, seq_dim: int) -> torch.Tensor:
        ctx.group, ctx.seq_dim = group, seq_dim
        return unshard_sequence(x, group, placement=PLACEMENT, seq_dim=seq_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return shard_sequence(grad, ctx.group, placement=PLACEMENT, seq_dim=ctx.seq_dim), None, None


def split_tokens(x: torch.Tensor, group: Optional[dist.ProcessGroup], seq_dim: int,
                 ctx: ForwardContext, *, view: bool = False) -> torch.Tensor:
    """x: full sequence along ``seq_dim`` (ctx.seq_len tokens, raster order) -> this rank's shard in the context's
    token order (differentiable: the gradient reaches x's rows of this shard).

    view: in raster order the shard is one run of x's rows; True returns it as a view of x (no copy: for a full x
    kept alive anyway, e.g. a checkpointed layer's argument), False a new tensor (x may then be freed)."""
    if x.shape[seq_dim] != ctx.seq_len:
        raise SPConfigError(f"parallelize: a tensor split along dim {seq_dim} has {x.shape[seq_dim]} tokens but this "
                            f"forward's patch grid {ctx.grid_thw} has {ctx.seq_len}")
    if ctx.order is None:
        if group is None:
            return x
        if view:
            (start, length), = pieces(PLACEMENT, dist.get_rank(group), dist.get_world_size(group), ctx.seq_len)
            return x.narrow(seq_dim, start, length)
        return shard_sequence(x, group, placement=PLACEMENT, seq_dim=seq_dim)
    # the shard of the permuted sequence, gathered straight from x: this rank's rows of the order (no full copy)
    rows = ctx.order if group is None else shard_sequence(ctx.order, group, placement=PLACEMENT, seq_dim=0)
    return x.index_select(seq_dim, rows.to(x.device))


def gather_tokens(x: torch.Tensor, group: Optional[dist.ProcessGroup], seq_dim: int,
                  ctx: ForwardContext) -> torch.Tensor:
    """This rank's shard along ``seq_dim`` -> the full sequence in raster order, on every rank (differentiable;
    backward gives this rank the gradient of its own tokens)."""
    if group is not None:
        x = _GatherTokens.apply(x, group, seq_dim)
    if ctx.order is not None:
        x = x.index_select(seq_dim, ctx.inverse.to(x.device))
    return x
