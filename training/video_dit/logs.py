"""Start-up output of the entry points: our messages through ``logging``, and the frameworks' known
start-up chatter filtered once, by an explicit list (everything not listed still shows).

Call ``quiet_known_warnings()`` before megatron-core / DeepSpeed / torch's cpp_extension are imported, then
``setup_logging(args.log_level, rank)`` once the rank is known. ``--log-level DEBUG`` also shows the
filtered framework messages again (the filters are removed).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import re
import warnings
from typing import Iterator

# (category, regex on the start of the message, who emits it and why it is harmless here)
KNOWN_WARNINGS: list[tuple[type[Warning], str, str]] = [
    (UserWarning, r"Transformer Engine and Apex are not installed",
     "megatron-core on import (optimizer, clip_grads, megatron_fsdp): falls back to torch implementations"),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm",
     "megatron-core layer specs on import: torch LayerNorm/RMSNorm instead of Apex's fused ones"),
    (UserWarning, r"absl\.logging is not installed",
     "megatron-core's hyper_comm_grid on import: uses the standard logging module instead"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
     "torch >= 2.13 deprecation of the name that DeepSpeed ZeRO (and torch's own helpers) still call"),
]

# (logger, regex on the message, why): framework log records dropped by a filter on that logger.
KNOWN_LOG_RECORDS: list[tuple[str, str, str]] = [
    ("torch.utils.cpp_extension", r"No CUDA runtime is found",
     "a CUDA build of torch on a CPU machine, on import by DeepSpeed's op builder: nothing is compiled for CUDA"),
]

# Loggers of the frameworks whose INFO chatter at start-up is not for the user of a training run.
FRAMEWORK_LOGGERS = ("DeepSpeed",)

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

_installed: list = []


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LEVELS,
                   help="our messages (logger 'megatron_sp_ext' and 'video_dit') at this level on rank 0 "
                        "(other ranks: WARNING); DEBUG also stops filtering the frameworks' known start-up warnings")


class _DropKnown(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.regex = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.regex.search(record.getMessage())


def quiet_known_warnings() -> None:
    """Install the filters of ``KNOWN_WARNINGS`` and ``KNOWN_LOG_RECORDS`` (idempotent)."""
    if _installed:
        return
    for category, pattern, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
        _installed.append(("warning", category, pattern))
    for name, pattern, _why in KNOWN_LOG_RECORDS:
        flt = _DropKnown(pattern)
        logging.getLogger(name).addFilter(flt)
        _installed.append(("log", name, flt))


def restore_known_warnings() -> None:
    """Remove the filters installed by ``quiet_known_warnings``."""
    for kind, what, how in _installed:
        if kind == "log":
            logging.getLogger(what).removeFilter(how)
        else:
            warnings.filters[:] = [f for f in warnings.filters
                                   if not (f[0] == "ignore" and f[2] is what and f[1] is not None
                                           and f[1].pattern == how)]
    _installed.clear()


class _BarAwareHandler(logging.StreamHandler):
    """Writes through tqdm.write when tqdm is installed, so lines do not break a running progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm  # noqa: PLC0415
        except ImportError:
            return super().emit(record)
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def setup_logging(level: str = "INFO", rank: int = 0) -> logging.Logger:
    """Configure our loggers: ``level`` on rank 0, WARNING elsewhere; framework loggers at WARNING
    unless DEBUG. Returns the entry points' logger ``video_dit``."""
    level = level.upper()
    if level not in LEVELS:
        raise ValueError(f"--log-level={level!r} is invalid: choose one of {', '.join(LEVELS)}")
    mine = getattr(logging, level) if rank == 0 else logging.WARNING
    for name, fmt in (("video_dit", "[video_dit] %(message)s"), ("megatron_sp_ext", "%(message)s")):
        handler = _BarAwareHandler()
        handler.setFormatter(logging.Formatter(fmt))  # the library's messages start with "megatron_sp_ext: "
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(mine)
        lg.propagate = False
    for name in FRAMEWORK_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)
    if level == "DEBUG":
        restore_known_warnings()
    return logging.getLogger("video_dit")


@contextlib.contextmanager
def captured_stdout(what: str) -> Iterator[None]:
    """Run a framework call whose progress lines are printed (not logged), e.g. DeepSpeed's
    "deepspeed_shm_comm_op built successfully": its output goes to our DEBUG log instead."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        text = buf.getvalue().strip()
        if text:
            logging.getLogger("video_dit").debug("%s printed: %s", what, text)
