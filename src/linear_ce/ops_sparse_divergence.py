"""``linear_ce::sparse_divergence``: distillation from a stored teacher's top-k as a custom op.

As ``linear_ce::divergence``, one op with two kinds of autograd by ``reduction``:
"mean"/"sum" form the gradients in forward (three GEMMs per training step: the
logits and the two gradient GEMMs); "none" returns the row losses and its
backward reruns the loop with the upstream gradient of each row. The teacher's
ids and log-probabilities get no gradient.

The teacher's values are checked here, vectorised before the loop (one host
sync per call; none inside the loop), so a compiled graph does not guard on them.
"""

from __future__ import annotations

import math

# Sequence, not list, in op signatures: torch 2.6's schema inference rejects list[float].
from collections.abc import Sequence

import torch

from linear_ce.chunked import Gradients, run_chunks, tiles_for
from linear_ce.losses.sparse_divergence import SparseDivergenceHead, SparseTeacher, sparse_teacher
from linear_ce.ops import (
    _gradient_outputs,
    _options,
    _vmap_by_loop,
    check_class_indices,
    hand_over_gradients,
)
from linear_ce.plan import acc_dtype_for, make_plan
from linear_ce.transform import LogitTransform
from linear_ce.vocab import LocalVocab

__all__ = ["check_sparse_targets", "run_sparse_divergence", "sparse_divergence_op"]

_NAME = "sparse_divergence"


#: The least allowance of ``_sum_tolerance``: log-probabilities computed in a coarser
#: dtype than they are stored in (an fp32 softmax kept as fp64 sums to 1 ± k·6e-8) are
#: log-probabilities all the same; logits, the mistake the check is for, overshoot by far more.
_MIN_SUM_TOLERANCE = 1e-3


def _sum_tolerance(dtype: torch.dtype, k: int) -> float:
    """How far above 1 the stored probabilities of one position may sum. Rounding a
    log-probability ``l`` to ``dtype`` moves ``e^l`` by at most ``|l| e^l eps/2``, and over
    ``k`` slots of total mass at most 1, ``sum |l| e^l <= log k + 1/e``: twice that bound,
    and at least ``_MIN_SUM_TOLERANCE``."""
    return max(torch.finfo(dtype).eps * (math.log(k) + 1.0), _MIN_SUM_TOLERANCE)


def check_sparse_targets(
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    counted: torch.Tensor,
    num_classes: int,
    *,
    rest: bool,
    beta: float,
    name: str = _NAME,
) -> None:
    """The teacher's slots at the rows that count (``counted`` ``(N,)``), ``ids`` and
    ``logprobs`` ``(N, k)``: ids in ``[0, num_classes)`` or ``-1``, no id twice in a row,
    log-probabilities finite or ``-inf`` and at most 1 in total, a non-empty row where
    the teacher is renormalised, some residual where ``beta=1`` compares it. One host
    sync when all is well; errors name ``name`` and the first offending row and slot."""
    if ids.numel() == 0:
        return
    wide = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    lp = logprobs.to(wide)
    rows = counted[:, None]
    empty = (ids == -1) | (lp == -math.inf)
    filled = rows & ~empty
    bad_id = filled & ((ids < 0) | (ids >= num_classes))
    bad_value = filled & ~lp.isfinite()
    ordered = torch.where(filled, ids.long(), -1).sort(dim=-1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    log_total = torch.logsumexp(lp.masked_fill(~filled, -math.inf), dim=-1)
    over = counted & (log_total > math.log1p(_sum_tolerance(logprobs.dtype, ids.shape[-1])))
    count = filled.sum(-1)
    no_slot = counted & (count == 0) if not rest else torch.zeros_like(counted)
    # Reverse KL over the rest is infinite where the teacher leaves it nothing while the
    # student (whose softmax is positive) has classes there.
    no_rest = (
        counted & (log_total >= 0) & (count < num_classes)
        if rest and beta == 1.0
        else torch.zeros_like(counted)
    )
    masks = (bad_id, bad_value, repeated, over, no_slot, no_rest)
    flags = torch.stack([m.any() for m in masks]).tolist()
    if not any(flags):
        return

    def first(mask: torch.Tensor) -> tuple[int, ...]:
        return tuple(int(i) for i in mask.nonzero()[0])

    if flags[0]:
        row, slot = first(bad_id)
        raise ValueError(
            f"{name}: target_ids holds {int(ids[row, slot])} at position {row} (counting the "
            f"leading dimensions flattened), slot {slot}: outside [0, {num_classes}) (the "
            f"vocabulary) and not -1 (an empty slot)"
        )
    if flags[1]:
        row, slot = first(bad_value)
        raise ValueError(
            f"{name}: target_logprobs is {float(lp[row, slot])} at position {row} (leading "
            f"dimensions flattened), slot {slot}; expected log-probabilities: finite, or -inf "
            f"for an empty slot"
        )
    if flags[2]:
        row, slot = first(repeated)
        raise ValueError(
            f"{name}: target_ids repeats id {int(ordered[row, slot + 1])} at position {row} "
            f"(leading dimensions flattened); each id may fill one slot of a position (mark "
            f"unused slots with id -1 or log-probability -inf)"
        )
    if flags[3]:
        (row,) = first(over)
        raise ValueError(
            f"{name}: target_logprobs at position {row} (leading dimensions flattened) sum to "
            f"{math.exp(float(log_total[row])):.6g} in probability, above 1; expected the "
            f"teacher's log-probabilities (log_softmax of its logits), not its logits"
        )
    if flags[4]:
        (row,) = first(no_slot)
        raise ValueError(
            f"{name}: position {row} (leading dimensions flattened) counts (its target is not "
            f"ignore_index) but every slot of it is empty (id -1 or log-probability -inf): "
            f"with mass='renormalize' the teacher has no distribution there; mark the position "
            f"ignored in target, or use mass='rest'"
        )
    (row,) = first(no_rest)
    raise ValueError(
        f"{name}: beta=1 (reverse KL) with mass='rest' is infinite at position {row} (leading "
        f"dimensions flattened): its target_logprobs leave no probability outside the top-k "
        f"(they sum to {math.exp(float(log_total[row])):.6g}) while the student has classes "
        f"there; use beta < 1 (the JSD stays finite)"
    )


def run_sparse_divergence(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    linear_bias: torch.Tensor | None,
    teacher: SparseTeacher,
    target: torch.Tensor,
    valid: torch.Tensor,
    *,
    row_weight: torch.Tensor | None,
    beta: float,
    hard_weight: float,
    transform: LogitTransform,
    options,
    needs: tuple[bool, bool, bool],
    vocab: LocalVocab | None = None,
    vocab_start: int = 0,
    plan_classes: int | None = None,
) -> tuple[SparseDivergenceHead, Gradients]:
    """The chunk loop with a :class:`SparseDivergenceHead`; ``(N, F)`` input, ``(V, P, F)``
    weight, ``(V, P)`` bias, ``(N, P)`` target and ``valid``. A vocab-parallel caller
    passes its ``vocab``, ``vocab_start`` and ``plan_classes`` (the largest shard: it
    sizes the chunks) and the same ``teacher`` on every rank."""
    acc = acc_dtype_for(input.dtype, options.acc_dtype)
    local_classes = linear_weight.shape[0]
    head = SparseDivergenceHead(
        teacher,
        target,
        valid,
        vocab_start,
        local_classes,
        acc,
        beta=beta,
        hard_weight=hard_weight,
        temperature=transform.temperature,
        row_weight=row_weight,
    )
    tiles = tiles_for(head.keeps_logits, transform, any(needs))
    plan = make_plan(
        input.shape[0],
        input.shape[1],
        plan_classes or local_classes,
        input.dtype,
        input.device,
        options,
        tiles=tiles,
    )
    need_x, need_w, need_b = needs
    grads = run_chunks(
        input,
        linear_weight,
        linear_bias,
        head,
        transform,
        plan,
        grad_input=need_x,
        grad_weight=need_w,
        grad_bias=need_b and linear_bias is not None,
        vocab=vocab,
    )
    return head, grads


@torch.library.custom_op("linear_ce::sparse_divergence", mutates_args=())
def sparse_divergence_op(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    linear_bias: torch.Tensor | None,
    target_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    target: torch.Tensor,
    grad_rows: torch.Tensor | None,
    ignore_index: int,
    beta: float,
    rest: bool,
    hard_weight: float,
    transform: Sequence[float],
    target_temperature: float,
    reduction: str,
    batch_chunk_size: int | None,
    chunking_method: str | None,
    acc_policy: str,
    acc_dtype: torch.dtype | None,
    allow_retain_graph: bool,
    need_grad_input: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, grad_input, grad_weight, grad_bias)`` for ``(N, F)`` input, ``(V, 1, F)``
    weight, ``(N, k)`` teacher slots and ``(N, 1)`` target.

    ``reduction`` "mean"/"sum": the scalar loss and its gradients (where needed).
    ``"none"`` without ``grad_rows``: the ``(N, 1)`` row losses, no gradient; with
    ``grad_rows`` ``(N, 1)``: their vector-Jacobian product in the gradient slots."""
    classes = linear_weight.shape[0]
    valid = target != ignore_index
    transform_ = LogitTransform.from_list(transform)
    if grad_rows is None:
        # A backward's rerun (grad_rows given) saw these values in its forward.
        if hard_weight > 0.0:
            check_class_indices(target, ignore_index, classes, _NAME)
        check_sparse_targets(
            target_ids, target_logprobs, valid[:, 0], classes, rest=rest, beta=beta
        )
    options = _options(batch_chunk_size, chunking_method, acc_policy, acc_dtype)
    acc = acc_dtype_for(input.dtype, acc_dtype)
    teacher = sparse_teacher(
        target_ids,
        target_logprobs,
        classes,
        acc,
        rest=rest,
        scale=target_temperature / transform_.temperature,
    )
    scalar = reduction != "none"
    if scalar:
        row_weight = valid.to(acc)
        if reduction == "mean":
            row_weight = row_weight / valid.sum()
        needs = (need_grad_input, need_grad_weight, need_grad_bias)
    else:
        row_weight = grad_rows
        formed = grad_rows is not None
        needs = (formed and need_grad_input, formed and need_grad_weight, formed and need_grad_bias)
    head, grads = run_sparse_divergence(
        input,
        linear_weight,
        linear_bias,
        teacher,
        target.long(),
        valid,
        row_weight=row_weight if any(needs) else None,
        beta=beta,
        hard_weight=hard_weight,
        transform=transform_,
        options=options,
        needs=needs,
    )
    if scalar:
        loss = head.loss.sum()
        if reduction == "mean":
            loss = loss / valid.sum()
    else:
        loss = head.loss
    return (loss, *_gradient_outputs(grads, input))


@sparse_divergence_op.register_fake
def _fake(
    input,
    linear_weight,
    linear_bias,
    target_ids,
    target_logprobs,
    target,
    grad_rows,
    ignore_index,
    beta,
    rest,
    hard_weight,
    transform,
    target_temperature,
    reduction,
    batch_chunk_size,
    chunking_method,
    acc_policy,
    acc_dtype,
    allow_retain_graph,
    need_grad_input,
    need_grad_weight,
    need_grad_bias,
):
    acc = acc_dtype_for(input.dtype, acc_dtype)
    scalar = reduction != "none"
    formed = scalar or grad_rows is not None
    grad_shapes = (input.shape, linear_weight.shape, linear_weight.shape[:-1])
    needs = (need_grad_input, need_grad_weight, need_grad_bias and linear_bias is not None)
    return (
        input.new_empty(() if scalar else target.shape, dtype=acc),
        *(
            input.new_empty(shape if formed and need else (0,))
            for shape, need in zip(grad_shapes, needs, strict=True)
        ),
    )


_ARGUMENTS = 22
_REDUCTION, _RETAIN, _NEEDS = 13, 18, slice(19, 22)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.reduction = inputs[_REDUCTION]
    if ctx.reduction != "none":
        ctx.allow_retain_graph = inputs[_RETAIN]
        ctx.needs = tuple(inputs[_NEEDS])
        # Detached: the stored gradients are outputs of this node (see ops.chunked_scalar).
        ctx.grads = [
            g.detach() if need else None for g, need in zip(output[1:], ctx.needs, strict=True)
        ]
        return
    ctx.save_for_backward(*(t.detach() if t is not None else None for t in inputs[:6]))
    ctx.args = inputs[7:19]


def _backward(ctx, grad_loss, *_unused):
    result = [None] * _ARGUMENTS
    if grad_loss is None:
        return tuple(result)
    if ctx.reduction != "none":
        result[0], result[1], result[2] = hand_over_gradients(
            ctx, ctx.needs, grad_loss, ctx.allow_retain_graph
        )
        return tuple(result)
    input, linear_weight, linear_bias, target_ids, target_logprobs, target = ctx.saved_tensors
    needs = ctx.needs_input_grad
    need = (needs[0], needs[1], linear_bias is not None and needs[2])
    if not any(need):
        return tuple(result)
    outputs = sparse_divergence_op(
        input,
        linear_weight,
        linear_bias,
        target_ids,
        target_logprobs,
        target,
        grad_loss.contiguous(),
        *ctx.args,
        *need,
    )
    for slot, grad, wanted in zip((0, 1, 2), outputs[1:], need, strict=True):
        if wanted:
            result[slot] = grad
    return tuple(result)


sparse_divergence_op.register_autograd(_backward, setup_context=_setup_context)
sparse_divergence_op.register_vmap(_vmap_by_loop(sparse_divergence_op))
