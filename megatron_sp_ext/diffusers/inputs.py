"""The per-forward check that every rank of the SP group gave the model the same inputs.

    check_same_inputs({"hidden_states": x, "timestep": t, ...}, group)   # every rank, every forward

A parallelized model computes one output from the inputs of every rank (each rank's tokens come from its own
copy of the latent, the text reaches every rank's cross-attention): inputs that differ between ranks (noise seeded
per rank, another prompt) give a mix of them on every rank, with no error. Each rank reduces each input to a few
float64 numbers on its device (present, element count, sum, sum of squares), one all_gather over the group brings
every rank's, and every rank compares them the same way, so all raise the same ``SPConfigError`` or none does. The
set of inputs is fixed (``INPUT_NAMES``; an input not given counts as absent), so every rank gathers the same
amount whatever it was given.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import SPConfigError

# the model inputs compared (WanTransformer3DModel's and WanVACETransformer3DModel's forward), in message order
INPUT_NAMES = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image",
               "control_hidden_states", "control_hidden_states_scale")
_PRESENT, _NUMEL, _SUM, _SUMSQ = range(4)
# equal tensors reduce to equal float64 sums up to the reduction's rounding (bitwise on one kernel): the sum is
# compared to this fraction of its Cauchy-Schwarz bound sqrt(n * sum of squares), the sum of squares relatively
RTOL = 1e-9


def input_checksums(values: dict, device: torch.device) -> torch.Tensor:
    """[len(INPUT_NAMES), 4] float64 on ``device``: per input (present, element count, sum, sum of squares);
    zeros for one that is None or missing from ``values``. Reductions run on each input's own device."""
    rows = []
    for name in INPUT_NAMES:
        x = values.get(name)
        if not isinstance(x, torch.Tensor):
            rows.append(torch.zeros(4, dtype=torch.float64, device=device))
            continue
        x = x.detach() if x.is_floating_point() else x.detach().double()   # e.g. an integer timestep
        with torch.autocast(x.device.type, enabled=False):   # float64 sums, whatever autocast the caller runs
            sums = torch.stack([x.sum(dtype=torch.float64),
                                torch.linalg.vector_norm(x, dtype=torch.float64).square()]).to(device)
        rows.append(torch.cat([torch.tensor([1.0, float(x.numel())], dtype=torch.float64, device=device), sums]))
    return torch.stack(rows)


def _differs(a: list, b: list) -> bool:
    """Whether two inputs' checksums (present, numel, sum, sum of squares) are of different tensors."""
    if a[_PRESENT] != b[_PRESENT] or a[_NUMEL] != b[_NUMEL]:
        return True
    if not a[_PRESENT]:
        return False
    scale = max(a[_SUMSQ], b[_SUMSQ])
    bound = math.sqrt(a[_NUMEL] * scale)
    return abs(a[_SUM] - b[_SUM]) > RTOL * bound or abs(a[_SUMSQ] - b[_SUMSQ]) > RTOL * scale


def _what(row: list) -> str:
    return "none" if not row[_PRESENT] else f"{int(row[_NUMEL])} elements, sum {row[_SUM]:.6g}"


def check_same_inputs(values: dict, group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None) -> None:
    """Raise SPConfigError on every rank of ``group`` when the ``values`` (name -> tensor or None, names from
    INPUT_NAMES) differ between its ranks. Collective: one all_gather of ``len(INPUT_NAMES) x 4`` float64 on
    ``device`` (default: the first given input's device) and one host sync. A group of one rank (or None): nothing."""
    if group is None or dist.get_world_size(group) == 1:
        return
    if device is None:   # the first input given (a rank given no tensor at all still takes part, on the CPU)
        device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    mine = input_checksums(values, device)
    world = dist.get_world_size(group)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = torch.stack(every).cpu().tolist()   # [rank][input][4]
    for r in range(1, world):
        names = [n for i, n in enumerate(INPUT_NAMES) if _differs(rows[r][i], rows[0][i])]
        if names:
            first = INPUT_NAMES.index(names[0])
            raise SPConfigError(
                f"parallelize: {', '.join(names)} differ between SP ranks (rank {r} != rank 0; {names[0]} on rank {r}: "
                f"{_what(rows[r][first])}, on rank 0: {_what(rows[0][first])}): give every rank of the SP "
                f"group the same latent, timestep and text (seed the noise the same on every rank); "
                f"parallelize(..., check_inputs=False) skips this check where they are equal by construction")
