"""A timeline of one rank's work on streams, simulated: what a mode's schedule costs once its parts overlap.

Tasks go to named streams (the compute stream, one communication stream per process group the mode exchanges on) in
the order the code issues them; a task starts when its stream is free and the tasks it waits for are done (CUDA
streams and events). Kernels and copies run on the compute stream; exchanges on a communication stream, or on the
compute stream where the code runs them there (plain Ulysses: one chunk, no side stream).

Overlap is not free. Each exchange (and each copy issued on a communication stream) that runs while the compute
stream is busy hides only its ``hidden`` share of that time (``cluster.Link.hidden``, measured); the rest is added
to the result (``Result.total_ms``: the simulated end + that cost).
"""
from __future__ import annotations

from dataclasses import dataclass, field

COMPUTE = "compute"


@dataclass
class Task:
    stream: str
    ms: float
    deps: tuple = ()
    kind: str = "kernel"   # "kernel", "copy" or "exchange"
    hidden: float = 1.0
    start: float = 0.0
    end: float = 0.0


@dataclass
class Result:
    """What a simulated timeline costs (ms): ``total_ms`` (end + the overlap cost), ``kernel_ms`` / ``copy_ms``
    (busy time), ``exchange_ms`` (exchanges' time), ``hidden_ms`` (the exchanges' time a kernel hid),
    ``exposed_ms`` (exchange_ms - hidden_ms)."""

    total_ms: float = 0.0
    kernel_ms: float = 0.0
    copy_ms: float = 0.0
    exchange_ms: float = 0.0
    hidden_ms: float = 0.0

    @property
    def exposed_ms(self) -> float:
        return self.exchange_ms - self.hidden_ms

    def __add__(self, other: "Result") -> "Result":
        return Result(self.total_ms + other.total_ms, self.kernel_ms + other.kernel_ms, self.copy_ms + other.copy_ms,
                      self.exchange_ms + other.exchange_ms, self.hidden_ms + other.hidden_ms)


@dataclass
class Timeline:
    tasks: list = field(default_factory=list)

    def add(self, stream: str, ms: float, deps=(), kind: str = "kernel", hidden: float = 1.0) -> int:
        """Issue a task; returns its id (for ``deps`` of later tasks). ``deps`` may hold None (no task)."""
        self.tasks.append(Task(stream, max(0.0, ms), tuple(d for d in deps if d is not None), kind, hidden))
        return len(self.tasks) - 1

    def last(self, stream: str = COMPUTE):
        """The id of the last task issued on ``stream`` (None if none)."""
        return next((i for i in range(len(self.tasks) - 1, -1, -1) if self.tasks[i].stream == stream), None)

    def run(self) -> Result:
        free: dict = {}
        for t in self.tasks:
            t.start = max([free.get(t.stream, 0.0)] + [self.tasks[d].end for d in t.deps])
            t.end = t.start + t.ms
            free[t.stream] = t.end
        busy = _merge([(t.start, t.end) for t in self.tasks if t.stream == COMPUTE and t.ms > 0])
        res = Result(total_ms=max((t.end for t in self.tasks), default=0.0))
        for t in self.tasks:
            if t.kind == "kernel":
                res.kernel_ms += t.ms
            elif t.kind == "copy":
                res.copy_ms += t.ms
            if t.stream == COMPUTE:
                continue
            covered = sum(max(0.0, min(b, t.end) - max(a, t.start)) for a, b in busy)
            res.total_ms += (1.0 - t.hidden) * covered
            if t.kind == "exchange":
                res.exchange_ms += t.ms
                res.hidden_ms += t.hidden * covered
        for t in self.tasks:
            if t.stream == COMPUTE and t.kind == "exchange":
                res.exchange_ms += t.ms
        return res


def _merge(spans: list) -> list:
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
