"""The statistics pass (:mod:`linear_ce.engine.stats_pass`): a call without gradients whose
row math is the compiled loops' forms its statistics a block of classes at a time and
combines them.

Each test forces the block (``LINEAR_CE_STATS_BLOCK``) so that rows span several blocks,
the last one partial, and checks the outputs against float64: within 3 eps of the dtype
or twice the plain same-dtype expression's own error, and against the same call in
chunks of whole rows (``off``). A block's max, sum, dot sum or target dropped or
misweighted moves a row's loss by far more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce.engine import chunk_loop, stats_pass
from linear_ce.engine.capability import last_level_cache_bytes, native_half_gemm
from linear_ce.engine.gemm import NativeHalf
from linear_ce.engine.machine import STATS_BLOCK_ENV
from linear_ce.engine.native_rows import native_rows
from linear_ce.engine.plan import make_plan
from linear_ce.engine.stats_pass import combine_blocks

CPU = torch.device("cpu")
NATIVE_GEMM = "LINEAR_CE_NATIVE_HALF_GEMM"
#: The pass runs the compiled row loops; where they do not build, calls keep the chunk loop.
LOOPS_OFF = "the compiled row loops are off here (LINEAR_CE_NATIVE_ROWS=0) or do not build"
needs_loops = pytest.mark.skipif(native_rows(torch.float32) is None, reason=LOOPS_OFF)


def _inputs(dtype, rows=203, features=48, classes=700, seed=3, ignored=0.2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=gen, dtype=torch.float64)
    w = torch.randn(classes, features, generator=gen, dtype=torch.float64) / 2
    t = torch.randint(0, classes, (rows,), generator=gen)
    t[torch.rand(rows, generator=gen) < ignored] = -100
    return x.to(dtype).double(), w.to(dtype).double(), t


@pytest.fixture
def spy(monkeypatch):
    """The plans of the calls that reached the statistics pass (the test skips where the
    compiled row loops do not build)."""
    if native_rows(torch.float32) is None:
        pytest.skip(LOOPS_OFF)
    calls = []
    original = stats_pass.run_stats_pass

    def run(*args, **kwargs):
        calls.append(args[4])
        return original(*args, **kwargs)

    monkeypatch.setattr(chunk_loop, "run_stats_pass", run)
    return calls


def _bound(dtype, own_error):
    # The plain same-dtype expression's own error (its logits rounded to the dtype) or 3 eps.
    return max(3 * eps(dtype), 2 * own_error)


@pytest.mark.parametrize("native_gemm", ["1", "0"], ids=["native-half", "fp32-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", ["128", "1", "4096"])
def test_cross_entropy_forward_by_blocks(dtype, block, native_gemm, monkeypatch, spy):
    """Per-row loss, its lse and z-loss under a logit scale, 20% of rows ignored, 700
    classes in blocks of 128 (six, the last of 60), of 1 and of all of them."""
    monkeypatch.setenv(STATS_BLOCK_ENV, block)
    monkeypatch.setenv(NATIVE_GEMM, native_gemm)
    x, w, t = _inputs(dtype)
    scale = 0.7

    def plain(x_, w_):
        z = (x_ @ w_.T).to(x_.dtype if x_.dtype == torch.float64 else torch.float32) * scale
        valid = t != -100
        lse = torch.logsumexp(z, -1)
        loss = torch.where(valid, lse - z.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
        return loss, torch.where(valid, lse, 0.0)

    ref_loss, ref_lse = plain(x, w)
    own_loss, own_lse = plain(x.to(dtype), w.to(dtype))
    with torch.no_grad():
        out = linear_ce.linear_cross_entropy(
            x.to(dtype),
            w.to(dtype),
            t,
            reduction="none",
            ignore_index=-100,
            logit_scale=scale,
            return_lse=True,
            loss_dtype=torch.float32,
        )
    assert spy, "the call did not take the statistics pass"
    assert spy[-1].classes_per_block == min(int(block), 700)
    half_tile = native_gemm == "1" and dtype != torch.float32 and native_half_gemm(dtype, CPU)
    assert isinstance(spy[-1].gemm, NativeHalf) == half_tile
    valid = t != -100
    lse = torch.where(valid, out.lse.double(), 0.0)
    assert rel_err(out.loss, ref_loss) <= _bound(dtype, rel_err(own_loss, ref_loss))
    assert rel_err(lse, ref_lse) <= _bound(dtype, rel_err(own_lse, ref_lse))
    monkeypatch.setenv(STATS_BLOCK_ENV, "off")
    spy.clear()
    with torch.no_grad():
        rows = linear_ce.linear_cross_entropy(
            x.to(dtype), w.to(dtype), t, reduction="none", logit_scale=scale,
            loss_dtype=torch.float32,
        )  # fmt: skip
    assert not spy
    assert rel_err(out.loss, rows.double()) <= 3 * eps(torch.float32) + rel_err(rows, ref_loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_loss_by_blocks(dtype, reduction, monkeypatch, spy):
    """A reduced loss (and a z-loss term) by blocks of 256 equals float64's within bound."""
    monkeypatch.setenv(STATS_BLOCK_ENV, "256")
    x, w, t = _inputs(dtype, rows=150, classes=1000, seed=5)

    def plain(x_, w_):
        z = (x_ @ w_.T).float() if x_.dtype != torch.float64 else x_ @ w_.T
        ce = F.cross_entropy(z, t, reduction=reduction, ignore_index=-100)
        lse = torch.logsumexp(z[t != -100], -1)
        z_term = lse.square().sum() * 1e-3
        return ce + (z_term / (t != -100).sum() if reduction == "mean" else z_term)

    ref = plain(x, w)
    own = plain(x.to(dtype), w.to(dtype))
    with torch.no_grad():
        got = linear_ce.linear_cross_entropy(
            x.to(dtype), w.to(dtype), t, reduction=reduction, z_loss=1e-3,
            loss_dtype=torch.float32,
        )  # fmt: skip
    assert spy
    assert rel_err(got, ref) <= _bound(dtype, rel_err(own, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_entropy_by_blocks(dtype, monkeypatch, spy):
    """``token_logprobs`` with entropy (the blocks' dot sums, each relative to its own max)
    under a temperature, by blocks of 128: log-probs and entropy within bound. Its fp32
    tiles keep torch's operations (``native_fp32`` false), so only the half tile's loops
    take the pass; fp32 must not."""
    monkeypatch.setenv(STATS_BLOCK_ENV, "128")
    monkeypatch.setenv(NATIVE_GEMM, "1")
    x, w, t = _inputs(dtype, classes=600, ignored=0.0)
    temperature = 1.3

    def plain(x_, w_):
        z = x_ @ w_.T
        z = (z if z.dtype == torch.float64 else z.float()) / temperature
        lp = torch.log_softmax(z, -1)
        return lp.gather(1, t[:, None])[:, 0], -(lp.exp() * lp).sum(-1)

    ref_lp, ref_h = plain(x, w)
    own_lp, own_h = plain(x.to(dtype), w.to(dtype))
    with torch.no_grad():
        out = linear_ce.token_logprobs(
            x.to(dtype), w.to(dtype), t, entropy=True, temperature=temperature
        )
    assert bool(spy) == (dtype != torch.float32 and native_half_gemm(dtype, CPU))
    assert rel_err(out.logprob, ref_lp) <= _bound(dtype, rel_err(own_lp, ref_lp))
    assert rel_err(out.entropy, ref_h) <= _bound(dtype, rel_err(own_h, ref_h))


def test_gradients_never_take_the_pass(monkeypatch, spy):
    """A call that wants a gradient runs the chunk loop (the pass forms no gradient)."""
    monkeypatch.setenv(STATS_BLOCK_ENV, "128")
    x, w, t = _inputs(torch.float32)
    x = x.float().requires_grad_()
    linear_ce.linear_cross_entropy(x, w.float(), t).backward()
    assert not spy
    assert x.grad is not None


@needs_loops
def test_non_finite_rows_as_whole_rows(monkeypatch):
    """A NaN logit row stays NaN and an inf one gives the plain expression's values, as the
    chunks of whole rows give them."""
    x, w, t = _inputs(torch.float32, rows=8, classes=300, ignored=0.0)
    x, w = x.float(), w.float()
    x[2, 0] = torch.nan
    x[5] = 0.0  # every logit 0: lse = log V
    results = []
    for block in ("128", "off"):
        monkeypatch.setenv(STATS_BLOCK_ENV, block)
        with torch.no_grad():
            results.append(linear_ce.linear_cross_entropy(x, w, t, reduction="none"))
    blocked, rows = results
    assert torch.isnan(blocked[2]) and torch.isnan(rows[2])
    torch.testing.assert_close(blocked[5], torch.tensor(300.0).log())
    keep = torch.arange(8) != 2
    torch.testing.assert_close(blocked[keep], rows[keep])


def test_combine_blocks_edges():
    """A row whose blocks are all -inf keeps max -inf and the loops' NaN sum, as one whole
    row gives them (its lse is then -inf, :meth:`RowStats.of`); a -inf block next to finite
    ones adds nothing (not 0 · NaN); a NaN block makes the row NaN."""
    inf, nan = torch.inf, torch.nan
    # blocks × (max, Z, D, u_t) × rows; the loops give NaN sums for an all -inf block.
    # Row 0: both blocks -inf; row 1: block 1 -inf; row 2: block 0 NaN.
    sums = torch.tensor(
        [
            [[-inf, 1.0, nan], [nan, 2.0, nan], [nan, -0.5, nan], [0.0, -0.25, 0.0]],
            [[-inf, -inf, 0.5], [nan, nan, 1.0], [nan, nan, 0.0], [0.0, 0.0, 0.0]],
        ]
    )
    owned = torch.tensor([[False, True, False], [False, False, False]])
    row_max, sum_exp, dot, target_u = combine_blocks(sums, owned)
    assert row_max[0] == -inf and torch.isnan(sum_exp[0])
    torch.testing.assert_close(sum_exp[1], torch.tensor(2.0))
    torch.testing.assert_close(dot[1], torch.tensor(-0.5))
    torch.testing.assert_close(target_u[1], torch.tensor(-0.25))
    assert torch.isnan(row_max[2]) and torch.isnan(sum_exp[2])


def test_combine_blocks_shifts_to_the_row_max():
    """Two blocks of one row against float64 whole-row sums, the target in the lower one."""
    v = torch.tensor([[0.25, -3.0, 1.5, 4.0, 2.0]], dtype=torch.float64)
    parts = []
    for cols in (slice(0, 3), slice(3, 5)):
        block = v[:, cols]
        u = block - block.amax(1, keepdim=True)
        parts.append(torch.stack([block.amax(1), u.exp().sum(1), (u.exp() * u).sum(1), u[:, 1]]))
    owned = torch.tensor([[True], [False]])
    row_max, sum_exp, dot, target_u = combine_blocks(torch.stack(parts), owned)
    u = v - v.amax()
    torch.testing.assert_close(row_max, v.amax(1))
    torch.testing.assert_close(sum_exp, u.exp().sum(1))
    torch.testing.assert_close(dot, (u.exp() * u).sum(1))
    torch.testing.assert_close(target_u, u[:, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tile_fits_half_the_last_level_cache(dtype, monkeypatch):
    """The pass's tile at N=2048, F=1024, V=32768 is within half the last-level cache and the
    budget's bytes (and more than half of the smaller), with every row in one group; ``STATS_TILE_FALLBACK_BYTES`` where the
    cache's size is unknown (16 MiB)."""
    options = linear_ce.LinearCrossEntropyOptions()
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    for cache in (last_level_cache_bytes(), None, 8 << 20):
        monkeypatch.setattr("linear_ce.engine.plan.last_level_cache_bytes", lambda c=cache: c)
        plan = make_plan(
            2048, 1024, 32768, dtype, CPU, options, gradients=False, stats_pass=True,
            gathered=False,
        )  # fmt: skip
        itemsize = dtype.itemsize if isinstance(plan.gemm, NativeHalf) else 4
        tile = plan.rows_per_chunk * plan.classes_per_block * itemsize
        # A quarter of the gradients' bytes, (N + V)·F·itemsize: the default budget.
        budget = (2048 + 32768) * 1024 * dtype.itemsize // 4
        room = min(16 << 20 if cache is None else cache // 2, budget)
        assert plan.rows_per_chunk == 2048
        assert room / 2 < tile <= room


def test_last_level_cache_is_read():
    """On Linux the last-level cache's size is read from sysfs (a positive number of bytes)."""
    size = last_level_cache_bytes()
    if size is None:
        pytest.skip("no sysfs cache description here")
    assert size >= 1 << 20


@needs_loops
def test_the_bench_names_the_pass(monkeypatch):
    """The bench's note on a forward without gradients names the statistics pass and its
    block (``off``: the chunk loop's layout); a training step's never does."""
    from linear_ce.bench.config import Point
    from linear_ce.bench.variants import describe_plan

    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    point = Point(256, 64, 1000, "fp32", "cpu")
    monkeypatch.setenv(STATS_BLOCK_ENV, "384")
    assert describe_plan(point, gradients=False)["layout"] == "statistics pass, 384-class blocks"
    assert "statistics" not in describe_plan(point)["layout"]
    monkeypatch.setenv(STATS_BLOCK_ENV, "off")
    assert "statistics" not in describe_plan(point, gradients=False)["layout"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_objective_entropy_by_blocks(dtype, monkeypatch, spy):
    """``token_objective`` under ``torch.no_grad()`` with an entropy term (its fp32 tiles take
    the loops, so the blocks' dot sums are combined on every CPU), by blocks of 128:
    ``Σ (logprob − 0.1·entropy)`` within bound of float64."""
    monkeypatch.setenv(STATS_BLOCK_ENV, "128")
    x, w, t = _inputs(dtype, classes=600)
    temperature = 0.8

    def plain(x_, w_):
        z = x_ @ w_.T
        z = (z if z.dtype == torch.float64 else z.float()) / temperature
        lp = torch.log_softmax(z, -1)
        valid = t != -100
        token = lp.gather(1, t.clamp(min=0)[:, None])[:, 0] + 0.1 * (lp.exp() * lp).sum(-1)
        return torch.where(valid, token, 0.0).sum()

    ref = plain(x, w)
    own = plain(x.to(dtype), w.to(dtype))
    with torch.no_grad():
        got = linear_ce.token_objective(
            x.to(dtype), w.to(dtype), t, lambda logprob, entropy: logprob - 0.1 * entropy,
            temperature=temperature, entropy=True,
        )  # fmt: skip
    assert spy
    assert rel_err(got, ref) <= _bound(dtype, rel_err(own, ref))


@pytest.mark.parametrize("native_gemm", ["1", "0"], ids=["native-half", "fp32-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_groups_and_blocks(dtype, native_gemm, monkeypatch, spy):
    """At scale: 8192 rows (a third of them ignored) in groups of 256, 300 classes in blocks
    of 32 (ten, the last of 12), D = 16: per-row loss and its sum within 3 eps or twice the
    plain same-dtype expression's own error of float64. An error that grew with the number
    of groups or blocks would show here."""
    monkeypatch.setenv(STATS_BLOCK_ENV, "32")
    monkeypatch.setenv(NATIVE_GEMM, native_gemm)
    x, w, t = _inputs(dtype, rows=8192, features=16, classes=300, seed=11, ignored=1 / 3)
    options = linear_ce.LinearCrossEntropyOptions(batch_chunk_size=256)

    def plain(x_, w_):
        z = x_ @ w_.T
        z = z if z.dtype == torch.float64 else z.float()
        loss = F.cross_entropy(z, t, reduction="none", ignore_index=-100)
        return loss, loss.sum()

    ref_rows, ref_sum = plain(x, w)
    own_rows, own_sum = plain(x.to(dtype), w.to(dtype))
    with torch.no_grad():
        rows = linear_ce.linear_cross_entropy(
            x.to(dtype), w.to(dtype), t, reduction="none", options=options,
            loss_dtype=torch.float32,
        )  # fmt: skip
    assert spy and (spy[-1].rows_per_chunk, spy[-1].classes_per_block) == (256, 32)
    assert rel_err(rows, ref_rows) <= _bound(dtype, rel_err(own_rows, ref_rows))
    assert rel_err(rows.double().sum(), ref_sum) <= _bound(dtype, rel_err(own_sum, ref_sum))
