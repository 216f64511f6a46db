"""The registry of sequence-parallel modes: each mode (``SPConfig.mode``, ``--cp-comm-type``) declares what it needs
and supports, and every list of modes in the library derives from here.

No mode name is compared anywhere else but in the one factory that maps a mode's ``family`` to its algorithm
(sp/factory.py); tests/test_registry.py scans. The ring-variant setting (``ring_variant``: ring, tasp) and the mesh
arrangement setting (``placement``: usp, tas; its word in code: arrangement) name modes of this registry too, and are read through it.

A mode declares (``Mode``):
  family          which algorithm runs it (sp/factory.py): "ulysses" (all-to-all, Ulysses/HCMS), "ring" (one Function
                  for ring and TASP), "hybrid" (Ulysses x Ring on a mesh), "torus", "auto" (resolved per model)
  p2p             exchanges point to point (ring hops) on a group of more than one rank (comm/capability.py)
  dropout         applies attention dropout (one plain softmax attention per head chunk; the ring family merges
                  partial results by log-sum-exp, which cannot)
  dynamic         runs on dynamic SP's aligned sub-groups (tas/torus place Ulysses across machines, which a
                  sub-group inside one machine does not span)
  mesh            runs on a 2D Ulysses x Ring mesh (topology.SPMesh)
  packed          packed variable-length samples (``cu_seqlens``)
  block_mask      block-sparse attention (``block_mask``)
  local_attention a caller's own local attention runs inside (no log-sum-exp needed: Hugging Face's attention,
                  Megatron's core attention)
  heads_per_rank  needs at least one attention head per rank
  all_to_all      its exchanges are all-to-alls: the copy-engine transports (``transport``) and the attention
                  layers that overlap projections with them (``async_qkv``) apply
  head_chunks     a fixed head-chunk count (ulysses: 1), or None: the ``head_chunks`` setting
  with_chunks     the mode a fixed-chunk mode becomes when another chunk count is set (same math)
  ring_variant    a value of the ``ring_variant`` setting (the ring inside ring and mesh modes)
  multi_ring      runs TASP's n-1 Hamiltonian rings at once (one ring otherwise)
  arrangement     a value of the mesh ``placement`` setting (the mesh arrangement: how Ulysses and ring groups lie on machines)
  ulysses_across  the mesh's Ulysses groups span machines (needs a multi-machine mesh)
  auto            resolved per model (``resolve_auto``), and on CUDA per shape by the factory's calibration
"auto"'s flags say what it accepts before it is resolved (``resolve_auto``: per model, from heads and ranks); once
resolved, the resolved mode's flags hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

FAMILIES = ("ulysses", "ring", "hybrid", "torus", "auto")


@dataclass(frozen=True)
class Mode:
    """One sequence-parallel mode (see module docstring for the fields)."""

    name: str
    family: str
    summary: str
    p2p: bool = False
    dropout: bool = False
    dynamic: bool = False
    mesh: bool = False
    packed: bool = True
    block_mask: bool = True
    local_attention: bool = False
    heads_per_rank: bool = False
    all_to_all: bool = False
    head_chunks: Optional[int] = None
    with_chunks: Optional[str] = None
    ring_variant: bool = False
    multi_ring: bool = False
    arrangement: bool = False
    ulysses_across: bool = False
    auto: bool = False

    def chunks(self, setting: "int | str") -> "int | str":
        """The head-chunk count this mode runs for the ``head_chunks`` setting ``setting``."""
        return self.head_chunks if self.head_chunks is not None else setting


_ULYSSES = dict(family="ulysses", dropout=True, dynamic=True, local_attention=True, heads_per_rank=True,
                all_to_all=True)
_RING = dict(family="ring", p2p=True, dynamic=True, ring_variant=True)

MODES = (
    Mode("ulysses", summary="all-to-all to full sequence / head shards (one head chunk)", head_chunks=1,
         with_chunks="hcms", **_ULYSSES),
    Mode("hcms", summary="Ulysses in head chunks pipelined against the all-to-alls", **_ULYSSES),
    Mode("ring", summary="ring attention: K|V blocks travel one ring", **_RING),
    Mode("tasp", summary="TASP: n-1 Hamiltonian rings at once", multi_ring=True, **_RING),
    Mode("usp", family="hybrid", summary="mesh: Ulysses inside machines, ring across", p2p=True, dynamic=True,
         mesh=True, arrangement=True),
    Mode("tas", family="hybrid", summary="mesh: Ulysses across machines, ring inside (StreamFusion)", p2p=True,
         mesh=True, arrangement=True, ulysses_across=True),
    Mode("torus", family="torus", summary="mesh: staged inter-machine all-to-all overlapped with attention", p2p=True,
         mesh=True),
    Mode("auto", family="auto", summary="hcms when every rank gets a head, else a usp mesh, else ring", dropout=True,
         dynamic=True, all_to_all=True, auto=True),
)
NAMES = tuple(m.name for m in MODES)
FLAGS = tuple(f.name for f in fields(Mode) if f.type in ("bool", bool))


def get(name: str) -> Mode:
    """The mode called ``name``; KeyError for an unknown name (settings are validated by SPConfig first)."""
    mode = find(name)
    if mode is None:
        raise KeyError(name)
    return mode


def find(name: object) -> Optional[Mode]:
    """The mode called ``name``, or None where ``name`` is no mode of this registry (Transformer Engine's CP types)."""
    return next((m for m in MODES if m.name == name), None)


def names(**flags: object) -> tuple[str, ...]:
    """Names of the modes (registry order) whose fields equal ``flags`` (e.g. ``names(dropout=True)``)."""
    for key in flags:
        if key not in FLAGS and key != "family":
            raise TypeError(f"modes.names: unknown field {key!r} (fields: family, {', '.join(FLAGS)})")
    return tuple(m.name for m in MODES if all(getattr(m, k) == v for k, v in flags.items()))


def head_chunks_of(name: str, setting: "int | str") -> "int | str":
    """The head-chunk count mode ``name`` runs for the ``head_chunks`` setting ``setting`` (``setting`` as it is for
    a name of no mode: SPConfig then refuses the name)."""
    mode = find(name)
    return setting if mode is None else mode.chunks(setting)


def listing(mode_names: tuple, last: str = "or") -> str:
    """``mode_names`` in a user's words for an error message: "ulysses, hcms or auto"."""
    if len(mode_names) < 2:
        return "".join(mode_names)
    return f"{', '.join(mode_names[:-1])} {last} {mode_names[-1]}"


def resolve_auto(num_heads: int, sp_size: int) -> str:
    """What mode "auto" runs: the head-chunked Ulysses mode when every rank gets a head, else a mesh arranged with Ulysses
    inside machines (if heads and ranks share a factor), else the one-ring mode."""
    if num_heads >= sp_size:
        return _first(family="ulysses", head_chunks=None)
    if math.gcd(num_heads, sp_size) > 1:
        return _first(arrangement=True, ulysses_across=False)
    return _first(ring_variant=True, multi_ring=False)


def _first(**flags: object) -> str:
    return next(m.name for m in MODES if all(getattr(m, k) == v for k, v in flags.items()))
