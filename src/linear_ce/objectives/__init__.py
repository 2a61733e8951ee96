r"""Built-in objectives: token-local ones for :func:`linear_ce.token_objective`, sequence-level
ones for :func:`linear_ce.sequence_objective`.

**Token-local.** An objective is a callable ``objective(logprob, entropy, **side) -> loss``:
1-D tensors of one chunk's valid tokens in, one loss per token out, written with
ordinary torch operations (its autograd gives the gradients). ``entropy`` is
``None`` unless ``token_objective(..., entropy=True)``; ``side`` holds the
per-token side inputs passed to ``token_objective`` (e.g. ``old_logprob``,
``advantage``, ``ref_logprob``, ``weight``), sliced the same way. Every built-in
multiplies its loss by the side input ``weight`` when one is given: that is how
token-mean or sequence-mean aggregation is expressed (see docs/per-token.md).
Without ``old_logprob`` the policy losses are on-policy: the ratio
:math:`r = e^{\log p - \operatorname{sg}(\log p)}` is 1 and its gradient is that of
:math:`\log p` (``sg``: stop-gradient).

Objectives add: ``clipped_policy_gradient() + kl_penalty(0.04) + entropy_bonus(0.01)``.

**Sequence-level.** A :class:`SequenceObjective` takes a :class:`SequenceBatch` (each
sequence's summed log-probability, its scored tokens, groups, side inputs) and returns one
loss per group or per sequence; written so that ``reduction="mean"`` gives the loss the
trainers (TRL) compute. Pair objectives (DPO, SimPO, CPO, ORPO) take groups of two
sequences, chosen then rejected (``group="pairs"``). They add, and scale by a float:
``0.8 * dpo(0.1) + 0.2 * dpo(0.1, "sft")`` is TRL's ``loss_weights``.
:func:`token_mean` turns a token-local objective into a per-sequence one (GRPO's
per-sequence token mean; a KL term next to GSPO).

**Metrics.** Built-ins log what trainers log (clip fractions, mean ratio, KL, rewards)
with :func:`log_metric`, from the same pass and without gradients:
``sequence_objective`` returns them; around ``token_objective`` collect them with
``with collect_metrics() as metrics: ...``.
"""

from linear_ce.losses.sequence_objective import (
    Metrics,
    SequenceBatch,
    collect_metrics,
    log_metric,
)

# DPO_LOSSES: the loss types dpo() takes, read by the TRL integration.
from linear_ce.objectives.sequence import DPO_LOSSES as DPO_LOSSES
from linear_ce.objectives.sequence import (
    SequenceObjective,
    cpo,
    dpo,
    gspo,
    kto,
    orpo,
    simpo,
    token_mean,
)
from linear_ce.objectives.token import (
    Objective,
    cispo,
    clipped_policy_gradient,
    entropy_bonus,
    kl_penalty,
    sapo,
)

__all__ = [
    "Metrics",
    "Objective",
    "SequenceBatch",
    "SequenceObjective",
    "cispo",
    "clipped_policy_gradient",
    "collect_metrics",
    "cpo",
    "dpo",
    "entropy_bonus",
    "gspo",
    "kl_penalty",
    "kto",
    "log_metric",
    "orpo",
    "sapo",
    "simpo",
    "token_mean",
]
