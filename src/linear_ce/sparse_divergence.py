"""The public function ``sparse_divergence``: distillation from a stored teacher's top-k."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from linear_ce.checks.call import (
    Call,
    Caller,
    HeadArguments,
    TransformArguments,
    check_token_call,
    gathered,
)
from linear_ce.checks.divergence import DistillationArguments, check_distillation
from linear_ce.engine.chunk_loop import Needs
from linear_ce.ops.schema import PlanOptions
from linear_ce.ops.sparse_divergence import (
    SCHEMA,
    SparseDivergenceArguments,
    sparse_divergence_on_shard,
    sparse_divergence_op,
)
from linear_ce.options import LinearCrossEntropyOptions, resolve_options
from linear_ce.parallel.dtensor import accepts_dtensors
from linear_ce.parallel.shard import VocabParallel, vocab_shard

__all__ = [
    "MASS_TREATMENTS",
    "SparseDivergenceCall",
    "StoredTeacher",
    "check_sparse_call",
    "sparse_divergence",
]

_NAME = "sparse_divergence"
#: How the teacher's probability outside its top-k is treated (see ``sparse_divergence``).
MASS_TREATMENTS = ("renormalize", "rest")
_LOGPROB_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class SparseDivergenceCall:
    """A checked sparse distillation call: the student's :class:`~linear_ce.checks.call.Call`
    (rows, target, transform), the teacher's ``(N, k)`` ``ids`` and ``logprobs``, and the
    scalar options."""

    call: Call
    ids: torch.Tensor
    logprobs: torch.Tensor
    beta: float
    rest: bool
    hard_weight: float
    target_temperature: float
    reduction: str


class StoredTeacher(NamedTuple):
    """A stored teacher's top-k as a sparse distillation call received it (unchecked): the
    slots' ids and log-probabilities, the temperature they were computed at, and how its
    probability outside them is treated (one of :data:`MASS_TREATMENTS`)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    temperature: float
    mass: str


def check_sparse_call(
    name: str,
    head: HeadArguments,
    transform: TransformArguments,
    teacher: StoredTeacher,
    distillation: DistillationArguments,
    num_classes: int | None = None,
) -> SparseDivergenceCall:
    """Validate a sparse distillation call's arguments (errors name ``name``); the
    teacher's values are checked in the op. ``num_classes`` is the whole vocabulary when
    the head is a vocab-parallel shard."""

    caller = Caller(name)
    fail = caller.fail
    beta, hard_weight, head = check_distillation(caller, distillation, head)
    target_ids, target_logprobs, target_temperature, mass = teacher
    temperature, input = transform.temperature, head.input
    if mass not in MASS_TREATMENTS:
        fail(f"mass must be one of {MASS_TREATMENTS}, got {mass!r}")
    if (
        isinstance(target_temperature, bool)
        or not isinstance(target_temperature, (int, float))
        or not 0.0 < target_temperature < math.inf
    ):
        fail(f"target_temperature must be a finite float > 0, got {target_temperature!r}")
    rest = mass == "rest"
    if not rest and beta == 1.0:
        fail(
            "beta=1 (reverse KL) with mass='renormalize' is infinite wherever the student puts "
            "probability outside the teacher's top-k; use mass='rest' (the student's mass "
            "outside the k classes against the teacher's residual) or beta < 1"
        )
    batch = tuple(input.shape[:-1])
    for label, value in (("target_ids", target_ids), ("target_logprobs", target_logprobs)):
        if not isinstance(value, torch.Tensor):
            fail(f"{label} must be a Tensor, got {type(value).__name__}")
    if target_ids.is_floating_point() or target_ids.is_complex() or target_ids.dtype == torch.bool:
        fail(f"target_ids must be an integer tensor of token ids, got {target_ids.dtype}")
    if target_logprobs.dtype not in _LOGPROB_DTYPES:
        fail(
            f"target_logprobs must be a floating tensor (float16/bfloat16/float32/float64), "
            f"got {target_logprobs.dtype}"
        )
    if target_ids.dim() != len(batch) + 1 or tuple(target_ids.shape[:-1]) != batch:
        fail(
            f"target_ids must have shape (*batch, k) with the input's batch shape {batch}, "
            f"got {tuple(target_ids.shape)}"
        )
    if target_ids.shape[-1] == 0:
        fail("target_ids must have at least one slot per position (k >= 1), got k = 0")
    if target_logprobs.shape != target_ids.shape:
        fail(
            f"target_logprobs must have target_ids' shape {tuple(target_ids.shape)}, got "
            f"{tuple(target_logprobs.shape)}"
        )
    for label, value in (("target_ids", target_ids), ("target_logprobs", target_logprobs)):
        if value.device != input.device:
            fail(f"{label} is on {value.device}, the input on {input.device}")
    if target_logprobs.requires_grad:
        fail(
            "target_logprobs requires grad, but the loss is not differentiated with respect "
            "to the teacher; pass target_logprobs.detach()"
        )
    if rest and temperature != target_temperature:
        fail(
            f"mass='rest' needs temperature == target_temperature (got {temperature!r} and "
            f"{target_temperature!r}): the teacher's residual at another temperature is not "
            f"determined by its top-k; store the teacher's log-probabilities at the temperature "
            f"you distil at and pass it as both"
        )
    call = check_token_call(name, head, transform, num_classes=num_classes)
    k = target_ids.shape[-1]
    rows = call.input.shape[0]
    return SparseDivergenceCall(
        call,
        target_ids.reshape(rows, k),
        target_logprobs.detach().reshape(rows, k),
        beta,
        rest,
        hard_weight,
        float(target_temperature),
        distillation.reduction,
    )


def _counted_positions(arguments: Mapping[str, Any], num_classes: int | None) -> torch.Tensor:
    """The positions a "mean" loss divides by, on this rank's rows (for DTensor inputs
    split along rows)."""
    head = gathered(HeadArguments, arguments)
    transform = gathered(TransformArguments, arguments)
    teacher = StoredTeacher(
        arguments["target_ids"],
        arguments["target_logprobs"],
        arguments["target_temperature"],
        arguments["mass"],
    )
    distillation = gathered(DistillationArguments, arguments)
    checked = check_sparse_call(_NAME, head, transform, teacher, distillation, num_classes)
    return (checked.call.target != checked.call.ignore_index).sum()


@accepts_dtensors(
    rows=("input", "target_ids", "target_logprobs", "target"),
    heads=("linear_weight", "linear_bias"),
    vocab_parallel=True,
    mean=_counted_positions,
)
def sparse_divergence(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    linear_bias: torch.Tensor | None = None,
    beta: float = 0.0,
    mass: str = "renormalize",
    temperature: float = 1.0,
    target_temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool | int = False,
    reduction: str = "mean",
    hard_weight: float = 0.0,
    options: LinearCrossEntropyOptions | None = None,
    vocab_parallel: VocabParallel | None = None,
) -> torch.Tensor:
    r"""Distillation loss against a stored teacher's top-k log-probabilities (sparse logit
    distillation), computed from the student's hidden states without its ``(N, V)`` logits
    and without a dense ``(N, V)`` target.

    Per position, the student is :math:`p = \mathrm{softmax}(s)` with
    :math:`s = \mathrm{softcap}\big((x W^\top + b)\,\sigma\big) / T`. The teacher is
    ``k`` slots of ids and log-probabilities :math:`\ell_j`; its support :math:`K` is
    the non-empty slots (an id of ``-1`` or a log-probability of ``-inf`` marks an empty
    one). ``mass`` decides what stands for the teacher's probability outside :math:`K`:

    - ``"renormalize"``: the teacher renormalised over :math:`K` at temperature
      :math:`T`, :math:`q = \mathrm{softmax}_K(\ell\,T_t / T)` (:math:`T_t` =
      ``target_temperature``, the temperature the log-probabilities were stored at), and
      zero elsewhere. The student stays the full :math:`p`; the divergence is the dense
      one against this teacher, over the whole vocabulary:

      .. math::
          \beta = 0:\ \sum_K q_j \log\frac{q_j}{p_j}, \qquad
          0 < \beta < 1:\ \beta\,\mathrm{KL}(q\,\|\,m) + (1 - \beta)\,\mathrm{KL}(p\,\|\,m),\
          m = \beta q + (1 - \beta) p,

      where the JSD's classes outside :math:`K` add :math:`-(1-\beta)\log(1-\beta)\,r_s`
      (:math:`r_s = \sum_{i \notin K} p_i`). Reverse KL (``beta=1``) is infinite here
      and refused.
    - ``"rest"``: the teacher's stored :math:`q_j = e^{\ell_j}` and its residual
      :math:`r_t = 1 - \sum_K q_j` as one more outcome, against the student's
      :math:`p_j` and :math:`r_s`: forward KL, reverse KL (``beta=1``) or the generalised
      JSD between the two distributions over :math:`K \cup \{\text{rest}\}`. Needs
      ``temperature == target_temperature``. Where :math:`\sum_K q_j` rounds above 1,
      or :math:`K` is the whole vocabulary, the :math:`q_j` are scaled to sum to 1 and
      :math:`r_t = 0`.

    With :math:`k = V` both are the dense divergences of :func:`linear_ce.linear_divergence`.
    ``hard_weight`` adds ``hard_weight`` times the student's cross-entropy against
    ``target`` at temperature 1. The loss is not multiplied by :math:`T^2`. Gradients
    flow to ``input``, ``linear_weight`` and ``linear_bias``; the teacher's slots are
    constants.

    Args:
        input: ``(*, F)`` the student's hidden states.
        linear_weight: ``(V, F)`` the student's head.
        target_ids: ``(*, k)`` integer token ids of the teacher's top-k at each position
            (aligned with ``input``: ``shift`` does not move them), ``-1`` for an empty
            slot. Each id at most once per position.
        target_logprobs: ``(*, k)`` the teacher's log-probabilities of those ids (float16,
            bfloat16, float32 or float64: the math runs in the accumulation dtype), ``-inf``
            for an empty slot; at most 1 in total per position (a rounding allowance aside).
        target: ``(*)`` token ids or ``None``, as in :func:`linear_ce.linear_divergence`:
            positions equal to ``ignore_index`` (after ``shift``) carry no loss and cost no
            GEMM (their slots are not read); with ``hard_weight > 0`` the hard labels;
            every other id in ``[0, V)``, whatever ``hard_weight``.
        linear_bias: ``(V,)`` or ``None``.
        beta: in ``[0, 1]``: 0 forward KL :math:`\mathrm{KL}(q\,\|\,p)`, 1 reverse KL,
            between: the generalised JSD.
        mass: ``"renormalize"`` or ``"rest"`` (above).
        temperature: :math:`T > 0`, the student's and the renormalised teacher's.
        target_temperature: the temperature ``target_logprobs`` were computed at.
        logit_scale, softcap: the student's logits transform (softcap ``None``: none).
        ignore_index, shift: as in :func:`linear_ce.linear_cross_entropy` (``shift`` moves
            ``target`` left along the sequence dimension).
        reduction: ``"mean"`` over the positions that count, ``"sum"``, or ``"none"``
            (``target``'s shape, zero where ignored).
        hard_weight: ``>= 0``; ``> 0`` needs ``target``.
        options: :class:`linear_ce.LinearCrossEntropyOptions` (chunking, accumulation).
        vocab_parallel: ``None`` for a whole head, or a :class:`~linear_ce.VocabParallel`:
            the head given is this rank's shard of one split along the vocabulary (what that
            means, the same for every family, is said there). Collectives: the teacher's
            support is split across the shards (each rank reads the slots whose ids lie in
            its slice); per chunk of valid rows one all_reduce MAX (the row max), one
            all_reduce SUM of the row sums (the normaliser, the student's mass outside the
            support where it is needed) and one more SUM of the slots' sums, which need the
            normaliser; "none" repeats them in backward; one all_reduce of the input
            gradient.

    Returns:
        The loss in the accumulation dtype (float32 for float16/bfloat16 inputs).

    Memory and time: one ``(chunk, V)`` tile (two with a softcap) and ``(N, k)`` teacher
    tensors; "mean"/"sum" form the gradients in forward, three GEMMs per training step;
    "none" recomputes them in backward. The teacher's slots are checked before the loop
    (ids in range, none repeated, finite log-probabilities): one host sync per call.

    Example::

        >>> # offline: the teacher's top-k, stored (ids int32, log-probs bfloat16)
        >>> with torch.no_grad():
        ...     top = torch.log_softmax(teacher(ids).logits.float(), -1).topk(64)
        >>> hidden = student.model(ids).last_hidden_state
        >>> loss = linear_ce.sparse_divergence(
        ...     hidden, student.lm_head.weight, top.indices, top.values.bfloat16(),
        ...     labels, shift=True,
        ... )
        >>> loss.backward()
    """
    head = HeadArguments(input, linear_weight, target, linear_bias, ignore_index, shift)
    transform = TransformArguments(temperature, logit_scale, softcap)
    teacher = StoredTeacher(target_ids, target_logprobs, target_temperature, mass)
    distillation = DistillationArguments(beta, hard_weight, reduction)
    shard = vocab_shard(_NAME, "linear_weight", linear_weight, vocab_parallel)
    checked = check_sparse_call(
        _NAME, head, transform, teacher, distillation, None if shard is None else shard.total
    )
    arguments = _arguments(checked, options)
    if shard is not None:
        loss = sparse_divergence_on_shard(arguments, shard)
    else:
        loss = sparse_divergence_op(*SCHEMA.flatten(arguments))[0]
    return _result(loss, checked)


def _arguments(
    checked: SparseDivergenceCall, options: LinearCrossEntropyOptions | None
) -> SparseDivergenceArguments:
    call = checked.call
    options = resolve_options(options, _NAME)
    return SparseDivergenceArguments(
        call.input,
        call.linear_weight,
        call.linear_bias,
        checked.ids,
        checked.logprobs,
        call.target,
        None,
        call.ignore_index,
        checked.beta,
        checked.rest,
        checked.hard_weight,
        call.transform,
        checked.target_temperature,
        checked.reduction,
        PlanOptions.of(options),
        options.allow_retain_graph,
        Needs.of(call.input, call.linear_weight, call.linear_bias),
        _NAME,
    )


def _result(loss: torch.Tensor, checked: SparseDivergenceCall) -> torch.Tensor:
    return loss.view(checked.call.loss_shape) if checked.reduction == "none" else loss
