"""The background data path: each step's inputs for THIS rank are built off the training thread.

A step's batch is a pure function of (step, dp_rank) (engine.flow_matching_batch), so the steps of
a run form a map-style dataset: ``StepBatches[i]`` is step ``start + i`` already cut to this rank's
tokens (CPU). A torch DataLoader reads it ahead with ``num_workers`` processes (0: in the training
thread, the plain path), pins the tensors, and ``DeviceBatches`` copies them to the device one step ahead, on a
copy stream of its own on CUDA.
The values are those of ``engine.prepare`` bit for bit: only where they are computed changes.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

from .engine import StepInputs, flow_matching_batch, shard_tokens, token_ids_of
from .packing import PackPlan, packed_batch, packed_host_inputs
from .varlen import pack_info


def sample_index(step: int, dp_rank: int, dp_world: int, micro_batch: int, m: int, base: int = 0) -> int:
    """The dataset index of micro-sample ``m`` of ``step`` on ``dp_rank`` (as flow_matching_batch reads it).
    ``base``: see ``sample_base``."""
    return base + (step * dp_world + dp_rank) * micro_batch + m


def sample_base(consumed: Optional[int], start: int, global_batch: int) -> int:
    """The index offset that makes step ``start`` read sample ``consumed`` (the samples a loaded checkpoint
    had consumed; None: a fresh run or a checkpoint that does not say, read as ``start * global_batch``).
    0 unless the global batch (DP size x micro-batch) changed at the resume: then the run continues the
    sample stream where it stopped, neither repeating nor skipping samples."""
    return 0 if consumed is None else consumed - start * global_batch


def resume_base(loaded: Optional[dict], start: int, global_batch: int) -> tuple:
    """(base, note) for a run starting at ``start`` from run.json ``loaded`` (None: fresh). ``note`` is a
    line for the log when the global batch changed at the resume, else None."""
    if not loaded:
        return 0, None
    consumed = loaded.get("consumed_samples")
    base = sample_base(consumed, start, global_batch)
    if base == 0:
        return 0, None
    return base, (f"global batch {global_batch} (the checkpoint's: {loaded.get('global_batch')}): continuing the "
                  f"sample stream at sample {consumed}")


def consumed_samples(step: int, base: int, global_batch: int) -> int:
    """Samples consumed before ``step`` (what a checkpoint at ``step`` records)."""
    return base + step * global_batch


def host_inputs(batch: dict, sp_rank: int, sp_world: int) -> dict:
    """This rank's share of a full batch, on the CPU, as a dict of tensors + ints (pinnable)."""
    n_valid = batch["x"].shape[1]
    x, ids, n_pad = shard_tokens(batch["x"], n_valid, sp_rank, sp_world)
    tgt, _, _ = shard_tokens(batch["target"], n_valid, sp_rank, sp_world)
    return {"x": x.contiguous(), "target": tgt.contiguous(), "valid": ids < n_valid, "t": batch["t"],
            "text": batch["text"].contiguous(), "token_ids": token_ids_of(batch, ids), "grid": tuple(batch["grid"]),
            "n_valid": n_valid, "n_pad": n_pad}


def to_device(h: dict, device, non_blocking: bool = True) -> StepInputs:
    """host_inputs(...) -> StepInputs on ``device`` (token_ids stay on the CPU, as in engine.prepare)."""
    def mv(t):
        return t.to(device, non_blocking=non_blocking)
    pack = None
    if "pack" in h:  # a packed step: the sample of each local token, loss weights (0 on padding rows)
        p = h["pack"]
        pack = pack_info(p["cu_seqlens"], p["grids"], p["cu_text"], p["sp_world"], torch.device(device), h["valid"],
                         p.get("dynamic"), p.get("sp_rank", 0))
    return StepInputs(mv(h["x"]), mv(h["target"]), mv(h["valid"]), mv(h["t"]), mv(h["text"]), h["token_ids"],
                      tuple(h["grid"]), int(h["n_valid"]), int(h["n_pad"]), pack)


class StepBatches(Dataset):
    """Item i = this rank's inputs of step ``start + i`` plus the step and its sample ids."""

    def __init__(self, dataset, *, start: int, stop: int, seed: int, dp_rank: int, dp_world: int, micro_batch: int,
                 patch: tuple, sp_rank: int, sp_world: int, base: int = 0, pack_plan: Optional[PackPlan] = None,
                 tile: Optional[tuple] = None, dynamic=None) -> None:
        """pack_plan: --pack-samples (one packed sequence of the plan's pack per step and DP rank); tile:
        --sparse-tile with --sparse-attention tiles (the tokens in tile order, engine.flow_matching_batch);
        dynamic: --dynamic-context-parallel (a ``dynamic.DynamicSP``: each pack's plan of sub-groups)."""
        self.tile, self.dynamic = tile, dynamic
        self.dataset, self.start, self.stop, self.seed, self.base = dataset, start, stop, seed, base
        self.pack_plan = pack_plan
        self.dp_rank, self.dp_world, self.micro, self.patch = dp_rank, dp_world, micro_batch, patch
        self.sp_rank, self.sp_world = sp_rank, sp_world

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getitem__(self, i: int) -> dict:
        step = self.start + i
        if self.pack_plan is not None:
            ids = self.pack_plan.pack(self.pack_plan.index(step, self.dp_rank, self.dp_world))
            batch = packed_batch(self.dataset, ids, self.seed, self.patch)
            plan = self.dynamic.plan(batch["cu_seqlens"]) if self.dynamic is not None else None
            h = packed_host_inputs(batch, self.sp_rank, self.sp_world, plan)
            h["step"], h["sample_ids"] = step, ids
            return h
        batch = flow_matching_batch(self.dataset, step, self.seed, self.dp_rank, self.dp_world, self.micro, self.patch,
                                    base=self.base, tile=self.tile)
        h = host_inputs(batch, self.sp_rank, self.sp_world)
        h["step"] = step
        h["sample_ids"] = [sample_index(step, self.dp_rank, self.dp_world, self.micro, m, self.base)
                           for m in range(self.micro)]
        return h


def _identity(item):
    return item


class DeviceBatches:
    """(step, StepInputs on the device, sample_ids) for every step, from a DataLoader of host batches.

    ``prefetch()`` takes the next host batch from the DataLoader and starts its copy to the device - on CUDA on a
    copy stream of its own. The step loop calls it once the current step's backward is queued (the GPU busy, the
    host about to wait for it anyway), so that between two steps there is neither a wait on the data path nor a
    copy on the compute stream. ``__next__`` prefetches if the loop did not, then orders the compute stream after
    the copy (and marks the batch's tensors as used there, so the allocator keeps them until that stream is done).
    ``take_wait_ms()``: host ms spent waiting on the DataLoader since the last call (what the data path costs the
    host beyond what the read-ahead hides). Values are ``to_device``'s, bit for bit."""

    def __init__(self, loader, device) -> None:
        self.device = torch.device(device)
        self.it = iter(loader)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.ahead: Optional[tuple] = None
        self.done = False
        self.wait_ms = 0.0

    def prefetch(self) -> None:
        """Read the next host batch and start its copy (no-op if one is ahead or the data is done)."""
        if self.ahead is not None or self.done:
            return
        t0 = time.perf_counter()
        try:
            h = next(self.it)
        except StopIteration:
            self.done = True
            return
        finally:
            self.wait_ms += 1e3 * (time.perf_counter() - t0)
        if self.stream is None:
            inp = to_device(h, self.device, non_blocking=False)
        else:
            with torch.cuda.stream(self.stream):
                inp = to_device(h, self.device, non_blocking=True)
        self.ahead = (h["step"], inp, h["sample_ids"])

    def take_wait_ms(self) -> float:
        ms, self.wait_ms = self.wait_ms, 0.0
        return ms

    def __iter__(self) -> "DeviceBatches":
        return self

    def __next__(self) -> tuple:
        self.prefetch()
        if self.ahead is None:
            raise StopIteration
        item, self.ahead = self.ahead, None
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.stream)
            for t in _tensors(item[1]):
                if t.device.type == "cuda":
                    t.record_stream(compute)
        return item


def _tensors(inp: StepInputs) -> list:
    """The tensors a StepInputs holds (its own and its PackInfo's)."""
    out = [v for v in vars(inp).values() if isinstance(v, torch.Tensor)]
    if inp.pack is not None:
        out += [v for v in vars(inp.pack).values() if isinstance(v, torch.Tensor)]
    return out


def step_inputs(batches: StepBatches, device, num_workers: int = 0, prefetch: int = 2,
                pin_memory: Optional[bool] = None) -> DeviceBatches:
    """Every step of ``batches`` as (step, StepInputs on device, sample_ids) (a ``DeviceBatches``), read ahead by
    ``num_workers`` DataLoader processes (``prefetch`` batches each), pinned when the device is CUDA."""
    device = torch.device(device)
    pin = device.type == "cuda" if pin_memory is None else pin_memory
    loader = DataLoader(batches, batch_size=None, shuffle=False, num_workers=num_workers, collate_fn=_identity,
                        pin_memory=pin, prefetch_factor=prefetch if num_workers > 0 else None,
                        persistent_workers=False)
    return DeviceBatches(loader, device)
