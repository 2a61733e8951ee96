"""``linear_ce::token_rows``: per-token log-probability, entropy, top-1 and the other
statistics of :class:`~linear_ce.losses.token_logprob.TokenOutputs` as a custom op.

Forward runs the chunk loop with :class:`~linear_ce.losses.token_logprob.TokenLogprobHead`
and no gradient GEMM, and also returns each row's log-normaliser. The upstream gradients
of ``logprob`` and ``entropy`` are known only in backward: it takes the forward's
log-normaliser and entropy and runs the vocabulary pass
(:mod:`linear_ce.vocab_pass`: one more logits GEMM, no row reduction, no ``(N, V)``
state). Called with upstream gradients but without those statistics (as
:func:`linear_ce.token_logprobs.token_logprobs_vjp` is), it reruns the chunk loop with
them instead. An upstream gradient that does not flow (an output nobody differentiated)
is ``None`` and costs nothing. ``log_sum_sq_prob`` and ``mean_logit`` are statistics
without a gradient: they stay in the graph so that differentiating one is an error
(:func:`refuse_statistic_gradients`), not a gradient dropped in silence.
"""

from __future__ import annotations

# Sequence, not list, in op signatures: torch 2.6's schema inference rejects list[float].
from collections.abc import Sequence

import torch

from linear_ce.chunked import Gradients, run_chunks, tiles_for
from linear_ce.losses.token_logprob import TokenLogprobGradient, TokenLogprobHead, TokenOutputs
from linear_ce.ops import (
    _gradient_outputs,
    _options,
    _vmap_by_loop,
    check_class_indices,
    recomputed_gradients,
)
from linear_ce.plan import acc_dtype_for, make_plan
from linear_ce.transform import LogitTransform
from linear_ce.vocab_pass import vocab_pass_gradients

__all__ = ["refuse_statistic_gradients", "token_rows"]


def _head_and_grads(
    input,
    linear_weight,
    target,
    linear_bias,
    grad_logprob,
    grad_entropy,
    ignore_index,
    transform,
    outputs,
    options,
    needs,
) -> tuple[TokenLogprobHead, Gradients]:
    check_class_indices(target, ignore_index, linear_weight.shape[0], "token_logprobs")
    acc = acc_dtype_for(input.dtype, options.acc_dtype)
    transform = LogitTransform.from_list(transform)
    head = TokenLogprobHead(
        target.long(),
        target != ignore_index,
        0,
        linear_weight.shape[0],
        acc,
        outputs=outputs,
        grad_logprob=grad_logprob,
        grad_entropy=grad_entropy,
    )
    rows, in_features = input.shape
    plan = make_plan(
        rows,
        in_features,
        linear_weight.shape[0],
        input.dtype,
        input.device,
        options,
        tiles=tiles_for(head.keeps_logits, transform, any(needs)),
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
    )
    return head, grads


@torch.library.custom_op("linear_ce::token_rows", mutates_args=())
def token_rows(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    linear_bias: torch.Tensor | None,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    row_stats: torch.Tensor | None,
    ignore_index: int,
    transform: Sequence[float],
    outputs: str,
    batch_chunk_size: int | None,
    chunking_method: str | None,
    acc_policy: str,
    acc_dtype: torch.dtype | None,
    need_grad_input: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """Without upstream gradients: ``(logprob, row_stats, entropy, top1,
    log_sum_sq_prob, mean_logit)``, each ``(N, P)`` but ``row_stats`` ``(N, P, 3)``
    (:attr:`TokenLogprobHead.row_stats`), those after it empty unless ``outputs``, a
    :meth:`TokenOutputs.encode` string, asks for them, and three empty gradients. With
    ``grad_logprob`` and/or ``grad_entropy`` ``(N, P)``: the six outputs empty and
    their vector-Jacobian product for input, weight and bias in the last three slots,
    by the vocabulary pass when the forward's ``row_stats`` are given, else by
    rerunning the chunk loop."""
    backward = grad_logprob is not None or grad_entropy is not None
    needs = (
        backward and need_grad_input,
        backward and need_grad_weight,
        backward and need_grad_bias,
    )
    options = _options(batch_chunk_size, chunking_method, acc_policy, acc_dtype)
    acc = acc_dtype_for(input.dtype, acc_dtype)

    def empty(dtype: torch.dtype = acc) -> torch.Tensor:
        return input.new_empty((0,), dtype=dtype)

    if backward:
        if row_stats is None:
            grads = _head_and_grads(
                input,
                linear_weight,
                target,
                linear_bias,
                grad_logprob,
                grad_entropy,
                ignore_index,
                transform,
                TokenOutputs(),
                options,
                needs,
            )[1]
        else:
            # A direct token_logprobs_vjp call has had no forward to check its targets.
            check_class_indices(target, ignore_index, linear_weight.shape[0], "token_logprobs")
            head = TokenLogprobGradient(
                target.long(), target != ignore_index, 0, row_stats, grad_logprob, grad_entropy
            )
            grads = vocab_pass_gradients(
                input,
                linear_weight,
                linear_bias,
                head,
                LogitTransform.from_list(transform),
                options,
                needs,
            )
        return (
            *(empty() for _ in range(3)),
            empty(torch.bool),
            empty(),
            empty(),
            *_gradient_outputs(grads, input),
        )
    asked = TokenOutputs.decode(outputs)
    head, _ = _head_and_grads(
        input,
        linear_weight,
        target,
        linear_bias,
        None,
        None,
        ignore_index,
        transform,
        asked,
        options,
        needs,
    )

    def given(value: torch.Tensor | None, on: bool, dtype: torch.dtype = acc) -> torch.Tensor:
        return value if on else empty(dtype)

    return (
        head.logprob,
        head.row_stats,
        given(head.entropy, asked.entropy),
        given(head.top1, asked.top1, torch.bool),
        given(head.log_sum_sq_prob, asked.log_sum_sq_prob),
        given(head.mean_logit, asked.mean_logit),
        *_gradient_outputs(Gradients(None, None, None), input),
    )


@token_rows.register_fake
def _token_rows_fake(
    input,
    linear_weight,
    target,
    linear_bias,
    grad_logprob,
    grad_entropy,
    row_stats,
    ignore_index,
    transform,
    outputs,
    batch_chunk_size,
    chunking_method,
    acc_policy,
    acc_dtype,
    need_grad_input,
    need_grad_weight,
    need_grad_bias,
):
    acc = acc_dtype_for(input.dtype, acc_dtype)
    backward = grad_logprob is not None or grad_entropy is not None
    asked = TokenOutputs.decode(outputs)

    def rows_if(on: bool, dtype: torch.dtype = acc, extra: tuple[int, ...] = ()) -> torch.Tensor:
        shape = (*target.shape, *extra) if on and not backward else (0,)
        return input.new_empty(shape, dtype=dtype)

    grad_shapes = (input.shape, linear_weight.shape, linear_weight.shape[:-1])
    needs = (need_grad_input, need_grad_weight, need_grad_bias and linear_bias is not None)
    return (
        rows_if(True),
        rows_if(True, extra=(3,)),
        rows_if(asked.entropy),
        rows_if(asked.top1, torch.bool),
        rows_if(asked.log_sum_sq_prob),
        rows_if(asked.mean_logit),
        *(
            input.new_empty(shape if backward and need else (0,))
            for shape, need in zip(grad_shapes, needs, strict=True)
        ),
    )


def _statistic_message(function: str, statistic: str) -> str:
    return (
        f"{function}: {statistic} is a statistic without a gradient, and it is part of the "
        f"graph being differentiated: its gradient would be lost. Differentiate logprob "
        f"and entropy only; use {statistic}.detach() where it enters a loss"
    )


@torch.library.custom_op("linear_ce::statistic_gradient_check", mutates_args=())
def _statistic_gradient_check(grad: torch.Tensor, function: str, statistic: str) -> torch.Tensor:
    """A zero scalar, or an error if ``grad`` (a statistic's upstream gradient) is
    nonzero anywhere: the check of :func:`refuse_statistic_gradients` in a compiled
    backward, run when the backward runs (one host synchronisation per backward)."""
    if bool(grad.ne(0).any()):
        raise RuntimeError(_statistic_message(function, statistic))
    return grad.new_zeros(())


@_statistic_gradient_check.register_fake
def _statistic_gradient_check_fake(grad, function, statistic):
    return grad.new_empty(())


def refuse_statistic_gradients(
    function: str, grads: dict[str, torch.Tensor | None], keep: torch.Tensor
) -> torch.Tensor:
    """Raises if a statistic (``log_sum_sq_prob``, ``mean_logit``) got an upstream
    gradient in ``grads``; returns ``keep``, a tensor the backward goes on to use.

    Eagerly a statistic's gradient is ``None`` unless it is in the differentiated graph.
    A compiled backward gets one for every output of the compiled graph (zeros where
    nobody differentiated it), so there the check is an op that runs with the backward
    and raises on a nonzero gradient; its zero is added to ``keep`` so the compiler
    keeps it."""
    for statistic, grad in grads.items():
        if grad is None:
            continue
        # A compiled backward is traced with functional (fake) tensors; torch 2.6's
        # is_compiling() is False while AOT autograd traces it.
        traced = torch.compiler.is_compiling() or type(grad) is not torch.Tensor
        if not traced:
            raise RuntimeError(_statistic_message(function, statistic))
        keep = keep + _statistic_gradient_check(grad, function, statistic)
    return keep


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1])
    input, linear_weight, target, linear_bias = inputs[:4]
    ctx.save_for_backward(
        input.detach(),
        linear_weight.detach(),
        target,
        None if linear_bias is None else linear_bias.detach(),
        output[1],
    )
    ctx.args = inputs[7:14]


def _backward(ctx, grad_logprob, _grad_row_stats, grad_entropy, _grad_top1, grad_sq, grad_mean, *_):
    input, linear_weight, target, linear_bias, row_stats = ctx.saved_tensors
    row_stats = refuse_statistic_gradients(
        "token_logprobs", {"log_sum_sq_prob": grad_sq, "mean_logit": grad_mean}, row_stats
    )
    needs = ctx.needs_input_grad
    need_input, need_weight = needs[0], needs[1]
    need_bias = linear_bias is not None and needs[3]
    result = [None] * 17
    if (grad_logprob is None and grad_entropy is None) or not (
        need_input or need_weight or need_bias
    ):
        return tuple(result)
    outputs = token_rows(
        input,
        linear_weight,
        target,
        linear_bias,
        None if grad_logprob is None else grad_logprob.contiguous(),
        None if grad_entropy is None else grad_entropy.contiguous(),
        row_stats,
        *ctx.args,
        need_input,
        need_weight,
        need_bias,
    )
    return recomputed_gradients(result, outputs, (need_input, need_weight, need_bias))


token_rows.register_autograd(_backward, setup_context=_setup_context)
token_rows.register_vmap(_vmap_by_loop(token_rows))
