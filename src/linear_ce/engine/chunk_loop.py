"""The loop over chunks of valid rows: pure math on a :class:`~linear_ce.engine.plan.Plan`.

Per chunk of ``B`` rows that carry an output (:mod:`linear_ce.engine.row_chunks`:
ignored rows are never in a chunk) and each output position: the logits GEMM
``x Wᵀ + b``, the logits transform (:mod:`linear_ce.engine.transform`), the row max,
``u = s − max``, the row sums of the head (:mod:`linear_ce.engine.head`) and
of ``eᵘ``, one combination of the row statistics over vocabulary shards, the
head's per-row outputs, then — only if gradients are wanted — the head turns
a tile into ``∂L/∂s`` and the two gradient GEMMs consume it. Nothing here
grows with ``N·V``: the ``(B, V)`` tiles (one, two when the head keeps ``u``
for its gradient, one more for a softcap's derivative) are reused by every
chunk. A head that keeps ``u`` but wants no gradient gets ``eᵘ`` a
cache-sized block of columns at a time instead of a second tile.

With native half GEMMs on a CPU the plan may ask for a *half tile*
(``Plan.rows_per_step`` below ``rows_per_chunk``): the logits GEMM writes the
chunk's half-precision logits (the rounding it applies anyway) into a tile of
the input dtype; the math above runs on ``rows_per_step`` rows at a time,
widened into an fp32 tile of that many rows, and each step's gradient is
written back over its logits, so the half tile becomes the gradient GEMMs'
operand. At 2 bytes per logit instead of an fp32 tile's 4 plus its half copy's
2, chunks are ~3× longer in the same memory, which is what the GEMMs and the
weight-gradient sum's passes are paid per. A head whose gradient needs every row of its
chunk done first (``grads_after_chunk``: a sequence objective's chunk of whole groups)
takes the half tile in two sweeps: the first runs each step up to ``rows_done`` and keeps
its row statistics, the second widens each step again, forms ``eᵘ`` from the kept row
max (the same values the first formed) and writes its gradient back. Unless each row's
gradient is a factor known after the chunk times a tile known at once (``scaled_rows``:
the gradient of ``log p_t`` alone, ``δ_t − p``, scaled by the objective's ``∂L/∂log p_t``):
then one sweep writes the unscaled tile back, and the gradient GEMMs take the factors
(``row_factors``, known once the chunk is done) on their small side: the input gradient's
rows are scaled after their GEMM, the rows of ``x`` before the weight gradient's. No pass
over the half tile, and the input gradient keeps one rounding of the tile. Without
gradients (and without ``late_sums``) the steps keep their row sums and maxima for the
chunk, which are combined over shards and handed to ``rows_done`` once per chunk.
A call without gradients whose row math is the compiled loops' (below) takes the
statistics pass instead (:mod:`linear_ce.engine.stats_pass`: blocks of classes, a
cache-sized tile), unless ``LINEAR_CE_STATS_BLOCK=off``.

Where each row is in one chunk (``rows_once``: a caller's chunks of whole sequences, one
output position), a half input's gradient is written per chunk in the input dtype instead
of summed in an ``(N, F)`` ``acc_dtype`` buffer (bf16 DPO at N=2048, F=1024: 8 MiB, 0.12×
the gradients' bytes): each row's value is the same one rounding of the same fp32 value.

Where the head and the call allow them (``_native_rows``), the row math after the logits
GEMM runs in the compiled row loops of :mod:`linear_ce.engine.native_rows`: the statistics
in one visit of each row, the gradient written over the tile in another (or both in one,
``native_fused``), on a half tile and, for the heads that say so (``native_fp32``), on an
fp32 tile, where the plan then holds one tile (:func:`tiles_for`).

A :class:`Companion` is a second projection of the same rows (a distillation
teacher's head): per chunk its logits are formed next to the student's,
transformed by its own transform, shifted by their row max over every shard
and handed to the head (``companion_tile``) before the head's row sums. It gets
no gradient. Where the head says so (``native_pair``: distillation) and both heads' math is
the compiled loops' (:func:`_native_pair`), the two raw tiles go to the loops' pair kernels
instead (:meth:`~linear_ce.engine.native_rows.NativeRows.pair_`): both rows read once, the
student's gradient written over its tile; in the input dtype with native half GEMMs (the
gradient GEMMs' operand, as a half tile), so a bf16 step's row math is not fp32 passes over
fp32 tiles, which cost more than the bf16 GEMMs themselves; no third tile for the mixture.
A head with
``late_sums`` has row sums that need the normalisers ``Z`` themselves (a mixture of two
distributions): they are formed once the first statistics are combined, and combined over
shards in a second round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from linear_ce.engine.accumulate import weight_grad_sum
from linear_ce.engine.gemm import Gemm, NativeHalf
from linear_ce.engine.head import Head, RowStats
from linear_ce.engine.machine import forced_stats_block
from linear_ce.engine.plan import Plan, acc_dtype_for, make_plan
from linear_ce.engine.row_chunks import RowChunk, chunk_size, gather_buffers, row_chunks, rows_of
from linear_ce.engine.row_reductions import row_max as tile_row_max
from linear_ce.engine.row_reductions import row_sum
from linear_ce.engine.scratch import keeps_scratch
from linear_ce.engine.stats_pass import run_stats_pass
from linear_ce.engine.transform import LogitTransform
from linear_ce.engine.triton_rows import RowLoops, row_loops
from linear_ce.engine.vocab import LocalVocab, Vocab
from linear_ce.options import LinearCrossEntropyOptions

__all__ = [
    "Companion",
    "Gradients",
    "Needs",
    "add_grad_input_rows",
    "fp32_tile_loops",
    "keeps_second_tile",
    "run_chunks",
    "run_head",
    "tiles_for",
    "without_autocast",
]

#: Elements of the block of ``eᵘ`` formed at a time when no second tile is kept (512 KiB
#: in fp32: it stays in L2 between the exponential and the head's row sums).
EXP_BLOCK_ELEMENTS = 1 << 17
_LOG2_E = math.log2(math.e)
#: Rows scaled at a time by their factors (``scaled_rows``): 256 KiB of fp32 temporaries
#: at 1024 features, not the chunk's.
SCALE_BLOCK_ROWS = 32


@dataclasses.dataclass
class Gradients:
    """The requested gradients in the input dtype (``None`` where not asked)."""

    input: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


class Needs(NamedTuple):
    """Which of the input, the weight and the bias get a gradient (``bias`` is ``False``
    without a bias)."""

    input: bool
    weight: bool
    bias: bool

    @classmethod
    def of(cls, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Needs:
        """The gradients autograd will ask for: those of the tensors that require grad,
        in grad mode."""
        on = torch.is_grad_enabled()
        return cls(
            on and input.requires_grad,
            on and weight.requires_grad,
            on and bias is not None and bias.requires_grad,
        )

    @classmethod
    def asked(cls, ctx: Any, bias: torch.Tensor | None) -> Needs:
        """What a backward is asked for (``ctx.needs_input_grad``, the three tensors first)."""
        asked = ctx.needs_input_grad
        return cls(asked[0], asked[1], bias is not None and asked[2])

    def when(self, flowing: bool) -> Needs:
        """These gradients if an upstream gradient flows, else none."""
        return Needs(*(flowing and need for need in self))

    def pick(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """``grads`` (input, weight, bias) where needed, ``None`` elsewhere."""
        return tuple(g if need else None for g, need in zip(grads, self, strict=True))


@dataclasses.dataclass(frozen=True)
class Companion:
    """A second head over the same rows, gradient-free: ``input`` ``(N, F')``,
    ``weight`` ``(V, P, F')``, ``bias`` ``(V, P)`` or ``None``, its own logits
    ``transform`` and the ``gemm`` backend of its dtype."""

    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    transform: LogitTransform
    gemm: Gemm


_Run = TypeVar("_Run", bound=Callable[..., "Gradients"])


def without_autocast(run: _Run) -> _Run:
    """``run(input, ...)`` with autocast off on ``input``'s device.

    The plan decides each GEMM's operand and result dtypes; a caller's ``torch.autocast``
    would otherwise run the products written as ``a @ b`` (:meth:`Gemm.product`) in its half
    dtype: under bf16 autocast, bf16 inputs without native bf16 GEMMs would get a weight
    gradient summed from bf16-rounded products, less accurate than the same call's without
    autocast (``tests/test_autocast_grads.py`` holds them equal).
    """

    @functools.wraps(run)
    def wrapped(input: torch.Tensor, *args, **kwargs):
        device = input.device.type
        off = (
            torch.autocast(device, enabled=False)
            if torch.amp.is_autocast_available(device)
            else contextlib.nullcontext()
        )
        with off:
            return run(input, *args, **kwargs)

    return wrapped  # type: ignore[return-value]


def keeps_second_tile(keeps_logits: bool, want_grads: bool, companion: bool) -> bool:
    """Whether the loop holds ``eᵘ`` in a tile of its own next to ``u``: for a head that
    keeps ``u`` (``keeps_logits``) when it forms a gradient, or reads a companion's tile
    alongside; otherwise ``eᵘ`` is formed a block of columns at a time."""
    return keeps_logits and (want_grads or companion)


def tiles_for(
    keeps_logits: bool,
    transform: LogitTransform,
    want_grads: bool,
    companion: bool = False,
    native: bool = False,
) -> int:
    """How many ``(B, V)`` tiles the loop holds for a head (its ``keeps_logits``, and a
    companion's tile): the divisor of the chunk planner's budget. One where the compiled
    row loops take the call's fp32 tile (``native``, :func:`fp32_tile_loops`): they write
    the gradient over it."""
    if native:
        return 1
    return (
        1
        + int(keeps_second_tile(keeps_logits, want_grads, companion))
        + int(companion)
        + int(want_grads and transform.softcap is not None)
    )


@without_autocast
@keeps_scratch
def run_chunks(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    head: Head,
    transform: LogitTransform,
    plan: Plan,
    *,
    grad_input: bool,
    grad_weight: bool,
    grad_bias: bool,
    vocab: Vocab | None = None,
    companion: Companion | None = None,
    chunks: list[list[RowChunk]] | None = None,
    grad_scale: torch.Tensor | None = None,
    rows_once: bool = False,
) -> Gradients:
    """Run ``head`` over ``input`` ``(N, F)``, ``weight`` ``(V, P, F)``, ``bias`` ``(V, P)``
    (and a ``companion`` head over the same rows); returns the gradients of the head's
    loss (its upstream gradients folded in), times ``grad_scale`` (a 0-dim tensor).

    ``grad_scale`` (a mean's ``1/count``) multiplies the fp32 sums before they are
    rounded to the input dtype: folded into a half gradient tile, a small factor pushes
    its entries into the half dtype's subnormals (fp16 ``reduction="mean"`` over 32768
    rows: 10x the weight gradient's final rounding). A weight-gradient sum held in the
    half dtype itself (``"direct"``), where the unscaled sum could overflow, takes its
    power of two on ``x``'s side (:class:`~linear_ce.engine.accumulate.DirectSum`).

    ``chunks``: each position's chunks of rows, given by the caller instead of
    ``row_chunks(head.valid, ...)`` (a head whose chunks must hold whole sequences,
    :mod:`linear_ce.engine.sequence_layout`); none longer than ``plan.rows_per_chunk``.

    ``rows_once``: no row is in two of ``chunks`` and there is one position, so a half
    input's gradient is written per chunk in its own dtype (see the module doc); without
    ``grad_scale`` (a head folds its scale into its upstream gradients). A head with
    ``scaled_rows`` needs it, as its input gradient's rows are scaled as they are written.

    The loop's strategy follows the chunk's tile (:func:`_loop_kind`): one set-up of
    buffers and gradient sums (:class:`_ChunkLoop`), one body per tile kind, one finish."""
    vocab = vocab or LocalVocab(weight.shape[0])
    chunk, step = _chunk_and_step(plan, input.shape[0])
    if chunks is None:
        chunks = row_chunks(head.valid, chunk, input.device)
    half = step < chunk
    acc = plan.acc_dtype
    # The compiled row loops (see the module doc) where the head and the call allow them.
    native = _native_rows(input, acc, head, transform, vocab, bias, companion, half)
    # ... and over the student's and the companion's tiles together (see the module doc).
    pair = _native_pair(input, acc, head, transform, vocab, bias, companion, plan.gemm)
    loop = _loop_kind(half, native, pair)(
        (input, weight, bias),
        head,
        transform,
        plan,
        needs=Needs(grad_input, grad_weight, grad_bias),
        vocab=vocab,
        companion=companion,
        chunks=chunks,
        grad_scale=grad_scale,
        rows_once=rows_once,
        loops=(native, pair),
    )
    return loop.run()


def _chunk_and_step(plan: Plan, rows: int) -> tuple[int, int]:
    """The rows of a chunk, and of a step of its fp32 math: fewer on a half tile (see the
    module doc)."""
    chunk = min(plan.rows_per_chunk, max(rows, 1))
    return chunk, min(plan.rows_per_step, chunk)


def _loop_kind(half: bool, native: RowLoops | None, pair: RowLoops | None) -> type[_ChunkLoop]:
    """The one place a call's loop strategy is chosen, by its tile: the compiled loops on a
    half tile, the pair loops on the student's and the companion's tiles, torch's row math
    a step at a time on a half tile, else one fp32 tile (the compiled loops' or torch's)."""
    if native is not None and half:
        return _NativeHalfLoop
    if pair is not None:
        return _PairLoop
    if half:
        return _HalfTileLoop
    return _FullTileLoop if native is None else _NativeFullLoop


class _ChunkLoop:
    """The set-up every loop strategy shares (a call's tiles, row buffers, statistics and
    gradient sums, allocated once and reused by every chunk), the loop over positions and
    chunks, the gradient GEMMs of a chunk and the finish. A strategy writes one method,
    :meth:`chunk_rows`: a chunk's logits GEMM and row math. ``operands``: :func:`run_chunks`'
    ``input``, ``weight`` and ``bias``."""

    def __init__(
        self,
        operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        head: Head,
        transform: LogitTransform,
        plan: Plan,
        *,
        needs: Needs,
        vocab: Vocab,
        companion: Companion | None,
        chunks: list[list[RowChunk]],
        grad_scale: torch.Tensor | None,
        rows_once: bool,
        loops: tuple[RowLoops | None, RowLoops | None],
    ) -> None:
        self.input, self.weight, self.bias = operands
        input, weight, self.head = self.input, self.weight, head
        self.transform, self.plan, self.vocab, self.chunks = transform, plan, vocab, chunks
        self.companion, self.native, self.pair = companion, *loops
        native, pair = loops
        self.grad_input, self.grad_weight, self.grad_bias = needs
        grad_input, grad_weight = needs.input, needs.weight
        self.want_grads = want_grads = any(needs)
        rows, in_features = input.shape
        self.classes, positions, _ = weight.shape
        acc, device, gemm = plan.acc_dtype, input.device, plan.gemm
        self.acc, self.device, self.gemm = acc, device, gemm
        self.chunk, self.step = chunk, step = _chunk_and_step(plan, rows)
        self.half = half = step < chunk
        self._tiles(companion is not None)
        narrow = rows_once and grad_input and input.dtype != acc
        self.narrow = narrow
        x_rows_buf, gx_rows_buf = gather_buffers(
            chunks, chunk, input, acc, grad_input and not narrow
        )
        # Two sweeps (see the module doc) keep every step's statistics for the chunk.
        after_chunk = half and want_grads and getattr(head, "grads_after_chunk", False)
        self.scaled_rows = scaled_rows = after_chunk and getattr(head, "scaled_rows", False)
        # The compiled loops visit a chunk's rows once for statistics and once for gradients.
        self.two_sweeps = two_sweeps = after_chunk and not scaled_rows and not native
        if rows_once and (positions != 1 or grad_scale is not None):
            raise ValueError("run_chunks: rows_once is for one position and no grad_scale")
        if scaled_rows and grad_input and not narrow:
            raise ValueError("run_chunks: a head with scaled_rows writes its input gradient once")
        if narrow and not half:
            # fp32 products (not a half tile's GEMMs): each chunk's sum is rounded once, aside.
            gx_rows_buf = torch.empty((chunk, in_features), dtype=acc, device=device)
        if scaled_rows and grad_weight and x_rows_buf is None:
            # The rows of x times their factors are formed aside, consecutive chunks too.
            x_rows_buf = torch.empty((chunk, in_features), dtype=input.dtype, device=device)
        self.x_rows_buf, self.gx_rows_buf = x_rows_buf, gx_rows_buf
        #: A chunk's row factors (``scaled_rows``), set by the strategy, read by the GEMMs.
        self.factors: torch.Tensor | None = None
        # Without gradients (and late sums) a head's outputs need its rows' statistics alone:
        # a half tile's steps keep them for the chunk, combined and handed to the head once
        # per chunk, not once per step (~25 small operations a step, whose cost grows with the
        # number of steps, not with the work).
        self.chunk_stats = chunk_stats = half and not want_grads and not head.late_sums
        loops = native is not None or pair is not None
        kept = chunk if two_sweeps or chunk_stats or loops else step
        self.stats_buf = torch.empty((kept, 1 + head.extra_sums), dtype=acc, device=device)
        self.late_buf = torch.empty((kept, head.late_sums), dtype=acc, device=device)
        self.max_buf = (
            torch.empty((kept,), dtype=acc, device=device) if two_sweeps or chunk_stats else None
        )
        if companion is not None:
            self.other = _CompanionBuffers(
                companion, chunk, self.classes, acc, x_rows_buf is not None, pair and gemm
            )
        self._gradient_sums(grad_scale, narrow)

    def _tiles(self, companion: bool) -> None:
        """The chunk's tiles: a half tile, the tile the row math runs on (none where the
        compiled loops write over the half tile), and torch's row math's: ``eᵘ`` (a tile, or
        a block of columns), a softcap's derivative."""
        step, classes, acc, device = self.step, self.classes, self.acc, self.device
        loops = self.native is not None or self.pair is not None
        head, want_grads = self.head, self.want_grads
        # A half tile (see the module doc): the chunk's logits and gradient in the input
        # dtype, the fp32 math a step of rows at a time in a tile of that many rows.
        buffer = self.gemm.half_tile_buffer if self.half else self.gemm.logits_buffer
        self.buffer = buffer
        self.half_tile = (
            buffer(self.chunk, classes, self.input.dtype, device) if self.half else None
        )
        if self.pair is not None:
            self.tile = pair_buffer(self.gemm, self.chunk, classes, acc, device)
        else:
            native_half = self.native is not None and self.half
            self.tile = None if native_half else buffer(step, classes, acc, device)
        self.exp_tile = (
            buffer(step, classes, acc, device)
            if not loops and keeps_second_tile(head.keeps_logits, want_grads, companion)
            else None
        )
        exp_step = max(1, EXP_BLOCK_ELEMENTS // step)
        self.exp_block = (
            buffer(step, exp_step, acc, device)
            if not loops and head.keeps_logits and self.exp_tile is None
            else None
        )
        self.block_sums = torch.empty((step, head.extra_sums), dtype=acc, device=device)
        self.sech2 = (
            buffer(step, classes, acc, device)
            if not loops and want_grads and self.transform.softcap is not None
            else None
        )

    def _gradient_sums(self, grad_scale: torch.Tensor | None, narrow: bool) -> None:
        """The gradients' sums over chunks: the input's in its own dtype where each row is
        written once (``narrow``), else in ``acc``; the weight's (:func:`weight_grad_sum`)."""
        acc, device, (rows, in_features) = self.acc, self.device, self.input.shape
        self.grad_x = (
            torch.zeros(
                (rows, in_features), dtype=self.input.dtype if narrow else acc, device=device
            )
            if self.grad_input
            else None
        )
        self.grad_scale = None if grad_scale is None else grad_scale.to(acc)
        self.grad_w = (
            weight_grad_sum(self.plan, self.weight.shape, device, self.grad_scale)
            if self.grad_weight
            else None
        )
        self.grad_b = (
            torch.zeros((self.classes, self.weight.shape[1]), dtype=acc, device=device)
            if self.grad_bias
            else None
        )

    def chunk_rows(
        self,
        x_op: torch.Tensor,
        w_op: torch.Tensor,
        b_p: torch.Tensor | None,
        rows: RowChunk,
        p: int,
        n: int,
    ) -> torch.Tensor | None:
        """The logits GEMM of ``n`` ``rows`` at position ``p`` and their row math: ``factor ·
        ∂L/∂s`` in a tile (the gradient GEMMs' operand), or ``None`` where none is formed."""
        raise NotImplementedError

    def run(self) -> Gradients:
        """Every position's chunks, then the gradients (:meth:`finish`)."""
        gemm, bias, weight = self.gemm, self.bias, self.weight
        for p in range(weight.shape[1]):
            w_op = gemm.weight_operand(weight[:, p, :])
            b_p = None if bias is None else bias[:, p].to(self.acc)
            for rows in self.chunks[p]:
                n = chunk_size(rows)
                x_op = gemm.operand(rows_of(self.input, rows, self.x_rows_buf))
                g = self.chunk_rows(x_op, w_op, b_p, rows, p, n)
                if g is None or not (self.grad_input or self.grad_weight):
                    continue
                self.gradient_gemms(g, x_op, w_op, rows, p, n)
        return self.finish()

    def gradient_gemms(
        self,
        g: torch.Tensor,
        x_op: torch.Tensor,
        w_op: torch.Tensor,
        rows: RowChunk,
        p: int,
        n: int,
    ) -> None:
        """A chunk's gradient tile ``g`` into the weight's and the input's gradients."""
        gemm, factors = self.gemm, self.factors
        g_op = gemm.operand(g)
        # The weight gradient first: its operand x (gathered or scaled) is then free to
        # hold a half tile's input-gradient rows (``narrow``).
        if self.grad_weight:
            if factors is not None:
                x_op = _scale_rows(x_op, factors, self.x_rows_buf[:n])
            self.grad_w.add(p, g_op, x_op)
        if self.narrow:
            part = self.x_rows_buf if self.half else self.gx_rows_buf
            _write_grad_input_rows(gemm, self.grad_x, rows, g_op, w_op, part, factors)
        elif self.grad_input:
            add_grad_input_rows(gemm, self.grad_x, rows, g_op, w_op, self.gx_rows_buf)

    def finish(self) -> Gradients:
        """The sums times ``grad_scale``, rounded to the input dtype."""
        grad_x, grad_b, grad_scale = self.grad_x, self.grad_b, self.grad_scale
        out_dtype = self.plan.input_dtype
        if grad_scale is not None:
            for sums in (grad_x, grad_b):
                if sums is not None:
                    sums.mul_(grad_scale)
        return Gradients(
            input=None if grad_x is None else grad_x.to(out_dtype),
            weight=None if self.grad_w is None else self.grad_w.finish(grad_scale),
            bias=None if grad_b is None else grad_b.to(out_dtype),
        )


class _TorchRowsLoop(_ChunkLoop):
    """Torch's row math on an fp32 tile of raw logits (shared by the strategies that run
    it: a whole chunk's tile, a half tile's steps)."""

    def transformed(self, u: torch.Tensor, b_p: torch.Tensor | None) -> None:
        """The logits transform of raw logits ``u``, in place."""
        if b_p is not None:
            u.add_(b_p)
        self.transform.apply_(u, None if self.sech2 is None else self.sech2[: u.shape[0]])

    def rows_math(
        self, u: torch.Tensor, rows: RowChunk, p: int, b_p: torch.Tensor | None, at: int = 0
    ) -> torch.Tensor | None:
        """Everything between the logits GEMM and the gradient GEMMs for the rows of
        ``u`` (their raw logits): ``factor · ∂L/∂s`` in a tile, or ``None`` without
        gradients (or with two sweeps, whose first keeps the statistics from row ``at``
        of the chunk's buffers; with ``chunk_stats`` only those row sums and maxima)."""
        head, vocab, n = self.head, self.vocab, u.shape[0]
        self.transformed(u, b_p)
        if self.companion is not None:
            head.companion_tile(self.other.logits(rows, p, n, vocab), rows, p)

        max_buf = self.max_buf
        row_max = tile_row_max(u, None if max_buf is None else max_buf[at : at + n])
        vocab.max_(row_max)
        u.sub_(row_max[:, None])
        stats = self.stats_buf[at : at + n]
        head.sums_before_exp(u, rows, p, stats[:, 1:])
        if self.exp_block is not None:
            _sums_in_blocks(head, u, self.exp_block[:n], stats, self.block_sums[:n], self.plan.exp2)
            e = None
        else:
            e = _exp(u, u if self.exp_tile is None else self.exp_tile[:n], self.plan.exp2)
            row_sum(e, stats[:, 0])
            head.sums_after_exp(u, e, stats[:, 1:])
        if self.chunk_stats:
            return None
        vocab.sum_(stats)
        row_stats = RowStats.of(row_max, stats)
        if head.late_sums:
            late = self.late_buf[at : at + n]
            head.sums_after_stats(u, e, row_stats, late)
            vocab.sum_(late)
            row_stats.late = late
        head.rows_done(rows, p, row_stats)
        if not self.want_grads or self.two_sweeps:
            return None
        return self.grad_math(u, e, rows, p, row_stats)

    def grad_math(
        self, u: torch.Tensor, e: torch.Tensor | None, rows: RowChunk, p: int, row_stats: RowStats
    ) -> torch.Tensor:
        """``factor · ∂L/∂s`` of the rows of ``u`` (``u = s − max``, ``e = eᵘ``) in a tile."""
        n = u.shape[0]
        g = self.head.grad_tile(u, e, rows, p, row_stats, self.transform.factor)
        if self.sech2 is not None:
            g.mul_(self.sech2[:n])
        if self.grad_bias:
            self.grad_b[:, p].add_(g.sum(0))
        return g


class _FullTileLoop(_TorchRowsLoop):
    """Torch's row math on a chunk's fp32 tile."""

    def chunk_rows(self, x_op, w_op, b_p, rows, p, n):
        u = self.tile[:n]
        self.gemm.logits(u, x_op, w_op)
        return self.rows_math(u, rows, p, b_p)


class _HalfTileLoop(_TorchRowsLoop):
    """Torch's row math on a half tile, a step of rows at a time in an fp32 tile; each
    step's gradient written back over its logits (see the module doc: one sweep, two
    sweeps for ``grads_after_chunk``, the factors of ``scaled_rows``)."""

    def chunk_rows(self, x_op, w_op, b_p, rows, p, n):
        if self.tile is None:
            self.tile = self.buffer(self.step, self.classes, self.acc, self.device)
        logits = self.half_tile[:n]
        self.gemm.half_logits(logits, x_op, w_op)
        self._first_sweep(logits, b_p, rows, p, n)
        if self.chunk_stats:
            stats = self.stats_buf[:n]
            self.vocab.sum_(stats)
            self.head.rows_done(rows, p, RowStats.of(self.max_buf[:n], stats))
        if self.two_sweeps:
            self._gradient_sweep(logits, b_p, rows, p, n)
        if self.scaled_rows:
            self.factors = self.head.row_factors(rows, p)
            # No step tile during the gradient GEMMs, whose own buffers then take
            # its place at the peak (bf16 DPO, N=2048, 32-row steps: 4 MiB, the
            # input gradient's GEMM 3.7 MiB with two threads); made again per chunk.
            self.tile = None
        return logits

    def _first_sweep(self, logits, b_p, rows, p, n) -> None:
        """Each step's row math; its gradient (one sweep) written back over its logits."""
        tile, step, two_sweeps, chunk_stats = (
            self.tile,
            self.step,
            self.two_sweeps,
            self.chunk_stats,
        )
        for start in range(0, n, step):
            part = slice(start, min(start + step, n))
            u = tile[: part.stop - start]
            u.copy_(logits[part])
            at = start if two_sweeps or chunk_stats else 0
            g = self.rows_math(u, _sub_rows(rows, part), p, b_p, at)
            if g is not None:
                logits[part].copy_(g)

    def _gradient_sweep(self, logits, b_p, rows, p, n) -> None:
        """Each step widened again, ``eᵘ`` formed from the kept row max, its gradient written
        back over its logits (the second of two sweeps)."""
        tile, exp_tile, max_buf = self.tile, self.exp_tile, self.max_buf
        for start in range(0, n, self.step):
            part = slice(start, min(start + self.step, n))
            u = tile[: part.stop - start]
            u.copy_(logits[part])
            self.transformed(u, b_p)
            u.sub_(max_buf[part, None])
            e = _exp(u, u if exp_tile is None else exp_tile[: u.shape[0]], self.plan.exp2)
            row_stats = RowStats.of(max_buf[part], self.stats_buf[part])
            if self.head.late_sums:
                row_stats.late = self.late_buf[part]
            sub_rows = _sub_rows(rows, part)
            logits[part].copy_(self.grad_math(u, e, sub_rows, p, row_stats))


class _NativeFullLoop(_ChunkLoop):
    """The compiled row loops on a chunk's fp32 tile, its gradient written over it."""

    def chunk_rows(self, x_op, w_op, b_p, rows, p, n):
        u = self.tile[:n]
        self.gemm.logits(u, x_op, w_op)
        written = _native_chunk(
            self.native, u, self.head, rows, p, self.transform, self.stats_buf[:n],
            self.want_grads,
        )  # fmt: skip
        return u if written else None


class _NativeHalfLoop(_ChunkLoop):
    """The compiled row loops on a chunk's half tile, its gradient written over it (and
    the chunk's row factors taken, ``scaled_rows``)."""

    def chunk_rows(self, x_op, w_op, b_p, rows, p, n):
        g = self.half_tile[:n]
        self.gemm.half_logits(g, x_op, w_op)
        if not _native_chunk(
            self.native, g, self.head, rows, p, self.transform, self.stats_buf[:n],
            self.want_grads,
        ):  # fmt: skip
            return None
        if self.scaled_rows:
            self.factors = self.head.row_factors(rows, p)
        return g


class _PairLoop(_ChunkLoop):
    """The pair loops on the raw logits of the student's tile and the companion's, the
    student's gradient written over its tile."""

    def chunk_rows(self, x_op, w_op, b_p, rows, p, n):
        g = self.tile[:n]
        _pair_logits(self.gemm, g, x_op, w_op)
        teacher = self.other.raw_logits(rows, p, n)
        if not _pair_chunk(
            self.pair, g, teacher, self.head, rows, p, self.transform, self.other,
            self.stats_buf[:n], self.want_grads,
        ):  # fmt: skip
            return None
        return g


def run_head(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    head: Head,
    transform: LogitTransform,
    options: LinearCrossEntropyOptions,
    vocab: Vocab,
    needs: Needs,
    companion: Companion | None = None,
    grad_scale: torch.Tensor | None = None,
    share: float | None = None,
) -> Gradients:
    """:func:`run_chunks` on the plan of ``head`` (its tiles, ``vocab.plan_classes``
    classes, the budget's ``share`` of the gradients' bytes, ``None``: the plan's
    default): the gradients ``needs`` asks for (times ``grad_scale``), the input's summed
    over the vocabulary's shards. A CPU call that asks for none, without a companion, whose
    row math the compiled loops take, runs the statistics pass instead
    (:func:`~linear_ce.engine.stats_pass.run_stats_pass`; ``LINEAR_CE_STATS_BLOCK=off``: not)."""
    rows, in_features = input.shape

    def plan_for(tiles: int, **pass_kind: bool) -> Plan:
        return make_plan(
            rows,
            in_features,
            vocab.plan_classes,
            input.dtype,
            input.device,
            options,
            tiles=tiles,
            share=share,
            half_tile=companion is None,
            longest=companion is not None,
            gradients=any(needs),
            **pass_kind,
        )

    cpu = input.device.type == "cpu"
    if cpu and not any(needs) and companion is None and forced_stats_block() != 0:
        plan = plan_for(1, stats_pass=True, gathered=not bool(head.valid.all()))
        half = isinstance(plan.gemm, NativeHalf)
        loops = _native_rows(input, plan.acc_dtype, head, transform, vocab, bias, None, half)
        if loops is not None:
            run_stats_pass(input, weight, head, transform.factor, plan, loops)
            return Gradients(input=None, weight=None, bias=None)
    plan = plan_for(
        tiles_for(
            head.keeps_logits,
            transform,
            any(needs),
            companion is not None,
            native=companion is None
            and _head_allows_loops(head, half=False)
            and fp32_tile_loops(input, options, transform, vocab, bias),
        )
    )
    pair = _native_pair(input, plan.acc_dtype, head, transform, vocab, bias, companion, plan.gemm)
    if pair is not None:
        # The pair loops hold two tiles of their dtype (half: one fp32 tile's bytes).
        plan = plan_for(2 * pair.dtype.itemsize // plan.acc_dtype.itemsize)
    grads = run_chunks(
        input,
        weight,
        bias,
        head,
        transform,
        plan,
        grad_input=needs.input,
        grad_weight=needs.weight,
        grad_bias=needs.bias,
        vocab=vocab,
        companion=companion,
        grad_scale=grad_scale,
    )
    if grads.input is not None:
        vocab.sum_(grads.input)
    return grads


def add_grad_input_rows(
    gemm: Gemm,
    grad_x: torch.Tensor,
    rows: RowChunk,
    grad_logits: torch.Tensor,
    weight: torch.Tensor,
    buffer: torch.Tensor | None,
) -> None:
    """``grad_x[rows] += grad_logits @ weight``: in place for consecutive rows, else
    through ``buffer`` (at least ``len(rows)`` rows) and an addition."""
    if isinstance(rows, slice):
        gemm.add_grad_input(grad_x[rows], grad_logits, weight)
        return
    part = buffer[: chunk_size(rows)].zero_()
    gemm.add_grad_input(part, grad_logits, weight)
    grad_x.index_add_(0, rows, part)


def _write_grad_input_rows(
    gemm: Gemm,
    grad_x: torch.Tensor,
    rows: RowChunk,
    grad_logits: torch.Tensor,
    weight: torch.Tensor,
    buffer: torch.Tensor | None,
    factors: torch.Tensor | None,
) -> None:
    """``grad_x[rows] = grad_logits @ weight`` (each row times ``factors`` ``(B,)`` where
    given) for rows still zero in ``grad_x`` (``rows_once``), each value rounded to
    ``grad_x``'s dtype once: a ``buffer`` of that dtype (products in it: a half tile's
    GEMMs) is used only for gathered rows, consecutive ones are formed in place; a wider
    ``buffer`` (at least ``len(rows)`` rows) holds every chunk's sum before it is rounded."""
    in_place = isinstance(rows, slice) and (buffer is None or buffer.dtype == grad_x.dtype)
    part = grad_x[rows] if in_place else buffer[: chunk_size(rows)].zero_()
    gemm.add_grad_input(part, grad_logits, weight)
    if factors is not None:
        _scale_rows(part, factors, part)
    if in_place:
        return
    if isinstance(rows, slice):
        grad_x[rows].copy_(part)
    else:
        grad_x.index_copy_(0, rows, part.to(grad_x.dtype))


def _scale_rows(t: torch.Tensor, factors: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = t * factors[:, None]`` (``out`` may be ``t``), ``SCALE_BLOCK_ROWS`` rows at a
    time: a half ``t`` times fp32 ``factors`` is formed in fp32 temporaries of the rows'
    size (2.8 MiB for 384 rows of 1024 bf16 features, measured), each value rounded once."""
    for start in range(0, t.shape[0], SCALE_BLOCK_ROWS):
        rows = slice(start, start + SCALE_BLOCK_ROWS)
        torch.mul(t[rows], factors[rows, None], out=out[rows])
    return out


def _call_allows_loops(
    input: torch.Tensor,
    acc: torch.dtype,
    transform: LogitTransform,
    vocab: Vocab,
    bias: torch.Tensor | None,
    companion: Companion | None,
) -> bool:
    """Whether the row loops' math (fp32, one local head, no bias, no softcap) covers this
    call: on a CPU the compiled loops, on CUDA the Triton kernels (:func:`row_loops`)."""
    return (
        acc == torch.float32
        and bias is None
        and companion is None
        and transform.softcap is None
        and isinstance(vocab, LocalVocab)
        and input.device.type in ("cpu", "cuda")
    )


def _head_allows_loops(head: Head, half: bool) -> bool:
    """Whether ``head``'s row math is the loops' (``native``) on a half tile, and on an fp32
    tile where it says so (``native_fp32``)."""
    return (
        getattr(head, "native", False)
        and not head.late_sums
        and (half or getattr(head, "native_fp32", False))
    )


def fp32_tile_loops(
    input: torch.Tensor,
    options: LinearCrossEntropyOptions,
    transform: LogitTransform,
    vocab: Vocab,
    bias: torch.Tensor | None,
) -> bool:
    """Whether the compiled row loops take this call's fp32 tile (before its plan, for
    :func:`tiles_for`), for a head that allows them there (``native_fp32``)."""
    acc = acc_dtype_for(input.dtype, options.acc_dtype)
    return _call_allows_loops(input, acc, transform, vocab, bias, None) and (
        row_loops(acc, input.device) is not None
    )


def _native_rows(
    input: torch.Tensor,
    acc: torch.dtype,
    head: Head,
    transform: LogitTransform,
    vocab: Vocab,
    bias: torch.Tensor | None,
    companion: Companion | None,
    half: bool,
) -> RowLoops | None:
    """The compiled row loops for this call's tile (a half tile in the input dtype, else an
    fp32 tile, for inputs of any dtype), or ``None`` where the head, the transform, a bias,
    a companion, a sharded vocabulary or a float64 accumulation needs the torch operations
    (the loops' math is fp32). An fp32 tile takes them for the heads that say so
    (``native_fp32``: cross-entropy, ``token_objective``, ``sequence_objective``), whose
    gradient they write over the tile, so the plan holds one tile where torch's operations
    keep ``eᵘ`` in a second (:func:`tiles_for`): chunks twice as long, and fewer passes
    over a tile that streams from memory (the store's ``sapphire-rapids-objective`` run,
    results/runs.jsonl).
    ``token_logprobs`` keeps torch's operations on fp32 tiles, so that its outputs stay
    those of a call that asks for more statistics (``top1``, ``topk``) bit for bit."""
    if not (
        _call_allows_loops(input, acc, transform, vocab, bias, companion)
        and _head_allows_loops(head, half)
    ):
        return None
    return row_loops(input.dtype if half else acc, input.device)


def _native_chunk(
    native: RowLoops,
    tile: torch.Tensor,
    head: Head,
    rows: RowChunk,
    p: int,
    transform: LogitTransform,
    stats: torch.Tensor,
    want_grads: bool,
) -> bool:
    """A chunk's row math by the compiled loops, on its half ``tile`` of raw logits: the
    statistics, ``rows_done`` once for the chunk, then its gradient written over the tile
    (``want_grads``; with the statistics, where the head's gradient coefficients are known
    before them: ``native_fused``). Returns whether a gradient was written."""
    targets, dot = head.native_targets(rows, p)
    fused = head.native_fused(rows, p, transform.factor) if want_grads else None
    if fused is not None:
        sums = native.fused_(tile, targets, *fused, scale=transform.factor)
    else:
        sums = native.stats(tile, scale=transform.factor, target=targets, dot=dot)
    stats[:, 0] = sums.sum_exp
    head.native_sums(sums.target_u, sums.dot, stats[:, 1:])
    row_stats = RowStats.of(sums.row_max, stats)
    head.rows_done(rows, p, row_stats)
    if fused is not None or not want_grads:
        return want_grads
    grad = head.native_grad(rows, p, row_stats, transform.factor)
    native.grad_(
        tile,
        sums.row_max,
        grad.a,
        scale=transform.factor,
        b=grad.b,
        mu=grad.mu,
        target=targets,
        gamma=grad.gamma,
    )
    return True


def _native_pair(
    input: torch.Tensor,
    acc: torch.dtype,
    head: Head,
    transform: LogitTransform,
    vocab: Vocab,
    bias: torch.Tensor | None,
    companion: Companion | None,
    gemm: Gemm,
) -> RowLoops | None:
    """The compiled pair loops (:meth:`NativeRows.pair_`) for a head that says so
    (``native_pair``) and its companion, where both heads' math is theirs (fp32, no bias, no
    softcap, one local shard) and both project in the same dtype and backend; on tiles in the
    input dtype with native half GEMMs (the gradient GEMMs' operand, as a half tile), else
    in fp32; else ``None``."""
    if (
        companion is None
        or not getattr(head, "native_pair", False)
        or not _call_allows_loops(input, acc, transform, vocab, bias, None)
        or companion.bias is not None
        or companion.transform.softcap is not None
        or companion.input.dtype != input.dtype
        or type(companion.gemm) is not type(gemm)
        or companion.gemm.operand_dtype != gemm.operand_dtype
    ):
        return None
    return row_loops(pair_tile_dtype(gemm, acc), input.device)


def pair_tile_dtype(gemm: Gemm, acc: torch.dtype) -> torch.dtype:
    """The dtype of the pair loops' tiles: the half operands of native half GEMMs, else
    ``acc``."""
    return gemm.operand_dtype if isinstance(gemm, NativeHalf) else acc


def pair_buffer(
    gemm: Gemm, rows: int, classes: int, acc: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A pair loops' tile: half tiles are row-major (their loops' layout); fp32 ones take the
    layout of ``gemm``'s logits (its ``class_major``, the faster GEMM on this machine)."""
    if isinstance(gemm, NativeHalf):
        return gemm.half_tile_buffer(rows, classes, gemm.operand_dtype, device)
    return gemm.logits_buffer(rows, classes, acc, device)


def _pair_logits(gemm: Gemm, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """A pair tile's logits, in its dtype (:func:`pair_buffer`)."""
    if isinstance(gemm, NativeHalf):
        gemm.half_logits(out, x, weight)
    else:
        gemm.logits(out, x, weight)


def _pair_chunk(
    pair: RowLoops,
    tile: torch.Tensor,
    teacher: torch.Tensor,
    head: Head,
    rows: RowChunk,
    p: int,
    transform: LogitTransform,
    other: _CompanionBuffers,
    stats: torch.Tensor,
    want_grads: bool,
) -> bool:
    """A chunk's row math by the pair loops on the raw logits of the student (``tile``) and
    of its companion (``teacher``): ``rows_done``, and the gradient written over ``tile``
    (``want_grads``). Returns whether a gradient was written."""
    terms = head.pair_terms(rows, p, transform.factor if want_grads else None)
    sums = pair.pair_(
        tile,
        teacher,
        student_scale=transform.factor,
        teacher_scale=other.companion.transform.factor,
        **terms,
    )
    stats[:, 0] = sums.sum_exp
    late = head.pair_sums(sums, stats[:, 1:])
    row_stats = RowStats.of(sums.row_max, stats)
    row_stats.late = late
    head.rows_done(rows, p, row_stats)
    return want_grads


def _sub_rows(rows, part: slice):
    """Rows ``part`` (a slice of positions) of a chunk's rows."""
    if isinstance(rows, slice):
        return slice(rows.start + part.start, rows.start + part.stop)
    return rows[part]


def _exp(u: torch.Tensor, out: torch.Tensor, base2: bool) -> torch.Tensor:
    """``out = eᵘ`` (``out`` may be ``u``); with ``base2`` as ``2^(u·log₂e)`` (``Plan.exp2``)."""
    if base2:
        return torch.mul(u, _LOG2_E, out=out).exp2_()
    return torch.exp(u, out=out)


def _sums_in_blocks(
    head: Head,
    u: torch.Tensor,
    block: torch.Tensor,
    stats: torch.Tensor,
    part: torch.Tensor,
    base2: bool,
) -> None:
    """``Σ eᵘ`` and the head's ``sums_after_exp`` a block of columns at a time, ``eᵘ``
    formed in ``block`` (``base2``: see :func:`_exp`). Row sums add up over blocks: the first block's are written
    into ``stats``, each later block's into ``part`` (zeroed: the head writes only its
    own slots) and added."""
    step = block.shape[1]
    for start in range(0, u.shape[1], step):
        u_part = u[:, start : start + step]
        e = block[:, : u_part.shape[1]]
        _exp(u_part, e, base2)
        if start == 0:
            torch.sum(e, dim=1, out=stats[:, 0])
            head.sums_after_exp(u_part, e, stats[:, 1:])
            continue
        stats[:, 0].add_(e.sum(1))
        part.zero_()
        head.sums_after_exp(u_part, e, part)
        stats[:, 1:].add_(part)


class _CompanionBuffers:
    """The companion's logits tile (and gathered-rows buffer), reused by every chunk."""

    def __init__(
        self,
        companion: Companion,
        chunk: int,
        classes: int,
        acc: torch.dtype,
        gathered: bool,
        pair: Gemm | None = None,
    ) -> None:
        self.companion = companion
        device = companion.input.device
        if pair:
            # The pair loops read both tiles in the student's layout (its ``pair`` GEMMs').
            self.tile = pair_buffer(pair, chunk, classes, acc, device)
        else:
            self.tile = companion.gemm.logits_buffer(chunk, classes, acc, device)
        features = companion.input.shape[1]
        self.rows_buf = (
            torch.empty((chunk, features), dtype=companion.input.dtype, device=device)
            if gathered
            else None
        )
        self.position = -1

    def _at(self, p: int) -> None:
        """The companion's weight operand and bias at position ``p``."""
        c = self.companion
        if p != self.position:
            self.w_op = c.gemm.weight_operand(c.weight[:, p, :])
            self.b_p = None if c.bias is None else c.bias[:, p].to(self.tile.dtype)
            self.position = p

    def raw_logits(self, rows, p: int, n: int) -> torch.Tensor:
        """The companion's raw logits of ``rows`` at ``p`` in the pair loops' tile."""
        c = self.companion
        self._at(p)
        t = self.tile[:n]
        _pair_logits(c.gemm, t, c.gemm.operand(rows_of(c.input, rows, self.rows_buf)), self.w_op)
        return t

    def logits(self, rows, p: int, n: int, vocab: Vocab) -> torch.Tensor:
        """The companion's transformed logits of ``rows`` at ``p`` minus their row max."""
        c = self.companion
        self._at(p)
        t = self.tile[:n]
        c.gemm.logits(t, c.gemm.operand(rows_of(c.input, rows, self.rows_buf)), self.w_op)
        if self.b_p is not None:
            t.add_(self.b_p)
        c.transform.apply_(t, None)
        row_max = tile_row_max(t)
        vocab.max_(row_max)
        return t.sub_(row_max[:, None])
