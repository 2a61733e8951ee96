r"""The autograd of :func:`linear_ce.sequence_objective`: one pass, gradients in forward.

Where every group of sequences fits a chunk (``plan.rows_per_chunk`` scored tokens, grown
up to ``GROUP_BUDGET_FACTOR`` times the budget for the longest group), the chunk loop runs
once over chunks of whole groups
(:meth:`~linear_ce.engine.sequence_layout.SequenceLayout.chunks`) with
:class:`~linear_ce.losses.sequence_objective.SequenceHead`: per chunk the logits GEMM, the
objective and its gradient, the two gradient GEMMs — three GEMMs per training step. With
native half GEMMs on a CPU the chunk's logits live in a half tile as for the other heads,
in two sweeps of its steps (the objective needs the whole chunk before any gradient:
:mod:`linear_ce.engine.chunk_loop`).

Where one group has more scored tokens than even that chunk may hold, the call takes the
four-GEMM path: the loop computes every token's log-probability and row statistics (one
GEMM, no gradient), the objective is evaluated on all groups at once, and the vocabulary
pass (:mod:`linear_ce.engine.vocab_pass`) forms the gradients from the row statistics (three
GEMMs). Nothing of size ``N·V`` exists on either path.

Forward returns the loss and the per-sequence log-probability sums (a statistic without
gradient); backward scales the stored gradients by the loss's upstream gradient.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from linear_ce.checks.call import Call
from linear_ce.engine.capability import HALF_DTYPES
from linear_ce.engine.chunk_loop import (
    Gradients,
    Needs,
    fp32_tile_loops,
    run_chunks,
    run_head,
    tiles_for,
)
from linear_ce.engine.gemm import NativeHalf
from linear_ce.engine.head import HeadFrame
from linear_ce.engine.machine import STEP_ROWS_ENV, memory_budget
from linear_ce.engine.plan import (
    BUDGET_SHARE,
    DIRECT_SUM_MAX_CHUNKS,
    HALF_CPU_BUDGET_SHARE,
    Plan,
    acc_dtype_for,
    make_plan,
    split_sum_supported,
)
from linear_ce.engine.sequence_layout import SequenceLayout
from linear_ce.engine.vocab import Vocab
from linear_ce.engine.vocab_pass import vocab_pass_gradients
from linear_ce.losses.sequence_objective import Metrics, SequenceEvaluation, SequenceHead
from linear_ce.losses.token_logprob import TokenLogprobGradient, TokenLogprobHead, TokenOutputs
from linear_ce.ops.autograd import HandOver, hand_over_gradients
from linear_ce.options import LinearCrossEntropyOptions, parse_chunking_method

__all__ = ["GROUP_BUDGET_FACTOR", "SEQUENCE_STEP_ROWS", "SequenceSpec", "sequence_objective_op"]

#: A chunk may grow beyond the plan's to hold the longest group while its tiles take at most
#: this many times the budget rule's share of the gradients' bytes
#: (:func:`linear_ce.engine.plan.choose_chunk_rows`): for fp32, half of them (with the gradients
#: themselves, 1.5× their bytes). Only the budget rule grows (``chunking_method``
#: ``"auto"``/``"budget[:N]"``, the share divided by ``N``); ``batch_chunk_size`` is a hard
#: limit.
GROUP_BUDGET_FACTOR = 2.0
#: The most rows of a half tile's fp32 step (4 MiB at V=32768): the half tile of whole
#: groups is most of what a step holds above the gradients (bf16 DPO at N=2048, F=1024,
#: V=32768: one pair, 0.35× them), and the plan's 64-row step (8 MiB) would take 0.06× more.
#: Shorter steps pay their ~40 small operations each more often; 32 rows are as fast as 64.
SEQUENCE_STEP_ROWS = 32


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    """A checked call: the rows (``call``), the layout, each sequence's scored tokens
    (``lengths``) and the side inputs in the sequence dtype (``side`` ``(S,)``,
    ``token_side`` ``(N,)``), which gradients are wanted (``needs``:
    input, weight, bias) and the vocabulary this process sees (``vocab``)."""

    name: str
    call: Call
    objective: Callable[..., torch.Tensor]
    entropy: bool
    layout: SequenceLayout
    lengths: torch.Tensor
    side: dict[str, torch.Tensor]
    token_side: dict[str, torch.Tensor]
    reduction: str
    options: LinearCrossEntropyOptions
    needs: Needs
    vocab: Vocab


def _no_direct_sum_overflow(plan: Plan, chunks: int) -> Plan:
    """The plan with the half weight gradient summed in fp32 where ``"balanced"`` chose to
    hold it in the result (``"direct"``) for at most ``DIRECT_SUM_MAX_CHUNKS`` chunks but
    packing whole groups made more: one rounding per chunk would outgrow the bound."""
    if (
        plan.policy != "balanced"
        or plan.weight_grad != "direct"
        or plan.input_dtype == plan.acc_dtype
        or chunks <= DIRECT_SUM_MAX_CHUNKS
    ):
        return plan
    split = split_sum_supported(plan.input_dtype, plan.acc_dtype)
    return dataclasses.replace(
        plan, weight_grad="split" if split else "wide", weight_grad_dtype=plan.acc_dtype
    )


def _share(input: torch.Tensor, acc: torch.dtype) -> float:
    """The budget rule's share for this call's loop: half inputs with fp32 math on a CPU
    take ``HALF_CPU_BUDGET_SHARE``, as the half tile and the block-upcast path do (and the
    fp32 tile of a CPU whose half GEMMs are not taken, against half gradients); otherwise
    ``BUDGET_SHARE``."""
    half = input.dtype in HALF_DTYPES
    if half and acc == torch.float32 and input.device.type == "cpu":
        return HALF_CPU_BUDGET_SHARE
    return BUDGET_SHARE


def _plan(input: torch.Tensor, spec: SequenceSpec, tiles: int, **kwargs) -> Plan:
    """:func:`linear_ce.engine.plan.make_plan` for this call's rows and classes per process."""
    rows, in_features = input.shape
    return make_plan(
        rows,
        in_features,
        spec.vocab.plan_classes,
        input.dtype,
        input.device,
        spec.options,
        tiles=tiles,
        **kwargs,
    )


def _half_tile(input: torch.Tensor, plan: Plan) -> bool:
    """Whether the loop may hold this plan's chunks in a half tile (as
    :func:`~linear_ce.engine.plan.make_plan` decides with ``half_tile=True``)."""
    return isinstance(plan.gemm, NativeHalf) and input.device.type == "cpu"


def _group_rows(
    input: torch.Tensor, spec: SequenceSpec, plan: Plan, tiles: int, share: float
) -> int:
    """The most rows a chunk may grow to for a group under the budget rule: ``tiles`` tiles
    (or one half tile) within ``GROUP_BUDGET_FACTOR × share`` of the gradients' bytes (scaled
    as the plan's budget by ``LINEAR_CE_MEMORY_BUDGET``), by memory alone (not the machine's
    choice of the fastest chunk); ``plan.rows_per_chunk`` under ``batch_chunk_size`` or
    another rule."""
    method, divisor = parse_chunking_method(spec.options.chunking_method)
    if spec.options.batch_chunk_size is not None or method not in ("auto", "budget"):
        return plan.rows_per_chunk
    rows, in_features = input.shape
    classes = spec.vocab.plan_classes
    share = GROUP_BUDGET_FACTOR * share * (memory_budget() or BUDGET_SHARE) / BUDGET_SHARE
    grad_bytes = (rows + classes) * in_features * input.dtype.itemsize
    if _half_tile(input, plan):
        row_bytes = classes * input.dtype.itemsize
    else:
        row_bytes = classes * plan.acc_dtype.itemsize * tiles
    return max(plan.rows_per_chunk, int(share * grad_bytes / divisor) // max(row_bytes, 1))


def _small_half_tile(input: torch.Tensor, spec: SequenceSpec, plan: Plan) -> Plan:
    """The plan of a half tile with chunks and steps held to what whole groups need.

    Chunks: a half weight gradient held in the result (``"direct"``) rounds once per chunk,
    within the bound up to ``DIRECT_SUM_MAX_CHUNKS`` chunks, so chunks take the fewest
    rows that many chunks of whole groups allow (as many as the plan's chunks where those
    are more). The half tile is most of the step's memory: bf16 DPO at N=2048, F=1024,
    V=32768 holds one pair (24 MiB) per chunk, not two (0.35× the gradients' bytes less);
    the three GEMMs of one-pair chunks run as fast as those of two-pair chunks at such
    shapes (their long side is the vocabulary). Steps: at most ``SEQUENCE_STEP_ROWS`` rows, unless
    ``LINEAR_CE_STEP_ROWS`` forces them."""
    layout = spec.layout
    if plan.weight_grad == "direct" and layout.max_group_tokens:
        capacity = layout.least_capacity(plan.rows_per_chunk, DIRECT_SUM_MAX_CHUNKS)
        plan = dataclasses.replace(plan, rows_per_chunk=capacity)
    if os.environ.get(STEP_ROWS_ENV, "auto").strip() != "auto":
        return plan
    return dataclasses.replace(plan, rows_per_step=min(plan.rows_per_step, SEQUENCE_STEP_ROWS))


def _fused(input, weight, bias, spec: SequenceSpec, evaluation, acc) -> Gradients | None:
    """The three-GEMM path, or ``None`` when a group does not fit a chunk."""
    call, layout = spec.call, spec.layout
    # A SequenceHead's fp32 tiles take the compiled row loops where the call allows them.
    native = fp32_tile_loops(input, spec.options, call.transform, spec.vocab, bias)
    tiles = tiles_for(spec.entropy, call.transform, any(spec.needs), native=native)
    share = _share(input, acc)
    plan = _plan(input, spec, tiles, share=share)
    longest = layout.max_group_tokens
    if plan.rows_per_chunk < longest <= _group_rows(input, spec, plan, tiles, share):
        # Chunks just long enough for the longest group (a half tile keeps its steps).
        step = plan.rows_per_step if _half_tile(input, plan) else longest
        plan = dataclasses.replace(plan, rows_per_chunk=longest, rows_per_step=step)
    if _half_tile(input, plan):
        plan = _small_half_tile(input, spec, plan)
    chunks = layout.chunks(plan.rows_per_chunk, input.device)
    if chunks is None:
        return None
    # Tiles for the longest chunk packed: whole groups seldom fill the plan's (bf16 DPO, pairs
    # of 384 scored tokens: 768 of 1024 rows, 16 MiB of a 64 MiB half tile).
    plan = dataclasses.replace(plan, rows_per_chunk=max(1, max(c.size for c in chunks)))
    plan = _no_direct_sum_overflow(plan, len(chunks))
    head = SequenceHead(
        HeadFrame(call.target.long(), layout.valid, spec.vocab.start, weight.shape[0], acc),
        entropy=spec.entropy,
        evaluation=evaluation,
        chunks=chunks,
        num_classes=spec.vocab.total,
        # A half tile in steps: one sweep, the rows scaled after the chunk, where the
        # gradient is the log-probabilities' alone (chunk_loop's scaled_rows).
        scaled_rows=plan.rows_per_step < plan.rows_per_chunk
        and not spec.entropy
        and not spec.needs.bias,
    )
    return run_chunks(
        input,
        weight,
        bias,
        head,
        call.transform,
        plan,
        grad_input=spec.needs.input,
        grad_weight=spec.needs.weight,
        grad_bias=spec.needs.bias,
        vocab=spec.vocab,
        chunks=[[c.rows for c in chunks]],
        # Each scored row is in one chunk of whole groups: a half input gradient is
        # written per chunk, without an fp32 (N, F) sum.
        rows_once=True,
    )


def _four_gemm(input, weight, bias, spec: SequenceSpec, evaluation, acc) -> Gradients:
    """Statistics pass, the objective on every group at once, then the vocabulary pass."""
    call, layout = spec.call, spec.layout
    target = call.target.long()
    head = TokenLogprobHead(
        HeadFrame(target, layout.valid, spec.vocab.start, weight.shape[0], acc),
        outputs=TokenOutputs(entropy=spec.entropy),
        num_classes=spec.vocab.total,
    )
    no_gradient = Needs(False, False, False)
    run_head(input, weight, bias, head, call.transform, spec.options, spec.vocab, no_gradient)
    chunk = layout.one_chunk(input.device)
    token_rows = chunk.rows
    entropy = head.entropy[token_rows, 0] if spec.entropy else None
    g, h = evaluation(chunk, token_rows, head.logprob[token_rows, 0], entropy)
    if not any(spec.needs):
        return Gradients(None, None, None)
    if g is None and h is None:
        # The objective does not depend on the log-probabilities: zero gradients, no pass.
        return Gradients(
            torch.zeros_like(input) if spec.needs.input else None,
            torch.zeros_like(weight) if spec.needs.weight else None,
            torch.zeros_like(bias) if spec.needs.bias else None,
        )

    def per_row(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        out = torch.zeros(layout.valid.shape, dtype=acc, device=input.device)
        out[token_rows, 0] = values
        return out

    gradient = TokenLogprobGradient(
        target, layout.valid, spec.vocab.start, head.row_stats, per_row(g), per_row(h)
    )
    return vocab_pass_gradients(
        input, weight, bias, gradient, call.transform, spec.options, spec.needs
    )


class _SequenceObjective(torch.autograd.Function):
    """Forward runs the pass and computes the gradients; backward scales them.

    With a vocab-parallel ``spec.vocab`` the weight is this rank's shard: the loop combines
    the row statistics over the group, so every rank evaluates the objective on the same
    log-probabilities, and the input gradient is summed over the group."""

    @staticmethod
    def forward(ctx, input, weight, bias, spec: SequenceSpec, evaluation: SequenceEvaluation):
        acc = acc_dtype_for(input.dtype, spec.options.acc_dtype)
        grads = _fused(input, weight, bias, spec, evaluation, acc)
        if grads is None:
            grads = _four_gemm(input, weight, bias, spec, evaluation, acc)
        if grads.input is not None:
            spec.vocab.sum_(grads.input)
        mean = spec.reduction == "mean"
        scale = 1.0 / evaluation.count if mean else 1.0
        # The gradients are the mean's already where the evaluation folded its count in.
        ctx.grad_scale = (evaluation.folded_count or 1) / evaluation.count if mean else 1.0
        ctx.grads = [grads.input, grads.weight, grads.bias]
        ctx.hand_over = HandOver(spec.needs, spec.options.allow_retain_graph, spec.name)
        logprob_sum = evaluation.logprob_sum.to(acc)
        ctx.mark_non_differentiable(logprob_sum)
        return (evaluation.total * scale).to(acc), logprob_sum

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_logprob_sum):
        upstream = grad_loss if ctx.grad_scale == 1.0 else grad_loss * ctx.grad_scale
        scaled = hand_over_gradients(ctx, upstream)
        return (*scaled, None, None)


def sequence_objective_op(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spec: SequenceSpec,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """``(loss, logprob_sum, metrics)`` of a checked call (see the module doc)."""
    evaluation = SequenceEvaluation(
        spec.objective,
        name=spec.name,
        lengths=spec.lengths,
        side=spec.side,
        token_side=spec.token_side,
        totals=spec.layout.totals,
        group_size=spec.layout.group_size,
        want_grads=any(spec.needs),
        mean=spec.reduction == "mean",
    )
    loss, logprob_sum = _SequenceObjective.apply(input, weight, bias, spec, evaluation)
    return loss, logprob_sum, evaluation.metrics
