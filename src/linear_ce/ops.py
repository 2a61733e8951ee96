"""``torch.library`` custom ops in namespace ``linear_ce``: fake impls, autograd, vmap.

Two ops, because their autograd differs:

- ``linear_ce::chunked_scalar`` (``reduction`` "mean"/"sum"): forward runs
  the chunk loop once and also computes the gradients; backward multiplies
  them by the scalar upstream gradient.
- ``linear_ce::chunked_rows`` (``reduction="none"``): forward returns the
  per-row loss; backward reruns the loop with the upstream gradient folded
  into the row scale (one extra logits GEMM per chunk, no ``(N, V)`` state).

Both take the flattened call of :class:`linear_ce.arguments.Call` and return
``(loss, z_loss, lse, ...)`` in the accumulation dtype (the public function
rounds the loss to the dtype it reports); ``z_loss`` and ``lse`` are for
logging and get no gradient.
"""

from __future__ import annotations

# Sequence, not list, in op signatures: torch 2.6's schema inference rejects list[float].
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from linear_ce.arguments import Call
from linear_ce.chunked import Gradients, tiles_for
from linear_ce.losses.cross_entropy import CrossEntropyHead, run_cross_entropy
from linear_ce.options import LinearCrossEntropyOptions
from linear_ce.plan import acc_dtype_for, make_plan
from linear_ce.transform import LogitTransform

__all__ = ["chunked_rows", "chunked_scalar", "hand_over_gradients"]


def _call(
    input,
    linear_weight,
    target,
    linear_bias,
    class_weight,
    token_weight,
    probability_target,
    reduction,
    ignore_index,
    label_smoothing,
    z_loss,
    transform,
) -> Call:
    logit_scale, softcap, temperature = LogitTransform.from_list(transform).as_tuple()
    return Call(
        input=input,
        linear_weight=linear_weight,
        target=target,
        linear_bias=linear_bias,
        class_weight=class_weight,
        token_weight=token_weight,
        probability_target=probability_target,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        loss_shape=tuple(target.shape),
        weight_shape=tuple(linear_weight.shape),
        logit_scale=logit_scale,
        temperature=temperature,
    )


def check_class_indices(
    target: torch.Tensor, ignore_index: int, num_classes: int, name: str = "linear_cross_entropy"
) -> None:
    """Class indices must lie in [0, C) or equal ignore_index; say which value does not.
    Runs inside the ops, so a compiled graph does not guard on the targets' values."""
    if target.numel() == 0:
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(
            f"{name}: target contains class index {value}, outside [0, "
            f"{num_classes}) and not ignore_index={ignore_index}"
        )


def _check_targets(call: Call, num_classes: int | None = None) -> None:
    """:func:`check_class_indices` of a class-index call; ``num_classes`` is the whole
    vocabulary's ``C`` for a vocab-parallel shard."""
    if call.probability_target:
        return
    if num_classes is None:
        num_classes = call.linear_weight.shape[0]
    check_class_indices(call.target, call.ignore_index, num_classes, call.name)


def _options(batch_chunk_size, chunking_method, acc_policy, acc_dtype) -> LinearCrossEntropyOptions:
    return LinearCrossEntropyOptions(
        batch_chunk_size=batch_chunk_size,
        chunking_method=chunking_method if batch_chunk_size is None else None,
        acc_policy=acc_policy,
        acc_dtype=acc_dtype,
    )


def _plan(call: Call, options: LinearCrossEntropyOptions, tiles: int):
    rows, in_features = call.input.shape
    return make_plan(
        rows,
        in_features,
        call.linear_weight.shape[0],
        call.input.dtype,
        call.input.device,
        options,
        tiles=tiles,
    )


def _gradient_outputs(grads: Gradients, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The three gradient slots of an op's result; an op cannot return ``None``, so a
    gradient that was not computed is an empty tensor."""
    return tuple(
        like.new_empty((0,)) if g is None else g for g in (grads.input, grads.weight, grads.bias)
    )


@torch.library.custom_op("linear_ce::chunked_scalar", mutates_args=())
def chunked_scalar(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    linear_bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    token_weight: torch.Tensor | None,
    probability_target: bool,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    transform: Sequence[float],
    batch_chunk_size: int | None,
    chunking_method: str | None,
    acc_policy: str,
    acc_dtype: torch.dtype | None,
    allow_retain_graph: bool,
    need_grad_input: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scalar loss, z-loss term and per-row lse, plus the gradients of the loss
    (empty where not needed), all in one pass over the chunks."""
    grad_enabled = torch.is_grad_enabled()
    for flag, tensor, name in (
        (need_grad_input, input, "input"),
        (need_grad_weight, linear_weight, "linear_weight"),
        (need_grad_bias, linear_bias, "linear_bias"),
    ):
        if not flag and grad_enabled and tensor is not None and tensor.requires_grad:
            raise RuntimeError(
                f"linear_ce::chunked_scalar: {name} requires grad but its gradient was not "
                "requested when this call was traced; recompile with the current requires_grad"
            )
    call = _call(
        input,
        linear_weight,
        target,
        linear_bias,
        class_weight,
        token_weight,
        probability_target,
        reduction,
        ignore_index,
        label_smoothing,
        z_loss,
        transform,
    )
    _check_targets(call)
    needs = (need_grad_input, need_grad_weight, need_grad_bias)
    tiles = tiles_for(CrossEntropyHead.keeps_logits, call.transform, any(needs))
    plan = _plan(call, _options(batch_chunk_size, chunking_method, acc_policy, acc_dtype), tiles)
    terms, head, grads = run_cross_entropy(call, plan, needs=needs)
    return (
        terms.reduce(head.row_loss),
        terms.reduce(terms.z_rows(head.lse)).to(plan.acc_dtype),
        head.lse,
        *_gradient_outputs(grads, input),
    )


def _fake_outputs(input, linear_weight, acc_dtype, loss_shape, needs):
    """Shapes and dtypes of ``(loss, z_loss, lse, grad_input, grad_weight, grad_bias)``."""
    acc = acc_dtype_for(input.dtype, acc_dtype)
    lse_shape = (input.shape[0], linear_weight.shape[1])
    grad_shapes = (input.shape, linear_weight.shape, linear_weight.shape[:2])
    return (
        input.new_empty(loss_shape, dtype=acc),
        input.new_empty(loss_shape, dtype=acc),
        input.new_empty(lse_shape, dtype=acc),
        *(
            input.new_empty(shape if need else (0,))
            for shape, need in zip(grad_shapes, needs, strict=True)
        ),
    )


@chunked_scalar.register_fake
def _chunked_scalar_fake(
    input,
    linear_weight,
    target,
    linear_bias,
    class_weight,
    token_weight,
    probability_target,
    reduction,
    ignore_index,
    label_smoothing,
    z_loss,
    transform,
    batch_chunk_size,
    chunking_method,
    acc_policy,
    acc_dtype,
    allow_retain_graph,
    need_grad_input,
    need_grad_weight,
    need_grad_bias,
):
    return _fake_outputs(
        input, linear_weight, acc_dtype, (), (need_grad_input, need_grad_weight, need_grad_bias)
    )


def _scalar_setup_context(ctx, inputs, output):
    # Unused outputs (z_loss, lse, the stored gradients) must not get zero-filled
    # gradients: for grad_weight that is a (V, F) allocation and fill per backward.
    ctx.set_materialize_grads(False)
    ctx.allow_retain_graph = inputs[16]
    ctx.needs = inputs[17:20]
    # Detached: the stored gradients are outputs of this node; keeping them
    # attached would make node -> ctx -> tensor -> grad_fn -> node a cycle.
    ctx.grads = [
        g.detach() if need else None for g, need in zip(output[3:], ctx.needs, strict=True)
    ]


_NO_GRAD = [None] * 20


def hand_over_gradients(
    ctx, needs: tuple[bool, ...], grad_loss: torch.Tensor, allow_retain_graph: bool
) -> list[torch.Tensor | None]:
    """The gradients stored in ``ctx.grads`` by forward, scaled by the scalar upstream
    gradient. Without ``allow_retain_graph`` the stored buffers are scaled in place and
    released, so a second backward raises instead of returning wrong numbers."""
    stored = ctx.grads
    if any(need and g is None for g, need in zip(stored, needs, strict=True)):
        raise RuntimeError(
            "linear_cross_entropy: backward ran twice through a graph whose gradients were "
            "already handed over; pass options=LinearCrossEntropyOptions(allow_retain_graph=True) "
            "to backward more than once"
        )
    # A traced backward (AOT autograd) cannot express handing a forward output over
    # mutated in place; there the copy is the only correct choice. Its tensors are
    # functional wrappers, which is_fake does not see through on torch 2.5 and 2.6.
    traced = is_fake(grad_loss) or isinstance(grad_loss, FunctionalTensor)
    in_place = not allow_retain_graph and not traced
    if not allow_retain_graph:
        ctx.grads = [None] * len(stored)
    return [
        None
        if g is None
        else g.mul_(grad_loss.to(g.dtype))
        if in_place
        else g * grad_loss.to(g.dtype)
        for g in stored
    ]


def _scalar_backward(ctx, grad_loss, *_unused):
    result = list(_NO_GRAD)
    if grad_loss is None:
        return tuple(result)
    result[0], result[1], result[3] = hand_over_gradients(
        ctx, ctx.needs, grad_loss, ctx.allow_retain_graph
    )
    return tuple(result)


chunked_scalar.register_autograd(_scalar_backward, setup_context=_scalar_setup_context)


@torch.library.custom_op("linear_ce::chunked_rows", mutates_args=())
def chunked_rows(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    linear_bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    token_weight: torch.Tensor | None,
    grad_output: torch.Tensor | None,
    probability_target: bool,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    transform: Sequence[float],
    batch_chunk_size: int | None,
    chunking_method: str | None,
    acc_policy: str,
    acc_dtype: torch.dtype | None,
    need_grad_input: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad_output=None``: per-row ``(loss, z_loss, lse)``, each ``(N, P)``, and
    empty gradients. With ``grad_output`` ``(N, P)``: the vector-Jacobian
    product of the loss rows, the gradients in the last three slots."""
    call = _call(
        input,
        linear_weight,
        target,
        linear_bias,
        class_weight,
        token_weight,
        probability_target,
        "none",
        ignore_index,
        label_smoothing,
        z_loss,
        transform,
    )
    _check_targets(call)
    backward = grad_output is not None
    needs = (
        backward and need_grad_input,
        backward and need_grad_weight,
        backward and need_grad_bias,
    )
    tiles = tiles_for(CrossEntropyHead.keeps_logits, call.transform, any(needs))
    plan = _plan(call, _options(batch_chunk_size, chunking_method, acc_policy, acc_dtype), tiles)
    terms, head, grads = run_cross_entropy(call, plan, needs=needs, grad_output=grad_output)
    return (
        head.row_loss,
        terms.z_rows(head.lse),
        head.lse,
        *_gradient_outputs(grads, input),
    )


@chunked_rows.register_fake
def _chunked_rows_fake(
    input,
    linear_weight,
    target,
    linear_bias,
    class_weight,
    token_weight,
    grad_output,
    probability_target,
    ignore_index,
    label_smoothing,
    z_loss,
    transform,
    batch_chunk_size,
    chunking_method,
    acc_policy,
    acc_dtype,
    need_grad_input,
    need_grad_weight,
    need_grad_bias,
):
    backward = grad_output is not None
    needs = (
        backward and need_grad_input,
        backward and need_grad_weight,
        backward and need_grad_bias,
    )
    rows_shape = (input.shape[0], linear_weight.shape[1])
    return _fake_outputs(input, linear_weight, acc_dtype, rows_shape, needs)


def _rows_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    tensors = inputs[:6]
    # Detached copies of the inputs' handles: backward recomputes, it does not
    # differentiate through them, and an attached view would keep its base alive.
    ctx.save_for_backward(*(t.detach() if t is not None else None for t in tensors))
    ctx.args = inputs[7:16]


def _rows_backward(ctx, grad_loss, *_unused):
    input, linear_weight, target, linear_bias, class_weight, token_weight = ctx.saved_tensors
    needs = ctx.needs_input_grad
    need_input, need_weight = needs[0], needs[1]
    need_bias = linear_bias is not None and needs[3]
    result = [None] * 19
    if grad_loss is None or not (need_input or need_weight or need_bias):
        return tuple(result)
    outputs = chunked_rows(
        input,
        linear_weight,
        target,
        linear_bias,
        class_weight,
        token_weight,
        grad_loss.contiguous(),
        *ctx.args,
        need_input,
        need_weight,
        need_bias,
    )
    return recomputed_gradients(result, outputs, (need_input, need_weight, need_bias))


chunked_rows.register_autograd(_rows_backward, setup_context=_rows_setup_context)


def recomputed_gradients(
    slots: list, outputs: tuple[torch.Tensor, ...], needs: tuple[bool, bool, bool]
) -> tuple:
    """An op's backward result: the gradients of ``input``, ``linear_weight`` and
    ``linear_bias`` (argument slots 0, 1, 3) from the last three outputs of its
    recomputing call, where needed."""
    for slot, output, need in zip((0, 1, 3), outputs[-3:], needs, strict=True):
        if need:
            slots[slot] = output
    return tuple(slots)


def _vmap_by_loop(op):
    """vmap rule: one call per batch element, results stacked along dim 0."""

    def rule(info, in_dims, *args):
        moved = [
            a.movedim(d, 0) if d is not None and isinstance(a, torch.Tensor) else a
            for a, d in zip(args, in_dims, strict=True)
        ]
        outs = [
            op(
                *[
                    a[i] if d is not None and isinstance(a, torch.Tensor) else a
                    for a, d in zip(moved, in_dims, strict=True)
                ]
            )
            for i in range(info.batch_size)
        ]
        stacked = tuple(torch.stack(parts) for parts in zip(*outs, strict=True))
        return stacked, (0,) * len(stacked)

    return rule


chunked_scalar.register_vmap(_vmap_by_loop(chunked_scalar))
chunked_rows.register_vmap(_vmap_by_loop(chunked_rows))
