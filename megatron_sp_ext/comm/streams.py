"""Side streams and events for overlapping exchanges with compute.

``StreamPool`` owns one communication stream per CUDA device, created on first use and reused:
never one per call. Adapters hold their own pool and pass streams explicitly; the functional API
falls back to ``default_pool()``. On CPU every helper is a no-op and work runs in program order.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch


class StreamPool:
    """Caches one high-priority communication stream per CUDA device."""

    def __init__(self, priority: int = -1) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._priority = priority

    def comm_stream(self, device: torch.device) -> Optional["torch.cuda.Stream"]:
        if device.type != "cuda":
            return None
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = torch.cuda.Stream(device=idx, priority=self._priority)
        return self._streams[idx]


_DEFAULT_POOL = StreamPool()


def default_pool() -> StreamPool:
    """The process-wide pool used when the caller passes no stream."""
    return _DEFAULT_POOL


def on_stream(stream: Optional["torch.cuda.Stream"]):
    """Context manager switching to ``stream`` (no-op for None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def record(stream: Optional["torch.cuda.Stream"]) -> Optional["torch.cuda.Event"]:
    """Event recorded on ``stream`` now (None on CPU)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def wait(stream: Optional["torch.cuda.Stream"], event: Optional["torch.cuda.Event"]) -> None:
    """Make ``stream`` wait for ``event`` (no-op on CPU)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def current(device: torch.device) -> Optional["torch.cuda.Stream"]:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None
