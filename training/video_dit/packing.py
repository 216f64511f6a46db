"""Packing clips of different sizes into one sequence per step (``--pack-samples``).

Beside bucketing (every step one micro-batch of equal-sized clips), a packed step concatenates the patch
tokens of several clips of DIFFERENT frame counts and latent sizes into one sequence (B=1), described by
``cu_seqlens``. ``PackPlan`` fills each step greedily in sample-stream order: consecutive samples join the
current pack while its video tokens stay within ``--max-tokens-per-step``; the next sample opens the next
pack. Pack k of the run goes to step start + k // DP, data-parallel rank k % DP. The plan is a pure function
of the dataset's shapes (file headers or the synthetic cycle), the budget and the first sample, so every
rank (and every DataLoader worker) computes the same packs, and a resumed run continues the stream where
the checkpoint stopped (it records the samples consumed).

Loss: the mean over the pack's samples of each sample's mean squared velocity error (varlen.token_weights),
equal to the average of one-sample-at-a-time runs of the same samples (same noise and timesteps: both
draw them from the sample's index). Across data-parallel ranks the step's loss is the mean over packs.

Under sequence parallelism each sample is split on its own over the P ranks (``shard_sequence(...,
cu_seqlens=)``, contiguous): a sample whose token count does not divide by P gets zero rows at its tail up to the
next multiple, as the library pads it; those rows carry no loss (weight 0), RoPE position 0 and their sample's
timestep and text, and the attention keeps them apart from the real tokens.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Optional

import torch

from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.dynamic import DynamicPlan, local_rows
from megatron_sp_ext.sp.placement import padded_samples, varlen_pieces

from .engine import describe_samples, sample_noise
from .model import patchify

PACK_FLAG, BUDGET_FLAG = "--pack-samples", "--max-tokens-per-step"


def tokens_of(shape: tuple, patch: tuple) -> int:
    """Video tokens of a latent [C, T, H, W] cut into patches (pt, ph, pw)."""
    _, t, h, w = shape
    pt, ph, pw = patch
    return (t // pt) * (h // ph) * (w // pw)


class PackPlan:
    """Greedy packing of the sample stream from sample ``first`` into packs of at most ``max_tokens`` video
    tokens. ``pack(k)``: the sample indices of pack k; ``first_sample(k)``: the first sample of pack k (the
    samples consumed before it). ``sp_world``: the SP size (samples are padded per sample to a multiple of it)."""

    def __init__(self, dataset, max_tokens: int, patch: tuple, *, first: int = 0, sp_world: int = 1,
                 start_step: int = 0) -> None:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise SPConfigError(f"{BUDGET_FLAG}={max_tokens!r}: use a positive number of video tokens per step")
        if not hasattr(dataset, "shape_of"):
            raise SPConfigError(f"{PACK_FLAG}: the dataset ({type(dataset).__name__}) cannot tell a sample's shape "
                                f"without reading it (it needs shape_of(i))")
        self.dataset, self.max_tokens, self.patch, self.sp_world = dataset, max_tokens, patch, sp_world
        self.starts = [first]  # starts[k]: first sample of pack k; starts[k + 1] - starts[k] samples in it
        self.start_step = start_step  # pack 0 is step start_step's pack on data-parallel rank 0

    def tokens(self, i: int) -> int:
        """Video tokens of sample i (checked against the budget and the SP size)."""
        n = tokens_of(self.dataset.shape_of(i)[0], self.patch)
        if n > self.max_tokens:
            raise SPConfigError(f"{BUDGET_FLAG}={self.max_tokens}: {describe_samples(self.dataset, [i])[0]} alone has "
                                f"{n} video tokens (latent {list(self.dataset.shape_of(i)[0])}); raise the budget to "
                                f"at least the largest clip's token count")
        return n

    def _extend(self, k: int) -> None:
        while len(self.starts) <= k + 1:
            i = self.starts[-1]
            used = self.tokens(i)
            i += 1
            while used + self.tokens(i) <= self.max_tokens:
                used += self.tokens(i)
                i += 1
            self.starts.append(i)

    def index(self, step: int, dp_rank: int, dp_world: int) -> int:
        """The pack of ``step`` on ``dp_rank``."""
        return (step - self.start_step) * dp_world + dp_rank

    def consumed_samples(self, step: int, dp_world: int) -> int:
        """Samples consumed before ``step`` (what a checkpoint at ``step`` records)."""
        return self.first_sample(self.index(step, 0, dp_world))

    def pack(self, k: int) -> list:
        self._extend(k)
        return list(range(self.starts[k], self.starts[k + 1]))

    def first_sample(self, k: int) -> int:
        self._extend(k)
        return self.starts[k]


def packed_batch(dataset, indices: list, seed: int, patch: tuple) -> dict:
    """Rectified flow on the samples ``indices`` packed into one full sequence: x / target [1, N_total, P],
    t [n], text [1, sum L_i, D_text], cu_seqlens / cu_text (lists [n + 1]), grids [(T', H', W')] * n. Each
    sample's noise and timestep are those of a one-sample batch of the same index (engine.sample_noise)."""
    xs, tgts, ts, texts, grids = [], [], [], [], []
    cu, cu_text = [0], [0]
    pt, ph, pw = patch
    for index in indices:
        sample = dataset[index]
        x0 = sample["latent"][None]
        eps, t = sample_noise(x0.shape, seed, index)
        xs.append(patchify((1 - t) * x0 + t * eps, patch))
        tgts.append(patchify(eps - x0, patch))
        ts.append(t)
        texts.append(sample["text"])
        _, _, tn, h, w = x0.shape
        grids.append((tn // pt, h // ph, w // pw))
        cu.append(cu[-1] + xs[-1].shape[1])
        cu_text.append(cu_text[-1] + sample["text"].shape[0])
    return {"x": torch.cat(xs, dim=1), "target": torch.cat(tgts, dim=1), "t": torch.cat(ts),
            "text": torch.cat(texts)[None], "grids": grids, "cu_seqlens": cu, "cu_text": cu_text}


def packed_host_inputs(batch: dict, sp_rank: int, sp_world: int, dynamic: Optional[DynamicPlan] = None) -> dict:
    """This rank's share of a packed batch (per-sample contiguous placement, each sample padded to a multiple of
    P: what ``shard_sequence(x, group, cu_seqlens=cu)`` keeps), as host_inputs' dict plus the pack description
    ("pack"). Padding rows: zero x and target, valid False, token id 0. ``dynamic``: dynamic SP's plan of this
    pack (--dynamic-context-parallel): the rows it gives this rank (``sp.dynamic.local_rows``) instead."""
    cu = tuple(batch["cu_seqlens"])
    pk = padded_samples(cu, "contiguous", sp_world)
    if dynamic is not None:
        src_t, tid_t = local_rows(dynamic, sp_rank)
    else:
        src, tid = [], []  # per run of local rows: the real rows they hold (-1: padding), their positions in the sample
        for a, n in varlen_pieces("contiguous", sp_rank, sp_world, pk.layout):
            i = bisect_right(pk.layout, a) - 1
            j = torch.arange(a - pk.layout[i], a - pk.layout[i] + n)
            real = j < cu[i + 1] - cu[i]
            src.append(torch.where(real, cu[i] + j, -1))
            tid.append(torch.where(real, j, 0))
        src_t, tid_t = torch.cat(src), torch.cat(tid)
    valid = src_t >= 0

    def rows(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], src_t.shape[0], *x.shape[2:])
        out[:, valid] = x[:, src_t[valid]]
        return out
    return {"x": rows(batch["x"]), "target": rows(batch["target"]), "valid": valid, "t": batch["t"],
            "text": batch["text"].contiguous(), "token_ids": tid_t, "grid": (0, 0, 0),
            "n_valid": cu[-1], "n_pad": pk.layout[-1] if dynamic is None else cu[-1] + int((~valid).sum()),
            "pack": {"cu_seqlens": cu, "grids": tuple(tuple(g) for g in batch["grids"]),
                     "cu_text": tuple(batch["cu_text"]), "sp_world": sp_world, "dynamic": dynamic,
                     "sp_rank": sp_rank}}


def first_sample(loaded: Optional[dict], start: int, global_batch: int) -> int:
    """The sample a packed run's step ``start`` begins at: the checkpoint's consumed_samples (None: a fresh
    run, or a checkpoint that does not say: ``start * global_batch``)."""
    consumed = (loaded or {}).get("consumed_samples")
    return start * global_batch if consumed is None else int(consumed)


def make_pack_plan(args, dataset, cfg, sp_world: int, first: int, start_step: int) -> Optional[PackPlan]:
    """The run's PackPlan (None without --pack-samples): step ``start_step`` begins at sample ``first``."""
    if not getattr(args, "pack_samples", False):
        return None
    return PackPlan(dataset, args.max_tokens_per_step, cfg.patch, first=first, sp_world=sp_world,
                    start_step=start_step)
