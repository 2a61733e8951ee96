r"""Scratch tiles kept from one call to the next, so their pages fault in once.

A call's logits tile is fresh memory: each 4 KiB page of it faults in when first
written, and a tile above malloc's mmap threshold is unmapped again when the call
returns. The first GEMM into a fresh tile pays its page faults on top of its work (about
twice the time of the later GEMMs into the same tile; docs/journal.md, scratch kept between
calls, has the measurements), a cost of every call that the floor does not pay.

A floor's GEMMs write into memory that is already there, and so do the same GEMMs
in a training loop whose head keeps its tile. So the loops (:func:`keeps_scratch`)
give their large buffers (:func:`scratch`, at least :data:`MIN_KEPT_BYTES`) back here
when they return. The next call takes a kept buffer that holds what it asks for with at
most an eighth to spare. Where none does, every kept buffer is freed before it
allocates, so a kept buffer never sits beside a new one. Without that bound, a
``token_logprobs`` backward that took its forward's tile for one half its size would
hold the difference beside its own buffers, past the plan's memory budget. What
a call returns replaces what was kept. So between calls the process holds one call's
scratch, the last one's, which the plan's memory budget already bounds.

A buffer that something still references when its loop returns is never kept. An
exception's traceback is such a reference. A forked child starts with nothing kept
(a data loader's worker would otherwise hold copies of the parent's tiles).

``LINEAR_CE_KEEP_SCRATCH=0`` turns keeping off (every call's scratch is fresh, as
before); :func:`release` frees what is kept. Other devices have caching allocators of
their own, so :func:`scratch` is ``torch.empty`` there. Kept or fresh, a buffer is
written before it is read, so keeping never changes a result.
"""

from __future__ import annotations

import contextvars
import functools
import math
import os
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from linear_ce.engine.environment import read

__all__ = [
    "KEEP_SCRATCH_ENV",
    "MIN_KEPT_BYTES",
    "keeps_scratch",
    "kept_bytes",
    "release",
    "scratch",
]

KEEP_SCRATCH_ENV = "LINEAR_CE_KEEP_SCRATCH"
#: Smaller buffers stay in malloc's heap between calls anyway (its mmap threshold
#: starts at 128 KiB and rises to the size of what it unmapped last).
MIN_KEPT_BYTES = 1 << 20

_lock = threading.Lock()
_kept: list[torch.Tensor] = []
# The buffers the innermost running loop of this thread (or task) has taken; None
# outside a loop.
_taken: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "linear_ce_scratch_taken", default=None
)


def _forked() -> None:
    global _lock
    _lock = threading.Lock()
    _kept.clear()


os.register_at_fork(after_in_child=_forked)

P = ParamSpec("P")
R = TypeVar("R")


def _keeping() -> bool:
    return read(KEEP_SCRATCH_ENV) == "1"


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous ``shape`` tensor: a kept buffer where one holds it and
    the caller runs under :func:`keeps_scratch`, else a new one."""
    taken = _taken.get()
    nbytes = math.prod(shape) * dtype.itemsize
    if taken is None or device.type != "cpu" or nbytes < MIN_KEPT_BYTES or not _keeping():
        return torch.empty(shape, dtype=dtype, device=device)
    with _lock:
        fits = [i for i, b in enumerate(_kept) if nbytes <= b.numel() <= nbytes + nbytes // 8]
        buffer = _kept.pop(min(fits, key=lambda i: _kept[i].numel())) if fits else None
        if buffer is None:
            # The kept buffers go before this one is allocated, so none sits beside it.
            _kept.clear()
    if buffer is None:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    taken.append(buffer)
    return buffer[:nbytes].view(dtype).view(shape)


def _unreferenced(buffer: torch.Tensor) -> bool:
    """Whether only ``buffer`` itself holds its memory: no view of it, no other tensor."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    # The buffer and the storage object made here to ask.
    return use_count(buffer.untyped_storage()._cdata) <= 2


def _give_back(taken: list[torch.Tensor]) -> None:
    free = [b for b in taken if _unreferenced(b)]
    with _lock:
        # The last call's scratch, nothing more: what the next call of its shape takes.
        _kept[:] = free


def keeps_scratch(loop: Callable[P, R]) -> Callable[P, R]:
    """``loop`` with its :func:`scratch` buffers kept for the next call when it returns."""

    @functools.wraps(loop)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        taken: list[torch.Tensor] = []
        token = _taken.set(taken)
        try:
            return loop(*args, **kwargs)
        finally:
            _taken.reset(token)
            _give_back(taken)

    return run


def kept_bytes() -> int:
    """The bytes of scratch kept between calls now."""
    with _lock:
        return sum(b.numel() for b in _kept)


def release() -> None:
    """Free the scratch kept between calls (the next call makes its own again)."""
    with _lock:
        _kept.clear()
