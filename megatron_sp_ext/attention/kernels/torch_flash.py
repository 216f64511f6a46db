"""torch's FlashAttention-2 (``aten._scaled_dot_product_flash_attention``; on CPU its CPU op): log-sum-exp blocks,
plain calls through SDPA with the flash backend, and packed samples through ``aten._flash_attention_forward`` /
``_backward`` with cum_seq_q/k (what torch.nn.attention.varlen.varlen_attn calls; [S, H, D] views, no copies). GQA:
k/v expanded and dk/dv summed back."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Capabilities, Kernel, expand_kv, fold_kv_grad

HALF = (torch.float16, torch.bfloat16)
# the leading argument names the varlen calls pass positionally (torch 2.11 and 2.13 agree)
VARLEN_SCHEMAS = (
    ("_flash_attention_forward", ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                                  "is_causal", "return_debug_mask")),
    ("_flash_attention_backward", ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
                                   "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused")))


def fused_forward(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused-kernel block forward (torch flash attention on CUDA or CPU). Returns (out, lse fp32)."""
    k, v, _ = expand_kv(k, v, q.shape[1])
    if q.is_cuda:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


_FLASH_AUX: dict = {}


def _flash_aux(device, dtype):
    """The flash forward's non-data outputs for a dense (non-varlen, dropout-free) call: its
    sequence-offset placeholders and RNG state. The backward needs them back; they do not depend on
    the data, so one tiny forward per (device, dtype) provides them."""
    key = (str(device), dtype)
    if key not in _FLASH_AUX:
        x = torch.zeros(1, 1, 16, 64, device=device, dtype=dtype)
        res = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
        _FLASH_AUX[key] = (res[2], res[3], res[6], res[7])
    return _FLASH_AUX[key]


def fused_backward(do, q, k, v, out, lse, scale: float, causal: bool):
    """Fused-kernel block backward given final out/lse. Returns (dq, dk, dv)."""
    ke, ve, rep = expand_kv(k, v, q.shape[1])
    if q.is_cuda:
        sq, sk = q.shape[2], ke.shape[2]
        cum_q, cum_k, rng, unused = _flash_aux(q.device, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, ke, ve, out, lse.contiguous(), cum_q, cum_k, sq, sk, 0.0, causal, rng, unused, scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, ke, ve, out, lse, 0.0, causal, scale=scale)
    return dq, fold_kv_grad(dk, rep), fold_kv_grad(dv, rep)


def varlen_schema_ok() -> bool:
    """Whether this torch has the varlen ops with the leading arguments passed here."""
    for name, args in VARLEN_SCHEMAS:
        op = getattr(torch.ops.aten, name, None)
        try:
            have = tuple(a.name for a in op.default._schema.arguments) if op is not None else ()
        except (AttributeError, RuntimeError):
            return False
        if have[:len(args)] != args:
            return False
    return True


def nonempty(cu: tuple) -> tuple:
    """``cu`` without empty samples."""
    out = [cu[0]]
    for c in cu[1:]:
        if c > out[-1]:
            out.append(c)
    return tuple(out)


def _thd(x: torch.Tensor) -> torch.Tensor:
    """[1, H, S, D] -> the [S, H, D] view the varlen kernel takes."""
    return x[0].transpose(0, 1)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> [1, H, S, D] view."""
    return x.transpose(0, 1).unsqueeze(0)


def _cu_args(cu: tuple, device) -> tuple[torch.Tensor, int]:
    cu = nonempty(cu)
    return torch.tensor(cu, dtype=torch.int32, device=device), max(b - a for a, b in zip(cu, cu[1:]))


class TorchFlashKernel(Kernel):
    name = "flash"
    setting = "torch_flash"
    label = "FlashAttention-2 (torch SDPA)"
    in_torch_sdpa = True   # "auto"'s plain calls go through torch's SDPA dispatch
    caps = Capabilities(plain=True, lse=True, varlen="flash_varlen", tiles="none", dropout=True,
                        dtypes={"cuda": HALF, "cpu": (torch.float32, torch.bfloat16, torch.float16)})

    def __init__(self) -> None:
        self._aux: dict = {}

    def attention(self, q, k, v, causal, scale, tiles=None):
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
        k, v, _ = expand_kv(k, v, q.shape[1])
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    def forward(self, q, k, v, scale, causal, tiles=None):
        return fused_forward(q, k, v, scale, causal)

    def backward(self, do, q, k, v, out, lse, scale, causal, tiles=None):
        return fused_backward(do, q, k, v, out, lse, scale, causal)

    def varlen_schema_ok(self) -> bool:
        return varlen_schema_ok()

    def varlen_aux(self, device, dtype):
        """(rng_state, unused) of a dropout-free varlen flash forward (data-independent; its backward wants them)."""
        key = (str(device), dtype)
        if key not in self._aux:
            x = torch.zeros(16, 1, 64, device=device, dtype=dtype)
            cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
            res = torch.ops.aten._flash_attention_forward(x, x, x, cu, cu, 16, 16, 0.0, False, False)
            self._aux[key] = (res[2], res[3])
        return self._aux[key]

    def varlen_forward(self, q, k, v, cu, scale, causal):
        h, s = q.shape[1], q.shape[2]
        ke, ve, _ = expand_kv(k, v, h)
        cu_t, m = _cu_args(cu, q.device)
        res = torch.ops.aten._flash_attention_forward(_thd(q), _thd(ke), _thd(ve), cu_t, cu_t, m, m, 0.0, causal,
                                                      False, scale=scale)
        return _bhsd(res[0]), res[1].reshape(1, h, s).float()

    def varlen_backward(self, do, q, k, v, out, lse, cu, scale, causal):
        h = q.shape[1]
        ke, ve, rep = expand_kv(k, v, h)
        cu_t, m = _cu_args(cu, q.device)
        rng, unused = self.varlen_aux(q.device, q.dtype)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            _thd(do), _thd(q), _thd(ke), _thd(ve), _thd(out), lse[0].float().contiguous(), cu_t, cu_t, m, m, 0.0,
            causal, rng, unused, scale=scale)
        return [_bhsd(dq), fold_kv_grad(_bhsd(dk), rep), fold_kv_grad(_bhsd(dv), rep)]

    def why_not_here(self, call):
        if "varlen" in call.needs and (torch.device(call.device).type != "cuda" or not varlen_schema_ok()):
            return "its varlen call runs on CUDA with this torch's _flash_attention_forward/_backward only"
        return None
