"""Property-based tests: the chunked loss against the float64 plain expression.

Each call is built from choices along every dimension of the input space:
shapes (one row, one class, N and V that are not multiples of the chunk, a
chunk larger than N), a K-dimensional loss, dtype, accumulation policy and
dtype, chunk rule, reduction, class weights, the fraction of ignored rows (0
to 100 %), bias, label smoothing, probability targets, the extras (z-loss,
softcap, token weights, shift) and which gradients are wanted. The reference
is ``F.cross_entropy(F.linear(x, W, b).view(N, C, *out), t, ...)`` in float64
on the same rounded inputs, plus the extras written out below; float64
results are checked against an 80-bit (numpy longdouble) evaluation of the
definition. Loss and every gradient must be within ``3·eps(dtype)`` relative
Frobenius error, or twice the plain expression's own error in that dtype where
that is larger, or ``eps·|terms|/|result|`` where the result cancels (see
``_check``).

Two sources of calls: a deterministic grid of ``GRID_SIZE`` calls in which
every option of every dimension occurs (asserted by
``test_grid_covers_every_option_of_every_dimension``, with the combinations
that matter most), and Hypothesis drawing the same choices at random (each
reported as an ``event``; a third of the profile's examples: 20 in ``ci``,
the default profile of ``tests/conftest.py``, 666 with
``HYPOTHESIS_PROFILE=long``).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import event, given, settings
from hypothesis import strategies as st

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine.gemm import NativeHalf
from linear_ce.engine.plan import make_plan

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
HALF = (torch.bfloat16, torch.float16)


def plain_expression(
    x,
    W,
    target,
    *,
    b,
    class_weight,
    reduction,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    token_weight,
    prob,
):
    """The definition, with full logits; returns ``(loss, z_loss term, lse per row)``.

    Like ``F.cross_entropy``, "mean" over zero total weight is NaN with zero gradients
    and ignored rows contribute exactly 0 to the loss.
    """
    classes, features = W.shape[0], W.shape[-1]
    flat_bias = None if b is None else b.reshape(-1)
    logits = F.linear(x, W.reshape(-1, features), flat_bias).view(
        x.shape[0], classes, *W.shape[1:-1]
    )
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    kwargs = {"weight": class_weight, "label_smoothing": label_smoothing}
    if not prob:
        kwargs["ignore_index"] = ignore_index
    lse = torch.logsumexp(logits, dim=1)
    per_row = F.cross_entropy(logits, target, reduction="none", **kwargs)
    valid = torch.ones_like(per_row, dtype=torch.bool) if prob else target != ignore_index
    omega = valid.to(per_row.dtype)
    if class_weight is not None and not prob:
        omega = omega * class_weight[torch.where(valid, target, 0)]
    # An ignored row adds nothing, even a NaN lse (as cross_entropy masks its own term).
    z_rows = torch.where(valid, z_loss * omega * lse.square(), 0.0)
    rows = per_row + z_rows
    if token_weight is not None:
        rows, z_rows = rows * token_weight, z_rows * token_weight
    if z_loss == 0.0 and token_weight is None:
        loss = F.cross_entropy(logits, target, reduction=reduction, **kwargs)
    elif reduction == "none":
        loss = rows
    elif reduction == "sum":
        loss = rows.sum()
    else:
        total = omega.sum()
        loss = rows.sum() / total if total != 0 else rows.sum() * 0.0 + math.nan
    if reduction == "none":
        z_term = z_rows
    elif reduction == "sum":
        z_term = z_rows.sum()
    else:
        z_term = z_rows.sum() / omega.sum()
    # lse is reported for the rows that carry a loss only (ignored rows are never computed).
    return loss, z_term.detach(), torch.where(valid, lse, 0.0).detach()


def build_call(choose, number, dtypes=DTYPES):
    """One complete call: tensors (in the tested dtype), keyword arguments, options.

    ``choose(name, options)`` picks one of ``options`` for the dimension ``name``;
    ``number(name, low, high)`` an int in ``[low, high]``. Hypothesis draws both
    (:func:`calls`); the grid (:func:`grid_call`) picks so that every option of every
    dimension occurs. A dimension is only chosen where it applies (no ignored rows for
    probability targets, no shift for a K-dimensional loss).
    """
    dtype = choose("dtype", dtypes)
    rows = choose("rows", [1, 2, 5, 17, 40, number("rows_any", 1, 40)])
    features = number("features", 1, 12)
    classes = choose("classes", [1, 2, 3, 7, 16, 31, 64])
    out_features = choose("out_features", [(), (), (2,), (3, 2)])
    loss_shape = (rows, *out_features)
    prob = choose("prob", [False, True])
    shift = 0 if prob or out_features else choose("shift", [0, 1, 2])
    g = torch.Generator().manual_seed(number("seed", 0, 2**31 - 1))
    scale = choose("scale", [0.1, 0.5, 1.0])
    x = (scale * torch.randn(rows, features, generator=g)).to(dtype)
    W = (scale * torch.randn(classes, *out_features, features, generator=g)).to(dtype)
    b = None
    if choose("bias", [False, True]):
        b = (scale * torch.randn(classes, *out_features, generator=g)).to(dtype)
    ignore_index = choose("ignore_index", [-100, -1, classes - 1])
    if prob:
        logits_shape = (rows, classes, *out_features)
        target = torch.softmax(2 * torch.randn(logits_shape, generator=g), dim=1).to(dtype)
        ignore_index = -100
    else:
        target = torch.randint(0, classes, loss_shape, generator=g)
        ignored = choose("ignored", [0.0, 0.1, 0.5, 0.9, 1.0])
        target[torch.rand(loss_shape, generator=g) < ignored] = ignore_index
        if ignored == 1.0:
            target.fill_(ignore_index)
        if choose("int32_target", [False, True]):
            target = target.to(torch.int32)
    class_weight = None
    if choose("class_weight", [False, True]):
        floor = choose("class_weight_floor", [0.0, 0.5])
        class_weight = (torch.rand(classes, generator=g) + floor).to(dtype)
    token_weight = None
    if choose("token_weight", [False, True]):
        token_weight = torch.rand(loss_shape, generator=g).to(dtype)
    kwargs = {
        "reduction": choose("reduction", ["mean", "sum", "none"]),
        "label_smoothing": choose("label_smoothing", [0.0, 0.1, 0.5, 1.0]),
        # V = 1 has an identically zero cross-entropy gradient; the z-loss gradient is then
        # the whole result and a fused (A + 2ζ·lse)·p − a loses its relative precision.
        "z_loss": choose("z_loss", [0.0, 1e-4, 0.1]) if classes > 1 else 0.0,
        "softcap": choose("softcap", [None, 0.5, 5.0]),
        "ignore_index": None
        if prob or (ignore_index == -100 and choose("default_ignore_index", [False, True]))
        else ignore_index,
    }
    wider = [None] + [d for d in (torch.float32, torch.float64) if d.itemsize > dtype.itemsize]
    policy = {
        "acc_policy": choose("acc_policy", ["auto", "accurate", "balanced", "compact"]),
        "acc_dtype": choose("acc_dtype", wider),
    }
    if choose("chunk_rule", ["size", "method"]) == "size":
        size = choose("batch_chunk_size", [1, 2, 3, 5, 8, rows, rows + 7])
        options = LinearCrossEntropyOptions(batch_chunk_size=size, **policy)
    else:
        method = choose(
            "chunking_method", ["auto", "budget:3", "aspect_ratio", "aspect_ratio:2", None]
        )
        options = LinearCrossEntropyOptions(chunking_method=method, **policy)
    # Which of x, W, b require grad: all three most often, then each alone, two, none.
    wanted = choose("requires_grad", ["xWb", "xWb", "xWb", "x", "W", "b", "xW", ""])
    needs = {name: name in wanted for name in ("x", "W", "b")}
    return {
        "dtype": dtype,
        "x": x,
        "W": W,
        "b": b,
        "target": target,
        "class_weight": class_weight,
        "token_weight": token_weight,
        "prob": prob,
        "shift": shift,
        "kwargs": kwargs,
        "options": options,
        "needs": needs,
        "upstream": choose("upstream", [1.0, 0.75, -2.0]),
        "grad_rows": torch.randn(loss_shape, generator=g).to(dtype),
    }


@st.composite
def calls(draw, dtypes=DTYPES):
    """:func:`build_call` drawn by Hypothesis; each choice is reported as an event."""

    def choose(name, options):
        value = draw(st.sampled_from(options))
        event(f"{name}={value}")
        return value

    def number(name, low, high):
        return draw(st.integers(low, high))

    return build_call(choose, number, dtypes)


#: Calls of the deterministic grid (the ``ci`` run's coverage; Hypothesis adds random ones).
GRID_SIZE = 60


def grid_call(index: int, record: dict | None = None) -> dict:
    """Call ``index`` of the grid: each dimension walks its own fixed random permutation
    of the grid, so each of its options occurs about ``GRID_SIZE / len(options)`` times
    and the dimensions vary independently. ``record`` collects the choices made."""
    numbers = random.Random(index)

    def choose(name, options):
        order = random.Random(name).sample(range(GRID_SIZE), GRID_SIZE)
        position = order[index] % len(options)
        if record is not None:
            offered, chosen = record.get(name, (0, set()))
            record[name] = (max(offered, len(options)), chosen | {position})
        return options[position]

    def number(name, low, high):
        return numbers.randint(low, high)

    return build_call(choose, number)


def _shifted(target: torch.Tensor, shift: int, ignore_index: int) -> torch.Tensor:
    out = torch.full_like(target, ignore_index)
    if shift < target.shape[0]:
        out[: target.shape[0] - shift] = target[shift:]
    return out


def _leaves(case, dtype):
    """Fresh leaves in ``dtype`` (values of the case's tensors), grads as drawn."""
    x = case["x"].to(dtype).requires_grad_(case["needs"]["x"])
    W = case["W"].to(dtype).requires_grad_(case["needs"]["W"])
    b = None if case["b"] is None else case["b"].to(dtype).requires_grad_(case["needs"]["b"])
    return x, W, b


def _run_plain(case, dtype):
    """Loss, lse and gradients of the plain expression evaluated in ``dtype``."""
    x, W, b = _leaves(case, dtype)
    kw = case["kwargs"]
    ignore_index = -100 if kw["ignore_index"] is None else kw["ignore_index"]
    target = case["target"]
    if case["prob"]:
        target = target.to(dtype)
    else:
        target = target.long()
        if case["shift"]:
            target = _shifted(target, case["shift"], ignore_index)
    loss, z_term, lse = plain_expression(
        x,
        W,
        target,
        b=b,
        class_weight=None if case["class_weight"] is None else case["class_weight"].to(dtype),
        reduction=kw["reduction"],
        ignore_index=ignore_index,
        label_smoothing=kw["label_smoothing"],
        z_loss=kw["z_loss"],
        softcap=kw["softcap"],
        token_weight=None if case["token_weight"] is None else case["token_weight"].to(dtype),
        prob=case["prob"],
    )
    return loss, z_term, lse, _grads(case, loss, (x, W, b))


def _grads(case, loss, leaves):
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    if not wanted:
        return [None] * 3
    if case["kwargs"]["reduction"] == "none":
        upstream = case["grad_rows"].to(loss.dtype).view(loss.shape)
    else:
        upstream = torch.full_like(loss, case["upstream"])
    found = iter(torch.autograd.grad(loss, wanted, upstream))
    return [next(found) if t is not None and t.requires_grad else None for t in leaves]


def _run_chunked(case):
    dtype = case["dtype"]
    x, W, b = _leaves(case, dtype)
    out = linear_ce.linear_cross_entropy(
        x.unsqueeze(0) if case["shift"] else x,
        W,
        case["target"].unsqueeze(0) if case["shift"] else case["target"],
        linear_bias=b,
        weight=case["class_weight"],
        token_weight=None
        if case["token_weight"] is None
        else (case["token_weight"].unsqueeze(0) if case["shift"] else case["token_weight"]),
        shift=case["shift"],
        options=case["options"],
        return_lse=True,
        return_z_loss=True,
        **case["kwargs"],
    )
    loss = out.loss.squeeze(0) if case["shift"] and out.loss.dim() else out.loss
    return loss, out.lse.reshape(-1), out.z_loss, _grads(case, loss, (x, W, b))


def _assert_close(name, got, ref, bound):
    """Same NaN/Inf pattern and relative error within ``bound`` on the finite entries."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    got64, ref64 = got.detach().double(), ref.detach().double()
    assert torch.equal(got64.isnan(), ref64.isnan()), f"{name}: NaN pattern differs"
    assert torch.equal(got64.isinf(), ref64.isinf()), f"{name}: Inf pattern differs"
    finite = ref64.isfinite()
    err = rel_err(got64[finite], ref64[finite])
    assert err <= bound, f"{name}: relative error {err:.3g} > bound {bound:.3g}"


def _ld(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy().astype(np.longdouble)


def _truth(case):
    """Loss, z-loss term, lse and gradients in 80-bit extended precision (numpy longdouble),
    from the definition: logits ``s`` (softcapped), ``p = softmax(s)``, target weights
    ``a_ij`` as torch defines them, ``∂ℓ_i/∂s_ij = (Σ_j a_ij + 2λω_i·lse_i)·p_ij − a_ij``.

    Used as the truth for float64 inputs, whose plain expression has rounding errors of its own.
    """
    kw = case["kwargs"]
    # A K-dimensional loss is P independent ones sharing x: the formula runs on the
    # N·P (row, position) pairs, and the gradients gather them back.
    x, W = _ld(case["x"]), _ld(case["W"])
    rows, classes, features = x.shape[0], W.shape[0], x.shape[1]
    Wp = W.reshape(classes, -1, features)
    positions = Wp.shape[1]
    pairs = rows * positions

    def per_pair(t: torch.Tensor) -> np.ndarray:
        return _ld(t).reshape(pairs)

    def logits_of(x_, W_, b_):
        s_ = np.einsum("nf,cpf->npc", x_, W_)
        if b_ is not None:
            s_ = s_ + b_.reshape(classes, positions).T[None]
        return s_.reshape(pairs, classes)

    def gathered(G_, x_, W_):
        G3 = G_.reshape(rows, positions, classes)
        return [
            np.einsum("npc,cpf->nf", G3, W_),
            np.einsum("npc,nf->cpf", G3, x_).reshape(W.shape),
            G3.sum(axis=0).T.reshape(W.shape[:-1]),
        ]

    b = None if case["b"] is None else _ld(case["b"])
    logits = logits_of(x, Wp, b)
    cap = kw["softcap"]
    if cap is not None:
        th = np.tanh(logits / cap)
        s, dcap = cap * th, 1 - th * th
    else:
        s, dcap = logits, np.ones_like(logits)
    peak = s.max(axis=1, keepdims=True)
    lse = peak[:, 0] + np.log(np.exp(s - peak).sum(axis=1))
    p = np.exp(s - lse[:, None])
    w = (
        np.ones(classes, np.longdouble)
        if case["class_weight"] is None
        else _ld(case["class_weight"])
    )
    smooth = kw["label_smoothing"]
    if case["prob"]:
        q = _ld(case["target"]).reshape(rows, classes, positions).transpose(0, 2, 1)
        a = ((1 - smooth) * q.reshape(pairs, classes) + smooth / classes) * w
        omega = np.ones(pairs, np.longdouble)
    else:
        ignore_index = -100 if kw["ignore_index"] is None else kw["ignore_index"]
        target = case["target"].long()
        if case["shift"]:
            target = _shifted(target, case["shift"], ignore_index)
        target = target.numpy().reshape(pairs)
        valid = target != ignore_index
        safe = np.where(valid, target, 0)
        a = np.zeros((pairs, classes), np.longdouble)
        a[np.arange(pairs), safe] = (1 - smooth) * w[safe] * valid
        a += (smooth / classes) * w[None, :] * valid[:, None]
        omega = valid * w[safe]
    z = kw["z_loss"]
    tau = (
        np.ones(pairs, np.longdouble)
        if case["token_weight"] is None
        else per_pair(case["token_weight"])
    )
    z_rows = z * omega * lse**2 * tau
    loss_rows = (a * (lse[:, None] - s)).sum(axis=1) * tau + z_rows
    reduction = kw["reduction"]
    if reduction == "none":
        loss, z_term, r = loss_rows, z_rows, per_pair(case["grad_rows"]) * tau
    elif reduction == "sum":
        loss, z_term, r = loss_rows.sum(), z_rows.sum(), case["upstream"] * tau
    elif omega.sum() == 0:
        loss, z_term, r = np.longdouble("nan"), np.longdouble("nan"), 0 * tau
    else:
        total = omega.sum()
        loss, z_term, r = (
            loss_rows.sum() / total,
            z_rows.sum() / total,
            case["upstream"] * tau / total,
        )
    G = r[:, None] * ((a.sum(axis=1) + 2 * z * omega * lse)[:, None] * p - a) * dcap
    # lse is reported for the rows that carry a loss only (ignored rows are never computed).
    reported_lse = lse if case["prob"] else np.where(valid, lse, 0)
    truth = (loss, z_term, reported_lse, gathered(G, x, Wp))

    # Magnitudes of the terms each output sums (|terms| instead of terms; the logits'
    # own rounding scales with |x|·|W|ᵀ + |b|): a result that cancels below these
    # cannot be computed to 3·eps of itself by any summation order.
    mag = logits_of(np.abs(x), np.abs(Wp), None if b is None else np.abs(b))
    lse_mag = np.abs(lse) + mag.max(axis=1)
    z_mag = z * np.abs(omega) * (lse**2 + 2 * np.abs(lse) * lse_mag) * np.abs(tau)
    loss_mag = (np.abs(a) * (np.abs(s) + mag + lse_mag[:, None])).sum(axis=1) * np.abs(tau) + z_mag
    p_mag = p * (1 + mag + lse_mag[:, None])
    coef = np.abs(a.sum(axis=1)) + 2 * z * np.abs(omega * lse)
    G_mag = np.abs(r)[:, None] * (coef[:, None] * p_mag + np.abs(a)) * (2 - dcap)
    norm = 1 if reduction != "mean" or omega.sum() == 0 else 1 / abs(omega.sum())
    if reduction != "none":
        loss_mag, z_mag = loss_mag.sum() * norm, z_mag.sum() * norm
    mags = (loss_mag, z_mag, lse_mag, gathered(G_mag, np.abs(x), np.abs(Wp)))
    return truth, mags


def _ld_err(got: torch.Tensor, truth) -> float:
    """Relative Frobenius error against an extended-precision truth (absolute if it is 0)."""
    diff = _ld(got) - np.asarray(truth, np.longdouble).reshape(tuple(got.shape))
    num = math.sqrt(float((diff * diff).sum()))
    den = math.sqrt(float((np.asarray(truth, np.longdouble) ** 2).sum()))
    return num / den if den > 0 else num


def _norm(a) -> float:
    a = np.asarray(a, np.longdouble)
    return math.sqrt(float((a * a).sum()))


def _check(name, got, plain64, truth, mag, acc, plain_same, dtype=None):
    """``got`` against the float64 plain expression (for float64 results against the
    extended-precision truth), relative error within the largest of ``3·eps(dtype)``
    (``dtype``: the result's precision, by default its dtype), twice the plain expression's
    own error in that dtype (fp32/fp64), and ``eps(acc)·|terms|/|result|`` where the
    result cancels (see :func:`_truth`)."""
    dtype = dtype or got.dtype
    if got.dtype == torch.float64:
        # The NaN/Inf patterns, and that the truth written here is the plain expression's
        # function: a formula slip (a sign, a missed mask or term) is O(1) relative, while
        # float64 rounding stays below 1e-8 unless the result cancels by more than 4e7×
        # (the cancellation bound below is what judges the value).
        _assert_close(name, got, plain64, 1e-8)
        truth64 = torch.from_numpy(np.asarray(truth, np.float64)).reshape(got.shape)
        _assert_close(name, truth64, plain64.detach(), 1e-8)
    if not plain64.isfinite().all():
        _assert_close(name, got, plain64, math.inf)
        return
    size = _norm(truth)
    cancel = eps(acc) * _norm(mag) / size if size > 0 else eps(acc) * _norm(mag)
    bound = max(3 * eps(dtype), cancel)
    if got.dtype == torch.float64:
        bound = max(bound, 2 * _ld_err(plain64, truth))
        err = _ld_err(got, truth)
        assert err <= bound, f"{name}: relative error {err:.3g} > bound {bound:.3g}"
        return
    if dtype == torch.float32 and plain_same.isfinite().all():
        bound = max(bound, 2 * rel_err(plain_same, plain64))
    _assert_close(name, got, plain64, bound)


@pytest.mark.parametrize("index", range(GRID_SIZE))
def test_grid_call_matches_float64_plain_expression(index):
    _check_call(grid_call(index))


@settings(max_examples=max(1, settings().max_examples // 3))
@given(case=calls())
def test_random_call_matches_float64_plain_expression(case):
    _check_call(case)


def test_grid_covers_every_option_of_every_dimension():
    """Each option of each dimension occurs in the grid (by position: some option lists
    depend on earlier choices), and so do the combinations a K-dimensional loss,
    shift and chunking are easiest to get wrong in."""
    record: dict = {}
    cases = [grid_call(i, record) for i in range(GRID_SIZE)]
    missing = {name: sorted(set(range(n)) - seen) for name, (n, seen) in record.items()}
    assert not any(missing.values()), f"options never chosen: {missing}"

    def count(condition):
        return sum(1 for case in cases if condition(case))

    def kdim(case):
        return case["W"].dim() > 2

    def several_chunks(case):
        size = case["options"].batch_chunk_size
        return size is not None and size < case["x"].shape[0]

    combinations = {
        "K-dim": kdim,
        "K-dim, token weights": lambda c: kdim(c) and c["token_weight"] is not None,
        "K-dim, softcap": lambda c: kdim(c) and c["kwargs"]["softcap"] is not None,
        "K-dim, z-loss": lambda c: kdim(c) and c["kwargs"]["z_loss"] > 0,
        "K-dim, smoothing": lambda c: kdim(c) and c["kwargs"]["label_smoothing"] > 0,
        "K-dim, class weights": lambda c: kdim(c) and c["class_weight"] is not None,
        "K-dim, probabilities": lambda c: kdim(c) and c["prob"],
        "K-dim, several chunks": lambda c: kdim(c) and several_chunks(c),
        "K-dim, every gradient": lambda c: kdim(c) and all(c["needs"].values()),
        "K-dim, reduction none": lambda c: kdim(c) and c["kwargs"]["reduction"] == "none",
        "shift inside the sequence": lambda c: 0 < c["shift"] < c["x"].shape[0],
        "several chunks, every gradient": lambda c: several_chunks(c) and all(c["needs"].values()),
        "no gradient": lambda c: not any(c["needs"].values()),
    }
    counts = {name: count(condition) for name, condition in combinations.items()}
    assert all(counts.values()), f"combinations never drawn: {counts}"


def _check_call(case):
    dtype = case["dtype"]
    acc = case["options"].acc_dtype or (torch.float32 if dtype in HALF else dtype)
    rounding = _logits_rounding(case, acc)
    loss, lse, z_term, grads = _run_chunked(case)
    plain64 = _run_plain(case, torch.float64)
    same = _run_plain(case, dtype)
    truth, mags = _truth(case)

    assert loss.dtype == dtype
    _check("loss", loss, plain64[0], truth[0], mags[0], rounding, same[0])
    for i, name in enumerate(("grad_input", "grad_weight", "grad_bias")):
        if plain64[3][i] is None:
            assert grads[i] is None
            continue
        assert grads[i].dtype == dtype
        _check(name, grads[i], plain64[3][i], truth[3][i], mags[3][i], rounding, same[3][i])
    # lse and the z-loss term are returned in the accumulation dtype, as accurate as the
    # logits they come from.
    assert lse.dtype == z_term.dtype == acc
    same_acc = _run_plain(case, acc) if acc != dtype else same
    _check(
        "lse",
        lse,
        plain64[2].reshape(-1),
        truth[2],
        mags[2],
        rounding,
        same_acc[2].reshape(-1),
        rounding,
    )
    _check(
        "z_loss",
        z_term,
        plain64[1].reshape(z_term.shape),
        truth[1],
        mags[1],
        rounding,
        same_acc[1].reshape(z_term.shape),
        rounding,
    )


def _logits_rounding(case, acc):
    """The dtype the logits are rounded to: the accumulation dtype, or the half input
    dtype itself where the plan uses native half GEMMs (CPUs with AVX512-BF16/AMX)."""
    x, W = case["x"], case["W"]
    plan = make_plan(
        x.shape[0],
        x.shape[1],
        W.shape[0],
        x.dtype,
        x.device,
        case["options"],
        tiles=2 if case["kwargs"]["softcap"] is not None else 1,
    )
    return case["dtype"] if isinstance(plan.gemm, NativeHalf) else acc
