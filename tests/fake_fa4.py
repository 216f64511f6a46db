"""A CPU stand-in for FlashAttention-4's block calls, so the library's "fa4" branch runs in CPU tests.

``install(monkeypatch)`` puts a module ``flash_attn.cute.interface`` with ``_flash_attn_fwd`` / ``_flash_attn_bwd``
(FA4's argument names, [B, S, H, D] or varlen [T, H, D] + cu_seqlens, GQA taken without expansion, lse [B, H, S] /
[H, T], causal aligned bottom-right as FA4 does) into ``sys.modules`` and lets ``attention.fa4`` run on the CPU for
the dtypes given. The math is blockwise.math_forward/backward in fp32 (fp64 for fp64), so results are checked
against the float64 reference at the dtype's tolerance. ``calls`` counts (name, heads of q, heads of k) per call.

Strict where the real interface (flash-attn-4 4.0.0b36, ``flash_attn/cute/interface.py``) is: every call checks what
FA4 asserts (q/k/v/out/dout of one fp16/bf16 dtype, or those given to ``install``; their shapes; lse fp32 of
exactly FA4's shape: [B, H, Sq], or [H, T] varlen; cu_seqlens int32 with stride 1) and what its kernels ASSUME
without checking: stride 1 on the last dim (the library never relies on FA4's own copy of a tensor without it),
16-byte aligned data pointers and every other stride a multiple of 16 bytes (``to_cute_tensor(assumed_align=16)`` and the divisibility of its compiled
tensors). It does not require FA4's own [B, S, H, D] memory order: the real kernel reads any such strides (the
library's probes pass it head-major dO on a GPU and check it against math); ``calls_log`` keeps, per backward, whether
out / dout were in that order, for tests that want to see which layouts reach the kernel.
"""
from __future__ import annotations

import sys
import types
from typing import NamedTuple, Optional

import torch

from megatron_sp_ext.attention import backends, blockwise, lse_kernels, varlen
from megatron_sp_ext.attention import kernels
from megatron_sp_ext.attention.kernels import fa4, fa4_mask_mod


class BlockSparseTensors(NamedTuple):
    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: Optional[torch.Tensor] = None
    full_block_idx: Optional[torch.Tensor] = None
    cu_total_m_blocks: Optional[torch.Tensor] = None
    cu_block_idx_offsets: Optional[torch.Tensor] = None
    block_size: Optional[tuple] = None


def _own_order(t: torch.Tensor) -> bool:
    """Whether ``t``'s dims lie in memory outermost first (strides non-increasing over the dims of size > 1): FA4's
    own [B, S, H, D] / [T, H, D] order, of which a slice along S or a batch of equal samples is a view too."""
    strides = [st for st, n in zip(t.stride(), t.shape) if n > 1]
    return all(a >= b for a, b in zip(strides, strides[1:]))


def check_tensor(name: str, t: torch.Tensor, dtypes: tuple = (torch.float16, torch.bfloat16)) -> None:
    """What FA4's kernels assume of a q/k/v/out/dout tensor (module docstring); ``dtypes``: those the stand-in takes
    (FA4's fp16/bf16, widened by tests that check the glue against float64)."""
    assert t.dtype in dtypes, f"FA4: {name} must be one of {dtypes}, not {t.dtype}"
    assert t.stride(-1) == 1, f"FA4: {name} must have stride 1 on its last dim (strides {t.stride()})"
    align = 16 // t.element_size()
    assert t.data_ptr() % 16 == 0, f"FA4: {name} must start 16-byte aligned"
    assert all(st % align == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1), \
        f"FA4: {name}'s strides {t.stride()} must be multiples of 16 bytes"


class FakeFA4:
    def __init__(self, dtypes: tuple = (torch.float16, torch.bfloat16)) -> None:
        self.calls: list = []
        self.calls_log: list = []
        self.dtypes = tuple(dtypes)

    @staticmethod
    def _check_cu(cu, total):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.stride(0) == 1, \
            "FA4: cu_seqlens must be int32 with stride 1"
        c = cu.tolist()
        assert c[0] == 0 and c[-1] == total and all(b >= a for a, b in zip(c, c[1:])), f"FA4: bad cu_seqlens {c}"

    def _check_qkv(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, self.dtypes)
        assert q.dtype == k.dtype == v.dtype, "FA4: inputs must have the same dtype"
        assert q.shape[-2] % k.shape[-2] == 0, "FA4: num_head must be divisible by num_head_kv"
        assert q.shape[-1] % 8 == 0 and q.shape[-1] == k.shape[-1], "FA4: head_dim must be a multiple of 8"
        if cu_seqlens_q is None:
            assert q.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0], \
                f"FA4: q/k/v must be [B, S, H, D] (got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})"
        else:
            assert q.dim() == 3 and k.shape == v.shape and k.shape[0] == q.shape[0], \
                f"FA4: varlen q/k/v must be [T, H, D] (got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})"
            self._check_cu(cu_seqlens_q, q.shape[0])
            self._check_cu(cu_seqlens_k, k.shape[0])

    @staticmethod
    def _mask(sq: int, sk: int, causal: bool):
        if not causal:
            return None
        # bottom-right aligned (FA4): query i sees keys j <= i + (sk - sq)
        i = torch.arange(sq).view(sq, 1)
        return torch.arange(sk).view(1, sk) <= i + (sk - sq)

    @staticmethod
    def _segments(cu, total):
        if cu is None:
            return [(0, total)]
        c = [int(x) for x in cu.tolist()]
        return list(zip(c, c[1:]))

    def _flash_attn_fwd(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=False,
                        return_lse=False, block_sparse_tensors=None, mask_mod=None, aux_tensors=None, **unused):
        self._check_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        if block_sparse_tensors is not None:
            self.calls.append(("sparse_fwd", q.shape[-2], k.shape[-2]))
            keep = self._sparse_keep(block_sparse_tensors, q.shape[-2], q.shape[1], k.shape[1], causal, mask_mod,
                                     aux_tensors, transposed=False)
            out, lse = self._fwd(q, k, v, scale, keep)
            return out, lse, None, None, None
        self.calls.append(("fwd" if cu_seqlens_q is None else "varlen_fwd", q.shape[-2], k.shape[-2]))
        if cu_seqlens_q is None:
            out, lse = self._fwd(q, k, v, scale, causal)
            return out, lse, None, None, None
        outs, lses = [], []
        for a, b in self._segments(cu_seqlens_q, q.shape[0]):
            o, lse = self._fwd(q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), scale, causal)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs, 0), torch.cat(lses, 1), None, None, None

    @staticmethod
    def _sparse_keep(bst, heads, sq, sk, causal, mask_mod, aux, transposed):
        """The token keep mask [h or 1, Sq, Sk] that FA4 computes from its block-sparse tensors: listed "full" blocks
        whole, listed partial blocks through the mask_mod (evaluated here from the library's aux-tensor layout,
        kernels/fa4_mask_mod.py) or FA4's causal mask; 128 x 128 blocks. ``transposed``: the backward's layout."""
        bm = bn = 128
        cnt_m, idx_m, cnt_f, idx_f = bst.mask_block_cnt[0], bst.mask_block_idx[0], bst.full_block_cnt[0], \
            bst.full_block_idx[0]
        h = cnt_m.shape[0]
        blocks_full = torch.zeros(h, -(-sq // bm), -(-sk // bn), dtype=torch.bool)
        blocks_part = torch.zeros_like(blocks_full)
        for hh in range(h):
            for r in range(cnt_m.shape[1]):
                for dst, cnt, idx in ((blocks_part, cnt_m, idx_m), (blocks_full, cnt_f, idx_f)):
                    cols = idx[hh, r, :int(cnt[hh, r])].tolist()
                    assert cols == sorted(cols), "block indices must ascend"
                    for c in cols:
                        if transposed:
                            dst[hh, c, r] = True
                        else:
                            dst[hh, r, c] = True
        assert not bool((blocks_full & blocks_part).any()), "a block listed as full and partial"
        rows = torch.arange(sq) // bm
        cols = torch.arange(sk) // bn
        full = blocks_full[:, rows][:, :, cols]
        part = blocks_part[:, rows][:, :, cols]
        if mask_mod is not None:
            # the real kernel calls the mask_mod for every row / column of a partial block, past sq / sk in the last
            # one too: the per-row aux tensors must cover whole blocks, and every tile index read must be in range
            for i, need in ((0, -(-sq // bm) * bm), (1, -(-sk // bn) * bn)) + (((3, -(-sq // bm) * bm),
                                                                              (4, -(-sk // bn) * bn))
                                                                             if len(aux) == 5 else ()):
                assert aux[i].shape[0] >= need, f"aux[{i}] has {aux[i].shape[0]} rows, the kernel reads {need}"
            qt_all, kt_all, tiles = aux[0].long().cpu(), aux[1].long().cpu(), aux[2].cpu().bool()
            nq_read, nk_read = -(-sq // bm) * bm, -(-sk // bn) * bn
            assert 0 <= int(qt_all[:nq_read].min()) and int(qt_all[:nq_read].max()) < tiles.shape[1], \
                "a query row's tile index past the tile mask"
            assert 0 <= int(kt_all[:nk_read].min()) and int(kt_all[:nk_read].max()) < tiles.shape[2], \
                "a key row's tile index past the tile mask"
            qt, kt = qt_all[:sq], kt_all[:sk]
            inside = tiles[:, qt][:, :, kt]
            if len(aux) == 5:
                inside = inside & (aux[4].long().cpu()[:sk][None, :] <= aux[3].long().cpu()[:sq][:, None])
            part = part & inside
        elif causal:
            tril = torch.ones(sq, sk, dtype=torch.bool).tril()
            part, full = part & tril, full & tril
        return full | part

    def _fwd(self, q, k, v, scale, causal):
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        qb, kb, vb = (t.transpose(1, 2).to(wide) for t in (q, k, v))
        mask = causal if isinstance(causal, torch.Tensor) else self._mask(q.shape[1], k.shape[1], causal)
        o, lse = blockwise.math_forward(qb, kb, vb, scale, mask)
        return o.to(q.dtype).transpose(1, 2).contiguous(), lse.float().contiguous()

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        block_sparse_tensors=None, mask_mod=None, aux_tensors=None, deterministic=False, **unused):
        self._check_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
        for name, t in (("out", out), ("dout", dout)):
            check_tensor(name, t, self.dtypes)
            assert t.shape == q.shape and t.dtype == q.dtype, \
                f"FA4: {name} must be {tuple(q.shape)} {q.dtype} (got {tuple(t.shape)} {t.dtype})"
        want = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
        assert lse.dtype == torch.float32 and tuple(lse.shape) == want, \
            f"FA4: lse must be fp32 {want} (got {lse.dtype} {tuple(lse.shape)})"
        assert lse.is_contiguous(), f"FA4: lse must be contiguous (strides {lse.stride()})"
        self.calls_log.append({"out_own_order": _own_order(out), "dout_own_order": _own_order(dout),
                               "deterministic": deterministic})
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        if block_sparse_tensors is not None:
            self.calls.append(("sparse_bwd", q.shape[-2], k.shape[-2]))
            keep = self._sparse_keep(block_sparse_tensors, q.shape[-2], q.shape[1], k.shape[1], causal, mask_mod,
                                     aux_tensors, transposed=True)
            return self._bwd(dout, q, k, v, out, lse, scale, keep)
        self.calls.append(("bwd" if cu_seqlens_q is None else "varlen_bwd", q.shape[-2], k.shape[-2]))
        if cu_seqlens_q is None:
            return self._bwd(dout, q, k, v, out, lse, scale, causal)
        parts = [self._bwd(*(t[a:b].unsqueeze(0) for t in (dout, q, k, v, out)), lse[:, a:b].unsqueeze(0), scale,
                           causal) for a, b in self._segments(cu_seqlens_q, q.shape[0])]
        return tuple(torch.cat([p[j][0] for p in parts], 0) for j in range(3))

    def _bwd(self, do, q, k, v, out, lse, scale, causal):
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        t = [x.transpose(1, 2).to(wide) for x in (do, q, k, v, out)]
        mask = causal if isinstance(causal, torch.Tensor) else self._mask(q.shape[1], k.shape[1], causal)
        dq, dk, dv = blockwise.math_backward(*t, lse.to(wide), scale, mask)
        return tuple(g.to(q.dtype).transpose(1, 2).contiguous() for g in (dq, dk, dv))


def install(monkeypatch, dtypes: tuple = (torch.bfloat16, torch.float16, torch.float32, torch.float64),
            head_dims: Optional[tuple] = None) -> FakeFA4:
    """Route ``attention.fa4`` to a ``FakeFA4`` on the CPU for ``dtypes`` (and ``head_dims``, if given); returns it."""
    fake = FakeFA4(dtypes)
    pkg, cute, iface = (types.ModuleType(n) for n in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"))
    iface._flash_attn_fwd, iface._flash_attn_bwd = fake._flash_attn_fwd, fake._flash_attn_bwd
    pkg.cute, cute.interface = cute, iface
    for name, mod in (("flash_attn", pkg), ("flash_attn.cute", cute), ("flash_attn.cute.interface", iface)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(fa4, "installed", lambda: True)
    monkeypatch.setattr(fa4, "schema_ok", lambda: True)

    def why_not(device, dtype, head_dim=None):
        if dtype not in dtypes:
            return f"it takes bf16 or fp16, not {dtype}"
        if head_dim is not None and head_dims is not None and head_dim not in head_dims:
            return f"head dim {head_dim} is not one it takes"
        return None
    monkeypatch.setattr(fa4, "why_not", why_not)
    monkeypatch.setattr(fa4, "head_dim_ok", lambda head_dim, device: head_dims is None or head_dim in head_dims)
    # block sparsity: FA4's BlockSparseTensorsTorch (a NamedTuple: a stand-in with its fields) and the mask_mod (a
    # CuTe DSL function there; the fake evaluates the aux tensors itself)
    monkeypatch.setattr(fa4, "_block_sparse_class", lambda: BlockSparseTensors)
    monkeypatch.setattr(fa4_mask_mod, "tile_mask_mod", lambda per_head, causal: ("tile_mask_mod", per_head, causal))
    monkeypatch.setattr(kernels.get("fa4"), "probed", {})
    monkeypatch.setattr(kernels.get("fa4"), "probe_failures_seen", {})
    # probes and choices already made in this process are for the kernels without FA4: start afresh
    monkeypatch.setattr(lse_kernels, "_PROBED", {})
    monkeypatch.setattr(varlen, "_PROBED", {})
    monkeypatch.setattr(varlen, "_DEFAULT", varlen.VarlenChooser())
    monkeypatch.setattr(backends, "_REGISTRY", backends.BackendRegistry())
    return fake
