"""The vocabulary a call sees: which classes this process holds, and how row statistics
are combined over the processes that hold the others."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["LocalVocab", "Vocab"]


class Vocab(Protocol):
    """Where the classes of a call lie: this process holds ``[start, start + V_local)``
    of ``total`` classes, and the chunk size is planned for ``plan_classes`` of them (the
    same on every process, so that every process runs the same chunks). ``max_`` and
    ``sum_`` combine row statistics over the processes that hold the others, in place.

    :class:`LocalVocab` is the whole vocabulary; a vocab-parallel shard is
    :class:`linear_ce.parallel.shard.VocabShard`.
    """

    start: int
    total: int
    plan_classes: int

    def max_(self, row_max: torch.Tensor) -> None:
        """Make ``row_max`` the maximum over every shard, in place."""

    def sum_(self, row_sums: torch.Tensor) -> None:
        """Make ``row_sums`` the sum over every shard, in place."""

    def merge_topk(
        self, values: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest of every shard's ``(..., k)`` candidates ``values`` (ids of the
        whole vocabulary in ``ids``; ``-1`` in a slot without a class), per row, sorted
        in descending order."""


class LocalVocab:
    """The whole vocabulary of ``classes`` classes in one process: combining row
    statistics is a no-op."""

    start: int = 0

    def __init__(self, classes: int) -> None:
        self.total = classes
        self.plan_classes = classes

    def max_(self, row_max: torch.Tensor) -> None:
        """Make ``row_max`` the maximum over every shard, in place."""

    def sum_(self, row_sums: torch.Tensor) -> None:
        """Make ``row_sums`` the sum over every shard, in place."""

    def merge_topk(
        self, values: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidates themselves: they are already every class's."""
        return values, ids
