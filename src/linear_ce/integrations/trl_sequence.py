r"""TRL's DPO loss on :func:`linear_ce.sequence_objective`: three GEMMs per step.

TRL 1.16's ``DPOTrainer._compute_loss`` runs the policy's fused LM head for per-token
log-probabilities (one GEMM forward, three in backward: four), sums them per sequence and
forms the loss of each pair in torch. Its stand-in here forms the same loss inside the
head's pass: the reference log-probabilities first (TRL's ``compute_ref_log_probs``, or
the precomputed ones), then the policy's forward with TRL's fused head answering by
:func:`linear_ce.sequence_objective` (:func:`linear_ce.objectives.dpo` of each of the
trainer's ``loss_type`` entries, weighted by ``loss_weights``, on chunks of whole
chosen/rejected pairs: the gradients are formed in the same pass, three GEMMs). Every
TRL loss type is routed except those whose loss is not one of each pair or reads what the
pass does not form; those calls run TRL's own ``_compute_loss`` unchanged:

- ``aot`` and ``aot_unpaired`` (they sort the log-ratios across the batch);
- ``use_weighting=True`` (WPO's weights read ``log_sum_sq_probs``), ``ld_alpha`` (LD-DPO
  splits each answer at the shorter one's length);
- a setting :func:`linear_ce.objectives.dpo` refuses (``robust`` with
  ``label_smoothing >= 0.5``, which TRL only warns about), a completion with no token
  (TRL clamps its length to 1), ``return_outputs=True``.

Logged as TRL logs them: ``rewards/chosen``, ``rewards/rejected``,
``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``,
``entropy`` (the policy's entropy over completion tokens, formed in the same pass),
``num_tokens`` and ``aux_loss``. Not logged on this route: ``logits/chosen``,
``logits/rejected`` and ``mean_token_accuracy``, statistics of every vocabulary entry the
fused pass does not keep (TRL's own route logs them). The loss is computed in float64 on
CPU (the sequence dtype), where TRL's is in the head's dtype; TRL's clamp of the
``alpha_divergence`` exponent (at 80) is not applied.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import inspect
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from linear_ce.objectives import DPO_LOSSES, SequenceObjective, dpo
from linear_ce.options import LinearCrossEntropyOptions
from linear_ce.sequence_objective import SequenceObjectiveOutput, sequence_objective

__all__ = [
    "DPO_ROUTED_LOSSES",
    "DPOLoss",
    "PolicyCall",
    "TrainerLoss",
    "answering",
    "check_dpo_loss",
    "code_constants",
    "log_tokens",
    "policy_loss",
    "routed_head",
]

DPO_MODULE = "trl.trainer.dpo_trainer"

#: TRL 1.16's DPO loss types this route computes (the others run TRL's own loss): those
#: of :func:`linear_ce.objectives.dpo`.
DPO_ROUTED_LOSSES = DPO_LOSSES
# The loss types whose TRL formula reads label_smoothing (the others ignore it).
_SMOOTHED = ("exo_pair", "robust")
_NOT_MODEL_INPUTS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
#: What a routed step against a reference (DPO, KTO) reads of its trainer besides its
#: loss's settings, set by TRL 1.16's trainers' ``__init__``: the reference, MoE's
#: auxiliary loss (:func:`policy_loss`), the metrics and the token count (:func:`log_tokens`).
REFERENCE_TRAINER_ATTRIBUTES = (
    "precompute_ref_logps",
    "ref_model",
    "aux_loss_enabled",
    "router_aux_loss_coef",
    "_metrics",
    "_total_train_tokens",
    "_tp_size",
)
# What the stand-in reads of the trainer: set by TRL 1.16's DPOTrainer.__init__.
_TRAINER_ATTRIBUTES = (
    "beta",
    "loss_types",
    "loss_weights",
    "ld_alpha",
    "f_divergence_type",
    "f_alpha_divergence_coef",
    "label_smoothing",
    "use_weighting",
    *REFERENCE_TRAINER_ATTRIBUTES,
)


@dataclasses.dataclass
class PolicyCall:
    """The policy forward of one routed step (DPO, GRPO, KTO): what TRL's fused head
    computes instead of per-token log-probabilities, and what it got.

    ``sequence``: the sequence id of each position the head scores, in TRL's compacted
    (row-major) order (negative: scored by TRL's head, but in no sequence of the loss);
    ``side``: the objective's side inputs, per sequence or per scored position;
    ``group`` and ``reduction``: as :func:`linear_ce.sequence_objective`'s; ``trainer``
    names the trainer in errors. ``result`` is set by the head."""

    objective: SequenceObjective
    sequence: torch.Tensor
    side: dict[str, torch.Tensor]
    options: LinearCrossEntropyOptions | None
    trainer: str
    group: str | None = "pairs"
    reduction: str = "mean"
    result: SequenceObjectiveOutput | None = None


_POLICY_CALL: contextvars.ContextVar[PolicyCall | None] = contextvars.ContextVar(
    "linear_ce_trl_policy_call", default=None
)


@contextlib.contextmanager
def answering(call: PolicyCall) -> Iterator[PolicyCall]:
    """Inside the block, the first call of TRL's fused head (patched) is answered by
    :func:`routed_head` with ``call``; the block raises if the head was not called."""
    token = _POLICY_CALL.set(call)
    try:
        yield call
    finally:
        _POLICY_CALL.reset(token)
    if call.result is None:
        raise RuntimeError(
            f"linear_ce.integrations.trl: the {call.trainer} policy forward did not call "
            "TRL's fused LM head; unpatch TRL for this model"
        )


def routed_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    dtype: torch.dtype,
    transform: dict[str, Any],
) -> tuple[torch.Tensor | None, ...] | None:
    """TRL's fused head inside a routed step's policy forward: the sequence objective on
    the scored positions (``hidden`` and ``targets`` compacted, row by row), its result
    kept in the :class:`PolicyCall`, and zero log-probabilities and entropies (without
    gradient) handed back to TRL's forward in their place. ``None`` outside such a
    forward."""
    call = _POLICY_CALL.get()
    if call is None or call.result is not None:
        return None
    if targets.shape != call.sequence.shape:
        raise RuntimeError(
            f"linear_ce.integrations.trl: the {call.trainer} policy forward scored "
            f"{targets.shape[0]} positions, its completion mask marks {call.sequence.shape[0]}; "
            "the model's forward changes the positions (prompt-learning adapters do): unpatch "
            "TRL for it"
        )
    with torch.autocast(hidden.device.type, enabled=False):
        call.result = sequence_objective(
            hidden.to(dtype),
            weight.to(dtype),
            targets,
            call.objective,
            sequence=call.sequence,
            group=call.group,
            linear_bias=None if bias is None else bias.to(dtype),
            entropy=True,
            reduction=call.reduction,
            options=call.options,
            **call.side,
            **transform,
        )
    zeros = hidden.new_zeros(targets.shape, dtype=dtype)
    return zeros, zeros, None, None, None


def policy_loss(
    trainer: Any, model: Any, batch: dict, not_model_inputs: set[str], call: PolicyCall, mode: str
) -> torch.Tensor:
    """The policy forward of a routed step as TRL's ``_compute_loss`` runs it (the batch
    but ``not_model_inputs``, no cache, the router logits where MoE's auxiliary loss is on,
    the completion tokens as labels), its fused head answering ``call``: the call's loss,
    plus MoE's auxiliary loss, logged as TRL logs it."""
    model_kwargs = {k: v for k, v in batch.items() if k not in not_model_inputs}
    model_kwargs["use_cache"] = False
    if trainer.aux_loss_enabled:
        model_kwargs["output_router_logits"] = True
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with answering(call):
        outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
    loss = call.result.loss
    if trainer.aux_loss_enabled:
        loss = loss + trainer.router_aux_loss_coef * outputs.aux_loss
        trainer._metrics[mode]["aux_loss"].append(
            trainer.accelerator.gather_for_metrics(outputs.aux_loss).mean().item()
        )
    return loss


def log_tokens(trainer: Any, mode: str, attention_mask: torch.Tensor) -> None:
    """TRL's ``num_tokens``: the training tokens so far, over processes (a tensor-parallel
    group counted once), the batch's added in training."""
    if mode == "train":
        batch_tokens = trainer.accelerator.gather_for_metrics(attention_mask.sum()).sum().item()
        trainer._total_train_tokens += batch_tokens // trainer._tp_size
    trainer._metrics[mode]["num_tokens"] = [trainer._total_train_tokens]


class TrainerLoss:
    """Stands in for a TRL trainer's ``_compute_loss`` (a method: bound through
    ``__get__``, so a call gets the trainer first). ``original`` is TRL's method, which
    runs the calls the route leaves to TRL. A subclass names the trainer (``MODULE``,
    ``TRAINER``), the method's parameters it keeps (``PARAMETERS``) and checks the rest of
    what it relies on (:meth:`check_trainer`)."""

    MODULE: ClassVar[str]
    TRAINER: ClassVar[str]
    PARAMETERS: ClassVar[tuple[str, ...]] = ("self", "model", "inputs", "return_outputs")

    def __init__(self, options: LinearCrossEntropyOptions | None, original: Any = None) -> None:
        self.options = options
        self.original = original

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        return functools.partial(self, trainer)

    @classmethod
    def check(cls, current: object) -> str | None:
        """What differs from TRL 1.16's trainer in what the stand-in relies on (``None``:
        nothing); ``current`` is the trainer's ``_compute_loss`` now."""
        if isinstance(current, cls):
            return None
        trainer = getattr(importlib.import_module(cls.MODULE), cls.TRAINER, None)
        if trainer is None:
            return f"{cls.MODULE}.{cls.TRAINER} is missing"
        params = tuple(inspect.signature(current).parameters) if callable(current) else ()
        if params != cls.PARAMETERS:
            wanted = ", ".join(cls.PARAMETERS)
            return f"{cls.TRAINER}._compute_loss takes {params}, not ({wanted})"
        return cls.check_trainer(trainer, current)

    @staticmethod
    def check_trainer(trainer: type, current: Any) -> str | None:
        """What differs in the trainer class (``trainer``) and in TRL's ``_compute_loss``
        (``current``, of the expected parameters) beyond what :meth:`check` reads."""
        raise NotImplementedError


def _objective(trainer: Any) -> SequenceObjective | None:
    """The trainer's loss as a sequence objective, or ``None`` where TRL's route stays."""
    types = list(trainer.loss_types)
    if (
        trainer.use_weighting
        or trainer.ld_alpha is not None
        or not set(types) <= set(DPO_ROUTED_LOSSES)
    ):
        return None
    divergence, alpha = trainer.f_divergence_type, float(trainer.f_alpha_divergence_coef)
    if divergence == "alpha_divergence" and abs(alpha - 1.0) < 1e-6:
        divergence = "reverse_kl"  # TRL's limit case: f'(t) -> log t
    total = None
    try:
        for loss_type, weight in zip(types, trainer.loss_weights, strict=True):
            term = float(weight) * dpo(
                float(trainer.beta),
                loss_type,
                label_smoothing=float(trainer.label_smoothing) if loss_type in _SMOOTHED else 0.0,
                f_divergence=divergence if loss_type != "sft" else "reverse_kl",
                f_alpha=alpha,
                discopop_tau=float(trainer.args.discopop_tau),
            )
            total = term if total is None else total + term
    except ValueError:
        return None  # a setting TRL accepts and dpo() refuses: TRL's own loss
    return total


class DPOLoss(TrainerLoss):
    """Stands in for ``DPOTrainer._compute_loss``."""

    MODULE = DPO_MODULE
    TRAINER = "DPOTrainer"

    def __call__(self, trainer: Any, model: Any, inputs: dict, return_outputs: bool) -> Any:
        completion_mask = inputs["completion_mask"]
        objective = None if return_outputs else _objective(trainer)
        scored = completion_mask[..., 1:].bool()
        if objective is None or not bool(scored.any(1).all()):
            return self.original(trainer, model, inputs, return_outputs)
        return _routed_loss(trainer, model, inputs, objective, scored, self.options)

    @staticmethod
    def check_trainer(trainer: type, current: Any) -> str | None:
        ref = getattr(trainer, "compute_ref_log_probs", None)
        if ref is None or tuple(inspect.signature(ref).parameters) != ("self", "model", "inputs"):
            return "DPOTrainer.compute_ref_log_probs(self, model, inputs) is missing"
        assigned = set(trainer.__init__.__code__.co_names)
        missing = [name for name in _TRAINER_ATTRIBUTES if name not in assigned]
        if missing:
            return f"DPOTrainer.__init__ no longer sets {', '.join(missing)}"
        known = {c for c in current.__code__.co_consts if isinstance(c, str)}
        unknown = [loss for loss in DPO_ROUTED_LOSSES if loss not in known]
        if unknown:
            return f"DPOTrainer._compute_loss no longer computes the loss types {unknown}"
        return None


def _ref_logprob(trainer: Any, inputs: dict) -> torch.Tensor:
    """``(2B,)`` the reference's summed log-probabilities, chosen first (TRL's)."""
    if trainer.precompute_ref_logps:
        chosen, rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    else:
        model = trainer.model if trainer.ref_model is None else trainer.ref_model
        chosen, rejected = trainer.compute_ref_log_probs(model, inputs)
    return torch.cat([chosen, rejected]).detach()


def _routed_loss(
    trainer: Any,
    model: Any,
    inputs: dict,
    objective: SequenceObjective,
    scored: torch.Tensor,
    options: LinearCrossEntropyOptions | None,
) -> torch.Tensor:
    mode = "train" if trainer.model.training else "eval"
    ref = _ref_logprob(trainer, inputs)

    entropy = []

    def with_entropy(batch):
        entropy.append(batch.entropy.detach().sum())
        return objective(batch)

    logged = SequenceObjective(
        with_entropy,
        objective.name,
        per="group",
        group_size=2,
        side=objective.side,
        needs_entropy=True,
    )
    rows = torch.arange(scored.shape[0], device=scored.device)[:, None].expand_as(scored)
    sequence = rows[scored].to(inputs["input_ids"].device)
    call = PolicyCall(logged, sequence, {"ref_logprob": ref}, options, "DPO")
    loss = policy_loss(trainer, model, inputs, _NOT_MODEL_INPUTS, call, mode)
    _log(trainer, mode, inputs, call.result, ref, torch.stack(entropy).sum(), scored)
    return loss


def _log(trainer, mode, inputs, result, ref, entropy_sum, scored) -> None:
    """TRL's DPO metrics from the pass's sums (gathered over processes as TRL does)."""
    accelerator, metrics = trainer.accelerator, trainer._metrics[mode]
    tokens = scored.sum()
    entropy_sum = accelerator.gather_for_metrics(entropy_sum.to(torch.float32)).sum()
    tokens = accelerator.gather_for_metrics(tokens).sum()
    metrics["entropy"].append((entropy_sum / tokens).item() if tokens > 0 else 0.0)
    log_tokens(trainer, mode, inputs["attention_mask"])
    logps = result.logprob_sum.to(ref.dtype)
    chosen_logps, rejected_logps = logps.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    chosen = trainer.beta * (chosen_logps - ref_chosen)
    rejected = trainer.beta * (rejected_logps - ref_rejected)
    metrics["rewards/chosen"].append(accelerator.gather(chosen).mean().item())
    metrics["rewards/rejected"].append(accelerator.gather(rejected).mean().item())
    accuracies = (chosen > rejected).float()
    metrics["rewards/accuracies"].append(accelerator.gather(accuracies).mean().item())
    metrics["rewards/margins"].append(accelerator.gather(chosen - rejected).mean().item())
    metrics["logps/chosen"].append(accelerator.gather(chosen_logps).mean().item())
    metrics["logps/rejected"].append(accelerator.gather(rejected_logps).mean().item())


def code_constants(function: Any) -> set[str]:
    """The string constants of ``function``'s code, the keyword names of its calls
    included (what the installed-TRL checks read of a method TRL may change)."""
    names = set()
    for const in function.__code__.co_consts:
        names.update(
            c for c in (const if isinstance(const, tuple) else (const,)) if isinstance(c, str)
        )
    return names


#: What differs from TRL 1.16's ``DPOTrainer`` in what :class:`DPOLoss` relies on.
check_dpo_loss = DPOLoss.check
