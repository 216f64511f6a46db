"""Input checks shared by every sequence-parallel algorithm (Ulysses family and ring family).

Local checks (this rank's tensors): ``check_inputs`` (Ulysses family: q, k, v of one layout, equal k/v shapes) and
``check_ring_inputs`` (ring family: also GQA heads), both through ``check_same_dtype``; ``packed_cu`` (packed
samples' cu_seqlens), ``valid_kv_len`` (the padding cut of every mode).

The cross-rank check: ``agree_across_ranks``, run by ``AttentionProblem.bind`` on a problem's first bind over a
group, is ONE all_gather of a fingerprint (dtype, q/k/v shapes, the problem's settings, a checksum of the block
mask and of the packed samples, and whether this rank refused its input) that every rank reaches: whatever a rank
has seen before, the same program binds the same problem objects at the same points. It raises one SPConfigError on
every rank naming what differs, instead of a hang in the exchange that follows.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..config import LAYOUTS
from ..errors import SPConfigError
from .placement import PackedSamples, packed_samples

def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise SPConfigError(f"layout={layout!r} is invalid: choose one of {', '.join(LAYOUTS)}")


def valid_kv_len(kv_valid_len: Optional[int], seqlen: int) -> Optional[int]:
    """kv_valid_len (keys at global positions >= it are padding) for a ``seqlen``-token sequence: None where it cuts
    nothing (None or == seqlen); SPConfigError naming it where it leaves no key to attend (< 1), which would
    otherwise give all-zero outputs, or names keys past the sequence (> seqlen). The one check every mode and layer
    runs."""
    if kv_valid_len is None or kv_valid_len == seqlen:
        return None
    if kv_valid_len < 1:
        raise SPConfigError(f"kv_valid_len={kv_valid_len} leaves no key to attend: use 1..{seqlen} (or None: no "
                            f"padding)")
    if kv_valid_len > seqlen:
        raise SPConfigError(f"kv_valid_len={kv_valid_len} is larger than the sequence ({seqlen} tokens over the "
                            f"group): use 1..{seqlen} (or None: no padding)")
    return int(kv_valid_len)


def check_same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v in one dtype (no algorithm upcasts one of them silently); raises SPConfigError naming each."""
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise SPConfigError(f"q, k, v dtypes differ (q: {q.dtype}, k: {k.dtype}, v: {v.dtype}): pass all three in "
                            f"one dtype (e.g. k.to(q.dtype), or one autocast region around the q/k/v projections)")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    """Ulysses-family inputs: q [B, S_loc, H, D] / k, v [B, S_loc, Hkv, D] ("bshd"; "sbhd" swaps B and S_loc),
    one dtype (this rank; ``agree_across_ranks`` compares the ranks). Raises SPConfigError naming the mismatch."""
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


def check_ring_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    """Ring-family inputs: q/k/v of one layout with matching batch, sequence and head_dim, q heads a multiple
    of k/v heads, one dtype (this rank). Raises SPConfigError naming the mismatch."""
    _check_layout(layout)
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise SPConfigError(f"q/k/v shapes do not agree ({layout}): {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise SPConfigError(f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")
    check_same_dtype(q, k, v)


def packed_cu(cu_seqlens, bsz: int, seqlen: int, placement: str, world: int) -> Optional[PackedSamples]:
    """``cu_seqlens`` (packed samples: 1-D int [n_samples + 1] real cumulative lengths, or ``PackedSamples``) for a
    batch of ``bsz`` padded sequences of ``seqlen`` rows split by ``placement`` over ``world`` ranks, or None when
    not given, after checking what packed samples need (B=1; ``AttentionProblem.bind`` refuses kv_valid_len with them);
    raises SPConfigError naming the argument."""
    if cu_seqlens is None:
        return None
    if bsz != 1:
        raise SPConfigError(f"cu_seqlens needs batch size 1 (samples packed along the sequence); got {bsz}")
    return packed_samples(cu_seqlens, seqlen, placement, world)


def _dtype_names() -> list[str]:
    """Every torch dtype's name, sorted: an index into it is the same code on every rank (same torch)."""
    return sorted({str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)})


def _shape4(x: torch.Tensor) -> list[int]:
    """A tensor's shape as 4 ints (-1 where it has fewer dims; a 5-D tensor's first four)."""
    dims = list(x.shape)[:4] if isinstance(x, torch.Tensor) else []
    return dims + [-1] * (4 - len(dims))


def _device_of(group) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# the fingerprint's named settings (after its failed flag, dtype and q/k/v shapes): name -> how to read it
_SETTINGS = ("layout", "placement", "causal", "kv_valid_len", "dropout_p", "tile", "softmax_scale")


def _settings_row(pb) -> list[int]:
    from ..config import LAYOUTS as lays, SEQ_PLACEMENTS as places  # noqa: PLC0415 - one table each
    return [lays.index(pb.layout) if pb.layout in lays else -1,
            places.index(pb.placement) if pb.placement in places else -1,
            int(bool(pb.causal)), -1 if pb.kv_valid_len is None else int(pb.kv_valid_len),
            round(float(pb.dropout_p) * 2 ** 40), int(pb.tile),
            -1 if pb.softmax_scale is None else round(float(pb.softmax_scale) * 2 ** 40)]


def _weighted_sums(x: torch.Tensor) -> torch.Tensor:
    """int64 [2]: two weighted sums of ``x``'s values (fixed pseudo-random weights, on x's device): tensors that
    differ in any entry differ here except with negligible probability."""
    n, dev = x.numel(), x.device
    key = (n, str(dev))
    if key not in _MASK_WEIGHTS:
        idx = torch.arange(n, dtype=torch.int64, device=dev)
        _MASK_WEIGHTS[key] = ((idx * 2654435761 + 12345) % 2147483647, (idx * 40503 + 977) % 1000003)
        while len(_MASK_WEIGHTS) > 8:
            _MASK_WEIGHTS.pop(next(iter(_MASK_WEIGHTS)))
    w1, w2 = _MASK_WEIGHTS[key]
    flat = x.reshape(-1).to(torch.int64)
    return torch.stack([(flat * w1).sum(), (flat * w2).sum()])


def _fingerprint(pb, q, k, v, failed: bool, with_mask: bool, dev: torch.device) -> torch.Tensor:
    """int64 [N] on ``dev``: whether this rank refused its input, its dtype, q/k/v shapes, the problem's settings,
    the block mask's shape and checksum (``with_mask``; -1s without one) and the packed samples' checksum."""
    names = _dtype_names()
    host = [int(failed), names.index(str(q.dtype)) if isinstance(q, torch.Tensor) else -1,
            *_shape4(q), *_shape4(k), *_shape4(v), *_settings_row(pb)]
    mask = pb.block_mask if with_mask else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 3:
        host += [*mask.shape[:2]]
        device_part = _weighted_sums(mask).to(dev)
    else:
        host += [-1, -1]
        device_part = torch.full((2,), -1, dtype=torch.int64, device=dev)
    cu = pb.cu_seqlens
    if cu is None:
        host += [-1, -1, -1]
    else:
        ints = [*cu.real, *cu.layout] if isinstance(cu, PackedSamples) else [int(x) for x in torch.as_tensor(cu).tolist()]
        host += [len(ints), *(int(x) for x in _weighted_sums(torch.tensor(ints, dtype=torch.int64)).tolist())]
    return torch.cat([torch.tensor(host, dtype=torch.int64).to(dev), device_part])


# fingerprint columns: 0 failed, 1 dtype, 2-13 q/k/v shapes, 14-20 _SETTINGS, 21-22 mask shape, 23-25 packed,
# 26-27 mask checksum
_MASK_COLS, _PACKED_COLS, _SUM_COLS = slice(21, 23), slice(23, 26), slice(26, 28)


def agree_across_ranks(pb, q, k, v, group, what: str, error: Optional[BaseException], *,
                       with_mask: bool = True) -> None:
    """The cross-rank check of one problem ``pb`` (an ``AttentionProblem``) and this rank's q, k, v over
    ``group``: ONE small all-gather of a fingerprint (``_fingerprint``; as a pairwise all_to_all) and a host sync,
    reached by every rank. Raises
    one SPConfigError on every rank when any rank refused its input (``error``: this rank's own, raised here after
    the collective; the others name that rank and its message) or the ranks' dtypes, shard shapes, settings, block
    masks (``with_mask``) or packed samples differ."""
    world = dist.get_world_size(group)
    dev = _device_of(group)
    mine = _fingerprint(pb, q, k, v, error is not None, with_mask, dev)
    # an all-gather as one pairwise all_to_all: every rank exchanges with every other directly, as the exchanges
    # that follow do, so a rank that died is seen by all the others at once (a ring all_gather over gloo blocks
    # the ranks not next to it until their neighbours give up, past the fault report's roll call)
    send = mine.unsqueeze(0).expand(world, -1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    rows = recv.cpu()   # the one host sync of the problem
    failed = [r for r in range(world) if rows[r, 0]]
    if failed:   # every rank sees it: one more collective (error path only) carries the messages
        said = [None] * world
        dist.all_gather_object(said, None if error is None else str(error), group=group)
        if error is not None:
            raise error
        raise SPConfigError(f"{what}: rank {failed[0]} of the group refused its input: {said[failed[0]]}")
    table = rows.tolist()
    names = _dtype_names()
    dtypes = [names[r[1]] for r in table]
    if len(set(dtypes)) != 1:
        per_rank = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dtypes))
        raise SPConfigError(f"{what}: sequence shard (q) dtypes differ across ranks ({per_rank}): every rank must pass "
                            f"q, k, v in one dtype (e.g. the same autocast / model dtype on every rank)")
    for i, name in enumerate(("q", "k", "v")):
        shapes = [tuple(r[2 + 4 * i:6 + 4 * i]) for r in table]
        if len(set(shapes)) != 1:
            raise SPConfigError(f"{what}: sequence shard ({name}) shapes differ across ranks: {shapes}; every rank "
                                f"must hold an equal shard")
    for i, name in enumerate(_SETTINGS):
        col = [r[14 + i] for r in table]
        if len(set(col)) != 1:
            values = ", ".join(f"rank {r}: {_setting_value(name, x)}" for r, x in enumerate(col))
            raise SPConfigError(f"{what}: the problem's {name} differs across ranks ({values}): give every rank the "
                                f"same AttentionProblem settings")
    if any(r[_PACKED_COLS] != table[0][_PACKED_COLS] for r in table):
        raise SPConfigError(f"{what}: cu_seqlens (packed samples) differs across ranks: give every rank the same "
                            f"cumulative lengths over the full sequence")
    differ = [r for r in range(world) if table[r][_MASK_COLS] != table[0][_MASK_COLS]
              or table[r][_SUM_COLS] != table[0][_SUM_COLS]]
    if differ:
        mask_rows = rows[:, [21, 22, 26, 27]]
        raise SPConfigError(f"block_mask differs between ranks ({_mask_difference(pb.block_mask, group, mask_rows, differ)}): "
                            f"give every rank the SAME mask over the full sequence in global token order (e.g. build "
                            f"it from data all ranks share, or broadcast it from rank 0)")


def _setting_value(name: str, x: int) -> str:
    from ..config import LAYOUTS as lays, SEQ_PLACEMENTS as places  # noqa: PLC0415
    if name == "layout":
        return lays[x] if 0 <= x < len(lays) else "?"
    if name == "placement":
        return places[x] if 0 <= x < len(places) else "?"
    if name in ("dropout_p", "softmax_scale"):
        return "None" if x == -1 else f"{x / 2 ** 40:g}"
    if name == "causal":
        return str(bool(x))
    return "None" if x == -1 else str(x)


_MASK_WEIGHTS: dict = {}   # (numel, device) -> the checksum weights, a few kept


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
