"""TRL's KTO loss routed through ``linear_ce.sequence_objective`` (integrations/trl_kto).

One batch of a real ``trl.KTOTrainer`` on a tiny random Llama (test_trl's model and
tokenizer): ``compute_loss`` and its backward unpatched (TRL's own loss on TRL's kernel)
and patched (the fused sequence pass), for both loss types, weighted, with a live and a
precomputed reference: the loss and every parameter's gradient against TRL's loss typed
again in float64 from the full logits, the logged values equal to TRL's. A call TRL's route
keeps (``return_outputs=True``) must not reach the sequence objective and must give TRL's
own results.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'linear-ce[trl]'")

from datasets import Dataset  # noqa: E402

from conftest import eps, rel_err  # noqa: E402
from linear_ce import LinearCrossEntropyOptions  # noqa: E402
from linear_ce.integrations import trl as lce_trl  # noqa: E402
from test_trl import _common, _llama, _sentences, _tokenizer  # noqa: E402
from trl_routes import routed_fixture, unpatched_fixture  # noqa: E402, F401 (fixtures)

# Logged values of both runs (fp32 heads, the same weights): TRL sums the log-probs in
# fp32, the route in float64; a handful of fp32 roundings of values of order one.
BOUND = 16 * eps(torch.float32)
# Means over every vocabulary entry, which the fused pass does not form (documented).
NOT_LOGGED = {"logits/chosen", "logits/rejected"}


def _trainer(tmp_path, ref_scale=4.0, **config):
    args = trl.KTOConfig(**{**_common(tmp_path), "per_device_train_batch_size": 6, **config})
    data = Dataset.from_dict(
        {
            "prompt": _sentences(6, 3, 5, 1),
            "completion": _sentences(6, 2, 6, 2),
            "label": [True, False, True, True, False, False],
        }
    )
    ref_model = _llama(seed=1)
    with torch.no_grad():  # 4: a sharper reference, a positive KL estimate, unclamped
        ref_model.lm_head.weight.mul_(ref_scale)
    return trl.KTOTrainer(
        model=_llama(),
        ref_model=ref_model,
        args=args,
        train_dataset=data,
        processing_class=_tokenizer(),
    )


def _step(trainer, inputs, return_outputs=False) -> tuple[torch.Tensor, dict, dict]:
    """Loss, every parameter's gradient and the metrics logged by one compute_loss."""
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    trainer._total_train_tokens = 0
    loss = trainer.compute_loss(trainer.model, inputs, return_outputs=return_outputs)
    loss = loss[0] if return_outputs else loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def _sums(model, ids, mask, completion_mask):
    """Each completion's summed log-probability, from the full logits."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    logp = torch.log_softmax(hidden @ model.lm_head.weight.T, -1)
    token = logp.gather(-1, ids[:, 1:, None])[..., 0]
    return torch.where(completion_mask[:, 1:].bool(), token, 0.0).sum(1)


def _float64(trainer, inputs) -> tuple[torch.Tensor, dict]:
    """TRL 1.16's KTO loss, typed from the paper and the trainer, in float64."""
    model = copy.deepcopy(trainer.model).double()
    ref_model = copy.deepcopy(trainer.ref_model).double()
    main = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
    with torch.no_grad():
        ref = _sums(ref_model, *main)
        if trainer.loss_type == "kto":  # the reference point: the batch's KL estimate
            mismatched = (
                inputs["KL_input_ids"],
                inputs["KL_attention_mask"],
                inputs["KL_completion_mask"],
            )
            kl = (_sums(model, *mismatched) - _sums(ref_model, *mismatched)).mean().clamp(min=0)
    rho = _sums(model, *main) - ref
    label = torch.as_tensor(inputs["label"], dtype=torch.bool)
    beta = trainer.beta
    if trainer.loss_type == "kto":
        good, bad = 1 - torch.sigmoid(beta * (rho - kl)), 1 - torch.sigmoid(beta * (kl - rho))
    else:
        good, bad = 1 - torch.sigmoid(beta * rho), torch.sigmoid(beta * rho)
    losses = torch.where(label, trainer.desirable_weight * good, trainer.undesirable_weight * bad)
    loss = losses.mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compare(
    tmp_path,
    routed,
    expect_route: bool,
    return_outputs=False,
    options=None,
    ref_scale=4.0,
    **config,
):
    trainer = _trainer(tmp_path, ref_scale, **config)
    trainer.model.train()
    inputs = next(iter(trainer.get_train_dataloader()))
    loss, grads, metrics = _step(trainer, inputs, return_outputs)
    routed.update(sequence=0, kernel=0)
    with lce_trl.patched(options):
        got, got_grads, got_metrics = _step(trainer, inputs, return_outputs)
    assert routed["kernel"] == 0
    assert routed["sequence"] == (1 if expect_route else 0), routed
    pairs = [(got, loss, "loss"), *((got_grads[n], grads[n], n) for n in grads)]
    if not expect_route:  # TRL's loss on the patched head: as test_trl, within BOUND
        for got_value, trl_value, name in pairs:
            assert rel_err(got_value, trl_value) <= BOUND, name
        assert got_metrics.keys() == metrics.keys()
    else:
        # House rule: within 3 eps of float64, or twice TRL's own fp32 error where that
        # is larger (the backbone's fp32 forward and backward round in both runs).
        want, want_grads = _float64(trainer, inputs)
        for got_value, trl_value, name in pairs:
            exact = want if name == "loss" else want_grads[name]
            bound = max(3 * eps(torch.float32), 2 * rel_err(trl_value, exact))
            assert rel_err(got_value, exact) <= bound, (name, rel_err(got_value, exact), bound)
        assert got_metrics.keys() == metrics.keys() - NOT_LOGGED
    for key in got_metrics:
        assert math.isclose(got_metrics[key], metrics[key], rel_tol=BOUND, abs_tol=BOUND), key
    return metrics


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(beta=0.3, desirable_weight=1.33, undesirable_weight=0.7),
        dict(loss_type="apo_zero_unpaired"),
        dict(precompute_ref_log_probs=True),
    ],
    ids=["kto", "kto-weighted", "apo_zero_unpaired", "precomputed_ref"],
)
def test_routed_kto_matches_trl(tmp_path, routed, config):
    metrics = _compare(tmp_path, routed, True, **config)
    if config.get("loss_type", "kto") == "kto":  # the reference point is in play
        assert metrics["kl"] > 0


def test_routed_kto_in_many_chunks(tmp_path, routed):
    """Chunks of 4 scored tokens: a completion per chunk (longer ones take the four-GEMM
    path), the objective and the entropy summed over every chunk."""
    options = LinearCrossEntropyOptions(batch_chunk_size=4, chunking_method=None)
    metrics = _compare(tmp_path, routed, True, options=options)
    assert metrics["kl"] > 0


def test_routed_kto_clamps_a_negative_kl_estimate(tmp_path, routed):
    """A uniform reference (its head zeroed): on this batch the policy's summed
    log-probabilities of the mismatched completions are below the uniform ones (as Jensen's
    inequality has it on average), a negative KL estimate that TRL clamps to 0, and so must
    the route (TRL's logged ``kl`` is exactly 0 only where it clamped)."""
    metrics = _compare(tmp_path, routed, True, ref_scale=0.0)
    assert metrics["kl"] == 0.0


def test_return_outputs_stays_trls(tmp_path, routed):
    with pytest.warns(FutureWarning, match="return_outputs"):
        _compare(tmp_path, routed, False, return_outputs=True)


def test_changed_trl_kto_is_refused(monkeypatch):
    """The adapter's check: a KTOTrainer whose loss no longer takes TRL 1.16's arguments."""

    def other(self, model, inputs):
        return None

    monkeypatch.setattr(trl.KTOTrainer, "_compute_loss", other)
    with pytest.raises(lce_trl.UnsupportedTRLVersion, match=r"KTOTrainer._compute_loss takes"):
        lce_trl.patch()
    assert not lce_trl.is_patched()
