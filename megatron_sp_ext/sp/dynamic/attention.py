"""Attention of a dynamic-SP pack: each sample on its own aligned sub-group, with the configured mode.

``DynamicAttention(cfg, groups, num_heads=H)(q, k, v, problems)`` takes this rank's rows (B=1, [1, S_loc, H, D] for
layout "bshd", [S_loc, 1, H, D] for "sbhd") in the plan's local order (``DynamicPlan.pieces``) and returns the
output in the same rows. Samples on one rank run the local kernel (no exchange; all of them in one varlen call);
the samples of a sub-group of d > 1 ranks run in one call of the factory's attention for ``cfg.mode`` over that
sub-group (``make_attention``, cu_seqlens of those samples: the library pads each to a multiple of d, as the plan's
rows are). Sub-groups run in ``plan.groups()`` order on every rank. With ``tile_masks`` (one per sample, over the
sample's own tokens, or None) each sample runs on its own with its mask (block-sparse kernels). ``problems``:
the pack's ``PackProblems`` (``attention.problems(plan, causal=...)``, built once per pack and step and passed to
every layer: each sub-group's problem is agreed across its ranks once per step), or the plan itself with causal /
softmax_scale as keywords (one PackProblems per call).

Modes: ulysses, hcms, ring, tasp, usp and auto (resolved per sub-group size); tas and torus place Ulysses across
machines, which a sub-group inside one machine does not span: refused by name.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from ...attention.backends import get_backend
from ...attention.block_sparse import DEFAULT_TILE_SIZE, block_sparse_attention
from ... import modes
from ...config import DYNAMIC_MODES, SPConfig
from ...errors import SPConfigError
from ..factory import SPAttention, SPResources, make_attention
from ..ulysses.attend import local_attention
from .groups import DynamicGroups
from .plan import DynamicPlan
from .problems import PackProblems



def check_dynamic_mode(cfg: SPConfig) -> None:
    """Refuse modes that cannot run on a sub-group, naming the mode setting and the dynamic one (SPConfig's check)."""
    dataclasses.replace(cfg, dynamic=True)


class DynamicAttention:
    """Per-sample sub-group attention of one model (see the module docstring). backend: local kernel (default
    ``cfg.backend``); resources: shared with the sub-groups' attentions."""

    def __init__(self, cfg: SPConfig, groups: DynamicGroups, *, num_heads: int, num_kv_heads: Optional[int] = None,
                 layout: str = "bshd", backend=None, resources: Optional[SPResources] = None) -> None:
        check_dynamic_mode(cfg)
        self.cfg, self.groups, self.layout = cfg, groups, layout
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads or num_heads
        self.backend = backend if backend is not None else cfg.backend
        self.local = get_backend(self.backend, cfg.name("backend"))
        self.res = resources or SPResources(cfg)
        self.attns: dict[tuple[int, int], SPAttention] = {}
        self.seq_dim = 1 if layout == "bshd" else 0

    def sub_attention(self, start: int, size: int) -> SPAttention:
        """The factory's attention over sub-group (start, size) (mesh settings scaled to the sub-group)."""
        key = (start, size)
        if key not in self.attns:
            cfg = dataclasses.replace(self.cfg, dynamic=False)  # one sub-group: a plain SP attention
            if modes.get(cfg.mode).mesh and size < self.groups.world:   # the mesh scaled to the sub-group
                cfg = dataclasses.replace(
                    cfg, ulysses_size=math.gcd(cfg.ulysses_size, size) if cfg.ulysses_size else None,
                    nodes=max(1, cfg.nodes * size // self.groups.world) if cfg.nodes else None)
            self.attns[key] = make_attention(cfg, self.groups.get(start, size), num_heads=self.num_heads,
                                             num_kv_heads=self.num_kv_heads, layout=self.layout,
                                             placement="contiguous", backend=self.backend, resources=self.res)
        return self.attns[key]

    def _local(self, q, k, v, lengths, causal, scale):
        """Whole samples on this rank: one varlen call of the local kernel (bhsd inside)."""
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        bhsd = (lambda t: t.permute(1, 2, 0, 3)) if self.seq_dim == 0 else (lambda t: t.transpose(1, 2))
        o = local_attention(self.local, bhsd(q), bhsd(k), bhsd(v), causal, scale, None, 0.0,
                            tuple(cu) if len(lengths) > 1 else None, "auto")
        return o.permute(2, 0, 1, 3) if self.seq_dim == 0 else o.transpose(1, 2)

    def _masked(self, q, k, v, problems: PackProblems, i, mask, block_size, scale):
        """Sample i alone with its block mask: the local block-sparse kernel, or its sub-group's attention."""
        plan = problems.plan
        if plan.sizes[i] == 1:
            bhsd = (lambda t: t.permute(1, 2, 0, 3)) if self.seq_dim == 0 else (lambda t: t.transpose(1, 2))
            o = block_sparse_attention(bhsd(q), bhsd(k), bhsd(v), mask, block_size=block_size,
                                       causal=problems.causal, softmax_scale=scale)
            return o.permute(2, 0, 1, 3) if self.seq_dim == 0 else o.transpose(1, 2)
        return self.sub_attention(plan.starts[i], plan.sizes[i])(q, k, v, problems.sample(i, mask, block_size, scale))

    def problems(self, plan: DynamicPlan, *, causal: bool = False,
                 softmax_scale: Optional[float] = None) -> PackProblems:
        """The pack's problems (``PackProblems``): build once per pack and step on every rank and pass to every
        layer's call in place of the plan."""
        return PackProblems(plan, causal, softmax_scale,
                            lambda start, size, **kw: self.sub_attention(start, size).problem(**kw))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problems: "PackProblems | DynamicPlan", *,
                 causal: Optional[bool] = None, softmax_scale: Optional[float] = None,
                 tile_masks: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 block_size: int = DEFAULT_TILE_SIZE) -> torch.Tensor:
        """q: this rank's rows ([1, S_loc, H, D] / [S_loc, 1, H, D]); k, v: Hkv heads; problems: the pack's
        ``PackProblems`` (``problems(plan, causal=, softmax_scale=)``), or the pack's plan (the same on every rank)
        with causal (default False) / softmax_scale as keywords. tile_masks: per sample, bool [H or 1, T_i, T_i]
        over its own tokens (T_i = ceil(n_i / block_size)), or None for dense. Returns the output rows."""
        if isinstance(problems, DynamicPlan):
            problems = self.problems(problems, causal=bool(causal), softmax_scale=softmax_scale)
        elif not isinstance(problems, PackProblems):
            raise SPConfigError(f"dynamic SP: pass the pack's PackProblems (attention.problems(plan, ...)) or its "
                                f"DynamicPlan; got {type(problems).__name__}")
        elif causal is not None or softmax_scale is not None:
            raise SPConfigError("dynamic SP: give causal / softmax_scale in attention.problems(plan, ...) or as "
                                "keywords beside the plan, not both")
        plan, causal, softmax_scale = problems.plan, problems.causal, problems.softmax_scale
        if plan.world != self.groups.world:
            raise SPConfigError(f"dynamic SP: the plan is for {plan.world} ranks, the SP group has "
                                f"{self.groups.world}")
        rank, sd = self.groups.rank, self.seq_dim
        pieces = plan.pieces(rank)
        rows = sum(r for _, _, r in pieces)
        if q.shape[sd] != rows:
            raise SPConfigError(f"dynamic SP: rank {rank} holds {q.shape[sd]} rows, its plan places {rows}")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        offset, at = {}, 0
        for i, _, r in pieces:
            offset[i], at = (at, r), at + r

        def rows_of(t, ids):
            """The rows of samples ``ids``: one view when they are adjacent in this order (a sub-group holding
            every sample of the rank: the whole tensor), else a copy."""
            first, total = offset[ids[0]][0], sum(offset[i][1] for i in ids)
            if all(offset[a][0] + offset[a][1] == offset[b][0] for a, b in zip(ids, ids[1:])):
                return t if (first, total) == (0, t.shape[sd]) else t.narrow(sd, first, total)
            return torch.cat([t.narrow(sd, *offset[i]) for i in ids], dim=sd)
        outs: dict[int, torch.Tensor] = {}
        whole: list = []   # the output of a call that covered every row of this rank in order (no reassembly)

        def keep(ids, o):
            if [i for i, _, _ in pieces] == list(ids) and o.shape[sd] == q.shape[sd]:
                whole.append(o)
            at = 0
            for i in ids:
                outs[i] = o.narrow(sd, at, offset[i][1])
                at += offset[i][1]
        masked = tile_masks is not None and any(m is not None for m in tile_masks)
        for start, size in plan.groups():  # one global order on every rank
            if not start <= rank < start + size:
                continue
            ids = [i for i, _, _ in pieces if (plan.starts[i], plan.sizes[i]) == (start, size)]
            if masked:
                for i in ids:
                    t = [x.narrow(sd, *offset[i]) for x in (q, k, v)]
                    if tile_masks[i] is not None:
                        keep([i], self._masked(*t, problems, i, tile_masks[i], block_size, scale))
                    elif size == 1:
                        keep([i], self._local(*t, [plan.lengths[i]], causal, scale))
                    else:
                        keep([i], self.sub_attention(start, size)(*t, problems.sample(i, None, block_size, scale)))
                continue
            qs, ks, vs = (rows_of(x, ids) for x in (q, k, v))
            if size == 1:
                keep(ids, self._local(qs, ks, vs, [plan.lengths[i] for i in ids], causal, scale))
            else:
                keep(ids, self.sub_attention(start, size)(qs, ks, vs, problems.group(start, size, tuple(ids), scale)))
        if whole:
            return whole[0]
        order = [outs[i] for i, _, _ in pieces]
        return order[0] if len(order) == 1 else torch.cat(order, dim=sd)
