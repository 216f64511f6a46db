"""The AttentionProblems of one dynamic-SP pack, built once per pack and step.

``DynamicAttention(q, k, v, problems)`` with ``problems = attention.problems(plan, causal=..., softmax_scale=...)``:
each sub-group call gets its problem (the group's samples as ``cu_seqlens``) and each masked sample its own (its
padding as ``kv_valid_len``) the first time a layer asks, and every later layer and recompute of the step gets the
same object; so each sub-group's problem is agreed across its ranks once per step (its first layer's bind: one
collective every rank of the sub-group reaches), not once per layer. A caller builds one per pack and step on every
rank (the plan is the same on every rank) and passes it to every layer; the keyword form ``attention(q, k, v, plan,
causal=...)`` builds one per call. A per-sample block mask is a new tensor per call: it is compared across the
sub-group on each call (``AttentionProblem.with_mask``), its sample's shapes once.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..problem import AttentionProblem
from .plan import DynamicPlan


class PackProblems:
    """The problems of one pack (``plan``, the same on every rank) for one ``DynamicAttention``; built by
    ``DynamicAttention.problems``. causal / softmax_scale: every sample's (None: 1 / sqrt(head dim), which the
    attention resolves per call and passes to ``group`` / ``sample`` as the problem's scale)."""

    def __init__(self, plan: DynamicPlan, causal: bool, softmax_scale: Optional[float],
                 sub_problem: Callable[..., AttentionProblem]) -> None:
        """sub_problem(start, size, **settings): the problem of a call of sub-group (start, size)'s attention."""
        self.plan, self.causal, self.softmax_scale = plan, bool(causal), softmax_scale
        self._sub_problem = sub_problem
        self._made: dict = {}

    def _get(self, key: tuple, scale: float, **settings) -> AttentionProblem:
        key = (*key, scale)
        if key not in self._made:
            start, size = key[1], key[2]
            self._made[key] = self._sub_problem(start, size, causal=self.causal, softmax_scale=scale, **settings)
        return self._made[key]

    def group(self, start: int, size: int, ids: tuple, scale: float) -> AttentionProblem:
        """The call of sub-group (start, size) on its samples ``ids`` (their rows side by side): packed samples;
        ``scale``: the call's softmax scale (``softmax_scale`` resolved against the head dim)."""
        cu = [0]
        for i in ids:
            cu.append(cu[-1] + self.plan.lengths[i])
        return self._get(("group", start, size, ids), scale, cu_seqlens=torch.tensor(cu, dtype=torch.int32))

    def sample(self, i: int, mask: Optional[torch.Tensor], tile: int, scale: float) -> AttentionProblem:
        """Sample ``i`` alone on its sub-group (the masked path): dense as one packed sample, or with its block
        ``mask`` (tiles of ``tile`` tokens over its own tokens) with its tail padding as kv_valid_len."""
        start, size, n = self.plan.starts[i], self.plan.sizes[i], self.plan.lengths[i]
        if mask is None:
            return self._get(("sample", start, size, i), scale, cu_seqlens=torch.tensor([0, n], dtype=torch.int32))
        base = self._get(("masked", start, size, i), scale, kv_valid_len=n if n % size else None)
        return base.with_mask(mask, tile=tile)
