"""The plain expression: full logits, then ``torch.nn.functional.cross_entropy``.

Same signature and meaning as :func:`linear_ce.linear_cross_entropy`; it holds
the whole ``(*, C, *out_features)`` logits tensor. It is the definition the
chunked path is tested against, and the "what it means" of every option.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linear_ce.checks.call import HeadArguments, LossArguments, TransformArguments, check_call
from linear_ce.checks.targets import check_targets
from linear_ce.outputs import LinearCrossEntropyOutput

__all__ = ["linear_cross_entropy"]


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options: object = None,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    return_lse: bool = False,
    softcap: float | None = None,
    shift: bool | int = False,
    token_weight: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor | LinearCrossEntropyOutput:
    r"""``cross_entropy(linear(input, W, b), target)`` computed the plain way.

    The logits are scaled by ``logit_scale``, then softcapped
    (``softcap·tanh(logits/softcap)``), then divided by ``temperature``; with
    ``z_loss`` each row adds ``z_loss·ω·lse²``; ``token_weight`` multiplies each
    row's loss; ``shift`` moves the labels (see
    :func:`linear_ce.linear_cross_entropy`). ``options`` is accepted and ignored.
    ``lse`` is zero on ignored rows (they carry no loss) and carries its gradient (none
    on ignored rows), as in the chunked path.

    Example::

        >>> x, W = torch.randn(4, 8), torch.randn(10, 8)
        >>> t = torch.tensor([1, 2, 3, -100])
        >>> loss = linear_cross_entropy(x, W, t)
    """
    head = HeadArguments(input, linear_weight, target, linear_bias, ignore_index, shift)
    given = TransformArguments(temperature, logit_scale, softcap)
    terms = LossArguments(weight, reduction, label_smoothing, z_loss, token_weight)
    call = check_call("linear_cross_entropy", head, given, terms)
    transform = call.transform
    rows, positions = call.input.shape[0], call.linear_weight.shape[1]
    num_classes = call.linear_weight.shape[0]
    # The chunked path's error, not torch's IndexError from inside cross_entropy.
    check_targets(call, num_classes)
    flat_weight = call.linear_weight.reshape(num_classes * positions, -1)
    flat_bias = None if call.linear_bias is None else call.linear_bias.reshape(-1)
    logits = F.linear(call.input, flat_weight, flat_bias).view(rows, num_classes, positions)
    logits = transform.plain(logits)
    # torch's cross_entropy takes int64 class indices only; int32/int16/... are accepted here.
    target = call.target if call.probability_target else call.target.long()
    if positions == 1:
        logits, target = logits.squeeze(2), target.squeeze(-1 if call.probability_target else 1)
    if call.probability_target or call.ignore_index is None:
        ignore = {}
    else:
        ignore = {"ignore_index": call.ignore_index}
    plain = call.z_loss == 0.0 and call.token_weight is None and not (return_lse or return_z_loss)
    if plain:
        loss = F.cross_entropy(
            logits,
            target,
            weight=call.class_weight,
            reduction=call.reduction,
            label_smoothing=call.label_smoothing,
            **ignore,
        )
        return loss.reshape(call.loss_shape) if call.reduction == "none" else loss

    per_row = F.cross_entropy(
        logits,
        target,
        weight=call.class_weight,
        reduction="none",
        label_smoothing=call.label_smoothing,
        **ignore,
    ).view(rows, positions)
    lse = torch.logsumexp(logits, dim=1).view(rows, positions)
    if call.probability_target:
        row_weight = torch.ones_like(per_row)
    else:
        valid = call.target != call.ignore_index
        lse = torch.where(valid, lse, 0.0)
        row_weight = valid.to(per_row.dtype)
        if call.class_weight is not None:
            safe = torch.where(valid, call.target, 0).long()
            row_weight = row_weight * call.class_weight[safe]
    denominator = row_weight.sum()
    # Ignored rows contribute nothing, not even a NaN of their logits (as in cross_entropy).
    z_rows = torch.where(row_weight != 0, call.z_loss * row_weight * lse.square(), 0.0)
    if call.token_weight is not None:
        token_weight = call.token_weight.to(per_row.dtype)
        per_row, z_rows = per_row * token_weight, z_rows * token_weight
    total = per_row + z_rows
    if call.reduction == "none":
        loss, z_term = total.reshape(call.loss_shape), z_rows.reshape(call.loss_shape)
    elif call.reduction == "sum":
        loss, z_term = total.sum(), z_rows.sum()
    else:
        loss, z_term = total.sum() / denominator, z_rows.sum() / denominator
    if not (return_z_loss or return_lse):
        return loss
    return LinearCrossEntropyOutput(
        loss,
        z_term.detach() if return_z_loss else None,
        lse.reshape(call.loss_shape) if return_lse else None,
    )
