"""The distillation family's public function: ``linear_divergence``, logit distillation
between two LM heads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from linear_ce.checks.call import HeadArguments, TransformArguments, gathered
from linear_ce.checks.divergence import (
    STUDENT_NAMES,
    DistillationArguments,
    DivergenceCall,
    TeacherArguments,
    check_divergence_call,
)
from linear_ce.engine.chunk_loop import Needs
from linear_ce.ops.divergence import SCHEMA, DivergenceArguments, divergence, divergence_on_shard
from linear_ce.ops.schema import PlanOptions
from linear_ce.options import LinearCrossEntropyOptions, resolve_options
from linear_ce.parallel.dtensor import accepts_dtensors
from linear_ce.parallel.shard import VocabParallel, vocab_shard

__all__ = ["linear_divergence"]

_NAME = "linear_divergence"
# linear_divergence's names for the teacher's fields (DTensor dispatch hands the call's
# arguments over by name).
_TEACHER = {field: f"teacher_{field}" for field in TeacherArguments._fields}


def _counted_positions(arguments: Mapping[str, Any], num_classes: int | None) -> torch.Tensor:
    """The positions a "mean" loss divides by, on this rank's rows (for DTensor inputs
    split along rows)."""
    head = gathered(HeadArguments, arguments, STUDENT_NAMES)
    transform = gathered(TransformArguments, arguments, STUDENT_NAMES)
    teacher = gathered(TeacherArguments, arguments, _TEACHER)
    distillation = gathered(DistillationArguments, arguments)
    checked = check_divergence_call(
        _NAME, head, transform, teacher, distillation, num_classes=num_classes
    )
    return (checked.call.target != checked.call.ignore_index).sum()


def _arguments(
    checked: DivergenceCall, options: LinearCrossEntropyOptions | None
) -> DivergenceArguments:
    call = checked.call
    options = resolve_options(options, _NAME)
    return DivergenceArguments(
        call.input,
        call.linear_weight,
        call.linear_bias,
        *checked.teacher,
        call.target,
        None,
        call.ignore_index,
        checked.beta,
        checked.hard_weight,
        call.transform,
        checked.teacher_transform,
        checked.reduction,
        checked.return_entropy,
        PlanOptions.of(options),
        options.allow_retain_graph,
        Needs.of(call.input, call.linear_weight, call.linear_bias),
        _NAME,
    )


def _result(
    loss: torch.Tensor, entropy: torch.Tensor, checked: DivergenceCall
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    shape = checked.call.loss_shape
    if checked.reduction == "none":
        loss = loss.view(shape)
    return (loss, entropy.view(shape).detach()) if checked.return_entropy else loss


@accepts_dtensors(
    rows=("student_input", "teacher_input", "target"),
    heads=("student_weight", "student_bias", "teacher_weight", "teacher_bias"),
    vocab_parallel=True,
    mean=_counted_positions,
)
def linear_divergence(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool | int = False,
    reduction: str = "mean",
    hard_weight: float = 0.0,
    return_entropy: bool = False,
    options: LinearCrossEntropyOptions | None = None,
    vocab_parallel: VocabParallel | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Distillation loss between a student's and a teacher's next-token distributions,
    computed from both heads' hidden states without either ``(N, V)`` logits tensor.

    Per token, with each head's logits :math:`z = \mathrm{softcap}\big((x W^\top + b)\,\sigma\big)`
    (its own logit scale :math:`\sigma` and softcap), :math:`p_s = \mathrm{softmax}(z_s / T)`
    and :math:`p_t = \mathrm{softmax}(z_t / T)`:

    .. math::
        D = \begin{cases}
            \mathrm{KL}(p_t \,\|\, p_s) & \beta = 0 \text{ (forward KL)}\\
            \mathrm{KL}(p_s \,\|\, p_t) & \beta = 1 \text{ (reverse KL)}\\
            \beta\,\mathrm{KL}(p_t \,\|\, m) + (1 - \beta)\,\mathrm{KL}(p_s \,\|\, m),\;
            m = \beta p_t + (1 - \beta) p_s & 0 < \beta < 1 \text{ (generalised JSD)}
        \end{cases}

    plus ``hard_weight`` times the student's cross-entropy against ``target`` at
    temperature 1 (:math:`-\log \mathrm{softmax}(z_s)_{t}`). The loss is not multiplied
    by :math:`T^2`; scale it yourself where your recipe does. Gradients flow to
    ``student_input``, ``student_weight`` and ``student_bias`` only: the teacher's
    tensors are constants (detached).

    Args:
        student_input: ``(*, F_s)`` hidden states of the student.
        student_weight: ``(V, F_s)`` the student's head.
        teacher_input: ``(*, F_t)`` hidden states of the teacher, same leading shape;
            ``F_t`` may differ from ``F_s``.
        teacher_weight: ``(V, F_t)`` the teacher's head (same vocabulary ``V``).
        target: ``(*)`` token ids, or ``None``. Positions equal to ``ignore_index`` carry
            no loss and cost no GEMM; with ``hard_weight > 0`` the ids are the hard
            labels. Every other id must lie in ``[0, V)``, whatever ``hard_weight``.
            ``None``: every position counts.
        student_bias, teacher_bias: ``(V,)`` or ``None``.
        beta: in ``[0, 1]``, which divergence (above).
        temperature: ``T > 0``, shared by both distributions.
        student_logit_scale, teacher_logit_scale, student_softcap, teacher_softcap: each
            head's logits transform (softcap ``None``: none).
        ignore_index, shift: as in :func:`linear_ce.linear_cross_entropy` (``shift``
            moves the target left along the sequence dimension).
        reduction: ``"mean"`` over the positions that count, ``"sum"``, or ``"none"``
            (the target's shape, zero where ignored).
        hard_weight: ``>= 0``; ``> 0`` needs a ``target``.
        return_entropy: also return the student's entropy :math:`-\sum p_s \log p_s` at
            each position (the target's shape, zero where ignored, detached), from the
            same pass (what distillation trainers log).
        options: :class:`linear_ce.LinearCrossEntropyOptions` (chunking, accumulation).
        vocab_parallel: ``None`` for a whole head, or a :class:`~linear_ce.VocabParallel`:
            the head given is this rank's shard of one split along the vocabulary (what that
            means, the same for every family, is said there). Collectives: both heads (and
            biases) split alike, the student's and the teacher's shards (V_r, F_s) and (V_r,
            F_t); per chunk of valid rows two all_reduce MAX (each head's row max) and one
            all_reduce SUM of the row sums, one more SUM for 0 < beta < 1 (the mixture's
            sums need both normalisers); "none" repeats them in backward; one all_reduce of
            the input gradient.

    Returns:
        The loss in the accumulation dtype (float32 for float16/bfloat16 students);
        ``(loss, entropy)`` with ``return_entropy``.

    Memory: one ``(chunk, V)`` logits tile per head (and one more for the mixture of
    ``0 < beta < 1``); "mean"/"sum" compute the gradients in forward (four GEMMs per
    training step), "none" recomputes them in backward.

    Example::

        >>> with torch.no_grad():
        ...     teacher_hidden = teacher.model(ids).last_hidden_state
        >>> hidden = student.model(ids).last_hidden_state
        >>> loss = linear_ce.linear_divergence(
        ...     hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight,
        ...     labels, shift=True, beta=0.5, temperature=0.9,
        ... )
        >>> loss.backward()
    """
    head = HeadArguments(student_input, student_weight, target, student_bias, ignore_index, shift)
    transform = TransformArguments(temperature, student_logit_scale, student_softcap)
    teacher = TeacherArguments(
        teacher_input, teacher_weight, teacher_bias, teacher_logit_scale, teacher_softcap
    )
    distillation = DistillationArguments(beta, hard_weight, reduction)
    shard = vocab_shard(_NAME, "student_weight", student_weight, vocab_parallel)
    checked = check_divergence_call(
        _NAME,
        head,
        transform,
        teacher,
        distillation,
        return_entropy,
        None if shard is None else shard.total,
    )
    arguments = _arguments(checked, options)
    if shard is not None:
        loss, entropy = divergence_on_shard(arguments, shard)
    else:
        loss, entropy = divergence(*SCHEMA.flatten(arguments))[:2]
    return _result(loss, entropy, checked)
