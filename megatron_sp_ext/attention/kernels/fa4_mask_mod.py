"""FlashAttention-4's mask_mod for block-sparse calls whose kernel blocks a tile edge, padded keys or (with them)
the causal diagonal cut: a CuTe DSL function FA4 compiles into its kernels and calls per element of a PARTIAL block
only (full blocks run unmasked).

aux tensors (int32, on the device; kernels/fa4.py ``TileMeta.aux``): [0] the query rows' global tile indices
[aux_rows(Sq)], [1] the key rows' global tile indices [aux_rows(Sk)] (T for padded keys and past Sk), [2] the tile
mask [h or 1, T, T + 1] (column T: 0), and with causal [3] / [4] the query / key rows' global positions (the
per-row tensors run past Sq / Sk to whole kernel blocks: FA4 calls the mask_mod there too). keep = tile_mask[head, q_tile, k_tile] AND
(causal) k_pos <= q_pos. ``probe`` checks the route against the math kernel on a tiny case before it is offered.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch


@lru_cache(maxsize=None)
def tile_mask_mod(per_head: bool, causal: bool):
    """The mask_mod for (a per-head tile mask or one broadcast row, causal or not)."""
    import cutlass  # noqa: PLC0415 - FA4's DSL, present wherever FA4 runs
    import cutlass.cute as cute  # noqa: PLC0415
    from flash_attn.cute import utils  # noqa: PLC0415

    @cute.jit
    def mask_mod(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        q_tile, k_tile, tiles = aux_tensors[0], aux_tensors[1], aux_tensors[2]
        qt = q_tile[m_idx[0]]
        kt = k_tile[n_idx[0]]
        if cutlass.const_expr(per_head):
            sel = tiles[head[0], qt, kt]
        else:
            sel = tiles[0, qt, kt]
        keep = utils.scalar_to_ssa(sel, cutlass.Int32) > utils.scalar_to_ssa(0, cutlass.Int32)
        if cutlass.const_expr(causal):
            q_pos, k_pos = aux_tensors[3], aux_tensors[4]
            qp = utils.scalar_to_ssa(q_pos[m_idx[0]], cutlass.Int32)
            kp = utils.scalar_to_ssa(k_pos[n_idx[0]], cutlass.Int32)
            keep = keep & (kp <= qp)
        return keep

    return mask_mod


def probe(kernel, device, dtype, partial: bool) -> tuple[bool, Optional[str]]:
    """FA4's block sparsity on a tiny case against the math kernel: out, lse (-inf where a row selects nothing) and
    the gradients within 3e-2 of max, causal and not, GQA 4/2, a per-head random mask with an empty query tile.
    ``partial``: 32-token tiles and padded keys (every 128-token kernel block cut: the mask_mod route); else
    128-token tiles (full blocks and FA4's causal diagonal). Any failure (the DSL refusing the function included)
    means "not here". Returns (ok, None) or (False, the reason: "raised ..." or "disagrees ...")."""
    from ..tiles import TileSlice  # noqa: PLC0415
    from .math import MathKernel  # noqa: PLC0415
    import logging  # noqa: PLC0415
    log = logging.getLogger("megatron_sp_ext")
    g = torch.Generator().manual_seed(0)
    s, bs = (320, 32) if partial else (640, 128)
    t = s // bs
    try:
        for causal in (False, True):
            bm = torch.rand(4, t, t, generator=g) < 0.5
            bm[:, 3] = False
            bm = bm.to(device)
            q, do = (torch.randn(1, 4, s, 64, generator=g).to(device=device, dtype=dtype) for _ in range(2))
            k, v = (torch.randn(1, 2, s, 64, generator=g).to(device=device, dtype=dtype) for _ in range(2))
            pos = torch.arange(s)   # positions are host data (tiles.TileSlice)
            ts = TileSlice(bm, bs, pos, pos, slice(None), s - 5 if partial else None)
            o, lse = kernel.forward(q, k, v, 0.125, causal, ts)
            grads = kernel.backward(do, q, k, v, o, lse, 0.125, causal, ts)
            ref = MathKernel()
            o_m, lse_m = ref.forward(q.float(), k.float(), v.float(), 0.125, causal, ts)
            grads_m = ref.backward(do.float(), q.float(), k.float(), v.float(), o_m, lse_m, 0.125, causal, ts)
            live = torch.isfinite(lse_m)
            close = lambda a, b: bool((a.float() - b.float()).abs().max() <= 3e-2 * (1 + b.float().abs().max()))  # noqa: E731
            if not (close(o, o_m) and close(torch.where(live, lse, 0), torch.where(live, lse_m, 0))
                    and bool((~torch.isfinite(lse[~live]) | (lse[~live] < -1e30)).all())
                    and all(close(a, b) for a, b in zip(grads, grads_m))):
                log.info("megatron_sp_ext: FA4's block sparsity (partial=%s) disagrees with math here: off", partial)
                return False, f"disagrees with the math kernel (causal={causal})"
    except Exception as e:  # noqa: BLE001 - see docstring
        log.info("megatron_sp_ext: FA4's block sparsity (partial=%s) unavailable here: %s", partial, e)
        return False, f"raised {type(e).__name__}: {str(e)[:200]}"
    return True, None
