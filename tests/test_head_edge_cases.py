"""The post-training heads under the loss's edge-case guarantees (docs/guarantees.md).

``token_logprobs``, ``token_objective`` and ``linear_divergence`` against the plain
expression on full logits, written here: non-finite inputs give the plain expression's
NaN/±Inf pattern (``token_objective`` is left out: its NaN policy is being settled,
issue 29 item 3), an empty batch, every position ignored, one class, non-contiguous
and transposed arguments, weights without ``requires_grad``, ``no_grad`` and
``inference_mode``, no mutation of any argument, bitwise determinism.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions

CHUNK2 = LinearCrossEntropyOptions(batch_chunk_size=2)
HEADS = ("token_logprobs", "token_objective", "linear_divergence")


def _objective(logprob, entropy, advantage):
    return -advantage * logprob - 0.1 * entropy


def _teacher(x: torch.Tensor, classes: int, seed: int = 9):
    """A teacher head of its own width (5) over the same positions and vocabulary."""
    g = torch.Generator().manual_seed(seed)
    xt = torch.randn(*x.shape[:-1], 5, generator=g, dtype=torch.float64).to(x.dtype)
    wt = torch.randn(classes, 5, generator=g, dtype=torch.float64).to(x.dtype)
    return xt, wt


def _side(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(10)
    return torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype)


def _run(head, x, W, t, *, b=None, teacher=None, reduction="mean", options=CHUNK2):
    """``(outputs, scalar)``: the head's outputs to compare and the scalar whose
    gradients are compared (a random upstream over per-position outputs)."""
    if head == "token_logprobs":
        out = linear_ce.token_logprobs(
            x, W, t, linear_bias=b, entropy=True, top1=True, options=options
        )
        up = _side(t, out.logprob.dtype)
        return [out.logprob, out.entropy, out.top1], (out.logprob * up + out.entropy).sum()
    if head == "token_objective":
        side = _side(t, torch.promote_types(x.dtype, torch.float32))
        loss = linear_ce.token_objective(
            x, W, t, _objective, linear_bias=b, entropy=True, options=options, advantage=side
        )
        return [loss], loss
    xt, wt = teacher if teacher is not None else _teacher(x, W.shape[0])
    loss = linear_ce.linear_divergence(
        x, W, xt, wt, t, student_bias=b, beta=0.5, reduction=reduction, options=options
    )
    return [loss], loss.sum() if reduction != "none" else (loss * _side(t, loss.dtype)).sum()


def _plain(head, x, W, t, *, b=None, teacher=None, reduction="mean", side=None):
    """The plain expression on full logits, in the dtype of ``x``; ignored positions
    contribute exactly zero (they are never part of the computation). ``side``: the
    upstream/advantage of each position (``_side(t)`` unless given)."""
    side = (_side(t, torch.float64) if side is None else side).to(x.dtype)
    s = x @ W.T + (b if b is not None else 0)
    valid = t != -100
    logp = torch.log_softmax(s, -1)
    if head == "linear_divergence":
        xt, wt = teacher if teacher is not None else _teacher(x, W.shape[0])
        lt = torch.log_softmax(xt.to(x.dtype) @ wt.to(x.dtype).T, -1)
        mix = torch.logsumexp(torch.stack([lt, logp]), 0) - math.log(2)
        rows = 0.5 * ((lt.exp() * (lt - mix)).sum(-1) + (logp.exp() * (logp - mix)).sum(-1))
        rows = torch.where(valid, rows, 0.0)
        if reduction == "none":
            return [rows], (rows * side).sum()
        loss = rows.sum() if reduction == "sum" else rows.sum() / valid.sum()
        return [loss], loss
    safe = torch.where(valid, t, 0)
    lp = torch.where(valid, logp.gather(-1, safe[..., None])[..., 0], 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    if head == "token_logprobs":
        top = s.max(-1, keepdim=True).values
        unique = (s == top).sum(-1) == 1
        top1 = valid & unique & (s.argmax(-1) == safe)
        return [lp, ent, top1], (lp * side + ent).sum()
    loss = torch.where(valid, _objective(lp, ent, side), 0.0).sum()
    return [loss], loss


def _grads(scalar, leaves):
    wanted = [a for a in leaves if a is not None and a.requires_grad]
    got = iter(torch.autograd.grad(scalar, wanted)) if wanted else iter(())
    return [next(got) if a is not None and a.requires_grad else None for a in leaves]


def _leaf(a, grad=True):
    return None if a is None else a.detach().clone().requires_grad_(grad)


def _inputs(rows=7, features=4, classes=6, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g, dtype=torch.float64).to(dtype)
    W = torch.randn(classes, features, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(classes, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(0, classes, (rows,), generator=g)
    return x, W, b, t


# ---------------------------------------------------------------- non-finite inputs

NONFINITE = [
    ("x", (1, 2), float("nan")),
    ("x", (2, 0), float("inf")),
    ("x", (3, 1), float("-inf")),
    ("W", (3, 1), float("nan")),
    ("W", (0, 3), float("inf")),
    ("b", (3,), float("nan")),
    ("b", (3,), float("inf")),  # every position's maximum is +inf
    ("b", (2,), float("-inf")),  # a masked class: finite unless it is the target
    ("teacher_x", (1, 0), float("nan")),
    ("teacher_x", (2, 3), float("inf")),
]


def _patterns_equal(name, got, ref, bound):
    got, ref = got.detach().double(), ref.detach().double()
    for what in ("isnan", "isposinf", "isneginf"):
        same = torch.equal(getattr(got, what)(), getattr(ref, what)())
        assert same, f"{name}: {what} pattern {got} vs {ref}"
    finite = ref.isfinite()
    assert rel_err(got[finite], ref[finite]) <= bound, f"{name}: {got} vs {ref}"


def _plain_on_carried(head, x, W, b, t, teacher, reduction, dtype):
    """The plain expression in ``dtype`` on the positions not ignored, its per-position
    outputs and input gradient scattered back (zeros where ignored)."""
    carried = t != -100
    leaves = [_leaf(a.to(dtype)) for a in (x[carried], W, b)]
    outputs, scalar = _plain(
        head,
        *leaves[:2],
        t[carried],
        b=leaves[2],
        teacher=(teacher[0][carried].to(dtype), teacher[1].to(dtype)),
        reduction=reduction,
        side=_side(t, torch.float64)[carried],
    )
    ref = [*(o.detach() for o in outputs), *_grads(scalar, leaves)]
    ref[-3] = torch.zeros(x.shape, dtype=dtype).index_put((carried,), ref[-3])
    for i, r in enumerate(ref[:-3]):
        if r.dim():
            ref[i] = torch.zeros(t.shape, dtype=r.dtype).index_put((carried,), r)
    return ref


@pytest.mark.parametrize(
    ("head", "reduction"),
    [("token_logprobs", None), ("linear_divergence", "mean"), ("linear_divergence", "none")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_inputs_propagate_like_the_plain_expression(head, dtype, reduction):
    """NaN/±Inf in the hidden state, weight, bias or the teacher's hidden state: the
    same NaN/+Inf/−Inf pattern in every output and gradient as the plain expression, no
    exception. Positions 1 and 2 (some poisoned) are ignored in half the cases: their
    outputs and gradients are zero whatever their hidden state holds (the reference is
    the plain expression on the carried positions, zeros scattered back)."""
    for (where, index, value), ignore in itertools.product(NONFINITE, (False, True)):
        x, W, b, t = _inputs(6, 4, 7, dtype, seed=2)
        xt, wt = _teacher(x, 7)
        {"x": x, "W": W, "b": b, "teacher_x": xt}[where][index] = value
        if ignore:
            t[1], t[2] = -100, -100
        leaves = [_leaf(a) for a in (x, W, b)]
        outputs, scalar = _run(
            head, leaves[0], leaves[1], t, b=leaves[2], teacher=(xt, wt), reduction=reduction
        )
        got = [*outputs, *_grads(scalar, leaves)]

        call = (head, x, W, b, t, (xt, wt), reduction)
        exact, plain = _plain_on_carried(*call, torch.float64), _plain_on_carried(*call, dtype)
        for i, (a, r, p) in enumerate(zip(got, exact, plain, strict=True)):
            case = f"{head} {where}{index}={value} ignored={ignore} #{i}"
            if a.dtype == torch.bool:
                assert torch.equal(a, r), case
                continue
            # The patterns exactly; the finite entries within the house bound, 3 eps or
            # twice the plain same-dtype expression's error on them.
            finite = r.isfinite() & p.isfinite()
            own = rel_err(p[finite], r[finite])
            _patterns_equal(case, a, r, max(3 * eps(dtype), 2 * own))


def test_top1_of_an_infinite_target_logit():
    """``top1 = [t = argmax s and the maximum is unique]``: a target whose logit is the
    only +inf is the unique argmax (its log-probability is NaN, as in the plain
    expression, but top1 is a comparison of logits)."""
    x, W, b, t = _inputs(6, 4, 7, torch.float32, seed=2)
    W[0, 3] = float("inf")
    t[:] = 0
    s = x @ W.T + b
    unique_inf = (s[:, 0] == math.inf) & (s[:, 1:] < math.inf).all(-1)
    assert unique_inf.any()
    out = linear_ce.token_logprobs(x, W, t, linear_bias=b, top1=True)
    _, _, want = _plain("token_logprobs", x, W, t, b=b)[0]
    assert torch.equal(out.top1, want)
    assert out.top1[unique_inf].all()


#: Bias patterns (class: value) that put a non-finite logit in every row.
_NONFINITE_ROWS = {
    "target +inf alone": {0: math.inf},
    "+inf tie, target first": {0: math.inf, 4: math.inf},
    "+inf tie, target second": {2: math.inf, 4: math.inf},
    "+inf elsewhere": {5: math.inf},
    "every logit -inf": dict.fromkeys(range(7), -math.inf),
    "every logit +inf": dict.fromkeys(range(7), math.inf),
    "a NaN logit": {3: math.nan},
}


@pytest.mark.parametrize("rule", ["unique", "argmax"])
@pytest.mark.parametrize("case", list(_NONFINITE_ROWS))
def test_top1_with_non_finite_row_maximum(case, rule):
    """top1 is a comparison of logits, also where the row maximum is ±inf (the loop's
    ``u = s - m`` is NaN at the maximum there): the plain rule on the logits, in float64,
    over targets at, before, between and after the non-finite classes. A row with a NaN
    logit has no maximum: top1 is false under both rules (linear_ce.losses.token_logprob)."""
    x, W, b, _ = _inputs(8, 4, 7, torch.float32, seed=3)
    for cls, value in _NONFINITE_ROWS[case].items():
        b[cls] = value
    t = torch.tensor([0, 2, 4, 1, 6, 4, 0, 2])
    s = x.double() @ W.double().T + b.double()
    top = s.max(-1).values
    first = s.argmax(-1)
    if rule == "unique":
        want = ((s == top[:, None]).sum(-1) == 1) & (first == t)
    else:
        want = (first == t) & ~top.isnan()
    for options in (CHUNK2, LinearCrossEntropyOptions(batch_chunk_size=8)):
        out = linear_ce.token_logprobs(
            x, W, t, linear_bias=b, top1=True, top1_rule=rule, options=options
        )
        assert torch.equal(out.top1, want), (case, rule, out.top1, want)


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("batch", [(0,), (2, 0)])
def test_empty_batch(head, batch):
    """No position: per-position outputs empty, a "mean" NaN (0/0, as torch), a sum 0,
    zero gradients of the right shapes."""
    x = torch.randn(*batch, 4, dtype=torch.float64, requires_grad=True)
    W = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    t = torch.zeros(batch, dtype=torch.long)
    outputs, scalar = _run(head, x, W, t)
    if head == "token_logprobs":
        assert all(o.shape == batch for o in outputs)
    elif head == "token_objective":
        assert outputs[0].item() == 0.0
    else:
        assert outputs[0].isnan()
    gx, gW = torch.autograd.grad(scalar, [x, W])
    assert gx.shape == x.shape and gW.shape == W.shape
    assert not gx.any() and not gW.any()


@pytest.mark.parametrize(
    ("head", "reduction"),
    [
        ("token_logprobs", None),
        ("token_objective", None),
        ("linear_divergence", "mean"),
        ("linear_divergence", "sum"),
        ("linear_divergence", "none"),
    ],
)
def test_every_position_ignored(head, reduction):
    """Outputs zero (a divergence "mean" NaN, 0/0 as torch's cross-entropy), gradients
    exactly zero, like the plain expression."""
    x, W, b, t = _inputs()
    t[:] = -100
    leaves = [_leaf(a) for a in (x, W, b)]
    outputs, scalar = _run(head, *leaves[:2], t, b=leaves[2], reduction=reduction or "mean")
    ref_leaves = [_leaf(a) for a in (x, W, b)]
    ref_out, _ = _plain(head, *ref_leaves[:2], t, b=ref_leaves[2], reduction=reduction)
    for a, r in zip(outputs, ref_out, strict=True):
        assert torch.equal(a.isnan(), r.isnan()) and torch.equal(a.nan_to_num(), r.nan_to_num())
    for g in _grads(scalar, leaves):
        assert not g.any()


@pytest.mark.parametrize("head", HEADS)
def test_single_class(head):
    """V = 1: log-probability and entropy exactly 0, the target the unique argmax, a
    divergence of 0 and gradients exactly zero, as in the plain expression."""
    x, W, b, t = _inputs(5, 3, 1)
    t[2] = -100
    leaves = [_leaf(a) for a in (x, W, b)]
    outputs, scalar = _run(head, *leaves[:2], t, b=leaves[2])
    ref_out, _ = _plain(head, *(a.detach() for a in leaves[:2]), t, b=b)
    for a, r in zip(outputs, ref_out, strict=True):
        assert torch.equal(a, r.to(a.dtype))
    assert all(not g.any() for g in _grads(scalar, leaves))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("layout", ["transposed", "strided", "input_transposed"])
def test_non_contiguous_arguments(head, layout):
    """A weight that is a ``.t()`` view of an ``(F, V)`` leaf (tied embeddings stored
    transposed), strided slices, a transposed input: the same outputs and gradients (to
    the leaves) as the plain expression, fp32 against float64 within 3 eps or twice the
    plain fp32 expression's own error."""
    g = torch.Generator().manual_seed(3)
    base_w = torch.randn(6, 13, generator=g)  # (F, V)
    base_x = torch.randn(6, 9, generator=g)  # (F, N)
    wide_w = torch.randn(13, 12, generator=g)
    wide_x = torch.randn(9, 12, generator=g)
    t = torch.randint(0, 13, (9,), generator=g)
    t[4] = -100

    def views(leaves):
        bw, bx, ww, wx = leaves
        if layout == "transposed":
            return wx[:, ::2], bw.t()
        if layout == "strided":
            return wx[:, 1::2], ww[:, ::2]
        return bx.t(), ww[:, :6]

    def run(fn, dtype):
        leaves = [_leaf(a.to(dtype)) for a in (base_w, base_x, wide_w, wide_x)]
        x, W = views(leaves)
        teacher = _teacher(x.detach(), 13)
        outputs, scalar = fn(head, x, W, t, teacher=teacher)
        grads = torch.autograd.grad(scalar, leaves, allow_unused=True)
        return [o.detach() for o in outputs] + [a for a in grads if a is not None]

    x, W = views([base_w, base_x, wide_w, wide_x])
    assert not (x.is_contiguous() and W.is_contiguous())
    got, exact, plain = (
        run(_run, torch.float32),
        run(_plain, torch.float64),
        run(_plain, torch.float32),
    )
    assert len(got) == len(exact)
    for a, e, p in zip(got, exact, plain, strict=True):
        if a.dtype == torch.bool:
            assert torch.equal(a, e)
        else:
            assert rel_err(a, e) <= max(3 * eps(torch.float32), 2 * rel_err(p, e))


@pytest.mark.parametrize("head", HEADS)
def test_weight_without_requires_grad(head):
    x, W, b, t = _inputs(8, 5, 9, torch.float32)
    leaves = [_leaf(x), _leaf(W, False), _leaf(b, False)]
    _, scalar = _run(head, *leaves[:2], t, b=leaves[2])
    scalar.backward()
    assert leaves[1].grad is None and leaves[2].grad is None
    wide = [_leaf(x.double()), W.double(), b.double()]
    plain = [_leaf(x), W, b]
    for leaves_, fn in ((wide, _plain), (plain, _plain)):
        fn(head, *leaves_[:2], t, b=leaves_[2])[1].backward()
    bound = max(3 * eps(torch.float32), 2 * rel_err(plain[0].grad, wide[0].grad))
    assert rel_err(leaves[0].grad, wide[0].grad) <= bound


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("head", HEADS)
def test_without_autograd(head, mode):
    """Under ``inference_mode``/``no_grad``: the plain expression's outputs, no graph."""
    x, W, b, t = _inputs(8, 5, 9, torch.float32)
    leaves = [_leaf(a) for a in (x, W, b)]
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        outputs, _ = _run(head, *leaves[:2], t, b=leaves[2])
    exact, _ = _plain(head, x.double(), W.double(), t, b=b.double())
    plain, _ = _plain(head, x, W, t, b=b)
    for a, e, p in zip(outputs, exact, plain, strict=True):
        assert a.grad_fn is None and not a.requires_grad
        if a.dtype == torch.bool:
            assert torch.equal(a, e)
        else:
            assert rel_err(a, e) <= max(3 * eps(torch.float32), 2 * rel_err(p, e))


# ---------------------------------------------------------------- no mutation, determinism


def _full_call(head, dtype=torch.float32, seed=4):
    """Every tensor argument a head takes: hidden states ``(2, 5, 6)`` with a bias and an
    ignored position, shifted targets, side inputs, a teacher with a bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 6, generator=g).to(dtype).requires_grad_()
    W = torch.randn(11, 6, generator=g).to(dtype).requires_grad_()
    b = torch.randn(11, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, 11, (2, 5), generator=g)
    t[0, 2] = -100
    extra = {}
    if head == "token_objective":
        extra = {
            "advantage": torch.randn(2, 5, generator=g),
            "weight": torch.rand(2, 5, generator=g),
        }
    elif head == "linear_divergence":
        extra = {
            "teacher_input": torch.randn(2, 5, 4, generator=g).to(dtype),
            "teacher_weight": torch.randn(11, 4, generator=g).to(dtype),
            "teacher_bias": torch.randn(11, generator=g).to(dtype),
        }
    return x, W, b, t, extra


def _call(head, x, W, b, t, extra, options):
    if head == "token_logprobs":
        out = linear_ce.token_logprobs(
            x, W, t, linear_bias=b, shift=True, entropy=True, softcap=5.0, options=options
        )
        return (out.logprob + out.entropy).sum()
    if head == "token_objective":
        return linear_ce.token_objective(
            x,
            W,
            t,
            lambda lp, ent, advantage, weight: -weight * advantage * lp - 0.1 * weight * ent,
            linear_bias=b,
            shift=True,
            entropy=True,
            softcap=5.0,
            options=options,
            **extra,
        )
    return linear_ce.linear_divergence(
        x,
        W,
        extra["teacher_input"],
        extra["teacher_weight"],
        t,
        student_bias=b,
        teacher_bias=extra["teacher_bias"],
        beta=0.3,
        hard_weight=0.5,
        shift=True,
        student_softcap=5.0,
        options=options,
    )


@pytest.mark.parametrize("head", HEADS)
def test_arguments_are_not_mutated(head):
    """Every tensor argument (side inputs and the teacher's too) bit-identical and
    unversioned after forward and backward."""
    x, W, b, t, extra = _full_call(head)
    args = [x, W, b, t, *extra.values()]
    before = [a.detach().clone() for a in args]
    versions = [a._version for a in args]
    _call(head, x, W, b, t, extra, CHUNK2).backward()
    for a, a0, v in zip(args, before, versions, strict=True):
        assert torch.equal(a.detach(), a0) and a._version == v


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_deterministic(head, dtype):
    """Two runs with the same inputs: bit-identical loss and gradients on CPU."""
    results = []
    for _ in range(2):
        x, W, b, t, extra = _full_call(head, dtype)
        loss = _call(head, x, W, b, t, extra, LinearCrossEntropyOptions(batch_chunk_size=3))
        results.append([loss.detach(), *torch.autograd.grad(loss, [x, W, b])])
    for a, b_ in zip(*results, strict=True):
        assert torch.equal(a, b_)
