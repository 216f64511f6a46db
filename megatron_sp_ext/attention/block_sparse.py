"""Block-sparse attention masks: a tile mask over the full sequence, and the local kernels that apply it.

A block mask is a bool tensor ``[H or 1, T, T]`` with ``T = ceil(S / block_size)``: entry ``[h, i, j]`` says
whether query tile i (global tokens ``[i*bs, (i+1)*bs)``) attends key tile j for query head h (1: every head).
It is stated over the FULL sequence in GLOBAL token order and is the same on every rank; a rank turns it into a
token mask from the global positions of the tokens it holds (``token_mask``), or asks cheaply at tile level
whether a (query set, key set) pair has anything to compute (``pair_selected``). ``causal`` combines as AND at
token level (key position <= query position). Query rows with no selected key give out 0, lse -inf, zero grads.

Local kernels (q [B, H, Sq, D], k/v [B, Hkv, Sk, D], GQA by head repetition; mask [h, Sq, Sk] bool):
  "math"  ``blockwise.math_forward`` / ``math_backward`` with the token mask (fp32 accumulation, fp64 for fp64);
          forward gives (out, lse) and backward runs from the FINAL out/lse (ring steps, held chunks). Any device.
  "flex"  CUDA only: ``torch.nn.attention.flex_attention`` (compiled) with a ``BlockMask`` built from a
          ``mask_mod`` that indexes the tile mask; differentiable through autograd (no backward-from-lse).
  "auto"  "flex" on CUDA where flex_attention imports (fp16/bf16/fp32), else "math". An explicit "flex" that cannot run raises
          SPConfigError naming ``block_kernel``; nothing falls back silently.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ..errors import SPConfigError
from . import blockwise
from .backends import LocalAttention

KERNELS = ("auto", "math", "flex")
DEFAULT_BLOCK_SIZE = 64


def num_tiles(seq_len: int, block_size: int) -> int:
    """Tiles per side of the block mask for a full sequence of ``seq_len`` tokens: ceil(seq_len / block_size)."""
    return -(-seq_len // block_size)


def check_block_mask(block_mask: torch.Tensor, *, seq_len: int, block_size: int, num_heads: int) -> torch.Tensor:
    """``block_mask`` checked: bool [1 or num_heads, T, T], T = ceil(seq_len / block_size); returns it (contiguous).

    Raises SPConfigError naming ``block_mask`` / ``block_size`` and what is expected."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise SPConfigError(f"block_size={block_size!r} is invalid: use a positive integer (default "
                            f"{DEFAULT_BLOCK_SIZE})")
    t = num_tiles(seq_len, block_size)
    want = f"a bool tensor [1 or {num_heads}, {t}, {t}] (heads, ceil(S/block_size) query tiles, key tiles) for " \
           f"S={seq_len}, block_size={block_size}"
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
    ``kv_valid_len``, k_pos < kv_valid_len. On the mask's device."""
    dev = block_mask.device
    qt, kt = q_pos.to(dev) // block_size, k_pos.to(dev) // block_size
    rows = head_rows(block_mask, heads)
    m = rows.index_select(1, qt).index_select(2, kt)
    if causal:
        m = m & (k_pos.to(dev).unsqueeze(0) <= q_pos.to(dev).unsqueeze(1))
    if kv_valid_len is not None:
        m = m & (k_pos.to(dev) < kv_valid_len)
    return m


def pair_selected(block_mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int,
                  heads: slice = slice(None), *, causal: bool = False, kv_valid_len: Optional[int] = None) -> bool:
    """Whether any query at ``q_pos`` attends any key at ``k_pos`` under the tile mask (any of ``heads``), causal
    and kv_valid_len: decided at tile level (T x T work, no token mask). Exact: for causal, tile pair (a, b) counts
    when the smallest selected key position of tile b is <= the largest query position of tile a."""
    t = block_mask.shape[-1]
    dev = block_mask.device
    q_pos, k_pos = q_pos.to(dev), k_pos.to(dev)
    if kv_valid_len is not None:
        k_pos = k_pos[k_pos < kv_valid_len]
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return False
    qt, kt = q_pos // block_size, k_pos // block_size
    rows = head_rows(block_mask, heads).any(0)  # [T, T]
    q_max = torch.full((t,), -1, dtype=torch.long, device=dev).scatter_reduce(0, qt, q_pos, "amax")
    k_min = torch.full((t,), torch.iinfo(torch.long).max, dtype=torch.long, device=dev).scatter_reduce(
        0, kt, k_pos, "amin")
    has_q, has_k = q_max >= 0, k_min < torch.iinfo(torch.long).max
    sel = rows & has_q.unsqueeze(1) & has_k.unsqueeze(0)
    if causal:
        sel = sel & (k_min.unsqueeze(0) <= q_max.unsqueeze(1))
    return bool(sel.any())


FLEX_AUTO_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_kernel(kernel: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> str:
    """"math" or "flex" for ``kernel`` ("auto", "math", "flex") on ``device``; raises SPConfigError naming
    ``block_kernel`` where "flex" cannot run (not CUDA, or flex_attention does not import). "auto" picks "flex"
    only for fp16/bf16/fp32 (``dtype``; fp64 stays on "math")."""
    if kernel not in KERNELS:
        raise SPConfigError(f"block_kernel={kernel!r} is invalid: choose one of {', '.join(KERNELS)}")
    device = torch.device(device)
    if kernel == "math" or (kernel == "auto" and dtype is not None and dtype not in FLEX_AUTO_DTYPES):
        return "math"
    why = _flex_unavailable(device)
    if kernel == "flex" and why is not None:
        raise SPConfigError(f"block_kernel='flex' cannot run here: {why}; use 'math' or 'auto'")
    return "flex" if why is None else "math"


def _flex_unavailable(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"flex_attention's block-sparse path runs on CUDA only (tensors on {device})"
    try:
        from torch.nn.attention import flex_attention  # noqa: F401, PLC0415
    except ImportError as e:  # pragma: no cover - depends on the torch build
        return f"torch.nn.attention.flex_attention does not import ({e})"
    return None


def math_forward(q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor, mask_hqk: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Sq, D] in q's dtype, lse [B, H, Sq] in the accumulator dtype) under the token mask
    ``mask_hqk`` [H or 1, Sq, Sk]; rows with no kept key: out 0, lse -inf."""
    return blockwise.math_forward(q_bhsd, k_bhsd, v_bhsd, scale, mask_hqk)


def math_backward(do_bhsd: torch.Tensor, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor,
                  out_bhsd: torch.Tensor, lse_bhs: torch.Tensor, mask_hqk: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``math_forward``'s block given the FINAL out/lse of the query rows (rows with lse -inf:
    zero gradients)."""
    return blockwise.math_backward(do_bhsd, q_bhsd, k_bhsd, v_bhsd, out_bhsd, lse_bhs, scale, mask_hqk)


class _MathBlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        out, lse = math_forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = math_backward(do, q, k, v, out, lse, mask, ctx.scale)
        return dq, dk, dv, None, None


# ------------------------------------------------------------------------------------------------- flex (CUDA)
@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415
    return torch.compile(flex_attention, dynamic=False)


def flex_block_mask(block_mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int,
                    heads: slice = slice(None), *, causal: bool = False, kv_valid_len: Optional[int] = None,
                    compiled: Optional[bool] = None):
    """flex_attention's ``BlockMask`` for queries at ``q_pos`` and keys at ``k_pos`` (global positions): its
    ``mask_mod`` indexes the tile mask (head rows ``heads``), ANDed with causal and kv_valid_len as in
    ``token_mask``. compiled (default: on CUDA): build it through torch.compile (``_compile=True``), which does not
    materialise the [h, Sq, Sk] mask; False evaluates the mask_mod eagerly (small shapes, CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415
    dev = block_mask.device
    rows = head_rows(block_mask, heads).contiguous()
    one_head = rows.shape[0] == 1
    qt, kt = (q_pos.to(dev) // block_size).contiguous(), (k_pos.to(dev) // block_size).contiguous()
    qp, kp = q_pos.to(dev).contiguous(), k_pos.to(dev).contiguous()
    valid = kv_valid_len if kv_valid_len is not None else int(k_pos.max()) + 1 if k_pos.numel() else 0

    def mask_mod(b, h, q_idx, kv_idx):
        keep = rows[0 if one_head else h, qt[q_idx], kt[kv_idx]]
        if causal:
            keep = keep & (kp[kv_idx] <= qp[q_idx])
        return keep & (kp[kv_idx] < valid)

    compiled = dev.type == "cuda" if compiled is None else compiled
    return create_block_mask(mask_mod, None, None if one_head else rows.shape[0], qp.numel(), kp.numel(),
                             device=dev, _compile=compiled)


def flex_attention_masked(q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor, flex_mask,
                          scale: float, *, compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Sq, D], lse [B, H, Sq] fp32) of flex_attention under ``flex_mask`` (``flex_block_mask``);
    differentiable in out. ``compiled=False`` runs flex_attention eagerly (its reference mode; CPU forward only)."""
    from torch.nn.attention import flex_attention as fa  # noqa: PLC0415
    fn = _compiled_flex() if compiled else fa.flex_attention
    gqa = k_bhsd.shape[1] != q_bhsd.shape[1]
    if hasattr(fa, "AuxRequest"):  # torch >= 2.9: return_lse is deprecated
        out, aux = fn(q_bhsd, k_bhsd, v_bhsd, block_mask=flex_mask, scale=scale, enable_gqa=gqa,
                      return_aux=fa.AuxRequest(lse=True))
        return out, aux.lse
    return fn(q_bhsd, k_bhsd, v_bhsd, block_mask=flex_mask, scale=scale, enable_gqa=gqa, return_lse=True)


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
                           block_mask: torch.Tensor, *, block_size: int, q_pos: Optional[torch.Tensor] = None,
                           k_pos: Optional[torch.Tensor] = None, heads: slice = slice(None), causal: bool = False,
                           softmax_scale: Optional[float] = None, kv_valid_len: Optional[int] = None,
                           kernel: str = "auto") -> torch.Tensor:
    """Differentiable single-device block-sparse attention. q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (H % Hkv == 0);
    ``block_mask`` [1 or H_total, T, T] (global tiles); q_pos / k_pos: global positions of the rows (default
    0..Sq-1 / 0..Sk-1); heads: the global query heads q carries (rows of the mask). Returns out [B, H, Sq, D]."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_bhsd.shape[-1])
    dev = q_bhsd.device
    q_pos = q_pos if q_pos is not None else torch.arange(q_bhsd.shape[2], device=dev)
    k_pos = k_pos if k_pos is not None else torch.arange(k_bhsd.shape[2], device=dev)
    kern = resolve_kernel(kernel, dev, q_bhsd.dtype)
    if kern == "flex":
        fm = flex_block_mask(block_mask, q_pos, k_pos, block_size, heads, causal=causal, kv_valid_len=kv_valid_len)
        return flex_attention_masked(q_bhsd, k_bhsd, v_bhsd, fm, scale)[0]
    mask = token_mask(block_mask, q_pos, k_pos, block_size, heads, causal=causal, kv_valid_len=kv_valid_len)
    return _MathBlockFn.apply(q_bhsd, k_bhsd, v_bhsd, mask, scale)
