"""Which slice of the vocabulary this process holds, and how row statistics are combined."""

from __future__ import annotations

import torch

__all__ = ["LocalVocab"]


class LocalVocab:
    """The whole vocabulary in one process: combining row statistics is a no-op.

    A vocab-parallel shard (:mod:`linear_ce.distributed`) provides the same
    members (``start``, ``max_``, ``sum_``) with collectives behind them.
    """

    start: int = 0

    def max_(self, row_max: torch.Tensor) -> None:
        """Make ``row_max`` the maximum over every shard, in place."""

    def sum_(self, row_sums: torch.Tensor) -> None:
        """Make ``row_sums`` the sum over every shard, in place."""
