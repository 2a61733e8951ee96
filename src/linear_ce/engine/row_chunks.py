"""Which rows the chunk loop visits: the rows that carry an output, in chunks.

Ignored rows (target equal to ``ignore_index``) are never part of a chunk, so
they cost no GEMM. A chunk is a ``slice`` when its rows are consecutive (the
input is used in place, as without any ignored row) and an index tensor
otherwise (its rows are gathered into a ``(chunk, F)`` buffer).

The validity mask is read on the host once per call: on CUDA that is the one
device-to-host synchronisation of a call.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["RowChunk", "chunk_size", "gather_buffers", "row_chunks", "rows_of"]

#: A chunk's rows: consecutive (``slice``) or gathered (an index tensor on the device).
RowChunk = slice | torch.Tensor


def row_chunks(valid: torch.Tensor, chunk: int, device: torch.device) -> list[list[RowChunk]]:
    """For each column ``p`` of the ``(N, P)`` mask ``valid``, its valid rows in chunks of
    at most ``chunk`` rows, in ascending order."""
    host = valid.cpu()
    rows = host.shape[0]
    return [list(_column_chunks(host[:, p], rows, chunk, device)) for p in range(host.shape[1])]


def _column_chunks(
    valid: torch.Tensor, rows: int, chunk: int, device: torch.device
) -> Iterator[RowChunk]:
    if bool(valid.all()):
        for start in range(0, rows, chunk):
            yield slice(start, min(start + chunk, rows))
        return
    index = valid.nonzero()[:, 0]
    for start in range(0, index.numel(), chunk):
        part = index[start : start + chunk]
        first, last = int(part[0]), int(part[-1])
        if last - first + 1 == part.numel():
            yield slice(first, last + 1)
        else:
            yield part.to(device, non_blocking=True)


def chunk_size(rows: RowChunk) -> int:
    """Number of rows in a chunk."""
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def rows_of(t: torch.Tensor, rows: RowChunk, buffer: torch.Tensor | None) -> torch.Tensor:
    """``t[rows]``: a view for consecutive rows, else gathered into ``buffer`` (at least
    ``chunk_size(rows)`` rows of ``t``'s row shape and dtype)."""
    if isinstance(rows, slice):
        return t[rows]
    return torch.index_select(t, 0, rows, out=buffer[: rows.numel()])


def gather_buffers(
    chunks: list[list[RowChunk]],
    size: int,
    input: torch.Tensor,
    acc_dtype: torch.dtype,
    grad_input: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Buffers of ``size`` rows for the gathered chunks among ``chunks``: their rows of
    ``input`` (for :func:`rows_of`) and, with ``grad_input``, their input gradient in
    ``acc_dtype``; ``None`` where every chunk is consecutive (used in place)."""
    if all(isinstance(c, slice) for per_p in chunks for c in per_p):
        return None, None
    shape, device = (size, input.shape[1]), input.device
    return (
        torch.empty(shape, dtype=input.dtype, device=device),
        torch.empty(shape, dtype=acc_dtype, device=device) if grad_input else None,
    )
