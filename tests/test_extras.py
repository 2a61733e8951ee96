"""Issue 5: the LM-training extras against a float64 formula written out here.

For hidden states ``h`` ``(B, T, F)``, logits ``s = h Wᵀ + b`` (then
``c·tanh(s/c)`` with softcap ``c``), ``lse = logsumexp(s)``, class weights
``w`` and label smoothing ``ε`` each unignored row's loss is

    ce = (1-ε)·w_t·(lse - s_t) + ε/C·Σ_j w_j·(lse - s_j),   z = λ·w_t·lse²

times the token weight ``τ``; "mean" divides the sum by ``Σ w_t`` over
unignored rows (no token weights in it). ``shift=k`` pairs ``h[:, :-k]`` with
``labels[:, k:]``; the last ``k`` positions have zero loss.
"""

from __future__ import annotations

import itertools
import warnings
import zlib

import pytest
import torch

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions

REDUCTIONS = ("mean", "sum", "none")
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
IGNORE = -100
B, T, FEATURES, CLASSES = 3, 9, 8, 23
EXTRAS = {
    "z_loss": {"z_loss": 0.1},
    "softcap": {"softcap": 2.0},
    "shift": {"shift": True},
    "token_weight": {"token_weight": True},
    "all": {"z_loss": 0.1, "softcap": 2.0, "shift": True, "token_weight": True},
}
#: (class weights, ignore_index, bias, label smoothing): every pair of these
#: on/off settings occurs in some row, plus everything on.
COMBINATIONS = [
    (False, False, False, False),
    (False, True, True, True),
    (True, False, True, True),
    (True, True, False, True),
    (True, True, True, False),
    (True, True, True, True),
]
CHUNKED = LinearCrossEntropyOptions(batch_chunk_size=4)


def _tolerance(dtype: torch.dtype) -> float:
    """3·eps(dtype); in float64 the formula rounds as much as the result does, so
    the distance between them gets the formula's share too."""
    return (6 if dtype == torch.float64 else 3) * eps(dtype)


def _make(dtype, *, class_weight, ignore, bias, smoothing, extras, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(B, T, FEATURES, generator=g)).to(dtype)
    W = (torch.randn(CLASSES, FEATURES, generator=g) / 2).to(dtype)
    target = torch.randint(0, CLASSES, (B, T), generator=g)
    if ignore:
        target[torch.rand(B, T, generator=g) < 0.3] = IGNORE
    kwargs = dict(extras)
    if kwargs.get("token_weight"):
        tw = 2 * torch.rand(B, T, generator=g)
        tw[0, :3] = 0.0
        kwargs["token_weight"] = tw.to(dtype)
    return {
        "x": x,
        "W": W,
        "target": target,
        "b": (torch.randn(CLASSES, generator=g) / 2).to(dtype) if bias else None,
        "weight": (torch.rand(CLASSES, generator=g) + 0.5).to(dtype) if class_weight else None,
        "ignore_index": IGNORE if ignore else None,
        "label_smoothing": 0.1 if smoothing else 0.0,
        "extras": kwargs,
        "grad_output": torch.randn(B, T, generator=g).to(dtype),
    }


def _formula(case: dict, reduction: str, dtype: torch.dtype = torch.float64):
    """The formula of the module doc in ``dtype``: (loss, z-loss term, lse, grads of x, W, b)."""
    extras = case["extras"]
    x = case["x"].detach().to(dtype).requires_grad_()
    W = case["W"].detach().to(dtype).requires_grad_()
    b = None if case["b"] is None else case["b"].detach().to(dtype).requires_grad_()
    logits = x @ W.T
    if b is not None:
        logits = logits + b
    cap = extras.get("softcap")
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    lse = torch.logsumexp(logits, dim=-1)
    log_p = logits - lse[..., None]
    labels, tw = case["target"], extras.get("token_weight")
    k = int(extras.get("shift", 0))
    if k:
        log_p, lse_used, labels = log_p[:, :-k], lse[:, :-k], labels[:, k:]
        tw = None if tw is None else tw[:, :-k]
    else:
        lse_used = lse
    w = torch.ones(CLASSES, dtype=dtype) if case["weight"] is None else case["weight"].to(dtype)
    valid = labels != IGNORE
    safe = torch.where(valid, labels, 0)
    w_t = w[safe] * valid
    eps_ = case["label_smoothing"]
    nll = -w_t * log_p.gather(-1, safe[..., None])[..., 0]
    smooth = -(log_p * w).sum(-1) * valid / CLASSES
    z = extras.get("z_loss", 0.0) * w_t * lse_used.square()
    rows, z_rows = (1 - eps_) * nll + eps_ * smooth + z, z
    if tw is not None:
        rows, z_rows = rows * tw.to(dtype), z_rows * tw.to(dtype)
    if reduction == "none":
        pad = torch.zeros(B, k, dtype=dtype)
        loss, z_term = torch.cat([rows, pad], 1), torch.cat([z_rows, pad], 1)
        loss.backward(case["grad_output"].to(dtype))
    else:
        denominator = w_t.sum() if reduction == "mean" else 1.0
        loss, z_term = rows.sum() / denominator, z_rows.sum() / denominator
        loss.backward()
    grads = [x.grad, W.grad, None if b is None else b.grad]
    # lse is reported for the rows that carry a loss only; ignored rows are never computed.
    carried = torch.zeros(lse.shape, dtype=torch.bool)
    carried[:, : lse.shape[1] - k] = valid
    return loss.detach(), z_term.detach(), torch.where(carried, lse, 0.0).detach(), grads


def _ours(case: dict, reduction: str, options=CHUNKED, **overrides):
    x = case["x"].detach().clone().requires_grad_()
    W = case["W"].detach().clone().requires_grad_()
    b = None if case["b"] is None else case["b"].detach().clone().requires_grad_()
    kwargs = {**case["extras"], **overrides}
    out = linear_ce.linear_cross_entropy(
        x,
        W,
        case["target"],
        linear_bias=b,
        weight=case["weight"],
        reduction=reduction,
        ignore_index=case["ignore_index"],
        label_smoothing=case["label_smoothing"],
        options=options,
        return_z_loss=True,
        return_lse=True,
        **kwargs,
    )
    out.loss.backward(case["grad_output"] if reduction == "none" else None)
    return out.loss.detach(), out.z_loss, out.lse, [x.grad, W.grad, None if b is None else b.grad]


def _assert_close(got, ref, tol: float, what: str) -> None:
    names = ("loss", "z_loss", "lse")
    errors = {}
    for name, g, r in zip(names, got[:3], ref[:3], strict=True):
        assert g.shape == r.shape, (what, name, g.shape, r.shape)
        errors[name] = rel_err(g, r)
    for name, g, r in zip(("input", "weight", "bias"), got[3], ref[3], strict=True):
        assert (g is None) == (r is None), (what, name)
        if r is not None:
            assert torch.isfinite(g).all(), (what, name)
            errors[name] = rel_err(g, r)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"{what}: relative errors {bad} exceed {tol:.2e}"


GRID = list(itertools.product(EXTRAS, REDUCTIONS, COMBINATIONS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("extra", "reduction", "combination"), GRID)
def test_extra_matches_float64_formula(extra, reduction, combination, dtype):
    class_weight, ignore, bias, smoothing = combination
    case = _make(
        dtype,
        class_weight=class_weight,
        ignore=ignore,
        bias=bias,
        smoothing=smoothing,
        extras=EXTRAS[extra],
        seed=zlib.crc32(repr((extra, reduction, combination)).encode()),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _ours(case, reduction)
    assert got[0].dtype == dtype
    _assert_close(
        got,
        _formula(case, reduction),
        _tolerance(dtype),
        f"{extra} {reduction} cw/ignore/bias/smoothing={combination}",
    )


@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_chunk_size_invariance_float64(extra, reduction):
    case = _make(
        torch.float64,
        class_weight=True,
        ignore=True,
        bias=True,
        smoothing=True,
        extras=EXTRAS[extra],
        seed=zlib.crc32(extra.encode()),
    )
    ref = _formula(case, reduction)
    whole = _ours(case, reduction, LinearCrossEntropyOptions(batch_chunk_size=B * T))
    _assert_close(whole, ref, _tolerance(torch.float64), f"{extra}, one chunk")
    for size in (1, 2, 3, 5):
        got = _ours(case, reduction, LinearCrossEntropyOptions(batch_chunk_size=size))
        _assert_close(got, whole, 4 * eps(torch.float64), f"{extra}, chunk {size} vs one chunk")


@pytest.mark.parametrize("shift", (1, 2, 3))
def test_shift_by_k_positions(shift):
    case = _make(
        torch.float64,
        class_weight=True,
        ignore=True,
        bias=False,
        smoothing=True,
        extras={"shift": shift, "z_loss": 0.1},
        seed=shift,
    )
    for reduction in REDUCTIONS:
        got = _ours(case, reduction)
        _assert_close(got, _formula(case, reduction), _tolerance(torch.float64), f"shift={shift}")
        if reduction == "none":
            assert torch.all(got[0][:, T - shift :] == 0)


@pytest.mark.parametrize("reduction", ("mean", "sum"))
def test_token_weight_mean_denominator(reduction):
    """Token weights scale the rows; "mean" still divides by Σ w_t of unignored rows."""
    case = _make(
        torch.float64,
        class_weight=True,
        ignore=True,
        bias=False,
        smoothing=False,
        extras={},
        seed=7,
    )
    x, W, t, cw = case["x"], case["W"], case["target"], case["weight"]
    rows = linear_ce.linear_cross_entropy(x, W, t, weight=cw, reduction="none")
    tw = torch.rand(B, T, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    weighted = linear_ce.linear_cross_entropy(
        x, W, t, weight=cw, reduction=reduction, token_weight=tw
    )
    valid = t != IGNORE
    denominator = cw[torch.where(valid, t, 0)][valid].sum() if reduction == "mean" else 1.0
    assert rel_err(weighted, (tw * rows).sum() / denominator) <= _tolerance(torch.float64)
    doubled = linear_ce.linear_cross_entropy(
        x,
        W,
        t,
        weight=cw,
        reduction=reduction,
        token_weight=torch.full((B, T), 2.0, dtype=torch.float64),
    )
    plain = linear_ce.linear_cross_entropy(x, W, t, weight=cw, reduction=reduction)
    assert rel_err(doubled, 2 * plain) <= _tolerance(torch.float64)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_lse_and_z_loss_output_values(reduction):
    case = _make(
        torch.float32,
        class_weight=True,
        ignore=True,
        bias=True,
        smoothing=True,
        extras=EXTRAS["all"],
        seed=9,
    )
    x = case["x"].clone().requires_grad_()
    W = case["W"].clone().requires_grad_()
    b = case["b"].clone().requires_grad_()
    out = linear_ce.linear_cross_entropy(
        x,
        W,
        case["target"],
        linear_bias=b,
        weight=case["weight"],
        reduction=reduction,
        label_smoothing=0.1,
        return_z_loss=True,
        return_lse=True,
        **case["extras"],
    )
    assert out.loss.requires_grad
    assert not out.z_loss.requires_grad and out.z_loss.grad_fn is None
    assert out.lse.requires_grad  # its gradient: tests/test_lse_gradient.py
    _, z_ref, lse_ref, _ = _formula(case, reduction)
    assert out.lse.shape == (B, T)
    assert rel_err(out.lse, lse_ref) <= 3 * eps(torch.float32)
    assert rel_err(out.z_loss, z_ref) <= 3 * eps(torch.float32)
    only_loss = linear_ce.linear_cross_entropy(
        x,
        W,
        case["target"],
        linear_bias=b,
        weight=case["weight"],
        reduction=reduction,
        label_smoothing=0.1,
        return_lse=True,
        **case["extras"],
    )
    assert only_loss.z_loss is None and only_loss.lse is not None
    assert torch.equal(only_loss.loss, out.loss)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_softcap_with_huge_logits_stays_finite(dtype, reduction):
    """Rows scaled by 1e4 saturate the tanh (zero gradient there); the rest still train."""
    case = _make(
        dtype,
        class_weight=True,
        ignore=True,
        bias=True,
        smoothing=True,
        extras={"softcap": 30.0, "z_loss": 1e-3},
        seed=10,
    )
    case["x"][:, ::2] *= 10_000
    got = _ours(case, reduction)
    assert torch.isfinite(got[0]).all()
    ref = _formula(case, reduction)
    tolerance = _tolerance(dtype)
    if dtype == torch.float32:
        # A logit of 1e4 is rounded by ~1e-3 in float32, which moves sech²(s/c) by a
        # relative 2·1e-3/c: no float32 evaluation does better (the guide's rule: at
        # most twice the error of the plain expression in the same dtype).
        plain = _formula(case, reduction, torch.float32)
        plain_errors = [
            rel_err(g, r) for g, r in zip([plain[0], *plain[3]], [ref[0], *ref[3]], strict=True)
        ]
        tolerance = max(tolerance, 2 * max(plain_errors))
    _assert_close(got, ref, tolerance, f"softcap {dtype}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_z_loss_fp16_large_vocabulary_stays_finite(reduction):
    vocab, rows, features = 2**17, 6, 16
    g = torch.Generator().manual_seed(11)
    x = (4 * torch.randn(rows, features, generator=g)).half()
    W = torch.randn(vocab, features, generator=g).half()
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[2] = IGNORE
    xs, Ws = x.clone().requires_grad_(), W.clone().requires_grad_()
    out = linear_ce.linear_cross_entropy(
        xs, Ws, t, reduction=reduction, z_loss=1e-4, return_z_loss=True
    )
    upstream = torch.ones(rows, dtype=torch.float16) if reduction == "none" else None
    out.loss.backward(upstream)
    for value in (out.loss, out.z_loss, xs.grad, Ws.grad):
        assert torch.isfinite(value).all()

    x64, W64 = x.double().requires_grad_(), W.double().requires_grad_()
    lse = torch.logsumexp(x64 @ W64.T, dim=-1)
    valid = t != IGNORE
    picked = (x64 @ W64.T).gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    z_rows = 1e-4 * lse.square() * valid
    rows_loss = (lse - picked) * valid + z_rows
    if reduction == "none":
        loss, z_term = rows_loss, z_rows
    else:
        denominator = valid.sum() if reduction == "mean" else 1
        loss, z_term = rows_loss.sum() / denominator, z_rows.sum() / denominator
    loss.backward(None if upstream is None else upstream.double())
    assert rel_err(out.loss, loss) <= 3 * eps(torch.float16)
    assert rel_err(out.z_loss, z_term) <= 3 * eps(torch.float16)
    assert rel_err(xs.grad, x64.grad) <= 3 * eps(torch.float16)
    assert rel_err(Ws.grad, W64.grad) <= 3 * eps(torch.float16)


@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_torch_compile_fullgraph_with_every_extra(reduction):
    case = _make(
        torch.float32,
        class_weight=True,
        ignore=True,
        bias=True,
        smoothing=True,
        extras=EXTRAS["all"],
        seed=12,
    )
    # allow_retain_graph=True is what compile would promote the default to (with a warning)
    options = LinearCrossEntropyOptions(allow_retain_graph=True, batch_chunk_size=5)

    def loss_fn(x, W, b, target, cw, tw):
        return linear_ce.linear_cross_entropy(
            x,
            W,
            target,
            linear_bias=b,
            weight=cw,
            reduction=reduction,
            label_smoothing=0.1,
            options=options,
            z_loss=0.1,
            return_z_loss=True,
            return_lse=True,
            softcap=2.0,
            shift=True,
            token_weight=tw,
        )

    compiled = torch.compile(loss_fn, fullgraph=True)
    results = []
    for fn in (compiled, loss_fn):
        leaves = [case[k].clone().requires_grad_() for k in ("x", "W", "b")]
        out = fn(*leaves, case["target"], case["weight"], case["extras"]["token_weight"])
        out.loss.backward(case["grad_output"] if reduction == "none" else None)
        results.append((out.loss.detach(), out.z_loss, out.lse, [v.grad for v in leaves]))
    (got, eager) = results
    _assert_close(got, eager, 3 * eps(torch.float32), f"compiled {reduction}")
    _assert_close(got, _formula(case, reduction), 3 * eps(torch.float32), f"compiled {reduction}")


def test_module_passes_extras():
    case = _make(
        torch.float64,
        class_weight=False,
        ignore=True,
        bias=False,
        smoothing=False,
        extras={"z_loss": 0.1, "softcap": 2.0, "shift": True, "token_weight": True},
        seed=13,
    )
    module = linear_ce.LinearCrossEntropyLoss(
        FEATURES, CLASSES, dtype=torch.float64, z_loss=0.1, softcap=2.0
    )
    with torch.no_grad():
        module.weight.copy_(case["W"])
    out = module(
        case["x"],
        case["target"],
        shift=True,
        token_weight=case["extras"]["token_weight"],
        return_lse=True,
    )
    loss, _, lse, _ = _formula(case, "mean")
    assert rel_err(out.loss, loss) <= _tolerance(torch.float64)
    assert rel_err(out.lse, lse) <= _tolerance(torch.float64)
