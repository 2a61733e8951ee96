"""``token_logprobs(..., topk=k)``: each token's ``k`` largest log-probabilities and their
ids, against ``torch.topk`` of the float64 log-softmax of the full logits written here."""

from __future__ import annotations

import math

import pytest
import torch

import linear_ce
from linear_ce import LinearCrossEntropyOptions


def _logits64(x, W, b, *, temperature=1.0, logit_scale=1.0, softcap=None):
    s = x.double() @ W.double().T
    if b is not None:
        s = s + b.double()
    s = s * logit_scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return s / temperature


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _plain_error(x, W, b, ids, valid, **transform):
    """Relative error of the plain same-dtype expression's log-probabilities at ``ids``."""
    s = x @ W.T
    if b is not None:
        s = s + b
    s = s * transform.get("logit_scale", 1.0)
    if transform.get("softcap") is not None:
        c = transform["softcap"]
        s = c * torch.tanh(s / c)
    s = s / transform.get("temperature", 1.0)
    plain = torch.log_softmax(s, -1).gather(-1, ids)[valid]
    want = torch.log_softmax(_logits64(x, W, b, **transform), -1).gather(-1, ids)[valid]
    return _rel(plain, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "transform",
    [
        {},
        {"temperature": 0.7},
        {"softcap": 3.0, "logit_scale": 1.5},
        {"temperature": 2.0, "softcap": 5.0},
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_topk_matches_float64(dtype, transform, bias):
    g = torch.Generator().manual_seed(3)
    N, D, V, k = 90, 24, 257, 9
    x = torch.randn(N, D, generator=g, dtype=dtype)
    W = torch.randn(V, D, generator=g, dtype=dtype) / 3
    b = torch.randn(V, generator=g, dtype=dtype) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = -100
    valid = t != -100
    options = LinearCrossEntropyOptions(batch_chunk_size=16)
    out = linear_ce.token_logprobs(
        x, W, t, linear_bias=b, topk=k, entropy=True, options=options, **transform
    )
    ref = torch.log_softmax(_logits64(x, W, b, **transform), -1).topk(k)
    assert out.topk_ids.dtype == torch.int64
    assert out.topk_logprobs.dtype == dtype  # the accumulation dtype of fp32 and fp64 inputs
    assert out.topk_logprobs.shape == out.topk_ids.shape == (N, k)
    # Random normal logits: the gaps between neighbouring log-probabilities (~1e-3 at the
    # k-th of 257) are far above the rounding (~1e-6), so the order is the float64 one.
    assert torch.equal(out.topk_ids[valid], ref.indices[valid])
    # House bound: 3 eps, or twice the plain same-dtype expression's own error.
    bound = max(
        3 * torch.finfo(dtype).eps, 2 * _plain_error(x, W, b, ref.indices, valid, **transform)
    )
    assert _rel(out.topk_logprobs[valid], ref.values[valid]) <= bound
    # Ignored rows: empty slots (the convention of sparse_divergence).
    assert (out.topk_ids[~valid] == -1).all()
    assert (out.topk_logprobs[~valid] == -math.inf).all()
    # The other outputs are those of a call without topk.
    plain = linear_ce.token_logprobs(
        x, W, t, linear_bias=b, entropy=True, options=options, **transform
    )
    assert torch.equal(out.logprob, plain.logprob) and torch.equal(out.entropy, plain.entropy)


def test_topk_many_chunks_and_k_equal_v():
    """Large N, small D and V: many chunks; k = V is the whole sorted row."""
    g = torch.Generator().manual_seed(8)
    N, D, V = 1500, 6, 40
    x = torch.randn(N, D, generator=g)
    W = torch.randn(V, D, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[100:300] = -100
    valid = t != -100
    options = LinearCrossEntropyOptions(batch_chunk_size=32)
    ref64 = torch.log_softmax(_logits64(x, W, None), -1)
    for k in (1, 5, V):
        out = linear_ce.token_logprobs(x, W, t, topk=k, options=options)
        ref = ref64.topk(k)
        got_ids, want_ids = out.topk_ids[valid], ref.indices[valid]
        # Neighbouring values closer than the rounding may swap: compare ids only where
        # the float64 gaps around each slot exceed 1e-4 (they are ~1e-2 here).
        sorted_all = ref64[valid].sort(-1, descending=True).values
        gaps = (sorted_all[:, :-1] - sorted_all[:, 1:]).abs()
        clear = (gaps[:, : min(k, V - 1)] > 1e-4).all(-1)
        assert clear.float().mean() > 0.9
        assert torch.equal(got_ids[clear], want_ids[clear])
        bound = max(
            3 * torch.finfo(torch.float32).eps, 2 * _plain_error(x, W, None, ref.indices, valid)
        )
        assert _rel(out.topk_logprobs[valid], ref.values[valid]) <= bound
        assert (out.topk_ids[~valid] == -1).all()


def test_topk_ties_match_torch_topk():
    """Integer inputs make every logit exact, so the tie pattern is the float64 one: the
    ids are torch.topk's on the full log-softmax row, ties included (duplicated head rows
    at the top and at the k-th place)."""
    g = torch.Generator().manual_seed(2)
    N, D, V, k = 64, 8, 300, 6
    x = torch.randint(-2, 3, (N, D), generator=g).float()
    W = torch.randint(-3, 4, (V, D), generator=g).float()
    W[10] = W[200] = W[250]  # three classes with the same logits everywhere
    t = torch.randint(0, V, (N,), generator=g)
    out = linear_ce.token_logprobs(
        x, W, t, topk=k, options=LinearCrossEntropyOptions(batch_chunk_size=8)
    )
    ref = torch.log_softmax(_logits64(x, W, None), -1).topk(k)
    top = ref.values
    ties_at_boundary = (top[:, -1:] == torch.log_softmax(_logits64(x, W, None), -1)).sum(-1) > 1
    assert ties_at_boundary.any()  # the test sees ties at the k-th place
    assert torch.equal(out.topk_ids, ref.indices)
    assert _rel(out.topk_logprobs, ref.values) <= 3 * torch.finfo(torch.float32).eps * 4


def test_topk_shift_and_batch_shape():
    g = torch.Generator().manual_seed(4)
    B, T, D, V, k = 3, 11, 8, 50, 4
    x = torch.randn(B, T, D, generator=g)
    W = torch.randn(V, D, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, 5] = -100
    out = linear_ce.token_logprobs(x, W, ids, shift=True, topk=k)
    assert out.topk_logprobs.shape == out.topk_ids.shape == (B, T, k)
    ref = torch.log_softmax(_logits64(x, W, None), -1).topk(k)
    shifted = torch.full_like(ids, -100)
    shifted[:, :-1] = ids[:, 1:]
    valid = shifted != -100
    assert not valid[:, -1].any() and not valid[1, 4]
    assert torch.equal(out.topk_ids[valid], ref.indices[valid])
    assert (out.topk_ids[~valid] == -1).all() and (out.topk_logprobs[~valid] == -math.inf).all()


def test_topk_half_inputs_are_a_top_k():
    """bf16 inputs: fp32 values within the plain bf16 expression's error of float64 at the
    ids returned, and those ids a top-k of the float64 row up to that rounding."""
    g = torch.Generator().manual_seed(6)
    N, D, V, k = 40, 32, 300, 8
    x = torch.randn(N, D, generator=g).bfloat16()
    W = (torch.randn(V, D, generator=g) / 4).bfloat16()
    t = torch.randint(0, V, (N,), generator=g)
    out = linear_ce.token_logprobs(x, W, t, topk=k)
    assert out.topk_logprobs.dtype == torch.float32
    ref64 = torch.log_softmax(_logits64(x, W, None), -1)
    at = ref64.gather(-1, out.topk_ids)
    plain = torch.log_softmax((x @ W.T).float(), -1)
    plain_err = (plain.double() - ref64).abs().max().item()
    # Each returned value within twice the plain bf16 expression's worst error of its
    # float64 value, and no class left out above the k-th by more than that.
    assert (out.topk_logprobs.double() - at).abs().max().item() <= 2 * plain_err
    assert (ref64.topk(k).values[:, -1] <= at[:, -1] + 4 * plain_err).all()
    assert (out.topk_ids.sort(-1).values.diff(dim=-1) > 0).all()  # distinct ids


def test_topk_has_no_gradient_and_leaves_others():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 30, (20,), generator=g)
    out = linear_ce.token_logprobs(x, W, t, topk=3)
    with pytest.raises(RuntimeError, match="topk_logprobs is a statistic without a gradient"):
        out.topk_logprobs.sum().backward(retain_graph=True)
    out = linear_ce.token_logprobs(x, W, t, topk=3)
    out.logprob.sum().backward()
    gx, gW = x.grad.clone(), W.grad.clone()
    x.grad = W.grad = None
    linear_ce.token_logprobs(x, W, t).logprob.sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gW, W.grad)
    with torch.no_grad():
        assert linear_ce.token_logprobs(x, W, t, topk=3).topk_ids.shape == (20, 3)


@pytest.mark.parametrize("bad", [0, -1, 31, 2.0, True, "3"])
def test_topk_bad_k(bad):
    x, W, t = torch.randn(4, 8), torch.randn(30, 8), torch.randint(0, 30, (4,))
    with pytest.raises(
        ValueError, match=r"token_logprobs: topk must be None or an int in \[1, 30\]"
    ):
        linear_ce.token_logprobs(x, W, t, topk=bad)


def test_topk_masked_classes_fill_before_nothing():
    """A ``-inf`` bias leaves fewer finite classes than k: the rest of the slots are real
    classes with ``-inf`` log-probabilities, as torch.topk gives."""
    g = torch.Generator().manual_seed(9)
    V, k = 20, 8
    x = torch.randn(6, 4, generator=g)
    W = torch.randn(V, 4, generator=g)
    b = torch.zeros(V)
    b[5:] = -math.inf
    t = torch.zeros(6, dtype=torch.long)
    with torch.no_grad():
        out = linear_ce.token_logprobs(x, W, t, linear_bias=b, topk=k)
    ref = torch.log_softmax(_logits64(x, W, b), -1).topk(k)
    assert torch.equal(out.topk_ids[:, :5], ref.indices[:, :5])
    assert (out.topk_logprobs[:, 5:] == -math.inf).all()
    assert (out.topk_ids[:, 5:] >= 5).all()
