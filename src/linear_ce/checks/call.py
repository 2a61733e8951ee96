"""Argument checking and shape normalisation shared by every entry point.

Everything here runs before any arithmetic: a bad call fails with a message
that starts with the public function the user called and names the argument (as
that function calls it, see :class:`Caller`), what it got and what was expected.

Each check covers one concern (tensor types and devices, scalar options, shapes
and the K dimensions, targets, class and token weights) so that an entry point
composes the ones it needs; :func:`check_call` composes all of them for
:func:`linear_ce.linear_cross_entropy` and its vocab-parallel twin.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, NoReturn, TypeVar

import torch

from linear_ce.engine.transform import LogitTransform

__all__ = [
    "PER_TOKEN",
    "Call",
    "Caller",
    "HeadArguments",
    "LossArguments",
    "Shapes",
    "TransformArguments",
    "check_call",
    "check_class_weight",
    "check_devices",
    "check_flags",
    "check_ignore_index",
    "check_k_dim",
    "check_label_smoothing",
    "check_linear_bias",
    "check_matching_dtypes",
    "check_not_vmapped",
    "check_reduction",
    "check_scale",
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
    "gathered",
    "shifted_target",
    "to_rows",
]

REDUCTIONS = ("mean", "sum", "none")
#: How ``top1`` treats a tie at the maximum (see :mod:`linear_ce.losses.token_logprob`).
TOP1_RULES = ("unique", "argmax")
DEFAULT_IGNORE_INDEX = -100
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Class indices in any integer dtype torch's cross_entropy takes (int64, uint8) or that
# saves memory (int32 holds any vocabulary; int16/int8 a small one). A dtype that cannot
# hold ignore_index is widened (see _widened_target).
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
    :func:`check_scale`) complete the logits transform. ``name``
    is the public function the call was checked for, which later errors (a class
    index out of range, found inside the op) also name.
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
    name: str = "linear_cross_entropy"

    @property
    def transform(self) -> LogitTransform:
        """The logits transform of this call (:mod:`linear_ce.engine.transform`)."""
        return LogitTransform(self.logit_scale, self.softcap, self.temperature)


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


@dataclasses.dataclass(frozen=True)
class Caller:
    """Whom a check speaks for: the public function the user called and, where that
    function names an argument otherwise, its name for it (``linear_divergence`` calls
    the checked ``input`` ``student_input``). Every message starts with ``function``
    and names arguments through :meth:`arg`, so the user reads their own words."""

    function: str
    renamed: tuple[tuple[str, str], ...] = ()

    def arg(self, name: str) -> str:
        """The caller's name for the checked argument ``name``."""
        return dict(self.renamed).get(name, name)

    def fail(self, message: str) -> NoReturn:
        raise ValueError(f"{self.function}: {message}")


def _caller(name: str, renamed: Mapping[str, str] | None) -> Caller:
    return Caller(name, tuple((renamed or {}).items()))


def _is_real(value: object) -> bool:
    """A Python int or float, not a bool (``True`` is an ``int`` but never a sensible scalar)."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_tensor_types(
    caller: Caller, required: dict[str, object], optional: dict[str, object] | None = None
) -> None:
    """Every ``required`` value is a Tensor; every ``optional`` one a Tensor or ``None``."""
    for name, value in required.items():
        if not isinstance(value, torch.Tensor):
            caller.fail(f"{caller.arg(name)} must be a Tensor, got {type(value).__name__}")
    for name, value in (optional or {}).items():
        if value is not None and not isinstance(value, torch.Tensor):
            caller.fail(f"{caller.arg(name)} must be a Tensor or None, got {type(value).__name__}")


def check_devices(caller: Caller, tensors: dict[str, torch.Tensor | None]) -> None:
    """All the given (non-``None``) tensors live on one device."""
    devices = {name: value.device for name, value in tensors.items() if value is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{caller.arg(name)} on {device}" for name, device in devices.items())
        caller.fail(f"all tensors must be on one device, got {listing}")


def check_reduction(caller: Caller, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        caller.fail(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_label_smoothing(caller: Caller, label_smoothing: float) -> None:
    if not _is_real(label_smoothing):
        caller.fail(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        caller.fail(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def check_z_loss(caller: Caller, z_loss: float) -> None:
    if not _is_real(z_loss) or not 0.0 <= z_loss < math.inf:
        caller.fail(f"z_loss must be a finite float >= 0, got {z_loss!r}")


def check_softcap(caller: Caller, softcap: float | None, arg: str = "softcap") -> None:
    """``softcap`` (the argument the caller names ``arg``) is ``None`` or a finite float > 0."""
    if softcap is not None and (not _is_real(softcap) or not 0.0 < softcap < math.inf):
        caller.fail(f"{caller.arg(arg)} must be None or a finite float > 0, got {softcap!r}")


def check_scale(caller: Caller, arg: str, value: float) -> None:
    """A logits scale or temperature (the argument the caller names ``arg``) is a finite
    float > 0."""
    if not _is_real(value) or not 0.0 < value < math.inf:
        caller.fail(f"{caller.arg(arg)} must be a finite float > 0, got {value!r}")


def check_ignore_index(caller: Caller, ignore_index: int | None) -> None:
    if ignore_index is None:
        return
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        caller.fail(f"ignore_index must be an int or None, got {ignore_index!r}")
    if not _fits(ignore_index, torch.int64):
        caller.fail(f"ignore_index must fit in int64, got {ignore_index}")


def _fits(value: int, dtype: torch.dtype) -> bool:
    bounds = torch.iinfo(dtype)
    return bounds.min <= value <= bounds.max


def _widened_target(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Class indices as int64 where their dtype cannot hold ``ignore_index``: compared in
    the narrower dtype it would wrap onto a class (-100 is class 156 in uint8) and that
    class would be ignored without a word. Otherwise ``target`` itself."""
    return target if _fits(ignore_index, target.dtype) else target.long()


def check_shift(caller: Caller, shift: bool | int) -> int:
    """The label shift as an int (``True`` is 1)."""
    if isinstance(shift, bool):
        shift = int(shift)
    if not isinstance(shift, int) or shift < 0:
        caller.fail(f"shift must be a bool or an int >= 0, got {shift!r}")
    return shift


def check_matching_dtypes(caller: Caller, input: torch.Tensor, linear_weight: torch.Tensor) -> None:
    """``input`` is floating and ``linear_weight`` has its dtype."""
    x, w = caller.arg("input"), caller.arg("linear_weight")
    if input.dtype not in _FLOAT_DTYPES:
        caller.fail(
            f"{x} must be a floating tensor (float16/bfloat16/float32/float64), got {input.dtype}"
        )
    if linear_weight.dtype != input.dtype:
        # autocast does not cast our arguments (the op runs in the dtype it is given),
        # so a bf16 hidden state meeting an fp32 lm_head under autocast lands here.
        hint = (
            f" (under torch.autocast {caller.function} is not autocast: it runs in the "
            "dtype of its arguments)"
            if input.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(input.device.type)
            else ""
        )
        caller.fail(
            f"{w} dtype {linear_weight.dtype} differs from {x} dtype {input.dtype}; "
            f"cast one of them so both match{hint}"
        )


def check_shapes(
    caller: Caller,
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    num_classes: int | None = None,
) -> Shapes:
    """The ranks of ``input`` and ``linear_weight``, their shared ``in_features`` and at
    least one class; ``num_classes=None`` means ``linear_weight.shape[0]``."""
    x, w = caller.arg("input"), caller.arg("linear_weight")
    if input.dim() < 1:
        caller.fail(
            f"{x} must have shape (*, in_features) with at least 1 dimension, got a 0-d tensor"
        )
    if linear_weight.dim() < 2:
        caller.fail(
            f"{w} must have shape (num_classes, in_features) or "
            f"(num_classes, d1, ..., dK, in_features), got shape {tuple(linear_weight.shape)}"
        )
    in_features = input.shape[-1]
    if linear_weight.shape[-1] != in_features:
        caller.fail(
            f"in_features mismatch: {x} has {in_features} features (last dimension) but "
            f"{w} has {linear_weight.shape[-1]} (shape {tuple(linear_weight.shape)})"
        )
    local_classes = linear_weight.shape[0]
    if local_classes == 0:
        caller.fail(f"{w} must have at least one class, got shape {tuple(linear_weight.shape)}")
    return Shapes(
        batch=tuple(input.shape[:-1]),
        in_features=in_features,
        local_classes=local_classes,
        num_classes=local_classes if num_classes is None else num_classes,
        out_features=tuple(linear_weight.shape[1:-1]),
    )


def check_linear_bias(
    caller: Caller, linear_bias: torch.Tensor | None, shapes: Shapes, dtype: torch.dtype
) -> None:
    """The bias, when given, is ``(local_classes, *out_features)`` in the input's dtype."""
    if linear_bias is None:
        return
    b = caller.arg("linear_bias")
    expected = (shapes.local_classes, *shapes.out_features)
    if tuple(linear_bias.shape) != expected:
        caller.fail(
            f"{b} must have shape {expected} (num_classes, "
            f"*out_features), got {tuple(linear_bias.shape)}"
        )
    if linear_bias.dtype != dtype:
        caller.fail(
            f"{b} dtype {linear_bias.dtype} differs from {caller.arg('input')} dtype {dtype}"
        )


def check_k_dim(
    caller: Caller, shapes: Shapes, input: torch.Tensor, linear_weight: torch.Tensor
) -> None:
    """A K-dimensional loss (``out_features`` not empty) needs a batch dimension."""
    if shapes.out_features and not shapes.batch:
        caller.fail(
            f"K-dimensional loss ({caller.arg('linear_weight')} shape "
            f"{tuple(linear_weight.shape)}) needs batched {caller.arg('input')} "
            f"(N, {shapes.in_features}), got shape {tuple(input.shape)}"
        )


def _check_probability_target(
    caller: Caller, target: torch.Tensor, dtype: torch.dtype, ignore_index: int | None, shift: int
) -> None:
    if target.dtype != dtype:
        caller.fail(
            f"probability target dtype {target.dtype} differs from {caller.arg('input')} "
            f"dtype {dtype}"
        )
    if ignore_index is not None:
        caller.fail(
            "ignore_index cannot be used with probability targets (target of shape "
            f"{tuple(target.shape)}); pass ignore_index=None"
        )
    if shift:
        caller.fail("shift needs class-index targets; shift probability targets yourself")
    if target.requires_grad:
        caller.fail(
            "a probability target that requires grad is not supported: the loss is "
            "not differentiated with respect to target; pass target.detach()"
        )


def _check_index_target(caller: Caller, target: torch.Tensor, shapes: Shapes) -> None:
    if target.is_floating_point():
        caller.fail(
            f"a floating target is read as class probabilities and must have the logits' "
            f"shape {shapes.logits} (*batch, num_classes, *out_features), got "
            f"{tuple(target.shape)}; class-index targets must be integers of shape {shapes.loss}"
        )
    if target.dtype not in _INDEX_DTYPES:
        caller.fail(
            "class-index target must be an integer tensor (int64, int32, int16, int8 or "
            f"uint8), got {target.dtype}"
        )
    if tuple(target.shape) != shapes.loss:
        caller.fail(
            f"class-index target must have shape {shapes.loss} ({caller.arg('input')}'s batch "
            f"shape {shapes.batch} then out_features {shapes.out_features}), got "
            f"{tuple(target.shape)}"
        )


def check_target(
    caller: Caller,
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
        _check_probability_target(caller, target, dtype, ignore_index, shift)
    else:
        _check_index_target(caller, target, shapes)
    return probability_target


def check_class_weight(
    caller: Caller, weight: torch.Tensor | None, num_classes: int, dtype: torch.dtype
) -> None:
    """Class weights, when given, are ``(num_classes,)`` in the input's dtype, without grad."""
    if weight is None:
        return
    if tuple(weight.shape) != (num_classes,):
        caller.fail(
            f"weight (class weights) must have shape ({num_classes},), got {tuple(weight.shape)}"
        )
    if weight.dtype != dtype:
        caller.fail(
            f"weight (class weights) must have the {caller.arg('input')}'s dtype {dtype}, "
            f"got {weight.dtype}"
        )
    if weight.requires_grad:
        caller.fail(
            "weight (class weights) that requires grad is not supported: the loss is not "
            "differentiated with respect to class weights; pass weight.detach()"
        )


def check_token_weight(
    caller: Caller, token_weight: torch.Tensor | None, loss_shape: tuple[int, ...]
) -> None:
    """Token weights, when given, are floating, of the per-token loss shape, without grad."""
    if token_weight is None:
        return
    if tuple(token_weight.shape) != loss_shape:
        caller.fail(
            f"token_weight must have the per-token loss shape {loss_shape}, got "
            f"{tuple(token_weight.shape)}"
        )
    if not token_weight.is_floating_point():
        caller.fail(f"token_weight must be a floating tensor, got {token_weight.dtype}")
    if token_weight.requires_grad:
        caller.fail("token_weight that requires grad is not supported; pass token_weight.detach()")


def check_shift_shape(caller: Caller, shift: int, shapes: Shapes) -> None:
    """A label shift needs a sequence (last batch) dimension and no K dimensions."""
    if shift and not shapes.batch:
        caller.fail(
            f"shift needs {caller.arg('input')} of shape (..., T, in_features) with a "
            "sequence dimension"
        )
    if shift and shapes.out_features:
        caller.fail("shift cannot be combined with K-dimensional loss")


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
    probability_target: bool,
    *tensors: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """``tensors``, ``(input, linear_weight, target, linear_bias, token_weight)``, reshaped
    to the row layout of :class:`Call` (views where the caller's layout allows)."""
    input, linear_weight, target, linear_bias, token_weight = tensors
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


class HeadArguments(NamedTuple):
    """A call's head and rows as its public function received them (unchecked), in the
    order of the public signatures; :func:`check_call` (:func:`check_token_call` for a
    per-token call) checks them. A function without ``shift``
    (:func:`linear_ce.token_logprobs_vjp`) leaves it ``False``."""

    input: torch.Tensor
    linear_weight: torch.Tensor
    target: torch.Tensor
    linear_bias: torch.Tensor | None
    ignore_index: int | None
    shift: bool | int = False

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors, by their names (for :func:`linear_ce.parallel.shard.vocab_shard`)."""
        return {
            "input": self.input,
            "linear_weight": self.linear_weight,
            "target": self.target,
            "linear_bias": self.linear_bias,
        }


class TransformArguments(NamedTuple):
    """A call's logits transform as its public function received it (unchecked); checked,
    it is the call's :class:`~linear_ce.engine.transform.LogitTransform`."""

    temperature: float
    logit_scale: float
    softcap: float | None


class LossArguments(NamedTuple):
    """A cross-entropy call's loss terms as its public function received them (unchecked),
    in the order of its signature. A per-token call has none: :data:`PER_TOKEN`."""

    weight: torch.Tensor | None
    reduction: str
    label_smoothing: float
    z_loss: float
    token_weight: torch.Tensor | None


#: The loss terms of a per-token call: one unweighted, unsmoothed loss per token.
PER_TOKEN = LossArguments(None, "none", 0.0, 0.0, None)

_Group = TypeVar("_Group", bound=tuple)


def gathered(
    group: type[_Group], arguments: Mapping[str, Any], renamed: Mapping[str, str] | None = None
) -> _Group:
    """A ``group`` of a call's arguments (a ``NamedTuple`` such as :class:`HeadArguments`),
    from its public function's ``arguments`` by name, as DTensor dispatch hands them over;
    ``renamed`` maps a field to the function's name for it."""
    renamed = renamed or {}
    return group(*(arguments[renamed.get(field, field)] for field in group._fields))


def check_call(
    name: str,
    head: HeadArguments,
    transform: TransformArguments,
    loss: LossArguments,
    *,
    num_classes: int | None = None,
    renamed: Mapping[str, str] | None = None,
) -> Call:
    """Validate a ``linear_cross_entropy`` call (its ``head`` and rows, logits
    ``transform`` and ``loss`` terms) and reshape it to rows (see :class:`Call`).

    ``num_classes`` is the whole vocabulary's ``C`` when ``linear_weight`` (and
    ``linear_bias``) hold a vocab-parallel shard of it (:mod:`linear_ce.distributed`):
    class weights and probability targets are checked against it, the bias
    against the shard. ``None`` means ``linear_weight.shape[0]``. Errors start with
    ``name``, the public function called, and give each argument the name ``renamed``
    maps it to (see :class:`Caller`).
    """
    caller = _caller(name, renamed)
    input, linear_weight, target, linear_bias, ignore_index, shift = head
    weight, reduction, label_smoothing, z_loss, token_weight = loss
    tensors = {"input": input, "linear_weight": linear_weight, "target": target}
    extras = {"linear_bias": linear_bias, "weight": weight, "token_weight": token_weight}
    check_tensor_types(caller, tensors, extras)
    check_reduction(caller, reduction)
    check_label_smoothing(caller, label_smoothing)
    check_z_loss(caller, z_loss)
    check_softcap(caller, transform.softcap)
    check_ignore_index(caller, ignore_index)
    shift = check_shift(caller, shift)

    check_matching_dtypes(caller, input, linear_weight)
    shapes = check_shapes(caller, input, linear_weight, num_classes)
    check_devices(caller, {**tensors, **extras})
    check_linear_bias(caller, linear_bias, shapes, input.dtype)
    check_k_dim(caller, shapes, input, linear_weight)
    probability_target = check_target(caller, target, shapes, input.dtype, ignore_index, shift)
    check_class_weight(caller, weight, shapes.num_classes, input.dtype)
    check_token_weight(caller, token_weight, shapes.loss)
    check_shift_shape(caller, shift, shapes)
    check_scale(caller, "logit_scale", transform.logit_scale)
    check_scale(caller, "temperature", transform.temperature)

    resolved_ignore = DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index
    if not probability_target:
        target = _widened_target(target, resolved_ignore)
    if shift:
        target = shifted_target(target, shift, resolved_ignore)
    flat_input, flat_weight, flat_target, flat_bias, flat_token_weight = to_rows(
        shapes, probability_target, input, linear_weight, target, linear_bias, token_weight
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
        softcap=None if transform.softcap is None else float(transform.softcap),
        loss_shape=shapes.loss,
        weight_shape=tuple(linear_weight.shape),
        logit_scale=float(transform.logit_scale),
        temperature=float(transform.temperature),
        name=name,
    )


def check_token_call(
    name: str,
    head: HeadArguments,
    transform: TransformArguments,
    *,
    flags: Mapping[str, object] | None = None,
    num_classes: int | None = None,
    renamed: Mapping[str, str] | None = None,
) -> Call:
    """Validate a per-token call (``token_logprobs``, ``token_objective``, on a whole head
    or a vocab-parallel shard; errors name ``name`` and the arguments as ``renamed`` maps
    them): integer token ids, a 2-D head, an int ``ignore_index``, bool ``flags``, then
    :func:`check_call` with ``reduction="none"`` and the logits transform."""
    caller = _caller(name, renamed)
    linear_weight, target, ignore_index = head.linear_weight, head.target, head.ignore_index
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        got = target.dtype if isinstance(target, torch.Tensor) else type(target).__name__
        caller.fail(f"target must be an integer tensor of token ids, got {got}")
    if not isinstance(linear_weight, torch.Tensor) or linear_weight.dim() != 2:
        got = getattr(linear_weight, "shape", type(linear_weight).__name__)
        got = tuple(got) if isinstance(got, torch.Size) else got
        caller.fail(f"{caller.arg('linear_weight')} must have shape (V, in_features), got {got}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        caller.fail(f"ignore_index must be an int, got {ignore_index!r}")
    check_flags(caller, flags or {})
    return check_call(name, head, transform, PER_TOKEN, num_classes=num_classes, renamed=renamed)


def check_flags(caller: Caller, flags: Mapping[str, object]) -> None:
    """Every one of ``flags`` (an argument's name and value) is a bool."""
    for flag, value in flags.items():
        if not isinstance(value, bool):
            caller.fail(f"{flag} must be a bool, got {value!r}")


def check_not_vmapped(caller: Caller, tensors: Mapping[str, object], advice: str) -> None:
    """None of ``tensors`` is batched by ``torch.func.vmap`` (under any other functorch
    transform's wrapper): a function that runs a Python callable over chunks of the
    valid tokens cannot run per sample, where the chunks' counts would be data; ``advice``
    says what to do instead."""
    functorch = torch._C._functorch
    for arg, value in tensors.items():
        while isinstance(value, torch.Tensor) and functorch.is_functorch_wrapped_tensor(value):
            if functorch.is_batchedtensor(value):
                caller.fail(
                    f"{caller.arg(arg)} is batched by torch.func.vmap, which "
                    f"{caller.function} does not support; {advice}"
                )
            value = functorch.get_unwrapped(value)


def check_top1_rule(name: str, top1_rule: str) -> None:
    """``top1_rule`` must be ``"unique"`` or ``"argmax"``; errors name ``name``."""
    if top1_rule not in TOP1_RULES:
        raise ValueError(f"{name}: top1_rule must be one of {TOP1_RULES}, got {top1_rule!r}")
