"""Argument checking of a distillation call: the student's head as a per-token call, the
teacher's checked against it."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from linear_ce.checks.call import (
    Call,
    Caller,
    HeadArguments,
    TransformArguments,
    check_scale,
    check_softcap,
    check_token_call,
)
from linear_ce.engine.plan import acc_dtype_for
from linear_ce.engine.transform import LogitTransform

__all__ = [
    "STUDENT_NAMES",
    "DistillationArguments",
    "DivergenceCall",
    "TeacherArguments",
    "check_distillation",
    "check_divergence_call",
    "check_teacher",
]

# The student's head goes through the checks of a per-token call, whose arguments are
# named for a single head; errors call them by the names linear_divergence gives them.
STUDENT_NAMES = {
    "input": "student_input",
    "linear_weight": "student_weight",
    "linear_bias": "student_bias",
    "softcap": "student_softcap",
    "logit_scale": "student_logit_scale",
}


class DistillationArguments(NamedTuple):
    """The scalars every distillation call shares, as its public function received them
    (unchecked)."""

    beta: float
    hard_weight: float
    reduction: str


class TeacherArguments(NamedTuple):
    """The teacher's head of a :func:`linear_ce.linear_divergence` call as received
    (unchecked)."""

    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    logit_scale: float
    softcap: float | None


def check_distillation(
    caller: Caller, distillation: DistillationArguments, head: HeadArguments
) -> tuple[float, float, HeadArguments]:
    """The scalars every distillation call shares: ``beta`` in ``[0, 1]``, a finite
    ``hard_weight >= 0`` (``> 0`` needs a ``target``), a reduction; ``(beta, hard_weight)``
    as floats, and the student's ``head`` with its target: where none is given, class 0
    at every position, none of them ignored (every position counts). The student's input is a tensor (its
    batch shape is the target's)."""
    beta, hard_weight, reduction = distillation
    target = head.target

    def real(label: str, value: object, low: float, high: float) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= value <= high  # NaN fails this too
        ):
            caller.fail(f"{label} must be a float in [{low}, {high}], got {value!r}")
        return float(value)

    beta = real("beta", beta, 0.0, 1.0)
    hard_weight = real("hard_weight", hard_weight, 0.0, math.inf)
    if math.isinf(hard_weight):
        caller.fail("hard_weight must be finite")
    if reduction not in ("mean", "sum", "none"):
        caller.fail(f"reduction must be one of ('mean', 'sum', 'none'), got {reduction!r}")
    if hard_weight > 0.0 and target is None:
        caller.fail("hard_weight > 0 needs target (the hard labels)")
    input = head.input
    if not isinstance(input, torch.Tensor):
        caller.fail(f"{caller.arg('input')} must be a Tensor, got {type(input).__name__}")
    ignore_index = head.ignore_index
    if target is None:
        target = torch.zeros(input.shape[:-1], dtype=torch.long, device=input.device)
        if type(ignore_index) is int and ignore_index == 0:
            # Without a target ignore_index marks nothing; as 0 it would ignore every
            # position of this stand-in target (a NaN mean) instead.
            ignore_index = -1
    # Field by field: torch 2.6's Dynamo traces neither head._replace nor a slice of it.
    return (
        beta,
        hard_weight,
        HeadArguments(
            input, head.linear_weight, target, head.linear_bias, ignore_index, head.shift
        ),
    )


def check_teacher(
    call: Call, teacher: TeacherArguments, batch: tuple[int, ...], name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The teacher's tensors, checked against the student's ``call`` and reshaped to rows:
    ``(N, F_t)``, ``(V, 1, F_t)``, ``(V, 1)``; detached (the teacher gets no gradient)."""
    teacher_input, teacher_weight, teacher_bias = teacher.input, teacher.weight, teacher.bias

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
    """A checked distillation call: the student's :class:`~linear_ce.checks.call.Call`
    (rows, target, transform), the teacher's ``(input, weight, bias)`` in rows and its
    transform, and the scalar options (``return_entropy``: also the student's entropy)."""

    call: Call
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    teacher_transform: LogitTransform
    beta: float
    hard_weight: float
    reduction: str
    return_entropy: bool


def check_divergence_call(
    name: str,
    head: HeadArguments,
    transform: TransformArguments,
    teacher: TeacherArguments,
    distillation: DistillationArguments,
    return_entropy: bool = False,
    num_classes: int | None = None,
) -> DivergenceCall:
    """Validate a distillation call (errors name ``name``): the student's ``head`` and
    ``transform`` under the names ``linear_divergence`` gives them (``student_input``,
    ...), its ``teacher``; ``num_classes`` is the whole vocabulary when the heads are
    vocab-parallel shards."""

    caller = Caller(name, tuple(STUDENT_NAMES.items()))
    beta, hard_weight, head = check_distillation(caller, distillation, head)
    if not isinstance(return_entropy, bool):
        caller.fail(f"return_entropy must be a bool, got {return_entropy!r}")
    check_softcap(caller, teacher.softcap, "teacher_softcap")
    check_scale(caller, "teacher_logit_scale", teacher.logit_scale)
    call = check_token_call(name, head, transform, num_classes=num_classes, renamed=STUDENT_NAMES)
    batch = tuple(head.input.shape[:-1])
    checked_teacher = check_teacher(call, teacher, batch, name)
    teacher_transform = LogitTransform(
        float(teacher.logit_scale),
        None if teacher.softcap is None else float(teacher.softcap),
        float(transform.temperature),
    )
    return DivergenceCall(
        call,
        checked_teacher,
        teacher_transform,
        beta,
        hard_weight,
        distillation.reduction,
        return_entropy,
    )
