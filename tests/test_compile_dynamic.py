"""torch.compile(fullgraph=True) with a dynamic row count: one compiled frame for every N,
and the same loss and gradients as eager, with ignored targets present."""

from __future__ import annotations

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
