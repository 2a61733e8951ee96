"""The cross-entropy ops in namespace ``linear_ce``, and the same on a vocab-parallel shard.

Two ops on one schema (:class:`CrossEntropyArguments`), because their autograd differs:

- ``linear_ce::chunked_scalar`` (``reduction`` "mean"/"sum"): forward runs the chunk
  loop once and also computes the gradients; backward multiplies them by the scalar
  upstream gradient.
- ``linear_ce::chunked_rows`` (``reduction="none"``): forward returns the per-row loss;
  backward reruns the loop with the upstream gradient folded into the row scale (one
  extra logits GEMM per chunk, no ``(N, V)`` state).

Both return ``(loss, z_loss, lse, grad_input, grad_weight, grad_bias)``, the loss in the
accumulation dtype (the public function rounds it to the dtype it reports). ``z_loss``
is for logging and gets no gradient; ``lse`` carries its gradient, softmax times its
upstream gradient, which backward folds into each row's coefficient of the softmax in
the pass that forms the loss's gradient: ``chunked_rows``' own pass, or, for
``chunked_scalar`` called with ``differentiable_lse``, a pass like ``chunked_rows``'
that replaces the gradients formed in forward (they were formed before the lse's
upstream gradient was known). :func:`cross_entropy_on_shard` runs the same bodies on a
shard of the vocabulary (:class:`~linear_ce.ops.autograd.OnVocab`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from linear_ce.checks.call import Call
from linear_ce.checks.targets import check_targets
from linear_ce.engine.chunk_loop import Gradients, Needs, run_head
from linear_ce.engine.plan import acc_dtype_for
from linear_ce.engine.transform import LogitTransform
from linear_ce.engine.vocab import LocalVocab, Vocab
from linear_ce.losses.cross_entropy import CrossEntropyHead, RowTerms, loss_upstream, row_terms
from linear_ce.ops.autograd import (
    Forward,
    HandOver,
    OnVocab,
    gradient_outputs,
    hand_over,
    hand_over_of,
    keep_gradients,
    release_gradients,
)
from linear_ce.ops.schema import OpSchema, PlanOptions
from linear_ce.options import LinearCrossEntropyOptions

__all__ = [
    "CrossEntropyArguments",
    "chunked_rows",
    "chunked_scalar",
    "cross_entropy_on_shard",
    "run_cross_entropy",
]


class CrossEntropyArguments(NamedTuple):
    """The arguments of both cross-entropy ops: a checked :class:`Call`, the upstream
    gradients of its rows' losses and lse (``chunked_rows``'s backward), how it runs,
    which gradients, whether the lse is returned with its gradient (``chunked_scalar``
    then keeps its tensors for a backward that recomputes), and the public function
    called (its errors name it)."""

    input: torch.Tensor
    linear_weight: torch.Tensor
    linear_bias: torch.Tensor | None
    target: torch.Tensor
    class_weight: torch.Tensor | None
    token_weight: torch.Tensor | None
    grad_output: torch.Tensor | None
    grad_lse: torch.Tensor | None
    probability_target: bool
    reduction: str
    ignore_index: int
    label_smoothing: float
    z_loss: float
    transform: LogitTransform
    options: PlanOptions
    allow_retain_graph: bool
    needs: Needs
    differentiable_lse: bool = False
    name: str = "linear_cross_entropy"

    @classmethod
    def of(
        cls,
        call: Call,
        options: LinearCrossEntropyOptions,
        needs: Needs,
        allow_retain_graph: bool = False,
        differentiable_lse: bool = False,
    ) -> CrossEntropyArguments:
        return cls(
            **{name: getattr(call, name) for name in _FROM_CALL},
            grad_output=None,
            grad_lse=None,
            transform=call.transform,
            options=PlanOptions.of(options),
            allow_retain_graph=allow_retain_graph,
            needs=needs,
            differentiable_lse=differentiable_lse,
        )

    def call(self) -> Call:
        """The :class:`Call` these arguments came from."""
        transform = self.transform
        return Call(
            **{name: getattr(self, name) for name in _FROM_CALL},
            softcap=transform.softcap,
            loss_shape=tuple(self.target.shape),
            weight_shape=tuple(self.linear_weight.shape),
            logit_scale=transform.logit_scale,
            temperature=transform.temperature,
        )


#: The arguments that are the :class:`Call`'s fields of the same name.
_FROM_CALL = tuple(
    field.name for field in dataclasses.fields(Call) if field.name in CrossEntropyArguments._fields
)


def run_cross_entropy(
    call: Call,
    options: LinearCrossEntropyOptions,
    vocab: Vocab,
    needs: Needs,
    grad_output: torch.Tensor | None = None,
    grad_lse: torch.Tensor | None = None,
) -> tuple[RowTerms, CrossEntropyHead, Gradients]:
    """The chunk loop on ``call`` with the cross-entropy head: its row coefficients, the
    head (``row_loss``, ``lse``) and the gradients ``needs`` asks for (the input's summed
    over the vocabulary's shards). ``grad_output`` and ``grad_lse`` as in
    :func:`~linear_ce.losses.cross_entropy.row_terms`."""
    check_targets(call, vocab.total)
    acc = acc_dtype_for(call.input.dtype, options.acc_dtype)
    terms = row_terms(
        call, acc, grad_output=grad_output, num_classes=vocab.total, grad_lse=grad_lse
    )
    head = CrossEntropyHead(call, terms, vocab.start, call.linear_weight.shape[0])
    grads = run_head(
        call.input,
        call.linear_weight,
        call.linear_bias,
        head,
        call.transform,
        options,
        vocab,
        needs,
        grad_scale=terms.grad_scale,
    )
    return terms, head, grads


def _scalar(call: Call, options: LinearCrossEntropyOptions, vocab: Vocab, needs: Needs):
    """``(loss, z_loss, lse, gradients)`` of a "mean"/"sum" call."""
    terms, head, grads = run_cross_entropy(call, options, vocab, needs)
    z_term = terms.reduce(terms.z_rows(head.lse)).to(head.lse.dtype)
    return terms.reduce(head.row_loss), z_term, head.lse, grads


def _rows(
    call: Call,
    options: LinearCrossEntropyOptions,
    vocab: Vocab,
    needs: Needs,
    grad_output: torch.Tensor | None,
    grad_lse: torch.Tensor | None = None,
):
    """``(loss, z_loss, lse, gradients)`` of a call, per row; with ``grad_output`` (see
    :func:`~linear_ce.losses.cross_entropy.loss_upstream`) the gradients of the rows'
    losses weighted by it, plus those of the rows' lse weighted by ``grad_lse``."""
    terms, head, grads = run_cross_entropy(
        call, options, vocab, needs.when(grad_output is not None), grad_output, grad_lse
    )
    return head.row_loss, terms.z_rows(head.lse), head.lse, grads


SCHEMA = OpSchema(CrossEntropyArguments)


def _check_traced_needs(args: CrossEntropyArguments) -> None:
    grad_enabled = torch.is_grad_enabled()
    tensors = (args.input, args.linear_weight, args.linear_bias)
    names = ("input", "linear_weight", "linear_bias")
    for need, tensor, name in zip(args.needs, tensors, names, strict=True):
        if not need and grad_enabled and tensor is not None and tensor.requires_grad:
            raise RuntimeError(
                f"linear_ce::chunked_scalar: {name} requires grad but its gradient was not "
                "requested when this call was traced; recompile with the current requires_grad"
            )


def _scalar_kernel(args: CrossEntropyArguments) -> tuple[torch.Tensor, ...]:
    """Scalar loss, z-loss term and per-row lse, plus the gradients of the loss (empty
    where not needed), all in one pass over the chunks."""
    _check_traced_needs(args)
    vocab = LocalVocab(args.linear_weight.shape[0])
    loss, z_term, lse, grads = _scalar(args.call(), args.options.as_options(), vocab, args.needs)
    return loss, z_term, lse, *gradient_outputs(grads, args.input)


def _rows_kernel(args: CrossEntropyArguments) -> tuple[torch.Tensor, ...]:
    """``grad_output=None``: per-row ``(loss, z_loss, lse)``, each ``(N, P)``, and empty
    gradients. With ``grad_output`` ``(N, P)`` (and ``grad_lse`` ``(N, P)``): the
    vector-Jacobian product of the loss rows (and of the lse rows), the gradients in the
    last three slots."""
    vocab = LocalVocab(args.linear_weight.shape[0])
    options = args.options.as_options()
    *outputs, grads = _rows(
        args.call(), options, vocab, args.needs, args.grad_output, args.grad_lse
    )
    return *outputs, *gradient_outputs(grads, args.input)


def _fake(args: CrossEntropyArguments) -> tuple[torch.Tensor, ...]:
    """Shapes and dtypes of ``(loss, z_loss, lse, grad_input, grad_weight, grad_bias)``."""
    input, weight = args.input, args.linear_weight
    acc = acc_dtype_for(input.dtype, args.options.acc_dtype)
    rows_shape = (input.shape[0], weight.shape[1])
    loss_shape = rows_shape if args.reduction == "none" else ()
    needs = args.needs.when(args.reduction != "none" or args.grad_output is not None)
    grad_shapes = (input.shape, weight.shape, weight.shape[:2])
    return (
        input.new_empty(loss_shape, dtype=acc),
        input.new_empty(loss_shape, dtype=acc),
        input.new_empty(rows_shape, dtype=acc),
        *(
            input.new_empty(shape if need else (0,))
            for shape, need in zip(grad_shapes, needs, strict=True)
        ),
    )


chunked_scalar = SCHEMA.define("chunked_scalar", 6, _scalar_kernel, _fake)
chunked_rows = SCHEMA.define("chunked_rows", 6, _rows_kernel, _fake)


def _scalar_setup_context(ctx, inputs, output):
    args = SCHEMA.unflatten(inputs)
    keep_gradients(ctx, output[3:], hand_over_of(args))
    ctx.differentiable_lse = args.differentiable_lse
    if args.differentiable_lse:
        SCHEMA.save(ctx, args)


def _upstream_rows(args: CrossEntropyArguments, grad_loss: torch.Tensor | None) -> torch.Tensor:
    """The upstream gradient of each row's loss from the op's ``grad_loss``
    (:func:`~linear_ce.losses.cross_entropy.loss_upstream`)."""
    acc = acc_dtype_for(args.input.dtype, args.options.acc_dtype)
    return loss_upstream(args.call(), acc, grad_loss)


def _scalar_backward(ctx, grad_loss, _grad_z_loss, grad_lse, *_unused):
    # Without differentiable_lse the lse was not returned: nothing can have used it.
    if grad_lse is None or not ctx.differentiable_lse:
        return SCHEMA.gradients(hand_over(ctx, grad_loss))
    # The gradients formed in forward are the loss's alone, and the tiles are gone: one
    # pass as chunked_rows' forms both, each row's loss taking its share of grad_loss.
    release_gradients(ctx)
    args, _ = SCHEMA.saved(ctx)
    rows = _upstream_rows(args, grad_loss)
    return SCHEMA.recompute(
        chunked_rows, ctx, args._replace(reduction="none"), grad_output=rows, grad_lse=grad_lse
    )


def _rows_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    SCHEMA.save(ctx, SCHEMA.unflatten(inputs))


def _rows_backward(ctx, grad_loss, _grad_z_loss, grad_lse, *_unused):
    if grad_loss is None and grad_lse is not None:
        # Only the lse is differentiated: the loss rows' upstream gradient is zero.
        grad_loss = _upstream_rows(SCHEMA.saved(ctx)[0], None)
    return SCHEMA.recompute(chunked_rows, ctx, grad_output=grad_loss, grad_lse=grad_lse)


chunked_scalar.register_autograd(_scalar_backward, setup_context=_scalar_setup_context)
chunked_rows.register_autograd(_rows_backward, setup_context=_rows_setup_context)


@dataclasses.dataclass(frozen=True)
class _OnShard:
    """The cross-entropy bodies on a vocabulary shard (:class:`~linear_ce.ops.autograd.Run`)."""

    call: Call
    options: LinearCrossEntropyOptions
    vocab: Vocab
    needs: Needs
    loss_dtype: torch.dtype
    differentiable_lse: bool

    @property
    def hand_over(self) -> HandOver:
        return HandOver(self.needs, self.options.allow_retain_graph, self.call.name)

    def _on(self, input, weight, bias) -> Call:
        return dataclasses.replace(self.call, input=input, linear_weight=weight, linear_bias=bias)

    def forward(self, input, weight, bias) -> Forward:
        call = self._on(input, weight, bias)
        statistics = (1,) if self.differentiable_lse else (1, 2)
        if call.reduction == "none":
            loss, z_term, lse, _ = _rows(call, self.options, self.vocab, self.needs, None)
            return Forward((loss.to(self.loss_dtype), z_term, lse), statistics=statistics)
        loss, z_term, lse, grads = _scalar(call, self.options, self.vocab, self.needs)
        outputs = (loss.to(self.loss_dtype), z_term, lse)
        return Forward(outputs, grads, statistics=statistics, recomputable=self.differentiable_lse)

    def backward(self, input, weight, bias, saved, grad_outputs, needs) -> Gradients:
        grad_loss, _, grad_lse = grad_outputs
        call = self._on(input, weight, bias)
        rows = loss_upstream(call, acc_dtype_for(input.dtype, self.options.acc_dtype), grad_loss)
        return _rows(call, self.options, self.vocab, needs, rows, grad_lse)[3]


class _CrossEntropyOnShard(OnVocab):
    """The autograd node of the cross-entropy on a shard (named for it in autograd graphs)."""


def cross_entropy_on_shard(
    call: Call,
    options: LinearCrossEntropyOptions,
    vocab: Vocab,
    loss_dtype: torch.dtype,
    differentiable_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, z_loss, lse)`` of ``call`` on a vocabulary shard ``vocab``, the loss in
    ``loss_dtype``, the lse with its gradient if ``differentiable_lse``; the same bodies
    as the ops, under :class:`OnVocab`."""
    needs = Needs.of(call.input, call.linear_weight, call.linear_bias)
    run = _OnShard(call, options, vocab, needs, loss_dtype, differentiable_lse)
    return _CrossEntropyOnShard.apply(call.input, call.linear_weight, call.linear_bias, run)
