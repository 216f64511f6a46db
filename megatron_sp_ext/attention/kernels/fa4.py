"""FlashAttention-4 (the pip package ``flash-attn-4``, CuTe DSL kernels for Hopper SM90 and Blackwell SM100) as a
local kernel: one block with log-sum-exp, its backward given the FINAL out/lse of the rows, and packed samples.

Shapes (this module's side; FA4 itself takes [B, S, H, D]): q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (bhsd, any strides
with stride(-1) == 1; GQA: H % Hkv == 0, k/v are NOT expanded, FA4 reads them per kv head and sums dk/dv itself).
out [B, H, Sq, D] in q's dtype, lse fp32 [B, H, Sq] (natural log). ``causal`` is used with Sq == Sk only (FA4 aligns
its causal mask bottom-right, which equals top-left there). Varlen: q/k/v [1, H, S, D] and ``cu`` (cumulative
sample lengths, ints), every sample attending only to itself.

FA4 exposes its block calls as ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd`` (the calls its
own autograd Function makes); they are named in this module only, and ``why_not`` refuses a build whose argument
lists differ (``schema_ok``). There is no attention dropout in FA4. Under torch's deterministic switch
(``torch.use_deterministic_algorithms(True)``, what ``--deterministic-mode`` sets) the dense and varlen backwards
run FA4's deterministic form (``deterministic=True``: dq, and with GQA dk/dv, summed in a fixed order instead of
by atomics); the block-sparse backward has no such form here and refuses to run under the switch.

Block sparsity (``tiles=``, a ``TileSlice``): FA4's own (``flash_attn.cute.block_sparsity.BlockSparseTensorsTorch``):
per 128-row query block the 128-key blocks to run, "full" ones without a mask and partial ones through a
``mask_mod``; the backward takes the transposed layout (per key block, the query blocks). ``tile_metadata`` builds
both on the call's device from the slice (unit-sampled tile indices, one pass of tensor ops, no host loop, no host
sync: what can run and whether partial blocks can occur is read off the rows' host positions, ``row_units``; the mask
only by device ops) and keeps them in the slice's cache: a slice that lives on its problem converts once. Kernel
blocks whose query and key rows each lie in one tile run as full or are skipped; the causal diagonal runs with FA4's
own causal mask; where a tile edge or padded keys can cut a block (decided from the positions, whatever the mask
selects) the call's partial blocks run through ``mask_mod.tile_mask_mod`` (aux tensors: the rows' tile indices and
the tile mask), or, where that route is unavailable here, the call is refused (``why_not``) so the registry picks
another kernel. A superset of the mask never runs.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
from functools import lru_cache
from typing import Optional

import torch

from .base import Capabilities, Kernel, KernelCall, LseFunction, package_device_problem

PACKAGE = "flash-attn-4"
INSTALL_HINT = "pip install 'megatron_sp_ext[fa4]'"
_FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
             "return_lse")
_BWD_ARGS = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "cu_seqlens_q", "cu_seqlens_k",
             "max_seqlen_q", "max_seqlen_k", "deterministic")
DTYPES = (torch.bfloat16, torch.float16)
ARCH_MAJORS = (9, 10)   # Hopper (SM90) and Blackwell datacenter (SM100): FA4's forward AND backward kernels


def _interface():
    return importlib.import_module("flash_attn.cute.interface")


@lru_cache(maxsize=None)
def installed() -> bool:
    """Whether ``flash_attn.cute`` (flash-attn-4) can be found here (not imported)."""
    try:
        return importlib.util.find_spec("flash_attn") is not None and \
            importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


@lru_cache(maxsize=None)
def schema_ok() -> bool:
    """Whether the installed FA4 has the block calls with the argument names this module passes."""
    try:
        mod = _interface()
        fwd = inspect.signature(mod._flash_attn_fwd).parameters
        bwd = inspect.signature(mod._flash_attn_bwd).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return False
    return all(a in fwd for a in _FWD_ARGS) and all(a in bwd for a in _BWD_ARGS)


# FA4 4.0.0b36's backward on an H100 was wrong at head dims 8 and 16 (dq/dk/dv up to 100% relative error from 90
# tokens on, and in its varlen call at every length; the forward right), right at 64 and 128
# (tests/gpu/check_fa4_layouts.py, 2026-11-25, results/2026-11-25_h100x2_sparse): head dims below MIN_HEAD_DIM
# (32 and 48 unchecked) go to the next kernel.
MIN_HEAD_DIM = 64


def head_dim_ok(head_dim: int, device: torch.device) -> bool:
    """FA4's head-dim rule as checked here: a multiple of 8 in [MIN_HEAD_DIM, 256] on SM90, [MIN_HEAD_DIM, 128] or
    256 on SM100."""
    if head_dim % 8 or head_dim < MIN_HEAD_DIM:
        return False
    if torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10:
        return head_dim <= 128 or head_dim == 256
    return head_dim <= 256


def why_not(device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> Optional[str]:
    """None if FA4 runs for (device, dtype, head_dim) here, else the reason in a user's words."""
    device = torch.device(device)
    problem = package_device_problem(installed(), PACKAGE, INSTALL_HINT, device, ARCH_MAJORS)
    if problem is not None:
        return problem
    if dtype not in DTYPES:
        return f"it takes bf16 or fp16, not {dtype}"
    if head_dim is not None and not head_dim_ok(head_dim, device):
        return (f"head dim {head_dim} is not one it runs right here (a multiple of 8 from {MIN_HEAD_DIM} up to 256 on "
                f"Hopper, 128 or 256 on Blackwell; its backward was measured wrong at head dims 8 and 16)")
    if not schema_ok():
        return f"the installed {PACKAGE} lacks the block calls this library uses (a different version)"
    return None


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> the [B, S, H, D] view FA4 takes (no copy)."""
    return x.transpose(1, 2)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (out [B, H, Sq, D] in q's dtype, lse fp32 [B, H, Sq])."""
    res = _interface()._flash_attn_fwd(_bshd(q), _bshd(k), _bshd(v), softmax_scale=scale, causal=causal,
                                       return_lse=True)
    return _bshd(res[0]), res[1]


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block gradients (dq [B, H, Sq, D], dk/dv [B, Hkv, Sk, D]) given the rows' FINAL out and lse."""
    dq, dk, dv = _interface()._flash_attn_bwd(_bshd(q), _bshd(k), _bshd(v), _own(_bshd(out)), _bshd(do),
                                              lse.float().contiguous(), scale, causal,
                                              deterministic=torch.are_deterministic_algorithms_enabled())[:3]
    return _bshd(dq), _bshd(dk), _bshd(dv)


def _own(out: torch.Tensor) -> torch.Tensor:
    """The backward's ``out`` ([B, S, H, D] / [T, H, D] view) in FA4's own memory order, as its forward wrote it and
    its autograd Function hands it back (no copy when it already is; a head-major out, which no other caller gives
    FA4, is copied). Defensive: seen with the dynamic-SP Ulysses path's wrong dq on an H100, not shown to be its
    cause (docs/dynamic_sp.md)."""
    return out.contiguous()


def _thd(x: torch.Tensor) -> torch.Tensor:
    """[1, H, S, D] -> the [S, H, D] view the varlen call takes."""
    return x[0].transpose(0, 1)


def _cu_args(cu: tuple[int, ...], device) -> tuple[torch.Tensor, int]:
    return torch.tensor(cu, dtype=torch.int32, device=device), max([b - a for a, b in zip(cu, cu[1:])] + [1])


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: tuple[int, ...], scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed samples in one call: (out [1, H, S, D], lse fp32 [1, H, S])."""
    cu_t, m = _cu_args(cu, q.device)
    res = _interface()._flash_attn_fwd(_thd(q), _thd(k), _thd(v), cu_seqlens_q=cu_t, cu_seqlens_k=cu_t,
                                       max_seqlen_q=m, max_seqlen_k=m, softmax_scale=scale, causal=causal,
                                       return_lse=True)
    return res[0].transpose(0, 1).unsqueeze(0), res[1].reshape(1, q.shape[1], q.shape[2]).float()


def varlen_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu: tuple[int, ...], scale: float, causal: bool) -> list[torch.Tensor]:
    """[dq, dk, dv] ([1, H or Hkv, S, D]) of ``varlen_forward`` given the final out / lse."""
    cu_t, m = _cu_args(cu, q.device)
    dq, dk, dv = _interface()._flash_attn_bwd(
        _thd(q), _thd(k), _thd(v), _own(_thd(out)), _thd(do), lse[0].float().contiguous(), scale, causal,
        cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, max_seqlen_q=m, max_seqlen_k=m,
        deterministic=torch.are_deterministic_algorithms_enabled())[:3]
    return [t.transpose(0, 1).unsqueeze(0) for t in (dq, dk, dv)]


# ---------------------------------------------------------------------------------------- block sparsity
KERNEL_BLOCK = 128   # FA4's SM90 tiles at head dim <= 128: forward 128 x 128, backward 64 (or 80) x 128
UNITS = (128, 64, 32, 16)


def _block_sparse_class():
    return importlib.import_module("flash_attn.cute.block_sparsity").BlockSparseTensorsTorch


def _unit(tile_idx: torch.Tensor, extra: Optional[torch.Tensor] = None) -> int:
    """The largest u of UNITS such that every aligned group of u rows has one tile index (and one ``extra`` value):
    0 when none (rows finer than 16). ``tile_idx`` on the host (the rows' positions are host data): no device sync."""
    n = tile_idx.numel()
    for u in UNITS:
        pad = (-n) % u
        t = torch.nn.functional.pad(tile_idx, (0, pad), value=-1)
        groups = t.view(-1, u)
        first = groups[:, :1]
        same = (groups == first) | (groups == -1)
        if extra is not None:
            e = torch.nn.functional.pad(extra.long(), (0, pad), value=-1).view(-1, u)
            same = same & ((e == e[:, :1]) | (e == -1))
        if bool(same.all()):
            return u
    return 0


def block_lists(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts int32 [..., R], ascending column indices int32 [..., R, C] (selected first, then the others)) of a
    bool [..., R, C], by two running counts and a scatter (a sort of the rows took ~3.4 ms per wan-14b top-k step on
    an H100). The index tensor keeps the full width C: a compact one (width = the largest count) made every FA4 call
    fail with "Expected strides[leading_dim] == 1, but got <width>" on an H100 (2026-11-25, FA4 4.0.0b36)."""
    c = sel.shape[-1]
    picked = sel.to(torch.int32)
    counts = picked.sum(-1, dtype=torch.int32)
    before = picked.cumsum(-1, dtype=torch.int32) - picked              # selected columns left of each column
    slot = torch.where(sel, before, counts.unsqueeze(-1) + torch.arange(c, device=sel.device, dtype=torch.int32)
                       - before)                                       # unselected: after all the selected ones
    col = torch.arange(c, device=sel.device, dtype=torch.int32).expand_as(slot)
    idx = torch.empty_like(slot).scatter_(-1, slot.long(), col)
    return counts, idx.contiguous()


class TileMeta:
    """FA4's block-sparse tensors of one call (forward and backward layouts), and the aux tensors of its partial
    blocks' mask_mod (None when every listed block is full or a plain causal diagonal)."""

    def __init__(self, fwd, bwd, aux: Optional[list], causal_in_kernel: bool, per_head: bool) -> None:
        self.fwd, self.bwd, self.aux = fwd, bwd, aux
        self.causal_in_kernel = causal_in_kernel
        self.per_head = per_head


def tile_metadata(ts, sq: int, sk: int, causal: bool, partial_ok: bool = True) -> Optional[TileMeta]:
    """``TileMeta`` of the slice ``ts`` for a call of ``sq`` query and ``sk`` key rows; None when the call needs a
    partial route this build lacks (``partial_ok`` False), rows finer than 16 tokens per tile, or causal over
    rows that are not identical increasing positions. Cached in ``ts.cache``. Decided on the host from the rows'
    positions, built on the device from the mask: no host sync (``_build_meta``)."""
    key = ("fa4_meta", sq, sk, bool(causal), bool(partial_ok))
    if key in ts.cache:
        return ts.cache[key]
    meta = _build_meta(ts, sq, sk, causal, partial_ok)
    ts.cache[key] = meta
    return meta


def aux_rows(n: int) -> int:
    """Rows of a per-row aux tensor of a call with ``n`` rows: whole kernel blocks plus one spare block (a kernel tile
    that runs past the last block boundary reads no further)."""
    return (-(-n // KERNEL_BLOCK) + 1) * KERNEL_BLOCK


def pad_to(x: torch.Tensor, n: int, value: int) -> torch.Tensor:
    """int32 contiguous copy of the 1-D ``x`` padded with ``value`` to ``n`` rows."""
    return torch.nn.functional.pad(x.to(torch.int32), (0, n - x.shape[0]), value=value).contiguous()


def row_units(ts, sk: int) -> Optional[tuple[int, int, bool]]:
    """(uq, uk, aligned) of the slice, from the rows' positions on the host: the row units (``_unit``: every aligned
    group of uq query / uk key rows inside one tile; None when finer than 16) and whether no kernel block can be
    partial whatever the mask says (each 128-row block inside one tile on both sides, and each 128-key block all
    valid or all padding): then no mask_mod is needed."""
    bs = ts.tile
    if ts.contiguous:   # rows 0..S-1: the units are the tile's alignment, known without looking
        uq = uk = next((u for u in UNITS if bs % u == 0), 0)
        n = ts.kv_valid_len
        homogeneous = n is None or n >= sk or n % KERNEL_BLOCK == 0
    else:
        uq, uk = _unit(ts.q_pos // bs), _unit(ts.k_pos // bs)
        valid = ts.valid_keys()
        homogeneous = True
        if valid is not None:
            blocks = torch.nn.functional.pad(valid, (0, (-sk) % KERNEL_BLOCK), value=True).view(-1, KERNEL_BLOCK)
            edge = torch.nn.functional.pad(valid, (0, (-sk) % KERNEL_BLOCK), value=False).view(-1, KERNEL_BLOCK)
            homogeneous = bool((blocks.all(1) | ~edge.any(1)).all())
    if uq == 0 or uk == 0:
        return None
    return uq, uk, uq == KERNEL_BLOCK and uk == KERNEL_BLOCK and homogeneous


def _build_meta(ts, sq, sk, causal, partial_ok):
    """The host decides from the rows' positions (``row_units``; causal needs identical increasing rows) whether FA4
    runs the call and whether partial blocks (and so the mask_mod) can occur; the device builds the block lists
    from the mask (no ``.item()``, ``nonzero`` or Python branch on a tensor value)."""
    if causal and not ts.identical_increasing():
        return None   # FA4's causal is tril over the rows: only for identical, increasing positions
    units = row_units(ts, sk)
    if units is None:
        return None
    uq, uk, aligned = units
    needs_mod = not aligned
    if needs_mod and not partial_ok:
        return None
    dev = ts.device
    rows = ts.mask_rows()                               # [h or 1, T, T]
    per_head = rows.shape[0] > 1
    m_units = rows.index_select(1, ts.tiles_of_rows("q", uq)).index_select(2, ts.tiles_of_rows("k", uk))  # [h, Uq, Uk]
    nq, nk = -(-sq // KERNEL_BLOCK), -(-sk // KERNEL_BLOCK)
    rq, rk = KERNEL_BLOCK // uq, KERNEL_BLOCK // uk
    pad_q, pad_k = nq * rq - m_units.shape[1], nk * rk - m_units.shape[2]
    h = m_units.shape[0]
    m_any = torch.nn.functional.pad(m_units, (0, pad_k, 0, pad_q), value=False).view(h, nq, rq, nk, rk)
    m_all = torch.nn.functional.pad(m_units, (0, pad_k, 0, pad_q), value=True).view(h, nq, rq, nk, rk)
    valid = ts.valid_keys_on_device()
    pad_v = nk * KERNEL_BLOCK - sk                      # padded keys, per key block: all valid / any valid
    v_all = torch.nn.functional.pad(valid, (0, pad_v), value=True).view(nk, KERNEL_BLOCK).all(1)
    v_any = torch.nn.functional.pad(valid, (0, pad_v), value=False).view(nk, KERNEL_BLOCK).any(1)
    anyb = m_any.any(4).any(2) & v_any                  # [h, nq, nk]; may over-count: a partial block is exact
    allb = m_all.all(4).all(2) & v_all
    if causal:
        i = torch.arange(nq, device=dev).view(nq, 1)
        j = torch.arange(nk, device=dev).view(1, nk)
        anyb = anyb & (j <= i)
        full = allb & (j < i)   # the diagonal: partial, run with FA4's causal mask (or the mask_mod's causal)
    else:
        full = allb & anyb
    partial = anyb & ~full
    cls = _block_sparse_class()
    fc, fi = block_lists(full)
    mc, mi = block_lists(partial)
    fct, fit = block_lists(full.transpose(1, 2))
    mct, mit = block_lists(partial.transpose(1, 2))
    add_b = lambda t: t.unsqueeze(0)  # noqa: E731 - [B=1 (broadcast), h, ...]
    fwd = cls(add_b(mc), add_b(mi), add_b(fc), add_b(fi), block_size=(KERNEL_BLOCK, KERNEL_BLOCK))
    bwd = cls(add_b(mct), add_b(mit), add_b(fct), add_b(fit), block_size=(KERNEL_BLOCK, KERNEL_BLOCK))
    aux = None
    if needs_mod:   # the mask_mod decides every element of a partial block: tiles, padded keys, causal
        t = rows.shape[-1]
        qt, kt = ts.tiles_of_rows("q"), ts.tiles_of_rows("k")
        tile_mask = torch.nn.functional.pad(rows, (0, 1), value=False).to(torch.int32).contiguous()
        # FA4 calls the mask_mod for every row and column of a partial kernel block, also past sq / sk in the last
        # one: the per-row aux tensors run to aux_rows(n) so those reads stay inside them (query rows past sq read
        # tile 0, their output is dropped; key columns past sk read the sentinel tile T, masked). Unpadded, the
        # reads past the end took garbage tile indices into the tile mask: an illegal memory access on an H200
        # (2026-11-25) where an H100 had passed the same cases.
        lq, lk = aux_rows(sq), aux_rows(sk)
        aux = [pad_to(qt, lq, 0), pad_to(torch.where(valid, kt, torch.full_like(kt, t)), lk, t), tile_mask]
        if causal:
            qp, kp = ts.positions_on_device()
            aux += [pad_to(qp, lq, 0), pad_to(kp, lk, 0)]
    return TileMeta(fwd, bwd, aux, causal_in_kernel=causal and aux is None, per_head=per_head)


def _mask_mod(meta: TileMeta, causal: bool):
    from . import fa4_mask_mod  # noqa: PLC0415 - imports the CuTe DSL, only where partial blocks run
    return fa4_mask_mod.tile_mask_mod(meta.per_head, causal)


def tile_forward(q, k, v, scale: float, causal: bool, meta: TileMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """One block under a tile slice's metadata: (out [B, H, Sq, D], lse fp32 [B, H, Sq]); rows that select nothing:
    out 0, lse -inf."""
    kw = {}
    if meta.aux is not None:
        kw = {"mask_mod": _mask_mod(meta, causal), "aux_tensors": meta.aux}
    res = _interface()._flash_attn_fwd(_bshd(q), _bshd(k), _bshd(v), softmax_scale=scale,
                                       causal=meta.causal_in_kernel, return_lse=True,
                                       block_sparse_tensors=meta.fwd, **kw)
    out, lse = _bshd(res[0]), res[1]
    return out, lse


def tile_backward(do, q, k, v, out, lse, scale: float, causal: bool, meta: TileMeta):
    """(dq, dk, dv) of ``tile_forward``'s block given the rows' FINAL out/lse."""
    if torch.are_deterministic_algorithms_enabled():
        raise RuntimeError("FA4's block-sparse backward has no deterministic form here (it needs a dq write order "
                           "this library does not build), and torch's deterministic algorithms are on "
                           "(--deterministic-mode): give --sparse-attention-kernel math (backend=\"math\" for a "
                           "block_sparse_attention call), or leave the deterministic mode off")
    kw = {}
    if meta.aux is not None:
        kw = {"mask_mod": _mask_mod(meta, causal), "aux_tensors": meta.aux}
    dq, dk, dv = _interface()._flash_attn_bwd(_bshd(q), _bshd(k), _bshd(v), _own(_bshd(out)), _bshd(do),
                                              lse.float().contiguous(), scale, meta.causal_in_kernel,
                                              block_sparse_tensors=meta.bwd, **kw)[:3]
    return _bshd(dq), _bshd(dk), _bshd(dv)


# ---------------------------------------------------------------------------------------- the registry's kernel
class FA4Kernel(Kernel):
    """FlashAttention-4: plain, log-sum-exp, varlen ("fa4_varlen"), GQA without expansion, block sparsity at
    128-token kernel blocks (partial blocks through a mask_mod where its probe passed)."""

    name = setting = "fa4"
    label = "FlashAttention-4"
    package = PACKAGE
    install_hint = INSTALL_HINT
    caps = Capabilities(plain=True, lse=True, varlen="fa4_varlen", tiles="kernel_blocks",
                        dropout=False, dtypes={"cuda": DTYPES}, archs=ARCH_MAJORS, deterministic="dense")
    probe_failures = Exception   # a package of its own, compiled at first call: any failure of its probe = not here

    def __init__(self) -> None:
        self.probed: dict = {}
        self.probe_failures_seen: dict = {}

    def installed(self) -> bool:
        return installed()

    def schema_ok(self) -> bool:
        return installed() and schema_ok()

    def device_reason(self, call: KernelCall) -> Optional[str]:
        return why_not(call.device, call.dtype, call.head_dim)   # FA4's own rules (device, arch, dtype, head dim)

    def why_not_here(self, call: KernelCall) -> Optional[str]:
        return None if call.tiles is None else self.why_not_tiles(call)

    def why_not_tiles(self, call: KernelCall) -> Optional[str]:
        """Tile slices FA4 cannot run exactly here: rows finer than 16 tokens per tile, causal over rows that are not
        the same increasing positions, or partial kernel blocks where the mask_mod route failed its probe."""
        ts = call.tiles
        sq, sk = ts.q_pos.numel(), ts.k_pos.numel()
        meta = tile_metadata(ts, sq, sk, call_causal(call))
        if meta is None:
            return "its block sparsity needs tiles of >= 16 tokens per row group (and, with causal, identical " \
                   "query and key positions)"
        if not self.route_ok(call.device, call.dtype, partial=False):
            return f"its block sparsity failed its probe here " \
                   f"({self.probe_failures_seen.get((str(call.device), call.dtype, False))})"
        if meta.aux is not None and not self.route_ok(call.device, call.dtype, partial=True):
            return "tiles that cut its 128-token blocks (or padded keys inside one) need its mask_mod route, which " \
                   f"failed its probe here ({self.probe_failures_seen.get((str(call.device), call.dtype, True))})"
        return None

    def route_ok(self, device, dtype, partial: bool) -> bool:
        """Whether FA4's block sparsity (``partial``: partial blocks through the mask_mod) runs right here: a probe
        against math, once per (device, dtype, route). A probe that RAISES is tried once more (seen once, 1 x H100
        2026-11-25: the partial probe failed in 2 ranks compiling at once, and passed in a single process); one that
        computes wrong results is not. The reason is kept for the refusal's message."""
        key = (str(device), dtype, partial)
        if key not in self.probed:
            from . import fa4_mask_mod  # noqa: PLC0415
            ok, reason = False, None
            for _ in range(2):
                ok, reason = fa4_mask_mod.probe(self, device, dtype, partial)
                if ok or not reason.startswith("raised"):
                    break
            self.probed[key] = ok
            self.probe_failures_seen[key] = reason
        return self.probed[key]

    def prepare(self, tiles, sq, sk, causal):
        tile_metadata(tiles, sq, sk, causal)

    def attention(self, q, k, v, causal, scale, tiles=None):
        return LseFunction.apply(q, k, v, self, causal, scale, tiles)

    def forward(self, q, k, v, scale, causal, tiles=None):
        if tiles is None:
            return forward(q, k, v, scale, causal)
        meta = tile_metadata(tiles, q.shape[2], k.shape[2], causal)
        return tile_forward(q, k, v, scale, causal, meta)

    def backward(self, do, q, k, v, out, lse, scale, causal, tiles=None):
        if tiles is None:
            return backward(do, q, k, v, out, lse, scale, causal)
        meta = tile_metadata(tiles, q.shape[2], k.shape[2], causal)
        return tile_backward(do, q, k, v, out, lse, scale, causal, meta)

    def varlen_forward(self, q, k, v, cu, scale, causal):
        return varlen_forward(q, k, v, cu, scale, causal)

    def varlen_backward(self, do, q, k, v, out, lse, cu, scale, causal):
        return varlen_backward(do, q, k, v, out, lse, cu, scale, causal)


def call_causal(call: KernelCall) -> bool:
    """Whether ``call`` asks for causal attention (a need named "causal")."""
    return "causal" in call.needs
