"""The public function ``token_objective``: a token-local loss fused into the LM head."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from linear_ce.arguments import Call, check_token_call
from linear_ce.chunked import run_chunks, tiles_for
from linear_ce.dtensor import accepts_dtensors
from linear_ce.losses.token_objective import ObjectiveHead
from linear_ce.ops import check_class_indices, hand_over_gradients
from linear_ce.options import LinearCrossEntropyOptions, resolve_options
from linear_ce.plan import acc_dtype_for, make_plan
from linear_ce.vocab import LocalVocab

__all__ = ["objective_loss", "token_objective"]

_NAME = "token_objective"


@dataclasses.dataclass(frozen=True)
class _Spec:
    name: str
    call: Call
    objective: Callable[..., torch.Tensor]
    entropy: bool
    side: dict[str, torch.Tensor]
    options: LinearCrossEntropyOptions
    needs: tuple[bool, bool, bool]
    grad_mode: bool
    vocab: LocalVocab
    planned_classes: int


class _TokenObjective(torch.autograd.Function):
    """Forward runs the loop once and computes the gradients; backward scales them.

    With a vocab-parallel ``spec.vocab`` (:class:`linear_ce.distributed.VocabShard`) the
    weight is this rank's shard: the loop combines the row statistics over the group, so
    every rank evaluates the objective on the same log-probabilities, and the input
    gradient is summed over the group."""

    @staticmethod
    def forward(ctx, input, weight, bias, spec: _Spec):
        call = spec.call
        acc = acc_dtype_for(input.dtype, spec.options.acc_dtype)
        head = ObjectiveHead(
            call.target.long(),
            call.target != call.ignore_index,
            spec.vocab.start,
            weight.shape[0],
            acc,
            objective=spec.objective,
            entropy=spec.entropy,
            side=spec.side,
            name=spec.name,
            grad_mode=spec.grad_mode,
            differentiate=any(spec.needs),
        )
        rows, in_features = input.shape
        plan = make_plan(
            rows,
            in_features,
            spec.planned_classes,
            input.dtype,
            input.device,
            spec.options,
            tiles=tiles_for(head.keeps_logits, call.transform, any(spec.needs)),
        )
        need_x, need_w, need_b = spec.needs
        grads = run_chunks(
            input,
            weight,
            bias,
            head,
            call.transform,
            plan,
            grad_input=need_x,
            grad_weight=need_w,
            grad_bias=need_b,
            vocab=spec.vocab,
        )
        if grads.input is not None:
            spec.vocab.sum_(grads.input)
        ctx.grads = [grads.input, grads.weight, grads.bias]
        ctx.needs = spec.needs
        ctx.allow_retain_graph = spec.options.allow_retain_graph
        return head.total.to(acc)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        scaled = hand_over_gradients(ctx, ctx.needs, grad_loss, ctx.allow_retain_graph)
        return (*scaled, None)


def _side_inputs(
    side: dict[str, torch.Tensor], target: torch.Tensor, input: torch.Tensor, name: str
) -> dict[str, torch.Tensor]:
    checked = {}
    for key, value in side.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{name}: side input {key} must be a tensor of the target's shape "
                f"{tuple(target.shape)}, got {type(value).__name__}"
            )
        if value.requires_grad:
            raise ValueError(
                f"{name}: side input {key} requires grad; side inputs are data (old or "
                f"reference log-probs, advantages, weights) and get no gradient: pass "
                f"{key}.detach()"
            )
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"{name}: side input {key} must have the target's shape "
                f"{tuple(target.shape)}, got {tuple(value.shape)}"
            )
        if not value.is_floating_point():
            raise ValueError(
                f"{name}: side input {key} must be a floating tensor, got {value.dtype}"
            )
        if value.device != input.device:
            raise ValueError(
                f"{name}: side input {key} is on {value.device}, the input on {input.device}"
            )
        checked[key] = value
    return checked


@torch.compiler.disable
@accepts_dtensors(
    rows=("input", "target"),
    heads=("linear_weight", "linear_bias"),
    per_token_keywords=True,
    vocab_parallel="vocab_parallel_token_objective",
)
def token_objective(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    objective: Callable[..., torch.Tensor],
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool | int = False,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    entropy: bool = False,
    options: LinearCrossEntropyOptions | None = None,
    **token_tensors: torch.Tensor,
) -> torch.Tensor:
    r"""A token-local objective of the LM head's log-probabilities, with its gradients
    computed in the same pass over the logits (three GEMMs per training step).

    Returns :math:`\sum_{t\ \text{valid}} \ell_t` with
    :math:`\ell = \mathrm{objective}(\log p_t, H, **side)` evaluated on each chunk's
    valid tokens, where :math:`\log p_t` and the entropy :math:`H` are those of
    :func:`linear_ce.token_logprobs` (same transform: ``logit_scale``, ``softcap``,
    ``temperature``). The objective applies any normalisation itself, e.g. through a
    per-token ``weight`` side input. Gradients flow to ``input``, ``linear_weight``
    and ``linear_bias``; side inputs are data and get none. The objective is
    differentiated with respect to ``logprob`` and ``entropy`` only: one whose result
    depends on another tensor that requires grad (one it closes over) is a
    ``ValueError``; apply a learnable factor outside the call instead. A NaN in the
    hidden state or a side input propagates to the loss and to the gradient rows it
    touches, as in plain autograd; under ``torch.no_grad()`` the objective runs
    without autograd.

    Args:
        input, linear_weight, target, linear_bias, ignore_index, shift, temperature,
        logit_scale, softcap, options: as in :func:`linear_ce.token_logprobs`.
        objective: ``objective(logprob, entropy, **side) -> loss``, 1-D tensors of one
            chunk's valid tokens (``entropy`` is ``None`` unless ``entropy=True``), one
            loss per token; plain torch code (see :mod:`linear_ce.objectives`).
        entropy: compute the entropy and pass it to the objective.
        **token_tensors: per-token side inputs of the target's shape (floating, no grad),
            e.g. ``old_logprob=``, ``advantage=``, ``ref_logprob=``, ``weight=``; aligned
            with the outputs of ``token_logprobs`` (position ``t`` with ``shift``).

    Under ``torch.compile`` the call is a graph break (a Python callable cannot be an
    argument of a custom op); the rest of the step compiles around it.

    Example (GRPO-style, token-mean over the batch)::

        >>> import linear_ce.objectives as obj
        >>> loss = linear_ce.token_objective(
        ...     hidden, lm_head, labels, obj.clipped_policy_gradient(0.2, 0.28),
        ...     shift=True, old_logprob=old, advantage=adv, weight=mask / mask.sum(),
        ... )
        >>> loss.backward()
    """
    return objective_loss(
        _NAME,
        input,
        linear_weight,
        target,
        objective,
        linear_bias=linear_bias,
        ignore_index=ignore_index,
        shift=shift,
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        entropy=entropy,
        options=options,
        side=token_tensors,
    )


def objective_loss(
    name: str,
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    objective: Callable[..., torch.Tensor],
    *,
    linear_bias: torch.Tensor | None,
    ignore_index: int,
    shift: bool | int,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    entropy: bool,
    options: LinearCrossEntropyOptions | None,
    side: dict[str, torch.Tensor],
    vocab: LocalVocab | None = None,
    num_classes: int | None = None,
    planned_classes: int | None = None,
) -> torch.Tensor:
    """:func:`token_objective` (errors name ``name``); ``vocab``, ``num_classes`` and
    ``planned_classes`` (the classes per rank the chunk size is planned for) describe a
    vocab-parallel shard (:func:`linear_ce.distributed.vocab_parallel_token_objective`);
    ``None`` means the whole vocabulary in ``linear_weight``."""
    if not callable(objective):
        raise ValueError(f"{name}: objective must be callable, got {type(objective).__name__}")
    if getattr(objective, "needs_entropy", False) and entropy is False:
        raise ValueError(f"{name}: objective {objective!r} reads the entropy; pass entropy=True")
    call = check_token_call(
        name,
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        ignore_index=ignore_index,
        shift=shift,
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        flags={"entropy": entropy},
        num_classes=num_classes,
    )
    classes = call.linear_weight.shape[0] if num_classes is None else num_classes
    check_class_indices(call.target, call.ignore_index, classes, name)
    checked_side = _side_inputs(side, target, input, name)
    options = resolve_options(options, name)
    rows = call.input.shape[0]
    acc = acc_dtype_for(call.input.dtype, options.acc_dtype)
    flat_side = {k: v.reshape(rows, 1).to(acc) for k, v in checked_side.items()}
    grad_on = torch.is_grad_enabled()
    spec = _Spec(
        name=name,
        call=call,
        objective=objective,
        entropy=entropy,
        side=flat_side,
        options=options,
        needs=(
            grad_on and call.input.requires_grad,
            grad_on and call.linear_weight.requires_grad,
            grad_on and call.linear_bias is not None and call.linear_bias.requires_grad,
        ),
        grad_mode=grad_on,
        vocab=LocalVocab() if vocab is None else vocab,
        planned_classes=call.linear_weight.shape[0] if planned_classes is None else planned_classes,
    )
    return _TokenObjective.apply(call.input, call.linear_weight, call.linear_bias, spec)
