"""Log-sum-exp merging of partial attention results (accumulated in ``acc_dtype``: fp32 for half and
single precision inputs, fp64 for fp64).

out_bhsd: [B, H, S, D] partial output normalised over its own keys; lse_bhs: [B, H, S].
Rows that saw no key carry lse = -inf and contribute nothing.
"""
from __future__ import annotations

import torch


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulator dtype for partial attention results of ``t``: at least float32."""
    return torch.promote_types(t.dtype, torch.float32)


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: (acc_out, acc_lse) <- merge((acc_out, acc_lse), (out, lse)).

    acc_out: [B, H, S, D], acc_lse: [B, H, S] (accumulator dtype); out, lse any float dtype.
    """
    lse = lse.to(acc_lse.dtype)
    new_lse = torch.logaddexp(acc_lse, lse)
    # guard rows where both are -inf (no keys yet): keep zeros, avoid nan
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_acc = torch.exp(acc_lse - safe).unsqueeze(-1)
    w_new = torch.exp(lse - safe).unsqueeze(-1)
    acc_out.mul_(w_acc).addcmul_(out, w_new)  # two passes over acc, no full-size temporary
    acc_lse.copy_(new_lse)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge several partial results; returns (out [B,H,S,D], lse [B,H,S]) in the accumulator dtype."""
    acc_out = torch.zeros_like(outs[0], dtype=acc_dtype(outs[0]))
    acc_lse = torch.full(lses[0].shape, float("-inf"), dtype=acc_out.dtype, device=lses[0].device)
    for o, l in zip(outs, lses):
        merge_into(acc_out, acc_lse, o, l)
    return acc_out, acc_lse
