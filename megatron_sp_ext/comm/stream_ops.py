"""CUDA stream memory operations (wait for / write a 32-bit flag on a stream, without a kernel) and
the few other driver calls the kernel-free exchange queues: async copies, events.

``cuStreamWaitValue32`` and ``cuStreamWriteValue32`` are executed by the GPU's stream front end,
not by SMs, so a flag wait or a flag write queued next to a long attention kernel neither takes SMs
from it nor waits for a free SM (a barrier kernel does both). The write fences the stream's earlier
memory writes before the flag lands, so a peer that sees the flag sees the data. They are called
through the driver library with ctypes (torch exposes only the write); the address may be this
device's memory or a peer's memory mapped into this process (torch symmetric memory).

Copies and events are also queued straight through the driver (``memcpy``, ``Event``): one
exchange queues ~4 driver calls per peer, and through torch's tensor ``copy_`` / stream guards /
``wait_stream`` the host needed ~0.3 ms per exchange at P=4, more than the GPU time of a chunk.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, i.e. wrap-around safe
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: memory fence before the write

_LIB: Optional[tuple] = None
_ERR: Optional[str] = None


def _load() -> Optional[tuple]:
    global _LIB, _ERR
    if _LIB is not None or _ERR is not None:
        return _LIB
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        _ERR = f"the CUDA driver library cannot be loaded ({e})"
        return None
    vp, u64, u32, uint = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint
    sigs = {"cuStreamWaitValue32": [vp, u64, u32, uint], "cuStreamWriteValue32": [vp, u64, u32, uint],
            "cuMemcpyDtoDAsync": [u64, u64, ctypes.c_size_t, vp], "cuEventCreate": [ctypes.POINTER(vp), uint],
            "cuEventRecord": [vp, vp], "cuStreamWaitEvent": [vp, vp, uint], "cuEventDestroy": [vp]}
    fns = []
    for base, argtypes in sigs.items():
        fn = getattr(lib, base + "_v2", None) or getattr(lib, base, None)
        if fn is None:
            _ERR = f"the CUDA driver has no {base}"
            return None
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        fns.append(fn)
    _LIB = tuple(fns)
    return _LIB


def unavailable_reason() -> Optional[str]:
    """Why stream memory operations cannot be used here, or None when they can."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    _load()
    return _ERR


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def wait_geq(stream: "torch.cuda.Stream", addr: int, value: int) -> None:
    """Queue on ``stream``: wait until the uint32 at device address ``addr`` is >= ``value``
    (mod 2**32 comparison). Later work on ``stream`` starts only after that."""
    _check(_fns()[0](stream.cuda_stream, addr, value & 0xFFFFFFFF, WAIT_GEQ), "cuStreamWaitValue32")


def write(stream: "torch.cuda.Stream", addr: int, value: int) -> None:
    """Queue on ``stream``: after its earlier work (and a memory fence), store ``value`` to the uint32
    at device address ``addr`` (local or a mapped peer address)."""
    _check(_fns()[1](stream.cuda_stream, addr, value & 0xFFFFFFFF, WRITE_DEFAULT), "cuStreamWriteValue32")


def _fns() -> tuple:
    fns = _load()
    if fns is None:
        raise RuntimeError(_ERR)
    return fns


def memcpy(stream: "torch.cuda.Stream", dst: int, src: int, nbytes: int) -> None:
    """Queue on ``stream`` a device-to-device copy of ``nbytes`` (peer addresses allowed: copy engine)."""
    _check(_fns()[2](dst, src, nbytes, stream.cuda_stream), "cuMemcpyDtoDAsync")


class Event:
    """A driver event without timing, reused: ``record`` on one stream, ``wait`` on others (the
    wait applies to the latest record, as with CUDA runtime events)."""

    def __init__(self) -> None:
        self._fns = _fns()
        self.handle = ctypes.c_void_p()
        _check(self._fns[3](ctypes.byref(self.handle), 0x2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING

    def record(self, stream: "torch.cuda.Stream") -> None:
        _check(self._fns[4](self.handle, stream.cuda_stream), "cuEventRecord")

    def wait(self, stream: "torch.cuda.Stream") -> None:
        _check(self._fns[5](stream.cuda_stream, self.handle, 0), "cuStreamWaitEvent")

    def __del__(self) -> None:
        if getattr(self, "handle", None) and self.handle.value:
            try:
                self._fns[6](self.handle)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


# A compiled exchange: a tuple of (code, stream handle, a, b, c) run by ``run_program`` with one driver
# call each and no per-op Python objects (the host cost of an exchange is what short chunks are bound by).
WAIT, WRITE, COPY, STAGE, EVENT_RECORD, EVENT_WAIT = range(6)


def run_program(program: tuple, epoch: int, recv_ptr: int, send_ptr: int) -> None:
    """Queue ``program`` for exchange ``epoch``. Ops: (WAIT, stream, addr, delta) waits for flag >=
    epoch + delta; (WRITE, stream, addr, delta) writes epoch + delta; (COPY, stream, dst_off, src, n)
    copies n bytes from src to recv_ptr + dst_off; (STAGE, stream, dst, n) copies n bytes from
    send_ptr to dst; (EVENT_RECORD / EVENT_WAIT, stream, event handle)."""
    f = _fns()
    wait_fn, write_fn, copy_fn, record_fn, ev_wait_fn = f[0], f[1], f[2], f[4], f[5]
    for code, stream, a, b, c in program:
        if code == COPY:
            rc = copy_fn(recv_ptr + a, b, c, stream)
        elif code == WAIT:
            rc = wait_fn(stream, a, (epoch + b) & 0xFFFFFFFF, WAIT_GEQ)
        elif code == WRITE:
            rc = write_fn(stream, a, (epoch + b) & 0xFFFFFFFF, WRITE_DEFAULT)
        elif code == EVENT_WAIT:
            rc = ev_wait_fn(stream, a, 0)
        elif code == EVENT_RECORD:
            rc = record_fn(a, stream)
        else:  # STAGE
            rc = copy_fn(a, send_ptr, b, stream)
        if rc != 0:
            raise RuntimeError(f"stream op {code} of an exchange failed with CUresult {rc}")
