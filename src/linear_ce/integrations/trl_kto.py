r"""TRL's KTO loss on :func:`linear_ce.sequence_objective`: three GEMMs per step.

TRL 1.16's ``KTOTrainer._compute_loss`` runs the policy's fused LM head for per-token
log-probabilities (one GEMM forward, three in backward: four), sums them per completion
and forms each completion's loss against the reference in torch. The loss of a completion
is a function of its summed log-probability, the reference's and the batch's KL estimate
(computed without gradient), so its stand-in here forms it inside the head's pass
(:func:`linear_ce.objectives.kto`, one loss per completion, their mean): the gradients
are formed in the same pass, three GEMMs. The KL estimate is TRL's own
(``_compute_kl_logps`` on the policy and the reference, no gradient), the reference's
log-probabilities too (the precomputed ones, or ``compute_ref_log_probs``).

Routed: ``loss_type`` ``kto`` and ``apo_zero_unpaired``, with their weights, the KL
estimate, precomputed or live reference, MoE's auxiliary loss. Kept on TRL's own
``_compute_loss``: ``return_outputs=True``, a batch with inputs besides the token ids and
attention mask (a vision-language batch: TRL's reference forward in ``_compute_loss``
passes them, ``compute_ref_log_probs`` does not), a completion with no token, a setting
:func:`linear_ce.objectives.kto` refuses.

Logged as TRL logs them: ``kl``, ``entropy`` (formed in the same pass), ``num_tokens``,
``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``, ``aux_loss``. Not logged on this route: ``logits/chosen`` and
``logits/rejected``, means over every vocabulary entry that the fused pass does not keep.
The loss is formed in float64 on CPU (the sequence dtype), where TRL's is in the head's
dtype.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from linear_ce.integrations.trl_sequence import (
    REFERENCE_TRAINER_ATTRIBUTES,
    PolicyCall,
    TrainerLoss,
    code_constants,
    log_tokens,
    policy_loss,
)
from linear_ce.objectives import SequenceBatch, SequenceObjective, kto
from linear_ce.options import LinearCrossEntropyOptions

__all__ = ["KTO_MODULE", "KTOLoss", "check_kto_loss"]

KTO_MODULE = "trl.trainer.kto_trainer"

_ROUTED_LOSSES = ("kto", "apo_zero_unpaired")
# The batch entries TRL 1.16's _compute_loss keeps out of the model's forward.
_NOT_MODEL_INPUTS = {
    "completion_mask",
    "KL_input_ids",
    "KL_attention_mask",
    "KL_completion_mask",
    "KL_token_type_ids",
    "KL_mm_token_type_ids",
    "label",
    "ref_logps",
    "ref_KL_logps",
}
# What the stand-in reads of the trainer: set by TRL 1.16's KTOTrainer.__init__.
_TRAINER_ATTRIBUTES = (
    "beta",
    "loss_type",
    "desirable_weight",
    "undesirable_weight",
    "calculate_KL",
    *REFERENCE_TRAINER_ATTRIBUTES,
)
_LOSS_READS = ("_compute_kl_logps", "calculate_KL", "desirable_weight", "undesirable_weight")
_LOSS_CONSTANTS = ("label", "ref_logps", "ref_KL_logps", "fused_lm_head", *_ROUTED_LOSSES)


def _objective(trainer: Any) -> SequenceObjective | None:
    if trainer.loss_type not in _ROUTED_LOSSES:
        return None
    try:
        return kto(
            float(trainer.beta),
            desirable_weight=float(trainer.desirable_weight),
            undesirable_weight=float(trainer.undesirable_weight),
            loss_type=trainer.loss_type,
        )
    except ValueError:
        return None  # a setting TRL accepts and kto() refuses: TRL's own loss


class KTOLoss(TrainerLoss):
    """Stands in for ``KTOTrainer._compute_loss``."""

    MODULE = KTO_MODULE
    TRAINER = "KTOTrainer"

    def __call__(self, trainer: Any, model: Any, inputs: dict, return_outputs: bool) -> Any:
        objective = None if return_outputs else _objective(trainer)
        text_only = set(inputs) - _NOT_MODEL_INPUTS <= {"input_ids", "attention_mask"}
        scored = inputs["completion_mask"][..., 1:].bool()
        if objective is None or not text_only or not bool(scored.any(1).all()):
            return self.original(trainer, model, inputs, return_outputs)
        return _routed_loss(trainer, model, inputs, objective, self.options)

    @staticmethod
    def check_trainer(trainer: type, current: Any) -> str | None:
        for name, wanted in (
            ("compute_ref_log_probs", ("self", "model", "inputs")),
            ("_compute_kl_logps", ("self", "model", "batch")),
        ):
            method = getattr(trainer, name, None)
            if method is None or tuple(inspect.signature(method).parameters) != wanted:
                return f"KTOTrainer.{name}({', '.join(wanted)}) is missing"
        assigned = set(trainer.__init__.__code__.co_names)
        missing = [name for name in _TRAINER_ATTRIBUTES if name not in assigned]
        if missing:
            return f"KTOTrainer.__init__ no longer sets {', '.join(missing)}"
        missing = [name for name in _LOSS_READS if name not in current.__code__.co_names]
        missing += [name for name in _LOSS_CONSTANTS if name not in code_constants(current)]
        if missing:
            return f"KTOTrainer._compute_loss no longer reads {', '.join(missing)}"
        return None


def _reference(trainer: Any, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference's summed log-probabilities per completion, and of the KL batch."""
    if trainer.precompute_ref_logps:
        return batch["ref_logps"], batch.get("ref_KL_logps") if trainer.calculate_KL else None
    model = trainer.model if trainer.ref_model is None else trainer.ref_model
    return trainer.compute_ref_log_probs(model, batch)


def _routed_loss(
    trainer: Any,
    model: Any,
    inputs: dict,
    objective: SequenceObjective,
    options: LinearCrossEntropyOptions | None,
) -> torch.Tensor:
    mode = "train" if trainer.model.training else "eval"
    accelerator = trainer.accelerator
    device = accelerator.device
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    kl_logps = trainer._compute_kl_logps(model, batch)
    ref, ref_kl_logps = _reference(trainer, batch)
    if trainer.calculate_KL:
        kl = (kl_logps - ref_kl_logps).mean().detach()
        kl = accelerator.gather_for_metrics(kl).mean().clamp(min=0)
    else:
        kl = torch.zeros((), device=device)
    label = torch.as_tensor(batch["label"], dtype=torch.bool, device=device)

    entropy = []

    def with_entropy(sequences: SequenceBatch) -> torch.Tensor:
        entropy.append(sequences.entropy.detach().sum())
        return objective(sequences)

    logged = SequenceObjective(
        with_entropy, objective.name, per="sequence", side=objective.side, needs_entropy=True
    )
    side = {"ref_logprob": ref.detach(), "label": label}
    if trainer.loss_type == "kto":
        side["kl"] = kl.reshape(()).to(ref.dtype)
    scored = batch["completion_mask"][..., 1:].bool()
    rows = torch.arange(scored.shape[0], device=scored.device)[:, None].expand_as(scored)
    call = PolicyCall(logged, rows[scored], side, options, "KTO", group=None)
    trainer._metrics[mode]["kl"].append(kl.item())
    loss = policy_loss(trainer, model, batch, _NOT_MODEL_INPUTS, call, mode)
    _log(trainer, mode, batch, call.result.logprob_sum, ref, label, torch.stack(entropy).sum())
    return loss


def _log(trainer, mode, batch, logps, ref, label, entropy_sum) -> None:
    """TRL's KTO metrics from the pass's sums (gathered over processes as TRL does)."""
    accelerator, metrics = trainer.accelerator, trainer._metrics[mode]
    tokens = accelerator.gather_for_metrics(batch["completion_mask"][:, 1:].sum()).sum()
    entropy_sum = accelerator.gather_for_metrics(entropy_sum.to(torch.float32)).sum()
    metrics["entropy"].append((entropy_sum / tokens).item() if tokens > 0 else 0.0)
    log_tokens(trainer, mode, batch["attention_mask"])
    logps = logps.to(ref.dtype)
    rewards = trainer.beta * (logps - ref)
    counts = {}
    for kind, members in (("chosen", label), ("rejected", ~label)):
        count = counts[kind] = accelerator.gather_for_metrics(members.sum()).sum().item()
        if count > 0:
            total = accelerator.gather_for_metrics(rewards[members].nansum()).nansum().item()
            metrics[f"rewards/{kind}"].append(total / count)
            total = accelerator.gather_for_metrics(logps[members].nansum()).nansum().item()
            metrics[f"logps/{kind}"].append(total / count)
    if counts["chosen"] > 0 and counts["rejected"] > 0:
        metrics["rewards/margins"].append(
            metrics["rewards/chosen"][-1] - metrics["rewards/rejected"][-1]
        )


#: What differs from TRL 1.16's ``KTOTrainer`` in what :class:`KTOLoss` relies on.
check_kto_loss = KTOLoss.check
