"""Measured local-kernel speed, the table the speed plan reads (``kernel_rates.json`` beside this file).

Format (written by ``tools/bench_kernels.py --rates`` on a GPU, or by ``--rates-from`` out of committed benchmark
JSONs; every row names its source file):
  {"devices": {DEVICE: {"sm_count": n,
                        "dense": {KERNEL: [{"s", "h", "causal", "fwd_ms", "fwd_bwd_ms", "source"}, ...]},
                        "block_sparse": {KERNEL: [{"s", "h", "tile", "density", "mask", "fwd_ms", "fwd_bwd_ms",
                                                   "source"}, ...]}}}}
  Rows are one call on one GPU: B=1, head dim 128, bf16, sq = sk = s; block-sparse rows are non-causal.

A call's time (``KernelRates.call_ms``): its FLOPs (4 sq sk h D B; half for a causal diagonal call; x the tile
density) at the rate of its kernel's rows of the same causality, interpolated in log FLOPs between rows and held at
the ends (rate = FLOPs / ms; backward = fwd_bwd - fwd, at 2.5x the forward's FLOPs). A call with fewer query tiles
x heads (128 tokens) than the GPU has SMs fills only that share of one wave: its rate is cut by that share. A
block-sparse call costs the dense call's time x density x the kernel's overhead at that tile size: the mean over
its rows of (row time / (dense time at the row's shape x the row's density)). Nothing here is fitted: every number
is a measured row or the SM count.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from ...errors import SPConfigError

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_rates.json")
Q_TILE = 128   # query tokens per kernel CTA (FA4 / cuDNN on Hopper): what fills the SMs
# devices with the same compute (H100 SXM and H200: one GH100 die, 132 SMs, the same clocks; only the memory
# differs): where one has no rows of a causality, the other's are read
SAME_COMPUTE = {"H100": "H200", "H200": "H100"}


@dataclass(frozen=True)
class Call:
    """One local kernel call: ``sq`` queries x ``sk`` keys x ``heads`` (B = batch), ``causal``: a diagonal causal
    call (half the pairs); ``density``: the share of tile pairs a block mask selects (1.0: dense) at ``tile``."""

    sq: int
    sk: int
    heads: int
    causal: bool = False
    density: float = 1.0
    tile: int = 128
    batch: int = 1

    def flops(self, head_dim: int) -> float:
        """Forward FLOPs (the pairs the call computes)."""
        return 4.0 * self.sq * self.sk * self.heads * head_dim * self.batch * (0.5 if self.causal else 1.0)


def _interp(points: list, x: float) -> float:
    """Piecewise-linear in log x through sorted (x, y) points, held at both ends."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 1.0
            return y0 + w * (y1 - y0)
    return points[-1][1]  # pragma: no cover - the loop returns


class KernelRates:
    """The kernel-rate table (module docstring): ``call_ms(device, kernel, call)`` -> (fwd ms, bwd ms)."""

    def __init__(self, table: dict, source: str = "<dict>") -> None:
        self.table, self.source = table, source
        if not isinstance(table.get("devices"), dict) or not table["devices"]:
            raise SPConfigError(f"kernel-rate table {source}: no 'devices' (see megatron_sp_ext/sp/speed_plan/rates.py "
                                f"for the format)")
        self._curves: dict = {}

    @classmethod
    def load(cls, path: Optional[str] = None) -> "KernelRates":
        """The table at ``path`` (default: the package's kernel_rates.json)."""
        path = path or TABLE
        try:
            with open(path) as f:
                return cls(json.load(f), path)
        except (OSError, json.JSONDecodeError) as e:
            raise SPConfigError(f"kernel-rate table {path} cannot be read: {e}") from None

    def check(self, device: str, kernel: str) -> None:
        """SPConfigError naming what the table has, unless it has dense rows of ``kernel`` on ``device``."""
        self._rows(device, "dense", kernel)

    def devices(self) -> tuple:
        return tuple(self.table["devices"])

    def kernels(self, device: str) -> tuple:
        return tuple(self._device(device).get("dense", {}))

    def _device(self, device: str) -> dict:
        dev = self.table["devices"].get(device)
        if dev is None:
            raise SPConfigError(f"device {device!r} has no rows in the kernel-rate table {self.source}: use one of "
                                f"{', '.join(self.devices())} (or measure it: tools/bench_kernels.py --rates)")
        return dev

    def _rows(self, device: str, kind: str, kernel: str) -> list:
        rows = self._device(device).get(kind, {}).get(kernel)
        if not rows:
            have = ", ".join(self._device(device).get(kind, {})) or "none"
            raise SPConfigError(f"kernel {kernel!r} has no {kind} rows for {device} in {self.source} (have: {have})")
        return rows

    def _curve(self, device: str, kernel: str, causal: bool, head_dim: int) -> tuple:
        """Sorted (FLOPs, TFLOP/s) points of the forward and of the backward."""
        key = (device, kernel, causal, head_dim)
        if key not in self._curves:
            rows = [r for r in self._rows(device, "dense", kernel) if bool(r["causal"]) == causal]
            twin = SAME_COMPUTE.get(device)
            if not rows and twin in self.table["devices"]:
                rows = [r for r in self._rows(twin, "dense", kernel) if bool(r["causal"]) == causal]
            if not rows:
                raise SPConfigError(f"kernel {kernel!r} on {device}: no {'causal' if causal else 'non-causal'} rows "
                                    f"in {self.source}")
            fwd, bwd = [], []
            for r in rows:
                fl = Call(r["s"], r["s"], r["h"], causal).flops(head_dim)
                fwd.append((fl, fl / r["fwd_ms"]))
                bwd.append((2.5 * fl, 2.5 * fl / (r["fwd_bwd_ms"] - r["fwd_ms"])))
            self._curves[key] = (sorted(fwd), sorted(bwd))
        return self._curves[key]

    def dense_ms(self, device: str, kernel: str, call: Call, head_dim: int = 128) -> tuple:
        """(fwd ms, bwd ms) of ``call`` run dense."""
        fwd_pts, bwd_pts = self._curve(device, kernel, call.causal, head_dim)
        fl = call.flops(head_dim)
        if fl <= 0:
            return 0.0, 0.0
        sms = self._device(device).get("sm_count", 132)
        fill = min(1.0, math.ceil(call.sq / Q_TILE) * call.heads * call.batch / sms)
        return fl / _interp(fwd_pts, fl) / fill, 2.5 * fl / _interp(bwd_pts, 2.5 * fl) / fill

    def sparse_overhead(self, device: str, kernel: str, tile: int, head_dim: int = 128) -> Optional[tuple]:
        """(fwd, bwd) time of ``kernel``'s block-sparse calls at ``tile`` over (dense time x density); None when
        the table has no such rows."""
        key = ("sparse", device, kernel, tile, head_dim)
        if key in self._curves:
            return self._curves[key]
        rows = [r for r in self._device(device).get("block_sparse", {}).get(kernel, []) if r["tile"] == tile]
        if not rows:
            self._curves[key] = None
            return None
        fwd, bwd = [], []
        for r in rows:
            d_fwd, d_bwd = self.dense_ms(device, self.dense_kernel_for(device, kernel), Call(r["s"], r["s"], r["h"]),
                                         head_dim)
            fwd.append(r["fwd_ms"] / (d_fwd * r["density"]))
            bwd.append((r["fwd_bwd_ms"] - r["fwd_ms"]) / (d_bwd * r["density"]))
        self._curves[key] = (sum(fwd) / len(fwd), sum(bwd) / len(bwd))
        return self._curves[key]

    def dense_kernel_for(self, device: str, kernel: str) -> str:
        """The dense rows a block-sparse kernel is measured against: its own name's, else the first dense kernel."""
        dense = self._device(device).get("dense", {})
        return kernel if kernel in dense else next(iter(dense))

    def call_ms(self, device: str, kernel: str, call: Call, head_dim: int = 128) -> tuple:
        """(fwd ms, bwd ms) of ``call`` on ``device`` with dense ``kernel``. Block-sparse calls (density < 1) run
        the fastest block-sparse kernel the table has at the call's tile (what backend "auto" takes where they
        are installed): its dense reference's time x density x its overhead."""
        if call.density >= 1.0:
            return self.dense_ms(device, kernel, call, head_dim)
        found = {k: o for k in self._device(device).get("block_sparse", {})
                 if (o := self.sparse_overhead(device, k, call.tile, head_dim)) is not None}
        if not found:
            raise SPConfigError(f"no block-sparse rows at tile {call.tile} for {device} in {self.source}: measure "
                                f"them (tools/bench_kernels.py --rates) or use a tile the table has")
        name = min(found, key=lambda k: found[k][0] + found[k][1])
        fwd, bwd = self.dense_ms(device, self.dense_kernel_for(device, name), call, head_dim)
        return fwd * call.density * found[name][0], bwd * call.density * found[name][1]


@lru_cache(maxsize=4)
def package_rates(path: Optional[str] = None) -> KernelRates:
    """The package's table, read once."""
    return KernelRates.load(path)
