"""cuDNN frontend's block-sparse attention (the pip package ``nvidia-cudnn-frontend``, module
``cudnn.block_sparse_attention``; CuTe DSL kernels with native 64- and 128-token blocks on Hopper SM90 and Blackwell
SM100) as a block-sparse kernel with log-sum-exp and a backward from the rows' FINAL out/lse (ring steps,
head-chunked blocks).

Shapes (this module's side): q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (bhsd, stride(-1) == 1; GQA: H % Hkv == 0), out
[B, H, Sq, D] bf16, lse fp32 [B, H, Sq] (natural log; cuDNN writes -inf for rows that select nothing). cuDNN takes
q/k/v as bhsd or bshd (here bshd when q's storage is [B, S, H, D], so no copy), per query block a list of key blocks
``q2k_block_index`` int32 [B, H, nq, cap] (the first ``q2k_block_nums`` [B, H, nq] entries count) and per key block the
number of valid keys ``block_sizes`` int32 [nk] (padding at a block's end).

What cuDNN runs (1.32.0, read from the wheel): NON-causal attention over whole blocks (no mask inside a block);
the backward is bf16 only, MHA only (k/v are expanded to H heads here, dk/dv summed back per kv head), head dim 128
on SM90 (64 or 128 at 128-token blocks on SM100). So:
  - a call runs when its rows split into kernel blocks (b = 128 or 64 rows) each inside ONE tile of the mask
    (``block_of``): the block grid is then exact, no superset of the mask ever runs; a short last block (Sq or Sk not
    a multiple of b: the DiT's last tile on Wan's grids) is padded here, its missing keys masked by ``block_sizes``;
  - causal (identical, increasing query and key positions, as FA4's): the blocks below the diagonal run on cuDNN,
    the diagonal blocks (tril inside one block) as one batched causal call of FlashAttention-4 (the math kernel where
    FA4 does not run), merged by log-sum-exp; the backward runs both from the FINAL
    out/lse and adds the gradients (the ring's contract);
  - padded keys (``kv_valid_len``) must form the end of each key block they sit in (``block_sizes``); not with causal.
Anything else is refused by ``why_not`` so the registry picks another kernel (FA4, flex, math); nothing runs a
different mask. Rows or blocks cuDNN leaves out (no listed block) get zero gradients here whatever the package
writes there (its SM90 128-token backward allocates dq/dk/dv with ``torch.empty``).

Metadata (``block_metadata``): built on the call's device from the slice by tensor ops (no host loop, no host sync:
whether cuDNN runs the call is read off the rows' host positions, the mask only by device ops; the blocks without a
listed pair are a device mask, zeroed by one masked write), kept in the slice's cache (keyed on rows, sizes, causal;
the per-(B, H) expansion cuDNN's shape check wants in the metadata object), so a slice that lives on its problem
converts once.
The package is imported at the first call only (this module imports with torch alone).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from functools import lru_cache
from typing import Optional

import torch

from ..lse import merge
from .base import Capabilities, Kernel, KernelCall, LseFunction, package_device_problem
from . import fa4
from .fa4 import block_lists
from .math import MathKernel

PACKAGE = "nvidia-cudnn-frontend"
INSTALL_HINT = "pip install nvidia-cudnn-frontend==1.32.0 (needs nvidia-cutlass-dsl[cu13] and apache-tvm-ffi)"
MODULE = "cudnn.block_sparse_attention"
DTYPES = (torch.bfloat16,)   # its backward is bf16 only (forward also fp16: not offered, a training kernel)
ARCH_MAJORS = (9, 10)        # SM90 (sm90_blk64 / sm90_blk128) and SM100 (sm100_blk64 / sm100_blk128): fwd AND bwd
BLOCKS = (128, 64)           # cuDNN's sparse block sizes, the larger tried first


def api():
    """The package's public module (``block_sparse_attention_forward`` / ``_backward``)."""
    return importlib.import_module(MODULE)


@lru_cache(maxsize=None)
def installed() -> bool:
    """Whether ``cudnn.block_sparse_attention`` is here, found without importing ``cudnn`` (its import loads a
    compiled module and cuDNN)."""
    try:
        spec = importlib.util.find_spec("cudnn")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(os.path.isfile(os.path.join(loc, "block_sparse_attention", "api.py"))
               for loc in spec.submodule_search_locations)


@lru_cache(maxsize=None)
def import_problem() -> Optional[str]:
    """None if ``cudnn.block_sparse_attention`` imports, else why not (a package found but not whole: e.g. installed
    without its CuTe DSL, ``No module named 'cutlass'``). Imported once, only when a CUDA call would use it."""
    try:
        api()
    except Exception as e:   # noqa: BLE001 - any failure of a third-party import means: not usable here
        return f"the package {PACKAGE!r} is installed but does not import ({type(e).__name__}: {e}; {INSTALL_HINT})"
    return None


def head_dims(device: torch.device) -> tuple:
    """The head dims its backward takes on ``device``: 128 on SM90, 64 (128-token blocks only) or 128 on SM100."""
    if torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10:
        return (64, 128)
    return (128,)


def why_not(device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> Optional[str]:
    """None if the package runs for (device, dtype, head_dim) here, else the reason in a user's words."""
    device = torch.device(device)
    problem = package_device_problem(installed(), PACKAGE, INSTALL_HINT, device, ARCH_MAJORS)
    if problem is not None:
        return problem
    broken = import_problem()
    if broken is not None:
        return broken
    if dtype not in DTYPES:
        return f"its backward takes bf16 only, not {dtype}"
    if head_dim is not None and head_dim not in head_dims(device):
        return f"its backward takes head dim {' or '.join(map(str, head_dims(device)))} here, not {head_dim}"
    return None


# ---------------------------------------------------------------------------------------- metadata
def one_tile_per_group(tile_idx: torch.Tensor, b: int) -> bool:
    """Whether every aligned group of ``b`` rows has one tile index (``tile_idx`` [n] on the host; a last group
    shorter than b counts its rows only)."""
    pad = (-tile_idx.numel()) % b
    groups = torch.nn.functional.pad(tile_idx, (0, pad), value=-1).view(-1, b)
    return bool(((groups == groups[:, :1]) | (groups == -1)).all())


def block_of(ts, sq: int, sk: int) -> Optional[int]:
    """The kernel block (128 or 64 rows) of the call: every aligned group of its query and key rows inside one tile
    (the last group may be shorter: padded here, its missing keys masked by ``block_sizes``); None when neither fits.
    Decided on the host (rows contiguous: from the tile size alone; else from the rows' host positions)."""
    if sq == 0 or sk == 0:
        return None
    for b in BLOCKS:
        if ts.contiguous:
            if ts.tile % b == 0:
                return b
            continue
        if one_tile_per_group(ts.q_pos // ts.tile, b) and one_tile_per_group(ts.k_pos // ts.tile, b):
            return b
    return None


def zero_dead(x: torch.Tensor, live: torch.Tensor, block: int, fill: float = 0.0) -> torch.Tensor:
    """``x`` [B, H, n * block, ...] (any strides: the kernel's bshd storage seen as bhsd) with the rows of the blocks
    that are not ``live`` ([h, n] bool on x's device; h = 1 covers every head) set to ``fill`` IN PLACE (the other rows
    untouched), by one masked write on the device (no host sync, whatever the mask). Returns ``x``."""
    by_block = x.unflatten(2, (x.shape[2] // block, block))          # a view: the writes land in x
    dead = ~live
    by_block.masked_fill_(dead.view(1, *dead.shape, *([1] * (by_block.dim() - 3))), fill)
    return x


class BlockMeta:
    """cuDNN's block lists of one call: kernel block ``block``; ``index`` int32 [h, nq, nk] (each query block's key
    blocks, selected first, ascending), ``nums`` int32 [h, nq], ``sizes`` int32 [nk] (valid keys per key block) or
    None; ``q_live`` / ``k_live`` bool [h, nq] / [h, nk]: blocks with a listed pair (cuDNN writes their gradients; the
    others' rows are zeroed after the kernel, ``zero_dead``); ``diag`` bool [h, nq]: the causal diagonal blocks
    selected (None when not causal). h = the mask's rows for the call (1: every head). All on the mask's device."""

    def __init__(self, block, index, nums, sizes, q_live, k_live, diag) -> None:
        self.block, self.index, self.nums, self.sizes = block, index, nums, sizes
        self.q_live, self.k_live, self.diag = q_live, k_live, diag
        self.expanded: dict = {}

    def lists(self, batch: int, heads: int, device: torch.device) -> tuple:
        """(q2k_block_index [B, H, nq, nk], q2k_block_nums [B, H, nq], block_sizes [nk] or None) as cuDNN checks them
        (contiguous int32 on q's ``device``: a mask kept elsewhere is copied once), kept per (B, H, device)."""
        key = (batch, heads, str(device))
        if key not in self.expanded:
            h, nq, nk = self.index.shape
            self.expanded[key] = (self.index.to(device).unsqueeze(0).expand(batch, heads, nq, nk).contiguous(),
                                  self.nums.to(device).unsqueeze(0).expand(batch, heads, nq).contiguous(),
                                  self.sizes.to(device) if self.sizes is not None else None)
        return self.expanded[key]

    def live(self, which: str, device: torch.device) -> torch.Tensor:
        """``q_live`` or ``k_live`` (``which`` "q" / "k") on ``device`` (copied once when the mask lives elsewhere)."""
        live = self.q_live if which == "q" else self.k_live
        if live.device == torch.device(device):
            return live
        key = (which, str(device))
        if key not in self.expanded:
            self.expanded[key] = live.to(device)
        return self.expanded[key]


def block_metadata(ts, sq: int, sk: int, causal: bool) -> Optional[BlockMeta]:
    """``BlockMeta`` of the slice ``ts`` for a call of ``sq`` x ``sk`` rows, or None when cuDNN cannot run it exactly
    (``why_not_tiles`` says why). Cached in ``ts.cache``."""
    key = ("cudnn_bsa_meta", sq, sk, bool(causal))
    if key not in ts.cache:
        ts.cache[key] = _build(ts, sq, sk, causal)
    return ts.cache[key]


def _build(ts, sq, sk, causal) -> Optional[BlockMeta]:
    """Whether cuDNN runs the call is decided on the host from the rows' positions (block, causal rows, padding at
    the ends of key blocks); the lists are built on the device from the mask (no host sync)."""
    b = block_of(ts, sq, sk)
    if b is None:
        return None
    padded = ts.padded()
    if causal and (padded or sq != sk or not ts.identical_increasing()):
        return None
    nq, nk = -(-sq // b), -(-sk // b)
    if padded and not ts.contiguous:   # padded keys in the middle of a block: block_sizes cannot say it
        host = torch.nn.functional.pad(ts.valid_keys(), (0, nk * b - sk), value=False).view(nk, b)
        if not bool((host == (torch.arange(b) < host.sum(1, keepdim=True))).all()):
            return None
    rows = ts.mask_rows()                                                        # [h or 1, T, T]
    sel = rows.index_select(1, ts.tiles_of_rows("q", b)).index_select(2, ts.tiles_of_rows("k", b))  # [h, nq, nk]
    sizes = None
    if padded or sk % b:   # valid keys per key block: padding (kv_valid_len) and the rows past sk (a short last block)
        valid = torch.nn.functional.pad(ts.valid_keys_on_device(), (0, nk * b - sk), value=False).view(nk, b)
        counts = valid.sum(1, dtype=torch.int32)
        sizes = counts.contiguous()
        sel = sel & (counts > 0)
    diag = None
    if causal:
        i = torch.arange(nq, device=ts.device)
        diag = sel[:, i, i].contiguous()                                          # [h, nq]
        sel = sel & (i.view(1, nq) < i.view(nq, 1))                               # strictly below the diagonal
    nums, index = block_lists(sel)
    return BlockMeta(b, index, nums, sizes, sel.any(2), sel.any(1), diag)


# ---------------------------------------------------------------------------------------- calls
def _layout(q: torch.Tensor) -> str:
    """cuDNN's layout for q's storage: "bshd" when q is a [B, S, H, D] tensor seen as bhsd (no copy), else "bhsd"."""
    return "bshd" if q.transpose(1, 2).is_contiguous() else "bhsd"


def _to(x: torch.Tensor, layout: str) -> torch.Tensor:
    """bhsd ``x`` in cuDNN's ``layout``, contiguous (no copy when it already is)."""
    return x.transpose(1, 2).contiguous() if layout == "bshd" else x.contiguous()


def _from(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2) if layout == "bshd" else x


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v [B, Hkv, S, D] with H heads (cuDNN's backward is MHA only; the forward gets the same tensors)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def bsa_forward(q, k, v, scale: float, meta: BlockMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's block-sparse forward over the listed blocks: (out [B, H, Sq, D], lse fp32 [B, H, Sq])."""
    batch, heads = q.shape[:2]
    lay = _layout(q)
    idx, nums, sizes = meta.lists(batch, heads, q.device)
    res = api().block_sparse_attention_forward(
        _to(q, lay), _to(_expand_kv(k, heads), lay), _to(_expand_kv(v, heads), lay), idx, block_sizes=sizes,
        q2k_block_nums=nums, sparse_block_size=meta.block, allow_empty_block_nums=True, softmax_scale=scale,
        layout=lay)
    # query blocks without a listed key block: out 0, lse -inf whatever the kernel wrote (its SM90 128-token path
    # has no empty-list specialisation of its own); their rows only
    out, lse = _from(res["o_tensor"], lay), res["lse_tensor"]
    q_live = meta.live("q", out.device)
    return zero_dead(out, q_live, meta.block), zero_dead(lse, q_live, meta.block, float("-inf"))


def bsa_backward(do, q, k, v, out, lse, scale: float, meta: BlockMeta):
    """(dq [B, H, Sq, D], dk/dv [B, H, Sk, D] per q head) of the listed blocks given the rows' FINAL out/lse; zero
    on blocks without a listed pair."""
    batch, heads = q.shape[:2]
    lay = _layout(q)
    idx, nums, sizes = meta.lists(batch, heads, q.device)
    res = api().block_sparse_attention_backward(
        _to(do, lay), _to(q, lay), _to(_expand_kv(k, heads), lay), _to(_expand_kv(v, heads), lay), _to(out, lay),
        lse.float().contiguous(), idx, block_sizes=sizes, q2k_block_nums=nums, softmax_scale=scale,
        sparse_block_size=meta.block, layout=lay)
    dq, dk, dv = (_from(res[n], lay) for n in ("dq_tensor", "dk_tensor", "dv_tensor"))
    b = meta.block
    k_live = meta.live("k", dk.device)
    return zero_dead(dq, meta.live("q", dq.device), b), zero_dead(dk, k_live, b), zero_dead(dv, k_live, b)


def _blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    """[B, H, S, D] -> [B * S/b, H, b, D] (one batch entry per block of b rows)."""
    bsz, h, s, d = x.shape
    return x.unflatten(2, (s // b, b)).transpose(1, 2).reshape(bsz * (s // b), h, b, d)


def _unblocks(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of ``_blocks`` (also for lse [B * n, H, b] -> [B, H, S])."""
    n, h = x.shape[0] // batch, x.shape[1]
    y = x.view(batch, n, *x.shape[1:]).transpose(1, 2)
    return y.reshape(batch, h, n * x.shape[2], *x.shape[3:])


def _diag_select(meta: BlockMeta, batch: int, heads: int) -> torch.Tensor:
    """[B * nq, H] bool: whether the causal diagonal block of each (batch, block) is selected for each head."""
    d = meta.diag.t()                                                     # [nq, h], on the mask's device
    return d.unsqueeze(0).expand(batch, d.shape[0], heads).reshape(batch * d.shape[0], heads)


class _FA4Dense:
    """FA4's dense block calls (kernels/fa4.py) in the kernel call signature."""

    forward = staticmethod(fa4.forward)
    backward = staticmethod(fa4.backward)


def dense_kernel(q: torch.Tensor):
    """The dense causal log-sum-exp kernel of the diagonal blocks: FlashAttention-4 where it runs, else the math
    kernel (exact, fp32; small blocks)."""
    return _FA4Dense if fa4.why_not(q.device, q.dtype, q.shape[-1]) is None else MathKernel()


def diag_forward(q, k, v, scale: float, meta: BlockMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected causal diagonal blocks as one batched causal call: (out [B, H, Sq, D], lse fp32 [B, H, Sq]),
    out 0 / lse -inf on rows of unselected ones."""
    batch, heads = q.shape[:2]
    b = meta.block
    qd, kd, vd = _blocks(q, b), _blocks(_expand_kv(k, heads), b), _blocks(_expand_kv(v, heads), b)
    out, lse = dense_kernel(q).forward(qd, kd, vd, scale, True)
    keep = _diag_select(meta, batch, heads).to(q.device)
    out = torch.where(keep[:, :, None, None], out, 0)
    lse = torch.where(keep[:, :, None], lse.float(), float("-inf"))
    return _unblocks(out, batch), _unblocks(lse, batch)


def diag_backward(do, q, k, v, out, lse, scale: float, meta: BlockMeta):
    """(dq [B, H, Sq, D], dk/dv [B, H, Sk, D] per q head) of ``diag_forward``'s blocks given the FINAL out/lse."""
    batch, heads = q.shape[:2]
    b = meta.block
    args = [_blocks(t, b) for t in (do, q, _expand_kv(k, heads), _expand_kv(v, heads), out)]
    lse_d = _blocks(lse.unsqueeze(-1), b).squeeze(-1)
    grads = dense_kernel(q).backward(*args, lse_d, scale, True)
    keep = _diag_select(meta, batch, heads).to(q.device)[:, :, None, None]
    return tuple(_unblocks(torch.where(keep, g, 0), batch) for g in grads)


def _sum_kv_heads(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """dk or dv per q head [B, H, S, D] summed to the kv heads [B, Hkv, S, D] (in fp32)."""
    bsz, h, s, d = g.shape
    return g.float().view(bsz, hkv, h // hkv, s, d).sum(2)


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, H, S, ...] with zero rows appended to n (no copy when S == n)."""
    extra = n - x.shape[2]
    if extra == 0:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, extra))


def tile_forward(q, k, v, scale: float, meta: BlockMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """One block-sparse call: (out [B, H, Sq, D] in q's dtype, lse fp32 [B, H, Sq]); rows that select nothing: out 0,
    lse -inf. Rows past whole kernel blocks are padded here (zero queries, keys masked by ``block_sizes``)."""
    sq = q.shape[2]
    nq, nk = meta.index.shape[1] * meta.block, meta.index.shape[2] * meta.block
    q, k, v = _pad_rows(q, nq), _pad_rows(k, nk), _pad_rows(v, nk)
    out, lse = bsa_forward(q, k, v, scale, meta)
    if meta.diag is not None:
        o2, l2 = diag_forward(q, k, v, scale, meta)
        out, lse = merge([out, o2], [lse, l2])
        out, lse = out.to(q.dtype), lse.float()
    return out[:, :, :sq], lse[:, :, :sq]


def tile_backward(do, q, k, v, out, lse, scale: float, meta: BlockMeta):
    """(dq [B, H, Sq, D], dk/dv [B, Hkv, Sk, D]) of ``tile_forward``'s call given the rows' FINAL out/lse (padded rows:
    zero dO and out, lse 0, so they add nothing)."""
    sq, sk = q.shape[2], k.shape[2]
    nq, nk = meta.index.shape[1] * meta.block, meta.index.shape[2] * meta.block
    do, q, out, lse = _pad_rows(do, nq), _pad_rows(q, nq), _pad_rows(out, nq), _pad_rows(lse.unsqueeze(-1), nq)[..., 0]
    k_p, v_p = _pad_rows(k, nk), _pad_rows(v, nk)
    grads = bsa_backward(do, q, k_p, v_p, out, lse, scale, meta)
    if meta.diag is not None:
        grads = tuple(a.float() + b.float() for a, b in zip(grads, diag_backward(do, q, k_p, v_p, out, lse, scale,
                                                                                 meta)))
    dq, dk, dv = grads[0][:, :, :sq], grads[1][:, :, :sk], grads[2][:, :, :sk]
    hkv = k.shape[1]
    if hkv != q.shape[1]:
        dk, dv = _sum_kv_heads(dk, hkv), _sum_kv_heads(dv, hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------- the registry's kernel
class CudnnBlockSparseKernel(Kernel):
    """cuDNN frontend's block-sparse attention: block masks only (64- and 128-token kernel blocks, whole blocks),
    log-sum-exp and backward from the final out/lse, GQA by expansion, bf16, Hopper and Blackwell."""

    name = setting = "cudnn_block_sparse"
    label = "cuDNN block-sparse attention"
    package = PACKAGE
    install_hint = INSTALL_HINT
    caps = Capabilities(plain=True, lse=True, varlen=None, tiles="kernel_blocks",
                        dropout=False, dtypes={"cuda": DTYPES}, archs=ARCH_MAJORS, dense=False)

    def installed(self) -> bool:
        return installed()

    def device_reason(self, call: KernelCall) -> Optional[str]:
        return why_not(call.device, call.dtype, call.head_dim)

    def why_not_here(self, call: KernelCall) -> Optional[str]:
        if "tiles" not in call.needs:
            return "it runs block-sparse calls only (give a block mask)"
        ts = call.tiles
        if ts is None:   # which kernel a block-sparse call goes to, asked before its slice is known
            return None
        sq, sk = ts.q_pos.numel(), ts.k_pos.numel()
        if block_of(ts, sq, sk) is None:
            return (f"its blocks are 64- or 128-token blocks: each aligned group of 64 of the call's {sq} query / {sk} "
                    f"key rows must lie inside one {ts.tile}-token tile")
        if block_metadata(ts, sq, sk, "causal" in call.needs) is None:
            return ("its kernels are non-causal and mask no token inside a block: causal needs identical increasing "
                    "query and key positions and no padded keys, and padded keys must end the key blocks they sit in")
        return None

    def prepare(self, tiles, sq, sk, causal):
        block_metadata(tiles, sq, sk, causal)

    def attention(self, q, k, v, causal, scale, tiles=None):
        return LseFunction.apply(q, k, v, self, causal, scale, tiles)

    def forward(self, q, k, v, scale, causal, tiles=None):
        return tile_forward(q, k, v, scale, self._meta(q, k, causal, tiles))

    def backward(self, do, q, k, v, out, lse, scale, causal, tiles=None):
        return tile_backward(do, q, k, v, out, lse, scale, self._meta(q, k, causal, tiles))

    def _meta(self, q, k, causal, tiles) -> BlockMeta:
        meta = block_metadata(tiles, q.shape[2], k.shape[2], causal) if tiles is not None else None
        if meta is None:   # the registry asked why_not first; a direct caller gets the reason
            needs = ("lse", "causal") if causal else ("lse",)
            raise ValueError(f"{self.name}: {self.why_not_here(KernelCall.of(q, *needs, tiles=tiles))}")
        return meta
