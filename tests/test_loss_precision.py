"""Issue 21: half-precision runs report the loss at the accumulation precision (fp32).

References written here: the float64 loss of the same (rounded) hidden states and
weights; the plain expression ``cross_entropy(linear(x, W), t)`` under autocast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err


def _inputs(dtype, seed=0, n=64, f=32, v=300):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g).to(dtype)
    W = (torch.randn(v, f, generator=g) / f**0.5 * 3).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    return x, W, t


def _f64(x, W, t, reduction="mean"):
    return F.cross_entropy(x.double() @ W.double().T, t, reduction=reduction)


def _not_rounded_to(value: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool((value.to(dtype).to(value.dtype) != value).any())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_autocast_returns_fp32_like_autocast_cross_entropy(reduction):
    """Under autocast the loss is fp32 and within 2× the plain autocast expression's error."""
    x, W, t = _inputs(torch.float32, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy(F.linear(x, W), t, reduction=reduction)
        ours = linear_ce.linear_cross_entropy(x, W, t, reduction=reduction)
        ours_bf16 = linear_ce.linear_cross_entropy(
            x.bfloat16(), W.bfloat16(), t, reduction=reduction
        )
    assert plain.dtype == ours.dtype == ours_bf16.dtype == torch.float32
    ref = _f64(x, W, t, reduction)
    assert rel_err(ours, ref) <= max(3 * eps(torch.float32), 2 * rel_err(plain, ref))
    ref_bf16 = _f64(x.bfloat16(), W.bfloat16(), t, reduction)
    assert rel_err(ours_bf16, ref_bf16) <= max(
        3 * eps(torch.bfloat16), 2 * rel_err(plain, ref_bf16)
    )
    assert _not_rounded_to(ours_bf16, torch.bfloat16)


@pytest.mark.parametrize("policy", ["auto", "accurate"])
def test_loss_dtype_reports_the_accumulation_value(policy):
    x, W, t = _inputs(torch.bfloat16, seed=2)
    options = linear_ce.LinearCrossEntropyOptions(acc_policy=policy)
    rounded = linear_ce.linear_cross_entropy(x, W, t, options=options)
    wide = linear_ce.linear_cross_entropy(x, W, t, options=options, loss_dtype=torch.float32)
    assert rounded.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert wide.to(torch.bfloat16) == rounded
    assert _not_rounded_to(wide, torch.bfloat16)
    ref = _f64(x, W, t)
    bound = 3 * eps(torch.float32) if policy == "accurate" else 3 * eps(torch.bfloat16)
    assert rel_err(wide, ref) <= bound


def test_loss_dtype_keeps_gradient_dtypes():
    x, W, t = _inputs(torch.bfloat16, seed=3)
    x.requires_grad_()
    W.requires_grad_()
    loss = linear_ce.linear_cross_entropy(x, W, t, loss_dtype=torch.float32)
    loss.backward()
    assert x.grad.dtype == W.grad.dtype == torch.bfloat16


def test_bad_loss_dtype_is_a_clear_error():
    x, W, t = _inputs(torch.bfloat16)
    with pytest.raises(ValueError, match="loss_dtype must be None, the input dtype"):
        linear_ce.linear_cross_entropy(x, W, t, loss_dtype=torch.float16)


@pytest.fixture
def transformers():
    """transformers, for the tests that need it (only they skip where it is missing)."""
    return pytest.importorskip("transformers")


def _tiny_llama(transformers, dtype):
    config = transformers.LlamaConfig(
        vocab_size=3000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def _hidden_loss64(model, ids, labels, divisor=None):
    """The float64 loss of the model's own (rounded) last hidden states and head."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = hidden[:, :-1].double() @ model.lm_head.weight.double().T
        target = labels[:, 1:].reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, reduction="sum")
    return loss / (divisor if divisor is not None else (target != -100).sum())


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("items", [None, 300])
def test_patched_bf16_model_reports_an_unrounded_loss(transformers, autocast, items):
    from linear_ce.integrations.transformers import patch, unpatch

    model = _tiny_llama(transformers, torch.float32 if autocast else torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 3000, (2, 96), generator=g)
    labels = ids.clone()
    labels[:, :10] = -100
    kwargs = {} if items is None else {"num_items_in_batch": items}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plain = model(input_ids=ids, labels=labels, **kwargs).loss
        patched = patch(model)(input_ids=ids, labels=labels, **kwargs).loss
        unpatch(model)
        if autocast:
            model_bf16 = model.to(torch.bfloat16)
            ref = _hidden_loss64(model_bf16, ids, labels, items)
        else:
            ref = _hidden_loss64(model, ids, labels, items)
    assert patched.dtype == plain.dtype == torch.float32
    assert _not_rounded_to(patched, torch.bfloat16)
    assert rel_err(patched, ref) <= max(3 * eps(torch.float32), 2 * rel_err(plain, ref))
