"""``linear_ce::token_rows``: per-token log-probability, entropy, top-1 and the other
statistics of :class:`~linear_ce.losses.token_logprob.TokenOutputs` as a custom op, and
the same on a vocab-parallel shard.

Forward runs the chunk loop with :class:`~linear_ce.losses.token_logprob.TokenLogprobHead`
and no gradient GEMM, and also returns each row's log-normaliser. The upstream gradients
of ``logprob`` and ``entropy`` are known only in backward: it takes the forward's
log-normaliser and entropy and runs the vocabulary pass
(:mod:`linear_ce.engine.vocab_pass`: one more logits GEMM, no row reduction, no ``(N, V)``
state). Called with upstream gradients but without those statistics (as
:func:`linear_ce.token_logprobs.token_logprobs_vjp` is), it reruns the chunk loop with
them instead. An upstream gradient that does not flow (an output nobody differentiated)
is ``None`` and costs nothing. ``log_sum_sq_prob`` and ``mean_logit`` are statistics
without a gradient: they stay in the graph so that differentiating one is an error
(:func:`refuse_statistic_gradients`), not a gradient dropped in silence, and so do the
``topk`` log-probabilities (their ids are integers). :func:`token_logprobs_on_shard` runs
the same bodies on a shard of the vocabulary, where the shards' top-k candidates are
merged after the loop (:meth:`~linear_ce.engine.vocab.Vocab.merge_topk`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from linear_ce.checks.targets import check_class_indices
from linear_ce.engine.chunk_loop import Gradients, Needs
from linear_ce.engine.head import HeadFrame
from linear_ce.engine.plan import acc_dtype_for
from linear_ce.engine.transform import LogitTransform
from linear_ce.engine.vocab import LocalVocab, Vocab
from linear_ce.engine.vocab_pass import vocab_pass_gradients
from linear_ce.losses.token_logprob import TokenLogprobGradient, TokenLogprobHead, TokenOutputs
from linear_ce.ops.autograd import Forward, OnVocab, gradient_outputs
from linear_ce.ops.schema import OpSchema, PlanOptions, run_head_on

__all__ = [
    "SCHEMA",
    "TokenArguments",
    "refuse_statistic_gradients",
    "run_token_logprobs",
    "token_gradients",
    "token_logprobs_on_shard",
    "token_rows",
]


class TokenArguments(NamedTuple):
    """The arguments of ``linear_ce::token_rows``: the rows ``(N, F)``, the head
    ``(V, 1, F)`` and bias ``(V, 1)``, the token ids ``(N, 1)``; the upstream gradients of
    ``logprob`` and ``entropy`` and the forward's ``row_stats`` (backward only); the
    outputs asked for, how it runs, which gradients, and the public function called (its
    errors name it)."""

    input: torch.Tensor
    linear_weight: torch.Tensor
    linear_bias: torch.Tensor | None
    target: torch.Tensor
    grad_logprob: torch.Tensor | None
    grad_entropy: torch.Tensor | None
    row_stats: torch.Tensor | None
    ignore_index: int
    transform: LogitTransform
    outputs: TokenOutputs
    options: PlanOptions
    needs: Needs
    name: str = "token_logprobs"


def run_token_logprobs(args: TokenArguments, vocab: Vocab) -> tuple[TokenLogprobHead, Gradients]:
    """The chunk loop with the per-token head: its outputs and the gradients of the
    upstream gradients in ``args`` (the input's summed over the vocabulary's shards)."""
    check_class_indices(args.target, args.ignore_index, vocab.total, args.name)
    options = args.options.as_options()
    acc = acc_dtype_for(args.input.dtype, options.acc_dtype)
    valid = args.target != args.ignore_index
    head = TokenLogprobHead(
        HeadFrame(args.target.long(), valid, vocab.start, args.linear_weight.shape[0], acc),
        outputs=args.outputs,
        num_classes=vocab.total,
        grad_logprob=args.grad_logprob,
        grad_entropy=args.grad_entropy,
    )
    grads = run_head_on(args, head, options, vocab, args.needs)
    if head.topk:
        head.topk_logprobs, head.topk_ids = vocab.merge_topk(head.topk_logprobs, head.topk_ids)
    return head, grads


def token_gradients(args: TokenArguments, vocab: Vocab) -> Gradients:
    """The gradients of ``args``'s upstream gradients: by the vocabulary pass from the
    forward's ``row_stats``, else by rerunning the chunk loop."""
    if args.row_stats is None:
        return run_token_logprobs(args._replace(outputs=TokenOutputs()), vocab)[1]
    # A direct token_logprobs_vjp call has had no forward to check its targets.
    check_class_indices(args.target, args.ignore_index, vocab.total, args.name)
    head = TokenLogprobGradient(
        args.target.long(),
        args.target != args.ignore_index,
        vocab.start,
        args.row_stats,
        args.grad_logprob,
        args.grad_entropy,
    )
    grads = vocab_pass_gradients(
        args.input,
        args.linear_weight,
        args.linear_bias,
        head,
        args.transform,
        args.options.as_options(),
        args.needs,
    )
    if grads.input is not None:
        vocab.sum_(grads.input)
    return grads


def _outputs(head: TokenLogprobHead, asked: TokenOutputs, like: torch.Tensor):
    """``(entropy, top1, log_sum_sq_prob, mean_logit, topk_logprobs, topk_ids)``, empty
    where not asked for."""

    def given(value: torch.Tensor | None, on: bool, dtype: torch.dtype) -> torch.Tensor:
        return value if on else like.new_empty((0,), dtype=dtype)

    acc = head.logprob.dtype
    return (
        given(head.entropy, asked.entropy, acc),
        given(head.top1, asked.top1, torch.bool),
        given(head.log_sum_sq_prob, asked.log_sum_sq_prob, acc),
        given(head.mean_logit, asked.mean_logit, acc),
        given(head.topk_logprobs, asked.topk > 0, acc),
        given(head.topk_ids, asked.topk > 0, torch.int64),
    )


def _kernel(args: TokenArguments) -> tuple[torch.Tensor, ...]:
    """Without upstream gradients: ``(logprob, row_stats, entropy, top1,
    log_sum_sq_prob, mean_logit, topk_logprobs, topk_ids)``, each ``(N, P)`` but
    ``row_stats`` ``(N, P, 3)`` (:attr:`TokenLogprobHead.row_stats`) and the top-k
    ``(N, P, k)``, those after ``row_stats`` empty unless ``outputs`` asks for them, and
    three empty gradients. With ``grad_logprob`` and/or ``grad_entropy``
    ``(N, P)``: the eight outputs empty and their vector-Jacobian product for input,
    weight and bias in the last three slots (:func:`token_gradients`)."""
    vocab = LocalVocab(args.linear_weight.shape[0])
    if args.grad_logprob is not None or args.grad_entropy is not None:
        grads = token_gradients(args, vocab)
        acc = acc_dtype_for(args.input.dtype, args.options.acc_dtype)
        dtypes = (acc, acc, acc, torch.bool, acc, acc, acc, torch.int64)
        empty = (args.input.new_empty((0,), dtype=dtype) for dtype in dtypes)
        return *empty, *gradient_outputs(grads, args.input)
    head, grads = run_token_logprobs(args._replace(needs=Needs(False, False, False)), vocab)
    return (
        head.logprob,
        head.row_stats,
        *_outputs(head, args.outputs, args.input),
        *gradient_outputs(grads, args.input),
    )


def _fake(args: TokenArguments) -> tuple[torch.Tensor, ...]:
    input, weight, target = args.input, args.linear_weight, args.target
    acc = acc_dtype_for(input.dtype, args.options.acc_dtype)
    backward = args.grad_logprob is not None or args.grad_entropy is not None
    asked = args.outputs

    def rows_if(on: bool, dtype: torch.dtype = acc, extra: tuple[int, ...] = ()) -> torch.Tensor:
        shape = (*target.shape, *extra) if on and not backward else (0,)
        return input.new_empty(shape, dtype=dtype)

    grad_shapes = (input.shape, weight.shape, weight.shape[:-1])
    return (
        rows_if(True),
        rows_if(True, extra=(3,)),
        rows_if(asked.entropy),
        rows_if(asked.top1, torch.bool),
        rows_if(asked.log_sum_sq_prob),
        rows_if(asked.mean_logit),
        rows_if(asked.topk > 0, extra=(asked.topk,)),
        rows_if(asked.topk > 0, torch.int64, extra=(asked.topk,)),
        *(
            input.new_empty(shape if backward and need else (0,))
            for shape, need in zip(grad_shapes, args.needs, strict=True)
        ),
    )


SCHEMA = OpSchema(TokenArguments)
token_rows = SCHEMA.define("token_rows", 11, _kernel, _fake)


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
    SCHEMA.save(ctx, SCHEMA.unflatten(inputs)._replace(row_stats=output[1]))


def _asked_gradients(
    asked: TokenOutputs, grad_entropy, grad_sq, grad_mean, grad_topk
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
    """The entropy's upstream gradient and the statistics' (by name), ``None`` for an
    output the call did not ask for.

    Such an output is an empty tensor in the graph; eager autograd hands it no gradient,
    but a traced backward (AOT autograd) hands one for every output, an empty one for an
    empty output. It carries nothing: dropping it loses no gradient and costs nothing."""

    def asked_for(grad: torch.Tensor | None, on: bool) -> torch.Tensor | None:
        return grad if on else None

    statistics = {
        "log_sum_sq_prob": asked_for(grad_sq, asked.log_sum_sq_prob),
        "mean_logit": asked_for(grad_mean, asked.mean_logit),
        "topk_logprobs": asked_for(grad_topk, asked.topk > 0),
    }
    return asked_for(grad_entropy, asked.entropy), statistics


def _backward(
    ctx, grad_logprob, _grad_row_stats, grad_entropy, _grad_top1, grad_sq, grad_mean, grad_topk, *_
):
    args, _ = SCHEMA.saved(ctx)
    grad_entropy, statistics = _asked_gradients(
        args.outputs, grad_entropy, grad_sq, grad_mean, grad_topk
    )
    args = args._replace(
        row_stats=refuse_statistic_gradients(args.name, statistics, args.row_stats)
    )
    return SCHEMA.recompute(
        token_rows, ctx, args, grad_logprob=grad_logprob, grad_entropy=grad_entropy
    )


token_rows.register_autograd(_backward, setup_context=_setup_context)


@dataclasses.dataclass(frozen=True)
class _OnShard:
    """The per-token bodies on a vocabulary shard (:class:`~linear_ce.ops.autograd.Run`)."""

    args: TokenArguments
    vocab: Vocab

    def _on(self, input, weight, bias, **fields) -> TokenArguments:
        return self.args._replace(input=input, linear_weight=weight, linear_bias=bias, **fields)

    def forward(self, input, weight, bias) -> Forward:
        head, _ = run_token_logprobs(self._on(input, weight, bias), self.vocab)
        outputs = (head.logprob, *_outputs(head, self.args.outputs, input))
        # log_sum_sq_prob, mean_logit and the top-k log-probabilities stay in the graph:
        # differentiating them is refused in backward.
        return Forward(outputs, saved=(head.row_stats,), statistics=(2, 6))

    def backward(self, input, weight, bias, saved, grad_outputs, needs) -> Gradients:
        grad_logprob, grad_entropy, _grad_top1, grad_sq, grad_mean, grad_topk, _ = grad_outputs
        grad_entropy, statistics = _asked_gradients(
            self.args.outputs, grad_entropy, grad_sq, grad_mean, grad_topk
        )
        row_stats = refuse_statistic_gradients(self.args.name, statistics, saved[0])
        if grad_logprob is None and grad_entropy is None:
            return Gradients(None, None, None)
        args = self._on(
            input,
            weight,
            bias,
            grad_logprob=grad_logprob,
            grad_entropy=grad_entropy,
            row_stats=row_stats,
            needs=needs,
        )
        return token_gradients(args, self.vocab)


class _TokenLogprobsOnShard(OnVocab):
    """The autograd node of the per-token outputs on a shard (named for them in graphs)."""


def token_logprobs_on_shard(args: TokenArguments, vocab: Vocab) -> tuple[torch.Tensor, ...]:
    """``(logprob, entropy, top1, log_sum_sq_prob, mean_logit, topk_logprobs, topk_ids)``
    of ``args`` on a vocabulary shard ``vocab`` (unasked statistics empty; the top-k merged
    over the shards); the same bodies as the op,
    under :class:`OnVocab`."""
    run = _OnShard(args, vocab)
    return _TokenLogprobsOnShard.apply(args.input, args.linear_weight, args.linear_bias, run)
