"""Every combination of options, for the chunked function and for the reference, in float64.

Both ``linear_ce.linear_cross_entropy`` (three ragged chunks per call) and
``linear_ce.reference.linear_cross_entropy`` (the plain expression the docs
call the definition) are checked against the formula of ``loss_formula``,
written independently of both: loss, z-loss term, lse and every gradient
within ``6·eps(float64)`` (the formula rounds as much as the result does).

The grid: both output layouts (one position; K-dimensional ``(2, 3)``), both
target kinds and every reduction, each with no extra, each extra alone and all
extras together — so each pair of extras is seen both on, each on with the
other off, and both off. The extras: token weights, softcap, logit scale,
temperature, z-loss, label smoothing, class weights, bias, the returned lse and
z-loss term, ignored rows (class-index targets) and shift (class-index targets
without K-dimensional positions, the only place it is accepted).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions, reference
from loss_formula import loss_formula

REDUCTIONS = ("mean", "sum", "none")
BATCH, FEATURES, CLASSES = (2, 4), 5, 7
OUT_FEATURES = {"flat": (), "kdim": (2, 3)}
IGNORE_INDEX = 3
TOL = 6 * eps(torch.float64)
FUNCTIONS = {
    "chunked": lambda *a, **k: linear_ce.linear_cross_entropy(
        *a, options=LinearCrossEntropyOptions(batch_chunk_size=3), **k
    ),
    "reference": reference.linear_cross_entropy,
}


def _extras(layout: str, prob: bool) -> tuple[str, ...]:
    extras = [
        "token_weight",
        "softcap",
        "logit_scale",
        "temperature",
        "z_loss",
        "smoothing",
        "class_weight",
        "bias",
        "returns",
    ]
    if not prob:
        extras.append("ignore")
        if layout == "flat":
            extras.append("shift")
    return tuple(extras)


def _grid():
    for layout, prob, reduction in itertools.product(OUT_FEATURES, (False, True), REDUCTIONS):
        extras = _extras(layout, prob)
        for chosen in [(), *[(e,) for e in extras], extras]:
            name = "+".join(chosen) or "plain"
            yield pytest.param(
                layout,
                prob,
                reduction,
                chosen,
                id=f"{layout}-{reduction}-{'prob' if prob else 'index'}-{name}",
            )


def _case(layout: str, prob: bool, reduction: str, chosen: tuple[str, ...]) -> dict:
    g = torch.Generator().manual_seed(zlib.crc32(repr((layout, prob, reduction, chosen)).encode()))
    out = OUT_FEATURES[layout]
    loss_shape = (*BATCH, *out)
    x = torch.randn(*BATCH, FEATURES, generator=g, dtype=torch.float64)
    W = torch.randn(CLASSES, *out, FEATURES, generator=g, dtype=torch.float64) / 2
    if prob:
        target = torch.softmax(
            2 * torch.randn(*BATCH, CLASSES, *out, generator=g, dtype=torch.float64),
            dim=len(BATCH),
        )
    else:
        target = torch.randint(0, CLASSES, loss_shape, generator=g)
        if "ignore" in chosen:
            target[torch.rand(loss_shape, generator=g) < 0.3] = IGNORE_INDEX
            target.view(-1)[0] = IGNORE_INDEX
    kwargs: dict = {"reduction": reduction}
    if "ignore" in chosen:
        kwargs["ignore_index"] = IGNORE_INDEX
    if "bias" in chosen:
        kwargs["linear_bias"] = torch.randn(CLASSES, *out, generator=g, dtype=torch.float64)
    if "class_weight" in chosen:
        kwargs["weight"] = torch.rand(CLASSES, generator=g, dtype=torch.float64) + 0.3
    if "smoothing" in chosen:
        kwargs["label_smoothing"] = 0.2
    if "z_loss" in chosen:
        kwargs["z_loss"] = 0.05
    if "softcap" in chosen:
        kwargs["softcap"] = 1.5
    if "logit_scale" in chosen:
        kwargs["logit_scale"] = 1.7
    if "temperature" in chosen:
        kwargs["temperature"] = 0.6
    if "shift" in chosen:
        kwargs["shift"] = 1
    if "token_weight" in chosen:
        # Distinct per position (and zero on some): a weight taken from the wrong
        # position, or ignored, changes the result.
        kwargs["token_weight"] = 2 * torch.rand(loss_shape, generator=g, dtype=torch.float64)
        kwargs["token_weight"].view(-1)[1] = 0.0
    returns = "returns" in chosen
    upstream = torch.rand(loss_shape, generator=g, dtype=torch.float64) + 0.5
    return {
        "x": x,
        "W": W,
        "target": target,
        "kwargs": kwargs,
        "returns": returns,
        "upstream": upstream if reduction == "none" else torch.tensor(0.7, dtype=torch.float64),
    }


def _expected(case: dict):
    kw = dict(case["kwargs"])
    return loss_formula(
        case["x"],
        case["W"],
        case["target"],
        b=kw.pop("linear_bias", None),
        class_weight=kw.pop("weight", None),
        ignore_index=kw.pop("ignore_index", -100),
        upstream=case["upstream"],
        **kw,
    )


def _run(fn, case: dict):
    x = case["x"].clone().requires_grad_()
    W = case["W"].clone().requires_grad_()
    kwargs = dict(case["kwargs"])
    b = kwargs.pop("linear_bias", None)
    if b is not None:
        b = b.clone().requires_grad_()
    result = fn(
        x,
        W,
        case["target"],
        linear_bias=b,
        return_lse=case["returns"],
        return_z_loss=case["returns"],
        **kwargs,
    )
    loss = result.loss if case["returns"] else result
    loss.backward(case["upstream"])
    return result, [x.grad, W.grad, None if b is None else b.grad]


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize(("layout", "prob", "reduction", "chosen"), list(_grid()))
def test_combination_matches_float64_formula(function, layout, prob, reduction, chosen):
    case = _case(layout, prob, reduction, chosen)
    want = _expected(case)
    result, grads = _run(FUNCTIONS[function], case)
    got = {"loss": result.loss if case["returns"] else result}
    if case["returns"]:
        assert isinstance(result, linear_ce.LinearCrossEntropyOutput)
        got["z_loss"], got["lse"] = result.z_loss, result.lse
    else:
        assert isinstance(result, torch.Tensor)
    errors = {}
    for name, value in got.items():
        ref = getattr(want, name)
        assert value.shape == ref.shape, (name, tuple(value.shape), tuple(ref.shape))
        # The z-loss term is for logging; the lse carries its gradient (test_lse_gradient.py).
        assert not value.requires_grad or name != "z_loss", f"{name} must be detached"
        errors[name] = rel_err(value, ref)
    for name, g, ref in zip(
        ("grad_input", "grad_weight", "grad_bias"), grads, want.grads, strict=True
    ):
        assert (g is None) == (ref is None), name
        if ref is not None:
            assert g.shape == ref.shape, name
            errors[name] = rel_err(g, ref)
    bad = {k: f"{v / eps(torch.float64):.1f} eps" for k, v in errors.items() if not v <= TOL}
    assert not bad, f"{function} {layout} {reduction} {chosen}: {bad}"
