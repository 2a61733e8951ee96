"""Issue 4: everything torch's builtin falls back on runs chunked here and matches float64.

Label smoothing, probability targets, K-dimensional loss, any leading shape and
int32 targets, each against torch's plain expression
``F.cross_entropy(F.linear(x, W, b).view(...), t, ...)`` evaluated in float64
on the same (rounded) inputs, for the loss and every gradient.
"""

from __future__ import annotations

import itertools
import math
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from conftest import eps, rel_err
from memory_probe import transient_peak

import linear_ce
from linear_ce import LinearCrossEntropyOptions

REDUCTIONS = ("mean", "sum", "none")
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FEATURES = ("smoothing", "prob", "prob_smoothing", "kdim", "kdim_prob", "leading", "int32")
IGNORE = -100
#: Several chunks per call, with a ragged last one, in every grid case.
CHUNKED = LinearCrossEntropyOptions(batch_chunk_size=5)


def _tolerance(dtype: torch.dtype) -> float:
    return 3 * eps(dtype)


def _dyadic(t: torch.Tensor, scale: int) -> torch.Tensor:
    return torch.round(t * 4) / scale


def _make(feature: str, dtype: torch.dtype, *, class_weight: bool, ignore: bool, bias: bool,
          seed: int) -> dict:
    """Random inputs for one case: leaves in ``dtype``, targets, and how to view the logits."""
    g = torch.Generator().manual_seed(seed)
    batch = {"leading": (3, 7), "kdim": (13,), "kdim_prob": (11,)}.get(feature, (23,))
    out_features = (2, 3) if feature.startswith("kdim") else ()
    num_classes, in_features = 17, 9
    x = _dyadic(torch.randn(*batch, in_features, generator=g), 4).to(dtype)
    W = _dyadic(torch.randn(num_classes, *out_features, in_features, generator=g), 8).to(dtype)
    b = _dyadic(torch.randn(num_classes, *out_features, generator=g), 8).to(dtype) if bias else None
    loss_shape = (*batch, *out_features)
    prob = "prob" in feature
    if prob:
        logits_shape = (*batch, num_classes, *out_features)
        target = torch.softmax(2 * torch.randn(logits_shape, generator=g), dim=len(batch)).to(dtype)
    else:
        target = torch.randint(0, num_classes, loss_shape, generator=g)
        if ignore:
            target[torch.rand(loss_shape, generator=g) < 0.3] = IGNORE
        if feature == "int32":
            target = target.to(torch.int32)
    cw = (torch.rand(num_classes, generator=g) + 0.5).to(dtype) if class_weight else None
    smoothing = {"smoothing": 0.1, "prob_smoothing": 0.2, "kdim": 0.05}.get(feature, 0.0)
    return {
        "x": x, "W": W, "b": b, "target": target, "weight": cw, "label_smoothing": smoothing,
        "ignore_index": IGNORE if ignore and not prob else None, "prob": prob,
        "out_features": out_features, "num_classes": num_classes, "loss_shape": loss_shape,
        "grad_output": torch.randn(loss_shape, generator=g).to(dtype),
    }


def _plain64(case: dict, reduction: str) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """torch's plain expression in float64 on the case's values; loss and grads (x, W, b)."""
    x = case["x"].detach().double().requires_grad_()
    W = case["W"].detach().double().requires_grad_()
    b = None if case["b"] is None else case["b"].detach().double().requires_grad_()
    num_classes, out_features = case["num_classes"], case["out_features"]
    logits = F.linear(x, W.reshape(-1, W.shape[-1]), None if b is None else b.reshape(-1))
    target = case["target"].double() if case["prob"] else case["target"].long()
    weight = None if case["weight"] is None else case["weight"].double()
    kwargs = {"weight": weight, "label_smoothing": case["label_smoothing"], "reduction": reduction}
    if case["ignore_index"] is not None:
        kwargs["ignore_index"] = case["ignore_index"]
    if x.dim() > 2:  # cross_entropy wants classes at dim 1: flatten the leading dims
        logits = logits.view(-1, num_classes)
        target = target.reshape(-1, num_classes) if case["prob"] else target.reshape(-1)
        loss = F.cross_entropy(logits, target, **kwargs)
        if reduction == "none":
            loss = loss.view(case["loss_shape"])
    else:
        logits = logits.view(*x.shape[:-1], num_classes, *out_features)
        loss = F.cross_entropy(logits, target, **kwargs)
    loss.backward(case["grad_output"].double() if reduction == "none" else None)
    return loss.detach(), [x.grad, W.grad, None if b is None else b.grad]


def _ours(case: dict, reduction: str, options=CHUNKED, **extra) -> tuple[torch.Tensor, list]:
    x = case["x"].detach().clone().requires_grad_()
    W = case["W"].detach().clone().requires_grad_()
    b = None if case["b"] is None else case["b"].detach().clone().requires_grad_()
    loss = linear_ce.linear_cross_entropy(
        x, W, case["target"], linear_bias=b, weight=case["weight"], reduction=reduction,
        ignore_index=case["ignore_index"], label_smoothing=case["label_smoothing"],
        options=options, **extra,
    )
    loss.backward(case["grad_output"] if reduction == "none" else None)
    return loss.detach(), [x.grad, W.grad, None if b is None else b.grad]


def _assert_close(got, ref, tol: float, what: str = "") -> None:
    loss, grads = got
    ref_loss, ref_grads = ref
    assert loss.shape == ref_loss.shape, what
    errors = {"loss": rel_err(loss, ref_loss)}
    for name, g, r in zip(("input", "weight", "bias"), grads, ref_grads, strict=True):
        assert (g is None) == (r is None), (what, name)
        if r is not None:
            assert g.shape == r.shape, (what, name)
            errors[name] = rel_err(g, r)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"{what}: relative errors {bad} exceed {tol:.2e}"


GRID = [
    (feature, reduction, class_weight, ignore, bias)
    for feature, reduction, class_weight, ignore, bias in itertools.product(
        FEATURES, REDUCTIONS, (False, True), (False, True), (False, True)
    )
    if not (ignore and "prob" in feature)  # torch forbids ignore_index with probabilities
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("feature", "reduction", "class_weight", "ignore", "bias"), GRID)
def test_feature_matches_float64_plain_expression(feature, reduction, class_weight, ignore, bias,
                                                 dtype):
    case = _make(feature, dtype, class_weight=class_weight, ignore=ignore, bias=bias,
                 seed=zlib.crc32(repr((feature, reduction, class_weight, ignore, bias)).encode()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning, nor any other
        got = _ours(case, reduction)
    assert got[0].dtype == dtype
    _assert_close(got, _plain64(case, reduction), _tolerance(dtype),
                  f"{feature} {reduction} cw={class_weight} ignore={ignore} bias={bias}")
