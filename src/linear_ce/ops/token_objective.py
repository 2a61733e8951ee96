"""The token objective's autograd: a user's token-local loss, differentiated in the same
pass over the logits.

Forward runs the loop once with :class:`~linear_ce.losses.token_objective.ObjectiveHead`
and computes the gradients; backward scales them. The objective is a Python callable,
which a custom op cannot take, so the call is an :class:`~linear_ce.ops.autograd.OnVocab`
node on any vocabulary: with a vocab-parallel shard the loop combines the row statistics
over the group, so every rank evaluates the objective on the same log-probabilities, and
the input gradient is summed over the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from linear_ce.checks.call import Call
from linear_ce.engine.chunk_loop import Needs, run_head
from linear_ce.engine.head import HeadFrame
from linear_ce.engine.plan import acc_dtype_for
from linear_ce.engine.vocab import Vocab
from linear_ce.losses.token_objective import ObjectiveHead, TokenObjective
from linear_ce.ops.autograd import Forward, HandOver, OnVocab
from linear_ce.options import LinearCrossEntropyOptions

__all__ = ["objective_loss"]


@dataclasses.dataclass(frozen=True)
class _Objective:
    """The objective's forward on one call (:class:`~linear_ce.ops.autograd.Run`)."""

    call: Call
    objective: TokenObjective
    options: LinearCrossEntropyOptions
    needs: Needs
    grad_mode: bool
    vocab: Vocab

    @property
    def hand_over(self) -> HandOver:
        return HandOver(self.needs, self.options.allow_retain_graph, self.objective.name)

    def forward(self, input, weight, bias) -> Forward:
        call, vocab = self.call, self.vocab
        acc = acc_dtype_for(input.dtype, self.options.acc_dtype)
        valid = call.target != call.ignore_index
        head = ObjectiveHead(
            HeadFrame(call.target.long(), valid, vocab.start, weight.shape[0], acc),
            self.objective,
            grad_mode=self.grad_mode,
            differentiate=any(self.needs),
        )
        grads = run_head(input, weight, bias, head, call.transform, self.options, vocab, self.needs)
        return Forward((head.total.to(acc),), grads)


class _TokenObjective(OnVocab):
    """The objective's autograd node (named for it in autograd graphs)."""


def objective_loss(
    name: str,
    call: Call,
    objective: Callable[..., torch.Tensor],
    entropy: bool,
    side: dict[str, torch.Tensor],
    options: LinearCrossEntropyOptions,
    vocab: Vocab,
) -> torch.Tensor:
    """The objective summed over the valid tokens of a checked per-token ``call`` (its
    class indices too) on ``vocab``, with ``side`` inputs of the target's shape; errors name
    ``name``."""
    rows = call.input.shape[0]
    acc = acc_dtype_for(call.input.dtype, options.acc_dtype)
    flat_side = {k: v.reshape(rows, 1).to(acc) for k, v in side.items()}
    needs = Needs.of(call.input, call.linear_weight, call.linear_bias)
    grad_mode = torch.is_grad_enabled()
    spec = TokenObjective(objective, entropy, flat_side, name)
    run = _Objective(call, spec, options, needs, grad_mode, vocab)
    (loss,) = _TokenObjective.apply(call.input, call.linear_weight, call.linear_bias, run)
    return loss
