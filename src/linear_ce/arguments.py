"""Argument checking and shape normalisation shared by every entry point.

Everything here runs before any arithmetic: a bad call fails with a message
that names the argument, what it got and what was expected.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from linear_ce.transform import LogitTransform

__all__ = ["Call", "check_call"]

REDUCTIONS = ("mean", "sum", "none")
DEFAULT_IGNORE_INDEX = -100
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclasses.dataclass(frozen=True)
class Call:
    """A checked call, reshaped to rows: ``N`` rows of ``F`` features, ``C`` classes
    at each of ``P = d1·…·dK`` positions.

    ``input`` is ``(N, F)`` (a view of the caller's tensor where the layout
    allows), ``linear_weight`` ``(C, P, F)``, ``linear_bias`` ``(C, P)``,
    ``target`` ``(N, P)`` class indices or ``(N, C, P)`` probabilities,
    ``token_weight`` ``(N, P)``. ``loss_shape`` is the shape of the
    ``reduction="none"`` result. ``logit_scale`` and ``temperature`` (checked by
    :func:`linear_ce.transform.check_scales`) complete the logits transform.
    """

    input: torch.Tensor
    linear_weight: torch.Tensor
    target: torch.Tensor
    linear_bias: torch.Tensor | None
    class_weight: torch.Tensor | None
    token_weight: torch.Tensor | None
    probability_target: bool
    reduction: str
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None
    loss_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    logit_scale: float = 1.0
    temperature: float = 1.0

    @property
    def transform(self) -> LogitTransform:
        """The logits transform of this call (:mod:`linear_ce.transform`)."""
        return LogitTransform(self.logit_scale, self.softcap, self.temperature)


def _fail(message: str) -> None:
    raise ValueError(f"linear_cross_entropy: {message}")


def _shifted_target(target: torch.Tensor, shift: int, ignore_index: int) -> torch.Tensor:
    """Labels moved ``shift`` places left along the sequence (last leading) dimension,
    the vacated positions set to ``ignore_index``; the hidden states stay untouched."""
    length = target.shape[-1]
    out = torch.full_like(target, ignore_index)
    if shift < length:
        out[..., : length - shift] = target[..., shift:]
    return out


def check_call(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    reduction: str,
    ignore_index: int | None,
    label_smoothing: float,
    z_loss: float = 0.0,
    softcap: float | None = None,
    shift: bool | int = False,
    token_weight: torch.Tensor | None = None,
    num_classes: int | None = None,
) -> Call:
    """Validate a ``linear_cross_entropy`` call and reshape it to rows (see :class:`Call`).

    ``num_classes`` is the whole vocabulary's ``C`` when ``linear_weight`` (and
    ``linear_bias``) hold a vocab-parallel shard of it (:mod:`linear_ce.distributed`):
    class weights and probability targets are checked against it, the bias
    against the shard. ``None`` means ``linear_weight.shape[0]``.
    """
    for name, value in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            _fail(f"{name} must be a Tensor, got {type(value).__name__}")
    for name, value in (
        ("linear_bias", linear_bias),
        ("weight", weight),
        ("token_weight", token_weight),
    ):
        if value is not None and not isinstance(value, torch.Tensor):
            _fail(f"{name} must be a Tensor or None, got {type(value).__name__}")
    if reduction not in REDUCTIONS:
        _fail(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        _fail(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        _fail(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if (
        isinstance(z_loss, bool)
        or not isinstance(z_loss, (int, float))
        or not 0.0 <= z_loss < math.inf
    ):
        _fail(f"z_loss must be a finite float >= 0, got {z_loss!r}")
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not 0.0 < softcap < math.inf
    ):
        _fail(f"softcap must be None or a finite float > 0, got {softcap!r}")
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
    ):
        _fail(f"ignore_index must be an int or None, got {ignore_index!r}")
    if isinstance(shift, bool):
        shift = int(shift)
    if not isinstance(shift, int) or shift < 0:
        _fail(f"shift must be a bool or an int >= 0, got {shift!r}")

    if input.dtype not in _FLOAT_DTYPES:
        _fail(
            f"input must be a floating tensor (float16/bfloat16/float32/float64), got {input.dtype}"
        )
    if linear_weight.dtype != input.dtype:
        # autocast does not cast our arguments (the op runs in the dtype it is given),
        # so a bf16 hidden state meeting an fp32 lm_head under autocast lands here.
        hint = (
            " (under torch.autocast linear_cross_entropy is not autocast: it runs in the "
            "dtype of its arguments)"
            if input.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(input.device.type)
            else ""
        )
        _fail(
            f"linear_weight dtype {linear_weight.dtype} differs from input dtype {input.dtype}; "
            f"cast one of them so both match{hint}"
        )
    if input.dim() < 1:
        _fail("input must have shape (*, in_features) with at least 1 dimension, got a 0-d tensor")
    if linear_weight.dim() < 2:
        _fail(
            "linear_weight must have shape (num_classes, in_features) or "
            f"(num_classes, d1, ..., dK, in_features), got shape {tuple(linear_weight.shape)}"
        )
    in_features = input.shape[-1]
    if linear_weight.shape[-1] != in_features:
        _fail(
            f"in_features mismatch: input has {in_features} features (last dimension) but "
            f"linear_weight has {linear_weight.shape[-1]} (shape {tuple(linear_weight.shape)})"
        )
    local_classes = linear_weight.shape[0]
    if local_classes == 0:
        _fail(f"linear_weight must have at least one class, got shape {tuple(linear_weight.shape)}")
    if num_classes is None:
        num_classes = local_classes
    out_features = tuple(linear_weight.shape[1:-1])
    batch_shape = tuple(input.shape[:-1])
    logits_shape = (*batch_shape, num_classes, *out_features)

    tensors = {"input": input, "linear_weight": linear_weight, "target": target}
    for name, value in (
        ("linear_bias", linear_bias),
        ("weight", weight),
        ("token_weight", token_weight),
    ):
        if value is not None:
            tensors[name] = value
    devices = {name: value.device for name, value in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        _fail(f"all tensors must be on one device, got {listing}")

    if linear_bias is not None:
        if tuple(linear_bias.shape) != (local_classes, *out_features):
            _fail(
                f"linear_bias must have shape {(local_classes, *out_features)} (num_classes, "
                f"*out_features), got {tuple(linear_bias.shape)}"
            )
        if linear_bias.dtype != input.dtype:
            _fail(f"linear_bias dtype {linear_bias.dtype} differs from input dtype {input.dtype}")

    if out_features and not batch_shape:
        _fail(
            f"K-dimensional loss (linear_weight shape {tuple(linear_weight.shape)}) needs batched "
            f"input (N, {in_features}), got shape {tuple(input.shape)}"
        )

    probability_target = target.is_floating_point() and tuple(target.shape) == logits_shape
    if probability_target:
        if target.dtype != input.dtype:
            _fail(f"probability target dtype {target.dtype} differs from input dtype {input.dtype}")
        if ignore_index is not None:
            _fail(
                "ignore_index cannot be used with probability targets (target of shape "
                f"{logits_shape}); pass ignore_index=None"
            )
        if shift:
            _fail("shift needs class-index targets; shift probability targets yourself")
        if target.requires_grad:
            _fail(
                "a probability target that requires grad is not supported: the loss is "
                "not differentiated with respect to target; pass target.detach()"
            )
    else:
        expected = (*batch_shape, *out_features)
        if target.is_floating_point():
            _fail(
                f"a floating target is read as class probabilities and must have the logits' "
                f"shape {logits_shape} (*batch, num_classes, *out_features), got "
                f"{tuple(target.shape)}; class-index targets must be integers of shape {expected}"
            )
        if target.dtype not in _INDEX_DTYPES:
            _fail(
                f"class-index target must be an integer tensor (int64 or int32), got {target.dtype}"
            )
        if tuple(target.shape) != expected:
            _fail(
                f"class-index target must have shape {expected} (input's batch shape "
                f"{batch_shape} then out_features {out_features}), got {tuple(target.shape)}"
            )

    if weight is not None:
        if tuple(weight.shape) != (num_classes,):
            _fail(
                f"weight (class weights) must have shape ({num_classes},), got {tuple(weight.shape)}"
            )
        if weight.dtype != input.dtype:
            _fail(
                f"weight (class weights) must have the input's dtype {input.dtype}, got {weight.dtype}"
            )
        if weight.requires_grad:
            _fail(
                "weight (class weights) that requires grad is not supported: the loss is not "
                "differentiated with respect to class weights; pass weight.detach()"
            )

    loss_shape = (*batch_shape, *out_features)
    if token_weight is not None:
        if tuple(token_weight.shape) != loss_shape:
            _fail(
                f"token_weight must have the per-token loss shape {loss_shape}, got "
                f"{tuple(token_weight.shape)}"
            )
        if not token_weight.is_floating_point():
            _fail(f"token_weight must be a floating tensor, got {token_weight.dtype}")
        if token_weight.requires_grad:
            _fail("token_weight that requires grad is not supported; pass token_weight.detach()")

    if shift and not batch_shape:
        _fail("shift needs input of shape (..., T, in_features) with a sequence dimension")
    if shift and out_features:
        _fail("shift cannot be combined with K-dimensional loss")

    resolved_ignore = DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index
    if shift:
        target = _shifted_target(target, shift, resolved_ignore)

    rows = math.prod(batch_shape)
    positions = math.prod(out_features)
    flat_input = input.reshape(rows, in_features)
    if probability_target:
        flat_target = target.reshape(rows, num_classes, positions)
    else:
        flat_target = target.reshape(rows, positions)
    return Call(
        input=flat_input,
        linear_weight=linear_weight.reshape(local_classes, positions, in_features),
        target=flat_target,
        linear_bias=None if linear_bias is None else linear_bias.reshape(local_classes, positions),
        class_weight=weight,
        token_weight=None if token_weight is None else token_weight.reshape(rows, positions),
        probability_target=probability_target,
        reduction=reduction,
        ignore_index=resolved_ignore,
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        softcap=None if softcap is None else float(softcap),
        loss_shape=loss_shape,
        weight_shape=tuple(linear_weight.shape),
    )
