"""How the ops' gradients reach autograd.

A scalar loss (``"mean"``, ``"sum"``, an objective's total) has one upstream gradient,
a scalar, so its gradients are formed in forward, in the same pass as the loss, and
backward hands them over scaled (:func:`keep_gradients`, :func:`hand_over`). Per-row
outputs get their upstream gradients only in backward, which recomputes (the op again,
or the vocabulary pass).

:class:`OnVocab` is the autograd node of the calls a custom op cannot take: a
vocab-parallel shard (a process group) or an objective (a Python callable). It runs a
family's forward and backward bodies, the same ones its custom op runs, on any
:class:`~linear_ce.engine.vocab.Vocab`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.autograd.function import once_differentiable

from linear_ce.engine.chunk_loop import Gradients, Needs
from linear_ce.engine.vocab import Vocab
from linear_ce.ops.schema import OpSchema

__all__ = [
    "Forward",
    "HandOver",
    "OnArguments",
    "OnVocab",
    "Run",
    "fake_gradient_outputs",
    "gradient_outputs",
    "hand_over",
    "hand_over_gradients",
    "hand_over_of",
    "keep_gradients",
    "reduce_rows",
    "register_by_reduction",
    "release_gradients",
    "row_weight",
]


def gradient_outputs(grads: Gradients, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The three gradient slots of an op's result; an op cannot return ``None``, so a
    gradient that was not computed is an empty tensor."""
    return tuple(
        like.new_empty((0,)) if g is None else g for g in (grads.input, grads.weight, grads.bias)
    )


def fake_gradient_outputs(
    input: torch.Tensor, weight: torch.Tensor, needs: Needs
) -> tuple[torch.Tensor, ...]:
    """The three gradient slots of an op's fake result: shaped like ``input``, ``weight``
    and its bias (``weight.shape[:-1]``) where ``needs`` asks for them, else empty."""
    shapes = (input.shape, weight.shape, weight.shape[:-1])
    return tuple(
        input.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs, strict=True)
    )


class HandOver(NamedTuple):
    """How the gradients a scalar loss formed in forward are handed over in backward:
    which of (input, weight, bias) were formed (``needs``), whether a second backward may
    read them (``allow_retain_graph``), and the public function called (``name``, which a
    second backward's error names)."""

    needs: Needs
    allow_retain_graph: bool
    name: str


def keep_gradients(ctx: Any, grads: Sequence[torch.Tensor | None], hand: HandOver) -> None:
    """Keep the gradients (input, weight, bias) a scalar loss formed in forward for
    :func:`hand_over`, as ``hand`` says."""
    # Unused outputs (a z-loss, lse, the stored gradients) must not get zero-filled
    # gradients: for grad_weight that is a (V, F) allocation and fill per backward.
    ctx.set_materialize_grads(False)
    ctx.hand_over = hand
    # Detached: the stored gradients are outputs of this node; keeping them
    # attached would make node -> ctx -> tensor -> grad_fn -> node a cycle.
    ctx.grads = [
        None if g is None or not need else g.detach()
        for g, need in zip(grads, hand.needs, strict=True)
    ]


def release_gradients(ctx: Any) -> None:
    """Free the gradients :func:`keep_gradients` kept, unless a second backward may read
    them: a backward that recomputes instead (an output other than the loss got an
    upstream gradient) then holds no second copy, and a later backward that would hand
    them over raises as :func:`hand_over_gradients` says."""
    if not ctx.hand_over.allow_retain_graph:
        ctx.grads = [None] * len(ctx.grads)


def hand_over(ctx: Any, grad_loss: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The gradients :func:`keep_gradients` kept, scaled by ``grad_loss``."""
    if grad_loss is None:
        return (None, None, None)
    return tuple(hand_over_gradients(ctx, grad_loss))


def hand_over_gradients(ctx: Any, grad_loss: torch.Tensor) -> list[torch.Tensor | None]:
    """The gradients stored in ``ctx.grads`` by forward, scaled by the scalar upstream
    gradient, as ``ctx.hand_over`` (a :class:`HandOver`) says. Without
    ``allow_retain_graph`` the stored buffers are scaled in place (or handed over as they
    are, where the upstream gradient is a CPU scalar equal to 1) and released, so a second
    backward raises, naming the public function called, instead of returning wrong
    numbers."""
    stored = ctx.grads
    needs, allow_retain_graph, name = ctx.hand_over
    if any(need and g is None for g, need in zip(stored, needs, strict=True)):
        raise RuntimeError(
            f"{name}: backward ran twice through a graph whose gradients were already "
            "handed over; pass options=LinearCrossEntropyOptions(allow_retain_graph=True) "
            "to backward more than once"
        )
    # A traced backward (AOT autograd) cannot express handing a forward output over
    # mutated in place; there the copy is the only correct choice. Its tensors are
    # functional wrappers, which is_fake does not see through on torch 2.5 and 2.6.
    traced = is_fake(grad_loss) or isinstance(grad_loss, FunctionalTensor)
    in_place = not allow_retain_graph and not traced
    if not allow_retain_graph:
        ctx.grads = [None] * len(stored)
    if in_place and _is_one(grad_loss):
        # loss.backward(): the gradients are already the loss's own; scaling by 1 would be
        # a pass over (V, F) that changes nothing, a few percent of a bf16 step's GEMMs.
        return list(stored)
    return [
        None
        if g is None
        else g.mul_(grad_loss.to(g.dtype))
        if in_place
        else g * grad_loss.to(g.dtype)
        for g in stored
    ]


def _is_one(grad_loss: torch.Tensor) -> bool:
    """Whether the upstream gradient is a plain scalar that is exactly 1, known without
    waiting on a device: a CPU tensor's value is in host memory already, so reading it
    is no synchronisation. On an accelerator the answer is "unknown" (the scaling then
    runs, on the device, asynchronously), as it is for a gradient that carries a graph
    (``create_graph``: the product's derivative in it is needed) or a wrapped one (a
    functorch transform's, a tensor subclass)."""
    return (
        type(grad_loss) is torch.Tensor
        and grad_loss.device.type == "cpu"
        and grad_loss.numel() == 1
        and not grad_loss.requires_grad
        and not torch._C._functorch.is_functorch_wrapped_tensor(grad_loss)
        and grad_loss.item() == 1.0
    )


def row_weight(
    valid: torch.Tensor, reduction: str, grad_rows: torch.Tensor | None, acc: torch.dtype
) -> torch.Tensor | None:
    """The upstream gradient of each row: of a scalar loss 1 ("sum") or 1/count
    ("mean"), over the ``valid`` rows; ``grad_rows`` for ``"none"``."""
    if reduction == "none":
        return grad_rows
    weight = valid.to(acc)
    return weight / valid.sum() if reduction == "mean" else weight


def reduce_rows(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """The per-row ``loss`` reduced: summed, divided by the ``valid`` rows for "mean"."""
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / valid.sum() if reduction == "mean" else total


def hand_over_of(args: Any) -> HandOver:
    """The :class:`HandOver` of an op's arguments ``args`` (its schema's ``NamedTuple``:
    its ``needs``, ``allow_retain_graph`` and ``name``)."""
    return HandOver(args.needs, args.allow_retain_graph, args.name)


def register_by_reduction(op: Any, schema: OpSchema) -> None:
    """The autograd of an op whose ``reduction`` argument decides it: "mean"/"sum" form
    the gradients in forward and hand them over; "none" recomputes them in backward
    with the upstream gradient of each row as the op's ``grad_rows``."""

    def setup_context(ctx, inputs, output):
        args = schema.unflatten(inputs)
        ctx.scalar = args.reduction != "none"
        if ctx.scalar:
            keep_gradients(ctx, output[-3:], hand_over_of(args))
            return
        ctx.set_materialize_grads(False)
        schema.save(ctx, args)

    def backward(ctx, grad_loss, *_unused):
        if ctx.scalar:
            return schema.gradients(hand_over(ctx, grad_loss))
        return schema.recompute(op, ctx, grad_rows=grad_loss)

    op.register_autograd(backward, setup_context=setup_context)


class Forward(NamedTuple):
    """What a :class:`Run`'s forward gives :class:`OnVocab`: its ``outputs``; the
    ``gradients`` it formed (a scalar loss), handed over in backward, or ``None`` (then
    backward recomputes, reading the three tensors and ``saved``); the positions of
    the outputs that are statistics, without a gradient; and whether a forward that
    formed its gradients also keeps the three tensors (``recomputable``), so that a
    backward where an output other than the first gets an upstream gradient (a returned
    lse) recomputes them with every upstream gradient instead of handing them over."""

    outputs: tuple[torch.Tensor, ...]
    gradients: Gradients | None = None
    saved: tuple[torch.Tensor, ...] = ()
    statistics: tuple[int, ...] = ()
    recomputable: bool = False


class Run(Protocol):
    """A family's forward and backward bodies on one call, for :class:`OnVocab`: a run
    whose forward forms the gradients has their ``hand_over`` and no ``backward``; any
    other has ``backward``."""

    hand_over: HandOver

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> Forward:
        """The outputs of the call on these tensors (see :class:`Forward`)."""

    def backward(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        saved: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor | None, ...],
        needs: Needs,
    ) -> Gradients:
        """The gradients ``needs`` asks for, from the upstream ``grad_outputs``."""


@dataclasses.dataclass(frozen=True)
class OnArguments:
    """The part of a :class:`Run` that an op's arguments ``args`` (its schema's
    ``NamedTuple``) give on ``vocab``: the hand-over is the call's own
    (:func:`hand_over_of`), and :meth:`on` puts the tensors :class:`OnVocab` passes in
    place of the call's."""

    args: Any
    vocab: Vocab

    @property
    def hand_over(self) -> HandOver:
        return hand_over_of(self.args)

    def on(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **fields):
        """``args`` with these three tensors (and any other ``fields``) in their places."""
        return self.args._replace(input=input, linear_weight=weight, linear_bias=bias, **fields)


class OnVocab(torch.autograd.Function):
    """``(input, weight, bias)`` → ``run``'s outputs, with ``run``'s gradients."""

    @staticmethod
    def forward(ctx, input, weight, bias, run: Run):
        result = run.forward(input, weight, bias)
        ctx.run, ctx.formed = run, result.gradients is not None
        if ctx.formed:
            grads = result.gradients
            keep_gradients(ctx, (grads.input, grads.weight, grads.bias), run.hand_over)
        else:
            ctx.set_materialize_grads(False)
        if not ctx.formed or result.recomputable:
            ctx.save_for_backward(
                input.detach(),
                weight.detach(),
                None if bias is None else bias.detach(),
                *result.saved,
            )
        ctx.mark_non_differentiable(*(result.outputs[i] for i in result.statistics))
        return result.outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs):
        if ctx.formed:
            if all(g is None for g in grad_outputs[1:]):
                return (*hand_over(ctx, grad_outputs[0]), None)
            release_gradients(ctx)
        input, weight, bias, *saved = ctx.saved_tensors
        needs = Needs.asked(ctx, bias)
        if not any(needs):
            return None, None, None, None
        grads = ctx.run.backward(input, weight, bias, tuple(saved), grad_outputs, needs)
        return grads.input, grads.weight, grads.bias, None
