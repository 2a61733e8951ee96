"""Argument checking and shape normalisation shared by every entry point.

Everything here runs before any arithmetic: a bad call fails with a message
that names the argument, what it got and what was expected.

Each check covers one concern (tensor types and devices, scalar options, shapes
and the K dimensions, targets, class and token weights) so that an entry point
composes the ones it needs; :func:`check_call` composes all of them for
:func:`linear_ce.linear_cross_entropy` and its vocab-parallel twin.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NoReturn

import torch

from linear_ce.engine.transform import LogitTransform, check_scales

__all__ = [
    "Call",
    "Shapes",
    "check_call",
    "check_class_weight",
    "check_devices",
    "check_ignore_index",
    "check_k_dim",
    "check_label_smoothing",
    "check_linear_bias",
    "check_matching_dtypes",
    "check_reduction",
    "check_shapes",
    "check_shift",
    "check_shift_shape",
    "check_softcap",
    "check_target",
    "check_tensor_types",
    "check_token_call",
    "check_token_weight",
    "check_top1_rule",
    "check_z_loss",
    "shifted_target",
    "to_rows",
    "with_scales",
]

REDUCTIONS = ("mean", "sum", "none")
#: How ``top1`` treats a tie at the maximum (see :mod:`linear_ce.losses.token_logprob`).
TOP1_RULES = ("unique", "argmax")
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
    :func:`linear_ce.engine.transform.check_scales`) complete the logits transform.
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
        """The logits transform of this call (:mod:`linear_ce.engine.transform`)."""
        return LogitTransform(self.logit_scale, self.softcap, self.temperature)


def with_scales(call: Call, logit_scale: float, temperature: float) -> Call:
    """``call`` with the logits transform's ``logit_scale`` and ``temperature`` set.

    Written out rather than ``dataclasses.replace``, which torch 2.6's Dynamo cannot
    trace on a ``Call`` (``hasattr`` of the dataclass fields on its class)."""
    fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}
    fields.update(logit_scale=float(logit_scale), temperature=float(temperature))
    return Call(**fields)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The shapes of a call before flattening: ``input`` is ``(*batch, in_features)``,
    ``linear_weight`` ``(local_classes, *out_features, in_features)``; ``num_classes``
    is the whole vocabulary (``local_classes`` unless the weight is a vocab shard)."""

    batch: tuple[int, ...]
    in_features: int
    local_classes: int
    num_classes: int
    out_features: tuple[int, ...]

    @property
    def logits(self) -> tuple[int, ...]:
        """``(*batch, num_classes, *out_features)``, also the probability target's shape."""
        return (*self.batch, self.num_classes, *self.out_features)

    @property
    def loss(self) -> tuple[int, ...]:
        """``(*batch, *out_features)``: per-token losses, class-index targets, token weights."""
        return (*self.batch, *self.out_features)


def _fail(message: str) -> NoReturn:
    raise ValueError(f"linear_cross_entropy: {message}")


def _is_real(value: object) -> bool:
    """A Python int or float, not a bool (``True`` is an ``int`` but never a sensible scalar)."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_tensor_types(
    required: dict[str, object], optional: dict[str, object] | None = None
) -> None:
    """Every ``required`` value is a Tensor; every ``optional`` one a Tensor or ``None``."""
    for name, value in required.items():
        if not isinstance(value, torch.Tensor):
            _fail(f"{name} must be a Tensor, got {type(value).__name__}")
    for name, value in (optional or {}).items():
        if value is not None and not isinstance(value, torch.Tensor):
            _fail(f"{name} must be a Tensor or None, got {type(value).__name__}")


def check_devices(tensors: dict[str, torch.Tensor | None]) -> None:
    """All the given (non-``None``) tensors live on one device."""
    devices = {name: value.device for name, value in tensors.items() if value is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        _fail(f"all tensors must be on one device, got {listing}")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        _fail(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_label_smoothing(label_smoothing: float) -> None:
    if not _is_real(label_smoothing):
        _fail(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        _fail(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def check_z_loss(z_loss: float) -> None:
    if not _is_real(z_loss) or not 0.0 <= z_loss < math.inf:
        _fail(f"z_loss must be a finite float >= 0, got {z_loss!r}")


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and (not _is_real(softcap) or not 0.0 < softcap < math.inf):
        _fail(f"softcap must be None or a finite float > 0, got {softcap!r}")


def check_ignore_index(ignore_index: int | None) -> None:
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
    ):
        _fail(f"ignore_index must be an int or None, got {ignore_index!r}")


def check_shift(shift: bool | int) -> int:
    """The label shift as an int (``True`` is 1)."""
    if isinstance(shift, bool):
        shift = int(shift)
    if not isinstance(shift, int) or shift < 0:
        _fail(f"shift must be a bool or an int >= 0, got {shift!r}")
    return shift


def check_matching_dtypes(input: torch.Tensor, linear_weight: torch.Tensor) -> None:
    """``input`` is floating and ``linear_weight`` has its dtype."""
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


def check_shapes(
    input: torch.Tensor, linear_weight: torch.Tensor, num_classes: int | None = None
) -> Shapes:
    """The ranks of ``input`` and ``linear_weight``, their shared ``in_features`` and at
    least one class; ``num_classes=None`` means ``linear_weight.shape[0]``."""
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
    return Shapes(
        batch=tuple(input.shape[:-1]),
        in_features=in_features,
        local_classes=local_classes,
        num_classes=local_classes if num_classes is None else num_classes,
        out_features=tuple(linear_weight.shape[1:-1]),
    )


def check_linear_bias(linear_bias: torch.Tensor | None, shapes: Shapes, dtype: torch.dtype) -> None:
    """The bias, when given, is ``(local_classes, *out_features)`` in the input's dtype."""
    if linear_bias is None:
        return
    expected = (shapes.local_classes, *shapes.out_features)
    if tuple(linear_bias.shape) != expected:
        _fail(
            f"linear_bias must have shape {expected} (num_classes, "
            f"*out_features), got {tuple(linear_bias.shape)}"
        )
    if linear_bias.dtype != dtype:
        _fail(f"linear_bias dtype {linear_bias.dtype} differs from input dtype {dtype}")


def check_k_dim(shapes: Shapes, input: torch.Tensor, linear_weight: torch.Tensor) -> None:
    """A K-dimensional loss (``out_features`` not empty) needs a batch dimension."""
    if shapes.out_features and not shapes.batch:
        _fail(
            f"K-dimensional loss (linear_weight shape {tuple(linear_weight.shape)}) needs batched "
            f"input (N, {shapes.in_features}), got shape {tuple(input.shape)}"
        )


def _check_probability_target(
    target: torch.Tensor, dtype: torch.dtype, ignore_index: int | None, shift: int
) -> None:
    if target.dtype != dtype:
        _fail(f"probability target dtype {target.dtype} differs from input dtype {dtype}")
    if ignore_index is not None:
        _fail(
            "ignore_index cannot be used with probability targets (target of shape "
            f"{tuple(target.shape)}); pass ignore_index=None"
        )
    if shift:
        _fail("shift needs class-index targets; shift probability targets yourself")
    if target.requires_grad:
        _fail(
            "a probability target that requires grad is not supported: the loss is "
            "not differentiated with respect to target; pass target.detach()"
        )


def _check_index_target(target: torch.Tensor, shapes: Shapes) -> None:
    if target.is_floating_point():
        _fail(
            f"a floating target is read as class probabilities and must have the logits' "
            f"shape {shapes.logits} (*batch, num_classes, *out_features), got "
            f"{tuple(target.shape)}; class-index targets must be integers of shape {shapes.loss}"
        )
    if target.dtype not in _INDEX_DTYPES:
        _fail(f"class-index target must be an integer tensor (int64 or int32), got {target.dtype}")
    if tuple(target.shape) != shapes.loss:
        _fail(
            f"class-index target must have shape {shapes.loss} (input's batch shape "
            f"{shapes.batch} then out_features {shapes.out_features}), got {tuple(target.shape)}"
        )


def check_target(
    target: torch.Tensor,
    shapes: Shapes,
    dtype: torch.dtype,
    ignore_index: int | None,
    shift: int,
) -> bool:
    """Check ``target`` and say whether it holds class probabilities (a floating tensor of
    the logits' shape) rather than class indices (integers of the loss shape)."""
    probability_target = target.is_floating_point() and tuple(target.shape) == shapes.logits
    if probability_target:
        _check_probability_target(target, dtype, ignore_index, shift)
    else:
        _check_index_target(target, shapes)
    return probability_target


def check_class_weight(weight: torch.Tensor | None, num_classes: int, dtype: torch.dtype) -> None:
    """Class weights, when given, are ``(num_classes,)`` in the input's dtype, without grad."""
    if weight is None:
        return
    if tuple(weight.shape) != (num_classes,):
        _fail(f"weight (class weights) must have shape ({num_classes},), got {tuple(weight.shape)}")
    if weight.dtype != dtype:
        _fail(f"weight (class weights) must have the input's dtype {dtype}, got {weight.dtype}")
    if weight.requires_grad:
        _fail(
            "weight (class weights) that requires grad is not supported: the loss is not "
            "differentiated with respect to class weights; pass weight.detach()"
        )


def check_token_weight(token_weight: torch.Tensor | None, loss_shape: tuple[int, ...]) -> None:
    """Token weights, when given, are floating, of the per-token loss shape, without grad."""
    if token_weight is None:
        return
    if tuple(token_weight.shape) != loss_shape:
        _fail(
            f"token_weight must have the per-token loss shape {loss_shape}, got "
            f"{tuple(token_weight.shape)}"
        )
    if not token_weight.is_floating_point():
        _fail(f"token_weight must be a floating tensor, got {token_weight.dtype}")
    if token_weight.requires_grad:
        _fail("token_weight that requires grad is not supported; pass token_weight.detach()")


def check_shift_shape(shift: int, shapes: Shapes) -> None:
    """A label shift needs a sequence (last batch) dimension and no K dimensions."""
    if shift and not shapes.batch:
        _fail("shift needs input of shape (..., T, in_features) with a sequence dimension")
    if shift and shapes.out_features:
        _fail("shift cannot be combined with K-dimensional loss")


def shifted_target(target: torch.Tensor, shift: int, ignore_index: int) -> torch.Tensor:
    """Labels moved ``shift`` places left along the sequence (last leading) dimension,
    the vacated positions set to ``ignore_index``; the hidden states stay untouched."""
    length = target.shape[-1]
    out = torch.full_like(target, ignore_index)
    if shift < length:
        out[..., : length - shift] = target[..., shift:]
    return out


def to_rows(
    shapes: Shapes,
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    linear_bias: torch.Tensor | None,
    token_weight: torch.Tensor | None,
    probability_target: bool,
) -> tuple[torch.Tensor, ...]:
    """``(input, linear_weight, target, linear_bias, token_weight)`` reshaped to the
    row layout of :class:`Call` (views where the caller's layout allows)."""
    rows = math.prod(shapes.batch)
    positions = math.prod(shapes.out_features)
    if probability_target:
        flat_target = target.reshape(rows, shapes.num_classes, positions)
    else:
        flat_target = target.reshape(rows, positions)
    return (
        input.reshape(rows, shapes.in_features),
        linear_weight.reshape(shapes.local_classes, positions, shapes.in_features),
        flat_target,
        None if linear_bias is None else linear_bias.reshape(shapes.local_classes, positions),
        None if token_weight is None else token_weight.reshape(rows, positions),
    )


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
    tensors = {"input": input, "linear_weight": linear_weight, "target": target}
    extras = {"linear_bias": linear_bias, "weight": weight, "token_weight": token_weight}
    check_tensor_types(tensors, extras)
    check_reduction(reduction)
    check_label_smoothing(label_smoothing)
    check_z_loss(z_loss)
    check_softcap(softcap)
    check_ignore_index(ignore_index)
    shift = check_shift(shift)

    check_matching_dtypes(input, linear_weight)
    shapes = check_shapes(input, linear_weight, num_classes)
    check_devices({**tensors, **extras})
    check_linear_bias(linear_bias, shapes, input.dtype)
    check_k_dim(shapes, input, linear_weight)
    probability_target = check_target(target, shapes, input.dtype, ignore_index, shift)
    check_class_weight(weight, shapes.num_classes, input.dtype)
    check_token_weight(token_weight, shapes.loss)
    check_shift_shape(shift, shapes)

    resolved_ignore = DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index
    if shift:
        target = shifted_target(target, shift, resolved_ignore)
    flat_input, flat_weight, flat_target, flat_bias, flat_token_weight = to_rows(
        shapes, input, linear_weight, target, linear_bias, token_weight, probability_target
    )
    return Call(
        input=flat_input,
        linear_weight=flat_weight,
        target=flat_target,
        linear_bias=flat_bias,
        class_weight=weight,
        token_weight=flat_token_weight,
        probability_target=probability_target,
        reduction=reduction,
        ignore_index=resolved_ignore,
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        softcap=None if softcap is None else float(softcap),
        loss_shape=shapes.loss,
        weight_shape=tuple(linear_weight.shape),
    )


def check_token_call(
    name: str,
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None,
    ignore_index: int,
    shift: bool | int,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    flags: dict[str, object],
    num_classes: int | None = None,
) -> Call:
    """Validate a per-token call (``token_logprobs``, ``token_objective`` and their
    vocab-parallel forms; errors name ``name``): integer token ids, a 2-D head, an int
    ``ignore_index``, bool ``flags``, then :func:`check_call` with ``reduction="none"``
    and the logits transform."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        got = target.dtype if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"{name}: target must be an integer tensor of token ids, got {got}")
    if not isinstance(linear_weight, torch.Tensor) or linear_weight.dim() != 2:
        got = getattr(linear_weight, "shape", type(linear_weight).__name__)
        got = tuple(got) if isinstance(got, torch.Size) else got
        raise ValueError(f"{name}: linear_weight must have shape (V, in_features), got {got}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"{name}: ignore_index must be an int, got {ignore_index!r}")
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}: {flag} must be a bool, got {value!r}")
    call = check_call(
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        weight=None,
        reduction="none",
        ignore_index=ignore_index,
        label_smoothing=0.0,
        softcap=softcap,
        shift=shift,
        num_classes=num_classes,
    )
    check_scales(name, logit_scale, temperature)
    return with_scales(call, logit_scale, temperature)


def check_top1_rule(name: str, top1_rule: str) -> None:
    """``top1_rule`` must be ``"unique"`` or ``"argmax"``; errors name ``name``."""
    if top1_rule not in TOP1_RULES:
        raise ValueError(f"{name}: top1_rule must be one of {TOP1_RULES}, got {top1_rule!r}")
