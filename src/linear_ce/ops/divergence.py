"""``linear_ce::divergence``: the distillation loss of two LM heads as a custom op, and the
same on a vocab-parallel shard.

One op, two kinds of autograd by ``reduction``:

- ``"mean"``/``"sum"``: forward runs the chunk loop once with the student's
  gradients (the upstream gradient of a scalar loss is a constant, so they are
  known in forward); backward scales them. Four GEMMs per training step.
- ``"none"``: forward returns the per-row losses; backward reruns the loop with
  the upstream gradient of each row (one more pair of logits GEMMs per chunk,
  no ``(N, V)`` state).

The teacher's tensors get no gradient. :func:`divergence_on_shard` runs the same bodies
on shards of both heads' vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from linear_ce.checks.targets import check_class_indices
from linear_ce.engine.chunk_loop import Companion, Gradients, Needs, tiles_for
from linear_ce.engine.head import HeadFrame
from linear_ce.engine.plan import DIVERGENCE_SHARE, acc_dtype_for, make_plan
from linear_ce.engine.transform import LogitTransform
from linear_ce.engine.vocab import LocalVocab, Vocab
from linear_ce.losses.divergence import DistillationTerms, DivergenceHead
from linear_ce.ops.autograd import (
    Forward,
    OnArguments,
    OnVocab,
    fake_gradient_outputs,
    gradient_outputs,
    reduce_rows,
    register_by_reduction,
    row_weight,
)
from linear_ce.ops.schema import OpSchema, PlanOptions, run_head_on
from linear_ce.options import LinearCrossEntropyOptions

__all__ = [
    "SCHEMA",
    "Distillation",
    "DivergenceArguments",
    "distillation",
    "divergence",
    "divergence_on_shard",
    "fake_distillation",
    "mean_gradient_scale",
]


class DivergenceArguments(NamedTuple):
    """The arguments of ``linear_ce::divergence``: the student's rows ``(N, F)``, head
    ``(V, 1, F)`` and bias ``(V, 1)``, the teacher's, the ``(N, 1)`` target, the upstream
    gradient of each row (``"none"``'s backward), the divergence, each head's logits
    transform, the reduction, whether the student's entropy is returned, how it runs,
    which gradients, and the public function called (its errors name it)."""

    input: torch.Tensor
    linear_weight: torch.Tensor
    linear_bias: torch.Tensor | None
    teacher_input: torch.Tensor
    teacher_weight: torch.Tensor
    teacher_bias: torch.Tensor | None
    target: torch.Tensor
    grad_rows: torch.Tensor | None
    ignore_index: int
    beta: float
    hard_weight: float
    transform: LogitTransform
    teacher_transform: LogitTransform
    reduction: str
    entropy: bool
    options: PlanOptions
    allow_retain_graph: bool
    needs: Needs
    name: str = "linear_divergence"


def mean_gradient_scale(
    valid: torch.Tensor, reduction: str, acc: torch.dtype
) -> tuple[str, torch.Tensor | None]:
    """The reduction whose row weights the head folds into its gradient tile, and the
    factor the loop applies to its fp32 gradient sums (``run_head``'s ``grad_scale``).

    A ``"mean"``'s ``1/count`` is that factor, the rows weighted as for ``"sum"``: folded
    into a half tile, ``w/count`` pushes its entries into the half dtype's subnormals
    (fp16 distillation over 32768 rows: 140x the weight gradient's final rounding). Zero,
    not NaN, where no row counts (the gradients are zero, as torch's)."""
    if reduction != "mean":
        return reduction, None
    count = valid.sum().to(acc)
    return "sum", torch.where(count == 0, 0.0, 1.0 / count)


class Distillation(NamedTuple):
    """Where a distillation op's body starts (:func:`distillation`): how it runs, its
    accumulation dtype, the rows that count, the gradients it forms, the factor of its
    gradient sums (a mean's ``1/count``, or ``None``), and its head's frame and terms."""

    options: LinearCrossEntropyOptions
    acc: torch.dtype
    valid: torch.Tensor
    needs: Needs
    grad_scale: torch.Tensor | None
    frame: HeadFrame
    terms: DistillationTerms


def distillation(args: Any, vocab: Vocab) -> Distillation:
    """The start of a distillation op's body (``args``: its schema's arguments, with the
    student's head, ``target``, ``grad_rows``, the divergence and the reduction) on the
    vocabulary ``vocab``. Gradients are formed for a scalar loss and in a ``"none"``
    backward (``grad_rows`` given); nothing is checked here."""
    options = args.options.as_options()
    acc = acc_dtype_for(args.input.dtype, options.acc_dtype)
    valid = args.target != args.ignore_index
    needs = args.needs.when(args.reduction != "none" or args.grad_rows is not None)
    weighted, grad_scale = mean_gradient_scale(valid, args.reduction, acc)
    weight = row_weight(valid, weighted, args.grad_rows, acc) if any(needs) else None
    frame = HeadFrame(args.target.long(), valid, vocab.start, args.linear_weight.shape[0], acc)
    terms = DistillationTerms(args.beta, args.hard_weight, args.transform.temperature, weight)
    return Distillation(options, acc, valid, needs, grad_scale, frame, terms)


def fake_distillation(args: Any, entropy: bool | None = None) -> tuple[torch.Tensor, ...]:
    """A distillation op's fake result: the loss (0-d, or per row for ``"none"``), the
    student's entropy where the op returns one (``entropy`` not ``None``: per row where
    ``True``, else empty), and the three gradient slots."""
    input = args.input
    acc = acc_dtype_for(input.dtype, args.options.acc_dtype)
    scalar = args.reduction != "none"
    needs = args.needs.when(scalar or args.grad_rows is not None)
    rows = args.target.shape
    entropies = () if entropy is None else (input.new_empty(rows if entropy else (0,), dtype=acc),)
    return (
        input.new_empty(() if scalar else rows, dtype=acc),
        *entropies,
        *fake_gradient_outputs(input, args.linear_weight, needs),
    )


def run_divergence(
    args: DivergenceArguments, vocab: Vocab
) -> tuple[torch.Tensor, torch.Tensor, Gradients]:
    """``(loss, entropy, gradients)``: the chunk loop with a :class:`DivergenceHead` and
    the teacher as its companion. ``"mean"``/``"sum"``: the scalar loss and its
    gradients; ``"none"``: the row losses, and with ``grad_rows`` their gradients
    weighted by it (the input's summed over the vocabulary's shards). The student's
    entropy is empty unless asked for."""
    # The target picks the rows that count, and with hard_weight > 0 holds their labels:
    # a value that is neither a class nor ignore_index is a mistake either way.
    check_class_indices(args.target, args.ignore_index, vocab.total, args.name)
    run = distillation(args, vocab)
    options, needs = run.options, run.needs
    head = DivergenceHead(run.frame, run.terms, entropy=args.entropy)
    # The teacher's plan gives its GEMM backend (its dtype may differ from the student's).
    teacher_plan = make_plan(
        args.teacher_input.shape[0],
        args.teacher_input.shape[1],
        vocab.plan_classes,
        args.teacher_input.dtype,
        args.teacher_input.device,
        options,
        tiles=tiles_for(head.keeps_logits, args.transform, any(needs), companion=True),
        share=DIVERGENCE_SHARE,
        half_tile=False,
        longest=True,
    )
    teacher = Companion(
        args.teacher_input,
        args.teacher_weight,
        args.teacher_bias,
        args.teacher_transform,
        teacher_plan.gemm,
    )
    grads = run_head_on(
        args,
        head,
        options,
        vocab,
        needs,
        companion=teacher,
        grad_scale=run.grad_scale,
        share=DIVERGENCE_SHARE,
    )
    loss = reduce_rows(head.loss, run.valid, args.reduction)
    entropy = head.entropy if args.entropy else args.input.new_empty((0,), dtype=run.acc)
    return loss, entropy, grads


def _kernel(args: DivergenceArguments) -> tuple[torch.Tensor, ...]:
    """``(loss, entropy, grad_input, grad_weight, grad_bias)``.

    ``reduction`` "mean"/"sum": the scalar loss and its gradients (where needed).
    ``"none"`` without ``grad_rows``: the ``(N, P)`` row losses, no gradient; with
    ``grad_rows`` ``(N, P)``: their vector-Jacobian product in the gradient slots.
    ``entropy``: the student's ``(N, P)`` entropy (empty unless asked; no gradient)."""
    loss, entropy, grads = run_divergence(args, LocalVocab(args.linear_weight.shape[0]))
    return loss, entropy, *gradient_outputs(grads, args.input)


def _fake(args: DivergenceArguments) -> tuple[torch.Tensor, ...]:
    return fake_distillation(args, args.entropy)


SCHEMA = OpSchema(DivergenceArguments)
divergence = SCHEMA.define("divergence", 5, _kernel, _fake)


register_by_reduction(divergence, SCHEMA)


@dataclasses.dataclass(frozen=True)
class _OnShard(OnArguments):
    """The distillation bodies on a vocabulary shard (:class:`~linear_ce.ops.autograd.Run`)."""

    args: DivergenceArguments

    def forward(self, input, weight, bias) -> Forward:
        loss, entropy, grads = run_divergence(self.on(input, weight, bias), self.vocab)
        formed = grads if self.args.reduction != "none" else None
        return Forward((loss, entropy), formed, statistics=(1,))

    def backward(self, input, weight, bias, saved, grad_outputs, needs) -> Gradients:
        grad_rows = grad_outputs[0].contiguous()
        args = self.on(input, weight, bias, grad_rows=grad_rows, entropy=False, needs=needs)
        return run_divergence(args, self.vocab)[2]


class _DivergenceOnShard(OnVocab):
    """The autograd node of the distillation loss on shards (named for it in graphs)."""


def divergence_on_shard(
    args: DivergenceArguments, vocab: Vocab
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, entropy)`` of ``args`` on shards ``vocab`` of both heads' vocabulary; the
    same bodies as the op, under :class:`OnVocab`."""
    run = _OnShard(args, vocab)
    return _DivergenceOnShard.apply(args.input, args.linear_weight, args.linear_bias, run)
