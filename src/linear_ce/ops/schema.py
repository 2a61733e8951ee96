"""One structure per custom op: its arguments, described once.

An op's arguments are the fields of a ``NamedTuple``, in order (a default is the op
argument's default). A field whose type is a *group* (a ``NamedTuple`` or dataclass of
argument types: the plan's options, the gradients wanted, the outputs asked for) stands
for the group's own fields, named ``<field>_<member>`` in the op's schema; one whose type
has a flat form (``as_list`` and ``from_list``: the logits transform) is one ``float[]``
argument. From that one structure :class:`OpSchema` builds the op's signature (torch
infers the schema from it), hands the kernel, the fake and ``setup_context`` the
structure again (rebuilt from the flat arguments), keeps it for backward
(:meth:`OpSchema.save`), reruns the op in backward (:meth:`OpSchema.recompute`) and lists
backward's gradients (:meth:`OpSchema.gradients`). The first three arguments of every op
are ``input``, ``linear_weight`` and ``linear_bias``, the only ones with a gradient; its
last three outputs are their gradients.

Example::

    class Arguments(NamedTuple):
        input: torch.Tensor
        linear_weight: torch.Tensor
        linear_bias: torch.Tensor | None
        transform: LogitTransform  # one float[] argument
        needs: Needs  # needs_input, needs_weight, needs_bias

    SCHEMA = OpSchema(Arguments)
    op = SCHEMA.define("my_head", outputs=4, kernel=run, fake=shapes)
    op(*SCHEMA.flatten(Arguments(x, W, None, LogitTransform(), Needs(True, True, False))))
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch._library.custom_ops import CustomOpDef

from linear_ce.engine.chunk_loop import Gradients, Needs, run_head
from linear_ce.engine.vocab import Vocab
from linear_ce.options import LinearCrossEntropyOptions

__all__ = ["OpSchema", "PlanOptions", "run_head_on"]

ArgumentsT = TypeVar("ArgumentsT", bound=tuple)

#: The arguments every op starts with, in this order: the ones that get a gradient.
DIFFERENTIABLE = ("input", "linear_weight", "linear_bias")


class PlanOptions(NamedTuple):
    """What the plan reads of :class:`~linear_ce.options.LinearCrossEntropyOptions`, as op
    arguments (``allow_retain_graph`` is the scalar ops' own argument)."""

    batch_chunk_size: int | None
    chunking_method: str | None
    acc_policy: str
    acc_dtype: torch.dtype | None

    @classmethod
    def of(cls, options: LinearCrossEntropyOptions) -> PlanOptions:
        return cls(*(getattr(options, name) for name in cls._fields))

    def as_options(self) -> LinearCrossEntropyOptions:
        return LinearCrossEntropyOptions(**self._asdict())


def run_head_on(
    args: Any,
    head: Any,
    options: LinearCrossEntropyOptions,
    vocab: Vocab,
    needs: Needs,
    **named: Any,
) -> Gradients:
    """:func:`~linear_ce.engine.chunk_loop.run_head` of ``head`` on an op's arguments
    ``args``: their ``input``, ``linear_weight``, ``linear_bias`` and ``transform``
    (``named``: its ``companion``, ``grad_scale`` and ``share``)."""
    return run_head(
        args.input,
        args.linear_weight,
        args.linear_bias,
        head,
        args.transform,
        options,
        vocab,
        needs,
        **named,
    )


@functools.cache
def _fields(structure: type) -> tuple[tuple[str, Any], ...]:
    """``(name, type)`` of each field of a ``NamedTuple`` or dataclass, in order (read once
    per type: every op call rebuilds its structure)."""
    hints = typing.get_type_hints(structure)
    if dataclasses.is_dataclass(structure):
        names = [field.name for field in dataclasses.fields(structure)]
    else:
        names = list(structure._fields)
    return tuple((name, hints[name]) for name in names)


def _is_flat(annotation: object) -> bool:
    return isinstance(annotation, type) and hasattr(annotation, "from_list")


def _is_group(annotation: object) -> bool:
    return (
        isinstance(annotation, type)
        and not _is_flat(annotation)
        and (
            dataclasses.is_dataclass(annotation)
            or (issubclass(annotation, tuple) and hasattr(annotation, "_fields"))
        )
    )


def _leaves(
    structure: type, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """``(path, type, default)`` of each op argument of ``structure``, in order."""
    defaults = getattr(structure, "_field_defaults", {})
    for field, hint in _fields(structure):
        if _is_group(hint):
            yield from _leaves(hint, (*path, field))
        else:
            yield (*path, field), hint, defaults.get(field, inspect.Parameter.empty)


def _build(structure: type, values: Iterator[Any]) -> Any:
    def value(hint: Any) -> Any:
        if _is_group(hint):
            return _build(hint, values)
        return hint.from_list(next(values)) if _is_flat(hint) else next(values)

    return structure(*(value(hint) for _, hint in _fields(structure)))


def _vmap_by_loop(op: CustomOpDef) -> Callable[..., Any]:
    """vmap rule: one call per batch element, results stacked along dim 0."""

    def rule(info, in_dims, *args):
        moved = [
            a.movedim(d, 0) if d is not None and isinstance(a, torch.Tensor) else a
            for a, d in zip(args, in_dims, strict=True)
        ]
        outs = [
            op(
                *[
                    a[i] if d is not None and isinstance(a, torch.Tensor) else a
                    for a, d in zip(moved, in_dims, strict=True)
                ]
            )
            for i in range(info.batch_size)
        ]
        stacked = tuple(torch.stack(parts) for parts in zip(*outs, strict=True))
        return stacked, (0,) * len(stacked)

    return rule


class OpSchema(Generic[ArgumentsT]):
    """The arguments of a custom op, from ``arguments`` (see the module doc)."""

    def __init__(self, arguments: type[ArgumentsT]) -> None:
        self.arguments = arguments
        leaves = list(_leaves(arguments))
        self._paths = [path for path, _, _ in leaves]
        self._flat = [_is_flat(hint) for _, hint, _ in leaves]
        names = ["_".join(path) for path in self._paths]
        if tuple(names[: len(DIFFERENTIABLE)]) != DIFFERENTIABLE:
            raise TypeError(f"{arguments.__name__} must start with {DIFFERENTIABLE}, got {names}")
        self.signature = inspect.Signature(
            [
                inspect.Parameter(
                    name,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=default,
                    # typing's alias: torch 2.6's infer_schema refuses collections.abc.Sequence
                    annotation=typing.Sequence[float] if _is_flat(hint) else hint,
                )
                for name, (_, hint, default) in zip(names, leaves, strict=True)
            ]
        )

    def flatten(self, arguments: ArgumentsT) -> list[Any]:
        """The op's arguments, in its order."""
        flat = []
        for path, as_list in zip(self._paths, self._flat, strict=True):
            value: Any = arguments
            for field in path:
                value = getattr(value, field)
            flat.append(value.as_list() if as_list else value)
        return flat

    def unflatten(self, flat: Sequence[Any]) -> ArgumentsT:
        """The structure of the op's arguments ``flat``."""
        return _build(self.arguments, iter(flat))

    def _bound(self, args: tuple, kwargs: dict) -> tuple:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.args

    def gradients(self, grads: Gradients | Sequence[torch.Tensor | None]) -> tuple:
        """Backward's result: the gradients of ``input``, ``linear_weight`` and
        ``linear_bias``, ``None`` for every other argument."""
        if isinstance(grads, Gradients):
            grads = (grads.input, grads.weight, grads.bias)
        return (*grads, *(None for _ in self._paths[len(DIFFERENTIABLE) :]))

    def save(self, ctx: Any, arguments: ArgumentsT, *extra: torch.Tensor) -> None:
        """Keep ``arguments`` (and ``extra`` tensors, outputs backward reads) for backward:
        the tensors through ``save_for_backward``, detached (backward recomputes, it does
        not differentiate through them, and an attached view would keep its base alive)."""
        flat = self.flatten(arguments)
        ctx.tensor_slots = [i for i, value in enumerate(flat) if isinstance(value, torch.Tensor)]
        ctx.constants = [None if i in ctx.tensor_slots else v for i, v in enumerate(flat)]
        ctx.save_for_backward(*(flat[i].detach() for i in ctx.tensor_slots), *extra)

    def saved(self, ctx: Any) -> tuple[ArgumentsT, tuple[torch.Tensor, ...]]:
        """What :meth:`save` kept: the arguments and the ``extra`` tensors."""
        tensors = ctx.saved_tensors
        flat = list(ctx.constants)
        for slot, value in zip(ctx.tensor_slots, tensors, strict=False):
            flat[slot] = value
        return self.unflatten(flat), tuple(tensors[len(ctx.tensor_slots) :])

    def recompute(
        self,
        op: CustomOpDef,
        ctx: Any,
        arguments: ArgumentsT | None = None,
        **upstream: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        """Backward of an op that recomputes: ``op`` again on ``arguments`` (those
        :meth:`save` kept if ``None``), with the upstream gradients ``upstream`` (arguments
        of the op) and the gradients backward is asked for; the op's last three outputs
        are those gradients."""
        if arguments is None:
            arguments, _ = self.saved(ctx)
        needs = Needs.asked(ctx, arguments.linear_bias)
        if all(grad is None for grad in upstream.values()) or not any(needs):
            return self.gradients((None, None, None))
        upstream = {k: None if g is None else g.contiguous() for k, g in upstream.items()}
        outputs = op(*self.flatten(arguments._replace(needs=needs, **upstream)))
        return self.gradients(needs.pick(outputs[-3:]))

    def define(
        self,
        name: str,
        outputs: int,
        kernel: Callable[[ArgumentsT], tuple[torch.Tensor, ...]],
        fake: Callable[[ArgumentsT], tuple[torch.Tensor, ...]],
    ) -> CustomOpDef:
        """The custom op ``linear_ce::<name>`` on these arguments, returning ``outputs``
        tensors: ``kernel`` computes them, ``fake`` gives their shapes and dtypes; vmap
        runs one call per batch element."""

        def call(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
            return kernel(self.unflatten(self._bound(args, kwargs)))

        def fake_call(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
            return fake(self.unflatten(self._bound(args, kwargs)))

        call.__name__ = call.__qualname__ = name
        call.__module__ = kernel.__module__
        call.__doc__ = kernel.__doc__
        call.__signature__ = self.signature.replace(  # type: ignore[attr-defined]
            return_annotation=tuple[(torch.Tensor,) * outputs]
        )
        op = torch.library.custom_op(f"linear_ce::{name}", call, mutates_args=())
        op.register_fake(fake_call)
        op.register_vmap(_vmap_by_loop(op))
        return op
