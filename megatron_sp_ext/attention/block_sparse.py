"""Block-sparse attention masks: a tile mask over the full sequence, and the local kernels that apply it.

A block mask is a bool tensor ``[H or 1, T, T]`` with ``T = ceil(S / tile)`` (``tile``: tokens per mask tile, called
``block_size`` where the public keyword predates the word): entry ``[h, i, j]`` says whether query tile i (global
tokens ``[i*tile, (i+1)*tile)``) attends key tile j for query head h (1: every head).
It is stated over the FULL sequence in GLOBAL token order and is the same on every rank; a rank turns it into a
token mask from the global positions of the tokens it holds (``token_mask``), or asks cheaply at tile level
whether a (query set, key set) pair has anything to compute (``pair_selected``). ``causal`` combines as AND at
token level (key position <= query position). Query rows with no selected key give out 0, lse -inf, zero grads.

Local kernels: the registry's (attention/kernels/) with block sparsity, ``KERNELS``: "auto" picks per call the first
that runs it (FlashAttention-4's own block sparsity at 128-token kernel blocks, cuDNN frontend's block sparsity at
64/128-token blocks, flex_attention, the math kernel; kernels/registry.py records the order: per tile size between
FA4 and cuDNN, ``kernels.TILE_ORDER``); a named kernel that cannot run the call raises SPConfigError naming
``tile_setting``; nothing falls back silently. A call's view of the mask is a ``tiles.TileSlice`` (positions on the
host, the mask on the device: the kernels' metadata costs no host sync).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import SPConfigError
from . import kernels
from .kernels import math as math_kernel
from .backends import LocalAttention, tile_kernel_settings, tile_call
from .kernels.flex import flex_attention_masked  # noqa: F401 - part of this module's API (tests, tools)
from .kernels.flex import flex_mask as _flex_mask_of_slice
from .tiles import TileSlice, full_sequence_slice

KERNELS = tile_kernel_settings()   # "auto" and the registry's kernels with block sparsity that auto may pick
DEFAULT_TILE_SIZE = 64   # tokens per tile: the default of the public ``tile`` (``block_size``) keyword


def num_tiles(seq_len: int, tile: int) -> int:
    """Tiles per side of the block mask for a full sequence of ``seq_len`` tokens: ceil(seq_len / tile)."""
    return -(-seq_len // tile)


def check_tile_mask(block_mask: torch.Tensor, *, seq_len: int, num_heads: int, tile: Optional[int] = None,
                    block_size: Optional[int] = None) -> torch.Tensor:
    """``block_mask`` checked: bool [1 or num_heads, T, T], T = ceil(seq_len / tile) (``tile``: tokens per mask tile;
    ``block_size`` its older name); returns it (contiguous). Only its shape and dtype are read (no host sync).

    Raises SPConfigError naming ``block_mask`` / the tile setting given and what is expected."""
    name, value = ("tile", tile) if tile is not None else ("block_size", block_size)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SPConfigError(f"{name}={value!r} is invalid: use a positive integer (default {DEFAULT_TILE_SIZE})")
    t = num_tiles(seq_len, value)
    want = f"a bool tensor [1 or {num_heads}, {t}, {t}] (heads, ceil(S/{name}) query tiles, key tiles) for " \
           f"S={seq_len}, {name}={value}"
    if not isinstance(block_mask, torch.Tensor):
        raise SPConfigError(f"block_mask must be {want}; got {type(block_mask).__name__}")
    if block_mask.dtype != torch.bool:
        raise SPConfigError(f"block_mask must be {want}; got dtype {block_mask.dtype}")
    if block_mask.dim() != 3 or block_mask.shape[0] not in (1, num_heads) or tuple(block_mask.shape[1:]) != (t, t):
        raise SPConfigError(f"block_mask must be {want}; got shape {list(block_mask.shape)}")
    return block_mask.contiguous()


def head_rows(block_mask: torch.Tensor, heads: slice) -> torch.Tensor:
    """The mask's rows for the query heads ``heads`` (a slice of global head indices): [h, T, T], or the
    broadcasting [1, T, T] when the mask has one head row."""
    return block_mask if block_mask.shape[0] == 1 else block_mask[heads]


def token_mask(block_mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int,
               heads: slice = slice(None), *, causal: bool = False,
               kv_valid_len: Optional[int] = None) -> torch.Tensor:
    """Token-level keep mask [h or 1, Sq, Sk] (bool) of queries at global positions ``q_pos`` [Sq] against keys at
    ``k_pos`` [Sk] (LongTensors): the tile mask (head rows ``heads``) AND, if ``causal``, k_pos <= q_pos AND, if
    ``kv_valid_len``, k_pos < kv_valid_len. On the mask's device (``TileSlice.token_mask``)."""
    return TileSlice(block_mask, block_size, q_pos, k_pos, heads, kv_valid_len).token_mask(causal)


def pair_selected(block_mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int,
                  heads: slice = slice(None), *, causal: bool = False, kv_valid_len: Optional[int] = None) -> bool:
    """Whether any query at ``q_pos`` attends any key at ``k_pos`` under the tile mask (any of ``heads``), causal
    and kv_valid_len: decided at tile level (``TileSlice.selects_any``: T x T work, no token mask; exact)."""
    return TileSlice(block_mask, block_size, q_pos, k_pos, heads, kv_valid_len).selects_any(causal)


def resolve_kernel(kernel: str, device: torch.device, dtype: Optional[torch.dtype] = None,
                   setting: str = "kernel") -> str:
    """The block-sparse kernel ``kernel`` ("auto" or one of ``KERNELS``) names for calls on (device, dtype), before
    a call's tile slice is known (the slice may still send a call elsewhere: ``kernel_for_call``); raises
    SPConfigError naming ``setting`` (the user's name of the choice) for an unknown name or a named kernel that cannot
    run here."""
    if kernel not in KERNELS:
        raise SPConfigError(f"{setting}={kernel!r} is invalid: choose one of {', '.join(KERNELS)}")
    # "auto" names the kernel of a plain call; a named kernel is checked for the device and dtype only
    needs = frozenset({"tiles", "plain"}) if kernels.is_auto(kernel) else frozenset({"tiles"})
    call = kernels.KernelCall(torch.device(device), dtype or torch.float32, None, needs)
    return kernels.choose(call, kernel, name=setting).setting


def kernel_for_call(kernel: str, q: torch.Tensor, ts: TileSlice, causal: bool, lse: bool,
                    setting: str = "kernel") -> kernels.Kernel:
    """The kernel of one block-sparse call: "auto" = the registry's first that runs it; a named kernel must run it
    (SPConfigError naming ``setting`` otherwise)."""
    if kernel not in KERNELS:
        raise SPConfigError(f"{setting}={kernel!r} is invalid: choose one of {', '.join(KERNELS)}")
    return kernels.choose(tile_call(q, ts, causal, lse), kernel, name=setting)


def math_forward(q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor, mask_hqk: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] in the accumulator dtype) under the token mask
    ``mask_hqk`` [H or 1, Sq, Sk]; rows with no kept key: out 0, lse -inf."""
    return math_kernel.math_forward(q_bhsd, k_bhsd, v_bhsd, scale, mask_hqk)


def math_backward(do_bhsd: torch.Tensor, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor,
                  out_bhsd: torch.Tensor, lse_bhs: torch.Tensor, mask_hqk: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``math_forward``'s call given the FINAL out/lse of the query rows (rows with lse -inf:
    zero gradients)."""
    return math_kernel.math_backward(do_bhsd, q_bhsd, k_bhsd, v_bhsd, out_bhsd, lse_bhs, scale, mask_hqk)


def flex_mask(block_mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int,
                    heads: slice = slice(None), *, causal: bool = False, kv_valid_len: Optional[int] = None,
                    compiled: Optional[bool] = None):
    """flex_attention's ``BlockMask`` for queries at ``q_pos`` and keys at ``k_pos`` (global positions) under the
    tile mask (``kernels.flex.flex_mask`` of their ``TileSlice``)."""
    return _flex_mask_of_slice(TileSlice(block_mask, block_size, q_pos, k_pos, heads, kv_valid_len), causal=causal,
                               compiled=compiled)


class BlockSparseBackend(LocalAttention):
    """A local attention that applies a block mask itself, over its own token positions (a hybrid mesh's sparse
    ring): ``attend(q, k, v, *, heads, causal, softmax_scale)`` differentiable, q/k/v bhsd in the order the backend
    knows, ``heads`` the global query heads q carries. ``seq_len``: the full sequence its mask covers."""

    seq_len: int

    def attend(self, q_bhsd, k_bhsd, v_bhsd, *, heads: slice, causal: bool, softmax_scale: float) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, q, k, v, *, causal, softmax_scale):
        raise SPConfigError(f"{self.name} applies a block mask and runs only with block_mask=")


# ------------------------------------------------------------------------------------------------ entry point
def block_sparse_attention(q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor,
                           block_mask: "torch.Tensor | TileSlice", *, tile: Optional[int] = None,
                           block_size: Optional[int] = None, causal: bool = False,
                           softmax_scale: Optional[float] = None, kv_valid_len: Optional[int] = None,
                           kernel: str = "auto", setting: str = "kernel") -> torch.Tensor:
    """Differentiable single-device block-sparse attention. q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (H % Hkv == 0).

    block_mask: bool [1 or H, T, T] (global tiles of ``tile`` tokens; ``block_size`` is its older name) over rows
    0..Sq-1 / 0..Sk-1, keys >= ``kv_valid_len`` padding; or a ``tiles.TileSlice`` (rows at any global positions,
    a head chunk's rows, its padding and tile inside it; its kernel metadata is kept in it, so a caller that passes
    the same slice again converts the mask once). ``causal``: key position <= query position (tril with the default
    rows). ``kernel``: "auto" or one of ``KERNELS`` (a named kernel that cannot run the call is refused naming
    ``setting``; "auto" moves to the next, e.g. causal between different rows runs on flex or math). No host sync
    for a whole-sequence call (the kernels' metadata is built on the device). Returns out [B, H, Sq, D]."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_bhsd.shape[-1])
    if isinstance(block_mask, TileSlice):
        if (tile, block_size, kv_valid_len) != (None, None, None):
            raise SPConfigError("block_sparse_attention: a TileSlice carries its tile and kv_valid_len: leave tile, "
                                "block_size and kv_valid_len unset")
        ts = block_mask
    else:
        if tile is not None and block_size is not None:
            raise SPConfigError("block_sparse_attention: tile and block_size name the same setting: give one of them")
        tile = tile if tile is not None else block_size
        if tile is None:
            raise SPConfigError("block_sparse_attention: give tile= (tokens per mask tile)")
        mask = block_mask.to(q_bhsd.device)   # the kernels' metadata lives beside q (no copy when it already does)
        sq, sk = q_bhsd.shape[2], k_bhsd.shape[2]
        ts = full_sequence_slice(mask, tile, sq, kv_valid_len) if sq == sk else \
            TileSlice(mask, tile, torch.arange(sq), torch.arange(sk), slice(None), kv_valid_len)
    kern = kernel_for_call(kernel, q_bhsd, ts, causal, lse=False, setting=setting)
    return kern.attention(q_bhsd, k_bhsd, v_bhsd, causal, scale, ts)
