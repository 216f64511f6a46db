"""The attention problem: what the attention computes, built once by the caller and passed to every mode.

``AttentionProblem`` is the argument every sequence-parallel mode takes beside this rank's q, k, v shards
(``ulysses_attention(q, k, v, group, problem)``, ``ring_attention``, ``hybrid_attention``, ``torus_attention``,
``make_attention(...)(q, k, v, problem)``): causal, the token ``placement``, key padding (``kv_valid_len``), packed
samples (``cu_seqlens``), the block mask and its ``tile``, dropout, the softmax scale and the shards' ``layout``.
A caller builds it once per step or per batch (the video DiT's forward, Megatron's ``packed_seq_params``, the
diffusers processor's plan) and hands the same object to every layer; the keyword forms
(``ulysses_attention(q, k, v, group, causal=True)``) build one per call (``problem_from_keywords``).

Validation happens once per problem: ``bind`` checks the call's tensors against the problem on this rank, and the
FIRST ``bind`` of a problem object runs the cross-rank agreement: ONE small all_gather (every rank's dtype, q/k
shapes, causal, placement, padding, packed samples, a checksum of the block mask) that every rank reaches
whatever it has seen before (a problem object is new on every rank at the same point of the same program), so a
rank whose shard differs gets the same SPConfigError as the others instead of a hang. Later binds of the same
problem compare their tensors with what was agreed on this rank alone (no collective). ``ranks_agree=True`` is
the caller's statement that every rank built the same problem and shards by construction: no collective at all.
``with_mask`` derives a problem that differs in its block mask only (a top-k mask per layer): the shapes' agreement
is inherited, and a mask declared agreed costs no collective.

``BoundProblem`` is one call's problem after ``bind``: the immutable value an algorithm runs (world, rank, shard
sizes, the resolved backend and scale, the mask on the call's device). The layout helpers: q/k/v arrive as
[B, S_loc, H, D] ("bshd") or [S_loc, B, H, D] ("sbhd"); the kernels run [B, H, S, D] (``to_bhsd`` / ``from_bhsd``)
and the torus stages [B, S, H, D] (``to_bshd``, its own inverse); ``seq_batch`` reads (S_loc, B) off a shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from .. import modes
from ..attention import block_sparse
from ..attention.backends import AutoBackend, LocalAttention, MathBackend, get_backend
from ..attention.varlen import SETTINGS as VARLEN_SETTINGS
from ..comm.capability import check_p2p, needs_p2p
from ..errors import SPConfigError
from ..config import DEFAULT_PLACEMENT, LAYOUTS, SEQ_PLACEMENTS
from .checks import agree_across_ranks, check_inputs, check_ring_inputs, packed_cu, valid_kv_len
from .placement import PackedSamples, pieces, varlen_pieces

VARIANTS = modes.names(ring_variant=True)   # the ring variants (the mode registry: ring, tasp)
_MODES = {m.name: m for m in modes.MODES}    # name -> Mode, a dict lookup per call

# Every refused pair of settings: (the setting, the one it cannot be combined with, what to do instead, whether a
# backend that holds its own positions (a hybrid mesh's sparse ring) lifts the refusal). The message reads
# "<setting> cannot be combined with <other> (<function>): <advice>".
COMBINATIONS = (
    ("block_mask", "cu_seqlens", "leave cu_seqlens at None, or block_mask=None", False),
    ("block_mask", "dropout_p", "leave dropout_p at 0.0, or block_mask=None", False),
    ("block_mask", "seq_order", "leave seq_order at None, or block_mask=None", True),
    ("kv_valid_len", "cu_seqlens", "give each sample's real length in cu_seqlens (samples are padded, and their "
                                   "padding kept apart, per sample)", False),
    ("seq_order", "cu_seqlens", "leave seq_order at None (packed samples set their own order)", False),
)
# what a mode may not support, by the registry flag that says it does: (keyword, flag)
CAPABILITIES = (("cu_seqlens", "packed"), ("block_mask", "block_mask"), ("dropout_p", "dropout"))


def seq_batch(shape: "torch.Size | tuple", layout: str) -> tuple[int, int]:
    """(S_loc, B) of a q/k/v shape in ``layout``."""
    return (shape[1], shape[0]) if layout == "bshd" else (shape[0], shape[1])


def to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, S, H, D] ("bshd") or [S, B, H, D] ("sbhd") -> the kernels' [B, H, S, D] (a view)."""
    return x.transpose(1, 2) if layout == "bshd" else x.permute(1, 2, 0, 3)


def from_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The kernels' [B, H, S, D] -> ``layout`` (a view); inverse of ``to_bhsd``."""
    return x.transpose(1, 2) if layout == "bshd" else x.permute(2, 0, 1, 3)


def to_bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``layout`` <-> [B, S, H, D] (a view; its own inverse)."""
    return x.transpose(0, 1) if layout == "sbhd" else x


class BoundProblem(NamedTuple):
    """What one call computes, validated (``AttentionProblem.bind``): q/k/v of ``batch`` x ``s_loc`` tokens per rank of ``world``
    in ``layout``, sequence order ``placement``; ``causal`` AND keys < ``kv_valid_len`` (None: no padding) AND within
    each packed sample (``packed``) AND the selected tiles of ``block_mask`` ([H or 1, T, T] over ``mask_seq_len``
    tokens, the caller's checked object: its identity keys the plan caches; ``mask_on`` moves it), softmax ``scale``,
    ``dropout_p``; the local ``backend`` resolved. Immutable; a NamedTuple because it is built on every call (a
    frozen dataclass's __init__ measured ~6x slower: host time is what short attention calls are bound by)."""

    what: str
    mode: modes.Mode
    layout: str
    world: int
    rank: int
    batch: int
    s_loc: int
    causal: bool
    scale: float
    backend: LocalAttention
    placement: str
    kv_valid_len: Optional[int]
    packed: Optional[PackedSamples]
    block_mask: Optional[torch.Tensor]
    block_size: int
    mask_seq_len: int
    dropout_p: float
    varlen_kernel: str
    seq_order: object
    source: "AttentionProblem"   # the caller's problem: derived data (slices, skip plans) is cached on it

    @property
    def seqlen(self) -> int:
        """Tokens of the full (padded) sequence over the group."""
        return self.s_loc * self.world

    @property
    def segments(self) -> Optional[tuple]:
        """The packed samples' segment boundaries (``PackedSamples.segments``), or None."""
        return None if self.packed is None else self.packed.segments

    @property
    def own_positions(self) -> bool:
        """Whether the backend is a sparse ring that holds its own positions (a hybrid mesh's inner ring)."""
        return isinstance(self.backend, block_sparse.BlockSparseBackend)

    def runs(self, rank: int) -> tuple:
        """Global (start, len) runs rank ``rank`` holds: the placement's pieces, per sample with packed samples."""
        if self.packed is None:
            return tuple(pieces(self.placement, rank, self.world, self.seqlen))
        return tuple(varlen_pieces(self.placement, rank, self.world, self.packed.layout))

    def mask_on(self, device: torch.device) -> Optional[torch.Tensor]:
        """The block mask on ``device`` (None without one; moved once per problem and device)."""
        return self.source.mask_on(device)

    def to_kernel(self, *xs: torch.Tensor) -> tuple:
        """Each of ``xs`` in ``layout`` -> [B, H, S, D]."""
        return tuple(to_bhsd(x, self.layout) for x in xs)

    def from_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, S, D] -> ``layout``."""
        return from_bhsd(x, self.layout)


def refuse(what: str, given: dict, own: bool, mode: modes.Mode) -> None:
    """The one table of refusals: unsupported combinations (``COMBINATIONS``), then what ``mode`` does not support
    (``CAPABILITIES``, read from the registry)."""
    for name, other, advice, lifted_by_own in COMBINATIONS:
        if given[name] and given[other] and not (lifted_by_own and own):
            raise SPConfigError(f"{name} cannot be combined with {other} ({what}): {advice}")
    for name, flag in CAPABILITIES:
        if given[name] and not getattr(mode, flag):
            able = modes.listing(modes.names(**{flag: True}))
            raise SPConfigError(f"{name} is not supported by {what} (mode {mode.name!r}): modes that take it: {able}; "
                                f"or leave {name} unset")



# the keywords that describe the problem (AttentionProblem's fields) and their old spellings
PROBLEM_KEYWORDS = ("causal", "softmax_scale", "layout", "placement", "kv_valid_len", "cu_seqlens", "block_mask",
                    "tile", "dropout_p", "ranks_agree", "seq_order")
ALIASES = {"block_size": "tile"}   # the old name of ``tile``, still taken by the keyword forms


@dataclass(frozen=True, eq=False)
class AttentionProblem:
    """What the attention computes, independent of the tensors (see module docstring): built once by the caller
    (per step, per batch) and passed with q, k, v to every mode. Immutable; compared by identity.

    causal: key position <= query position (global token order). softmax_scale: None is 1/sqrt(head_dim).
    layout: "bshd" ([B, S_loc, H, D]) or "sbhd" ([S_loc, B, H, D]) of the shards. placement: which tokens each
    rank holds ("contiguous", "zigzag", "tasp_zigzag"; ``shard_sequence`` with the same word makes them).
    kv_valid_len: keys at global positions >= it are padding (1..S; None: none). cu_seqlens: packed samples (B=1):
    1-D int [n + 1] cumulative lengths over the full sequence, or a ``PackedSamples``. block_mask: bool
    [H or 1, T, T] tiles over the full sequence in global order, T = ceil(S / tile). tile: tokens per mask tile.
    dropout_p: attention dropout (Ulysses family). ranks_agree: the caller states that every rank built the same
    problem and equal shards (no cross-rank collective). seq_order: an explicit order of the gathered sequence
    (advanced: a hybrid mesh's inner call)."""

    causal: bool = False
    softmax_scale: Optional[float] = None
    layout: str = "bshd"
    placement: str = DEFAULT_PLACEMENT
    kv_valid_len: Optional[int] = None
    cu_seqlens: "torch.Tensor | PackedSamples | None" = None
    block_mask: Optional[torch.Tensor] = None
    tile: int = block_sparse.DEFAULT_TILE_SIZE
    dropout_p: float = 0.0
    ranks_agree: bool = False
    seq_order: object = None
    state: dict = field(default_factory=dict, init=False, repr=False)   # agreements, device masks, derived plans

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise SPConfigError(f"layout={self.layout!r} is invalid: choose one of {', '.join(LAYOUTS)}")
        if self.placement not in SEQ_PLACEMENTS:
            raise SPConfigError(f"placement={self.placement!r} is invalid: choose one of {', '.join(SEQ_PLACEMENTS)}")
        d = self.dropout_p
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d < 1.0:
            raise SPConfigError(f"dropout_p={d!r} is invalid: use a probability in [0, 1)")
        if isinstance(self.tile, bool) or not isinstance(self.tile, int) or self.tile < 1:
            raise SPConfigError(f"tile={self.tile!r} (block_size={self.tile!r}) is invalid: use a positive integer "
                                f"(default {block_sparse.DEFAULT_TILE_SIZE})")
        if isinstance(self.block_mask, torch.Tensor):   # derived data is cached on the problem: the mask is frozen
            self.state["mask_version"] = self.block_mask._version
        n = self.kv_valid_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
            raise SPConfigError(f"kv_valid_len={n!r} is invalid: use an int in 1..S (the full sequence length) or "
                                f"None (no padding)")

    def with_mask(self, block_mask: Optional[torch.Tensor], *, tile: Optional[int] = None,
                  agreed: bool = False) -> "AttentionProblem":
        """This problem with another block mask (e.g. a layer's own top-k mask; ``tile``: its tile size, default
        this problem's): the agreement of the shapes made by this problem carries over; ``agreed=True`` states the
        mask is the same on every rank by construction (built from data all ranks share), so binding it runs no
        collective."""
        child = replace(self, block_mask=block_mask, tile=self.tile if tile is None else tile)
        child.state["inherit"] = (self, agreed)
        return child

    def inner(self, **changes) -> "AttentionProblem":
        """This problem, with ``changes``, for a call inside a mode over a subgroup of the group it was agreed
        over (a mesh's Ulysses group): agreed by construction."""
        return replace(self, ranks_agree=True, **changes)

    def mask_on(self, device: torch.device) -> Optional[torch.Tensor]:
        """The block mask on ``device``, moved once per problem and device (None without one)."""
        if self.block_mask is None:
            return None
        masks = self.state.setdefault("masks", {})
        key = str(device)
        if key not in masks:
            masks[key] = self.block_mask.to(device)
        return masks[key]

    def cached(self, key: tuple, build: Callable[[], object]) -> object:
        """What ``build()`` returns, once per problem and ``key`` (the mask's full-sequence slices, a ring's skip
        plan): derived data lives as long as the problem, so nothing is keyed on tensor ids across steps."""
        cache = self.state.setdefault("cache", {})
        if key not in cache:
            cache[key] = build()
        return cache[key]

    def bind(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup], *,
             what: str, mode: str, backend: "str | LocalAttention" = "auto", variant: Optional[tuple] = None,
             p2p: tuple = (), varlen_kernel: str = "per_sample") -> BoundProblem:
        """This problem for the call ``what`` (mode ``mode``) of q [B, S_loc, H, D] / k, v [B, S_loc, Hkv, D] (in
        ``layout``) over ``group``: every local check, and on the first bind of this problem over ``group`` the
        cross-rank agreement (one all_gather every rank reaches; see module docstring). Raises SPConfigError naming
        the keyword (and ``what``) on every rank of the group when any rank's input is refused."""
        world = dist.get_world_size(group) if group is not None else 1
        try:
            bound = _local_bind(self, q, k, v, group, what=what, mode=mode, backend=backend, variant=variant,
                                p2p=p2p, varlen_kernel=varlen_kernel)
            error = None
        except SPConfigError as e:
            bound, error = None, e
        if world > 1:
            self.agree(group, q, k, v, what=what, error=error)
        elif error is not None:
            raise error
        return bound

    def agree(self, group: dist.ProcessGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, what: str,
              error: Optional[SPConfigError] = None) -> None:
        """The cross-rank agreement of this problem and the call's tensors over ``group``: on the first call over
        ``group`` (of this problem, or of the problem whose agreement covers it) one all_gather every rank reaches
        (``checks.agree_across_ranks``); later calls compare the tensors with the agreed ones on this rank only.
        ``error``: this rank's refusal of its input, raised on every rank after the collective. Tensors of any
        shape (a packed q|k|v buffer passes itself three times)."""
        owner = self._agreement_owner()
        # the mask is compared when the problem binds itself with its own mask (not a child's declared-agreed or
        # absent one); an agreement that covered the shapes only (a child bound first) does not cover it
        with_mask = owner is self and self.block_mask is not None
        if owner is not None and owner._first_over(group, q, k, v, with_mask):
            agree_across_ranks(self, q, k, v, group, what, error, with_mask=owner is self)
            owner._record(group, _tensors_key(q, k, v), with_mask)
        if error is not None:
            raise error

    def _agreement_owner(self) -> Optional["AttentionProblem"]:
        """The problem whose agreement covers this one (None: declared agreed, no collective): itself, or for a
        ``with_mask`` child whose mask is declared agreed (or absent) the parent it was derived from."""
        if self.ranks_agree:
            return None
        parent = self.state.get("inherit")
        if parent is not None and (parent[1] or self.block_mask is None):
            return parent[0]._agreement_owner()
        return self

    def _first_over(self, group, q, k, v, with_mask: bool) -> bool:
        """Whether the collective runs for this bind over ``group``: the first bind over ``group``, or the first that
        needs this problem's own mask compared (``with_mask``) after an agreement that covered the shapes only (a
        ``with_mask(agreed=True)`` child bound first). Every rank decides alike: the same program binds the same
        problems in the same order. Later binds compare their tensors with the agreed ones on this rank
        (SPConfigError if they differ: a problem is agreed for one set of shapes)."""
        for g, key, masked in self.state.get("agreed", ()):
            if g is group:
                if key != _tensors_key(q, k, v):
                    raise SPConfigError(f"this AttentionProblem was agreed across ranks for q/k/v shapes {key[0]} "
                                        f"({key[1]}); this call has {_tensors_key(q, k, v)[0]}: build a new "
                                        f"AttentionProblem for other shapes (on every rank at the same point). Ranks whose shapes did "
                                        f"not change go on into the exchange and wait for this one: torchrun ends "
                                        f"them; without a launcher they wait for the process group's timeout")
                return with_mask and not masked
        return True

    def _record(self, group, key: tuple, with_mask: bool) -> None:
        """Record an agreement over ``group`` of the tensors ``key`` (and of this problem's mask: ``with_mask``)."""
        agreed = self.state.setdefault("agreed", [])
        for i, (g, _, masked) in enumerate(agreed):
            if g is group:
                agreed[i] = (g, key, masked or with_mask)
                return
        agreed.append((group, key, with_mask))


def _tensors_key(q, k, v) -> tuple:
    """What an agreement covers of the call's tensors: shapes, dtype, device type."""
    return ((tuple(q.shape), tuple(k.shape), tuple(v.shape)), q.dtype, q.device.type)


def problem_from_keywords(what: str, problem: Optional[AttentionProblem], keywords: dict,
                          options: tuple = ()) -> tuple[AttentionProblem, dict]:
    """The keyword forms' adapter: (the problem, the remaining keywords) of a call of ``what`` that got either
    ``problem`` or the problem's keywords (``PROBLEM_KEYWORDS``; ``block_size`` for ``tile``); ``options``: the
    other keywords ``what`` takes. Raises SPConfigError naming an unknown keyword, or problem keywords given beside
    a problem."""
    fields, rest = {}, {}
    for name, value in keywords.items():
        key = ALIASES.get(name, name)
        if key in PROBLEM_KEYWORDS:
            if key in fields:
                raise SPConfigError(f"{what}: tile and block_size name the same setting: give one of them")
            fields[key] = value
        elif name in options:
            rest[name] = value
        else:
            raise SPConfigError(f"{what}() got an unknown keyword {name!r}: the problem's keywords are "
                                f"{', '.join(PROBLEM_KEYWORDS)}; the call's options {', '.join(options) or 'none'}")
    if problem is None:
        return AttentionProblem(**fields), rest
    if not isinstance(problem, AttentionProblem):
        raise SPConfigError(f"{what}: problem must be an AttentionProblem; got {type(problem).__name__}")
    if fields:
        raise SPConfigError(f"{what}: give the problem's settings ({', '.join(fields)}) in the AttentionProblem or "
                            f"as keywords, not both")
    return problem, rest


def _local_bind(pb: AttentionProblem, q, k, v, group, *, what: str, mode: str, backend, variant, p2p,
                varlen_kernel: str) -> BoundProblem:
    """Every check of one call that needs no other rank; the BoundProblem."""
    if variant is not None and variant[1] not in VARIANTS:
        raise SPConfigError(f"{variant[0]}={variant[1]!r} is invalid: choose one of {', '.join(VARIANTS)}")
    m = _MODES[mode]
    if varlen_kernel not in VARLEN_SETTINGS:
        raise SPConfigError(f"varlen_kernel={varlen_kernel!r} is invalid: choose one of {', '.join(VARLEN_SETTINGS)}")
    hops = variant[1] if variant is not None else mode
    for g in p2p:
        if g is not None and needs_p2p(hops, dist.get_world_size(g)):
            check_p2p(what if variant is None else f"{what}({variant[0]}={variant[1]!r})", g, q.device,
                      "ulysses_attention")
    (check_ring_inputs if m.p2p else check_inputs)(q, k, v, pb.layout)
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    s_loc, batch = seq_batch(q.shape, pb.layout)
    seqlen = s_loc * world
    be = get_backend(backend)
    own = isinstance(be, block_sparse.BlockSparseBackend)
    kv_valid_len = valid_kv_len(pb.kv_valid_len, seqlen)
    given = {"block_mask": pb.block_mask is not None, "cu_seqlens": pb.cu_seqlens is not None,
             "dropout_p": pb.dropout_p != 0.0, "seq_order": pb.seq_order is not None,
             "kv_valid_len": kv_valid_len is not None}
    refuse(what, given, own, m)
    mask_seq_len = be.seq_len if own else seqlen
    block_mask = None
    if pb.block_mask is not None:
        if getattr(pb.block_mask, "_version", None) != pb.state.get("mask_version"):
            raise SPConfigError(f"block_mask was changed in place after its AttentionProblem was built ({what}): a "
                                f"problem and what is derived from it are fixed; build a new problem (or "
                                f"problem.with_mask(new_mask)) for another mask")
        if m.local_attention and not (own or isinstance(be, (AutoBackend, MathBackend))):
            # a mode that runs a caller's local attention inside: a block mask would bypass it
            raise SPConfigError(f"block_mask runs megatron_sp_ext's block-sparse kernels (math, flex_attention), not "
                                f"backend={getattr(be, 'name', be)!r}: use backend 'auto', 'sdpa', 'math' (or a "
                                f"fixed fused kernel's name), or block_mask=None")
        block_sparse.check_tile_mask(pb.block_mask, seq_len=mask_seq_len, block_size=pb.tile, num_heads=q.shape[2])
        block_mask = pb.mask_on(q.device)
    packed = None
    if pb.cu_seqlens is not None:
        packed = pb.cached(("packed", batch, seqlen, pb.placement, world),
                           lambda: packed_cu(pb.cu_seqlens, batch, seqlen, pb.placement, world))
    scale = pb.softmax_scale if pb.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return BoundProblem(what, m, pb.layout, world, rank, batch, s_loc, pb.causal, scale, be, pb.placement,
                        kv_valid_len, packed, block_mask, pb.tile, mask_seq_len, float(pb.dropout_p), varlen_kernel,
                        pb.seq_order, pb)
