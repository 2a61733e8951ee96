r"""What a loss plug-in ("head") of the chunk loop provides.

The loop (:mod:`linear_ce.engine.chunk_loop`) owns the GEMMs, the logits transform,
the row maximum and the row sum of :math:`e^{u}` with :math:`u = s - \max_j s`.
Per chunk it calls, in this order:

1. ``sums_before_exp(u, rows, p, out)``: row sums the head needs from
   :math:`u` (e.g. the target logit), written into ``out`` ``(B, extra_sums)``.
2. ``sums_after_exp(u, e, out)``: row sums that need :math:`u` and
   :math:`e = e^{u}` together (only when ``keeps_logits``; ``u`` may be
   overwritten from here on).
3. the loop sums ``out`` over vocabulary shards (one collective with
   :math:`\sum_j e_j`); a head with ``late_sums`` then forms
   ``sums_after_stats(u, e, stats, out)`` (row sums that need the combined
   statistics), summed over shards in a second collective and passed as
   ``stats.late``; then ``rows_done(rows, p, stats)`` writes the per-row
   outputs.
4. only when gradients are wanted: ``grad_tile(u, e, rows, p, stats, factor)``
   turns one of the two tiles into :math:`\partial L / \partial s` times
   ``factor`` (the constant of the logits transform) and returns it. A head
   with ``grads_after_chunk = True`` (optional; a row's gradient needs every
   row of its chunk done first) may get ``rows_done`` for the chunk a step of
   rows at a time, and then ``grad_tile`` for each step in a second sweep, with
   that step's ``stats``: its ``grad_tile`` reads nothing an earlier step left.
   With ``scaled_rows = True`` too, ``grad_tile`` follows each step's ``rows_done``
   (one sweep) and gives the gradient up to a factor per row, which
   ``row_factors(rows, p)`` ``(B,)`` gives once the chunk's rows are all done.

A head run with a companion projection (a teacher's head,
:class:`linear_ce.engine.chunk_loop.Companion`) also gets ``companion_tile(t, rows, p)``
first: the companion's transformed logits minus their row max, a tile it may
overwrite. A head never issues a GEMM, never allocates anything that grows with
``N·V``, and never knows the device or the vocabulary sharding beyond its
slice ``[vocab_start, vocab_start + local_classes)``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from linear_ce.engine.row_chunks import RowChunk

__all__ = [
    "Head",
    "HeadFrame",
    "KnownStatsHead",
    "NativeGrad",
    "NativeRowsHead",
    "RowStats",
    "Tile",
]

#: A tile of the loop: ``(B, C)`` values of one chunk's rows (``B``) and classes (``C``, the
#: local vocabulary or a block of it) in the accumulation dtype: logits, their exponentials,
#: a gradient. Any memory layout (class-major on a CPU).
Tile = torch.Tensor


@dataclasses.dataclass(frozen=True)
class HeadFrame:
    """What every head of a call is built on: the rows' class indices ``target`` ``(N, P)``
    (int64), which of them carry an output (``valid``, ``(N, P)`` bool), the slice of the
    vocabulary the head sees, ``[vocab_start, vocab_start + local_classes)``, and the
    accumulation dtype ``acc_dtype`` of its outputs. The op builds it once and hands it to
    the head's constructor."""

    target: torch.Tensor
    valid: torch.Tensor
    vocab_start: int
    local_classes: int
    acc_dtype: torch.dtype

    def zeros(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A per-row output ``(N, P)`` of zeros, in ``acc_dtype`` unless ``dtype``."""
        dtype = self.acc_dtype if dtype is None else dtype
        return torch.zeros(self.valid.shape, dtype=dtype, device=self.target.device)

    def local_columns(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(owned, column)`` of class ids ``ids``: whether each lies in this slice, and its
        column in the slice's tiles (0 where it does not: a safe index, masked by ``owned``)."""
        local = ids - self.vocab_start
        owned = (local >= 0) & (local < self.local_classes)
        return owned, torch.where(owned, local, 0)


@dataclasses.dataclass
class RowStats:
    """Statistics of one chunk's rows, each ``(B,)`` in the accumulation dtype, summed
    over every vocabulary shard: ``row_max`` :math:`m`, ``sum_exp``
    :math:`Z = \\sum_j e^{s_j - m}`, ``log_sum_exp`` :math:`\\log Z`, ``lse``
    :math:`m + \\log Z`, and the head's own ``sums`` ``(B, extra_sums)``."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor
    log_sum_exp: torch.Tensor
    lse: torch.Tensor
    sums: torch.Tensor
    late: torch.Tensor | None = None

    @classmethod
    def of(cls, row_max: torch.Tensor, stats: torch.Tensor) -> RowStats:
        """The rows' statistics from their max and their summed ``(Σ eᵘ, head's sums)``
        ``(B, 1 + extra_sums)``."""
        sum_exp = stats[:, 0]
        log_sum_exp = sum_exp.log()
        # A ±inf row max is the lse itself (as torch.logsumexp), not inf − inf = NaN.
        lse = torch.where(row_max.isinf(), row_max, row_max + log_sum_exp)
        return cls(row_max, sum_exp, log_sum_exp, lse, stats[:, 1:])


class Head(Protocol):
    #: ``(N, P)`` bool: the rows (and positions) that carry an output; the others are skipped.
    valid: torch.Tensor
    #: Number of row sums the head adds to the loop's statistics.
    extra_sums: int
    #: Whether :math:`u` must survive the exponential (a second ``(B, V)`` tile).
    keeps_logits: bool
    #: Number of row sums formed after the first combination (``sums_after_stats``).
    late_sums: int

    def sums_before_exp(self, u: Tile, rows: RowChunk, p: int, out: torch.Tensor) -> None:
        """Row sums read from :math:`u`, into ``out``."""

    def sums_after_exp(self, u: Tile, e: Tile, out: torch.Tensor) -> None:
        """Row sums read from :math:`u` and :math:`e` together, into ``out``."""

    def sums_after_stats(self, u: Tile, e: Tile, stats: RowStats, out: torch.Tensor) -> None:
        """Row sums that need the combined statistics, into ``out`` (only with ``late_sums``)."""

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        """Write the per-row outputs of ``rows`` at position ``p``."""

    def grad_tile(
        self, u: Tile, e: Tile, rows: RowChunk, p: int, stats: RowStats, factor: float
    ) -> Tile:
        """Overwrite a tile with ``factor · ∂L/∂s`` and return it."""


@dataclasses.dataclass
class NativeGrad:
    r"""A head's gradient in the form the compiled row loops write
    (:mod:`linear_ce.engine.native_rows`), per row ``(B,)``:
    :math:`g_j = e^{u_j}\,(a + b\,(u_j - \mu)) + \gamma\,[j = t]` (``b``, ``mu``: ``None``
    for none; the target columns those :meth:`NativeRowsHead.native_targets` gave)."""

    a: torch.Tensor
    gamma: torch.Tensor
    b: torch.Tensor | None = None
    mu: torch.Tensor | None = None


class NativeRowsHead(Protocol):
    r"""A head whose row math the compiled row loops do on a half tile: its row sums are the
    target column's :math:`u_t` and, where ``native_targets`` asks, :math:`\sum_j e^{u_j} u_j`; its
    gradient is a :class:`NativeGrad`. ``native`` says whether this call's options allow it;
    ``native_fp32`` whether its fp32 tiles take them too."""

    native: bool
    native_fp32: bool

    def native_targets(self, rows: RowChunk, p: int) -> tuple[torch.Tensor, bool]:
        """The rows' local target columns ``(B,)`` (``-1`` where another shard holds the
        target) and whether the loops must form the dot sum."""

    def native_sums(
        self, target_u: torch.Tensor, dot: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """The head's row sums (``out``, as ``sums_before_exp`` and ``sums_after_exp`` write
        them) from the loops' ``target_u`` and ``dot``."""

    def native_fused(
        self, rows: RowChunk, p: int, factor: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(c0, c1, gamma)`` ``(B,)`` where the gradient's coefficients are known before the
        row statistics, :math:`a = (c_0 + c_1\\,\\mathrm{lse}) / Z`, :math:`b = 0` (the loops
        then write it in the same visit of each row); ``None`` otherwise. After
        ``native_targets``."""

    def native_grad(self, rows: RowChunk, p: int, stats: RowStats, factor: float) -> NativeGrad:
        """``factor · ∂L/∂s`` of ``rows`` as a :class:`NativeGrad`, after ``rows_done``
        (a head whose ``native_fused`` never returns ``None`` needs none)."""


class KnownStatsHead(Protocol):
    """A head of the vocabulary pass (:mod:`linear_ce.engine.vocab_pass`): its row statistics
    (the log-normaliser and what else its gradient needs) came from a forward, so each
    logit's gradient is a function of that logit and its row alone."""

    #: ``(N, P)`` bool: the rows (and positions) that carry an output; the others are skipped.
    valid: torch.Tensor

    #: Whether :meth:`grad_half_block` takes half blocks (:mod:`linear_ce.engine.vocab_pass`).
    half_blocks: bool

    def grad_block(self, s: Tile, rows: RowChunk, p: int, classes: slice, factor: float) -> None:
        """Overwrite ``s`` ``(B, C)``, the transformed logits of ``rows`` at position ``p``
        for the local classes ``classes``, with ``factor · ∂L/∂s``."""

    def grad_half_block(
        self, s: Tile, rows: RowChunk, p: int, classes: slice, factor: float
    ) -> None:
        """As :meth:`grad_block` for a row-major half tile ``s`` of raw logits (no bias, no
        softcap: ``s·factor`` are the transformed ones), its gradient rounded once."""
