"""FlashAttention-4 (the pip package ``flash-attn-4``, CuTe DSL kernels for Hopper SM90 and Blackwell SM100) as a
local kernel: one block with log-sum-exp, its backward given the FINAL out/lse of the rows, and packed samples.

Shapes (this module's side; FA4 itself takes [B, S, H, D]): q [B, H, Sq, D], k/v [B, Hkv, Sk, D] (bhsd, any strides
with stride(-1) == 1; GQA: H % Hkv == 0, k/v are NOT expanded, FA4 reads them per kv head and sums dk/dv itself).
out [B, H, Sq, D] in q's dtype, lse fp32 [B, H, Sq] (natural log). ``causal`` is used with Sq == Sk only (FA4 aligns
its causal mask bottom-right, which equals top-left there). Varlen: q/k/v [1, H, S, D] and ``cu`` (cumulative
sample lengths, ints), every sample attending only to itself.

FA4 exposes its block calls as ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd`` (the calls its
own autograd Function makes); they are named in this module only, and ``why_not`` refuses a build whose argument
lists differ (``schema_ok``). There is no attention dropout in FA4.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
from functools import lru_cache
from typing import Optional

import torch

PACKAGE = "flash-attn-4"
INSTALL_HINT = "pip install 'megatron_sp_ext[fa4]'"
_FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
             "return_lse")
_BWD_ARGS = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "cu_seqlens_q", "cu_seqlens_k",
             "max_seqlen_q", "max_seqlen_k")
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


def head_dim_ok(head_dim: int, device: torch.device) -> bool:
    """FA4's head-dim rule: a multiple of 8 in [8, 256] on SM90, [8, 128] or 256 on SM100."""
    if head_dim % 8:
        return False
    if torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10:
        return 8 <= head_dim <= 128 or head_dim == 256
    return 8 <= head_dim <= 256


def why_not(device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> Optional[str]:
    """None if FA4 runs for (device, dtype, head_dim) here, else the reason in a user's words."""
    device = torch.device(device)
    if not installed():
        return f"the package {PACKAGE!r} is not installed ({INSTALL_HINT})"
    if device.type != "cuda":
        return f"it runs on NVIDIA GPUs only (tensors are on {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in ARCH_MAJORS:
        return f"it runs on Hopper (sm_90) and Blackwell (sm_100) GPUs, not sm_{major}{minor}"
    if dtype not in DTYPES:
        return f"it takes bf16 or fp16, not {dtype}"
    if head_dim is not None and not head_dim_ok(head_dim, device):
        return f"head dim {head_dim} is not one it takes (a multiple of 8 up to 256 on Hopper, 128 on Blackwell)"
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
    dq, dk, dv = _interface()._flash_attn_bwd(_bshd(q), _bshd(k), _bshd(v), _bshd(out), _bshd(do),
                                              lse.float().contiguous(), scale, causal)[:3]
    return _bshd(dq), _bshd(dk), _bshd(dv)


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
        _thd(q), _thd(k), _thd(v), _thd(out), _thd(do), lse[0].float().contiguous(), scale, causal,
        cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, max_seqlen_q=m, max_seqlen_k=m)[:3]
    return [t.transpose(0, 1).unsqueeze(0) for t in (dq, dk, dv)]
