"""Input checks shared by every sequence-parallel algorithm (Ulysses family and ring family).

``check_same_tile_mask`` compares a block mask across the group (one all_gather and a host sync); ``MaskChecks``
runs it once per distinct mask (the algorithms take one as ``mask_checks=``; the factory passes its resources').

``check_inputs`` (Ulysses family: q, k, v of one layout, equal k/v shapes) and ``check_ring_inputs`` (ring
family: also GQA heads), both through ``check_same_dtype`` (q, k, v of one dtype), validate this rank's
tensors, then once per (group, shapes, layout, dtype) ``check_same_shape_across_ranks`` compares them across the group with one
small all_gather, so a mismatch raises SPConfigError on every rank instead of hanging an exchange.
``packed_cu`` checks the packed-sample arguments (cu_seqlens; for ``problem.describe``); ``valid_kv_len`` the
padding cut (kv_valid_len) of every mode.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..config import LAYOUTS
from ..errors import SPConfigError
from .placement import PackedSamples, packed_samples

_VALIDATED: set = set()  # (group id, shapes, layout, dtype, family) keys already compared across ranks


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise SPConfigError(f"layout={layout!r} is invalid: choose one of {', '.join(LAYOUTS)}")


def _across_ranks_once(q: torch.Tensor, k: torch.Tensor, layout: str, group, family: str) -> None:
    key = (id(group), tuple(q.shape), tuple(k.shape), layout, q.dtype, family)
    if key in _VALIDATED:
        return
    check_same_shape_across_ranks(q, group, what="sequence shard (q)")
    _VALIDATED.add(key)


def valid_kv_len(kv_valid_len: Optional[int], seqlen: int) -> Optional[int]:
    """kv_valid_len (keys at global positions >= it are padding) for a ``seqlen``-token sequence: None where it cuts
    nothing (None or >= seqlen); SPConfigError naming it where it leaves no key to attend (< 1), which would
    otherwise give all-zero outputs. The one check every mode and layer runs."""
    if kv_valid_len is None or kv_valid_len >= seqlen:
        return None
    if kv_valid_len < 1:
        raise SPConfigError(f"kv_valid_len={kv_valid_len} leaves no key to attend: use 1..{seqlen} (or None: no "
                            f"padding)")
    return int(kv_valid_len)


def check_same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v in one dtype (no algorithm upcasts one of them silently); raises SPConfigError naming each."""
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise SPConfigError(f"q, k, v dtypes differ (q: {q.dtype}, k: {k.dtype}, v: {v.dtype}): pass all three in "
                            f"one dtype (e.g. k.to(q.dtype), or one autocast region around the q/k/v projections)")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, group) -> None:
    """Ulysses-family inputs: q [B, S_loc, H, D] / k, v [B, S_loc, Hkv, D] ("bshd"; "sbhd" swaps B and S_loc),
    one dtype, equal shards on every rank of ``group``. Raises SPConfigError naming the mismatch."""
    _check_layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise SPConfigError(f"q, k, v must be 4-D ({layout}); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise SPConfigError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2]:
        raise SPConfigError(f"q and k/v disagree on batch/sequence ({layout}): {tuple(q.shape)} vs {tuple(k.shape)}")
    if q.shape[3] != k.shape[3]:
        raise SPConfigError(f"head_dim mismatch: q has {q.shape[3]}, k/v have {k.shape[3]}")
    check_same_dtype(q, k, v)
    _across_ranks_once(q, k, layout, group, "ulysses")


def check_ring_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, group) -> None:
    """Ring-family inputs: q/k/v of one layout with matching batch, sequence and head_dim, q heads a multiple
    of k/v heads, one dtype, equal q shards on every rank of ``group``. Raises SPConfigError naming the mismatch."""
    _check_layout(layout)
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise SPConfigError(f"q/k/v shapes do not agree ({layout}): {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise SPConfigError(f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")
    check_same_dtype(q, k, v)
    _across_ranks_once(q, k, layout, group, "ring")


def packed_cu(cu_seqlens, bsz: int, seqlen: int, placement: str, world: int) -> Optional[PackedSamples]:
    """``cu_seqlens`` (packed samples: 1-D int [n_samples + 1] real cumulative lengths, or ``PackedSamples``) for a
    batch of ``bsz`` padded sequences of ``seqlen`` rows split by ``placement`` over ``world`` ranks, or None when
    not given, after checking what packed samples need (B=1; ``problem.describe`` refuses kv_valid_len with them);
    raises SPConfigError naming the argument."""
    if cu_seqlens is None:
        return None
    if bsz != 1:
        raise SPConfigError(f"cu_seqlens needs batch size 1 (samples packed along the sequence); got {bsz}")
    return packed_samples(cu_seqlens, seqlen, placement, world)


def _dtype_names() -> list[str]:
    """Every torch dtype's name, sorted: an index into it is the same code on every rank (same torch)."""
    return sorted({str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)})


def check_same_shape_across_ranks(x: torch.Tensor, group, what: str) -> None:
    """One all_gather of the dtype and shape; raises SPConfigError on every rank if any rank's differs
    (a dtype mismatch used to crash inside the backend's exchange)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    names = _dtype_names()
    mine = torch.tensor([names.index(str(x.dtype)), *x.shape], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    allv = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(allv, mine, group=group)
    rows = [t.tolist() for t in allv]
    dtypes = [names[r[0]] for r in rows]
    if len(set(dtypes)) != 1:
        per_rank = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dtypes))
        raise SPConfigError(f"{what} dtypes differ across ranks ({per_rank}): every rank must pass q, k, v in one "
                            f"dtype (e.g. the same autocast / model dtype on every rank)")
    shapes = [tuple(r[1:]) for r in rows]
    if len(set(shapes)) != 1:
        raise SPConfigError(f"{what} shapes differ across ranks: {shapes}; every rank must hold an equal shard")


_MASK_WEIGHTS: dict = {}


def _mask_checksum(block_mask: torch.Tensor) -> torch.Tensor:
    """int64 [4]: the mask's shape (heads, tiles) and two weighted sums of its bits (fixed pseudo-random weights):
    masks that differ in any bit differ here except with negligible probability. On the mask's device."""
    n, dev = block_mask.numel(), block_mask.device
    key = (n, str(dev))
    if key not in _MASK_WEIGHTS:
        idx = torch.arange(n, dtype=torch.int64, device=dev)
        _MASK_WEIGHTS[key] = ((idx * 2654435761 + 12345) % 2147483647, (idx * 40503 + 977) % 1000003)
    w1, w2 = _MASK_WEIGHTS[key]
    bits = block_mask.reshape(-1).to(torch.int64)
    shape = torch.tensor(block_mask.shape[:2], dtype=torch.int64, device=dev)
    return torch.cat([shape, (bits * w1).sum().view(1), (bits * w2).sum().view(1)])


def check_same_tile_mask(block_mask: torch.Tensor, group, what: str = "block_mask") -> None:
    """One small all_gather of a checksum of ``block_mask`` ([H or 1, T, T] bool, already checked on this rank):
    raises SPConfigError naming ``what`` on every rank when any rank's mask differs (a per-rank mask used to hang
    TASP and crash the ring), before any exchange. Every call runs it; ``MaskChecks`` runs it once per distinct mask."""
    if group is None or dist.get_world_size(group) == 1:
        return
    world = dist.get_world_size(group)
    mine = _mask_checksum(block_mask)
    if dist.get_backend(group) == "nccl":
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        mine = mine.cpu()
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    rows = torch.stack(parts).cpu()
    differ = [r for r in range(world) if not torch.equal(rows[r], rows[0])]
    if differ:  # every rank sees the same rows: all raise, after the same collectives
        raise SPConfigError(f"{what} differs between ranks ({_mask_difference(block_mask, group, rows, differ)}): "
                            f"give every rank the SAME mask over the full sequence in global token order (e.g. build "
                            f"it from data all ranks share, or broadcast it from rank 0)")


def _mask_difference(block_mask: torch.Tensor, group, rows: torch.Tensor, differ: list) -> str:
    """What differs between rank 0's mask and ranks ``differ``'s: their [H, T] shapes where those differ, else (one
    more all_gather, on this error path only, of the equal-shaped masks) how many entries and the first one."""
    shapes = [tuple(rows[r, :2].tolist()) for r in range(rows.shape[0])]
    if any(shapes[r] != shapes[0] for r in differ):
        return "shapes [heads, tiles]: " + ", ".join(f"rank {r} {shapes[r]}" for r in [0, *differ])
    mine = block_mask.to(torch.uint8).contiguous()
    if dist.get_backend(group) == "nccl":
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    parts = [torch.empty_like(mine) for _ in range(rows.shape[0])]
    dist.all_gather(parts, mine, group=group)
    ref, said = parts[0].cpu(), []
    for r in differ:
        diff = parts[r].cpu() != ref
        h, i, j = (int(x) for x in diff.nonzero()[0])
        said.append(f"rank {r} at {int(diff.sum())} of {diff.numel()} entries, first [head {h}, query tile {i}, key "
                    f"tile {j}]: {bool(parts[r][h, i, j])} where rank 0 has {bool(ref[h, i, j])}")
    return f"same shape {shapes[0]} on every rank; the selected tiles differ from rank 0's: " + "; ".join(said)


class MaskChecks:
    """The cross-rank block-mask check once per distinct mask: ``check(mask, group)`` runs ``check_same_tile_mask``
    (one all_gather and a host sync) unless this object already checked (or was told about) the same mask over the
    same group. "The same mask" is keyed on everything that changes the result: the mask object itself (held by a
    weak reference: a new mask built at a freed mask's address is a new mask), its in-place version (``_version``:
    a mask mutated in place is checked again), data pointer, shape, dtype and device, and the group. So a mask
    object that 40 layers reuse is checked once, and a mask rebuilt every step is checked once per step.

    ``agree(mask, group)`` is the "already agreed" token: the caller states that every rank built ``mask``
    identically by construction (e.g. top-k over pooled tiles all-reduced over ``group``, the DiT's
    ``--sparse-topk``), so it is recorded as checked without a collective. A mask the caller did NOT declare is
    still compared, and refused by name when it differs between ranks.

    Each rank decides locally; the decisions agree across ranks when every rank makes the same calls on its masks
    (the same program on every rank, as the algorithms' own exchanges already require). A mask mutated in place
    on some ranks only is outside that contract: use a new mask object instead. Writes that bypass autograd's
    version counter (``mask.data[...] = ...``, a view taken through ``.data`` or ``.detach()``, DLPack/NumPy
    aliases) are not seen either: after such a write pass a new mask object. ``per_call=True`` checks every
    call (the behaviour before this cache; profiles compare the two). ``collectives``: the checks run so far.
    Owned by the caller (``SPResources.mask_checks`` is one model's); entries go when their mask is freed."""

    def __init__(self, per_call: bool = False) -> None:
        self.per_call = per_call
        self.collectives = 0
        self._seen: dict = {}   # (id(mask), id(group)) -> (weak ref to the mask, group, state at the check)

    def __len__(self) -> int:
        """How many (mask, group) pairs are remembered (entries go when their mask is freed)."""
        return len(self._seen)

    @staticmethod
    def _state(mask: torch.Tensor) -> tuple:
        return (mask._version, mask.data_ptr(), tuple(mask.shape), mask.dtype, mask.device)

    def _remember(self, mask: torch.Tensor, group) -> None:
        key = (id(mask), id(group))
        self._seen[key] = (weakref.ref(mask, lambda _ref, seen=self._seen, key=key: seen.pop(key, None)), group,
                           self._state(mask))

    def checked(self, mask: torch.Tensor, group) -> bool:
        """Whether ``mask`` (as it is now) was checked, or declared agreed, over ``group`` (no collective)."""
        entry = self._seen.get((id(mask), id(group)))
        return (not self.per_call and entry is not None and entry[0]() is mask and entry[1] is group
                and entry[2] == self._state(mask))

    def check(self, mask: torch.Tensor, group, what: str = "block_mask") -> None:
        """``check_same_tile_mask(mask, group, what)`` unless ``checked(mask, group)``."""
        if group is None or dist.get_world_size(group) == 1 or self.checked(mask, group):
            return
        check_same_tile_mask(mask, group, what)
        self.collectives += 1
        self._remember(mask, group)

    def agree(self, mask: torch.Tensor, group) -> torch.Tensor:
        """Record ``mask`` as agreed over ``group`` without a collective (see class docstring); returns ``mask``.
        Later in-place changes to it void the record (its version moves)."""
        if group is not None and not self.per_call:
            self._remember(mask, group)
        return mask


def check_mask_once(block_mask: torch.Tensor, group, mask_checks: Optional[MaskChecks],
                    what: str = "block_mask") -> None:
    """The cross-rank check of ``block_mask``: through ``mask_checks`` (once per distinct mask) or, without one,
    on this call (``check_same_tile_mask``)."""
    if mask_checks is None:
        check_same_tile_mask(block_mask, group, what)
    else:
        mask_checks.check(block_mask, group, what)
