"""``linear_ce::sparse_divergence``: distillation from a stored teacher's top-k as a custom op.

As ``linear_ce::divergence``, one op with two kinds of autograd by ``reduction``:
"mean"/"sum" form the gradients in forward (three GEMMs per training step: the
logits and the two gradient GEMMs); "none" returns the row losses and its
backward reruns the loop with the upstream gradient of each row. The teacher's
ids and log-probabilities get no gradient.

The teacher's values are checked here, vectorised before the loop (one host
sync per call; none inside the loop), so a compiled graph does not guard on them.
:func:`sparse_divergence_on_shard` runs the same bodies on a shard of the student's
vocabulary: each rank's head reads the teacher's slots whose ids lie in its slice, and
the row sums (the rest's mass, the slots' late sums) go through the loop's collectives.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from linear_ce.checks.targets import check_class_indices
from linear_ce.engine.chunk_loop import Gradients, Needs
from linear_ce.engine.transform import LogitTransform
from linear_ce.engine.vocab import LocalVocab, Vocab
from linear_ce.losses.sparse_divergence import SparseDivergenceHead, sparse_teacher
from linear_ce.ops.autograd import (
    Forward,
    OnArguments,
    OnVocab,
    gradient_outputs,
    reduce_rows,
    register_by_reduction,
)
from linear_ce.ops.divergence import distillation, fake_distillation
from linear_ce.ops.schema import OpSchema, PlanOptions, run_head_on

__all__ = [
    "SCHEMA",
    "SparseDivergenceArguments",
    "check_sparse_targets",
    "run_sparse_divergence",
    "sparse_divergence_on_shard",
    "sparse_divergence_op",
]

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

    kind = flags.index(True)
    # The first offending position (and slot, for the per-slot checks).
    row, *slot = (int(i) for i in masks[kind].nonzero()[0])
    position = f"position {row} (leading dimensions flattened)"
    mass = math.exp(float(log_total[row]))
    problem = (
        lambda s: (
            f"target_ids holds {int(ids[row, s])} at {position}, slot {s}: outside "
            f"[0, {num_classes}) (the vocabulary) and not -1 (an empty slot)"
        ),
        lambda s: (
            f"target_logprobs is {float(lp[row, s])} at {position}, slot {s}; expected "
            "log-probabilities: finite, or -inf for an empty slot"
        ),
        lambda s: (
            f"target_ids repeats id {int(ordered[row, s + 1])} at {position}; each id may "
            "fill one slot of a position (mark unused slots with id -1 or log-probability -inf)"
        ),
        lambda: (
            f"target_logprobs at {position} sum to {mass:.6g} in probability, above 1; "
            "expected the teacher's log-probabilities (log_softmax of its logits), not its logits"
        ),
        lambda: (
            f"{position} counts (its target is not ignore_index) but every slot of it is empty "
            "(id -1 or log-probability -inf): with mass='renormalize' the teacher has no "
            "distribution there; mark the position ignored in target, or use mass='rest'"
        ),
        lambda: (
            f"beta=1 (reverse KL) with mass='rest' is infinite at {position}: its "
            f"target_logprobs leave no probability outside the top-k (they sum to {mass:.6g}) "
            "while the student has classes there; use beta < 1 (the JSD stays finite)"
        ),
    )[kind](*slot)
    raise ValueError(f"{name}: {problem}")


class SparseDivergenceArguments(NamedTuple):
    """The arguments of ``linear_ce::sparse_divergence``: the student's rows ``(N, F)``,
    head ``(V, 1, F)`` and bias ``(V, 1)``, the teacher's slots ``(N, k)`` (ids and
    log-probabilities), the ``(N, 1)`` target, the upstream gradient of each row
    (``"none"``'s backward), the divergence and how the teacher's mass outside its slots
    counts (``rest``), the student's logits transform and the teacher's temperature, the
    reduction, how it runs, which gradients, and the public function called (its errors
    name it)."""

    input: torch.Tensor
    linear_weight: torch.Tensor
    linear_bias: torch.Tensor | None
    target_ids: torch.Tensor
    target_logprobs: torch.Tensor
    target: torch.Tensor
    grad_rows: torch.Tensor | None
    ignore_index: int
    beta: float
    rest: bool
    hard_weight: float
    transform: LogitTransform
    target_temperature: float
    reduction: str
    options: PlanOptions
    allow_retain_graph: bool
    needs: Needs
    name: str = _NAME


def run_sparse_divergence(
    args: SparseDivergenceArguments, vocab: Vocab
) -> tuple[torch.Tensor, Gradients]:
    """``(loss, gradients)``: the chunk loop with a :class:`SparseDivergenceHead`.
    ``"mean"``/``"sum"``: the scalar loss and its gradients; ``"none"``: the row losses,
    and with ``grad_rows`` their gradients weighted by it. The teacher's values are
    checked first, except in a backward's rerun (``grad_rows`` given: its forward saw
    them)."""
    if args.grad_rows is None:
        # The target picks the rows that count, and with hard_weight > 0 holds their
        # labels: a value that is neither a class nor ignore_index is a mistake either way.
        check_class_indices(args.target, args.ignore_index, vocab.total, args.name)
        check_sparse_targets(
            args.target_ids,
            args.target_logprobs,
            args.target[:, 0] != args.ignore_index,
            vocab.total,
            rest=args.rest,
            beta=args.beta,
            name=args.name,
        )
    run = distillation(args, vocab)
    teacher = sparse_teacher(
        args.target_ids,
        args.target_logprobs,
        vocab.total,
        run.acc,
        rest=args.rest,
        scale=args.target_temperature / args.transform.temperature,
    )
    head = SparseDivergenceHead(teacher, run.frame, run.terms)
    grads = run_head_on(args, head, run.options, vocab, run.needs, grad_scale=run.grad_scale)
    return reduce_rows(head.loss, run.valid, args.reduction), grads


def _kernel(args: SparseDivergenceArguments) -> tuple[torch.Tensor, ...]:
    """``(loss, grad_input, grad_weight, grad_bias)`` for ``(N, F)`` input, ``(V, 1, F)``
    weight, ``(N, k)`` teacher slots and ``(N, 1)`` target.

    ``reduction`` "mean"/"sum": the scalar loss and its gradients (where needed).
    ``"none"`` without ``grad_rows``: the ``(N, 1)`` row losses, no gradient; with
    ``grad_rows`` ``(N, 1)``: their vector-Jacobian product in the gradient slots."""
    loss, grads = run_sparse_divergence(args, LocalVocab(args.linear_weight.shape[0]))
    return loss, *gradient_outputs(grads, args.input)


def _fake(args: SparseDivergenceArguments) -> tuple[torch.Tensor, ...]:
    return fake_distillation(args)


SCHEMA = OpSchema(SparseDivergenceArguments)
sparse_divergence_op = SCHEMA.define("sparse_divergence", 4, _kernel, _fake)


register_by_reduction(sparse_divergence_op, SCHEMA)


@dataclasses.dataclass(frozen=True)
class _OnShard(OnArguments):
    """The sparse distillation bodies on a vocabulary shard
    (:class:`~linear_ce.ops.autograd.Run`)."""

    args: SparseDivergenceArguments

    def forward(self, input, weight, bias) -> Forward:
        loss, grads = run_sparse_divergence(self.on(input, weight, bias), self.vocab)
        return Forward((loss,), grads if self.args.reduction != "none" else None)

    def backward(self, input, weight, bias, saved, grad_outputs, needs) -> Gradients:
        grad_rows = grad_outputs[0].contiguous()
        return run_sparse_divergence(
            self.on(input, weight, bias, grad_rows=grad_rows, needs=needs), self.vocab
        )[1]


def sparse_divergence_on_shard(args: SparseDivergenceArguments, vocab: Vocab) -> torch.Tensor:
    """The loss of ``args`` on a shard ``vocab`` of the student's vocabulary; the same
    bodies as the op, under :class:`OnVocab`."""
    return OnVocab.apply(args.input, args.linear_weight, args.linear_bias, _OnShard(args, vocab))[0]
