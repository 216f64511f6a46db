"""A CPU stand-in for FlashAttention-4's block calls, so the library's "fa4" branch runs in CPU tests.

``install(monkeypatch)`` puts a module ``flash_attn.cute.interface`` with ``_flash_attn_fwd`` / ``_flash_attn_bwd``
(FA4's argument names, [B, S, H, D] or varlen [T, H, D] + cu_seqlens, GQA taken without expansion, lse [B, H, S] /
[H, T], causal aligned bottom-right as FA4 does) into ``sys.modules`` and lets ``attention.fa4`` run on the CPU for
the dtypes given. The math is blockwise.math_forward/backward in fp32 (fp64 for fp64), so results are checked
against the float64 reference at the dtype's tolerance. ``calls`` counts (name, heads of q, heads of k) per call.
"""
from __future__ import annotations

import sys
import types
from typing import Optional

import torch

from megatron_sp_ext.attention import backends, blockwise, lse_kernels, varlen
from megatron_sp_ext.attention.kernels import fa4


class FakeFA4:
    def __init__(self) -> None:
        self.calls: list = []

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
                        return_lse=False, **unused):
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        self.calls.append(("fwd" if cu_seqlens_q is None else "varlen_fwd", q.shape[-2], k.shape[-2]))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        if cu_seqlens_q is None:
            out, lse = self._fwd(q, k, v, scale, causal)
            return out, lse, None, None, None
        outs, lses = [], []
        for a, b in self._segments(cu_seqlens_q, q.shape[0]):
            o, lse = self._fwd(q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), scale, causal)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs, 0), torch.cat(lses, 1), None, None, None

    def _fwd(self, q, k, v, scale, causal):
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        qb, kb, vb = (t.transpose(1, 2).to(wide) for t in (q, k, v))
        o, lse = blockwise.math_forward(qb, kb, vb, scale, self._mask(q.shape[1], k.shape[1], causal))
        return o.to(q.dtype).transpose(1, 2).contiguous(), lse.float().contiguous()

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **unused):
        self.calls.append(("bwd" if cu_seqlens_q is None else "varlen_bwd", q.shape[-2], k.shape[-2]))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        if cu_seqlens_q is None:
            return self._bwd(dout, q, k, v, out, lse, scale, causal)
        parts = [self._bwd(*(t[a:b].unsqueeze(0) for t in (dout, q, k, v, out)), lse[:, a:b].unsqueeze(0), scale,
                           causal) for a, b in self._segments(cu_seqlens_q, q.shape[0])]
        return tuple(torch.cat([p[j][0] for p in parts], 0) for j in range(3))

    def _bwd(self, do, q, k, v, out, lse, scale, causal):
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        t = [x.transpose(1, 2).to(wide) for x in (do, q, k, v, out)]
        dq, dk, dv = blockwise.math_backward(*t, lse.to(wide), scale, self._mask(q.shape[1], k.shape[1], causal))
        return tuple(g.to(q.dtype).transpose(1, 2).contiguous() for g in (dq, dk, dv))


def install(monkeypatch, dtypes: tuple = (torch.bfloat16, torch.float16, torch.float32, torch.float64),
            head_dims: Optional[tuple] = None) -> FakeFA4:
    """Route ``attention.fa4`` to a ``FakeFA4`` on the CPU for ``dtypes`` (and ``head_dims``, if given); returns it."""
    fake = FakeFA4()
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
    # probes and choices already made in this process are for the kernels without FA4: start afresh
    monkeypatch.setattr(lse_kernels, "_PROBED", {})
    monkeypatch.setattr(varlen, "_PROBED", {})
    monkeypatch.setattr(varlen, "_DEFAULT", varlen.VarlenChooser())
    monkeypatch.setattr(backends, "_REGISTRY", backends.BackendRegistry())
    return fake
