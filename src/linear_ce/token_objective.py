"""The token-objective family's public function: ``token_objective``, a token-local loss
fused into the LM head."""

from __future__ import annotations

from collections.abc import Callable

import torch

from linear_ce.checks.call import HeadArguments, TransformArguments
from linear_ce.checks.objective import check_objective_call
from linear_ce.ops.token_objective import objective_loss
from linear_ce.options import LinearCrossEntropyOptions, resolve_options
from linear_ce.parallel.dtensor import accepts_dtensors
from linear_ce.parallel.shard import VocabParallel, vocab_shard

__all__ = ["token_objective"]

_NAME = "token_objective"


def _checked_side_inputs(
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
    vocab_parallel=True,
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
    vocab_parallel: VocabParallel | None = None,
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
        vocab_parallel: ``None`` for a whole head, or a :class:`~linear_ce.VocabParallel`:
            the head given is this rank's shard of one split along the vocabulary (what that
            means, the same for every family, is said there). Collectives: as
            token_logprobs' (two all_reduce per chunk of valid rows, the entropy's sum
            riding in the SUM one), so every rank evaluates objective on the same
            log-probabilities; the gradients are computed in forward, one all_reduce sums
            the input gradient, and backward communicates nothing.

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

    head = HeadArguments(input, linear_weight, target, linear_bias, ignore_index, shift)
    transform = TransformArguments(temperature, logit_scale, softcap)
    shard = vocab_shard(_NAME, "linear_weight", linear_weight, vocab_parallel)
    call, vocab = check_objective_call(
        _NAME, head, transform, objective, entropy, token_tensors, shard
    )
    side = _checked_side_inputs(token_tensors, target, input, _NAME)
    options = resolve_options(options, _NAME)
    return objective_loss(_NAME, call, objective, entropy, side, options, vocab)
