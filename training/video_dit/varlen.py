"""One rank's view of a PACKED step: several clips of different sizes in one sequence (B=1).

The full packed sequence is the samples' patch tokens concatenated, ``cu_seqlens`` (cumulative lengths,
[n_samples + 1]) the same on every rank. Under sequence parallelism each sample is split on its own
(``megatron_sp_ext.shard_sequence(..., cu_seqlens=)``, contiguous placement, each sample padded to a multiple of
P): rank r holds piece r of P of every sample, in sample order, so its local tokens are again grouped by sample
(``local_lens``); padding rows (zero weight) sit at a sample's tail.

``PackInfo`` is what the model needs beyond the tokens: each sample's token grid (its own 3D RoPE), its text
range in the packed text (block-diagonal cross-attention), which sample each local token belongs to
(per-token AdaLN modulation), and the per-token loss weight (see ``token_weights``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_sp_ext.sp.dynamic import DynamicPlan
from megatron_sp_ext.sp.placement import padded_samples


@dataclass
class PackInfo:
    """cu_seqlens: cumulative sample lengths over the full packed sequence (ints, [N + 1]);
    grids: each sample's token grid (T', H', W'); cu_text: cumulative text lengths in the packed text [N + 1];
    local_lens: each sample's token count on this rank; sample_of_token: [S_local] int64 (model device);
    token_weight: [S_local] float32, 1 / (N * n_i) for a token of sample i (model device);
    dynamic: dynamic SP's plan (--dynamic-context-parallel: each sample over its own sub-group of ranks, this rank's
    rows in ``DynamicPlan.pieces`` order; samples not on this rank have local length 0), or None."""

    cu_seqlens: tuple
    grids: tuple
    cu_text: tuple
    local_lens: tuple
    sample_of_token: torch.Tensor
    token_weight: torch.Tensor
    dynamic: Optional[DynamicPlan] = None

    @property
    def num_samples(self) -> int:
        return len(self.grids)

    @property
    def lengths(self) -> list:
        """Each sample's full token count."""
        cu = self.cu_seqlens
        return [b - a for a, b in zip(cu, cu[1:])]

    @property
    def attention_seqlen(self) -> float:
        """The sequence length a token attends over, averaged over tokens (sum n_i^2 / sum n_i): what
        DiTConfig.flops_per_token needs for packed attention."""
        n = self.lengths
        return sum(x * x for x in n) / max(1, sum(n))

    def cu_tensor(self) -> torch.Tensor:
        """cu_seqlens as the 1-D int32 CPU tensor the attention API takes (CPU: read without a device sync)."""
        return torch.tensor(self.cu_seqlens, dtype=torch.int32)

    def text_ranges(self) -> list:
        return list(zip(self.cu_text, self.cu_text[1:]))

    def local_ranges(self) -> list:
        out, a = [], 0
        for n in self.local_lens:
            out.append((a, a + n))
            a += n
        return out


def local_lengths(cu_seqlens: Sequence[int], sp_world: int) -> tuple:
    """Each sample's row count on one rank (contiguous per-sample placement, each sample padded to a multiple of P:
    ceil(n_i / P))."""
    lay = padded_samples(tuple(cu_seqlens), "contiguous", sp_world).layout
    return tuple((b - a) // sp_world for a, b in zip(lay, lay[1:]))


def token_weights(cu_seqlens: Sequence[int], local_lens: Sequence[int]) -> torch.Tensor:
    """[S_local] float32: 1 / (N * n_i) for each local token of sample i. Summing weight x (squared error
    averaged over the patch values) over ALL tokens of all ranks gives the mean over samples of each
    sample's mean loss: the average of one-sample-at-a-time runs of the same samples."""
    n = len(local_lens)
    full = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    w = torch.tensor([1.0 / (n * f) for f in full], dtype=torch.float64)
    return w.repeat_interleave(torch.tensor(local_lens)).float()


def pack_info(cu_seqlens: Sequence[int], grids: Sequence[tuple], cu_text: Sequence[int], sp_world: int,
              device: Optional[torch.device] = None, valid: Optional[torch.Tensor] = None,
              dynamic: Optional[DynamicPlan] = None, sp_rank: int = 0) -> PackInfo:
    """The PackInfo of one rank. ``valid`` ([S_local] bool, host): False for a padding row (a sample padded to a
    multiple of P), whose loss weight is 0; None: every row is real. ``dynamic``: dynamic SP's plan of the pack
    (this rank ``sp_rank`` holds ``dynamic.local_lens(sp_rank)`` rows of each sample)."""
    cu = tuple(int(x) for x in cu_seqlens)
    lens = local_lengths(cu, sp_world) if dynamic is None else dynamic.local_lens(sp_rank)
    sot = torch.arange(len(lens)).repeat_interleave(torch.tensor(lens, dtype=torch.int64))
    w = token_weights(cu, lens)
    if valid is not None:
        w = w * valid.to(w.dtype)
    if device is not None:
        sot, w = sot.to(device, non_blocking=True), w.to(device, non_blocking=True)
    return PackInfo(cu, tuple(tuple(int(v) for v in g) for g in grids), tuple(int(x) for x in cu_text), lens, sot, w,
                    dynamic)
