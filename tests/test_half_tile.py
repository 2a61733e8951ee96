"""The native bf16 path's half tile with a mean's scale in the tile.

With native half GEMMs and at most a few chunks, the weight gradient is summed in the
bf16 result itself (``DirectSum``), so a mean's ``1/count`` belongs in the gradient tile
(the unscaled sum could overflow bf16). Under a half tile each step takes it through
the factor its head multiplies the tile by, not as a pass of its own. These tests force
that path (``LINEAR_CE_STEP_ROWS``) and check it against float64: a scale dropped or
applied twice is off by the count of rows (hundreds), far outside the bound.
The half tile exists only where the CPU has native bf16 GEMMs; elsewhere they skip.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine.capability import native_half_gemm
from linear_ce.engine.machine import STEP_ROWS_ENV
from linear_ce.engine.plan import make_plan

CPU = torch.device("cpu")
DTYPE = torch.bfloat16


def _inputs(rows: int, features: int, classes: int, seed: int, ignored: float):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=gen, dtype=torch.float64).to(DTYPE)
    W = (torch.randn(classes, features, generator=gen, dtype=torch.float64) / 3).to(DTYPE)
    b = torch.randn(classes, generator=gen, dtype=torch.float64).to(DTYPE)
    t = torch.randint(0, classes, (rows,), generator=gen)
    t[torch.rand(rows, generator=gen) < ignored] = -100
    return x, W, b, t


@pytest.mark.parametrize(
    "softcap, smoothing, z_loss",
    [(None, 0.0, 0.0), (20.0, 0.1, 1e-3)],
    ids=["plain", "softcap-smoothing-zloss"],
)
def test_mean_scale_in_half_tile(softcap, smoothing, z_loss, monkeypatch):
    """``reduction="mean"`` under the half tile with the weight gradient summed in bf16
    (3 chunks of 160 rows, each in steps of 48, 48, 48 and 16 rows), a bias and 30% of
    the rows ignored: loss and every gradient within 3 eps or twice the plain bf16
    expression's own error against float64 (the rounding of its logits and of its
    gradients, which the half tile shares)."""
    if not native_half_gemm(DTYPE, CPU):
        pytest.skip("this CPU has no native bf16 GEMMs (no half tile)")
    monkeypatch.setenv(STEP_ROWS_ENV, "48")
    rows, features, classes = 600, 32, 300
    x, W, b, t = _inputs(rows, features, classes, seed=91, ignored=0.3)
    options = LinearCrossEntropyOptions(batch_chunk_size=160)
    plan = make_plan(rows, features, classes, DTYPE, CPU, options)
    # The path under test: a half tile, and the weight gradient's sum in bf16 itself.
    assert (plan.rows_per_chunk, plan.rows_per_step, plan.weight_grad) == (160, 48, "direct")

    def run(fn, dt):
        leaves = [v.detach().to(dt).requires_grad_() for v in (x, W, b)]
        loss = fn(*leaves)
        loss.backward()
        return [loss.detach(), *(v.grad for v in leaves)]

    def plain(x_, W_, b_):
        z = F.linear(x_, W_, b_)
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        valid = t != -100
        z, target = z[valid], t[valid]
        loss = F.cross_entropy(z, target, label_smoothing=smoothing, reduction="sum")
        loss = loss + z_loss * torch.logsumexp(z, -1).square().sum()
        return loss / valid.sum()

    def ours(x_, W_, b_):
        return linear_ce.linear_cross_entropy(
            x_,
            W_,
            t,
            linear_bias=b_,
            softcap=softcap,
            label_smoothing=smoothing,
            z_loss=z_loss,
            reduction="mean",
            options=options,
        )

    exact, same, got = run(plain, torch.float64), run(plain, DTYPE), run(ours, DTYPE)
    for name, g, s, e in zip(("loss", "input", "weight", "bias"), got, same, exact, strict=True):
        bound = max(3 * eps(DTYPE), 2 * rel_err(s, e))
        assert rel_err(g, e) <= bound, f"{name}: {rel_err(g, e):.3g} > {bound:.3g}"
