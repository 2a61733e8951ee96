"""The chunked engine (``linear_ce.linear_cross_entropy``) against independent references.

The references are written here: the plain torch expression
``F.cross_entropy(F.linear(x, W, b), t, ...)`` in float64 on the same (rounded)
inputs, and, for float64 inputs, the same loss and its textbook gradient in
numpy's extended precision (the float64 plain expression is itself a few eps
off at the larger shape, so it cannot judge a float64 result to 3 eps).
"""

import itertools
import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import linear_ce
import linear_ce.engine.chunk_loop
import linear_ce.ops
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
POLICIES = ["accurate", "balanced", "compact", "auto"]
REDUCTIONS = ["mean", "sum", "none"]
# None: the default -100 marks the ignored rows; 3 is a real class; 1000 and -5 lie outside [0, C).
IGNORE_INDICES = [None, 3, 1000, -5]
EXTENDED = np.finfo(np.longdouble).eps < 1e-18


def _inputs(n, f, c, dtype, class_weight, ignore_index, bias, seed=0):
    """Random inputs rounded to ``dtype``; every fourth target is the ignored value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=gen, dtype=torch.float64).to(dtype)
    W = (torch.randn(c, f, generator=gen, dtype=torch.float64) * (2 / f**0.5)).to(dtype)
    b = torch.randn(c, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    w = (
        (torch.rand(c, generator=gen, dtype=torch.float64) + 0.2).to(dtype)
        if class_weight
        else None
    )
    t = torch.randint(0, c, (n,), generator=gen)
    t[::4] = -100 if ignore_index is None else ignore_index
    upstream = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    return x, W, b, w, t, upstream


def _plain(
    x, W, t, *, linear_bias=None, weight=None, reduction="mean", ignore_index=None, options=None
):
    """The plain expression, as torch users write it (``options`` ignored)."""
    ii = -100 if ignore_index is None else ignore_index
    return F.cross_entropy(
        F.linear(x, W, linear_bias), t, weight=weight, reduction=reduction, ignore_index=ii
    )


def _run(fn, x, W, b, w, t, reduction, ignore_index, upstream, **kwargs):
    """``[loss, grad_x, grad_W(, grad_b)]`` of ``fn``; backward with ``upstream`` for "none"."""
    leaves = [a.detach().clone().requires_grad_(True) for a in (x, W, b) if a is not None]
    bias = leaves[2] if b is not None else None
    loss = fn(
        leaves[0],
        leaves[1],
        t,
        linear_bias=bias,
        weight=w,
        reduction=reduction,
        ignore_index=ignore_index,
        **kwargs,
    )
    loss.backward(upstream.to(loss.dtype) if reduction == "none" else None)
    return [loss.detach()] + [leaf.grad for leaf in leaves]


def _double(t):
    return None if t is None else t.double()


def _exact(x, W, b, w, t, reduction, ignore_index, upstream):
    """Loss and gradients in extended precision: softmax cross entropy and its textbook
    gradient ``∂ℓ/∂s_i = r_i·ω_i·(softmax(s_i) − onehot(t_i))``."""
    ld = np.longdouble
    X, Wn = x.double().numpy().astype(ld), W.double().numpy().astype(ld)
    S = X @ Wn.T
    if b is not None:
        S = S + b.double().numpy().astype(ld)
    m = S.max(axis=1, keepdims=True)
    E = np.exp(S - m)
    Z = E.sum(axis=1, keepdims=True)
    lse = (m + np.log(Z))[:, 0]
    tn = t.numpy()
    valid = tn != (-100 if ignore_index is None else ignore_index)
    safe = np.where(valid, tn, 0)
    omega = valid.astype(ld)
    if w is not None:
        omega = omega * w.double().numpy().astype(ld)[safe]
    rows = np.arange(len(tn))
    row_loss = omega * (lse - S[rows, safe])
    if reduction == "mean":
        loss, r = row_loss.sum() / omega.sum(), np.full(len(tn), 1 / omega.sum(), dtype=ld)
    elif reduction == "sum":
        loss, r = row_loss.sum(), np.ones(len(tn), dtype=ld)
    else:
        loss, r = row_loss, upstream.double().numpy().astype(ld)
    dS = E / Z
    dS[rows, safe] -= 1
    dS *= (r * omega)[:, None]
    grads = [dS @ Wn, dS.T @ X] + ([dS.sum(axis=0)] if b is not None else [])
    return [np.asarray(loss, dtype=ld), *grads]


def _rel_err_ld(got, exact):
    """Relative Frobenius error in extended precision."""
    g = got.detach().double().numpy().astype(np.longdouble)
    return float(np.linalg.norm((g - exact).ravel()) / np.linalg.norm(exact.ravel()))


def _check(dtype, policies, shape, chunk, reduction, ignore_index, class_weight, bias, seed=0):
    """Every policy's loss and gradients within 3·eps(dtype) of the reference, or, for
    float32/float64, within twice the plain expression's own error in that dtype where
    that is larger (the project's accuracy rule)."""
    n, f, c = shape
    x, W, b, w, t, up = _inputs(n, f, c, dtype, class_weight, ignore_index, bias, seed)
    args = (t, reduction, ignore_index, up.double())
    names = ["loss", "grad_input", "grad_weight", "grad_bias"]
    ref = _run(_plain, _double(x), _double(W), _double(b), _double(w), *args)
    bound = [3 * eps(dtype)] * len(ref)
    if dtype == torch.float64:
        if not EXTENDED:
            pytest.skip("numpy.longdouble is not wider than float64 on this platform")
        exact = _exact(x, W, b, w, t, reduction, ignore_index, up)
        # The float64 plain expression is the extended one up to its own rounding, which
        # (large sums with cancellation) may exceed 3 eps: then twice it is the bound.
        for i, (name, r, e) in enumerate(zip(names, ref, exact, strict=False)):
            plain_err = _rel_err_ld(r, e)
            assert plain_err <= 16 * eps(dtype), f"extended reference disagrees on {name}"
            bound[i] = max(bound[i], 2 * plain_err)
    elif dtype == torch.float32:
        plain32 = _run(_plain, x, W, b, w, *args[:3], up)
        bound = [max(bd, 2 * rel_err(p, r)) for bd, p, r in zip(bound, plain32, ref, strict=True)]
    for policy in policies:
        options = LinearCrossEntropyOptions(batch_chunk_size=chunk, acc_policy=policy)
        got = _run(linear_ce.linear_cross_entropy, x, W, b, w, *args[:3], up, options=options)
        for i, (name, g) in enumerate(zip(names, got, strict=False)):
            assert g.dtype == dtype
            err = _rel_err_ld(g, exact[i]) if dtype == torch.float64 else rel_err(g, ref[i])
            assert err <= bound[i], f"{policy}: {name} error {err / eps(dtype):.2f} eps"


@pytest.mark.parametrize(
    ("class_weight", "bias"), [(False, False), (True, True), (True, False), (False, True)]
)
@pytest.mark.parametrize("ignore_index", IGNORE_INDICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accuracy_grid_small(dtype, reduction, ignore_index, class_weight, bias):
    # N=13 in chunks of 4: the last chunk is partial.
    _check(dtype, POLICIES, (13, 5, 7), 4, reduction, ignore_index, class_weight, bias)


_LARGE_CASES = [
    (dtype, policy, REDUCTIONS[i % 3], IGNORE_INDICES[i % 4], i % 2 == 0, i % 5 != 0)
    for i, (dtype, policy) in enumerate(itertools.product(DTYPES, POLICIES))
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "policy", "reduction", "ignore_index", "class_weight", "bias"), _LARGE_CASES
)
def test_accuracy_grid_large(dtype, policy, reduction, ignore_index, class_weight, bias):
    # N=252 in chunks of 64 (last one 60 rows); F=123 and C=507 not multiples of anything.
    _check(
        dtype, [policy], (252, 123, 507), 64, reduction, ignore_index, class_weight, bias, seed=1
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_chunk_size_invariance(reduction):
    x, W, b, w, t, up = _inputs(13, 5, 7, torch.float64, True, 1000, True, seed=2)
    args = (x, W, b, w, t, reduction, 1000, up)
    whole = _run(
        linear_ce.linear_cross_entropy,
        *args,
        options=LinearCrossEntropyOptions(chunking_method=None),
    )
    ref = _run(_plain, *args)
    for name, g, r in zip(
        ["loss", "grad_input", "grad_weight", "grad_bias"], whole, ref, strict=True
    ):
        assert rel_err(g, r) <= 3 * eps(torch.float64), name
    for chunk in (1, 2, 3, 4, 7, 13):
        got = _run(
            linear_ce.linear_cross_entropy,
            *args,
            options=LinearCrossEntropyOptions(batch_chunk_size=chunk),
        )
        for g, h in zip(got, whole, strict=True):
            assert rel_err(g, h) <= 3 * eps(torch.float64), f"chunk {chunk}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_batch_invariance(dtype):
    x, W, b, w, t, _ = _inputs(13, 5, 7, dtype, True, None, True, seed=3)
    options = LinearCrossEntropyOptions(batch_chunk_size=4)
    total = linear_ce.linear_cross_entropy(
        x, W, t, linear_bias=b, weight=w, reduction="sum", options=options
    )
    rows = [
        linear_ce.linear_cross_entropy(
            x[i : i + 1], W, t[i : i + 1], linear_bias=b, weight=w, reduction="sum", options=options
        )
        for i in range(13)
    ]
    assert rel_err(total, torch.stack(rows).sum()) <= 3 * eps(dtype)
    ref = _plain(
        x.double(), W.double(), t, linear_bias=b.double(), weight=w.double(), reduction="sum"
    )
    assert rel_err(total, ref) <= 3 * eps(dtype)


def test_upstream_gradient_scales_the_stored_gradients():
    x, W, b, w, t, _ = _inputs(13, 5, 7, torch.float64, True, 3, True, seed=4)
    grads = []
    for fn in (linear_ce.linear_cross_entropy, _plain):
        xs, Ws = x.clone().requires_grad_(), W.clone().requires_grad_()
        loss = fn(xs, Ws, t, linear_bias=b, weight=w, ignore_index=3)
        (-2.5 * loss).backward()
        grads.append((xs.grad, Ws.grad))
    for g, r in zip(*grads, strict=True):
        assert rel_err(g, r) <= 3 * eps(torch.float64)


class _LargeWrites(TorchDispatchMode):
    """Records every op but a view whose output has at least ``elements`` elements."""

    def __init__(self, elements):
        super().__init__()
        self.elements, self.ops = elements, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and any(
            isinstance(o, torch.Tensor) and o.numel() >= self.elements
            for o in torch.utils._pytree.tree_leaves(out)
        ):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("upstream", [None, 0.5], ids=["loss.backward()", "0.5"])
def test_a_unit_upstream_gradient_is_handed_over_without_a_pass(upstream):
    # loss.backward() hands over the gradients formed in forward as they are: a scaling
    # by 1 would be a pass over the (V, F) weight gradient that changes nothing.
    x, W, _, _, t, _ = _inputs(40, 16, 300, torch.float32, False, None, False, seed=5)
    xs, Ws = x.clone().requires_grad_(), W.clone().requires_grad_()
    loss = linear_ce.linear_cross_entropy(xs, Ws, t)
    with _LargeWrites(W.numel()) as writes:
        loss.backward(None if upstream is None else torch.tensor(upstream))
    assert writes.ops == ([] if upstream is None else ["aten.mul_.Tensor"])
    x64, W64 = x.double().requires_grad_(), W.double().requires_grad_()
    F.cross_entropy(x64 @ W64.T, t).backward(torch.tensor(1.0 if upstream is None else upstream))
    # fp32 inputs: the float64 plain expression judges them to 3 eps (house rule).
    assert rel_err(xs.grad, x64.grad) <= 3 * eps(torch.float32)
    assert rel_err(Ws.grad, W64.grad) <= 3 * eps(torch.float32)


def test_an_upstream_gradient_with_a_graph_keeps_its_derivative():
    # create_graph with an upstream gradient that requires grad, equal to 1: the
    # handed-over gradient depends on it, so its derivative must reach it.
    x, W, _, _, t, _ = _inputs(13, 5, 7, torch.float64, False, None, False, seed=6)
    Ws = W.clone().requires_grad_()
    scale = torch.ones((), dtype=torch.float64, requires_grad=True)
    (grad_w,) = torch.autograd.grad(
        linear_ce.linear_cross_entropy(x, Ws, t), Ws, scale, create_graph=True
    )
    probe = torch.randn(W.shape, generator=torch.Generator().manual_seed(1), dtype=W.dtype)
    (grad_w * probe).sum().backward()
    Wr = W.clone().requires_grad_()
    (ref,) = torch.autograd.grad(F.cross_entropy(x @ Wr.T, t), Wr)
    assert scale.grad is not None
    # One float64 sum of V·F products against another: a few eps of its magnitude.
    assert (
        abs(scale.grad - (ref * probe).sum()) <= 3 * eps(torch.float64) * (ref * probe).abs().sum()
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck(reduction):
    x, W, b, w, t, _ = _inputs(6, 3, 4, torch.float64, True, 1000, True, seed=5)
    options = LinearCrossEntropyOptions(batch_chunk_size=4, allow_retain_graph=True)

    def fn(xs, Ws, bs):
        return linear_ce.linear_cross_entropy(
            xs,
            Ws,
            t,
            linear_bias=bs,
            weight=w,
            reduction=reduction,
            ignore_index=1000,
            options=options,
        )

    leaves = [a.clone().requires_grad_() for a in (x, W, b)]
    assert torch.autograd.gradcheck(fn, leaves)


def _builtin_options(**kwargs):
    return torch.nn.LinearCrossEntropyOptions(**kwargs)


@pytest.mark.skipif(
    not hasattr(F, "linear_cross_entropy"), reason="torch has no builtin linear_cross_entropy"
)
@pytest.mark.parametrize(
    ("dtype", "policy"),
    [
        (torch.float64, "auto"),
        (torch.float32, "accurate"),
        (torch.bfloat16, "accurate"),
        (torch.bfloat16, "compact"),
        (torch.float16, "balanced"),
    ],
    ids=str,
)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_same_as_torch_builtin(dtype, policy, reduction):
    # V > F so the builtin really chunks instead of falling back to its reference path.
    x, W, b, w, t, up = _inputs(37, 8, 50, dtype, True, 1000, True, seed=6)
    args = (x, W, b, w, t, reduction, 1000, up)
    try:
        builtin = _builtin_options(batch_chunk_size=16, acc_policy=policy)
    except ValueError as error:  # torch 2.14's builtin has no "balanced" policy
        pytest.skip(f"torch {torch.__version__}'s builtin: {error}")
    ours = _run(
        linear_ce.linear_cross_entropy,
        *args,
        options=LinearCrossEntropyOptions(batch_chunk_size=16, acc_policy=policy),
    )
    theirs = _run(F.linear_cross_entropy, *args, options=builtin)
    # Both are within rounding of the exact value; their difference within twice that.
    tol = 6 * eps(dtype) if dtype in (torch.float16, torch.bfloat16) else 3 * eps(dtype)
    for name, a, c in zip(
        ["loss", "grad_input", "grad_weight", "grad_bias"], ours, theirs, strict=True
    ):
        assert a.shape == c.shape and a.dtype == c.dtype
        assert rel_err(a, c) <= tol, name


def test_fp16_large_vocabulary_is_finite():
    # Near-equal logits: Σ exp(s − max) ≈ V = 131072 > 65504, the largest float16.
    V, n, f = 2**17, 4, 8
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, f, generator=gen).half()
    W = (torch.randn(V, f, generator=gen) * 1e-3).half()
    t = torch.randint(0, V, (n,), generator=gen)
    got = _run(linear_ce.linear_cross_entropy, x, W, None, None, t, "mean", None, None)
    ref = _run(_plain, x.double(), W.double(), None, None, t, "mean", None, None)
    assert torch.isfinite(got[0]) and abs(got[0].item() - np.log(V)) < 0.01
    for g, r in zip(got, ref, strict=True):
        assert torch.isfinite(g).all()
        assert rel_err(g, r) <= 3 * eps(torch.float16)


@pytest.mark.slow
def test_fp16_mean_over_many_rows():
    # 1/N < 2**-14: the mean's normaliser is subnormal in float16.
    n, f, c = 65536 + 37, 4, 8
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(n, f, generator=gen).half()
    W = torch.randn(c, f, generator=gen).half()
    t = torch.randint(0, c, (n,), generator=gen)
    got = _run(linear_ce.linear_cross_entropy, x, W, None, None, t, "mean", None, None)
    ref = _run(_plain, x.double(), W.double(), None, None, t, "mean", None, None)
    # The plain fp16 mean cannot run here (N overflows fp16: its gradients are all zero), so
    # the plain same-dtype expression is the per-row losses backpropagated with the mean's
    # weight 1/N. Its gradient tile (p − y)/N ~ 1e-5 lies in fp16's subnormal range, where
    # a rounding costs up to 2^-25 absolute (~3× the result's own rounding): a CPU with
    # native fp16 GEMMs rounds the same tile to fp16 (measured on a Sapphire Rapids:
    # grad_input 3.09e-3, the plain expression 3.15e-3, 3·eps 2.93e-3).
    weight = torch.full((n,), 1 / n, dtype=torch.float16)
    plain = _run(_plain, x, W, None, None, t, "none", None, weight)[1:]
    names = ["loss", "grad_input", "grad_weight"]
    for name, g, r, p in zip(names, got, ref, [None, *plain], strict=True):
        own = 0.0 if p is None else rel_err(p, r)
        bound = max(3 * eps(torch.float16), 2 * own)
        assert bound < 0.01, f"{name}: the plain fp16 expression failed ({own:.3g})"
        assert rel_err(g, r) <= bound, name
    assert (got[1] != 0).float().mean() > 0.99  # per-row gradients ~1e-5 did not flush to zero


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, torch, linear_ce

    def rss(field):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024

    torch.manual_seed(0)
    N, F, V = 4096, 256, 50000
    x = torch.randn(N, F, requires_grad=True)
    W = (torch.randn(V, F) * 0.05).requires_grad_()
    t = torch.randint(0, V, (N,))
    small = torch.randn(8, F, requires_grad=True)
    linear_ce.linear_cross_entropy(small, torch.randn(16, F), t[:8] % 16).backward()  # lazy set-up
    before = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    loss = linear_ce.linear_cross_entropy(x, W, t)
    loss.backward()
    peak = rss("VmHWM")
    print(json.dumps({"growth": peak - before, "loss": loss.item(), "finite": bool(W.grad.isfinite().all())}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_memory_without_logits():
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    logits_bytes = 4096 * 50000 * 4
    assert result["finite"] and np.isfinite(result["loss"])
    assert result["growth"] < 0.25 * logits_bytes, (
        f"peak grew by {result['growth'] / 2**20:.0f} MiB"
    )


def _small_problem(seed=9, **options):
    x, W, b, w, t, _ = _inputs(13, 5, 7, torch.float64, True, None, True, seed)
    leaves = [a.clone().requires_grad_() for a in (x, W, b)]
    loss = linear_ce.linear_cross_entropy(
        leaves[0],
        leaves[1],
        t,
        linear_bias=leaves[2],
        weight=w,
        options=LinearCrossEntropyOptions(**options),
    )
    ref_leaves = [a.clone().requires_grad_() for a in (x, W, b)]
    ref = _plain(ref_leaves[0], ref_leaves[1], t, linear_bias=ref_leaves[2], weight=w)
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    return loss, leaves, ref_grads


def test_second_backward_raises_by_default():
    loss, leaves, ref_grads = _small_problem()
    loss.backward(retain_graph=True)
    for leaf, r in zip(leaves, ref_grads, strict=True):
        assert rel_err(leaf.grad, r) <= 3 * eps(torch.float64)
    with pytest.raises(RuntimeError, match=r"backward ran twice.*allow_retain_graph=True"):
        loss.backward()


def test_allow_retain_graph_makes_second_backward_correct():
    loss, leaves, ref_grads = _small_problem(allow_retain_graph=True)
    loss.backward(retain_graph=True)
    loss.backward()
    for leaf, r in zip(leaves, ref_grads, strict=True):
        assert rel_err(leaf.grad, 2 * r) <= 3 * eps(torch.float64)


def test_reduction_none_supports_retain_graph():
    x, W, _, _, t, up = _inputs(13, 5, 7, torch.float64, False, None, False, seed=10)
    Ws = W.clone().requires_grad_()
    loss = linear_ce.linear_cross_entropy(x, Ws, t, reduction="none")
    loss.backward(up, retain_graph=True)
    loss.backward(up)
    Wr = W.clone().requires_grad_()
    (ref,) = torch.autograd.grad(_plain(x, Wr, t, reduction="none"), [Wr], up)
    assert rel_err(Ws.grad, 2 * ref) <= 3 * eps(torch.float64)


def _training_step(x, A, W, b, t, reduction, options):
    hidden = torch.tanh(x @ A)
    loss = linear_ce.linear_cross_entropy(
        hidden, W, t, linear_bias=b, reduction=reduction, ignore_index=3, options=options
    )
    return loss if reduction != "none" else loss.sum()


def _plain_training_step(x, A, W, b, t, reduction):
    hidden = torch.tanh(x @ A)
    loss = _plain(hidden, W, t, linear_bias=b, reduction=reduction, ignore_index=3)
    return loss if reduction != "none" else loss.sum()


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph_training_step(reduction):
    """A compiled training step is as exact as the plain step compiled the same way.

    The bound is relative to the compiled plain step, not 3 eps alone: the compiler's
    own kernels around the loss (here tanh's backward) may round differently from
    eager (torch 2.5's Inductor costs A's gradient about 2x eager's error)."""
    gen = torch.Generator().manual_seed(11)
    A = torch.randn(6, 5, generator=gen, requires_grad=True)
    W = torch.randn(9, 5, generator=gen, requires_grad=True)
    b = torch.randn(9, generator=gen, requires_grad=True)
    options = LinearCrossEntropyOptions(batch_chunk_size=4)
    compiled = torch.compile(_training_step, fullgraph=True)
    compiled_plain = torch.compile(_plain_training_step, fullgraph=True)
    for n in (13, 21):  # a second N must not fail (recompiles with a dynamic N)
        x = torch.randn(n, 6, generator=gen)
        t = torch.randint(0, 9, (n,), generator=gen)
        leaves64 = [p.detach().double().requires_grad_() for p in (A, W, b)]
        ref = _plain_training_step(x.double(), *leaves64, t, reduction)
        ref_grads = torch.autograd.grad(ref, leaves64)
        plain = compiled_plain(x, A, W, b, t, reduction)
        plain_grads = torch.autograd.grad(plain, [A, W, b])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = compiled(x, A, W, b, t, reduction, options)
        promoted = [w for w in caught if "allow_retain_graph is set to True" in str(w.message)]
        if reduction == "mean" and n == 13:
            assert promoted, "compile must promote allow_retain_graph with a warning"
        got_grads = torch.autograd.grad(loss, [A, W, b])
        for got, p, r in zip(
            (loss, *got_grads), (plain, *plain_grads), (ref, *ref_grads), strict=True
        ):
            assert rel_err(got, r) <= max(3 * eps(torch.float32), 2 * rel_err(p, r))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_vmap_over_leading_dimension(reduction):
    gen = torch.Generator().manual_seed(12)
    X = torch.randn(3, 13, 5, generator=gen, dtype=torch.float64)
    T = torch.randint(0, 7, (3, 13), generator=gen)
    T[:, ::5] = -100
    W = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=gen, dtype=torch.float64)
    options = LinearCrossEntropyOptions(batch_chunk_size=4)

    def per_sample(x, t):
        return linear_ce.linear_cross_entropy(
            x, W, t, linear_bias=b, reduction=reduction, options=options
        )

    got = torch.func.vmap(per_sample)(X, T)
    (got_grad,) = torch.autograd.grad(got.sum(), [W])
    loop = torch.stack(
        [F.cross_entropy(F.linear(X[i], W, b), T[i], reduction=reduction) for i in range(3)]
    )
    (ref_grad,) = torch.autograd.grad(loop.sum(), [W])
    assert got.shape == loop.shape
    assert rel_err(got, loop) <= 3 * eps(torch.float64)
    assert rel_err(got_grad, ref_grad) <= 3 * eps(torch.float64)


@pytest.fixture
def chunk_calls(monkeypatch):
    """The gradient flags of every ``run_chunks`` call the ops make."""
    calls = []
    original = linear_ce.engine.chunk_loop.run_chunks

    def recording(*args, **kwargs):
        calls.append((kwargs["grad_input"], kwargs["grad_weight"], kwargs["grad_bias"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(linear_ce.engine.chunk_loop, "run_chunks", recording)
    return calls


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_loss_only_without_grad(chunk_calls, context, reduction):
    x, W, b, w, t, _ = _inputs(13, 5, 7, torch.float64, True, None, True, seed=13)
    leaves = [a.clone().requires_grad_() for a in (x, W, b)]
    with context():
        loss = linear_ce.linear_cross_entropy(
            *leaves[:2], t, linear_bias=leaves[2], weight=w, reduction=reduction
        )
    assert not loss.requires_grad
    assert chunk_calls == [(False, False, False)]
    assert rel_err(loss, _plain(x, W, t, linear_bias=b, weight=w, reduction=reduction)) <= 3 * eps(
        torch.float64
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    ("needs", "flags"),
    [
        ("x", (True, False, False)),
        ("W", (False, True, False)),
        ("b", (False, False, True)),
        ("xWb", (True, True, True)),
    ],
)
def test_only_needed_gradients_are_computed(chunk_calls, reduction, needs, flags):
    x, W, b, _, t, up = _inputs(13, 5, 7, torch.float64, False, None, True, seed=14)
    leaves = {
        k: v.clone().requires_grad_(k in needs) for k, v in zip("xWb", (x, W, b), strict=True)
    }
    loss = linear_ce.linear_cross_entropy(
        leaves["x"], leaves["W"], t, linear_bias=leaves["b"], reduction=reduction
    )
    loss.backward(up if reduction == "none" else None)
    # "none" runs a loss-only forward and the gradients in backward; mean/sum all in forward.
    assert chunk_calls == ([(False, False, False), flags] if reduction == "none" else [flags])
    refs = {k: v.clone().requires_grad_(k in needs) for k, v in zip("xWb", (x, W, b), strict=True)}
    ref = _plain(refs["x"], refs["W"], t, linear_bias=refs["b"], reduction=reduction)
    ref.backward(up if reduction == "none" else None)
    for k in "xWb":
        if k in needs:
            assert rel_err(leaves[k].grad, refs[k].grad) <= 3 * eps(torch.float64)
        else:
            assert leaves[k].grad is None


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("rows", [0, 13])
def test_all_ignored_and_empty_batch_like_torch(reduction, rows):
    # torch: mean over no (unignored) rows is NaN, sum is 0, gradients are zero.
    x, W, b, w, _, _ = _inputs(max(rows, 1), 5, 7, torch.float64, True, None, True, seed=15)
    x = x[:rows]
    t = torch.full((rows,), -100)
    results = []
    for fn in (linear_ce.linear_cross_entropy, _plain):
        leaves = [a.clone().requires_grad_() for a in (x, W, b)]
        loss = fn(leaves[0], leaves[1], t, linear_bias=leaves[2], weight=w, reduction=reduction)
        loss.sum().backward()
        results.append([loss.detach()] + [leaf.grad for leaf in leaves])
    for g, r in zip(*results, strict=True):
        assert g.shape == r.shape
        assert torch.equal(g.isnan(), r.isnan())
        assert torch.equal(g.nan_to_num(), r.nan_to_num())


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.uint8])
def test_narrow_integer_targets(target_dtype):
    x, W, b, w, t, _ = _inputs(13, 5, 7, torch.float64, True, 3, True, seed=16)
    got = _run(linear_ce.linear_cross_entropy, x, W, b, w, t.to(target_dtype), "mean", 3, None)
    ref = _run(_plain, x, W, b, w, t, "mean", 3, None)
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) <= 3 * eps(torch.float64)


def test_inputs_not_mutated_and_strided_layouts():
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(5, 13, generator=gen, dtype=torch.float64).T  # (13, 5), not contiguous
    head = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    W = head.T  # (7, 5) view of an (F, V) parameter, as with tied embeddings stored transposed
    b = torch.randn(7, generator=gen, dtype=torch.float64)
    w = torch.rand(7, generator=gen, dtype=torch.float64) + 0.2
    t = torch.randint(0, 7, (13,), generator=gen)
    before = [a.clone() for a in (x, W, b, w, t)]
    for reduction in REDUCTIONS:
        up = torch.rand(13, generator=gen, dtype=torch.float64)
        got = _run(linear_ce.linear_cross_entropy, x, W, b, w, t, reduction, None, up)
        ref = _run(_plain, x, W, b, w, t, reduction, None, up)
        for g, r in zip(got, ref, strict=True):
            assert rel_err(g, r) <= 3 * eps(torch.float64)
    for a, a0 in zip((x, W, b, w, t), before, strict=True):
        assert torch.equal(a, a0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    ("dtype", "bias", "options"),
    [
        (torch.float64, True, LinearCrossEntropyOptions(batch_chunk_size=4)),
        (torch.float32, False, LinearCrossEntropyOptions(chunking_method="aspect_ratio:2")),
        (torch.bfloat16, True, LinearCrossEntropyOptions(acc_policy="compact")),
        (torch.float16, False, LinearCrossEntropyOptions(acc_dtype=torch.float64)),
    ],
    ids=["f64", "f32", "bf16", "f16"],
)
def test_custom_op_registration(monkeypatch, reduction, dtype, bias, options):
    """torch.library.opcheck: schema, fake (meta) impl, autograd registration and AOT
    dispatch with dynamic shapes, on the exact arguments the public function passes
    (with the default ``allow_retain_graph=False`` too: a traced backward scales copies)."""
    import linear_ce.functional

    op_name = "chunked_rows" if reduction == "none" else "chunked_scalar"
    op = getattr(linear_ce.functional, op_name)
    recorded = []

    def recording(*args):
        recorded.append(args)
        return op(*args)

    monkeypatch.setattr(linear_ce.functional, op_name, recording)
    x, W, b, w, t, _ = _inputs(13, 5, 7, dtype, True, 1000, bias, seed=18)
    leaves = [a.clone().requires_grad_() if a is not None else None for a in (x, W, b)]
    linear_ce.linear_cross_entropy(
        leaves[0],
        leaves[1],
        t,
        linear_bias=leaves[2],
        weight=w,
        reduction=reduction,
        ignore_index=1000,
        label_smoothing=0.1,
        options=options,
    )
    (args,) = recorded
    result = torch.library.opcheck(getattr(torch.ops.linear_ce, op_name).default, args)
    assert set(result.values()) == {"SUCCESS"}, result
