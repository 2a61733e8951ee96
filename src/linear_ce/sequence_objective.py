"""The public function ``sequence_objective``: a loss of whole sequences (preference and
sequence-level policy losses) fused into the LM head."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from linear_ce.checks.call import HeadArguments, TransformArguments
from linear_ce.checks.objective import check_objective_call
from linear_ce.engine.chunk_loop import Needs
from linear_ce.engine.sequence_layout import SequenceLayout, sequence_layout
from linear_ce.engine.vocab import Vocab
from linear_ce.losses.sequence_objective import Metrics, SequenceBatch, sequence_dtype
from linear_ce.ops.sequence_objective import SequenceSpec, sequence_objective_op
from linear_ce.options import LinearCrossEntropyOptions, resolve_options
from linear_ce.parallel.dtensor import accepts_dtensors
from linear_ce.parallel.shard import VocabParallel, vocab_shard

__all__ = [
    "SequenceObjectiveOutput",
    "sequence_objective",
    "sequence_objective_loss",
]

_NAME = "sequence_objective"
_REDUCTIONS = ("mean", "sum")


class SequenceObjectiveOutput(NamedTuple):
    """What :func:`sequence_objective` returns.

    ``loss``: the reduced objective (0-d, the accumulation dtype). ``logprob_sum``: ``(S,)``
    each sequence's summed log-probability, in the accumulation dtype: a statistic without
    gradient (what trainers log as rewards; differentiate through the objective).
    ``num_tokens``: ``(S,)`` int64, each sequence's scored tokens. ``metrics``: the means of
    what the objective logged (:func:`linear_ce.objectives.log_metric`), by name, 0-d
    float64 tensors without gradient.
    """

    loss: torch.Tensor
    logprob_sum: torch.Tensor
    num_tokens: torch.Tensor
    metrics: Metrics


def _side_inputs(
    name: str,
    side: dict[str, torch.Tensor],
    target: torch.Tensor,
    sequences: int,
    input: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-sequence side inputs as ``(S,)``, per-token ones as ``(N,)``, in ``dtype``."""
    per_sequence, per_token = {}, {}
    shapes = {(sequences,), (sequences, 1), ()}
    for key, value in side.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{name}: side input {key} must be a tensor (per sequence ({sequences},), or "
                f"per token of the target's shape {tuple(target.shape)}), got "
                f"{type(value).__name__}"
            )
        if value.requires_grad:
            raise ValueError(
                f"{name}: side input {key} requires grad; side inputs are data (reference "
                f"log-probs, advantages, labels) and get no gradient: pass {key}.detach()"
            )
        if not (value.is_floating_point() or value.dtype == torch.bool):
            raise ValueError(
                f"{name}: side input {key} must be a floating or bool tensor, got {value.dtype}"
            )
        if value.device != input.device:
            raise ValueError(
                f"{name}: side input {key} is on {value.device}, the input on {input.device}"
            )
        shape = tuple(value.shape)
        if shape in shapes:
            per_sequence[key] = value.to(dtype).reshape(-1).expand(sequences)
        elif shape == tuple(target.shape):
            per_token[key] = value.to(dtype).reshape(-1)
        else:
            raise ValueError(
                f"{name}: side input {key} must be per sequence, of shape ({sequences},) or "
                f"({sequences}, 1) (or a scalar), or per token, of the target's shape "
                f"{tuple(target.shape)}; got {shape}"
            )
    return per_sequence, per_token


def _check_objective(
    name: str,
    objective: Callable[..., torch.Tensor],
    layout: SequenceLayout,
    side: dict[str, torch.Tensor],
    token_side: dict[str, torch.Tensor],
) -> None:
    """What a :class:`~linear_ce.objectives.SequenceObjective` declares about its groups and
    side inputs, checked before the pass."""
    wanted = getattr(objective, "group_size", None)
    if wanted is not None and layout.group_size != wanted:
        found = "different sizes" if layout.group_size is None else f"{layout.group_size}"
        raise ValueError(
            f"{name}: objective {objective!r} compares groups of {wanted} sequences, but this "
            f"call's groups have {found}: a group is split across the batch or mixes answers; "
            f'pass group="pairs" (the first half of the sequences chosen, the second half '
            f"rejected) or a group id per sequence, {wanted} sequences each"
        )
    for names, given, kind, other in (
        (getattr(objective, "side", ()), side, "per sequence", token_side),
        (getattr(objective, "token_side", ()), token_side, "per token", side),
    ):
        for key in names:
            if key not in given:
                hint = (
                    f" (it was given {'per token' if kind == 'per sequence' else 'per sequence'})"
                )
                raise ValueError(
                    f"{name}: objective {objective!r} needs the side input {key} {kind}"
                    f"{hint if key in other else ''}"
                )


def _losses_on_rank(arguments: Mapping[str, Any], num_classes: int | None) -> torch.Tensor:
    """How many losses this rank's rows of a DTensor call average (the denominator of
    ``reduction="mean"`` when a batch dimension is split): the groups for an objective of
    one loss per group, the sequences for one of one loss per sequence."""
    target, group = arguments["target"], arguments["group"]
    per = getattr(arguments["objective"], "per", None)
    sequences = target.shape[0]  # a padded batch (the only split layout): a row each
    if per == "sequence" or group is None:
        count = sequences
    elif per == "group" and isinstance(group, str):
        count = sequences // 2  # "pairs"; its check names an odd count
    elif per == "group" and isinstance(group, torch.Tensor):
        count = int(torch.unique(group).numel())
    else:
        raise ValueError(
            f"{_NAME}: reduction='mean' over a batch split across ranks needs to know whether "
            f"the objective returns a loss per group or per sequence, and {arguments['objective']!r} "
            "does not say (a linear_ce.objectives.SequenceObjective does); pass "
            "reduction='sum' and divide by the global count"
        )
    return torch.tensor(float(count), dtype=torch.float64, device=target.device)


@torch.compiler.disable
@accepts_dtensors(
    rows=("input", "target", "group"),
    heads=("linear_weight", "linear_bias"),
    per_token_keywords=True,
    vocab_parallel=True,
    mean=_losses_on_rank,
    whole_sequences=("sequence", "cu_seqlens"),
)
def sequence_objective(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    objective: Callable[[SequenceBatch], torch.Tensor],
    *,
    sequence: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    group: torch.Tensor | str | None = None,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool | int = False,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    entropy: bool = False,
    reduction: str = "mean",
    options: LinearCrossEntropyOptions | None = None,
    vocab_parallel: VocabParallel | None = None,
    **side_inputs: torch.Tensor,
) -> SequenceObjectiveOutput:
    r"""A loss of whole sequences (DPO and its variants, SimPO, CPO, ORPO, KTO, GSPO, …) of
    the LM head's log-probabilities, with its gradients computed in the same pass over the
    logits: three GEMMs per training step where every group fits a chunk.

    Each scored token :math:`t` (target not ``ignore_index``) belongs to a sequence
    :math:`s`; per sequence the objective sees :math:`L_s = \sum_{t \in s} \log p_t` (the
    log-probabilities of :func:`linear_ce.token_logprobs`, same logits transform) and the
    number of scored tokens :math:`|s|`, and its tokens' log-probabilities (and entropies).
    Sequences form groups the objective compares (a chosen/rejected pair, a group of
    samples). ``objective(batch)`` gets a :class:`~linear_ce.objectives.SequenceBatch` of one
    chunk's whole groups and returns one loss per group or per sequence, plain torch code
    (built-ins: :mod:`linear_ce.objectives`). The result is their mean (``reduction="mean"``:
    over every group or sequence of the call) or sum. Gradients flow to ``input``,
    ``linear_weight`` and ``linear_bias``; side inputs are data and get none.

    Layouts: a padded ``(B, T)`` target (one sequence per row, ``S = B``; prompt and
    padding labels ``ignore_index``), or packed sequences: ``sequence`` (an id per token, of
    the target's shape; negative: no sequence) or ``cu_seqlens`` (``(S + 1,)`` boundaries of
    the flattened tokens). With ``shift`` a position is scored only if its label lies in
    the same sequence. Every sequence needs at least one scored token.

    Groups (``group``): ``None``, each sequence alone; ``"pairs"``, TRL's convention,
    sequence ``i`` of the first half (chosen) with ``i + S/2`` (rejected); or an integer
    group id per sequence ``(S,)``. A group's sequences reach the objective together, in
    their order (chosen first).

    Groups are packed into chunks of the plan's size (:class:`LinearCrossEntropyOptions`;
    under the budget rule a chunk grows to hold the longest group while its tiles take at
    most twice the budget). Where one group has more scored tokens than a chunk may
    hold, the call takes a four-GEMM path: a statistics pass, the objective on every group,
    then the vocabulary pass; same results, no ``(N, V)`` tensor.

    Args:
        input, linear_weight, target, linear_bias, ignore_index, shift, temperature,
        logit_scale, softcap, options: as in :func:`linear_ce.token_logprobs`.
        objective: ``objective(batch) -> loss``, ``(G,)`` or ``(S,)`` of the chunk's groups.
        sequence: packed layout, a sequence id per token (the target's shape).
        cu_seqlens: packed layout, ``(S + 1,)`` boundaries (not with ``sequence``).
        group: ``None``, ``"pairs"`` or ``(S,)`` integer group ids.
        entropy: compute each token's entropy and pass it to the objective.
        reduction: ``"mean"`` or ``"sum"`` of the objective's losses.
        **side_inputs: per-sequence (``(S,)``, ``(S, 1)`` or a scalar) or per-token (the
            target's shape) floating or bool tensors without grad, e.g. ``ref_logprob=``,
            ``advantage=``, ``label=``, ``old_logprob=``.
        vocab_parallel: ``None`` for a whole head, or a :class:`~linear_ce.VocabParallel`:
            the head given is this rank's shard of one split along the vocabulary (what that
            means, the same for every family, is said there). Collectives: as
            token_logprobs' (two all_reduce per chunk of whole groups, the entropy's sum
            riding in the SUM one), so every rank evaluates objective on the same
            log-probabilities and gets the same loss, logprob_sum and metrics, on the fused
            path or the four-GEMM fallback alike; the gradients are computed in forward, one
            all_reduce sums the input gradient, and backward communicates nothing.

    Returns:
        :class:`SequenceObjectiveOutput` ``(loss, logprob_sum, num_tokens, metrics)``.

    Under ``torch.compile`` the call is a graph break (a Python callable cannot be an
    argument of a custom op).

    Example (DPO on TRL's concatenated batch, chosen rows first)::

        >>> import linear_ce.objectives as obj
        >>> out = linear_ce.sequence_objective(
        ...     hidden, lm_head, labels, obj.dpo(beta=0.1), shift=True, group="pairs",
        ...     ref_logprob=torch.cat([ref_chosen_logps, ref_rejected_logps]),
        ... )
        >>> out.loss.backward()
        >>> chosen, rejected = out.logprob_sum.chunk(2)
    """
    head = HeadArguments(input, linear_weight, target, linear_bias, ignore_index, shift)
    transform = TransformArguments(temperature, logit_scale, softcap)
    packing = (sequence, cu_seqlens, group)
    shard = vocab_shard(_NAME, "linear_weight", linear_weight, vocab_parallel)
    return sequence_objective_loss(
        _NAME, head, transform, objective, packing, entropy, reduction, options, side_inputs, shard
    )


def sequence_objective_loss(
    name: str,
    head: HeadArguments,
    transform: TransformArguments,
    objective: Callable[[SequenceBatch], torch.Tensor],
    packing: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | str | None],
    entropy: bool,
    reduction: str,
    options: LinearCrossEntropyOptions | None,
    side: dict[str, torch.Tensor],
    vocab: Vocab | None = None,
) -> SequenceObjectiveOutput:
    """:func:`sequence_objective` (errors name ``name``) on ``vocab``, a vocab-parallel
    shard; ``None`` means the whole vocabulary in the head. ``packing`` is ``(sequence,
    cu_seqlens, group)``."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    sequence, cu_seqlens, group = packing
    others = {**side, "sequence": sequence, "cu_seqlens": cu_seqlens, "group": group}
    call, vocab = check_objective_call(name, head, transform, objective, entropy, others, vocab)
    target = head.target
    device = call.input.device
    layout = sequence_layout(
        name,
        target,
        call.target.view(target.shape),
        call.ignore_index,
        int(head.shift),  # checked by check_token_call
        sequence=sequence,
        cu_seqlens=cu_seqlens,
        group=group,
        device=device,
    )
    if layout.totals.sequences == 0:
        raise ValueError(
            f"{name}: the batch holds no sequence (target of shape {tuple(target.shape)})"
        )
    dtype = sequence_dtype(device)
    per_sequence, per_token = _side_inputs(
        name, side, target, layout.totals.sequences, call.input, dtype
    )
    _check_objective(name, objective, layout, per_sequence, per_token)
    options = resolve_options(options, name)
    spec = SequenceSpec(
        name=name,
        call=call,
        objective=objective,
        entropy=entropy,
        layout=layout,
        lengths=layout.lengths.to(dtype),
        side=per_sequence,
        token_side=per_token,
        reduction=reduction,
        options=options,
        needs=Needs.of(call.input, call.linear_weight, call.linear_bias),
        vocab=vocab,
    )
    loss, logprob_sum, metrics = sequence_objective_op(
        call.input, call.linear_weight, call.linear_bias, spec
    )
    return SequenceObjectiveOutput(loss, logprob_sum, layout.lengths, metrics)
