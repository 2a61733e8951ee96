"""The public function ``linear_divergence``: logit distillation between two LM heads."""

from __future__ import annotations

import dataclasses
import math

import torch

from linear_ce.arguments import Call, Caller, check_scale, check_softcap, check_token_call
from linear_ce.dtensor import accepts_dtensors
from linear_ce.ops_divergence import divergence
from linear_ce.options import LinearCrossEntropyOptions, resolve_options
from linear_ce.plan import acc_dtype_for
from linear_ce.transform import LogitTransform

__all__ = ["DivergenceCall", "check_divergence_call", "check_teacher", "linear_divergence"]

_NAME = "linear_divergence"
# The student's head goes through the checks of a per-token call, whose arguments are
# named for a single head; errors call them by the names linear_divergence gives them.
_STUDENT_NAMES = {
    "input": "student_input",
    "linear_weight": "student_weight",
    "linear_bias": "student_bias",
    "softcap": "student_softcap",
    "logit_scale": "student_logit_scale",
}


def check_teacher(
    call: Call,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    batch: tuple[int, ...],
    name: str = _NAME,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The teacher's tensors, checked against the student's ``call`` and reshaped to rows:
    ``(N, F_t)``, ``(V, 1, F_t)``, ``(V, 1)``; detached (the teacher gets no gradient)."""

    def fail(message: str):
        raise ValueError(f"{name}: {message}")

    for label, value in (("teacher_input", teacher_input), ("teacher_weight", teacher_weight)):
        if not isinstance(value, torch.Tensor):
            fail(f"{label} must be a Tensor, got {type(value).__name__}")
    if teacher_bias is not None and not isinstance(teacher_bias, torch.Tensor):
        fail(f"teacher_bias must be a Tensor or None, got {type(teacher_bias).__name__}")
    if teacher_weight.dim() != 2:
        fail(
            f"teacher_weight must have shape (V, teacher_features), got {tuple(teacher_weight.shape)}"
        )
    classes, features = teacher_weight.shape
    student_classes = call.weight_shape[0]
    if classes != student_classes:
        fail(
            f"student and teacher must share the vocabulary (the same shard of it when "
            f"vocab-parallel): student_weight has {student_classes} classes, teacher_weight "
            f"{classes}"
        )
    if tuple(teacher_input.shape) != (*batch, features):
        fail(
            f"teacher_input must have shape {(*batch, features)} (the student input's batch "
            f"shape, then teacher_weight's {features} features), got {tuple(teacher_input.shape)}"
        )
    if not teacher_input.is_floating_point() or teacher_input.dtype != teacher_weight.dtype:
        fail(
            f"teacher_input and teacher_weight must be floating tensors of one dtype, got "
            f"{teacher_input.dtype} and {teacher_weight.dtype}"
        )
    if teacher_bias is not None:
        if tuple(teacher_bias.shape) != (classes,):
            fail(f"teacher_bias must have shape ({classes},), got {tuple(teacher_bias.shape)}")
        if teacher_bias.dtype != teacher_weight.dtype:
            fail(
                f"teacher_bias dtype {teacher_bias.dtype} differs from teacher_weight's "
                f"{teacher_weight.dtype}"
            )
    device = call.input.device
    for label, value in (
        ("teacher_input", teacher_input),
        ("teacher_weight", teacher_weight),
        ("teacher_bias", teacher_bias),
    ):
        if value is not None and value.device != device:
            fail(f"{label} is on {value.device}, the student's input on {device}")
    student_acc = acc_dtype_for(call.input.dtype, None)
    teacher_acc = acc_dtype_for(teacher_input.dtype, None)
    if student_acc != teacher_acc:
        fail(
            f"the teacher's dtype {teacher_input.dtype} computes in {teacher_acc}, the "
            f"student's {call.input.dtype} in {student_acc}; cast the teacher to the student's dtype"
        )
    rows = call.input.shape[0]
    return (
        teacher_input.detach().reshape(rows, features),
        teacher_weight.detach().reshape(classes, 1, features),
        None if teacher_bias is None else teacher_bias.detach().reshape(classes, 1),
    )


@dataclasses.dataclass(frozen=True)
class DivergenceCall:
    """A checked distillation call: the student's :class:`~linear_ce.arguments.Call`
    (rows, target, transform), the teacher's ``(input, weight, bias)`` in rows and its
    transform, and the scalar options."""

    call: Call
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    teacher_transform: LogitTransform
    beta: float
    hard_weight: float
    reduction: str


def check_divergence_call(
    name: str,
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None,
    *,
    student_bias: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    beta: float,
    temperature: float,
    student_logit_scale: float,
    teacher_logit_scale: float,
    student_softcap: float | None,
    teacher_softcap: float | None,
    ignore_index: int,
    shift: bool | int,
    reduction: str,
    hard_weight: float,
    return_entropy: bool = False,
    num_classes: int | None = None,
) -> DivergenceCall:
    """Validate a distillation call (errors name ``name``); ``num_classes`` is the whole
    vocabulary when the heads are vocab-parallel shards."""

    def fail(message: str):
        raise ValueError(f"{name}: {message}")

    def real(label: str, value: object, low: float, high: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(f"{label} must be a float in [{low}, {high}], got {value!r}")
        if not low <= value <= high or math.isnan(value):
            fail(f"{label} must be a float in [{low}, {high}], got {value!r}")
        return float(value)

    if not isinstance(student_input, torch.Tensor):
        fail(f"student_input must be a Tensor, got {type(student_input).__name__}")
    beta = real("beta", beta, 0.0, 1.0)
    hard_weight = real("hard_weight", hard_weight, 0.0, math.inf)
    if math.isinf(hard_weight):
        fail("hard_weight must be finite")
    if reduction not in ("mean", "sum", "none"):
        fail(f"reduction must be one of ('mean', 'sum', 'none'), got {reduction!r}")
    if hard_weight > 0.0 and target is None:
        fail("hard_weight > 0 needs target (the hard labels)")
    if not isinstance(return_entropy, bool):
        fail(f"return_entropy must be a bool, got {return_entropy!r}")
    check_softcap(Caller(name), teacher_softcap, "teacher_softcap")
    check_scale(Caller(name), "teacher_logit_scale", teacher_logit_scale)
    batch = tuple(student_input.shape[:-1])
    if target is None:
        target = torch.zeros(batch, dtype=torch.long, device=student_input.device)
    call = check_token_call(
        name,
        student_input,
        student_weight,
        target,
        linear_bias=student_bias,
        ignore_index=ignore_index,
        shift=shift,
        temperature=temperature,
        logit_scale=student_logit_scale,
        softcap=student_softcap,
        flags={},
        num_classes=num_classes,
        renamed=_STUDENT_NAMES,
    )
    teacher = check_teacher(call, teacher_input, teacher_weight, teacher_bias, batch, name)
    teacher_transform = LogitTransform(
        float(teacher_logit_scale),
        None if teacher_softcap is None else float(teacher_softcap),
        float(temperature),
    )
    return DivergenceCall(call, teacher, teacher_transform, beta, hard_weight, reduction)


def _mean_denominator(arguments: dict, num_classes: int) -> torch.Tensor:
    """The positions a "mean" loss divides by, on this rank's rows (for DTensor inputs
    split along rows)."""
    names = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target")
    keywords = {k: v for k, v in arguments.items() if k not in (*names, "options")}
    checked = check_divergence_call(
        _NAME, *(arguments.get(k) for k in names), **keywords, num_classes=num_classes
    )
    return (checked.call.target != checked.call.ignore_index).sum()


@accepts_dtensors(
    rows=("student_input", "teacher_input", "target"),
    heads=("student_weight", "student_bias", "teacher_weight", "teacher_bias"),
    vocab_parallel="vocab_parallel_linear_divergence",
    mean=_mean_denominator,
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
            labels. ``None``: every position counts.
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
    checked = check_divergence_call(
        _NAME,
        student_input,
        student_weight,
        teacher_input,
        teacher_weight,
        target,
        student_bias=student_bias,
        teacher_bias=teacher_bias,
        beta=beta,
        temperature=temperature,
        student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        student_softcap=student_softcap,
        teacher_softcap=teacher_softcap,
        ignore_index=ignore_index,
        shift=shift,
        reduction=reduction,
        hard_weight=hard_weight,
        return_entropy=return_entropy,
    )
    call, teacher = checked.call, checked.teacher
    options = resolve_options(options, _NAME)
    grad_on = torch.is_grad_enabled()
    loss, entropy, *_grads = divergence(
        call.input,
        call.linear_weight,
        call.linear_bias,
        *teacher,
        call.target,
        None,
        call.ignore_index,
        checked.beta,
        checked.hard_weight,
        call.transform.as_list(),
        checked.teacher_transform.as_list(),
        reduction,
        return_entropy,
        options.batch_chunk_size,
        options.chunking_method,
        options.acc_policy,
        options.acc_dtype,
        options.allow_retain_graph,
        grad_on and call.input.requires_grad,
        grad_on and call.linear_weight.requires_grad,
        grad_on and call.linear_bias is not None and call.linear_bias.requires_grad,
    )
    if reduction == "none":
        loss = loss.view(call.loss_shape)
    return (loss, entropy.view(call.loss_shape).detach()) if return_entropy else loss
