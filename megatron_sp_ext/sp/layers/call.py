"""One attention-layer call's arguments beside its input and its ``AttentionProblem``, and the checks every layer
form makes before its first collective.

    y = async_ulysses_self_attention(x, LayerWeights(w_qkv, w_o, b_qkv, b_o), group, problem,
                                     num_heads=H, num_kv_heads=Hkv, prep=prep, run=LayerRun(head_chunks=2))

``LayerWeights``: the layer's parameters (nn.Linear layout) and the QK-norm weights handed to ``prep``.
``LayerRun``: how the call runs, not what it computes (HCMS chunks, local kernel, communication stream,
transport, fused symm_mem matmuls, reduce-scatter pieces): every choice gives the same math (to fp rounding).
``layer_call`` is the keyword forms' adapter: ``causal=True`` and the other ``AttentionProblem`` settings build one
problem per call, ``head_chunks=2`` and the other ``LayerRun`` settings one LayerRun. ``agree_layer`` runs a
layer's local checks (``check_layer``) and, on the first call of a problem over a group, the problem's cross-rank
agreement on the layer input's shape (``AttentionProblem.agree``: one collective every rank reaches, whatever it
has seen before), so a refusal on any rank is raised on every rank instead of leaving the others in an exchange.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ...attention.backends import LocalAttention, get_backend
from ...errors import SPConfigError
from ..checks import valid_kv_len
from ..heads import head_layout
from ..problem import AttentionProblem, problem_from_keywords


@dataclass(frozen=True)
class LayerWeights:
    """A self-attention layer's parameters: w_qkv [(H + 2 Hkv) D, dim] (rows q, then k, then v), b_qkv
    [(H + 2 Hkv) D] or None, w_o [dim, H D], b_o [dim] or None (nn.Linear layout); norm_q / norm_k: the QK-norm
    weights handed to the layer's ``prep`` (its gradients flow back to them; None: prep gets None)."""

    w_qkv: torch.Tensor
    w_o: torch.Tensor
    b_qkv: Optional[torch.Tensor] = None
    b_o: Optional[torch.Tensor] = None
    norm_q: Optional[torch.Tensor] = None
    norm_k: Optional[torch.Tensor] = None

    def head_dim(self, num_heads: int) -> int:
        """D, read off w_o's [dim, H D] columns."""
        return self.w_o.shape[1] // num_heads

    def tensors(self) -> tuple:
        """(w_qkv, b_qkv, w_o, b_o, norm_q, norm_k): the layer Function's parameter inputs, in its order."""
        return self.w_qkv, self.b_qkv, self.w_o, self.b_o, self.norm_q, self.norm_k


@dataclass(frozen=True)
class LayerRun:
    """How a layer call runs (every choice computes the same math, to fp rounding). head_chunks: HCMS head chunks
    (1: plain Ulysses). backend: the local attention kernel ("auto", a kernel's name, or a ``LocalAttention``).
    comm_stream: the communication stream (None: the default pool's). transport: "nccl", "symm_mem",
    "copy_engine" or a transport object. fused: torch's fused symm_mem all-gather / reduce-scatter matmuls (the
    all-gather and TP x CP layers; None: with transport "symm_mem"). rs_pieces: token pieces of the TP x CP
    layer's pipelined reduce-scatters (None: the TP size)."""

    head_chunks: int = 1
    backend: "str | LocalAttention" = "auto"
    comm_stream: Optional["torch.cuda.Stream"] = None
    transport: "str | object" = "nccl"
    fused: Optional[bool] = None
    rs_pieces: Optional[int] = None

    def __post_init__(self) -> None:
        c = self.head_chunks
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise SPConfigError(f"head_chunks={c!r} is invalid for an attention layer: use a positive integer")
        if self.fused is not None and not isinstance(self.fused, bool):
            raise SPConfigError(f"fused={self.fused!r} is invalid: use True, False or None (follow the transport)")
        n = self.rs_pieces
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise SPConfigError(f"rs_pieces={n!r} is invalid: use a positive integer or None (the TP size)")

    def refuse(self, what: str, names: Sequence[str]) -> None:
        """SPConfigError naming the first of ``names`` that is set, which the layer ``what`` does not take."""
        for name in names:
            if getattr(self, name) is not None:
                owner = "the all-gather and TP x CP layers" if name == "fused" else "the TP x CP layer"
                raise SPConfigError(f"{name}={getattr(self, name)!r} does not apply to {what}: it is a setting of "
                                    f"{owner}; leave it unset")


RUN_KEYWORDS = tuple(f.name for f in fields(LayerRun))
# what the layers compute: the problem's settings they cannot take (the setting, what to do instead)
LAYER_REFUSALS = (
    ("cu_seqlens", "the layers take one sequence per batch row; for packed samples project q, k, v yourself and "
                   "call ulysses_attention / make_attention"),
    ("block_mask", "the layers run dense attention; for a block mask project q, k, v yourself and call "
                   "ulysses_attention / make_attention"),
    ("dropout_p", "the layers run without attention dropout; leave dropout_p at 0.0"),
    ("seq_order", "leave seq_order at None (the placement gives the order)"),
)


def layer_call(what: str, problem: Optional[AttentionProblem], run: Optional[LayerRun],
               keywords: dict) -> tuple[AttentionProblem, LayerRun]:
    """The keyword forms' adapter of the layer ``what``: (the problem, the LayerRun) from ``problem`` / ``run`` or
    their settings as ``keywords``. Raises SPConfigError naming an unknown keyword, or settings given twice (in
    the object and as keywords)."""
    given = {name: keywords.pop(name) for name in list(keywords) if name in RUN_KEYWORDS}
    if run is None:
        run = LayerRun(**given)
    elif not isinstance(run, LayerRun):
        raise SPConfigError(f"{what}: run must be a LayerRun; got {type(run).__name__}")
    elif given:
        raise SPConfigError(f"{what}: give how the layer runs ({', '.join(given)}) in the LayerRun or as keywords, "
                            f"not both")
    problem, _ = problem_from_keywords(what, problem, keywords, RUN_KEYWORDS)
    return problem, run


def check_layer(what: str, problem: AttentionProblem, x: torch.Tensor, num_heads: int, num_kv_heads: int,
                run: LayerRun, world: int, seq_local: Optional[int] = None) -> Optional[int]:
    """Every check of a layer call that needs no other rank: the problem's settings the layers take, x [B, S_local,
    dim], the heads over ``world`` ranks in ``run.head_chunks`` chunks, the backend's name, the key padding over the
    full sequence of ``seq_local`` (default x's S_local) tokens per rank. Returns the padding cut
    (``checks.valid_kv_len``). Raises SPConfigError naming the setting."""
    for name, advice in LAYER_REFUSALS:
        value = getattr(problem, name)
        if value is not None and not (name == "dropout_p" and value == 0.0):
            raise SPConfigError(f"{name} is not supported by {what}: {advice}")
    if problem.layout != "bshd":
        raise SPConfigError(f"layout={problem.layout!r} is invalid for {what}: it takes x [B, S_local, dim] "
                            f"(layout 'bshd'); build its AttentionProblem with layout='bshd'")
    if x.dim() != 3:
        raise SPConfigError(f"{what} takes x [B, S_local, dim]; got shape {tuple(x.shape)}")
    head_layout(num_heads, num_kv_heads, world, run.head_chunks)
    get_backend(run.backend)
    return valid_kv_len(problem.kv_valid_len, (seq_local or x.shape[1]) * world)


def agree_layer(what: str, problem: AttentionProblem, x: torch.Tensor, groups: Sequence[Optional[dist.ProcessGroup]],
                check: Callable[[], object]) -> object:
    """``check()`` on this rank, then the problem's agreement on x's shape over each of ``groups`` of more than one
    rank (one collective each on the problem's first call over it, none later; every rank reaches them, refusal or
    not). Returns what ``check`` returned; raises its SPConfigError (or another rank's, named) on every rank of the
    groups. Several groups (TP and CP) cover every rank a refusal must reach: a refusal seen in one group is carried
    into the next agreement."""
    try:
        result, error = check(), None
    except SPConfigError as e:
        result, error = None, e
    for g in groups:
        if g is None or dist.get_world_size(g) == 1:
            continue
        try:
            problem.agree(g, x, x, x, what=what, error=error)
        except SPConfigError as e:   # this group's refusal: carried into the next group's agreement
            error = error or e
    if error is not None:
        raise error
    return result
