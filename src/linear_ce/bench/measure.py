"""One measured call: wall time and transient peak memory.

CPU: just before the call the freed heap is returned to the OS
(``malloc_trim``), ``VmRSS`` is read from ``/proc/self/status`` and the peak
is reset (``5`` written to ``/proc/self/clear_refs``); afterwards ``VmHWM``
minus that ``VmRSS`` is the call's transient peak — everything the call
allocated at its worst moment, the gradients it returns included. Scratch that
linear_ce kept from the call before (:mod:`linear_ce.engine.scratch`) is counted
as this call's: it is memory the call needs, found already there.
CUDA: CUDA events for time, the ``max_memory_allocated`` delta for memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import time
from collections.abc import Callable

import torch

from linear_ce.engine.scratch import kept_bytes

__all__ = ["Sample", "measure"]


@dataclasses.dataclass(frozen=True)
class Sample:
    seconds: float
    peak_bytes: int


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line; CPU memory needs Linux")


def _trim() -> None:
    # Memory freed by earlier calls stays in glibc's heap and would hide this call's growth.
    name = ctypes.util.find_library("c")
    if name is not None:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def _reset(call: Callable[[], None]) -> None:
    reset = getattr(call, "reset", None)
    if reset is not None:
        reset()
    gc.collect()


def _cpu(call: Callable[[], None]) -> Sample:
    _reset(call)
    _trim()
    before = _status_bytes("VmRSS") - kept_bytes()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    return Sample(seconds, max(0, _status_bytes("VmHWM") - before))


def _cuda(call: Callable[[], None], device: torch.device) -> Sample:
    _reset(call)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    return Sample(start.elapsed_time(end) / 1000.0, max(0, peak))


def measure(call: Callable[[], None], device: torch.device) -> Sample:
    """Time and transient peak memory of one ``call()`` on ``device``; a
    ``call.reset()``, where present, runs first (outside both)."""
    if device.type == "cuda":
        return _cuda(call, device)
    return _cpu(call)
