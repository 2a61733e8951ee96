"""``linear_ce::divergence``: the distillation loss of two LM heads as a custom op.

One op, two kinds of autograd by ``reduction``:

- ``"mean"``/``"sum"``: forward runs the chunk loop once with the student's
  gradients (the upstream gradient of a scalar loss is a constant, so they are
  known in forward); backward scales them. Four GEMMs per training step.
- ``"none"``: forward returns the per-row losses; backward reruns the loop with
  the upstream gradient of each row (one more pair of logits GEMMs per chunk,
  no ``(N, V)`` state).

The teacher's tensors get no gradient.
"""

from __future__ import annotations

# Sequence, not list, in op signatures: torch 2.6's schema inference rejects list[float].
from collections.abc import Sequence

import torch

from linear_ce.engine.chunk_loop import Companion, Gradients, run_chunks, tiles_for
from linear_ce.engine.plan import acc_dtype_for, make_plan
from linear_ce.engine.transform import LogitTransform
from linear_ce.engine.vocab import LocalVocab
from linear_ce.losses.divergence import DivergenceHead
from linear_ce.ops.cross_entropy import (
    _gradient_outputs,
    _options,
    _vmap_by_loop,
    check_class_indices,
    hand_over_gradients,
)

__all__ = ["DIVERGENCE_SHARE", "divergence", "run_divergence", "scalar_row_weight"]

#: The share of the student's gradient bytes the two (or three) logits tiles may take:
#: with the gradients themselves and the blocked scratch the call stays within 1.5× of
#: them. At D=1024, V=32768 (fp32) that is 256-row chunks, which run the four GEMMs at
#: 1.08× their floor where 128-row chunks (the cross-entropy share) run at 1.31×: the
#: weight-gradient GEMM of a short chunk is bound by reading and writing ``grad_W``.
DIVERGENCE_SHARE = 0.48


def run_divergence(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    linear_bias: torch.Tensor | None,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    target: torch.Tensor,
    valid: torch.Tensor,
    *,
    row_weight: torch.Tensor | None,
    beta: float,
    hard_weight: float,
    transform: LogitTransform,
    teacher_transform: LogitTransform,
    entropy: bool,
    options,
    needs: tuple[bool, bool, bool],
    vocab: LocalVocab | None = None,
    vocab_start: int = 0,
    plan_classes: int | None = None,
) -> tuple[DivergenceHead, Gradients]:
    """The chunk loop with a :class:`DivergenceHead` and the teacher as its companion;
    ``(N, F)`` inputs, ``(V, P, F)`` weights, ``(V, P)`` biases, ``(N, P)`` target and
    ``valid``. ``plan_classes`` sizes the chunks (the largest shard when vocab-parallel)."""
    acc = acc_dtype_for(input.dtype, options.acc_dtype)
    local_classes = linear_weight.shape[0]
    head = DivergenceHead(
        target,
        valid,
        vocab_start,
        local_classes,
        acc,
        beta=beta,
        hard_weight=hard_weight,
        temperature=transform.temperature,
        entropy=entropy,
        row_weight=row_weight,
    )
    rows = input.shape[0]
    classes = plan_classes or local_classes
    tiles = tiles_for(head.keeps_logits, transform, any(needs), companion=True)
    plan = make_plan(
        rows,
        input.shape[1],
        classes,
        input.dtype,
        input.device,
        options,
        tiles=tiles,
        half_tile=False,
    )
    teacher_plan = make_plan(
        rows,
        teacher_input.shape[1],
        classes,
        teacher_input.dtype,
        teacher_input.device,
        options,
        tiles=tiles,
        share=DIVERGENCE_SHARE,
        half_tile=False,
    )
    companion = Companion(
        teacher_input, teacher_weight, teacher_bias, teacher_transform, teacher_plan.gemm
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
        companion=companion,
    )
    return head, grads


def scalar_row_weight(valid: torch.Tensor, reduction: str, acc: torch.dtype) -> torch.Tensor:
    """The upstream gradient of each row of a scalar loss: 1 ("sum") or 1/count ("mean")."""
    weight = valid.to(acc)
    if reduction == "mean":
        weight = weight / valid.sum()
    return weight


@torch.library.custom_op("linear_ce::divergence", mutates_args=())
def divergence(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    linear_bias: torch.Tensor | None,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    target: torch.Tensor,
    grad_rows: torch.Tensor | None,
    ignore_index: int,
    beta: float,
    hard_weight: float,
    transform: Sequence[float],
    teacher_transform: Sequence[float],
    reduction: str,
    entropy: bool,
    batch_chunk_size: int | None,
    chunking_method: str | None,
    acc_policy: str,
    acc_dtype: torch.dtype | None,
    allow_retain_graph: bool,
    need_grad_input: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, entropy, grad_input, grad_weight, grad_bias)``.

    ``reduction`` "mean"/"sum": the scalar loss and its gradients (where needed).
    ``"none"`` without ``grad_rows``: the ``(N, P)`` row losses, no gradient; with
    ``grad_rows`` ``(N, P)``: their vector-Jacobian product in the gradient slots.
    ``entropy``: the student's ``(N, P)`` entropy (empty unless asked; no gradient)."""
    if hard_weight > 0.0:
        check_class_indices(target, ignore_index, linear_weight.shape[0], "linear_divergence")
    options = _options(batch_chunk_size, chunking_method, acc_policy, acc_dtype)
    acc = acc_dtype_for(input.dtype, acc_dtype)
    valid = target != ignore_index
    scalar = reduction != "none"
    if scalar:
        row_weight = scalar_row_weight(valid, reduction, acc)
        needs = (need_grad_input, need_grad_weight, need_grad_bias)
    else:
        row_weight = grad_rows
        backward = grad_rows is not None
        needs = (
            backward and need_grad_input,
            backward and need_grad_weight,
            backward and need_grad_bias,
        )
    head, grads = run_divergence(
        input,
        linear_weight,
        linear_bias,
        teacher_input,
        teacher_weight,
        teacher_bias,
        target.long(),
        valid,
        row_weight=row_weight if any(needs) else None,
        beta=beta,
        hard_weight=hard_weight,
        transform=LogitTransform.from_list(transform),
        teacher_transform=LogitTransform.from_list(teacher_transform),
        entropy=entropy,
        options=options,
        needs=needs,
    )
    if scalar:
        loss = head.loss.sum()
        if reduction == "mean":
            loss = loss / valid.sum()
    else:
        loss = head.loss
    return (
        loss,
        head.entropy if entropy else input.new_empty((0,), dtype=acc),
        *_gradient_outputs(grads, input),
    )


@divergence.register_fake
def _divergence_fake(
    input,
    linear_weight,
    linear_bias,
    teacher_input,
    teacher_weight,
    teacher_bias,
    target,
    grad_rows,
    ignore_index,
    beta,
    hard_weight,
    transform,
    teacher_transform,
    reduction,
    entropy,
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
        input.new_empty(target.shape if entropy else (0,), dtype=acc),
        *(
            input.new_empty(shape if formed and need else (0,))
            for shape, need in zip(grad_shapes, needs, strict=True)
        ),
    )


_ARGUMENTS = 23


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.reduction = inputs[13]
    if ctx.reduction != "none":
        ctx.allow_retain_graph = inputs[19]
        ctx.needs = tuple(inputs[20:23])
        # Detached: the stored gradients are outputs of this node (see ops.chunked_scalar).
        ctx.grads = [
            g.detach() if need else None for g, need in zip(output[2:], ctx.needs, strict=True)
        ]
        return
    tensors = inputs[:7]
    ctx.save_for_backward(*(t.detach() if t is not None else None for t in tensors))
    ctx.args = inputs[8:20]


def _backward(ctx, grad_loss, *_unused):
    result = [None] * _ARGUMENTS
    if grad_loss is None:
        return tuple(result)
    if ctx.reduction != "none":
        result[0], result[1], result[2] = hand_over_gradients(
            ctx, ctx.needs, grad_loss, ctx.allow_retain_graph
        )
        return tuple(result)
    input, linear_weight, linear_bias, teacher_input, teacher_weight, teacher_bias, target = (
        ctx.saved_tensors
    )
    needs = ctx.needs_input_grad
    need = (needs[0], needs[1], linear_bias is not None and needs[2])
    if not any(need):
        return tuple(result)
    outputs = divergence(
        input,
        linear_weight,
        linear_bias,
        teacher_input,
        teacher_weight,
        teacher_bias,
        target,
        grad_loss.contiguous(),
        *ctx.args,
        *need,
    )
    for slot, grad, wanted in zip((0, 1, 2), outputs[2:], need, strict=True):
        if wanted:
            result[slot] = grad
    return tuple(result)


divergence.register_autograd(_backward, setup_context=_setup_context)
divergence.register_vmap(_vmap_by_loop(divergence))
