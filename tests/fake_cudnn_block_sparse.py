"""A CPU stand-in for cuDNN frontend's block-sparse attention, so the library's "cudnn_block_sparse" kernel runs in
CPU tests.

``install(monkeypatch)`` puts a module ``cudnn.block_sparse_attention`` with ``block_sparse_attention_forward`` /
``block_sparse_attention_backward`` (the argument names, defaults and return keys of nvidia-cudnn-frontend 1.32.0,
``cudnn/block_sparse_attention/api.py``) into ``sys.modules`` and lets ``kernels.cudnn_block_sparse`` run on the CPU
for the dtypes and head dims given. The math is blockwise.math_forward/backward in fp32 (fp64 for fp64) over the token
mask the block lists say, so results are checked against the float64 reference.

Strict where the real package is (its validation in api.py and the kernels' assumptions): layout "bhsd"/"bshd",
rank-4 q/k/v with stride 1 on the head dim, one dtype; q2k_block_index int32 [B, H, nq, cap], q2k_block_nums int32
[B, H, nq] (nq, nk from the sparse block size), listed key blocks in range and without repeats; an empty list needs
``allow_empty_block_nums=True`` (else the real kernel's branch-free specialisation); Sq a multiple of 64 at 64-token
blocks; block_sizes int32 [nk]; the backward MHA only, lse fp32 [B, H, Sq], out/dout of q's shape and dtype. Where the
real backward leaves memory unwritten (query blocks with no listed key block, key blocks no query block lists: its SM90
128-token path allocates dq/dk/dv with ``torch.empty``), the stand-in writes NaN, so the library must not read it.
``calls`` counts (name, sparse block size, layout) per call.
"""
from __future__ import annotations

import sys
import types
from typing import Optional

import torch

from megatron_sp_ext.attention import backends, blockwise, lse_kernels, varlen
from megatron_sp_ext.attention.kernels import cudnn_block_sparse as cbs


class FakeBSA:
    def __init__(self, dtypes: tuple, head_dims: Optional[tuple]) -> None:
        self.calls: list = []
        self.dtypes, self.head_dims = tuple(dtypes), head_dims

    # ------------------------------------------------------------------------------------------ checks
    def _shapes(self, q, k, v, layout):
        assert layout in ("bhsd", "bshd"), f"layout must be 'bhsd' or 'bshd', got {layout!r}"
        assert q.ndim == k.ndim == v.ndim == 4, "q, k, and v must all be rank-4 tensors"
        if layout == "bhsd":
            (b, hq, sq, d), (_, hkv, sk, _) = q.shape, k.shape
        else:
            (b, sq, hq, d), (_, sk, hkv, _) = q.shape, k.shape
        assert k.shape == v.shape, "k and v must match"
        assert hq % hkv == 0, "the number of query heads must be divisible by the number of KV heads"
        assert q.dtype in self.dtypes and q.dtype == k.dtype == v.dtype, f"q/k/v dtype {q.dtype} not taken"
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "q, k, and v must have a contiguous head dimension"
        return b, hq, hkv, sq, sk, d

    @staticmethod
    def _block(sparse_block_size):
        bs = 64 if sparse_block_size is None else sparse_block_size   # SM90's default
        assert bs in (64, 128), "sparse_block_size must be 64 or 128"
        return bs

    @staticmethod
    def _keep_blocks(idx, nums, num, b, hq, nq, nk, allow_empty):
        """[B, H, nq, nk] bool of the listed pairs, after the package's checks of the lists."""
        assert idx.dtype == torch.int32 and idx.ndim == 4 and tuple(idx.shape[:3]) == (b, hq, nq), \
            f"q2k_block_index must be int32 [{b}, {hq}, {nq}, cap], got {idx.dtype} {tuple(idx.shape)}"
        if nums is None:
            nums = torch.full((b, hq, nq), num if num is not None else idx.shape[-1], dtype=torch.int32)
        assert nums.dtype == torch.int32 and tuple(nums.shape) == (b, hq, nq), \
            f"q2k_block_nums must be int32 [{b}, {hq}, {nq}], got {nums.dtype} {tuple(nums.shape)}"
        assert int(nums.min()) >= 0 and int(nums.max()) <= idx.shape[-1], "q2k_block_nums past the capacity"
        assert allow_empty or int(nums.min()) >= 1, "an empty list needs allow_empty_block_nums=True"
        listed = torch.arange(idx.shape[-1]) < nums.unsqueeze(-1)
        used = idx.long()[listed]
        assert used.numel() == 0 or (int(used.min()) >= 0 and int(used.max()) < nk), "a listed key block past nk"
        keep = torch.zeros(b, hq, nq, nk + 1, dtype=torch.int64)
        keep.scatter_add_(-1, torch.where(listed, idx.long(), nk), listed.long())
        assert keep.numel() == 0 or int(keep[..., :nk].max()) <= 1, "a key block listed twice"
        return keep[..., :nk].bool()

    @staticmethod
    def _token_keep(blocks, bs, sq, sk, block_sizes):
        keep = blocks.repeat_interleave(bs, 2).repeat_interleave(bs, 3)[:, :, :sq, :sk]
        if block_sizes is not None:
            nk = blocks.shape[-1]
            assert block_sizes.dtype == torch.int32 and tuple(block_sizes.shape) == (nk,), \
                f"block_sizes must be int32 [{nk}] here"
            j = torch.arange(sk)
            keep = keep & ((j % bs) < block_sizes.long()[j // bs])
        return keep

    @staticmethod
    def _bhsd(t, layout):
        return t.transpose(1, 2) if layout == "bshd" else t

    # ------------------------------------------------------------------------------------------ the API
    def block_sparse_attention_forward(self, q_tensor, k_tensor, v_tensor, q2k_block_index, block_sparse_num=None,
                                       block_sizes=None, q2k_block_nums=None, *, sparse_block_size=None,
                                       allow_empty_block_nums=False, softmax_scale=None, pack_gqa=None,
                                       layout="bhsd", kv_splits=1, use_clc=None):
        b, hq, hkv, sq, sk, d = self._shapes(q_tensor, k_tensor, v_tensor, layout)
        bs = self._block(sparse_block_size)
        assert bs != 64 or sq % 64 == 0, "SM90 forward requires seqlen_q to be a multiple of 64"
        nq, nk = -(-sq // bs), -(-sk // bs)
        blocks = self._keep_blocks(q2k_block_index, q2k_block_nums, block_sparse_num, b, hq, nq, nk,
                                   allow_empty_block_nums and q2k_block_nums is not None)
        keep = self._token_keep(blocks, bs, sq, sk, block_sizes)
        self.calls.append(("fwd", bs, layout))
        wide = torch.float64 if q_tensor.dtype == torch.float64 else torch.float32
        q, k, v = (self._bhsd(t, layout).to(wide) for t in (q_tensor, k_tensor, v_tensor))
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        outs, lses = zip(*(blockwise.math_forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], scale, keep[i])
                           for i in range(b)))
        out = self._bhsd(torch.cat(outs).to(q_tensor.dtype), layout).contiguous()
        return {"o_tensor": out, "lse_tensor": torch.cat(lses).float().contiguous()}

    def block_sparse_attention_backward(self, do_tensor, q_tensor, k_tensor, v_tensor, o_tensor, lse_tensor,
                                        q2k_block_index, block_sparse_num=None, block_sizes=None, q2k_block_nums=None,
                                        *, softmax_scale=None, dq_tensor=None, dk_tensor=None, dv_tensor=None,
                                        bucket_size_blocks=None, sparse_block_size=None, layout="bhsd"):
        b, hq, hkv, sq, sk, d = self._shapes(q_tensor, k_tensor, v_tensor, layout)
        assert hq == hkv, "block sparse attention backward supports MHA only"
        assert self.head_dims is None or d in self.head_dims, f"backward head dim {d} not taken"
        bs = self._block(sparse_block_size)
        assert do_tensor.shape == o_tensor.shape == q_tensor.shape, "do, o and q must have identical shapes"
        assert do_tensor.dtype == o_tensor.dtype == q_tensor.dtype, "do and o must have q's dtype"
        assert do_tensor.stride(-1) == 1 and o_tensor.stride(-1) == 1, "do and o need a contiguous head dim"
        assert lse_tensor.dtype == torch.float32 and tuple(lse_tensor.shape) == (b, hq, sq), \
            f"lse_tensor must be fp32 {(b, hq, sq)}, got {lse_tensor.dtype} {tuple(lse_tensor.shape)}"
        nq, nk = -(-sq // bs), -(-sk // bs)
        blocks = self._keep_blocks(q2k_block_index, q2k_block_nums, block_sparse_num, b, hq, nq, nk, True)
        keep = self._token_keep(blocks, bs, sq, sk, block_sizes)
        self.calls.append(("bwd", bs, layout))
        wide = torch.float64 if q_tensor.dtype == torch.float64 else torch.float32
        t = [self._bhsd(x, layout).to(wide) for x in (do_tensor, q_tensor, k_tensor, v_tensor, o_tensor)]
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        grads = [blockwise.math_backward(*(x[i:i + 1] for x in t), lse_tensor[i:i + 1].to(wide), scale, keep[i])
                 for i in range(b)]
        dq, dk, dv = (torch.cat([g[j] for g in grads]) for j in range(3))
        # memory the real backward never writes: query blocks without a listed key block, unlisted key blocks
        q_dead = ~blocks.any(3).repeat_interleave(bs, 2)[:, :, :sq, None]
        k_dead = ~blocks.any(2).repeat_interleave(bs, 2)[:, :, :sk, None]
        dq = dq.masked_fill(q_dead, float("nan"))
        dk, dv = dk.masked_fill(k_dead, float("nan")), dv.masked_fill(k_dead, float("nan"))
        out = (self._bhsd(g.to(q_tensor.dtype), layout).contiguous() for g in (dq, dk, dv))
        return dict(zip(("dq_tensor", "dk_tensor", "dv_tensor"), out))


def install(monkeypatch, dtypes: tuple = (torch.bfloat16, torch.float32, torch.float64),
            head_dims: Optional[tuple] = None) -> FakeBSA:
    """Route ``kernels.cudnn_block_sparse`` to a ``FakeBSA`` on the CPU for ``dtypes`` (and ``head_dims``, if given:
    the real SM90 backward takes 128 only); returns it."""
    fake = FakeBSA(dtypes, head_dims)
    pkg, mod = types.ModuleType("cudnn"), types.ModuleType("cudnn.block_sparse_attention")
    mod.block_sparse_attention_forward = fake.block_sparse_attention_forward
    mod.block_sparse_attention_backward = fake.block_sparse_attention_backward
    pkg.block_sparse_attention = mod
    monkeypatch.setitem(sys.modules, "cudnn", pkg)
    monkeypatch.setitem(sys.modules, "cudnn.block_sparse_attention", mod)
    monkeypatch.setattr(cbs, "installed", lambda: True)

    def why_not(device, dtype, head_dim=None):
        if dtype not in dtypes:
            return f"its backward takes bf16 only, not {dtype}"
        if head_dim is not None and head_dims is not None and head_dim not in head_dims:
            return f"its backward takes head dim {head_dims} here, not {head_dim}"
        return None
    monkeypatch.setattr(cbs, "why_not", why_not)
    # choices already made in this process are for the kernels without it: start afresh
    monkeypatch.setattr(lse_kernels, "_PROBED", {})
    monkeypatch.setattr(varlen, "_PROBED", {})
    monkeypatch.setattr(varlen, "_DEFAULT", varlen.VarlenChooser())
    monkeypatch.setattr(backends, "_REGISTRY", backends.BackendRegistry())
    return fake
