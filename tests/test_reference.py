"""linear_ce.reference.linear_cross_entropy is the plain torch expression, over the whole input space.

Each test writes ``F.cross_entropy(F.linear(...))`` itself and compares loss and
gradients in float64.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce import reference

N, FEAT, C = 11, 5, 7
TOL = 3 * eps(torch.float64)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]


def _compare(got_fn, ref_fn, x, W, b, reduction, seed=1):
    """Loss and gradients of both functions on fresh leaves; backward with a random upstream."""
    results = []
    for fn in (got_fn, ref_fn):
        xs, Ws, bs = _leaves(x, W, b)
        loss = fn(xs, Ws, bs)
        gen = torch.Generator().manual_seed(seed)
        upstream = torch.rand(loss.shape, generator=gen, dtype=loss.dtype) + 0.5
        params = [t for t in (xs, Ws, bs) if t is not None]
        grads = torch.autograd.grad(loss, params, upstream)
        results.append((loss.detach(), grads))
    (loss, grads), (ref_loss, ref_grads) = results
    assert loss.shape == ref_loss.shape
    if reduction == "mean" and torch.isnan(ref_loss).all():
        assert torch.isnan(loss).all()
    else:
        assert rel_err(loss, ref_loss) <= TOL
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) <= TOL


def _targets(gen, shape, ignore_index):
    t = torch.randint(0, C, shape, generator=gen)
    ignored = -100 if ignore_index is None else ignore_index
    flat = t.view(-1)
    flat[::3] = ignored  # a third of the rows ignored, at least one not
    return t


@pytest.mark.parametrize(
    ("reduction", "class_weight", "ignore_index", "smoothing", "bias"),
    list(
        itertools.product(
            ["mean", "sum", "none"], [False, True], [None, 2, 1000, -5], [0.0, 0.3], [False, True]
        )
    ),
)
def test_class_index_targets(reduction, class_weight, ignore_index, smoothing, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, FEAT, generator=gen, dtype=torch.float64)
    W = torch.randn(C, FEAT, generator=gen, dtype=torch.float64)
    b = torch.randn(C, generator=gen, dtype=torch.float64) if bias else None
    w = torch.rand(C, generator=gen, dtype=torch.float64) + 0.1 if class_weight else None
    t = _targets(gen, (N,), ignore_index)
    ii = {} if ignore_index is None else {"ignore_index": ignore_index}

    def got(xs, Ws, bs):
        return reference.linear_cross_entropy(
            xs,
            Ws,
            t,
            linear_bias=bs,
            weight=w,
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=smoothing,
        )

    def ref(xs, Ws, bs):
        return F.cross_entropy(
            F.linear(xs, Ws, bs), t, weight=w, reduction=reduction, label_smoothing=smoothing, **ii
        )

    _compare(got, ref, x, W, b, reduction)


@pytest.mark.parametrize(
    ("reduction", "class_weight", "smoothing", "bias"),
    list(itertools.product(["mean", "sum", "none"], [False, True], [0.0, 0.2], [False, True])),
)
def test_probability_targets(reduction, class_weight, smoothing, bias):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, FEAT, generator=gen, dtype=torch.float64)
    W = torch.randn(C, FEAT, generator=gen, dtype=torch.float64)
    b = torch.randn(C, generator=gen, dtype=torch.float64) if bias else None
    w = torch.rand(C, generator=gen, dtype=torch.float64) + 0.1 if class_weight else None
    q = torch.softmax(torch.randn(N, C, generator=gen, dtype=torch.float64), dim=1)

    def got(xs, Ws, bs):
        return reference.linear_cross_entropy(
            xs, Ws, q, linear_bias=bs, weight=w, reduction=reduction, label_smoothing=smoothing
        )

    def ref(xs, Ws, bs):
        return F.cross_entropy(
            F.linear(xs, Ws, bs), q, weight=w, reduction=reduction, label_smoothing=smoothing
        )

    _compare(got, ref, x, W, b, reduction)


@pytest.mark.parametrize(
    ("reduction", "out_features", "probabilities", "bias"),
    list(itertools.product(["mean", "sum", "none"], [(3,), (2, 3)], [False, True], [False, True])),
)
def test_k_dimensional(reduction, out_features, probabilities, bias):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(N, FEAT, generator=gen, dtype=torch.float64)
    W = torch.randn(C, *out_features, FEAT, generator=gen, dtype=torch.float64)
    b = torch.randn(C, *out_features, generator=gen, dtype=torch.float64) if bias else None
    w = torch.rand(C, generator=gen, dtype=torch.float64) + 0.1
    if probabilities:
        t = torch.softmax(
            torch.randn(N, C, *out_features, generator=gen, dtype=torch.float64), dim=1
        )
        ii = {}
    else:
        t = torch.randint(0, C, (N, *out_features), generator=gen)
        t.view(-1)[::4] = 1000
        ii = {"ignore_index": 1000}

    def got(xs, Ws, bs):
        return reference.linear_cross_entropy(
            xs, Ws, t, linear_bias=bs, weight=w, reduction=reduction, label_smoothing=0.1, **ii
        )

    def ref(xs, Ws, bs):
        # The K-dim layout: logits (N, C, d1..dK) from the flattened (C·P, F) weight.
        logits = F.linear(xs, Ws.reshape(-1, FEAT), None if bs is None else bs.reshape(-1)).view(
            N, C, *out_features
        )
        return F.cross_entropy(logits, t, weight=w, reduction=reduction, label_smoothing=0.1, **ii)

    _compare(got, ref, x, W, b, reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("target_kind", ["index", "ignored", "probabilities"])
def test_one_dimensional_input(reduction, target_kind):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(FEAT, generator=gen, dtype=torch.float64)
    W = torch.randn(C, FEAT, generator=gen, dtype=torch.float64)
    b = torch.randn(C, generator=gen, dtype=torch.float64)
    if target_kind == "probabilities":
        t = torch.softmax(torch.randn(C, generator=gen, dtype=torch.float64), dim=0)
    else:
        t = torch.tensor(4 if target_kind == "index" else -100)

    def got(xs, Ws, bs):
        return reference.linear_cross_entropy(xs, Ws, t, linear_bias=bs, reduction=reduction)

    def ref(xs, Ws, bs):
        return F.cross_entropy(F.linear(xs, Ws, bs), t, reduction=reduction)

    _compare(got, ref, x, W, b, reduction)


def test_batch_dimensions_flatten_like_torch():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, FEAT, generator=gen, dtype=torch.float64)
    W = torch.randn(C, FEAT, generator=gen, dtype=torch.float64)
    t = torch.randint(0, C, (2, 3), generator=gen)

    def got(xs, Ws, bs):
        return reference.linear_cross_entropy(xs, Ws, t, reduction="none")

    def ref(xs, Ws, bs):
        return F.cross_entropy(F.linear(xs, Ws).reshape(6, C), t.reshape(6), reduction="none").view(
            2, 3
        )

    _compare(got, ref, x, W, None, "none")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_target_integer_dtypes(dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(N, FEAT, generator=gen, dtype=torch.float64)
    W = torch.randn(C, FEAT, generator=gen, dtype=torch.float64)
    t = torch.randint(0, C, (N,), generator=gen)
    got = reference.linear_cross_entropy(x, W, t.to(dtype))
    assert rel_err(got, F.cross_entropy(F.linear(x, W), t)) <= TOL


@pytest.mark.parametrize(
    ("bad", "kwargs"),
    [
        (C, {}),
        (-3, {}),
        (C + 5, {"ignore_index": 2}),
        (C, {"token_weight": torch.ones(N, dtype=torch.float64)}),
        (C, {"shift": True}),
    ],
)
def test_out_of_range_target_is_the_package_error(bad, kwargs):
    """A class index outside [0, C) (and not ignore_index) is the chunked path's clear
    error, naming the function, the argument, the value and the range; not torch's
    IndexError from inside cross_entropy, nor a gather past the class weights."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(N, FEAT, generator=gen, dtype=torch.float64)
    W = torch.randn(C, FEAT, generator=gen, dtype=torch.float64)
    t = torch.randint(0, C, (N,), generator=gen)
    t[4] = bad
    ignored = kwargs.get("ignore_index", -100)
    want = (
        rf"^linear_cross_entropy: target contains class index {bad}, outside \[0, {C}\) "
        rf"and not ignore_index={ignored}$"
    )
    with pytest.raises(ValueError, match=want):
        reference.linear_cross_entropy(x, W, t, **kwargs)
    with pytest.raises(ValueError, match=want):
        linear_ce.linear_cross_entropy(x, W, t, **kwargs)
