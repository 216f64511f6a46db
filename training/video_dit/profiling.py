"""Where a training step's time goes: torch.profiler over steps [--profile-step-start, --profile-step-end)
on --profile-ranks (Megatron-LM's flag names), written beside metrics.jsonl as a Chrome trace
(profile_rank{r}.json, open in chrome://tracing or Perfetto) and two tables (profile_rank{r}.txt): kernels
by device time and ops by self CPU time. A CPU time close to the step time means the host is the bound."""
from __future__ import annotations

import os
from typing import Optional

import torch


class StepProfiler:
    """``step(n)`` before each step's work; ``close()`` at the end (idempotent)."""

    def __init__(self, enabled: bool, start: int, end: int, ranks, rank: int, out_dir: Optional[str], device) -> None:
        if enabled and not 0 <= start < end:
            raise ValueError(f"--profile-step-start={start} / --profile-step-end={end}: need 0 <= start < end")
        self.on = enabled and rank in set(ranks)
        self.start, self.end, self.rank, self.out_dir = start, end, rank, out_dir or "."
        self.cuda = torch.device(device).type == "cuda"
        self.prof = None

    def step(self, n: int) -> None:
        if not self.on:
            return
        if n == self.start and self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True)  # shapes: cross vs self attention
            self.prof.__enter__()
        elif n == self.end:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        base = os.path.join(self.out_dir, f"profile_rank{self.rank}")
        self.prof.export_chrome_trace(base + ".json")
        avg = self.prof.key_averages()
        with open(base + ".txt", "w") as f:
            f.write(f"steps [{self.start}, {self.end}) on rank {self.rank}\n\n")
            if self.cuda:
                f.write(avg.table(sort_by="self_cuda_time_total", row_limit=40) + "\n\n")
            f.write(avg.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        self.prof, self.on = None, False
