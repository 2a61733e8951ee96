"""TRL's DPO loss routed through ``linear_ce.sequence_objective`` (integrations/trl_sequence).

One batch of a real ``trl.DPOTrainer`` on a tiny random Llama (test_trl's model and
tokenizer): ``compute_loss`` and its backward unpatched (TRL's own loss on TRL's kernel)
and patched (the fused sequence pass), for every routed loss type, mixed and weighted,
with the f-divergences and label smoothing TRL applies; the loss, every parameter's
gradient and the logged rewards, log-probs and entropy must agree. The settings TRL's route
keeps (``aot``, WPO weighting, LD-DPO) must not reach the sequence objective and must give
TRL's own results.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'linear-ce[trl]'")

from datasets import Dataset  # noqa: E402

import sequence_formula as formula  # noqa: E402
from conftest import eps, rel_err  # noqa: E402
from linear_ce.integrations import trl as lce_trl  # noqa: E402
from test_trl import _common, _llama, _sentences, _tokenizer  # noqa: E402
from trl_routes import routed_fixture, unpatched_fixture  # noqa: E402, F401 (fixtures)

# The logged values: both runs hold fp32 heads and the same weights; TRL sums the log-probs
# in fp32, the route in float64: a handful of fp32 roundings of the per-sequence sums,
# relative to values of order one (measured: under 4 eps on these batches).
BOUND = 16 * eps(torch.float32)
ROUTED_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "entropy",
    "num_tokens",
)


def _trainer(tmp_path, **config):
    args = trl.DPOConfig(**{**_common(tmp_path), "per_device_train_batch_size": 4, **config})
    data = Dataset.from_dict(
        {
            "prompt": _sentences(4, 3, 5, 1),
            "chosen": _sentences(4, 2, 6, 2),
            "rejected": _sentences(4, 2, 6, 3),
        }
    )
    return trl.DPOTrainer(
        model=_llama(),
        ref_model=_llama(seed=1),
        args=args,
        train_dataset=data,
        processing_class=_tokenizer(),
    )


def _step(trainer, inputs) -> tuple[torch.Tensor, dict, dict]:
    """Loss, every parameter's gradient and the metrics logged by one compute_loss."""
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    trainer._total_train_tokens = 0
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def _float64(trainer, inputs, config) -> tuple[torch.Tensor, dict]:
    """The loss and gradients in float64, from the full logits: the backbone's last hidden
    states times the head, per-token log-probabilities summed over each completion, and
    each loss type's formula (tests/sequence_formula.py, typed from TRL's trainer)."""
    model = copy.deepcopy(trainer.model).double()
    ref_model = copy.deepcopy(trainer.ref_model).double()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    scored = inputs["completion_mask"][:, 1:].bool()
    labels = ids[:, 1:]

    def logprob_sums(lm):
        hidden = lm.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        logp = torch.log_softmax(hidden @ lm.lm_head.weight.T, -1)
        token = logp.gather(-1, labels[..., None])[..., 0]
        return torch.where(scored, token, 0.0).sum(1)

    with torch.no_grad():
        ref = logprob_sums(ref_model)
    lp = logprob_sums(model)
    n = scored.sum(1).double()
    types = config["loss_type"]
    weights = config.get("loss_weights", [1.0] * len(types))
    loss = 0.0
    for loss_type, weight in zip(types, weights, strict=True):
        per_pair = formula.dpo_loss(
            loss_type,
            lp,
            ref,
            n,
            config.get("beta", 0.1),
            eps=config.get("label_smoothing", 0.0) if loss_type in ("exo_pair", "robust") else 0,
            fdiv=config.get("f_divergence_type", "reverse_kl"),
            alpha=config.get("f_alpha_divergence_coef", 0.5),
        )
        loss = loss + weight * per_pair.mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compare(tmp_path, routed, expect_route: bool, **config):
    trainer = _trainer(tmp_path, **config)
    trainer.model.train()
    inputs = next(iter(trainer.get_train_dataloader()))
    loss, grads, metrics = _step(trainer, inputs)
    routed.update(sequence=0, kernel=0)
    with lce_trl.patched():
        got, got_grads, got_metrics = _step(trainer, inputs)
    assert routed["kernel"] == 0
    assert routed["sequence"] == (1 if expect_route else 0), routed
    pairs = [(got, loss, "loss"), *((got_grads[n], grads[n], n) for n in grads)]
    if not expect_route:  # TRL's loss on the patched head: as test_trl, within BOUND
        for got_value, trl_value, name in pairs:
            assert rel_err(got_value, trl_value) <= BOUND, name
    else:
        # House rule: within 3 eps of float64, or twice TRL's own fp32 error where that
        # is larger (the backbone's fp32 backward rounds in both runs).
        want, want_grads = _float64(trainer, inputs, config)
        for got_value, trl_value, name in pairs:
            exact = want if name == "loss" else want_grads[name]
            bound = max(3 * eps(torch.float32), 2 * rel_err(trl_value, exact))
            assert rel_err(got_value, exact) <= bound, (name, rel_err(got_value, exact), bound)
    keys = ROUTED_METRICS if expect_route else tuple(metrics)
    for key in keys:
        assert math.isclose(got_metrics[key], metrics[key], rel_tol=BOUND, abs_tol=BOUND), key
    if expect_route:  # documented: per-vocabulary statistics the fused pass does not keep
        assert not {"logits/chosen", "mean_token_accuracy"} & set(got_metrics)


@pytest.mark.parametrize(
    "config",
    [
        dict(loss_type=["sigmoid"]),
        dict(loss_type=["hinge", "ipo", "sft"], loss_weights=[0.5, 2.0, 1.0], beta=0.3),
        dict(loss_type=["robust"], label_smoothing=0.2),
        dict(loss_type=["exo_pair", "nca_pair"], label_smoothing=0.1),
        dict(loss_type=["bco_pair", "sppo_hard", "apo_zero", "apo_down"]),
        dict(loss_type=["discopop", "sigmoid_norm"]),
        dict(loss_type=["sigmoid"], label_smoothing=0.3),  # TRL's sigmoid ignores it
        dict(loss_type=["sigmoid", "ipo"], f_divergence_type="js_divergence"),
        dict(
            loss_type=["hinge"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5
        ),
        dict(loss_type=["sigmoid"], f_divergence_type="forward_kl"),
    ],
    ids=lambda config: "-".join(
        [
            "+".join(config["loss_type"]),
            *(f"{k}={v}" for k, v in config.items() if k != "loss_type"),
        ]
    ),
)
def test_routed_dpo_matches_trl(tmp_path, routed, config):
    _compare(tmp_path, routed, True, **config)


@pytest.mark.parametrize(
    "config",
    [
        dict(loss_type=["aot"]),
        dict(loss_type=["sigmoid"], use_weighting=True),
        dict(loss_type=["sigmoid"], ld_alpha=0.5),
    ],
    ids=["aot", "wpo", "ld_alpha"],
)
def test_unrouted_dpo_stays_trls(tmp_path, routed, config):
    _compare(tmp_path, routed, False, **config)


def test_changed_trl_dpo_is_refused(monkeypatch):
    """The adapter's check: a DPOTrainer whose loss no longer takes TRL 1.16's arguments."""

    def other(self, model, inputs):
        return None

    monkeypatch.setattr(trl.DPOTrainer, "_compute_loss", other)
    with pytest.raises(lce_trl.UnsupportedTRLVersion, match=r"DPOTrainer._compute_loss takes"):
        lce_trl.patch()
    assert not lce_trl.is_patched()
