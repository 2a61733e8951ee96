"""Edge cases, non-finite inputs, no mutation, determinism, autocast.

Every result is compared with the plain expression
``F.cross_entropy(F.linear(x, W, b), t, ...)`` (float64 unless stated), written
in the tests (:func:`test_properties.plain_expression` for the extras).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from test_properties import plain_expression

CHUNK2 = LinearCrossEntropyOptions(batch_chunk_size=2)
REDUCTIONS = ("mean", "sum", "none")


def _grads(loss, leaves, upstream=None):
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    if upstream is None:
        upstream = torch.ones_like(loss)
    got = iter(torch.autograd.grad(loss, wanted, upstream))
    return [next(got) if t is not None and t.requires_grad else None for t in leaves]


def _leaf(t, grad=True):
    return t.detach().clone().requires_grad_(grad)


# ---------------------------------------------------------------- non-finite inputs


def _patterns_equal(name, got, ref, tol):
    got, ref = got.detach().double(), ref.detach().double()
    assert torch.equal(got.isnan(), ref.isnan()), f"{name}: NaN pattern {got} vs {ref}"
    assert torch.equal(got.isposinf(), ref.isposinf()), f"{name}: +Inf pattern {got} vs {ref}"
    assert torch.equal(got.isneginf(), ref.isneginf()), f"{name}: -Inf pattern {got} vs {ref}"
    finite = ref.isfinite()
    assert rel_err(got[finite], ref[finite]) <= tol, (
        f"{name}: finite entries differ: {got} vs {ref}"
    )


NONFINITE = [
    # (tensor, index, value): one poisoned entry
    ("x", (1, 2), float("nan")),
    ("x", (1, 2), float("inf")),
    ("x", (2, 0), float("-inf")),
    ("W", (3, 1), float("nan")),
    ("W", (3, 1), float("inf")),
    ("W", (0, 3), float("-inf")),
    ("b", (3,), float("nan")),
    ("b", (3,), float("inf")),  # every row's max is +inf
    ("b", (2,), float("-inf")),  # a masked class: finite unless it is the target
    ("b", (slice(None),), float("-inf")),  # every logit -inf
]
EXTRAS = {
    "plain": {},
    "smoothing+weights": {"label_smoothing": 0.2, "class_weight": True},
    "z_loss+token": {"z_loss": 1e-2, "token_weight": True},
    "softcap": {"softcap": 3.0},
}


@pytest.mark.parametrize(("extras", "reduction"), list(itertools.product(EXTRAS, REDUCTIONS)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_non_finite_inputs_propagate_like_the_plain_expression(extras, reduction, dtype):
    """NaN/±Inf in input, weight or bias: same NaN/+Inf/-Inf masks in loss, lse and every
    gradient as the plain expression, no exception, no silent finite number. Rows 1 and 2
    (which hold the poisoned input entries in some cases) are ignored in half the rows.
    Ignored rows are never read (issue 12): the reference sees zeros there, and their
    lse and gradient are exactly zero whatever their hidden state holds."""
    setting = EXTRAS[extras]
    g = torch.Generator().manual_seed(1)
    N, Fd, V = 6, 4, 7
    for (where, index, value), ignore_poisoned in itertools.product(NONFINITE, (False, True)):
        x = torch.randn(N, Fd, generator=g).to(dtype)
        W = torch.randn(V, Fd, generator=g).to(dtype)
        b = torch.randn(V, generator=g).to(dtype)
        {"x": x, "W": W, "b": b}[where][index] = value
        t = torch.tensor([0, 1, 2, 3, 4, 5])
        if ignore_poisoned:
            t[1], t[2] = -100, -100
        cw = torch.rand(V, generator=g).to(dtype) + 0.5 if setting.get("class_weight") else None
        tw = torch.rand(N, generator=g).to(dtype) if setting.get("token_weight") else None
        up = torch.randn(N, generator=g).to(dtype) if reduction == "none" else None
        kw = {
            "reduction": reduction,
            "label_smoothing": setting.get("label_smoothing", 0.0),
            "z_loss": setting.get("z_loss", 0.0),
            "softcap": setting.get("softcap"),
        }

        leaves = [_leaf(v) for v in (x, W, b)]
        out = linear_ce.linear_cross_entropy(
            *leaves[:2],
            t,
            linear_bias=leaves[2],
            weight=cw,
            token_weight=tw,
            options=CHUNK2,
            return_lse=True,
            **kw,
        )
        got = [out.loss, *_grads(out.loss, leaves, up)]

        # Ignored rows are not part of the computation: the reference is the plain
        # expression on the carried rows, zeros scattered back where needed.
        carried = t != -100
        ref_leaves = [_leaf(v.double()) for v in (x[carried], W, b)]
        loss, _, lse = plain_expression(
            ref_leaves[0],
            ref_leaves[1],
            t[carried],
            b=ref_leaves[2],
            class_weight=None if cw is None else cw.double(),
            ignore_index=-100,
            token_weight=None if tw is None else tw[carried].double(),
            prob=False,
            **kw,
        )
        ref = [loss, *_grads(loss, ref_leaves, None if up is None else up[carried].double())]
        ref[1] = torch.zeros(N, Fd, dtype=torch.float64).index_put((carried,), ref[1])
        if reduction == "none":
            ref[0] = torch.zeros(N, dtype=torch.float64).index_put((carried,), ref[0].detach())
        lse = torch.zeros(N, dtype=torch.float64).index_put((carried,), lse)
        case = f"{where}{index}={value} ignored={ignore_poisoned}"
        names = ("loss", "grad_input", "grad_weight", "grad_bias")
        # float64: the float64 reference is itself a few eps off where the bias gradient
        # cancels (Σ_i p_ij − [j = t_i]); 6 eps as in test_extras.
        tol = (6 if dtype == torch.float64 else 3) * eps(dtype)
        for name, a, r in zip(names, got, ref, strict=True):
            _patterns_equal(f"{case} {name}", a, r, tol)
        # lse may come from logits rounded to the input dtype (native half GEMMs on CPU); it
        # is m + log Z, which cancels where lse is near zero (absolute error ~ eps·|m|):
        # with few finite rows left that dominates the relative norm.
        _patterns_equal(f"{case} lse", out.lse, lse, 10 * eps(dtype))


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("batch", [(0,), (0, 3), (2, 0)])
def test_empty_batch(reduction, batch):
    """mean → NaN, sum → 0, none → empty; gradients are zeros of the right shapes."""
    x = torch.randn(*batch, 4, requires_grad=True)
    W = torch.randn(5, 4, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    t = torch.zeros(batch, dtype=torch.long)
    loss = linear_ce.linear_cross_entropy(x, W, t, linear_bias=b, reduction=reduction)
    ref = F.cross_entropy(F.linear(x, W, b).reshape(-1, 5), t.reshape(-1), reduction=reduction)
    if reduction == "mean":
        assert loss.isnan() and ref.isnan()
    elif reduction == "sum":
        assert loss.item() == 0.0 == ref.item()
    else:
        assert loss.shape == batch
    gx, gW, gb = torch.autograd.grad(loss.sum(), [x, W, b])
    assert gx.shape == x.shape and gW.shape == W.shape and gb.shape == b.shape
    assert not gW.any() and not gb.any() and not gx.any()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_all_rows_ignored(reduction, ignore_index):
    """torch: mean is NaN (0/0) with zero gradients, sum is 0, none is zeros."""
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    W = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    t = torch.full((7,), ignore_index)
    kw = {"reduction": reduction, "ignore_index": ignore_index, "label_smoothing": 0.1}
    got = linear_ce.linear_cross_entropy(x, W, t, options=CHUNK2, **kw)
    ref = F.cross_entropy(F.linear(x, W), t, **kw)
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.nan_to_num(), ref.nan_to_num())
    for a, r in zip(_grads(got, [x, W]), _grads(ref, [x, W]), strict=True):
        assert torch.equal(a, r) and not a.any()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_single_class(reduction, smoothing):
    """V = 1: the loss is exactly 0 and the gradients vanish (to rounding with smoothing)."""
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    W = torch.randn(1, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 0, -100, 0, 0])
    got = linear_ce.linear_cross_entropy(
        x, W, t, linear_bias=b, reduction=reduction, label_smoothing=smoothing
    )
    ref = F.cross_entropy(F.linear(x, W, b), t, reduction=reduction, label_smoothing=smoothing)
    assert torch.equal(got, ref) and not got.any()
    for g in _grads(got, [x, W, b]):
        assert g.abs().max() <= 4 * eps(torch.float64)


def _plain64(x, W, t, b=None, reduction="mean"):
    leaves = [_leaf(v.double()) for v in (x, W) + ((b,) if b is not None else ())]
    loss = F.cross_entropy(F.linear(*leaves), t, reduction=reduction)
    return loss, _grads(loss, leaves)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tied_embeddings(reduction):
    """``W = emb.weight`` also used to embed the tokens: both gradients add up in one .grad."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 6, dtype=torch.float64)
    ids = torch.randint(0, 11, (9,))
    t = torch.randint(0, 11, (9,))
    hidden = torch.tanh(emb(ids))
    loss = linear_ce.linear_cross_entropy(
        hidden, emb.weight, t, reduction=reduction, options=CHUNK2
    )
    loss.sum().backward()
    got = emb.weight.grad.clone()
    emb.weight.grad = None
    F.cross_entropy(
        F.linear(torch.tanh(emb(ids)), emb.weight), t, reduction=reduction
    ).sum().backward()
    assert rel_err(got, emb.weight.grad) <= 3 * eps(torch.float64)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("layout", ["transposed", "strided", "input_transposed"])
def test_non_contiguous_arguments(reduction, layout):
    """A weight that is a ``.t()`` view of an (F, V) leaf, strided slices, a transposed input."""
    g = torch.Generator().manual_seed(2)
    base_w = torch.randn(6, 13, dtype=torch.float64, generator=g, requires_grad=True)  # (F, V)
    base_x = torch.randn(6, 9, dtype=torch.float64, generator=g, requires_grad=True)  # (F, N)
    wide_w = torch.randn(13, 12, dtype=torch.float64, generator=g, requires_grad=True)
    wide_x = torch.randn(9, 12, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 13, (9,), generator=g)
    t[4] = -100

    def views():
        if layout == "transposed":
            return wide_x[:, ::2], base_w.t()
        if layout == "strided":
            return wide_x[:, 1::2], wide_w[:, ::2]
        return base_x.t(), wide_w[:, :6]

    leaves = [base_w, base_x, wide_w, wide_x]
    x, W = views()
    assert not (x.is_contiguous() and W.is_contiguous())
    loss = linear_ce.linear_cross_entropy(x, W, t, reduction=reduction, options=CHUNK2)
    got = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
    x, W = views()
    ref = torch.autograd.grad(
        F.cross_entropy(F.linear(x, W), t, reduction=reduction).sum(), leaves, allow_unused=True
    )
    for a, r in zip(got, ref, strict=True):
        assert (a is None) == (r is None)
        if a is not None:
            assert rel_err(a, r) <= 3 * eps(torch.float64)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_weight_without_requires_grad(reduction):
    x = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    W = torch.randn(9, 5, dtype=torch.float64)
    b = torch.randn(9, dtype=torch.float64)
    t = torch.randint(0, 9, (8,))
    loss = linear_ce.linear_cross_entropy(x, W, t, linear_bias=b, reduction=reduction)
    loss.sum().backward()
    assert W.grad is None and b.grad is None
    ref_x = _leaf(x)
    F.cross_entropy(F.linear(ref_x, W, b), t, reduction=reduction).sum().backward()
    assert rel_err(x.grad, ref_x.grad) <= 3 * eps(torch.float64)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_without_autograd(mode, reduction):
    """Under inference_mode/no_grad: the right loss, no graph, no gradient work."""
    x = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    W = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 9, (8,))
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        loss = linear_ce.linear_cross_entropy(x, W, t, reduction=reduction, options=CHUNK2)
        ref = F.cross_entropy(F.linear(x, W), t, reduction=reduction)
    assert loss.grad_fn is None and not loss.requires_grad
    assert rel_err(loss, ref) <= 3 * eps(torch.float64)


def test_cpu_autocast_runs_in_the_dtype_it_is_given():
    """Defined behaviour: linear_cross_entropy is not an autocast op. Under CPU autocast to
    bf16, fp32 arguments are computed in fp32 (not rounded to bf16 as ``F.linear`` would be),
    bf16 arguments in bf16 with fp32 accumulation, and mixing the two is a clear error. The
    loss is reported in fp32 either way, as autocast's ``cross_entropy`` (issue 21)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    W = torch.randn(32, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 32, (8,), generator=g)
    ref_loss, ref_grads = _plain64(x, W, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_ce.linear_cross_entropy(x, W, t)
        loss_bf16 = linear_ce.linear_cross_entropy(x.bfloat16(), W.bfloat16(), t)
        with pytest.raises(
            ValueError,
            match=r"linear_weight dtype torch.float32 differs from "
            r"input dtype torch.bfloat16.*not autocast",
        ):
            linear_ce.linear_cross_entropy(x.bfloat16(), W, t)
    assert loss.dtype == torch.float32 and loss_bf16.dtype == torch.float32
    assert rel_err(loss, ref_loss) <= 3 * eps(torch.float32)
    for got, ref in zip(torch.autograd.grad(loss, [x, W]), ref_grads, strict=True):
        assert got.dtype == torch.float32 and rel_err(got, ref) <= 3 * eps(torch.float32)
    ref_bf16, _ = _plain64(x.bfloat16(), W.bfloat16(), t)
    assert rel_err(loss_bf16, ref_bf16) <= 3 * eps(torch.bfloat16)


# ---------------------------------------------------------------- no mutation, determinism


def _full_call(reduction, prob, seed=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 6, generator=g, requires_grad=True)
    W = torch.randn(11, 6, generator=g, requires_grad=True)
    b = torch.randn(11, generator=g, requires_grad=True)
    cw = torch.rand(11, generator=g) + 0.5
    if prob:
        t = torch.softmax(torch.randn(2, 5, 11, generator=g), -1)
    else:
        t = torch.randint(0, 11, (2, 5), generator=g)
        t[0, 1] = -100
    tw = torch.rand(2, 5, generator=g)
    return x, W, b, t, cw, tw


@pytest.mark.parametrize(("reduction", "prob"), list(itertools.product(REDUCTIONS, (False, True))))
def test_arguments_are_not_mutated(reduction, prob):
    """input, weight, bias, target, class weight, token weight bit-identical after
    forward + backward."""
    args = _full_call(reduction, prob)
    before = [a.detach().clone() for a in args]
    versions = [a._version for a in args]
    out = linear_ce.linear_cross_entropy(
        args[0],
        args[1],
        args[3],
        linear_bias=args[2],
        weight=args[4],
        token_weight=args[5],
        reduction=reduction,
        label_smoothing=0.1,
        z_loss=1e-3,
        options=CHUNK2,
    )
    out.sum().backward()
    for a, b, v in zip(args, before, versions, strict=True):
        assert torch.equal(a.detach(), b) and a._version == v


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_deterministic(reduction, dtype):
    """Two runs with the same inputs give bit-identical loss and gradients on CPU."""
    results = []
    for _ in range(2):
        x, W, b, t, cw, tw = _full_call(reduction, False)
        leaves = [_leaf(v.to(dtype)) for v in (x, W, b)]
        loss = linear_ce.linear_cross_entropy(
            *leaves[:2],
            t,
            linear_bias=leaves[2],
            weight=cw.to(dtype),
            token_weight=tw,
            reduction=reduction,
            label_smoothing=0.1,
            z_loss=1e-3,
            softcap=5.0,
            options=LinearCrossEntropyOptions(batch_chunk_size=3),
        )
        results.append([loss, *_grads(loss, leaves)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
