r"""TRL's GRPO loss at ``importance_sampling_level="sequence"`` (GSPO) on
:func:`linear_ce.sequence_objective`: three GEMMs per step.

TRL 1.16's ``GRPOTrainer._compute_loss`` runs the policy's fused LM head for per-token
log-probabilities and entropies (one GEMM forward, three in backward: four), then forms
the loss in torch. With ``importance_sampling_level="sequence"`` each completion's
importance ratio is the geometric mean of its tokens',
:math:`s = \exp\big(\sum_t (\log p_t - \log p^{old}_t) / |y|\big)`, a function of the
sequence's summed log-probability: its stand-in here forms the loss inside the head's pass
(:func:`linear_ce.objectives.gspo` for the clipped surrogate, TRL's KL term per token with
its sequence-ratio correction, the entropy bonus), so the gradients are formed in the same
pass, three GEMMs. TRL's forward (its batching, multimodal inputs, autocast, MoE auxiliary
loss) runs unchanged around the head, through ``_get_per_token_logps_and_entropies``.

Routed: ``loss_type`` ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` and ``luspo`` (the clipped
surrogate), ``sapo`` (its soft gate of the sequence ratio) and ``cispo`` (its detached,
capped sequence ratio times the log-probabilities), each with its own aggregation; with
``delta``, ``beta`` (and ``use_bias_correction_kl``), the entropy bonus (static, or TRL's
adaptive controller, its state moved as TRL moves it), the
off-policy sequence mask (``off_policy_mask_threshold``), vLLM's importance-sampling
correction (the batch's ratios, per token or per sequence, weigh the policy term), a tool
mask,
completions without a token (as TRL: they count in the means with a zero loss), MoE's
auxiliary loss. Kept on TRL's own ``_compute_loss`` (unchanged):

- ``importance_sampling_level="token"``: the ratio is per token, not a function of
  sequence sums (:func:`linear_ce.token_objective` territory);
- ``loss_type="vespo"``: TRL's gamma weights are formed from the token ratios' clamped
  sum (not the sequence ratio) and TRL expects it at the token level (it warns otherwise);
- ``top_entropy_quantile < 1``: the token mask is a quantile of every token's entropy over
  every process, known only after the whole batch's entropies, so no token's gradient is
  known inside the pass (a first pass for them would cost the GEMM the route saves);
- advantages per token (a subclass's ``(B, T)``), a ``delta`` below ``1 + epsilon_high``
  (:func:`~linear_ce.objectives.gspo` refuses it), a batch with no completion token.

Logged as TRL logs them: ``entropy``, ``kl``, ``clip_ratio/low_mean``,
``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``clip_ratio/low_min``,
``clip_ratio/high_max`` (the clipped surrogate), ``cispo_clip_ratio``, ``policy_loss`` and
``entropy_coef`` (with an entropy bonus),
``aux_loss``. The loss is formed in float64 on CPU (the sequence dtype), where TRL's is
in the head's dtype.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from linear_ce.integrations.trl_sequence import (
    PolicyCall,
    TrainerLoss,
    answering,
    code_constants,
)
from linear_ce.objectives import SequenceBatch, SequenceObjective, gspo
from linear_ce.options import LinearCrossEntropyOptions

__all__ = ["GRPO_MODULE", "GRPO_ROUTED_LOSSES", "GRPOLoss", "check_grpo_loss"]

GRPO_MODULE = "trl.trainer.grpo_trainer"

#: TRL 1.16's GRPO loss types this route computes at the sequence level.
GRPO_ROUTED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo", "cispo")
# The loss types of the clipped surrogate (objectives.gspo).
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# The loss types whose loss is a mean of per-sequence token means (the others sum tokens).
_PER_SEQUENCE_MEAN = ("grpo", "sapo")
# The inputs of TRL's forward helper that _compute_loss passes from the batch.
_FORWARD_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
# What the stand-in reads of the trainer: set by TRL 1.16's GRPOTrainer.__init__.
_TRAINER_ATTRIBUTES = (
    "beta",
    "loss_type",
    "importance_sampling_level",
    "epsilon_low",
    "epsilon_high",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "_entropy_bonus_enabled",
    "_last_world_entropy",
    "_entropy_window_stats",
    "off_policy_mask_threshold",
    "use_vllm",
    "vllm_importance_sampling_correction",
    "max_completion_length",
    "aux_loss_enabled",
    "router_aux_loss_coef",
    "_metrics",
)
# What TRL 1.16's _compute_loss reads that the stand-in reads the same way.
_LOSS_READS = (
    "_get_per_token_logps_and_entropies",
    "current_gradient_accumulation_steps",
    "use_bias_correction_kl",
    "delta",
    "steps_per_generation",
    "num_processes",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "get_off_policy_mask",
    "entropy_target",
    "entropy_coef_delta",
    "entropy_coef_max",
    "entropy_coef_min",
    "sync_gradients",
)
_LOSS_CONSTANTS = (
    "sequence",
    "advantages",
    "old_per_token_logps",
    "ref_per_token_logps",
    "num_items_in_batch",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
    "tool_mask",
    *GRPO_ROUTED_LOSSES,
)


def _routable(trainer: Any, inputs: dict) -> bool:
    """Whether this call's settings are the route's (else TRL's own loss runs)."""
    return (
        trainer.importance_sampling_level == "sequence"
        and trainer.loss_type in GRPO_ROUTED_LOSSES
        and trainer.top_entropy_quantile >= 1.0
        and inputs["advantages"].dim() == 1
    )


Surrogate = Callable[[SequenceBatch], torch.Tensor]


def _surrogate(trainer: Any) -> Surrogate | None:
    r"""The policy term of each sequence summed over its tokens (TRL's per-token loss
    times the mask, summed), for the trainer's loss type, with the sequence ratio
    :math:`s` and each token's weight :math:`w_t` (vLLM's importance-sampling ratio, else
    1): the clipped surrogate :math:`\ell` of :func:`~linear_ce.objectives.gspo` times
    :math:`\sum_t w_t`; SAPO's :math:`-\tfrac{4}{\tau}\sigma(\tau(s-1))\,A \sum_t w_t`
    (:math:`\tau` by the advantage's sign); CISPO's
    :math:`-\mathrm{sg}(\min(s, \varepsilon_{high}))\,A \sum_t w_t \log p_t`. ``None``
    where :func:`~linear_ce.objectives.gspo` refuses TRL's setting."""
    loss_type = trainer.loss_type
    if loss_type in _CLIPPED:
        try:
            clipped = gspo(
                float(trainer.epsilon_low),
                float(trainer.epsilon_high),
                delta=None if trainer.args.delta is None else float(trainer.args.delta),
            )
        except ValueError:
            return None  # a setting TRL accepts and gspo() refuses: TRL's own loss
        return lambda batch: clipped(batch) * _weight_sums(batch)
    if loss_type == "sapo":
        positive = float(trainer.args.sapo_temperature_pos)
        negative = float(trainer.args.sapo_temperature_neg)

        def sapo(batch: SequenceBatch) -> torch.Tensor:
            advantage = batch.side["advantage"]
            tau = torch.where(advantage > 0, positive, negative).to(advantage.dtype)
            gate = torch.sigmoid(tau * (_ratio(batch) - 1)) * 4 / tau
            return -gate * advantage * _weight_sums(batch)

        return sapo
    high = float(trainer.epsilon_high)

    def cispo(batch: SequenceBatch) -> torch.Tensor:
        weight = _ratio(batch).clamp(max=high).detach()
        token_logprob = batch.token_logprob
        if "is_ratio" in batch.token_side:
            token_logprob = token_logprob * batch.token_side["is_ratio"]
        return -weight * batch.side["advantage"] * batch.sum_tokens(token_logprob)

    return cispo


def _weight_sums(batch: SequenceBatch) -> torch.Tensor:
    """Each sequence's summed token weights: vLLM's importance-sampling ratios, else its
    number of tokens."""
    if "is_ratio" in batch.token_side:
        return batch.sum_tokens(batch.token_side["is_ratio"])
    return batch.length


class GRPOLoss(TrainerLoss):
    """Stands in for ``GRPOTrainer._compute_loss``."""

    MODULE = GRPO_MODULE
    TRAINER = "GRPOTrainer"
    PARAMETERS = ("self", "model", "inputs")

    def __call__(self, trainer: Any, model: Any, inputs: dict) -> Any:
        surrogate = _surrogate(trainer) if _routable(trainer, inputs) else None
        if surrogate is None or not bool(_loss_mask(inputs).any()):
            return self.original(trainer, model, inputs)
        return _routed_loss(trainer, model, inputs, surrogate, self.options)

    @staticmethod
    def check_trainer(trainer: type, current: Any) -> str | None:
        forward = getattr(trainer, "_get_per_token_logps_and_entropies", None)
        wanted = ("self", "model", "input_ids", "attention_mask", "logits_to_keep")
        if forward is None:
            return "GRPOTrainer._get_per_token_logps_and_entropies is missing"
        forward_params = tuple(inspect.signature(forward).parameters)
        missing = [
            p
            for p in (*wanted, "compute_entropy", "compute_aux_loss", *_FORWARD_INPUTS)
            if p not in forward_params
        ]
        if forward_params[: len(wanted)] != wanted or missing:
            return f"GRPOTrainer._get_per_token_logps_and_entropies takes {forward_params}"
        if "fused_lm_head" not in code_constants(inspect.unwrap(forward)):
            return (
                "GRPOTrainer._get_per_token_logps_and_entropies no longer calls the fused LM head"
            )
        assigned = set(trainer.__init__.__code__.co_names)
        missing = [name for name in _TRAINER_ATTRIBUTES if name not in assigned]
        if missing:
            return f"GRPOTrainer.__init__ no longer sets {', '.join(missing)}"
        code = current.__code__
        missing = [name for name in _LOSS_READS if name not in code.co_names]
        known = code_constants(current)
        missing += [name for name in _LOSS_CONSTANTS if name not in known]
        if missing:
            return f"GRPOTrainer._compute_loss no longer reads {', '.join(missing)}"
        return None


def _loss_mask(inputs: dict) -> torch.Tensor:
    """TRL's ``mask``: the completion tokens the loss reads (a tool mask drops some)."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


def _ratio(batch: SequenceBatch) -> torch.Tensor:
    """Each sequence's importance ratio as :func:`linear_ce.objectives.gspo` forms it."""
    if "old_logprob" in batch.token_side:
        old = batch.sum_tokens(batch.token_side["old_logprob"])
    else:
        old = batch.logprob.detach()
    return torch.exp((batch.logprob - old) / batch.length)


def _kept_on_policy(batch: SequenceBatch, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask as TRL forms it: a sequence is kept when its
    advantage is not negative or the mean over its tokens of ``log p_sampling - sg(log p)``
    (NaN, a token the sampler did not score, counted 0) is at most ``threshold``."""
    current = batch.token_logprob.detach()
    sampling = batch.token_side.get("sampling_logprob", batch.token_side.get("old_logprob"))
    gap = torch.zeros_like(current) if sampling is None else sampling - current
    mean_gap = batch.sum_tokens(torch.nan_to_num(gap, nan=0.0)) / batch.length
    kept = (batch.side["advantage"] >= 0) | (mean_gap <= threshold)
    return kept.to(current.dtype)


class _Sums:
    """Detached sums the objective adds up over the pass's chunks (for the metrics)."""

    def __init__(self) -> None:
        self.values: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        self.values.setdefault(name, []).append(value.detach())

    def total(self, name: str) -> torch.Tensor:
        return torch.stack(self.values[name]).sum()


def _objective(
    trainer: Any,
    surrogate: Surrogate,
    denominator: torch.Tensor,
    tokens: torch.Tensor,
    steps: float,
    bonus: float,
    sums: _Sums,
) -> SequenceObjective:
    r"""The step's loss as one objective whose sum (``reduction="sum"``) is TRL's loss:
    per sequence :math:`c_b = (|y_b|\,\ell_b + \beta \sum_t k_t)\,/\,D` (divided by
    :math:`|y_b|` for ``grpo``), with :math:`\ell_b` the clipped surrogate, :math:`k_t`
    TRL's per-token KL, :math:`D` the loss type's denominator, less the entropy bonus
    :math:`c \sum_t H_t / (n\,a)` (``n`` loss tokens, ``a`` accumulation steps)."""
    beta, bias_correction = float(trainer.beta), bool(trainer.args.use_bias_correction_kl)
    per_mean = trainer.loss_type in _PER_SEQUENCE_MEAN
    threshold = trainer.off_policy_mask_threshold

    def fn(batch: SequenceBatch) -> torch.Tensor:
        loss = surrogate(batch)
        if threshold is not None:
            loss = loss * _kept_on_policy(batch, threshold)
        if beta != 0.0:
            log_ratio = batch.token_side["ref_logprob"] - batch.token_logprob
            kl = torch.exp(log_ratio) - log_ratio - 1
            if bias_correction:
                kl = kl * batch.per_token(_ratio(batch))
            sums.add("kl", kl.sum())
            loss = loss + beta * batch.sum_tokens(kl)
        if per_mean:
            loss = loss / batch.length
        loss = loss / denominator
        sums.add("policy", loss.sum())
        sums.add("entropy", batch.entropy.sum())
        if bonus != 0.0:
            loss = loss - bonus * batch.sum_tokens(batch.entropy) / (tokens.clamp(min=1.0) * steps)
        return loss

    return SequenceObjective(
        fn,
        f"trl_grpo({trainer.loss_type})",
        per="sequence",
        side=("advantage",),
        needs_entropy=True,
    )


def _bonus(trainer: Any) -> float:
    """The entropy bonus's coefficient for this step: the static one, or the adaptive
    controller's as its last optimizer step left it (applied only while the entropy it
    measured is at most the target)."""
    if not trainer._entropy_bonus_enabled:
        return 0.0
    if trainer.use_adaptive_entropy and trainer._last_world_entropy > trainer.args.entropy_target:
        return 0.0
    return float(trainer.entropy_coef)


def _adapt(trainer: Any, entropy_sum: torch.Tensor, tokens: torch.Tensor) -> None:
    """TRL's adaptive entropy controller, moved by this micro-batch: its entropy sum and
    token count added to the accumulation window's; at an optimizer step, the window's
    entropy over every process moves the coefficient by ``entropy_coef_delta`` toward
    raising the entropy to ``entropy_target`` (within its bounds), and the window restarts."""
    args = trainer.args
    stats = torch.stack([entropy_sum, tokens]).to(torch.float32)
    window = trainer._entropy_window_stats
    trainer._entropy_window_stats = stats if window is None else window + stats
    if not trainer.accelerator.sync_gradients:
        return
    totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
    entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
    if entropy <= args.entropy_target:
        trainer.entropy_coef = min(
            trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max
        )
    else:
        trainer.entropy_coef = max(
            trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min
        )
    trainer._last_world_entropy = entropy
    trainer._entropy_window_stats = None


def _denominator(trainer: Any, inputs: dict, rows: int, tokens: torch.Tensor, mode: str):
    """What TRL 1.16 divides the summed per-sequence losses by, per loss type, and the
    factor from the divided loss to the logged ``policy_loss`` (the accumulation steps,
    which ``dapo``'s and ``cispo``'s logged loss keeps)."""
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    loss_type = trainer.loss_type
    if loss_type in ("grpo", "sapo", "luspo"):
        return rows * accumulation, accumulation
    if loss_type == "bnpo":
        return tokens.clamp(min=1.0) * accumulation, accumulation
    if loss_type == "dr_grpo":
        return rows * trainer.max_completion_length * accumulation, accumulation
    # dapo, cispo: the generation batch's tokens, rescaled to one accumulation window
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if mode == "train":
        normalizer = normalizer * trainer.current_gradient_accumulation_steps
        normalizer = normalizer / trainer.args.steps_per_generation
    return normalizer, 1.0


def _routed_loss(
    trainer: Any,
    model: Any,
    inputs: dict,
    surrogate: Surrogate,
    options: LinearCrossEntropyOptions | None,
) -> torch.Tensor:
    mode = "train" if trainer.model.training else "eval"
    completion_mask = inputs["completion_mask"]
    mask = _loss_mask(inputs)
    scored, kept = completion_mask.bool(), mask.bool()  # the head's positions; the loss's
    lengths = kept.sum(1)
    present = lengths > 0
    ids = torch.where(kept, (present.cumsum(0) - 1)[:, None], -1)[scored]
    rows = completion_mask.shape[0]
    tokens = lengths.sum().to(torch.float64)
    denominator, accumulation = _denominator(trainer, inputs, rows, tokens, mode)
    sums = _Sums()
    steps = float(trainer.current_gradient_accumulation_steps) if mode == "train" else 1.0
    objective = _objective(trainer, surrogate, denominator, tokens, steps, _bonus(trainer), sums)
    side = {"advantage": inputs["advantages"][present].detach()}
    old = inputs.get("old_per_token_logps")
    if old is not None:
        side["old_logprob"] = old[scored].detach()
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        ratio = inputs["importance_sampling_ratio"]  # (B, T) by token, (B, 1) by sequence
        side["is_ratio"] = ratio.expand_as(completion_mask)[scored].detach()
    sampling = inputs.get("sampling_per_token_logps")
    if trainer.off_policy_mask_threshold is not None and sampling is not None:
        side["sampling_logprob"] = sampling[scored].detach()
    if trainer.beta != 0.0:
        side["ref_logprob"] = inputs["ref_per_token_logps"][scored].detach()

    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    call = PolicyCall(objective, ids, side, options, "GRPO", group=None, reduction="sum")
    with answering(call):
        _, _, aux_loss = trainer._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_mask.size(1),
            compute_entropy=True,
            compute_aux_loss=trainer.aux_loss_enabled,
            **{name: inputs.get(name) for name in _FORWARD_INPUTS},
        )
    result = call.result
    loss = result.loss
    if trainer._entropy_bonus_enabled:
        policy = sums.total("policy") * accumulation
        trainer._metrics[mode]["policy_loss"].append(
            trainer.accelerator.gather(policy.to(torch.float32)).nanmean().item()
        )
        if trainer.use_adaptive_entropy and mode == "train":
            _adapt(trainer, sums.total("entropy"), tokens)
        if mode == "train" and trainer.accelerator.sync_gradients:
            trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)
    if trainer.aux_loss_enabled:
        normalizer = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + trainer.router_aux_loss_coef * aux_loss / normalizer
        trainer._metrics[mode]["aux_loss"].append(
            trainer.accelerator.gather_for_metrics(aux_loss).mean().item()
        )
    _log(trainer, mode, inputs, result.logprob_sum, present, lengths, tokens, sums)
    return loss


def _log(trainer, mode, inputs, logprob_sum, present, lengths, tokens, sums) -> None:
    """TRL's GRPO metrics from the pass's sums (reduced over processes as TRL does)."""
    accelerator, metrics = trainer.accelerator, trainer._metrics[mode]

    def mean(total: torch.Tensor, count: torch.Tensor) -> float:
        totals = accelerator.reduce(torch.stack([total, count]).to(torch.float32), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if trainer.beta != 0.0:
        metrics["kl"].append(mean(sums.total("kl"), tokens))
    metrics["entropy"].append(mean(sums.total("entropy"), tokens))

    # The clip statistics of every completion, TRL's ratio of 1 for one without a token.
    log_ratio = torch.zeros(present.shape, dtype=logprob_sum.dtype, device=logprob_sum.device)
    old = inputs.get("old_per_token_logps")
    if old is not None:
        kept = _loss_mask(inputs).bool()
        old_sum = torch.where(kept, old.to(logprob_sum.dtype), 0.0).sum(1)[present]
        log_ratio[present] = (logprob_sum - old_sum) / lengths[present]
    ratio = torch.exp(log_ratio)
    advantages = inputs["advantages"].to(ratio.dtype)
    rows = torch.tensor(float(ratio.numel()), dtype=torch.float64, device=ratio.device)
    if trainer.loss_type == "cispo":
        clipped = ((ratio > trainer.epsilon_high) & (advantages > 0)).to(torch.float64)
        metrics["cispo_clip_ratio"].append(mean(clipped.sum(), rows))
    if trainer.loss_type not in _CLIPPED:
        return
    if trainer.args.delta is not None:
        ratio = ratio.clamp(max=trainer.args.delta)  # TRL caps it before its clip statistics
    low = ((ratio < 1 - trainer.epsilon_low) & (advantages < 0)).to(torch.float64)
    high = ((ratio > 1 + trainer.epsilon_high) & (advantages > 0)).to(torch.float64)
    metrics["clip_ratio/low_mean"].append(mean(low.sum(), rows))
    metrics["clip_ratio/high_mean"].append(mean(high.sum(), rows))
    metrics["clip_ratio/region_mean"].append(mean(torch.maximum(low, high).sum(), rows))
    metrics["clip_ratio/low_min"].append(accelerator.gather(low.float()).min().item())
    metrics["clip_ratio/high_max"].append(accelerator.gather(high.float()).max().item())


#: What differs from TRL 1.16's ``GRPOTrainer`` in what :class:`GRPOLoss` relies on.
check_grpo_loss = GRPOLoss.check
