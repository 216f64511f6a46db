"""Log-sum-exp merging of partial attention results (fp32 accumulation).

out_bhsd: [B, H, S, D] partial output normalised over its own keys; lse_bhs: [B, H, S] fp32.
Rows that saw no key carry lse = -inf and contribute nothing.
"""
from __future__ import annotations

import torch


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: (acc_out, acc_lse) <- merge((acc_out, acc_lse), (out, lse)).

    acc_out: fp32 [B, H, S, D]; acc_lse: fp32 [B, H, S]; out any float dtype, lse fp32.
    """
    lse = lse.float()
    new_lse = torch.logaddexp(acc_lse, lse)
    # guard rows where both are -inf (no keys yet): keep zeros, avoid nan
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_acc = torch.exp(acc_lse - safe).unsqueeze(-1)
    w_new = torch.exp(lse - safe).unsqueeze(-1)
    acc_out.mul_(w_acc).add_(out.float() * w_new)
    acc_lse.copy_(new_lse)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge several partial results; returns (fp32 out [B,H,S,D], fp32 lse [B,H,S])."""
    acc_out = torch.zeros_like(outs[0], dtype=torch.float32)
    acc_lse = torch.full(lses[0].shape, float("-inf"), dtype=torch.float32, device=lses[0].device)
    for o, l in zip(outs, lses):
        merge_into(acc_out, acc_lse, o, l)
    return acc_out, acc_lse
