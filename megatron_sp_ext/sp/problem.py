"""The attention problem of one call, described once.

``describe`` is the one builder the public functions (``ulysses_attention``, ``ring_attention``,
``hybrid_attention``, ``torus_attention``) run first: it validates every argument, refuses every unsupported
combination from ONE table (``COMBINATIONS``; what a mode cannot do is read from the mode registry, ``modes.py``:
``packed``, ``block_mask``, ``dropout``, ``p2p``, ``local_attention``), checks the block mask on this rank and
across the group (once per distinct mask through ``checks.MaskChecks``), and returns an ``AttentionProblem``: the
immutable value the algorithm then runs. Messages name the keyword and the function.

The layout helpers: q/k/v arrive as [B, S_loc, H, D] ("bshd") or [S_loc, B, H, D] ("sbhd"); the kernels run
[B, H, S, D] (``to_bhsd`` / ``from_bhsd``) and the torus stages [B, S, H, D] (``to_bshd``, its own inverse);
``seq_batch`` reads (S_loc, B) off a shape.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .. import modes
from ..attention import block_sparse
from ..attention.backends import AutoBackend, LocalAttention, MathBackend, get_backend
from ..attention.varlen import SETTINGS as VARLEN_SETTINGS
from ..comm.capability import check_p2p, needs_p2p
from ..errors import SPConfigError
from .checks import MaskChecks, check_inputs, check_mask_once, check_ring_inputs, packed_cu, valid_kv_len
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


class AttentionProblem(NamedTuple):
    """What one call computes, validated (``describe``): q/k/v of ``batch`` x ``s_loc`` tokens per rank of ``world``
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
        """The block mask on ``device`` (None without one)."""
        return None if self.block_mask is None else self.block_mask.to(device)

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


def describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup], *, what: str,
             mode: str, causal: bool, softmax_scale: Optional[float], layout: str, placement: str,
             backend: "str | LocalAttention" = "auto", kv_valid_len: Optional[int] = None,
             cu_seqlens: "torch.Tensor | PackedSamples | None" = None, block_mask: Optional[torch.Tensor] = None,
             block_size: int = block_sparse.DEFAULT_TILE_SIZE, dropout_p: float = 0.0,
             varlen_kernel: str = "per_sample", seq_order: object = None, mask_checks: Optional[MaskChecks] = None,
             variant: Optional[tuple[str, str]] = None, p2p: tuple = ()) -> AttentionProblem:
    """The ``AttentionProblem`` of a call of the public function ``what`` (mode ``mode`` of the registry) over
    ``group`` with q [B, S_loc, H, D] / k, v [B, S_loc, Hkv, D] ("bshd"; "sbhd" swaps B and S_loc), after every
    check; raises SPConfigError naming the keyword (and ``what``).

    variant: (keyword, value) of a ring-variant setting (``variant``, ``ring_variant``), checked against the registry;
    p2p: the groups whose hops run point to point (checked they can carry q's device). The inputs: ``check_ring_inputs``
    for point-to-point modes (the ring family), else ``check_inputs`` (one small all_gather per shape). Local checks
    first, then the collectives (shapes; the block mask once per distinct mask)."""
    if variant is not None and variant[1] not in VARIANTS:
        raise SPConfigError(f"{variant[0]}={variant[1]!r} is invalid: choose one of {', '.join(VARIANTS)}")
    m = _MODES[mode]
    if varlen_kernel not in VARLEN_SETTINGS:
        raise SPConfigError(f"varlen_kernel={varlen_kernel!r} is invalid: choose one of {', '.join(VARLEN_SETTINGS)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise SPConfigError(f"dropout_p={dropout_p!r} is invalid: use a probability in [0, 1)")
    hops = variant[1] if variant is not None else mode
    for g in p2p:
        if g is not None and needs_p2p(hops, dist.get_world_size(g)):
            check_p2p(what if variant is None else f"{what}({variant[0]}={variant[1]!r})", g, q.device,
                      "ulysses_attention")
    (check_ring_inputs if m.p2p else check_inputs)(q, k, v, layout, group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    s_loc, batch = seq_batch(q.shape, layout)
    seqlen = s_loc * world
    be = get_backend(backend)
    own = isinstance(be, block_sparse.BlockSparseBackend)
    kv_valid_len = valid_kv_len(kv_valid_len, seqlen)   # < 1: no key left, refused by name
    given = {"block_mask": block_mask is not None, "cu_seqlens": cu_seqlens is not None,
             "dropout_p": dropout_p != 0.0, "seq_order": seq_order is not None,
             "kv_valid_len": kv_valid_len is not None}
    refuse(what, given, own, m)
    mask_seq_len = be.seq_len if own else seqlen
    if block_mask is not None:
        if m.local_attention and not (own or isinstance(be, (AutoBackend, MathBackend))):
            # a mode that runs a caller's local attention inside: a block mask would bypass it
            raise SPConfigError(f"block_mask runs megatron_sp_ext's block-sparse kernels (math, flex_attention), not "
                                f"backend={getattr(be, 'name', be)!r}: use backend 'auto', 'sdpa', 'math' (or a "
                                f"fixed fused kernel's name), or block_mask=None")
        block_mask = block_sparse.check_tile_mask(block_mask, seq_len=mask_seq_len, block_size=block_size,
                                                   num_heads=q.shape[2])
    packed = packed_cu(cu_seqlens, batch, seqlen, placement, world)
    if block_mask is not None:   # the caller's mask object: what mask_checks keys on
        check_mask_once(block_mask, group, mask_checks)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return AttentionProblem(what, m, layout, world, rank, batch, s_loc, causal, scale, be, placement, kv_valid_len,
                            packed, block_mask, block_size, mask_seq_len, float(dropout_p), varlen_kernel, seq_order)
