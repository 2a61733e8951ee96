r"""The statistics pass: a call without gradients, over blocks of the vocabulary.

Without gradients a head's outputs need each row's statistics alone: its max
:math:`m`, :math:`Z = \sum_j e^{u_j}` with :math:`u = v - m` (``v`` the transformed
logits), the target's :math:`u_t`, and where the head asks, :math:`D = \sum_j e^{u_j} u_j`.
Where the compiled row loops (:mod:`linear_ce.engine.native_rows`) take the head's row
math, this pass forms them a block of ``C`` classes at a time for a group of rows: per
block ``b``, :math:`S_b = X W_b^\top` into one ``(rows, C)`` tile and the loops' statistics
of that block alone, :math:`m_b, Z_b, D_b` (and :math:`u_t` where the target lies in
``b``); after the last block,

.. math::

    m = \max_b m_b, \quad
    Z = \sum_b e^{m_b - m} Z_b, \quad
    D = \sum_b e^{m_b - m} \left(D_b - (m - m_b) Z_b\right), \quad
    u_t = u_{t,b} + (m_b - m).

The tile is sized to the last-level cache (``linear_ce.engine.plan.STATS_TILE_CACHE_SHARE``):
a call faults in the pages of one small tile instead of a chunk of whole rows (a tile
larger than the cache faults in on every call and is read back from memory), and each
GEMM has every row of the group as its long side (docs/journal.md, the forward by blocks
of classes, has the measurements). The combination adds one rounding per block to each
sum, as a longer row would.
"""

from __future__ import annotations

import torch

from linear_ce.engine.gemm import NativeHalf
from linear_ce.engine.head import Head, RowStats
from linear_ce.engine.native_rows import NativeRows
from linear_ce.engine.plan import Plan
from linear_ce.engine.row_chunks import chunk_size, gather_buffers, row_chunks, rows_of
from linear_ce.engine.scratch import keeps_scratch, scratch

__all__ = ["combine_blocks", "run_stats_pass"]


@keeps_scratch
def run_stats_pass(
    input: torch.Tensor,
    weight: torch.Tensor,
    head: Head,
    scale: float,
    plan: Plan,
    loops: NativeRows,
) -> None:
    """The per-row outputs of ``head`` (``rows_done``; a head the compiled loops take, with
    :class:`~linear_ce.engine.head.NativeRowsHead`'s ``native_targets`` and ``native_sums``)
    for ``input`` ``(N, F)`` and
    ``weight`` ``(V, P, F)`` (logits ``x Wᵀ · scale``), by the statistics pass of ``plan``
    (``rows_per_chunk`` rows per group, ``classes_per_block`` classes per block) with the
    compiled ``loops`` of the tile's dtype: the input's with native half GEMMs
    (:class:`~linear_ce.engine.gemm.NativeHalf`), else the plan's ``acc_dtype``."""
    classes, positions, _ = weight.shape
    gemm, device = plan.gemm, input.device
    group = min(plan.rows_per_chunk, max(input.shape[0], 1))
    block = min(plan.classes_per_block, max(classes, 1))
    half = isinstance(gemm, NativeHalf)
    chunks = row_chunks(head.valid, group, device)
    x_rows_buf, _ = gather_buffers(chunks, group, input, plan.acc_dtype, False)
    # One flat tile: each block's ``(rows, classes)`` view is dense in it.
    flat = scratch((group * block,), loops.dtype, device)
    starts = range(0, classes, block)
    for p in range(positions):
        w_op = gemm.weight_operand(weight[:, p, :])
        for rows in chunks[p]:
            n = chunk_size(rows)
            x_op = gemm.operand(rows_of(input, rows, x_rows_buf))
            targets, dot = head.native_targets(rows, p)
            # Each block's loops write into its rows of ``sums``, with its own columns of
            # the targets, all settled before the first GEMM: no torch operation between a
            # block's GEMM and the next (one right after a GEMM waits for the GEMM's
            # threads to settle, once per block).
            sums = torch.zeros((len(starts), 4, n), dtype=torch.float32, device=device)
            block_of = torch.div(targets, block, rounding_mode="floor")
            owned = block_of == torch.arange(len(starts), device=device)[:, None]
            local = torch.where(owned, targets - block_of * block, -1)
            blocks = []
            for b, start in enumerate(starts):
                stop = min(start + block, classes)
                tile = _tile_view(flat, n, stop - start, half or not gemm.class_major)
                stats = loops.stats_call(tile, scale=scale, target=local[b], dot=dot, out=sums[b])
                blocks.append((tile, w_op[start:stop], stats))
            for tile, w_block, stats in blocks:
                if half:
                    gemm.half_logits(tile, x_op, w_block)
                else:
                    gemm.logits(tile, x_op, w_block)
                stats()
            row_max, sum_exp, dot_sum, target_u = combine_blocks(sums, owned)
            stats = torch.empty((n, 1 + head.extra_sums), dtype=torch.float32, device=device)
            stats[:, 0] = sum_exp
            head.native_sums(target_u, dot_sum if dot else None, stats[:, 1:])
            head.rows_done(rows, p, RowStats.of(row_max, stats))


def combine_blocks(
    sums: torch.Tensor, owned: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``(m, Z, D, u_t)`` ``(B,)`` of whole rows from their blocks' ``sums``
    ``(blocks, 4, B)``: each block's :math:`m_b, Z_b, D_b` and :math:`u_{t,b}`, the latter
    read where ``owned`` ``(blocks, B)`` says the block holds the row's target (``u_t`` is
    0 for a row whose target is in none), combined as the module doc says.

    Example::

        >>> v = torch.tensor([[0.5, 2.0, -1.0, 3.0]])
        >>> m, u = v.amax(1), v - v.amax(1, keepdim=True)
        >>> parts = []
        >>> for cols in (slice(0, 2), slice(2, 4)):
        ...     ub = v[:, cols] - v[:, cols].amax(1, keepdim=True)
        ...     e = ub.exp()
        ...     parts.append(torch.stack([v[:, cols].amax(1), e.sum(1), (e * ub).sum(1), ub[:, 1]]))
        >>> owned = torch.tensor([[True], [False]])  # the target, class 1, is in block 0
        >>> row_max, z, d, u_t = combine_blocks(torch.stack(parts), owned)
        >>> torch.allclose(z, u.exp().sum(1)), torch.allclose(d, (u.exp() * u).sum(1))
        (True, True)
        >>> torch.allclose(u_t, u[:, 1])
        True
    """
    block_max, block_z, block_d, block_t = sums.unbind(1)
    row_max = block_max.amax(0)
    # A block of the row max (a row of -inf blocks too) weighs 1, not exp(-inf + inf).
    shift = torch.where(block_max == row_max, 0.0, row_max - block_max)
    weight = torch.where(shift == 0, 1.0, torch.exp(-shift))
    # A block whose weight is 0 adds nothing: not 0 · NaN where its max is -inf (the loops'
    # sums of such a block are NaN), nor 0 · inf.
    sum_exp = torch.where(weight == 0, 0.0, weight * block_z).sum(0)
    dot = torch.where(weight == 0, 0.0, weight * (block_d - shift * block_z)).sum(0)
    target_u = torch.where(owned, block_t - shift, 0.0).sum(0)
    return row_max, sum_exp, dot, target_u


def _tile_view(flat: torch.Tensor, rows: int, classes: int, row_major: bool) -> torch.Tensor:
    """A dense ``(rows, classes)`` view of the start of ``flat``: row-major, or class-major
    (a ``(classes, rows)`` array's transpose, the layout the plan measured faster)."""
    part = flat[: rows * classes]
    return part.view(rows, classes) if row_major else part.view(classes, rows).T
