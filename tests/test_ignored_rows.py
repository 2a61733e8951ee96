"""Issue 12: ignored rows cost nothing — they take part in no GEMM — and change no result.

The reference is the plain float64 expression written here, on the full logits:
``cross_entropy(linear(x, W, b), t, weight, ignore_index, label_smoothing, "none")``
plus ``λ·w_t·lse²`` on carried rows, times the token weight, reduced like torch.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine.accumulate import DirectSum, SplitSum
from linear_ce.engine.gemm import Gemm, NativeHalf

N, FEAT, CLASSES, CHUNK = 24, 6, 11, 4
OPTIONS = LinearCrossEntropyOptions(batch_chunk_size=CHUNK)


def _pattern(name: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """Boolean ``(n,)``: True where the row is ignored."""
    ignored = torch.zeros(n, dtype=torch.bool)
    if name == "all":
        ignored[:] = True
    elif name == "all_but_one":
        ignored[:] = True
        ignored[n // 3] = False
    elif name == "half":
        ignored = torch.rand(n, generator=gen) < 0.5
    elif name == "chunk_boundaries":
        # A run across a chunk boundary, a whole chunk, and a lone row at a boundary.
        ignored[3:6] = True
        ignored[8:12] = True
        ignored[16] = True
    elif name != "none":
        raise ValueError(name)
    return ignored


PATTERNS = ("none", "all", "all_but_one", "half", "chunk_boundaries")
EXTRAS = {
    "plain": {},
    "weights+smoothing": {"class_weight": True, "label_smoothing": 0.15},
    "z_loss+token": {"z_loss": 1e-2, "token_weight": True, "bias": True},
    "softcap+scale+temperature": {"softcap": 2.5, "logit_scale": 1.7, "temperature": 0.8},
}


def _case(pattern: str, extras: dict, seed: int = 0, positions: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    w_shape = (CLASSES, FEAT) if positions is None else (CLASSES, positions, FEAT)
    t_shape = (N,) if positions is None else (N, positions)
    t = torch.randint(0, CLASSES, t_shape, generator=gen)
    ignored = _pattern(pattern, t.numel(), gen).view(t_shape)
    t[ignored] = -100
    return {
        "x": torch.randn(N, FEAT, generator=gen, dtype=torch.float64),
        "W": torch.randn(*w_shape, generator=gen, dtype=torch.float64) / FEAT**0.5 * 2,
        "b": torch.randn(w_shape[:-1], generator=gen, dtype=torch.float64)
        if extras.get("bias")
        else None,
        "t": t,
        "cw": torch.rand(CLASSES, generator=gen, dtype=torch.float64) + 0.3
        if extras.get("class_weight")
        else None,
        "tw": torch.rand(t_shape, generator=gen, dtype=torch.float64) + 0.5
        if extras.get("token_weight")
        else None,
        "up": torch.randn(t_shape, generator=gen, dtype=torch.float64),
        "kw": {
            k: extras[k]
            for k in ("label_smoothing", "z_loss", "softcap", "logit_scale", "temperature")
            if k in extras
        },
    }


def _plain(case: dict, reduction: str, dtype: torch.dtype):
    """The float64 (or ``dtype``) plain expression: loss, lse and the gradients of x, W, b."""
    x = case["x"].to(dtype, copy=True).requires_grad_()
    W = case["W"].to(dtype, copy=True).requires_grad_()
    b = None if case["b"] is None else case["b"].to(dtype, copy=True).requires_grad_()
    kw, t = case["kw"], case["t"]
    positions = 1 if W.dim() == 2 else W.shape[1]
    logits = x @ W.reshape(CLASSES * positions, FEAT).T
    if b is not None:
        logits = logits + b.reshape(-1)
    logits = logits.view(N, CLASSES, positions) * kw.get("logit_scale", 1.0)
    if kw.get("softcap"):
        logits = kw["softcap"] * torch.tanh(logits / kw["softcap"])
    logits = logits / kw.get("temperature", 1.0)
    tt = t.view(N, positions)
    cw = None if case["cw"] is None else case["cw"].to(dtype)
    ce = F.cross_entropy(
        logits, tt, weight=cw, reduction="none", label_smoothing=kw.get("label_smoothing", 0.0)
    )
    valid = tt != -100
    w_t = valid.to(dtype) * (1.0 if cw is None else cw[torch.where(valid, tt, 0)])
    lse = torch.logsumexp(logits, dim=1)
    rows = ce + kw.get("z_loss", 0.0) * w_t * lse.square()
    if case["tw"] is not None:
        rows = rows * case["tw"].to(dtype).view(N, positions)
    if reduction == "none":
        loss = rows.view(t.shape)
        loss.backward(case["up"].to(dtype))
    else:
        loss = rows.sum() / (w_t.sum() if reduction == "mean" else 1.0)
        loss.backward()
    grads = [x.grad, W.grad, None if b is None else b.grad]
    return loss.detach(), torch.where(valid, lse, 0.0).view(t.shape).detach(), grads


def _ours(case: dict, reduction: str, dtype: torch.dtype, options=OPTIONS):
    x = case["x"].to(dtype, copy=True).requires_grad_()
    W = case["W"].to(dtype, copy=True).requires_grad_()
    b = None if case["b"] is None else case["b"].to(dtype, copy=True).requires_grad_()
    out = linear_ce.linear_cross_entropy(
        x,
        W,
        case["t"],
        linear_bias=b,
        weight=None if case["cw"] is None else case["cw"].to(dtype),
        token_weight=None if case["tw"] is None else case["tw"].to(dtype),
        reduction=reduction,
        options=options,
        return_lse=True,
        **case["kw"],
    )
    if reduction == "none":
        out.loss.backward(case["up"].to(dtype))
    else:
        out.loss.backward()
    grads = [x.grad, W.grad, None if b is None else b.grad]
    return out.loss.detach(), out.lse, grads


def _check(case, reduction, dtype):
    got_loss, got_lse, got_grads = _ours(case, reduction, dtype)
    ref_loss, ref_lse, ref_grads = _plain(case, reduction, torch.float64)
    all_ignored = bool((case["t"] == -100).all())
    if reduction == "mean" and all_ignored:
        assert got_loss.isnan(), "mean over no carried row is NaN, as torch"
        for g in got_grads:
            assert g is None or torch.equal(g, torch.zeros_like(g))
        return
    if dtype == torch.float64:
        bounds = [6 * eps(dtype)] * 5
    else:
        same_loss, same_lse, same_grads = _plain(case, reduction, dtype)
        own = [
            rel_err(a, r)
            for a, r in zip(
                (same_loss, same_lse, *same_grads), (ref_loss, ref_lse, *ref_grads), strict=False
            )
            if r is not None
        ]
        bounds = [max(3 * eps(dtype), 2 * e) for e in own]
    pairs = [(got_loss, ref_loss), (got_lse, ref_lse)] + [
        (g, r) for g, r in zip(got_grads, ref_grads, strict=True) if r is not None
    ]
    for (got, ref), bound in zip(pairs, bounds, strict=False):
        assert rel_err(got, ref) <= bound, (rel_err(got, ref), bound)
    # Ignored rows: exactly zero gradient (and loss for "none").
    ignored = (case["t"] == -100).view(N, -1).all(dim=1)
    assert torch.equal(got_grads[0][ignored], torch.zeros_like(got_grads[0][ignored]))
    if reduction == "none":
        assert torch.equal(
            got_loss[case["t"] == -100], torch.zeros_like(got_loss[case["t"] == -100])
        )


@pytest.mark.parametrize(
    ("pattern", "extras", "reduction"),
    list(itertools.product(PATTERNS, EXTRAS, ("mean", "sum", "none"))),
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ignore_patterns_match_float64(pattern, extras, reduction, dtype):
    _check(_case(pattern, EXTRAS[extras]), reduction, dtype)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_k_dim_ignored_positions(pattern, reduction):
    """K-dimensional loss: each position skips its own ignored rows."""
    extras = {"class_weight": True, "token_weight": True, "z_loss": 1e-2, "bias": True}
    _check(_case(pattern, extras, seed=3, positions=3), reduction, torch.float64)


def test_shift_skips_the_vacated_positions():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, FEAT, generator=gen, dtype=torch.float64, requires_grad=True)
    W = torch.randn(CLASSES, FEAT, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, CLASSES, (2, 9), generator=gen)
    labels[0, :4] = -100
    loss = linear_ce.linear_cross_entropy(x, W, labels, shift=True, options=OPTIONS)
    loss.backward()
    xr, Wr = x.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    ref = F.cross_entropy((xr[:, :-1] @ Wr.T).reshape(-1, CLASSES), labels[:, 1:].reshape(-1))
    ref.backward()
    assert rel_err(loss, ref) <= 3 * eps(torch.float64)
    assert rel_err(x.grad, xr.grad) <= 3 * eps(torch.float64)
    assert rel_err(W.grad, Wr.grad) <= 3 * eps(torch.float64)
    assert torch.equal(x.grad[:, -1], torch.zeros_like(x.grad[:, -1]))


@pytest.fixture
def gemm_rows(monkeypatch):
    """Rows of every operand the three GEMMs see, on every backend class."""
    seen = {"logits": [], "add_grad_input": [], "weight_grad": []}
    # (method, index of the argument whose first dimension is the chunk's rows)
    methods = {"logits": 1, "add_grad_input": 1, "weight_grad": 2}

    def recording(name, real, index):
        def method(self, *args):
            seen[name].append(args[index].shape[0])
            return real(self, *args)

        return method

    for cls in (Gemm, *Gemm.__subclasses__()):
        for name, index in methods.items():
            if name in vars(cls):
                monkeypatch.setattr(cls, name, recording(name, vars(cls)[name], index))
    # A half tile's logits (the chunk loop's, the statistics pass's) are a logits GEMM too.
    monkeypatch.setattr(
        NativeHalf, "half_logits", recording("logits", vars(NativeHalf)["half_logits"], 1)
    )
    # The weight-gradient GEMMs are issued by the weight-gradient sum: add(position, g, x).
    for cls in (DirectSum, SplitSum):
        monkeypatch.setattr(cls, "add", recording("weight_grad", vars(cls)["add"], 2))
    return seen


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemms_see_only_valid_rows(gemm_rows, reduction, dtype):
    """Structural: the logits GEMM and both gradient GEMMs get the carried rows only."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(N, FEAT, generator=gen).to(dtype).requires_grad_()
    W = torch.randn(CLASSES, FEAT, generator=gen).to(dtype).requires_grad_()
    t = torch.randint(0, CLASSES, (N,), generator=gen)
    t[torch.rand(N, generator=gen) < 0.75] = -100
    carried = int((t != -100).sum())
    loss = linear_ce.linear_cross_entropy(x, W, t, reduction=reduction, options=OPTIONS)
    (loss.sum() if reduction == "none" else loss).backward()
    passes = 2 if reduction == "none" else 1  # "none" recomputes the logits in backward
    assert sum(gemm_rows["logits"]) == passes * carried
    assert sum(gemm_rows["add_grad_input"]) == carried
    assert sum(gemm_rows["weight_grad"]) == carried
    assert max(gemm_rows["logits"]) <= CHUNK


def test_no_gemm_when_every_row_is_ignored(gemm_rows):
    x = torch.randn(N, FEAT, requires_grad=True)
    W = torch.randn(CLASSES, FEAT, requires_grad=True)
    loss = linear_ce.linear_cross_entropy(x, W, torch.full((N,), -100))
    loss.backward()
    assert loss.isnan()
    assert gemm_rows == {"logits": [], "add_grad_input": [], "weight_grad": []}
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(W.grad, torch.zeros_like(W))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_fullgraph_with_ignored_rows(reduction):
    case = _case("chunk_boundaries", EXTRAS["weights+smoothing"], seed=4)
    x, W = case["x"].float(), case["W"].float()

    def step(x, W):
        loss = linear_ce.linear_cross_entropy(
            x,
            W,
            case["t"],
            weight=case["cw"].float(),
            reduction=reduction,
            options=LinearCrossEntropyOptions(batch_chunk_size=CHUNK, allow_retain_graph=True),
            **case["kw"],
        )
        return loss.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_(), W.clone().requires_grad_()]
    got = compiled(*leaves)
    got.backward()
    ref_leaves = [x.clone().requires_grad_(), W.clone().requires_grad_()]
    ref = step(*ref_leaves)
    ref.backward()
    assert rel_err(got, ref) <= 3 * eps(torch.float32)
    for a, r in zip(leaves, ref_leaves, strict=True):
        assert rel_err(a.grad, r.grad) <= 3 * eps(torch.float32)


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_position_without_a_valid_row_gets_a_zero_weight_gradient(monkeypatch, dtype, native):
    """The weight-gradient sum is not zeroed up front (a position's first product is
    written): a K-dimensional position whose every target is ignored gets exactly zero,
    and the others match the float64 expression, over several chunks."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", native)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 16, generator=gen, dtype=torch.float64)
    W = torch.randn(40, 3, 16, generator=gen, dtype=torch.float64) / 4
    t = torch.randint(0, 40, (300, 3), generator=gen)
    t[:, 1] = -100
    t[::7, 2] = -100
    xs, Ws = (v.to(dtype).requires_grad_() for v in (x, W))
    options = LinearCrossEntropyOptions(batch_chunk_size=64)
    linear_ce.linear_cross_entropy(xs, Ws, t, reduction="sum", options=options).backward()
    grads = {}
    for dt in (torch.float64, dtype):  # the exact expression, and the plain one in dtype
        xr, Wr = (v.to(dtype).to(dt).requires_grad_() for v in (x, W))
        F.cross_entropy(torch.einsum("nf,vpf->nvp", xr, Wr), t, reduction="sum").backward()
        grads[dt] = (xr.grad, Wr.grad)
    assert torch.equal(Ws.grad[:, 1], torch.zeros_like(Ws.grad[:, 1]))
    for got, own, ref in zip((xs.grad, Ws.grad), grads[dtype], grads[torch.float64], strict=True):
        assert rel_err(got, ref) <= max(3 * eps(dtype), 2 * rel_err(own, ref))
