"""torch.compile(fullgraph=True) with a dynamic row count: one compiled frame for every N,
and the same loss and gradients as eager, with ignored targets present; for the loss and
the post-training heads, which also run under ``torch.func.vmap``."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions

OPTIONS = LinearCrossEntropyOptions(allow_retain_graph=True, batch_chunk_size=4)


def _loss(x, W, t, reduction):
    loss = linear_ce.linear_cross_entropy(
        x, W, t, reduction=reduction, label_smoothing=0.1, options=OPTIONS
    )
    return loss if reduction != "none" else loss.sum()


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_dynamic_rows_compile_once_and_match_eager(reduction):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss, backend=counter, fullgraph=True)
    W = torch.randn(19, 8, dtype=torch.float64, requires_grad=True)
    for rows in (7, 13, 30):
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, 8, dtype=torch.float64, generator=g, requires_grad=True)
        t = torch.randint(0, 19, (rows,), generator=g)
        t[::3] = -100
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(t, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = compiled(x, W, t, reduction)
        got_grads = torch.autograd.grad(got, [x, W])
        ref = _loss(x, W, t, reduction)
        ref_grads = torch.autograd.grad(ref, [x, W])
        # eager is itself tested against the plain expression; compiled must be the same op
        assert rel_err(got, ref) <= 3 * eps(torch.float64)
        for a, r in zip(got_grads, ref_grads, strict=True):
            assert rel_err(a, r) <= 3 * eps(torch.float64)
        plain = torch.nn.functional.cross_entropy(
            x @ W.T, t, label_smoothing=0.1, reduction=reduction
        ).sum()
        assert rel_err(got, plain) <= 3 * eps(torch.float64)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for 3 row counts"


def _head_loss(head, x, W, t, teacher_x, teacher_W, advantage=None):
    """A training-step scalar of each head, with a temperature so the transform is traced."""
    if head == "token_logprobs":
        out = linear_ce.token_logprobs(x, W, t, entropy=True, temperature=0.8, options=OPTIONS)
        return (out.logprob + 0.1 * out.entropy).sum()
    if head == "token_objective":
        return linear_ce.token_objective(
            x,
            W,
            t,
            lambda lp, ent, advantage: -advantage * lp - 0.1 * ent,
            entropy=True,
            temperature=0.8,
            options=OPTIONS,
            advantage=advantage,
        )
    return linear_ce.linear_divergence(
        x, W, teacher_x, teacher_W, t, beta=0.5, temperature=0.8, options=OPTIONS
    )


def _plain_head_loss(head, x, W, t, teacher_x, teacher_W, advantage):
    valid = t != -100
    logp = torch.log_softmax(x @ W.T / 0.8, -1)
    if head == "linear_divergence":
        lt = torch.log_softmax(teacher_x @ teacher_W.T / 0.8, -1)
        mix = torch.logsumexp(torch.stack([lt, logp]), 0) - math.log(2)
        rows = 0.5 * ((lt.exp() * (lt - mix)).sum(-1) + (logp.exp() * (logp - mix)).sum(-1))
        return rows[valid].sum() / valid.sum()
    lp = logp.gather(-1, torch.where(valid, t, 0)[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    if head == "token_logprobs":
        return (lp + 0.1 * ent)[valid].sum()
    return (-advantage * lp - 0.1 * ent)[valid].sum()


@pytest.mark.slow
@pytest.mark.parametrize("head", ["token_logprobs", "token_objective", "linear_divergence"])
def test_heads_compile_once_for_dynamic_rows_and_match_eager(head):
    """The heads under ``torch.compile`` with ``mark_dynamic`` rows: no recompile for a
    new N, the same loss and gradients as eager and as the plain expression (float64: 3
    eps against eager, whose own accuracy is tested elsewhere; the plain expression to
    16 eps, its own rounding over the vocabulary sums included). ``token_logprobs`` and
    ``linear_divergence`` in one graph (``fullgraph=True``), one frame for the three N;
    ``token_objective`` at its documented graph break (its objective is a Python callable;
    tests/test_token_objective.py compiles a step around it)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fullgraph = head != "token_objective"
    compiled = torch.compile(_head_loss, backend=counter, fullgraph=fullgraph, dynamic=None)
    W = torch.randn(19, 8, dtype=torch.float64, requires_grad=True)
    teacher_W = torch.randn(19, 6, dtype=torch.float64)
    frames = []
    for rows in (7, 13, 30):
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, 8, dtype=torch.float64, generator=g, requires_grad=True)
        teacher_x = torch.randn(rows, 6, dtype=torch.float64, generator=g)
        advantage = torch.randn(rows, dtype=torch.float64, generator=g)
        t = torch.randint(0, 19, (rows,), generator=g)
        t[::3] = -100
        call = (head, x, W, t, teacher_x, teacher_W, advantage)
        for a in (x, teacher_x, advantage, t):
            torch._dynamo.mark_dynamic(a, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = compiled(*call)
        got_grads = torch.autograd.grad(got, [x, W])
        ref = _head_loss(*call)
        ref_grads = torch.autograd.grad(ref, [x, W])
        plain = _plain_head_loss(*call)
        plain_grads = torch.autograd.grad(plain, [x, W])
        for a, r, p in zip(
            (got, *got_grads), (ref, *ref_grads), (plain, *plain_grads), strict=True
        ):
            assert rel_err(a, r) <= 3 * eps(torch.float64)
            assert rel_err(a, p) <= 16 * eps(torch.float64)
        frames.append(counter.frame_count)
    if fullgraph:
        assert frames == [1, 1, 1], f"compiled frames after each N: {frames}"


@pytest.mark.parametrize("head", ["token_logprobs", "linear_divergence"])
def test_heads_vmap_over_a_leading_dimension(head):
    """``torch.func.vmap`` over a batch of sequences: the loop's losses and gradients."""
    g = torch.Generator().manual_seed(12)
    X = torch.randn(3, 13, 5, generator=g, dtype=torch.float64)
    TX = torch.randn(3, 13, 4, generator=g, dtype=torch.float64)
    T = torch.randint(0, 7, (3, 13), generator=g)
    T[:, ::5] = -100
    W = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    TW = torch.randn(7, 4, generator=g, dtype=torch.float64)

    def per_sample(x, t, tx):
        return _head_loss(head, x, W, t, tx, TW)

    got = torch.func.vmap(per_sample)(X, T, TX)
    (got_grad,) = torch.autograd.grad(got.sum(), [W])
    loop = torch.stack([per_sample(X[i], T[i], TX[i]) for i in range(3)])
    (ref_grad,) = torch.autograd.grad(loop.sum(), [W])
    assert got.shape == loop.shape
    # The same op on the same rows: vmap runs it per sample (a loop inside the op).
    assert rel_err(got, loop) <= 3 * eps(torch.float64)
    assert rel_err(got_grad, ref_grad) <= 3 * eps(torch.float64)


def _vmap_inputs():
    g = torch.Generator().manual_seed(13)
    X = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    T = torch.randint(0, 7, (3, 5), generator=g)
    T[:, ::4] = -100
    A = torch.randn(3, 5, generator=g, dtype=torch.float64)
    W = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    return X, T, A, W


@pytest.mark.parametrize("batched", ["input", "target", "advantage"])
def test_token_objective_under_vmap_says_to_call_it_on_the_whole_batch(batched):
    """``token_objective`` runs a Python callable on chunks of the valid tokens, whose
    number is data: under ``vmap`` it refuses with an error naming the function and the
    batched argument, and saying what works instead (it takes any leading dimensions)."""
    X, T, A, W = _vmap_inputs()
    given = {"input": X, "target": T, "advantage": A}
    fixed = {"input": X[0], "target": T[0], "advantage": A[0]}

    def per_sample(value):
        args = {**fixed, batched: value}
        return _head_loss(
            "token_objective", args["input"], W, args["target"], None, None, args["advantage"]
        )

    with pytest.raises(
        ValueError,
        match=rf"^token_objective: {batched} is batched by torch.func.vmap, which "
        r"token_objective does not support; call token_objective on the whole batch instead",
    ):
        torch.func.vmap(per_sample)(given[batched])
    # What the error advises: the whole batch in one call, against the plain expression
    # (float64; its own rounding over the vocabulary's sums, as in the compile test above).
    whole = _head_loss("token_objective", X, W, T, None, None, A)
    rows = X.shape[0] * X.shape[1]
    plain = _plain_head_loss(
        "token_objective", X.reshape(rows, -1), W, T.reshape(rows), None, None, A.reshape(rows)
    )
    assert rel_err(whole, plain) <= 16 * eps(torch.float64)


def test_sequence_objective_under_vmap_says_to_call_it_on_the_whole_batch():
    X, T, _, W = _vmap_inputs()
    T[:, 1] = 3  # every sequence scores a token

    def per_batch(x):
        out = linear_ce.sequence_objective(
            x[None], W, T[:1], lambda batch: -batch.logprob_sum, reduction="sum"
        )
        return out.loss

    with pytest.raises(
        ValueError,
        match=r"^sequence_objective: input is batched by torch.func.vmap, which "
        r"sequence_objective does not support; call sequence_objective on the whole batch",
    ):
        torch.func.vmap(per_batch)(X)
