"""Issue 4: everything torch's builtin falls back on runs chunked here and matches float64.

Label smoothing, probability targets, K-dimensional loss, any leading shape and
int32 targets, each against torch's plain expression
``F.cross_entropy(F.linear(x, W, b).view(...), t, ...)`` evaluated in float64
on the same (rounded) inputs, for the loss and every gradient.
"""

from __future__ import annotations

import itertools
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from memory_probe import transient_peak

REDUCTIONS = ("mean", "sum", "none")
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FEATURES = ("smoothing", "prob", "prob_smoothing", "kdim", "kdim_prob", "leading", "int32")
IGNORE = -100
#: Several chunks per call, with a ragged last one, in every grid case.
CHUNKED = LinearCrossEntropyOptions(batch_chunk_size=5)


def _tolerance(dtype: torch.dtype) -> float:
    """3·eps(dtype); in float64 the reference rounds as much as the result does (up to
    1.5·eps against an 80-bit evaluation), so their distance gets that reference's share."""
    return (6 if dtype == torch.float64 else 3) * eps(dtype)


def _dyadic(t: torch.Tensor, scale: int) -> torch.Tensor:
    return torch.round(t * 4) / scale


def _make(
    feature: str, dtype: torch.dtype, *, class_weight: bool, ignore: bool, bias: bool, seed: int
) -> dict:
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
        "x": x,
        "W": W,
        "b": b,
        "target": target,
        "weight": cw,
        "label_smoothing": smoothing,
        "ignore_index": IGNORE if ignore and not prob else None,
        "prob": prob,
        "out_features": out_features,
        "num_classes": num_classes,
        "loss_shape": loss_shape,
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
        x,
        W,
        case["target"],
        linear_bias=b,
        weight=case["weight"],
        reduction=reduction,
        ignore_index=case["ignore_index"],
        label_smoothing=case["label_smoothing"],
        options=options,
        **extra,
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
def test_feature_matches_float64_plain_expression(
    feature, reduction, class_weight, ignore, bias, dtype
):
    case = _make(
        feature,
        dtype,
        class_weight=class_weight,
        ignore=ignore,
        bias=bias,
        seed=zlib.crc32(repr((feature, reduction, class_weight, ignore, bias)).encode()),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning, nor any other
        got = _ours(case, reduction)
    assert got[0].dtype == dtype
    _assert_close(
        got,
        _plain64(case, reduction),
        _tolerance(dtype),
        f"{feature} {reduction} cw={class_weight} ignore={ignore} bias={bias}",
    )


@pytest.mark.parametrize("feature", ("smoothing", "prob", "prob_smoothing", "kdim", "kdim_prob"))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_chunk_size_invariance_float64(feature, reduction):
    case = _make(
        feature,
        torch.float64,
        class_weight=True,
        ignore="prob" not in feature,
        bias=True,
        seed=zlib.crc32(feature.encode()),
    )
    rows = case["x"].shape[0]
    whole = _ours(case, reduction, LinearCrossEntropyOptions(batch_chunk_size=rows))
    ref = _plain64(case, reduction)
    _assert_close(whole, ref, _tolerance(torch.float64), f"{feature} one chunk")
    for size in (1, 2, 3, 5):
        got = _ours(case, reduction, LinearCrossEntropyOptions(batch_chunk_size=size))
        _assert_close(got, whole, 4 * eps(torch.float64), f"{feature} chunk {size} vs one chunk")
        _assert_close(got, ref, _tolerance(torch.float64), f"{feature} chunk {size}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_batch_time_input_keeps_its_shape(reduction):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 8, generator=g, requires_grad=True)
    W = torch.randn(11, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (2, 3, 5), generator=g)
    loss = linear_ce.linear_cross_entropy(x, W, t, reduction=reduction)
    ref = F.cross_entropy(
        F.linear(x.double(), W.double()).view(-1, 11), t.view(-1), reduction=reduction
    )
    if reduction == "none":
        assert loss.shape == (2, 3, 5)
        ref = ref.view(2, 3, 5)
    assert rel_err(loss, ref) <= 3 * eps(torch.float32)


def test_batch_time_input_is_not_copied():
    from linear_ce.checks.call import HeadArguments, LossArguments, TransformArguments, check_call

    x = torch.randn(2, 6, 8)
    t = torch.randint(0, 11, (2, 6))
    transform = TransformArguments(1.0, 1.0, None)
    terms = LossArguments(None, "mean", 0.0, 0.0, None)
    for shift in (False, True):
        head = HeadArguments(x, torch.randn(11, 8), t, None, None, shift)
        call = check_call("linear_cross_entropy", head, transform, terms)
        assert call.input.data_ptr() == x.data_ptr()
        assert call.input.shape == (12, 8)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("prob", (False, True))
def test_one_dimensional_input_like_torch(reduction, prob):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = (
        torch.softmax(torch.randn(11, generator=g, dtype=torch.float64), 0)
        if prob
        else torch.tensor(4)
    )
    loss = linear_ce.linear_cross_entropy(x, W, t, reduction=reduction, label_smoothing=0.1)
    x64, W64 = x.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(x64, W64), t, reduction=reduction, label_smoothing=0.1)
    assert loss.shape == ref.shape == ()
    loss.backward()
    ref.backward()
    for got, want in ((loss, ref), (x.grad, x64.grad), (W.grad, W64.grad)):
        assert rel_err(got, want) <= _tolerance(torch.float64)


_VIEWS = {
    "strided features": ((19, 12), lambda base: base[:, ::2]),
    "transposed (T, B) to (B, T)": ((5, 3, 6), lambda base: base.transpose(0, 1)),
    "row slice": ((40, 6), lambda base: base[3:37:2]),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("view", list(_VIEWS))
def test_non_contiguous_input_view(view, reduction):
    g = torch.Generator().manual_seed(3)
    base_shape, pick = _VIEWS[view]
    base = torch.randn(base_shape, generator=g, dtype=torch.float64, requires_grad=True)
    base_ref = base.detach().clone().requires_grad_()
    W = torch.randn(13, 6, generator=g, dtype=torch.float64, requires_grad=True)
    W_ref = W.detach().clone().requires_grad_()
    assert not pick(base).is_contiguous()
    t = torch.randint(0, 13, pick(base).shape[:-1], generator=g)
    loss = linear_ce.linear_cross_entropy(
        pick(base), W, t, reduction=reduction, label_smoothing=0.1, options=CHUNKED
    )
    ref = F.cross_entropy(
        F.linear(pick(base_ref), W_ref).reshape(-1, 13),
        t.reshape(-1),
        reduction=reduction,
        label_smoothing=0.1,
    )
    upstream = None
    if reduction == "none":
        ref = ref.view(t.shape)
        upstream = torch.randn(t.shape, generator=g, dtype=torch.float64)
    assert loss.shape == ref.shape
    loss.backward(upstream)
    ref.backward(upstream)
    for got, want in ((loss, ref), (base.grad, base_ref.grad), (W.grad, W_ref.grad)):
        assert rel_err(got, want) <= _tolerance(torch.float64)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_int32_targets_equal_int64(reduction):
    case = _make("smoothing", torch.float32, class_weight=True, ignore=True, bias=True, seed=4)
    as64 = _ours(case, reduction)
    case["target"] = case["target"].to(torch.int32)
    as32 = _ours(case, reduction)
    assert torch.equal(as32[0], as64[0])
    for g32, g64 in zip(as32[1], as64[1], strict=True):
        assert torch.equal(g32, g64)


@pytest.mark.parametrize("feature", FEATURES)
def test_no_warning_with_default_options(feature):
    """Default options (``options=None``) and the module: chunked, silent, correct."""
    case = _make(
        feature, torch.float32, class_weight=True, ignore="prob" not in feature, bias=False, seed=5
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _ours(case, "mean", options=None)
    _assert_close(got, _plain64(case, "mean"), _tolerance(torch.float32), feature)


_UNSUPPORTED = {
    "probability target that requires grad": (
        lambda x, W, probs, labels: {"target": probs.requires_grad_()},
        "requires grad",
    ),
    "ignore_index with probability targets": (
        lambda x, W, probs, labels: {"target": probs, "ignore_index": 0},
        "ignore_index",
    ),
    "shift with a K-dimensional loss": (
        lambda x, W, probs, labels: {
            "linear_weight": torch.randn(11, 2, 8),
            "shift": True,
            "target": torch.zeros(4, 2, dtype=torch.long),
        },
        "shift",
    ),
}


@pytest.mark.parametrize("name", list(_UNSUPPORTED))
def test_what_cannot_run_chunked_is_an_error_not_a_fallback(name):
    x, W = torch.randn(4, 8), torch.randn(11, 8)
    probs, labels = torch.softmax(torch.randn(4, 11), 1), torch.randint(0, 11, (4,))
    make, word = _UNSUPPORTED[name]
    kwargs = {"linear_weight": W, "target": labels, **make(x, W, probs, labels)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=word):
            linear_ce.linear_cross_entropy(x, **kwargs)


# --- memory -----------------------------------------------------------------------------------

_N, _F, _V = 4096, 256, 50000
_LOGITS_BYTES = _N * _V * 4
_MEMORY_SETUP = """
import torch, linear_ce
torch.manual_seed(0)
N, F_, V = {n}, {f}, {v}
W = (torch.randn(V, F_) / 16).requires_grad_()
x = torch.randn({shape}, F_).requires_grad_()
t = {target}
# load the kernels with a tiny call, so one-time library set-up is not counted
warm = torch.randn(8, F_, requires_grad=True)
linear_ce.linear_cross_entropy(warm, W, torch.randint(0, V, (8,)), label_smoothing=0.1).backward()
W.grad = None
"""
_MEMORY_CASES = {
    "label smoothing": ("N", "torch.randint(0, V, (N,))", "label_smoothing=0.1"),
    # in place, so no N x V temporary of the set-up is left in the allocator
    "probability target": ("N", "torch.rand(N, V).div_(V / 2)", ""),
    "(B, T, F) input": ("4, N // 4", "torch.randint(0, V, (4, N // 4))", ""),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_MEMORY_CASES))
def test_transient_memory_is_a_fraction_of_the_logits(name):
    shape, target, kwargs = _MEMORY_CASES[name]
    setup = _MEMORY_SETUP.format(n=_N, f=_F, v=_V, shape=shape, target=target)
    peak = transient_peak(setup, f"linear_ce.linear_cross_entropy(x, W, t, {kwargs}).backward()")
    assert peak < 0.25 * _LOGITS_BYTES, (
        f"{name}: forward+backward grew RSS by {peak / 1e6:.0f} MB, "
        f"{peak / _LOGITS_BYTES:.1%} of the {_LOGITS_BYTES / 1e6:.0f} MB logits"
    )
