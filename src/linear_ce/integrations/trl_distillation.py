"""TRL's distillation loss on :func:`linear_ce.linear_divergence`.

TRL 1.16's ``DistillationTrainer`` computes its loss through one module-level
function, ``trl.trainer.distillation_trainer._chunked_divergence_loss``. Its
stand-in here keeps that function's signature and results (the loss, the sum
of the student's entropies and the number of valid positions) but runs the
divergence on :func:`linear_ce.linear_divergence`: masked positions take part
in no GEMM, the student's gradients are formed in the same pass (four GEMMs per
step where TRL's function takes six, eight for the generalised JSD) and no
``(V, F)`` fp32 accumulator is allocated for half heads.

The compute dtype of each head (student, teacher): without autocast the hidden states'
dtype, as TRL's. Under autocast (TRL's default config: bf16, also on CPU) the wider of the
autocast dtype and the head weight's dtype, where TRL's takes the autocast dtype: fp32
parameters run an fp32 head, so the student's gradients are fp32 sums within fp32
rounding of the float64 gradient (about 1e-7, against 2-3e-3 for TRL's function, which
rounds the operands and the logit gradients to bf16, and 3.5-4.4e-3 for a bf16 head; tiny
Llamas, ``tests/test_trl_distillation.py``). A weight in the autocast dtype (a bf16 model)
keeps a bf16 head. The price is fp32 GEMMs where a bf16 head would have run half ones
(``docs/integrations.md``, "Autocast with fp32 parameters").
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from linear_ce.divergence import linear_divergence
from linear_ce.options import LinearCrossEntropyOptions

__all__ = ["DIVERGENCE_LOSS_ARGS", "chunked_divergence_loss"]

#: The parameters of TRL 1.16's ``_chunked_divergence_loss``, which the stand-in copies.
DIVERGENCE_LOSS_ARGS = (
    "student_hidden_states",
    "teacher_hidden_states",
    "student_lm_head_weight",
    "teacher_lm_head_weight",
    "completion_mask",
    "beta",
    "num_items_in_batch",
    "student_lm_head_bias",
    "teacher_lm_head_bias",
    "student_logit_scale",
    "teacher_logit_scale",
    "student_final_logit_softcapping",
    "teacher_final_logit_softcapping",
    "temperature",
)

_IGNORE = -100


def _gathered(weight: torch.Tensor, bias: torch.Tensor | None):
    """TRL's ZeRO-3 gather of a head (a null context without ZeRO-3), looked up at the call.
    The loss is a sum, so the student's gradients are formed inside it, in forward."""
    try:
        utils = importlib.import_module("trl.trainer.utils")
    except ImportError:
        return contextlib.nullcontext()
    return utils.maybe_gather_lm_head_ctx(weight, bias)


def _whole(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor head (FSDP2) gathered into one plain tensor, once per call, as TRL does."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return tensor
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype a head runs in: the hidden states' without autocast (as TRL); under
    autocast the wider of its dtype and the weight's (TRL: autocast's), so fp32
    parameters get fp32 gradient sums, not bf16-rounded ones (see the module doc)."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.promote_types(torch.get_autocast_dtype(kind), weight.dtype)
    return hidden.dtype


def _head(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One head's hidden states, weight and bias, whole (:func:`_whole`) and in the dtype
    it runs in (:func:`_compute_dtype`)."""
    weight = _whole(weight)
    dtype = _compute_dtype(hidden, weight)
    bias = _whole(bias)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def chunked_divergence_loss(
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    num_items_in_batch: torch.Tensor | int | None = None,
    student_lm_head_bias: torch.Tensor | None = None,
    teacher_lm_head_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    temperature: float = 1.0,
    *,
    options: LinearCrossEntropyOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, entropy_sum, n_valid)`` as TRL's function returns them: the divergence
    summed over the positions where ``completion_mask`` is nonzero, divided by
    ``num_items_in_batch`` (or by the number of those positions, at least 1); the sum of
    the student's entropies there (detached); that number. ``options`` set the chunking
    and precision of :func:`linear_ce.linear_divergence`."""
    with (
        _gathered(student_lm_head_weight, student_lm_head_bias),
        _gathered(teacher_lm_head_weight, teacher_lm_head_bias),
    ):
        student, student_weight, student_bias = _head(
            student_hidden_states, student_lm_head_weight, student_lm_head_bias
        )
        teacher, teacher_weight, teacher_bias = _head(
            teacher_hidden_states, teacher_lm_head_weight, teacher_lm_head_bias
        )
        valid = completion_mask != 0
        marks = torch.where(valid, 0, _IGNORE).to(torch.long)
        with torch.autocast(student_hidden_states.device.type, enabled=False):
            total, entropy = linear_divergence(
                student,
                student_weight,
                teacher,
                teacher_weight,
                marks,
                student_bias=student_bias,
                teacher_bias=teacher_bias,
                beta=float(beta),
                temperature=float(temperature),
                student_logit_scale=float(student_logit_scale),
                teacher_logit_scale=float(teacher_logit_scale),
                student_softcap=student_final_logit_softcapping,
                teacher_softcap=teacher_final_logit_softcapping,
                reduction="sum",
                return_entropy=True,
                options=options,
            )
    n_valid = valid.sum()
    if num_items_in_batch is None:
        loss = total / n_valid.clamp(min=1)
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        loss = total / num_items_in_batch
    return loss, entropy.sum(), n_valid
