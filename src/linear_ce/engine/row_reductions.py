"""Row max and row sum of a logits tile, fast in either layout.

A class-major tile (a ``(V, B)`` array used as its ``(B, V)`` transpose,
:meth:`linear_ce.engine.gemm.Gemm.logits_buffer`) reduces each row over its strided
dimension; torch then parallelises over the ``B`` outputs alone and walks each
column of the array in a long strided stride. Folding the classes into ``SPLIT``
slabs first (``(SPLIT, V / SPLIT, B)``, reduced over the middle dimension, then over the
slabs) gives ``SPLIT · B`` outputs, each reduced over contiguous rows of ``B``
elements, so every thread streams memory in order: the reductions take a fraction of
their strided time. The max is the same value either way; the sum is added in another
order (a rounding of the sum's own).
"""

from __future__ import annotations

import torch

__all__ = ["SPLIT", "row_max", "row_sum"]

#: Slabs the classes of a class-major tile are folded into: enough outputs to keep every
#: thread busy, few enough that the second reduction is short; the choice is not critical
#: (counts from 16 to 256 run within a small factor of each other). Tiles with fewer than
#: ``SPLIT²`` classes are reduced as they are.
SPLIT = 64


def _slabs(tile: torch.Tensor) -> torch.Tensor | None:
    """The class-major array of ``tile`` ``(B, V)`` folded into ``(SPLIT, V // SPLIT, B)``
    slabs (its first ``V - V % SPLIT`` classes), or ``None`` where it is row-major or
    too narrow to gain."""
    rows, classes = tile.shape
    if rows < 2 or tile.stride(0) != 1 or classes < SPLIT * SPLIT:
        return None
    return tile.T[: classes - classes % SPLIT].unflatten(0, (SPLIT, -1))


def row_max(tile: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tile.amax(dim=1)`` ``(B,)`` (into ``out`` where given)."""
    slabs = _slabs(tile)
    if slabs is None:
        return tile.amax(dim=1) if out is None else torch.amax(tile, 1, out=out)
    result = torch.amax(slabs.amax(1), 0, out=out)
    rest = tile.shape[1] % SPLIT
    if rest:
        torch.maximum(result, tile[:, -rest:].amax(dim=1), out=result)
    return result


def row_sum(tile: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``tile.sum(dim=1)`` ``(B,)`` into ``out``."""
    slabs = _slabs(tile)
    if slabs is None:
        return torch.sum(tile, dim=1, out=out)
    torch.sum(slabs.sum(1), 0, out=out)
    rest = tile.shape[1] % SPLIT
    if rest:
        out.add_(tile[:, -rest:].sum(dim=1))
    return out
