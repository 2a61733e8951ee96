"""The compiled row loops (:mod:`linear_ce.engine.native_rows`) and the chunk loop's path
through them.

The loops' two functions are checked on their own against float64 written here (bf16,
fp16 and fp32 tiles, strided slices of wider tiles, targets and no targets, the entropy's
terms or not; masked, NaN and very negative logits), then their environment switch and
their build (a missing compiler, a failing one, the cached library), then every public
call whose head takes them (``linear_cross_entropy``, ``token_logprobs`` and its vjp,
``token_objective``, ``sequence_objective``) on both paths, ``LINEAR_CE_NATIVE_ROWS=0``
and ``=1``, each against float64 at the house bound and each checked to have taken the
path it was asked for. The chunk loop's half-tile tests need native half GEMMs on this
CPU (elsewhere they skip); its fp32 tests (cross-entropy's fused loops on a class-major
or row-major tile) need only a C compiler.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import linear_ce
import linear_ce.objectives as obj
import sequence_formula as seqref
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine import native_rows as nr
from linear_ce.engine.capability import NATIVE_HALF_GEMM_ENV, native_half_gemm
from linear_ce.engine.machine import STEP_ROWS_ENV, TILE_LAYOUT_ENV

CPU = torch.device("cpu")
HALF = [torch.bfloat16, torch.float16]
TILES = [torch.bfloat16, torch.float16, torch.float32]
ENV = nr.NATIVE_ROWS_ENV


def _need_compiler() -> None:
    """Skip where there is no C compiler to build the loops with (the package then takes
    the torch operations); one that is there but fails is an error, not a skip."""
    if shutil.which(nr._compiler()[0]) is None:
        pytest.skip(f"no C compiler {nr._compiler()[0]!r} to build the row loops")


def _loops(dtype: torch.dtype) -> nr.NativeRows:
    """The loops of ``dtype`` tiles from this process's library, whatever the environment
    says."""
    _need_compiler()
    return nr.NativeRows(nr._library.get(required=True), dtype)


def _fp32(scale: float) -> float:
    """``scale`` as the loops get it: a C float (ctypes), as the torch path's fp32
    multiply takes a Python float too."""
    return float(torch.tensor(scale, dtype=torch.float32))


def _tile(rows, classes, dtype, spread, seed, pad):
    """A ``(rows, classes)`` tile of ``dtype`` logits ``spread · N(0, 1)``, a slice of a
    tile ``pad`` columns wider whose extra columns hold NaN: a loop that read past a row's
    ``classes`` columns would turn its outputs into NaN."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.full((rows, classes + pad), math.nan, dtype=dtype)
    values = torch.randn(rows, classes, generator=gen, dtype=torch.float64) * spread
    wide[:, :classes] = values.to(dtype)
    return wide, wide[:, :classes]


def _targets(rows, classes, seed, kind):
    gen = torch.Generator().manual_seed(seed + 1)
    t = torch.randint(0, classes, (rows,), generator=gen)
    if kind == "some":
        t[torch.rand(rows, generator=gen) < 0.3] = -1
    elif kind == "none_owned":
        t[:] = -1
    return t


def _exact_stats(tile, scale, target, row_max=None):
    """m, Z, D and u_t of each row in float64 (m exact: see the test); Z, D and u_t
    relative to ``row_max`` where given (the fp32 max the loops return, which the chunk
    loop's lse = m + log Z adds back: their u = x·c − m needs no rounded x·c, as an FMA
    forms it, so Z is Σ e^(x·c − m) for that m, not for the unrounded max)."""
    v = tile.double() * _fp32(scale)
    m = v.amax(1)
    u = v - (m if row_max is None else row_max.double())[:, None]
    e = u.exp()
    # e·u is 0 where e is (a masked class: 0 · -inf is NaN in float64 too).
    dot = torch.where(e == 0, 0.0, e * u).sum(1)
    u_t = torch.where(target >= 0, u.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    return m, e.sum(1), dot, u_t


def _plain_stats(tile, scale, target):
    """The same statistics by torch's fp32 operations (the path the loops replace)."""
    v = tile.float() * torch.tensor(scale, dtype=torch.float32)
    m = v.amax(1)
    u = v - m[:, None]
    e = u.exp()
    dot = torch.where(e == 0, 0.0, e * u).sum(1)
    u_t = torch.where(target >= 0, u.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    return m, e.sum(1), dot, u_t


def _grad_formula(tile, m, a, b, mu, target, gamma, scale, dtype):
    """g = eᵘ (a + b (u − μ)) + γ [j = t] from ``tile`` in ``dtype`` math (float64: the
    exact value; float32: torch's plain expression), 0 where eᵘ is."""
    v = tile.to(dtype) * torch.tensor(_fp32(scale), dtype=dtype)
    u = v - m.to(dtype)[:, None]
    e = u.exp()
    g = e * a.to(dtype)[:, None]
    if b is not None:
        g = g + e * b.to(dtype)[:, None] * (u - mu.to(dtype)[:, None])
    g = torch.where(e == 0, 0.0, g)
    if target is not None:
        owned = target >= 0
        rows = torch.arange(tile.shape[0])[owned]
        g[rows, target[owned]] += gamma.to(dtype)[owned]
    return g


def _row_vectors(rows, seed, with_b):
    gen = torch.Generator().manual_seed(seed + 2)
    a, b, mu, gamma = torch.randn(4, rows, generator=gen)
    return a, (b if with_b else None), (mu if with_b else None), gamma


def _check_stats(loops, tile, scale, target, dot, dtype):
    got = loops.stats(tile, scale=scale, target=target, dot=dot)
    m, z, d, u_t = _exact_stats(tile, scale, target, got.row_max)
    # The row max is exact: x (a bf16/fp16/fp32 value) times the fp32 scale is exact in
    # float64 (two 24-bit significands), so the fp32 product is its one rounding, and the
    # max of rounded values is the rounding of the max.
    assert torch.equal(got.row_max, m.float())
    plain = _plain_stats(tile, scale, target)
    pairs = [("sum_exp", got.sum_exp, z, plain[1]), ("target_u", got.target_u, u_t, plain[3])]
    if dot:
        pairs.append(("dot", got.dot, d, plain[2]))
    else:
        assert got.dot is None
    for name, value, exact, same in pairs:
        # fp32 sums of fp32 exponentials of u = x·c − m: the house bound, 3 eps(fp32) or
        # twice torch's own fp32 expression's error. 3 eps alone is not enough: the
        # long profile found D at 4.9 eps (one row, 65 classes, c = 1/0.7, logits ~10:
        # u's rounding, ~|x·c|·eps/2, enters every eᵘ and u), torch's own D further off.
        bound = max(3 * eps(torch.float32), 2 * rel_err(same, exact))
        err = rel_err(value, exact)
        assert err <= bound, f"{dtype} {name}: {err:.3g} > {bound:.3g}"
    return got


def _check_grad(loops, wide, tile, scale, target, with_b, seed, dtype):
    rows = tile.shape[0]
    m = loops.stats(tile, scale=scale).row_max
    a, b, mu, gamma = _row_vectors(rows, seed, with_b)
    exact = _grad_formula(tile, m, a, b, mu, target, gamma, scale, torch.float64)
    same = _grad_formula(tile, m, a, b, mu, target, gamma, scale, torch.float32).to(dtype)
    before = wide.clone()
    loops.grad_(
        tile, m, a, scale=scale, b=b, mu=mu, target=target, gamma=None if target is None else gamma
    )
    # The columns past the tile's are another tile's: untouched (NaN stays NaN).
    assert torch.equal(wide[:, tile.shape[1] :].isnan(), before[:, tile.shape[1] :].isnan())
    # The tile holds g rounded once to its dtype: within twice that rounding's own error
    # (the loops' fp32 eᵘ and products add a few fp32 ulps before it), 3 eps of the dtype,
    # or twice torch's plain fp32 expression rounded to the dtype. The last is needed
    # for fp32 tiles: where γ cancels eᵘ·a at the target (g_t ≈ 0), the fp32 sum's error
    # relative to g_t is eps·|a|/|g_t| for both (the long profile: 11 eps, one 1-class
    # row), which the rounding of the exact g does not see.
    bound = max(3 * eps(dtype), 2 * rel_err(exact.to(dtype), exact), 2 * rel_err(same, exact))
    err = rel_err(tile, exact)
    assert err <= bound, f"{dtype} grad: {err:.3g} > {bound:.3g}"


@st.composite
def _cases(draw):
    return dict(
        rows=draw(st.integers(1, 40)),
        # Fewer classes than the loops' 64 partial sums, and not multiples of 64.
        classes=draw(st.one_of(st.integers(1, 70), st.integers(64, 3000))),
        pad=draw(st.sampled_from([0, 3, 64])),
        scale=draw(st.sampled_from([1.0, 0.5, 1 / 0.7])),
        spread=draw(st.sampled_from([0.3, 3.0, 10.0])),
        targets=draw(st.sampled_from(["all", "some", "none_owned", "absent"])),
        dot=draw(st.booleans()),
        with_b=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


_EDGE_CASE = dict(
    rows=3, classes=64, pad=5, scale=1 / 0.7, spread=10.0, targets="some", dot=True,
    with_b=True, seed=7,
)  # fmt: skip


@pytest.mark.parametrize("dtype", TILES, ids=str)
@settings(max_examples=max(1, settings().max_examples // 2))
@given(case=_cases())
@example(case={**_EDGE_CASE, "classes": 1, "pad": 0})
@example(case={**_EDGE_CASE, "classes": 63})
@example(case={**_EDGE_CASE, "classes": 129, "rows": 40})
def test_loops_against_float64(dtype, case):
    """stats (row max exact; Z, D, u_t at fp32's bound) and grad_ (the tile's rounding of
    the exact g) for random tiles, strided slices of wider ones."""
    loops = _loops(dtype)
    rows, classes = case["rows"], case["classes"]
    wide, tile = _tile(rows, classes, dtype, case["spread"], case["seed"], case["pad"])
    target = _targets(rows, classes, case["seed"], case["targets"])
    given_target = None if case["targets"] == "absent" else target
    got = _check_stats(loops, tile, case["scale"], target, case["dot"], dtype)
    if given_target is None:
        assert loops.stats(tile, scale=case["scale"]).target_u is None
    assert torch.equal(got.row_max, loops.stats(tile, scale=case["scale"]).row_max)
    _check_grad(loops, wide, tile, case["scale"], given_target, case["with_b"], case["seed"], dtype)


@pytest.mark.parametrize("dtype", TILES, ids=str)
def test_masked_classes(dtype):
    """A row with -inf logits (masked classes): eᵘ is 0 there, so they add nothing to Z
    or D (no 0·(-inf) NaN) and their gradient is exactly 0, with and without b."""
    loops = _loops(dtype)
    rows, classes = 4, 150
    _, tile = _tile(rows, classes, dtype, 3.0, 11, 0)
    tile[0, ::3] = -math.inf
    tile[2, 70:] = -math.inf
    target = torch.tensor([1, 5, 3, -1])
    got = _check_stats(loops, tile, 1.0, target, True, dtype)
    assert got.sum_exp.isfinite().all() and got.dot.isfinite().all()
    masked = tile.isinf()
    for with_b in (False, True):
        _, tile2 = _tile(rows, classes, dtype, 3.0, 11, 0)
        tile2[masked] = -math.inf
        m = loops.stats(tile2).row_max
        a, b, mu, gamma = _row_vectors(rows, 3, with_b)
        loops.grad_(tile2, m, a, b=b, mu=mu, target=target, gamma=gamma)
        assert not tile2.isnan().any()
        assert (tile2[masked] == 0).all()
        exact = _grad_formula(tile.clone(), m, a, b, mu, target, gamma, 1.0, torch.float64)
        bound = max(3 * eps(dtype), 2 * rel_err(exact.to(dtype), exact))
        assert rel_err(tile2, exact) <= bound


@pytest.mark.parametrize("dtype", TILES, ids=str)
def test_nan_logit(dtype):
    """A NaN logit makes its row's max NaN (as torch.amax) and the row's Z, D, u_t and
    gradient NaN (as torch.exp of NaN); the other rows are untouched by it."""
    loops = _loops(dtype)
    _, tile = _tile(3, 100, dtype, 2.0, 5, 0)
    tile[1, 40] = math.nan
    target = torch.tensor([2, 3, 4])
    got = loops.stats(tile, target=target, dot=True)
    assert torch.equal(got.row_max.isnan(), tile.float().amax(1).isnan())
    for value in (got.row_max, got.sum_exp, got.dot, got.target_u):
        assert value[1].isnan() and value[[0, 2]].isfinite().all()
    keep = [0, 2]
    _, z, d, u_t = _exact_stats(tile[keep], 1.0, target[keep], got.row_max[keep])
    # The other rows as in test_loops_against_float64: fp32 sums of fp32 exponentials of
    # exact u (x·1 − m is exact here), 3 eps(fp32).
    for value, exact in ((got.sum_exp, z), (got.dot, d), (got.target_u, u_t)):
        assert rel_err(value[keep], exact) <= 3 * eps(torch.float32)
    a, b, mu, gamma = _row_vectors(3, 1, True)
    loops.grad_(tile, got.row_max, a, b=b, mu=mu, target=target, gamma=gamma)
    assert tile[1].isnan().all() and not tile[keep].isnan().any()


def test_stats_into_a_given_tensor():
    """``out`` receives the same sums as a call without it (its ``dot`` row untouched where
    no dot sum is asked); an ``out`` of another shape, dtype or layout is refused."""
    loops = _loops(torch.bfloat16)
    _, tile = _tile(5, 300, torch.bfloat16, 2.0, 3, 0)
    target = torch.tensor([0, -1, 7, 299, 3])
    fresh = loops.stats(tile, target=target)
    out = torch.full((4, 5), 7.0)
    got = loops.stats(tile, target=target, out=out)
    assert got.row_max.data_ptr() == out.data_ptr()
    assert torch.equal(out[[0, 1, 3]], torch.stack([fresh.row_max, fresh.sum_exp, fresh.target_u]))
    assert torch.equal(out[2], torch.full((5,), 7.0))
    for bad in (torch.zeros(4, 6), torch.zeros(4, 5, dtype=torch.float64), torch.zeros(5, 4).T):
        with pytest.raises(ValueError, match=r"out must be a contiguous \(4, 5\) float32"):
            loops.stats(tile, target=target, out=bad)


@pytest.mark.parametrize("classes", [2, 3], ids=["pairs", "pairs and a tail"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_every_half_value_read_exactly(dtype, classes):
    """Each of the 65536 bit patterns of a half logit, a row of ``classes`` copies: the loops
    widen it exactly (their max is torch's fp32 of it: subnormals, -0, ±inf, the largest
    values), the sums of a finite row are ``classes`` copies of e⁰ = 1, an infinite row's
    are NaN (eᵛ⁻ᵐ at v = m = ±inf, as torch's), and a NaN row's max is NaN."""
    loops = _loops(dtype)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    tile = bits.view(dtype)[:, None].expand(-1, classes).contiguous()
    target = torch.ones(tile.shape[0], dtype=torch.int64)
    got = loops.stats(tile, target=target, dot=True)
    widened = tile[:, 0].float()
    finite, nan = widened.isfinite(), widened.isnan()
    assert torch.equal(got.row_max[~nan], widened[~nan]) and got.row_max[nan].isnan().all()
    assert torch.equal(got.sum_exp[finite], torch.full_like(widened[finite], classes))
    assert torch.equal(got.dot[finite], torch.zeros_like(widened[finite]))
    assert torch.equal(got.target_u[finite], torch.zeros_like(widened[finite]))
    assert got.sum_exp[~finite].isnan().all() and got.dot[~finite].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_very_negative_logits(dtype):
    """u down to -100 (fp16 cannot hold such logits next to a max near 0 with its range,
    so bf16 and fp32): eᵘ flushes to 0 below ~-87.3 (fp32's smallest normal), where
    float64 keeps ~1e-38; against float64 at the bound all the same, those terms being
    far below an ulp of Z."""
    loops = _loops(dtype)
    u = torch.linspace(-100.0, 0.0, 401, dtype=torch.float64)
    tile = torch.stack([u, u.flip(0), u * 0.5]).to(dtype)
    target = torch.tensor([0, 399, 200])
    got = _check_stats(loops, tile, 1.0, target, True, dtype)
    assert got.sum_exp.isfinite().all()
    _check_grad(loops, tile, tile, 1.0, target, True, 4, dtype)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_gradient_rounds_to_nearest_even(dtype):
    """The gradient is rounded once, to nearest even, as torch's ``.to(dtype)``: a tile of
    zeros (u = 0, eᵘ = 1 exactly) takes g = a, fp32 values between the dtype's, halfway
    ones (ties) among them, past its largest finite value and NaN; exactly torch's."""
    loops = _loops(dtype)
    gen = torch.Generator().manual_seed(13)
    a = torch.randn(64, generator=gen) * 4
    ulp = torch.finfo(dtype).eps
    base = a.to(dtype).float()
    # Ties: halfway between two neighbours of the dtype (both parities).
    a[:16] = base[:16] * (1 + ulp / 2)
    a[16:32] = (base[16:32] * (1 + 2 * ulp)).to(dtype).float() * (1 + ulp / 2)
    a[32] = torch.finfo(dtype).max * (1 + ulp / 4)
    a[33] = math.nan
    a[34] = -(2.0**-130) if dtype == torch.bfloat16 else -(2.0**-20)
    tile = torch.zeros(64, 70, dtype=dtype)
    loops.grad_(tile, torch.zeros(64), a)
    want = a[:, None].expand(64, 70).to(dtype)
    assert torch.equal(tile.isnan(), want.isnan())
    assert torch.equal(torch.where(want.isnan(), 0, tile), torch.where(want.isnan(), 0, want))


def _exp_ulps(u: torch.Tensor) -> torch.Tensor:
    """The loops' eᵘ of fp32 ``u`` (an fp32 tile's gradient with a = 1, m = 0), its error
    in units in the last place of the float64 value."""
    loops = _loops(torch.float32)
    tile = torch.stack([torch.zeros_like(u), u], 1).contiguous()
    loops.grad_(tile, torch.zeros(len(u)), torch.ones(len(u)))
    exact = u.double().exp()
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 24)
    return (tile[:, 1].double() - exact).abs() / ulp


def test_exp_within_two_ulps():
    """The module's claim, element by element: eᵘ within 2 ulp of fp32 for u in [-87, 0]
    (measured: 0.88 at most over these points; torch.exp 0.55)."""
    gen = torch.Generator().manual_seed(17)
    u = torch.cat([torch.linspace(-87.0, 0.0, 50001), -87 * torch.rand(50000, generator=gen)])
    assert _exp_ulps(u).max() <= 2


def test_exp_within_two_ulps_down_to_the_smallest_normal():
    """eᵘ within 2 ulp down to fp32's smallest normal (u = -87.3365), where the loops'
    cut to 0 begins."""
    u = torch.linspace(-87.33, -87.0, 1001)
    assert _exp_ulps(u).max() <= 2


@pytest.mark.parametrize("threads", [1, 3])
def test_row_split_over_threads(threads):
    """Rows split over torch's threads give each row's result as one thread does: the
    same bits (rows are independent), with more threads than rows too."""
    loops = _loops(torch.bfloat16)
    _, tile = _tile(7, 300, torch.bfloat16, 3.0, 19, 0)
    target = _targets(7, 300, 19, "some")
    a, b, mu, gamma = _row_vectors(7, 19, True)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (threads, 8):
            torch.set_num_threads(n)
            got = loops.stats(tile, target=target, dot=True)
            grad = loops.grad_(tile.clone(), got.row_max, a, b=b, mu=mu, target=target, gamma=gamma)
            results.append([got.row_max, got.sum_exp, got.dot, got.target_u, grad])
    finally:
        torch.set_num_threads(before)
    for one, many in zip(*results, strict=True):
        assert torch.equal(one, many)
    _, z, _, _ = _exact_stats(tile, 1.0, target, results[1][0])
    assert rel_err(results[1][1], z) <= 3 * eps(torch.float32)


def test_target_in_a_masked_class_with_b():
    """A target whose class is masked (-inf): its u is -inf and eᵘ = 0, so its gradient is
    γ alone, as every other masked class's gradient is 0 (the limit, not 0·(-inf))."""
    loops = _loops(torch.float32)
    tile = torch.randn(2, 70, generator=torch.Generator().manual_seed(23))
    tile[:, 7] = -math.inf
    target = torch.tensor([7, 7])
    m = loops.stats(tile).row_max
    a, b, mu, gamma = _row_vectors(2, 9, True)
    loops.grad_(tile, m, a, b=b, mu=mu, target=target, gamma=gamma)
    assert torch.equal(tile[:, 7], gamma)


# The environment switch and the build.


def test_mode_values(monkeypatch):
    """0 turns the loops off; a value other than 0, 1, auto is an error naming the variable."""
    monkeypatch.setenv(ENV, "0")
    assert nr.native_rows(torch.bfloat16) is None
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=ENV):
        nr.native_rows(torch.bfloat16)
    monkeypatch.setenv(ENV, "1")
    assert nr.native_rows(torch.float64) is None
    _need_compiler()
    assert isinstance(nr.native_rows(torch.bfloat16), nr.NativeRows)


def test_bad_mode_through_a_public_call(monkeypatch):
    """The chunk loop reads the variable on each call: a bad value is the same error."""
    if not native_half_gemm(torch.bfloat16, CPU):
        pytest.skip("this CPU has no native bf16 GEMMs (no half tile)")
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    monkeypatch.setenv(STEP_ROWS_ENV, "8")
    x, W, t = _data(1, 40, 8, 30)
    monkeypatch.setenv(ENV, "2")
    with pytest.raises(ValueError, match=rf"{ENV} must be 0 .* got '2'"):
        linear_ce.linear_cross_entropy(x.bfloat16(), W.bfloat16(), t)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A build state of its own (nothing built yet) over an empty cache directory."""
    monkeypatch.setattr(nr, "_library", nr._Library())
    monkeypatch.setenv("LINEAR_CE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_missing_compiler_required_is_an_error(monkeypatch, fresh_build):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(RuntimeError, match=r"/nonexistent/cc"):
        nr.native_rows(torch.bfloat16)


def test_missing_compiler_auto_warns_once(monkeypatch, fresh_build):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(ENV, "auto")
    with pytest.warns(RuntimeWarning, match=r"/nonexistent/cc"):
        assert nr.native_rows(torch.bfloat16) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nr.native_rows(torch.float16) is None


def _compiler_script(folder, name, body):
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_failing_compiler_message(monkeypatch, fresh_build):
    """A compiler that runs but fails: the error carries its message."""
    cc = _compiler_script(
        fresh_build,
        "badcc",
        'if [ "$1" = --version ]; then echo badcc 1.0; exit 0; fi\n'
        "echo 'no such intrinsic' >&2\nexit 1\n",
    )
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(RuntimeError, match=r"badcc failed: no such intrinsic"):
        nr.native_rows(torch.bfloat16)


def test_library_is_cached(monkeypatch, fresh_build):
    """The first build compiles into the cache directory; a new process state (a fresh
    _Library) on the same directory loads that file without compiling again."""
    _need_compiler()
    real = shutil.which(nr._compiler()[0])
    log = fresh_build / "calls"
    cc = _compiler_script(fresh_build, "logcc", f'echo "$@" >> {log}\nexec {real} "$@"\n')
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(ENV, "1")
    first = nr.native_rows(torch.bfloat16)
    path = nr.library_path()
    assert path is not None and path.parent == fresh_build / "cache" and path.exists()
    compiles = [line for line in log.read_text().splitlines() if " -o " in line]
    assert len(compiles) == 1
    mtime = os.stat(path).st_mtime_ns
    monkeypatch.setattr(nr, "_library", nr._Library())
    second = nr.native_rows(torch.bfloat16)
    assert nr.library_path() == path and os.stat(path).st_mtime_ns == mtime
    assert [line for line in log.read_text().splitlines() if " -o " in line] == compiles
    tile = torch.randn(3, 100).bfloat16()
    assert torch.equal(first.stats(tile).sum_exp, second.stats(tile).sum_exp)


def test_compiler_without_openmp_builds_the_thread_pool_form(monkeypatch, fresh_build):
    """A compiler that rejects ``-fopenmp`` (clang without libomp) builds with
    ``-fopenmp-simd``: the kernels split their rows over the thread pool, with the same bits
    as the OpenMP build's."""
    _need_compiler()
    real = shutil.which(nr._compiler()[0])
    cc = _compiler_script(
        fresh_build,
        "noompcc",
        'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "no -fopenmp" >&2; exit 1; }; done\n'
        f'exec {real} "$@"\n',
    )
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(ENV, "1")
    pool = nr.native_rows(torch.bfloat16)
    assert pool is not None and not pool.openmp
    monkeypatch.setenv("CC", real)
    monkeypatch.setattr(nr, "_library", nr._Library())
    region = nr.native_rows(torch.bfloat16)
    if not region.openmp:
        pytest.skip(f"{real} has no OpenMP either")
    tile = (torch.randn(37, 300, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    sums = [dataclasses.astuple(loops.stats(tile, dot=True))[:3] for loops in (pool, region)]
    assert all(torch.equal(a, b) for a, b in zip(*sums, strict=True))


# The chunk loop on both paths.


def _counting(monkeypatch):
    """Counts the loops' calls (stats, grad_, fused_: statistics and gradient in one);
    where the dict holds a set under ``"tiles"``, the dtypes of the tiles they got."""
    calls = {"stats": 0, "grad": 0, "fused": 0}

    def counted(name, key):
        original = getattr(nr.NativeRows, name)

        def call(self, tile, *args, **kwargs):
            calls[key] += 1
            if "tiles" in calls:
                calls["tiles"].add(tile.dtype)
            return original(self, tile, *args, **kwargs)

        monkeypatch.setattr(nr.NativeRows, name, call)

    # stats_call: every statistics call, stats's own and the statistics pass's blocks.
    for name, key in (("stats_call", "stats"), ("grad_", "grad"), ("fused_", "fused")):
        counted(name, key)
    return calls


#: The tiles a head's loops may get in the chunk loop: the input dtype and the environment
#: that forces the tile. bf16/fp16: a half tile (native half GEMMs: skipped on a CPU
#: without them); bf16-fp32-tile: bf16 inputs where the CPU has no native bf16 GEMMs (fp32
#: GEMMs on upcast blocks of the weight, an fp32 tile), forced on any CPU.
_HEAD_TILES = {
    "bf16": (torch.bfloat16, {}),
    "f16": (torch.float16, {}),
    "f32-class-major": (torch.float32, {TILE_LAYOUT_ENV: "class-major"}),
    "f32-row-major": (torch.float32, {TILE_LAYOUT_ENV: "row-major"}),
    "bf16-fp32-tile": (torch.bfloat16, {NATIVE_HALF_GEMM_ENV: "0"}),
}


def _head_tile(tile, monkeypatch):
    """``(dtype, fp32_tile)`` of a :data:`_HEAD_TILES` entry, its environment set."""
    dtype, env = _HEAD_TILES[tile]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return dtype, dtype == torch.float32 or bool(env)


def _both_paths(monkeypatch, dtype, run, *, grads=True, fp32_tile=None):
    """``run()`` with the loops off and on: each result, after checking the path taken
    (under ``=1`` every tile the loops got is fp32 where ``fp32_tile``, else a half tile of
    ``dtype``; ``None``: fp32 inputs' fp32 tiles)."""
    fp32_tile = dtype == torch.float32 if fp32_tile is None else fp32_tile
    if not fp32_tile and not native_half_gemm(dtype, CPU):
        pytest.skip(f"this CPU has no native {dtype} GEMMs (no half tile)")
    _need_compiler()
    # The fixed rules' plan, which takes the half tile wherever native half GEMMs exist.
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    calls = _counting(monkeypatch)
    results = {}
    counts = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(ENV, mode)
        calls.update(stats=0, grad=0, fused=0)
        calls["tiles"] = set()
        results[mode] = run()
        tiles = calls.pop("tiles")
        if mode == "0":
            assert calls == {"stats": 0, "grad": 0, "fused": 0}
        else:
            visits, grad_visits = calls["stats"] + calls["fused"], calls["grad"] + calls["fused"]
            assert visits > 0 and (grad_visits > 0) == grads, calls
            assert tiles == {torch.float32 if fp32_tile else dtype}, tiles
        counts[mode] = dict(calls)
    return results, counts


def _leaves(values, dtype):
    return [v.to(dtype, copy=True).requires_grad_() for v in values]


def _check(got, exact, same, dtype, what, floor=3):
    """The house bound: ``floor`` eps of ``dtype`` or twice the plain same-dtype error."""
    for i, (g, e, s) in enumerate(zip(got, exact, same, strict=True)):
        bound = max(floor * eps(dtype), 2 * rel_err(s, e))
        err = rel_err(g, e)
        assert err <= bound, f"{what}[{i}]: {err:.3g} > {bound:.3g}"


def _data(seed, rows, feat, classes, ignored=0.25):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, feat, generator=gen, dtype=torch.float64)
    W = torch.randn(classes, feat, generator=gen, dtype=torch.float64) * 2 / feat**0.5
    t = torch.randint(0, classes, (rows,), generator=gen)
    t[torch.rand(rows, generator=gen) < ignored] = -100
    return x, W, t


@pytest.mark.parametrize("tile", ["bf16", "f16", "bf16-fp32-tile"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "z_loss, scale, temperature", [(0.0, 1.0, 1.0), (1e-2, 1.3, 0.8)], ids=["plain", "zloss-scaled"]
)
def test_cross_entropy_both_paths(tile, reduction, z_loss, scale, temperature, monkeypatch):
    """Half-input linear_cross_entropy with a quarter of the rows ignored, chunks of 96
    rows (a half tile's in steps of 16, or an fp32 tile's): loss and gradients against
    float64 on both paths."""
    dtype, fp32_tile = _head_tile(tile, monkeypatch)
    monkeypatch.setenv(STEP_ROWS_ENV, "16")
    x, W, t = _data(3, 300, 24, 200)
    options = LinearCrossEntropyOptions(batch_chunk_size=96)

    def plain(x_, W_):
        z = F.linear(x_, W_) * scale / temperature
        valid = t != -100
        z, target = z[valid], t[valid]
        loss = F.cross_entropy(z, target, reduction="sum")
        loss = loss + z_loss * torch.logsumexp(z, -1).square().sum()
        return loss / valid.sum() if reduction == "mean" else loss

    def ours(x_, W_):
        return linear_ce.linear_cross_entropy(
            x_, W_, t, reduction=reduction, z_loss=z_loss, logit_scale=scale,
            temperature=temperature, options=options,
        )  # fmt: skip

    def run(fn, dt):
        leaves = _leaves((x, W), dt)
        loss = fn(*leaves)
        return [loss.detach(), *torch.autograd.grad(loss, leaves)]

    results, _ = _both_paths(monkeypatch, dtype, lambda: run(ours, dtype), fp32_tile=fp32_tile)
    exact, same = run(plain, torch.float64), run(plain, dtype)
    for mode, got in results.items():
        _check(got, exact, same, dtype, f"cross_entropy {tile} {mode}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cross_entropy_many_chunks(dtype, monkeypatch):
    """4000 rows (a tenth ignored) in chunks of 64 valid rows (57 chunks; a bf16 half tile
    in steps of 16, an fp32 tile in the plan's class-major layout), 100 classes, 8
    features: errors that grew with the chunk count would show against float64."""
    monkeypatch.setenv(STEP_ROWS_ENV, "16")
    x, W, t = _data(5, 4000, 8, 100, ignored=0.1)
    options = LinearCrossEntropyOptions(batch_chunk_size=64)

    def run(fn, dt):
        leaves = _leaves((x, W), dt)
        loss = fn(*leaves)
        return [loss.detach(), *torch.autograd.grad(loss, leaves)]

    def plain(x_, W_):
        return F.cross_entropy(F.linear(x_, W_), t, ignore_index=-100)

    def ours(x_, W_):
        return linear_ce.linear_cross_entropy(x_, W_, t, options=options)

    results, counts = _both_paths(monkeypatch, dtype, lambda: run(ours, dtype))
    # 3600 valid rows in chunks of 64: one fused_ (statistics and gradient) per chunk.
    calls = counts["1"]
    assert calls["fused"] >= 50 and calls["stats"] == calls["grad"] == 0, calls
    exact, same = run(plain, torch.float64), run(plain, dtype)
    for mode, got in results.items():
        _check(got, exact, same, dtype, f"many chunks {mode}")


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_token_logprobs_both_paths(dtype, monkeypatch):
    """token_logprobs with entropy (the loops' stats, the dot sum too) and its vjp without
    the forward's statistics (the chunk loop again, the gradient by the loops) with both
    upstream gradients and with the log-probabilities' alone."""
    monkeypatch.setenv(STEP_ROWS_ENV, "8")
    x, W, t = _data(7, 150, 16, 300)
    gen = torch.Generator().manual_seed(8)
    up_lp, up_h = torch.randn(2, 150, generator=gen, dtype=torch.float64)
    options = LinearCrossEntropyOptions(batch_chunk_size=40)
    transform = dict(logit_scale=1.2, temperature=0.9)

    def ours():
        xs, Ws = (v.to(dtype) for v in (x, W))
        out = linear_ce.token_logprobs(xs, Ws, t, entropy=True, options=options, **transform)
        outs = [out.logprob, out.entropy]
        for h in (up_h, None):
            gx, gW, _ = linear_ce.token_logprobs_vjp(
                xs, Ws, t, up_lp.to(dtype), None if h is None else h.to(dtype),
                options=options, **transform,
            )  # fmt: skip
            outs += [gx, gW]
        return outs

    def plain(dt):
        outs = []
        for h in (up_h, None):
            xs, Ws = _leaves((x, W), dt)
            ids = torch.zeros_like(t)
            lp, ent, _ = seqref.token_terms(xs, Ws, None, t, ids, **transform)
            loss = (lp * up_lp.to(dt)).sum()
            if h is not None:
                loss = loss + (ent * h.to(dt)).sum()
                outs += [lp.detach(), ent.detach()]
            outs += list(torch.autograd.grad(loss, [xs, Ws]))
        return outs

    results, _ = _both_paths(monkeypatch, dtype, ours)
    exact, same = plain(torch.float64), plain(dtype)
    for mode, got in results.items():
        # 4 eps: the entropy's gradient (as tests/test_sequence_objective.py's bound).
        _check(got, exact, same, dtype, f"token_logprobs {mode}", floor=4)


def _clipped(lp, old, adv, low=0.2, high=0.28):
    ratio = torch.exp(lp - old)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)


@pytest.mark.parametrize("tile", list(_HEAD_TILES))
@pytest.mark.parametrize("entropy", [False, True])
def test_token_objective_both_paths(tile, entropy, monkeypatch):
    """token_objective of the clipped surrogate (and an entropy bonus: the b term, and the
    dot sum of the statistics), on every tile the loops take."""
    dtype, fp32_tile = _head_tile(tile, monkeypatch)
    monkeypatch.setenv(STEP_ROWS_ENV, "8")
    rows = 160
    x, W, t = _data(9, rows, 16, 250)
    gen = torch.Generator().manual_seed(10)
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)
    old = -5.0 + torch.randn(rows, generator=gen, dtype=torch.float64)
    objective = obj.clipped_policy_gradient(0.2, 0.28)
    if entropy:
        objective = objective + obj.entropy_bonus(0.05)
    options = LinearCrossEntropyOptions(batch_chunk_size=48)

    def ours():
        leaves = _leaves((x, W), dtype)
        loss = linear_ce.token_objective(
            *leaves, t, objective, entropy=entropy, options=options,
            advantage=adv.to(dtype), old_logprob=old.to(dtype),
        )  # fmt: skip
        return [loss.detach(), *torch.autograd.grad(loss, leaves)]

    def plain(dt):
        leaves = _leaves((x, W), dt)
        lp, ent, scored = seqref.token_terms(*leaves, None, t, torch.zeros_like(t))
        terms = _clipped(lp, old.to(dt), adv.to(dt))
        if entropy:
            terms = terms - 0.05 * ent
        terms = torch.where(scored, terms, 0.0)
        loss = terms.sum()
        return [loss.detach(), *torch.autograd.grad(loss, leaves)], terms.detach()

    results, _ = _both_paths(monkeypatch, dtype, ours, fp32_tile=fp32_tile)
    (exact, exact_terms), (same, same_terms) = plain(torch.float64), plain(dtype)
    # The loss sums terms of both signs (the advantages'), so its relative error is its
    # terms' errors over |loss|, which the plain expression's own error measures only up to
    # the luck of their cancellation (its loss error is 2.7e-7 on AVX2 kernels, 4.7e-7 on
    # AVX-512 ones, the package's 5.7e-7 on both): the loss's bound takes the plain
    # expression's term errors added without cancelling.
    own = (same_terms.double() - exact_terms).abs().sum().item() / exact[0].abs().item()
    for mode, got in results.items():
        what = f"token_objective {tile} {mode}"
        _check(got[1:], exact[1:], same[1:], dtype, what, floor=4)
        err, bound = rel_err(got[0], exact[0]), max(4 * eps(dtype), 2 * own)
        assert err <= bound, f"{what} loss: {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("tile", list(_HEAD_TILES))
@pytest.mark.parametrize("entropy", [False, True])
def test_sequence_objective_dpo_both_paths(tile, entropy, monkeypatch):
    """sequence_objective of DPO over 6 pairs of padded sequences (a quarter of the
    labels ignored), chunks of whole pairs; with entropy asked too (the dot sum); on every
    tile the loops take."""
    dtype, fp32_tile = _head_tile(tile, monkeypatch)
    monkeypatch.setenv(STEP_ROWS_ENV, "8")
    seqs, length, feat, classes = 12, 20, 16, 150
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(seqs, length, feat, generator=gen, dtype=torch.float64)
    W = torch.randn(classes, feat, generator=gen, dtype=torch.float64) * 2 / feat**0.5
    t = torch.randint(0, classes, (seqs, length), generator=gen)
    t[torch.rand(seqs, length, generator=gen) < 0.25] = -100
    t[:, 0] = torch.randint(0, classes, (seqs,), generator=gen)
    refs = -length * 3 + torch.randn(seqs, generator=gen, dtype=torch.float64)
    options = LinearCrossEntropyOptions(batch_chunk_size=48)

    def ours():
        leaves = _leaves((x, W), dtype)
        out = linear_ce.sequence_objective(
            *leaves, t, obj.dpo(0.1), group="pairs", entropy=entropy, options=options,
            ref_logprob=refs.to(dtype),
        )  # fmt: skip
        return [out.loss.detach(), *torch.autograd.grad(out.loss, leaves)]

    def plain(dt):
        leaves = _leaves((x, W), dt)
        ids = torch.arange(seqs)[:, None].expand(seqs, length)
        lp, _, scored = seqref.token_terms(*leaves, None, t, ids)
        per_seq = seqref.per_sequence(lp, ids, scored, seqs)
        n = scored.sum(1).to(dt)
        loss = seqref.dpo_loss("sigmoid", per_seq, refs.to(dt), n, 0.1).mean()
        return [loss.detach(), *torch.autograd.grad(loss, leaves)]

    results, _ = _both_paths(monkeypatch, dtype, ours, fp32_tile=fp32_tile)
    exact, same = plain(torch.float64), plain(dtype)
    for mode, got in results.items():
        _check(got, exact, same, dtype, f"sequence_objective {tile} {mode}", floor=4)


def test_fp32_loops_plan_one_tile(monkeypatch):
    """With entropy, torch's operations keep eᵘ in a second fp32 tile, which the loops do
    not (they write the gradient over the tile): the plan of token_objective and of
    sequence_objective's fused path divides its budget by the tiles held, one where the
    loops take the call (its chunks twice as long) and two where they do not."""
    import linear_ce.engine.chunk_loop as chunk_loop
    import linear_ce.ops.sequence_objective as sequence_ops

    _need_compiler()
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    seen = []
    for module in (chunk_loop, sequence_ops):
        original = module.make_plan

        def recorded(*args, _original=original, **kwargs):
            seen.append(kwargs.get("tiles", 1))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "make_plan", recorded)
    x, W, t = _data(4, 64, 8, 90)
    xs, Ws = _leaves((x, W), torch.float32)
    seq = t.reshape(8, 8)
    seq[:, 0] = 1
    tiles = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(ENV, mode)
        seen.clear()
        objective = obj.clipped_policy_gradient() + obj.entropy_bonus(0.05)
        loss = linear_ce.token_objective(
            xs, Ws, t, objective, entropy=True, advantage=torch.ones(64)
        )
        loss.backward()
        out = linear_ce.sequence_objective(
            xs.reshape(8, 8, -1), Ws, seq, obj.dpo(0.1), group="pairs", entropy=True,
            ref_logprob=torch.zeros(8),
        )  # fmt: skip
        out.loss.backward()
        tiles[mode] = list(seen)
    assert tiles == {"0": [2, 2], "1": [1, 1]}, tiles


_TORCH_ONLY = {
    "cross_entropy smoothing": ("ce", dict(label_smoothing=0.1)),
    "cross_entropy bias": ("ce", dict(bias=True)),
    "cross_entropy softcap": ("ce", dict(softcap=5.0)),
    "token_logprobs top1": ("lp", dict(top1=True)),
    "token_logprobs log_sum_sq_prob": ("lp", dict(log_sum_sq_prob=True)),
    "token_logprobs mean_logit": ("lp", dict(mean_logit=True)),
    "token_logprobs topk": ("lp", dict(topk=3)),
}


@pytest.mark.parametrize("case", list(_TORCH_ONLY))
def test_calls_the_loops_cannot_do_take_the_torch_operations(case, monkeypatch):
    """A head statistic, a bias or a softcap the loops do not form: with
    ``LINEAR_CE_NATIVE_ROWS=1`` too the torch operations, the same bits as with ``=0``."""
    if not native_half_gemm(torch.bfloat16, CPU):
        pytest.skip("this CPU has no native bf16 GEMMs (no half tile)")
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    monkeypatch.setenv(STEP_ROWS_ENV, "8")
    kind, kwargs = _TORCH_ONLY[case]
    x, W, t = _data(2, 60, 8, 90)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(90, generator=gen).bfloat16() if kwargs.pop("bias", False) else None
    options = LinearCrossEntropyOptions(batch_chunk_size=24)

    def run(bias, **kwargs):
        xs, Ws = _leaves((x, W), torch.bfloat16)
        if kind == "ce":
            loss = linear_ce.linear_cross_entropy(
                xs, Ws, t, linear_bias=bias, options=options, **kwargs
            )
            return [loss, *torch.autograd.grad(loss, [xs, Ws])]
        out = linear_ce.token_logprobs(xs, Ws, t, entropy=True, options=options, **kwargs)
        return [v for v in out if isinstance(v, torch.Tensor)]

    calls = _counting(monkeypatch)
    results = []
    for mode in ("0", "1"):
        monkeypatch.setenv(ENV, mode)
        results.append(run(bias, **kwargs))
    assert calls == {"stats": 0, "grad": 0, "fused": 0}
    for off, on in zip(*results, strict=True):
        assert torch.equal(off, on)
    # The same call without what the loops cannot do takes them (a half tile is there).
    run(None)
    assert calls["stats"] + calls["fused"] > 0


# The fused loops (fused_: statistics and gradient in one visit of each row) and fp32
# class-major tiles.

#: The fused loops' tiles: the dtype, and whether the tile is class-major (fp32 only).
_FUSED_LAYOUTS = {
    "bf16": (torch.bfloat16, False),
    "f16": (torch.float16, False),
    "f32": (torch.float32, False),
    "f32-class-major": (torch.float32, True),
}


def _cm_tile(rows, classes, spread, seed, pad):
    """``(outside, tile)``: a class-major fp32 ``(rows, classes)`` tile of logits
    ``spread · N(0, 1)``, the transpose of the first ``rows`` columns of a
    ``(classes, rows + pad)`` buffer (class stride ``rows + pad``, as a short last chunk in
    a longer chunk's tile), and the buffer's other columns, NaN: a loop that read or wrote
    past its rows would show."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((classes, rows + pad), math.nan)
    values = torch.randn(rows, classes, generator=gen, dtype=torch.float64) * spread
    buf[:, :rows] = values.T.float()
    return buf[:, rows:], buf[:, :rows].T


def _layout_tile(layout, rows, classes, spread, seed, pad):
    """``(outside, tile)``: a tile of ``layout`` and the NaN next to it in its buffer."""
    dtype, class_major = _FUSED_LAYOUTS[layout]
    if class_major:
        return _cm_tile(rows, classes, spread, seed, pad)
    wide, tile = _tile(rows, classes, dtype, spread, seed, pad)
    return wide[:, classes:], tile


def _coefficients(rows, seed, with_c1):
    """``(c0, c1, gamma)`` of fused_; ``c1`` (a z-loss's ``2·λ·r``) 0 or ~0.1, so that its
    term ``c1·lse`` is a tenth of ``c0``'s or more."""
    gen = torch.Generator().manual_seed(seed + 3)
    c0, c1, gamma = torch.randn(3, rows, generator=gen)
    return c0, (0.1 * c1 if with_c1 else torch.zeros(rows)), gamma


def _fused_formula(tile, m, target, c0, c1, gamma, scale, dtype):
    """g_j = eᵘʲ·a + γ [j = t], a = (c0 + c1·lse) / Z, lse = m + log Z (m where m is ±inf),
    u = x·c − m for the row max ``m``, from ``tile`` in ``dtype`` math (float64: the exact
    value; float32: torch's plain expression)."""
    v = tile.to(dtype) * torch.tensor(_fp32(scale), dtype=dtype)
    m = m.to(dtype)
    e = (v - m[:, None]).exp()
    z = e.sum(1)
    lse = torch.where(m.isinf(), m, m + z.log())
    a = (c0.to(dtype) + c1.to(dtype) * lse) / z
    g = e * a[:, None]
    owned = target >= 0
    rows = torch.arange(tile.shape[0])[owned]
    g[rows, target[owned]] += gamma.to(dtype)[owned]
    return g


def _check_fused(loops, tile, outside, scale, target, coefficients, dtype):
    """fused_ against float64: the row max exact, Z and u_t at fp32's bound (as
    _check_stats), the gradient at the tile's (as _check_grad)."""
    x = tile.clone()
    got = loops.fused_(tile, target, *coefficients, scale=scale)
    assert outside.isnan().all(), "fused_ wrote past its tile"
    assert got.dot is None
    m, z, _, u_t = _exact_stats(x, scale, target, got.row_max)
    # Exact, as in _check_stats (x·c is exact in float64; the max of roundings is the
    # rounding of the max).
    assert torch.equal(got.row_max, m.float())
    plain = _plain_stats(x, scale, target)
    for name, value, exact, same in (
        ("sum_exp", got.sum_exp, z, plain[1]),
        ("target_u", got.target_u, u_t, plain[3]),
    ):
        # A masked target's u_t is -inf, exactly.
        finite = exact.isfinite()
        assert torch.equal(value[~finite], exact[~finite].float()), name
        value, exact, same = value[finite], exact[finite], same[finite]
        # As _check_stats: fp32 sums of fp32 exponentials, 3 eps(fp32) or twice torch's
        # own fp32 expression's error.
        bound = max(3 * eps(torch.float32), 2 * rel_err(same, exact))
        err = rel_err(value, exact)
        assert err <= bound, f"fused {dtype} {name}: {err:.3g} > {bound:.3g}"
    exact = _fused_formula(x, got.row_max, target, *coefficients, scale, torch.float64)
    same = _fused_formula(x, got.row_max, target, *coefficients, scale, torch.float32)
    # As _check_grad: the exact g rounded once to the tile's dtype, within twice that
    # rounding's error, 3 eps of the dtype, or twice torch's plain fp32 expression (rounded
    # to the dtype) — that one also carries a's fp32 Z, log and division, which the loops'
    # a carries, as every g of its row does; and γ's cancellation at the target (fp32).
    bound = max(
        3 * eps(dtype), 2 * rel_err(exact.to(dtype), exact), 2 * rel_err(same.to(dtype), exact)
    )
    err = rel_err(tile, exact)
    assert err <= bound, f"fused {dtype} grad: {err:.3g} > {bound:.3g}"
    return got


@st.composite
def _fused_cases(draw):
    return dict(
        # 16 rows to a vector of a class-major tile (and a thread's share): fewer, more.
        rows=draw(st.one_of(st.sampled_from([1, 15, 16, 17, 40]), st.integers(1, 40))),
        # Fewer classes than a block of 64 (class-major) or the 64 partial sums
        # (row-major), and not multiples of 64: blocks whose max grows.
        classes=draw(st.one_of(st.integers(1, 70), st.integers(64, 3000))),
        pad=draw(st.sampled_from([0, 3, 64])),
        scale=draw(st.sampled_from([1.0, 0.5, 1 / 0.7])),
        spread=draw(st.sampled_from([0.3, 3.0, 10.0])),
        targets=draw(st.sampled_from(["all", "some", "none_owned"])),
        c1=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


_FUSED_EDGE = dict(
    rows=40, classes=129, pad=7, scale=1 / 0.7, spread=10.0, targets="some", c1=True, seed=5
)


@pytest.mark.parametrize("layout", list(_FUSED_LAYOUTS))
@settings(max_examples=max(1, settings().max_examples // 2))
@given(case=_fused_cases())
@example(case=_FUSED_EDGE)
@example(case={**_FUSED_EDGE, "rows": 17, "classes": 63, "pad": 0})
@example(case={**_FUSED_EDGE, "rows": 15, "classes": 1000, "c1": False})
@example(case={**_FUSED_EDGE, "rows": 1, "classes": 1, "pad": 0})
def test_fused_against_float64(layout, case):
    """fused_ (row max exact; Z, u_t at fp32's bound; the gradient at the tile's) for
    bf16, fp16, fp32 row-major tiles and fp32 class-major ones, slices of wider buffers;
    on a class-major tile stats too, with a target and without, and with the dot sum (the
    same kernel without the gradient: the same bits as fused_'s statistics)."""
    dtype, class_major = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    rows, classes, scale = case["rows"], case["classes"], case["scale"]
    outside, tile = _layout_tile(layout, rows, classes, case["spread"], case["seed"], case["pad"])
    if class_major:
        assert loops.class_major(tile)
    target = _targets(rows, classes, case["seed"], case["targets"])
    coefficients = _coefficients(rows, case["seed"], case["c1"])
    if class_major:
        stats = _check_stats(loops, tile, scale, target, False, dtype)
        alone = loops.stats(tile, scale=scale)
        assert alone.target_u is None and alone.dot is None
        assert torch.equal(alone.row_max, stats.row_max)
        assert torch.equal(alone.sum_exp, stats.sum_exp)
        # With the dot sum (its own rescaling as the max grows): D at fp32's bound, the
        # other statistics the same bits as without it.
        with_dot = _check_stats(loops, tile, scale, target, True, dtype)
        for name in ("row_max", "sum_exp", "target_u"):
            assert torch.equal(getattr(with_dot, name), getattr(stats, name)), name
    got = _check_fused(loops, tile, outside, scale, target, coefficients, dtype)
    if class_major:
        for name in ("row_max", "sum_exp", "target_u"):
            assert torch.equal(getattr(got, name), getattr(stats, name)), name


_AGREE_CASES = [(17, 130, 3), (40, 1000, 0), (5, 50, 64)]


@pytest.mark.parametrize("layout", list(_FUSED_LAYOUTS))
@pytest.mark.parametrize("rows, classes, pad", _AGREE_CASES)
def test_fused_agrees_with_stats_and_grad(layout, rows, classes, pad):
    """fused_ (and stats on a class-major tile) against the row-major stats, then grad_
    with a = (c0 + c1·lse)/Z formed by torch from them: the same values to rounding."""
    dtype, _ = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    scale = 1 / 0.7
    _, tile = _layout_tile(layout, rows, classes, 4.0, 29, pad)
    target = _targets(rows, classes, 29, "some")
    c0, c1, gamma = _coefficients(rows, 29, True)
    row_major = tile.clone(memory_format=torch.contiguous_format)
    assert row_major.stride() == (classes, 1)
    ref = loops.stats(row_major, scale=scale, target=target)
    m, z = ref.row_max, ref.sum_exp
    lse = torch.where(m.isinf(), m, m + z.log())
    loops.grad_(row_major, m, (c0 + c1 * lse) / z, scale=scale, target=target, gamma=gamma)
    results = [loops.stats(tile, scale=scale, target=target)]
    results.append(loops.fused_(tile, target, c0, c1, gamma, scale=scale))
    for got in results:
        assert torch.equal(got.row_max, m)
        # Z summed in another order (class-major: per block of 64 classes, rescaled as the
        # max grows): each within 3 eps(fp32) of the exact sum (test_loops_against_float64),
        # so within twice that of each other.
        assert rel_err(got.sum_exp, z) <= 6 * eps(torch.float32)
        # u_t = x·c − m, one rounding (or two where the product is rounded first): each
        # within an ulp of |x·c| of the exact value, of the order of |u_t| here (logits
        # ~ N(0, 5.7), m ≈ 3 σ, u_t ≈ −m): a few eps(fp32) of each other.
        assert rel_err(got.target_u, ref.target_u) <= 4 * eps(torch.float32)
    # The fp32 gradients differ by a (Z's difference, within 6 eps above, enters every g of
    # its row; log and division add an ulp each): 8 eps(fp32). In a half tile's dtype that
    # is one of its ulps at most, where the two straddle a rounding boundary.
    bound = max(eps(dtype), 8 * eps(torch.float32))
    assert rel_err(tile, row_major) <= bound


@pytest.mark.parametrize("layout", list(_FUSED_LAYOUTS))
def test_fused_masked_classes(layout):
    """Masked (-inf) classes in fused_, a whole block of 64 among them (but not the first:
    test_first_block_masked): they add nothing to Z, their gradient is exactly 0, a masked
    target's exactly γ; no NaN anywhere."""
    dtype, _ = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    rows, classes = 20, 150
    outside, tile = _layout_tile(layout, rows, classes, 3.0, 31, 5)
    tile[0, ::3] = -math.inf
    tile[2, 70:] = -math.inf
    tile[18, 64:128] = -math.inf
    tile[18, :64:2] = -math.inf
    masked = tile.isinf()
    target = _targets(rows, classes, 31, "some")
    target[:4] = torch.tensor([0, 5, 71, -1])
    target[18] = 100
    c0, c1, gamma = _coefficients(rows, 31, True)
    got = _check_fused(loops, tile, outside, 1.0, target, (c0, c1, gamma), dtype)
    assert got.sum_exp.isfinite().all() and not tile.isnan().any()
    owned = target >= 0
    at_target = torch.zeros_like(masked)
    at_target[torch.arange(rows)[owned], target[owned]] = True
    assert (tile[masked & ~at_target] == 0).all()
    for i in (0, 2, 18):
        assert tile[i, target[i]] == gamma[i].to(dtype), i


@pytest.mark.parametrize(
    "layout",
    [k for k in _FUSED_LAYOUTS],
)
def test_first_block_masked(layout):
    """A row whose first 64 classes (the class-major kernel's first block) are all masked:
    its statistics and gradient as any masked row's (finite, the masked gradient 0), in
    stats (with the dot sum and without) and fused_."""
    dtype, _ = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    rows, classes = 3, 100
    outside, tile = _layout_tile(layout, rows, classes, 3.0, 43, 0)
    tile[1, :64] = -math.inf
    target = torch.tensor([3, 70, 5])
    coefficients = _coefficients(rows, 43, True)
    _check_stats(loops, tile, 1.0, target, False, dtype)
    # The dot sum's rescaling starts from that block's empty sums (0, not 0 · inf).
    _check_stats(loops, tile, 1.0, target, True, dtype)
    _check_fused(loops, tile, outside, 1.0, target, coefficients, dtype)
    assert (tile[1, :64] == 0).all()


@pytest.mark.parametrize("layout", list(_FUSED_LAYOUTS))
def test_fused_nan_logit(layout):
    """A NaN logit makes its row's max, Z, u_t and whole gradient NaN (as torch.amax and
    torch.exp of NaN) in fused_ and, on a class-major tile, in stats (its dot sum too);
    the other rows (on both sides of a 16-row boundary) are as without it."""
    dtype, class_major = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    rows, classes = 20, 100
    outside, tile = _layout_tile(layout, rows, classes, 2.0, 37, 3)
    tile[1, 40] = math.nan
    tile[18, 99] = math.nan
    bad = torch.zeros(rows, dtype=torch.bool)
    bad[[1, 18]] = True
    target = _targets(rows, classes, 37, "all")
    c0, c1, gamma = _coefficients(rows, 37, True)
    x = tile.clone()
    calls = [loops.fused_(tile, target, c0, c1, gamma)]
    if class_major:
        calls.append(loops.stats(x.T.contiguous().T, target=target, dot=True))
    for got in calls:
        for value in (got.row_max, got.sum_exp, got.target_u, got.dot):
            if value is not None:
                assert torch.equal(value.isnan(), bad)
    assert torch.equal(tile.isnan().all(1), bad) and not tile[~bad].isnan().any()
    assert outside.isnan().all()
    keep = ~bad
    got = calls[0]
    m, z, _, u_t = _exact_stats(x[keep], 1.0, target[keep], got.row_max[keep])
    assert torch.equal(got.row_max[keep], m.float())
    # The other rows as in test_nan_logit: exact u (x·1 − m), 3 eps(fp32).
    for value, exact in ((got.sum_exp, z), (got.target_u, u_t)):
        assert rel_err(value[keep], exact) <= 3 * eps(torch.float32)
    exact = _fused_formula(
        x[keep], got.row_max[keep], target[keep], c0[keep], c1[keep], gamma[keep], 1.0,
        torch.float64,
    )  # fmt: skip
    # As _check_fused (no cancellation here to need the plain expression's error).
    assert rel_err(tile[keep], exact) <= max(3 * eps(dtype), 2 * rel_err(exact.to(dtype), exact))


@pytest.mark.parametrize("rows", [17, 40, 100])
def test_class_major_split_over_threads(rows):
    """The class-major kernel's rows split over 1, 3 and 8 threads (each range a multiple
    of 16 rows): every row's statistics and gradient the same bits."""
    loops = _loops(torch.float32)
    _, tile = _cm_tile(rows, 300, 3.0, 41, 5)
    target = _targets(rows, 300, 41, "some")
    coefficients = _coefficients(rows, 41, True)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3, 8):
            torch.set_num_threads(n)
            alone = loops.stats(tile, scale=0.5)
            stats = loops.stats(tile, scale=0.5, target=target, dot=True)
            work = tile.T.contiguous().T
            fused = loops.fused_(work, target, *coefficients, scale=0.5)
            results.append([alone.row_max, alone.sum_exp, stats.target_u, stats.dot])
            results[-1] += [fused.row_max]
            results[-1] += [fused.sum_exp, fused.target_u, work]
    finally:
        torch.set_num_threads(before)
    for one, many in zip(results[0], results[1], strict=True):
        assert torch.equal(one, many)
    for one, many in zip(results[0], results[2], strict=True):
        assert torch.equal(one, many)
    _, z, _, _ = _exact_stats(tile, 0.5, target, results[0][0])
    assert rel_err(results[0][1], z) <= 3 * eps(torch.float32)


# The chunk loop with fp32 tiles: cross-entropy's fused loops, class-major or row-major.


def _tile_layouts(monkeypatch):
    """Records, for every tile the loops get (stats_call, fused_), whether it is
    class-major."""
    seen = set()
    for name in ("stats_call", "fused_"):
        original = getattr(nr.NativeRows, name)

        def recorded(self, tile, *args, _original=original, **kwargs):
            seen.add(tile.stride(0) == 1)
            return _original(self, tile, *args, **kwargs)

        monkeypatch.setattr(nr.NativeRows, name, recorded)
    return seen


_CE_VARIANTS = {
    "plain": dict(z_loss=0.0, scale=1.0, temperature=1.0, weighted=False),
    "zloss-scaled": dict(z_loss=1e-2, scale=1.3, temperature=0.8, weighted=False),
    "weighted-zloss": dict(z_loss=1e-2, scale=1.0, temperature=1.0, weighted=True),
}


def _class_weights(classes):
    return torch.rand(classes, generator=torch.Generator().manual_seed(4)).double() + 0.5


def _ce_rows(x, W, t, w, z_loss, scale, temperature):
    """Per row, in x's dtype: ``w_t (lse − z_t) + λ w_t lse²``, lse, and w_t (torch's
    class-weighted cross-entropy with a z-loss, written out); 0 on ignored rows."""
    z = F.linear(x, W) * scale / temperature
    valid = t != -100
    safe = t.clamp(min=0)
    lse = torch.logsumexp(z, -1)
    z_t = z.gather(1, safe[:, None])[:, 0]
    w_t = torch.ones_like(lse) if w is None else w.to(z.dtype)[safe]
    w_t = torch.where(valid, w_t, 0.0)
    loss = w_t * (lse - z_t) + z_loss * w_t * lse.square()
    return torch.where(valid, loss, 0.0), torch.where(valid, lse, 0.0), w_t


@pytest.mark.parametrize("layout", ["class-major", "row-major"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("variant", list(_CE_VARIANTS))
def test_fp32_cross_entropy_both_paths(layout, reduction, variant, monkeypatch):
    """fp32 linear_cross_entropy (a quarter of the rows ignored, chunks of 96 rows, the
    last one short): a training step's loss and gradients against float64 on both paths;
    under ``=1`` every chunk by fused_ on a tile of the layout asked."""
    monkeypatch.setenv(TILE_LAYOUT_ENV, layout)
    seen = _tile_layouts(monkeypatch)
    v = _CE_VARIANTS[variant]
    x, W, t = _data(3, 300, 24, 200)
    w = _class_weights(200) if v["weighted"] else None
    terms = dict(z_loss=v["z_loss"], scale=v["scale"], temperature=v["temperature"])
    options = LinearCrossEntropyOptions(batch_chunk_size=96)

    def plain(x_, W_):
        loss, _, w_t = _ce_rows(x_, W_, t, w, **terms)
        return loss.sum() / w_t.sum() if reduction == "mean" else loss.sum()

    def ours(x_, W_):
        return linear_ce.linear_cross_entropy(
            x_, W_, t, weight=None if w is None else w.to(x_.dtype), reduction=reduction,
            z_loss=v["z_loss"], logit_scale=v["scale"], temperature=v["temperature"],
            options=options,
        )  # fmt: skip

    def run(fn, dt):
        leaves = _leaves((x, W), dt)
        loss = fn(*leaves)
        return [loss.detach(), *torch.autograd.grad(loss, leaves)]

    results, counts = _both_paths(monkeypatch, torch.float32, lambda: run(ours, torch.float32))
    assert counts["1"]["fused"] >= 3 and counts["1"]["stats"] == counts["1"]["grad"] == 0
    assert seen == {layout == "class-major"}
    exact, same = run(plain, torch.float64), run(plain, torch.float32)
    for mode, got in results.items():
        _check(got, exact, same, torch.float32, f"fp32 cross_entropy {layout} {mode}")


@pytest.mark.parametrize("layout", ["class-major", "row-major"])
def test_fp32_cross_entropy_forward_both_paths(layout, monkeypatch):
    """fp32 linear_cross_entropy under torch.no_grad, ``reduction="none"`` and
    ``return_lse``, class weights and a scaled z-loss: per-row losses and lse against
    float64 on both paths; under ``=1`` the loops' stats alone (no gradient)."""
    monkeypatch.setenv(TILE_LAYOUT_ENV, layout)
    seen = _tile_layouts(monkeypatch)
    x, W, t = _data(13, 300, 24, 200)
    w = _class_weights(200)
    options = LinearCrossEntropyOptions(batch_chunk_size=96)
    terms = dict(z_loss=1e-2, scale=1.3, temperature=0.8)

    def ours():
        xs, Ws = _leaves((x, W), torch.float32)
        with torch.no_grad():
            out = linear_ce.linear_cross_entropy(
                xs, Ws, t, weight=w.float(), reduction="none", return_lse=True,
                z_loss=terms["z_loss"], logit_scale=terms["scale"],
                temperature=terms["temperature"], options=options,
            )  # fmt: skip
        return [out.loss, out.lse]

    results, counts = _both_paths(monkeypatch, torch.float32, ours, grads=False)
    assert counts["1"]["stats"] >= 3 and counts["1"]["fused"] == 0, counts
    assert seen == {layout == "class-major"}
    exact = list(_ce_rows(x, W, t, w, **terms)[:2])
    same = list(_ce_rows(x.float(), W.float(), t, w, **terms)[:2])
    for mode, got in results.items():
        assert torch.equal(got[0][t == -100], torch.zeros(int((t == -100).sum())))
        _check(got, exact, same, torch.float32, f"fp32 forward {layout} {mode}")


def _fp32_call(kind, x, W, t, options):
    """One fp32 public call the loops must leave to the torch operations: its outputs."""
    xs, Ws = _leaves((x, W), torch.float32)
    gen = torch.Generator().manual_seed(6)
    up_lp, up_h = torch.randn(2, x.shape[0], generator=gen)
    if kind == "token_logprobs":
        out = linear_ce.token_logprobs(xs, Ws, t, entropy=True, options=options)
        return [out.logprob, out.entropy]
    if kind == "token_logprobs_vjp":
        return list(linear_ce.token_logprobs_vjp(xs, Ws, t, up_lp, up_h, options=options)[:2])
    kwargs = {
        "cross_entropy": {},
        "cross_entropy smoothing": dict(label_smoothing=0.1),
        "cross_entropy bias": dict(linear_bias=torch.randn(W.shape[0], generator=gen)),
        "cross_entropy softcap": dict(softcap=5.0),
    }[kind]
    loss = linear_ce.linear_cross_entropy(xs, Ws, t, options=options, **kwargs)
    return [loss, *torch.autograd.grad(loss, [xs, Ws])]


_FP32_TORCH_ONLY = [
    "token_logprobs",
    "token_logprobs_vjp",
    "cross_entropy smoothing",
    "cross_entropy bias",
    "cross_entropy softcap",
]


@pytest.mark.parametrize("layout", ["class-major", "row-major"])
@pytest.mark.parametrize("kind", _FP32_TORCH_ONLY)
def test_fp32_calls_the_loops_leave_take_the_torch_operations(kind, layout, monkeypatch):
    """fp32 calls whose head keeps torch's operations on fp32 tiles (token log-probs and
    their vjp) or whose options the loops cannot do (label smoothing, a bias, a softcap):
    with ``LINEAR_CE_NATIVE_ROWS=1`` too the torch operations, the same bits as with ``=0``;
    the plain cross-entropy call (the control) takes the loops."""
    _need_compiler()
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    monkeypatch.setenv(TILE_LAYOUT_ENV, layout)
    x, W, t = _data(2, 60, 8, 90)
    options = LinearCrossEntropyOptions(batch_chunk_size=24)
    calls = _counting(monkeypatch)
    results = []
    for mode in ("0", "1"):
        monkeypatch.setenv(ENV, mode)
        results.append(_fp32_call(kind, x, W, t, options))
    assert calls == {"stats": 0, "grad": 0, "fused": 0}
    for off, on in zip(*results, strict=True):
        assert torch.equal(off, on)
    _fp32_call("cross_entropy", x, W, t, options)
    assert calls["fused"] > 0


@pytest.mark.parametrize("layout", ["class-major", "row-major"])
def test_fp32_cross_entropy_first_classes_masked(layout, monkeypatch):
    """The public face of test_first_block_masked: fp32 linear_cross_entropy whose classes
    0..63 have -inf weights (their logits -inf for positive features): the per-row losses
    and lse on the loops' path as on the torch operations' (finite, as torch's)."""
    _need_compiler()
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    monkeypatch.setenv(TILE_LAYOUT_ENV, layout)
    gen = torch.Generator().manual_seed(47)
    x = torch.rand(8, 4, generator=gen) + 0.1
    W = torch.randn(100, 4, generator=gen)
    W[:64] = -math.inf
    t = torch.randint(64, 100, (8,), generator=gen)
    calls = _counting(monkeypatch)
    results = []
    for mode in ("0", "1"):
        monkeypatch.setenv(ENV, mode)
        with torch.no_grad():
            out = linear_ce.linear_cross_entropy(x, W, t, reduction="none", return_lse=True)
        results.append(torch.stack([out.loss, out.lse]))
    plain = F.cross_entropy(x.double() @ W.double().T, t, reduction="none")
    assert calls["stats"] > 0 and results[0].isfinite().all()
    # The per-row losses at the house bound (the torch operations' fp32 losses as the
    # plain same-dtype expression).
    _check([results[1][0]], [plain], [results[0][0]], torch.float32, f"masked {layout}")


# The vocabulary pass (token_logprobs' backward): grad_ on fp32 blocks in either layout.


@settings(deadline=None)
@given(
    rows=st.sampled_from([1, 15, 16, 17, 40]),
    classes=st.one_of(st.integers(1, 70), st.integers(64, 900)),
    targets=st.sampled_from(["all", "some", "none_owned", "absent"]),
    with_b=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(rows=17, classes=65, targets="some", with_b=True, seed=3)
def test_class_major_grad_against_float64(rows, classes, targets, with_b, seed):
    """grad_ on a class-major fp32 tile (a column slice of a wider (V, B) buffer: its class
    stride is the buffer's rows) at _check_grad's bound, the buffer's other columns
    untouched; the row-major copy of the tile agrees to a few ulps (the target column's
    sum may be fused into one rounding on one layout and not the other)."""
    loops = _loops(torch.float32)
    _, tile = _tile(rows, classes, torch.float32, 3.0, seed, 0)
    buffer = torch.full((classes, rows + 5), math.nan)
    buffer[:, :rows] = tile.T
    major = buffer[:, :rows].T
    assert loops.class_major(major)
    target = _targets(rows, classes, seed, targets)
    m = loops.stats(tile).row_max
    a, b, mu, gamma = _row_vectors(rows, seed, with_b)
    exact = _grad_formula(tile, m, a, b, mu, target, gamma, 1.0, torch.float64)
    same = _grad_formula(tile, m, a, b, mu, target, gamma, 1.0, torch.float32)
    gamma = None if target is None else gamma
    row_major = tile.clone()
    loops.grad_(row_major, m, a, b=b, mu=mu, target=target, gamma=gamma)
    loops.grad_(major, m, a, b=b, mu=mu, target=target, gamma=gamma)
    # _check_grad's bound (its reasons there).
    bound = max(3 * eps(torch.float32), 2 * rel_err(same, exact))
    err = rel_err(major, exact)
    assert err <= bound, f"class-major grad: {err:.3g} > {bound:.3g}"
    assert rel_err(major, row_major.double()) <= 3 * eps(torch.float32)
    assert buffer[:, rows:].isnan().all()


def _logprob_entropy_loss(logprob, entropy, up_lp, up_h, flows, dtype):
    """Σ up_lp·log p + Σ up_h·H, the terms ``flows`` names (``both``, ``logprob``,
    ``entropy``): the upstream gradients of token_logprobs' outputs."""
    loss = 0.0
    if flows != "entropy":
        loss = loss + (logprob * up_lp.to(dtype)).sum()
    if flows != "logprob":
        loss = loss + (entropy * up_h.to(dtype)).sum()
    return loss


@pytest.mark.parametrize("layout", ["class-major", "row-major"])
@pytest.mark.parametrize("flows", ["both", "logprob", "entropy"])
def test_fp32_vocabulary_pass_both_paths(layout, flows, monkeypatch):
    """token_logprobs' backward (the vocabulary pass, TokenLogprobGradient.grad_block) in
    fp32 on both paths, each tile layout, against float64 at the house bound; under
    LINEAR_CE_NATIVE_ROWS=1 its blocks go to grad_, under 0 to torch's operations."""
    _need_compiler()
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    monkeypatch.setenv(TILE_LAYOUT_ENV, layout)
    x, W, t = _data(9, 300, 16, 700)
    gen = torch.Generator().manual_seed(10)
    up_lp, up_h = torch.randn(2, x.shape[0], generator=gen, dtype=torch.float64)
    options = LinearCrossEntropyOptions(batch_chunk_size=64)

    def loss_of(logprob, entropy, dtype):
        return _logprob_entropy_loss(logprob, entropy, up_lp, up_h, flows, dtype)

    def run(dtype):
        xs, Ws = _leaves((x, W), dtype)
        out = linear_ce.token_logprobs(xs, Ws, t, entropy=True, options=options)
        return list(torch.autograd.grad(loss_of(out.logprob, out.entropy, dtype), [xs, Ws]))

    def plain(dtype):
        xs, Ws = _leaves((x, W), dtype)
        logp = F.log_softmax(xs @ Ws.T, dim=-1)
        valid = t != -100
        logprob = torch.where(valid, logp.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
        entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
        return list(torch.autograd.grad(loss_of(logprob, entropy, dtype), [xs, Ws]))

    calls = _counting(monkeypatch)
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(ENV, mode)
        calls.update(stats=0, grad=0, fused=0)
        results[mode] = run(torch.float32)
        # fp32 token_logprobs' forward keeps torch's operations; its backward's blocks
        # take the loops.
        expected = {"stats": 0, "grad": 0, "fused": 0} if mode == "0" else None
        if expected:
            assert calls == expected, calls
        else:
            assert calls["grad"] > 0 and calls["stats"] == calls["fused"] == 0, calls
    exact, same = plain(torch.float64), plain(torch.float32)
    assert rel_err(run(torch.float64)[0], exact[0]) <= 1e-12
    for mode, got in results.items():
        _check(got, exact, same, torch.float32, f"vocabulary pass {layout} {flows} {mode}")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("flows", ["both", "logprob", "entropy"])
@pytest.mark.parametrize("case", ["plain", "scaled", "bias", "softcap"])
@pytest.mark.parametrize("group_rows", [64, 512], ids=["groups", "one-group"])
def test_half_vocabulary_pass_both_paths(dtype, flows, case, group_rows, monkeypatch):
    """token_logprobs' backward on half inputs with native half GEMMs: under
    LINEAR_CE_NATIVE_ROWS=1 the vocabulary pass takes half blocks (the loops' grad_ on
    row-major tiles of the input dtype, the transform's factor applied by the loops), or,
    with a bias or a softcap, fp32 blocks; under 0 torch's operations on fp32 blocks; both
    against float64 at the house bound. Rows in groups of 64 (each block's weight gradient
    summed over groups) and in one group (written by its GEMM into the result)."""
    if not native_half_gemm(dtype, CPU):
        pytest.skip(f"this CPU has no native {dtype} GEMMs (no half blocks)")
    _need_compiler()
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    x, W, t = _data(11, 300, 16, 700)
    gen = torch.Generator().manual_seed(12)
    up_lp, up_h = torch.randn(2, x.shape[0], generator=gen, dtype=torch.float64)
    bias = torch.randn(700, generator=gen, dtype=torch.float64) / 4 if case == "bias" else None
    transform = {
        "plain": {}, "bias": {}, "scaled": dict(logit_scale=1.2, temperature=0.9),
        "softcap": dict(softcap=5.0),
    }[case]  # fmt: skip
    options = LinearCrossEntropyOptions(batch_chunk_size=group_rows)

    def loss_of(logprob, entropy, dt):
        return _logprob_entropy_loss(logprob, entropy, up_lp, up_h, flows, dt)

    def run():
        xs, Ws = _leaves((x, W), dtype)
        b = None if bias is None else bias.to(dtype)
        out = linear_ce.token_logprobs(
            xs, Ws, t, entropy=True, linear_bias=b, options=options, **transform
        )
        return list(torch.autograd.grad(loss_of(out.logprob, out.entropy, dtype), [xs, Ws]))

    def plain(dt):
        xs, Ws = _leaves((x, W), dt)
        ids = torch.zeros_like(t)
        b = None if bias is None else bias.to(dt)
        lp, ent, _ = seqref.token_terms(xs, Ws, b, t, ids, **transform)
        return list(torch.autograd.grad(loss_of(lp, ent, dt), [xs, Ws]))

    calls = _counting(monkeypatch)
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(ENV, mode)
        calls.update(stats=0, grad=0, fused=0, tiles=set())
        results[mode] = run()
        tiles = calls.pop("tiles")
        if mode == "0":
            assert calls == {"stats": 0, "grad": 0, "fused": 0}, calls
        else:
            assert calls["grad"] > 0, calls
            # A bias or a softcap keeps the forward on torch's operations, the blocks fp32.
            fp32_blocks = case in ("bias", "softcap")
            assert tiles == ({torch.float32} if fp32_blocks else {dtype}), tiles
    exact, same = plain(torch.float64), plain(dtype)
    for mode, got in results.items():
        # 4 eps: the entropy's gradient (as test_token_logprobs_both_paths).
        what = f"half vocabulary pass {case} {flows} {group_rows} {mode}"
        _check(got, exact, same, dtype, what, floor=4)


# The pair loops (pair_: a distillation loss's student and teacher tiles in one visit of
# each row), every tile layout, against float64 written here.

#: A pair_ call's hard term: ``(target kind, hard weight, power)``. The target alone (no
#: weight) still asks for u_t; ``power > 0`` gives the hard term its own normaliser Z_1.
_PAIR_HARD = {
    "none": ("absent", 0.0, 0.0),
    "target-only": ("some", 0.0, 0.0),
    "hard": ("some", 0.7, 0.0),
    "hard-all": ("all", 0.7, 0.0),
    "hard-power": ("some", 0.7, 2.0),
    "hard-power-half": ("all", 0.4, 0.5),
    "hard-power-none-owned": ("none_owned", 0.7, 1.5),
}


def _pair_tiles(layout, rows, classes, spread, seed, pads):
    """``(student_outside, student, teacher_outside, teacher)``: tiles of ``layout``, each a
    slice of its own wider NaN buffer (``pads``: the student's and the teacher's extra
    columns, so their row or class strides differ)."""
    s_out, s = _layout_tile(layout, rows, classes, spread, seed, pads[0])
    t_out, t = _layout_tile(layout, rows, classes, spread, seed + 1000, pads[1])
    return s_out, s, t_out, t


def _pair_formula(s, t, cs, ct, reverse, target, hard, power, w, dtype, ms=None, mt=None):
    r"""Everything a pair_ call forms, written out in ``dtype`` math (float64: the exact
    value; float32: torch's plain expression on the same fp32 logits), from the student's
    ``s`` and teacher's ``t`` tiles: with ``a = s·c_s``, ``b = t·c_t``, ``u = a − m_s``,
    ``v = b − m_t`` (``ms``, ``mt``: those maxima, default the rows' own), the sums
    (Zs, Zt, C, E, Z1, u_t), the divergence, the student's entropy, the hard term's
    cross-entropy at temperature 1 (``T' = power`` or 1: ``log Z1 − T' u_t``, Z1 = Zs
    where ``power`` is 0) and, with ``w``, the gradient with respect to ``a`` of
    ``w · (divergence + hard · CE)``: ``p − q`` (forward), ``p (u − v − μ)`` (reverse,
    ``μ = C/Zs``), plus ``hard · T' (softmax(T' a) − onehot(target))``, where a target of
    -1 (another shard's) has no one-hot term. A product with a factor eᵘ or eᵛ that is 0
    is 0 (a masked class: the limit, not 0·inf)."""
    a = s.to(dtype) * torch.tensor(_fp32(cs), dtype=dtype)
    b = t.to(dtype) * torch.tensor(_fp32(ct), dtype=dtype)
    ms = a.amax(1) if ms is None else ms.to(dtype)
    mt = b.amax(1) if mt is None else mt.to(dtype)
    u, v = a - ms[:, None], b - mt[:, None]
    eu, ev = u.exp(), v.exp()
    zs, zt = eu.sum(1), ev.sum(1)
    if reverse:
        c = torch.where(eu == 0, 0.0, eu * (u - v)).sum(1)
        divergence = c / zs - zs.log() + zt.log()
    else:
        c = torch.where(ev == 0, 0.0, ev * (v - u)).sum(1)
        divergence = c / zt - zt.log() + zs.log()
    # The divergence as the plain expression forms it too: Σ (softmax) (log-softmax
    # difference), the larger of the two plain errors bounds (a plain form can be lucky).
    ls, lt = a.log_softmax(1), b.log_softmax(1)
    if reverse:
        softmax_form = torch.where(eu == 0, 0.0, ls.exp() * (ls - lt)).sum(1)
    else:
        softmax_form = torch.where(ev == 0, 0.0, lt.exp() * (lt - ls)).sum(1)
    e = torch.where(eu == 0, 0.0, eu * u).sum(1)
    tpow = power if power > 0 else 1.0
    e1 = (power * u).exp() if power > 0 else eu
    z1 = e1.sum(1)
    owned = target >= 0 if target is not None else torch.zeros(len(s), dtype=torch.bool)
    safe = (target if target is not None else torch.zeros(len(s), dtype=torch.long)).clamp(min=0)
    ut = torch.where(owned, u.gather(1, safe[:, None])[:, 0], 0.0)
    out = dict(
        zs=zs, zt=zt, cross=c, dot=e, z1=z1 if power > 0 else torch.zeros_like(zs), ut=ut,
        divergence=divergence, entropy=zs.log() - e / zs, ce=z1.log() - tpow * ut,
        softmax_form=softmax_form,
    )  # fmt: skip
    # The scales of the values whose terms cancel (see _check_pair), in units of their
    # terms' relative rounding: u = x·c − m carries up to |x·c| + |u| of it (x·c rounded
    # to fp32 first, as in torch's plain expression; then the difference), so eᵘ that as a
    # relative error, a sum of eᵘ its p-weighted mean (rel_s; a log takes it as an
    # absolute one), a product e^v (v − u) both factors' (C's terms).
    ru, rv = a.abs() + u.abs(), b.abs() + v.abs()
    p, q = eu / zs[:, None], ev / zt[:, None]
    rel_s = 1 + torch.where(eu == 0, 0.0, p * ru).sum(1)
    rel_t = 1 + torch.where(ev == 0, 0.0, q * rv).sum(1)
    f, z = (eu, zs) if reverse else (ev, zt)
    cross_terms = f * ((u - v).abs() * (1 + (ru if reverse else rv)) + ru + rv)
    out["cross_scale"] = torch.where(f == 0, 0.0, cross_terms).sum(1)
    out["divergence_scale"] = (out["cross_scale"] + c.abs()) / z + rel_s + rel_t
    u_terms = torch.where(eu == 0, 0.0, p * (1 + u.abs()) * ru).sum(1)
    out["entropy_scale"] = u_terms + e.abs() / zs + rel_s
    p1 = e1 / z1[:, None]
    rel_1 = 1 + tpow * torch.where(e1 == 0, 0.0, p1 * ru).sum(1)
    ru_t = torch.where(owned, ru.gather(1, safe[:, None])[:, 0], 0.0)
    out["ce_scale"] = tpow * ru_t + rel_1
    if w is not None:
        if reverse:
            mu = (c / zs)[:, None]
            g = torch.where(eu == 0, 0.0, p * (u - v - mu))
            gap = ((u - v).abs() + mu.abs()) * (1 + ru + rel_s[:, None]) + ru + rv + mu.abs()
            g_scale = torch.where(eu == 0, 0.0, p * gap)
        else:
            g = p - q
            g_scale = p * (1 + ru + rel_s[:, None]) + q * (1 + rv + rel_t[:, None])
        g = g + hard * tpow * p1
        g_scale = g_scale + hard * tpow * p1 * (1 + tpow * ru + rel_1[:, None])
        rows = torch.arange(len(s))[owned]
        g[rows, safe[owned]] -= hard * tpow
        g_scale[rows, safe[owned]] += hard * tpow
        out["grad"] = g * w.to(dtype)[:, None]
        out["grad_scale"] = g_scale * w.abs().to(dtype)[:, None]
    return out


def _raises(a: torch.Tensor) -> int:
    """The most times a row's running max over blocks of 64 classes grows past the first
    block (the class-major loops rescale their sums then)."""
    blocks = torch.stack([part.amax(1) for part in a.double().split(64, dim=1)], 1)
    running = blocks.cummax(1).values
    return int((running[:, 1:] > running[:, :-1]).sum(1).max()) if blocks.shape[1] > 1 else 0


def _online(class_major: bool, s, t, cs: float, ct: float) -> float:
    """3 eps(fp32), the sums' bound, and on class-major tiles 3 eps(fp32) more per raise of
    the student's and the teacher's running maxima (see _check_pair)."""
    if not class_major:
        return 3 * eps(torch.float32)
    raises = _raises(s.double() * _fp32(cs)) + _raises(t.double() * _fp32(ct))
    return 3 * eps(torch.float32) * (1 + raises)


def _norm_ratio(scale: torch.Tensor, value: torch.Tensor) -> float:
    """``‖scale‖ / ‖value‖``: how far a value formed from terms of these magnitudes
    amplifies their rounding (its condition)."""
    return (scale.double().norm() / value.double().norm()).item()


def _pair_call(loops, s, t, case, w):
    target, hard, power = case["target"], case["hard"], case["power"]
    return loops.pair_(
        s, t, student_scale=case["cs"], teacher_scale=case["ct"], beta=float(case["reverse"]),
        entropy=case["entropy"], target=target, hard=hard, power=power, weight=w,
    )  # fmt: skip


def _pair_sums(got) -> dict:
    """pair_'s sums by :func:`_pair_formula`'s names."""
    zs, zt, c = got.sum_exp, got.teacher_sum_exp, got.cross
    return dict(zs=zs, zt=zt, cross=c, dot=got.dot, z1=got.z_1, ut=got.target_u)


def _pair_derived(got, reverse, power) -> dict:
    """What a head forms from pair_'s sums (the divergence, the entropy, the hard term's
    cross-entropy), in float64, so that only the loops' sums carry an error."""
    zs, zt, c = (x.double() for x in (got.sum_exp, got.teacher_sum_exp, got.cross))
    z_div, z_other = (zs, zt) if reverse else (zt, zs)
    divergence = c / z_div - z_div.log() + z_other.log()
    z1 = got.z_1.double() if power > 0 else zs
    tpow = power if power > 0 else 1.0
    return dict(
        divergence=divergence,
        entropy=zs.log() - got.dot.double() / zs,
        ce=z1.log() - tpow * got.target_u.double(),
    )


def _check_pair(loops, layout, s, t, s_out, case, w):
    """pair_ on ``s``, ``t`` against float64: the maxima exact; every sum and what a head
    forms from them (divergence, entropy, hard cross-entropy) at fp32's bound; the
    gradient (with ``w``) at the tile's; the teacher's tile and everything past the
    student's untouched. Returns the sums."""
    dtype, cm = _FUSED_LAYOUTS[layout]
    x, teacher = s.clone(), t.clone()
    args = (case["cs"], case["ct"], case["reverse"], case["target"], case["hard"], case["power"])
    got = _pair_call(loops, s, t, case, w)
    assert torch.equal(t, teacher), "pair_ wrote over the teacher's tile"
    assert s_out.isnan().all(), "pair_ wrote past the student's tile"
    exact = _pair_formula(x, t, *args, w, torch.float64)
    # The maxima are exact: x (a bf16/fp16/fp32 value) times an fp32 scale is exact in
    # float64, the fp32 product its one rounding (as in _check_stats).
    exact_max = (x.double() * _fp32(case["cs"])).amax(1).float()
    assert torch.equal(got.row_max, exact_max)
    assert torch.equal(got.teacher_max, (t.double() * _fp32(case["ct"])).amax(1).float())
    # The sums relative to the loops' maxima, which the head's lse adds back.
    at = _pair_formula(x, t, *args, None, torch.float64, got.row_max, got.teacher_max)
    same = _pair_formula(x, t, *args, w, torch.float32, exact_max, got.teacher_max)
    # Class-major: each block of 64 classes that raises a row's max multiplies the sums
    # so far by e^(−Δm) (an exp within 2 ulp, and one rounding): 3 eps(fp32) more per raise
    # of the student's and the teacher's maxima (HYPOTHESIS_PROFILE=long: Zs 3.5 eps over
    # one row of 1340 classes, spread 10).
    online = _online(cm, x, t, case["cs"], case["ct"])
    checks = [(k, v, at[k], same[k]) for k, v in _pair_sums(got).items()]
    checks += [(k, v, exact[k], same[k]) for k, v in _pair_derived(got, *args[2:6:3]).items()]
    for name, value, want, plain in checks:
        if name == "dot" and not case["entropy"]:
            assert (value == 0).all(), name
            continue
        if (name == "entropy" and not case["entropy"]) or (name == "ce" and case["target"] is None):
            continue
        if name == "ut" and case["target"] is None:
            assert (value == 0).all(), name
            continue
        if name == "z1" and case["power"] == 0:
            assert (value == 0).all(), name
            continue
        rows = slice(None)
        if name == "ce":
            # The cross-entropy where the row's target is here (log Z alone, without its
            # max, is not the same number for another max).
            rows = case["target"] >= 0
            if not rows.any():
                continue
        # fp32 sums of fp32 exponentials of u = x·c − m (and what the head forms of them):
        # 3 eps(fp32), or twice torch's own fp32 expression's error (the divergence's: the
        # larger of its two plain forms). Where a value's terms cancel or a log takes a sum
        # near 1 (C = Σ e^v (v − u); the divergence C/Zt − log Zt + log Zs, small where the
        # two softmaxes are near; entropy and cross-entropy near 0 where the softmax is
        # peaked, log Z ≈ 0 holding Z's relative rounding as an absolute one), each term
        # keeps its own rounding, not the value's: 3 eps(fp32) of the norm of the terms'
        # magnitudes (_pair_formula's scales). The plain error alone was not enough: one row
        # of 2 classes, the divergence 4.3e-7 where the plain expression's was 1.8e-7; one
        # peaked row of 64 classes, the entropy 6.2e-7 where the plain's was 1.8e-7.
        value, want, plain = value[rows], want[rows], plain[rows]
        bound = max(online, 2 * rel_err(plain, want))
        if name == "divergence":
            bound = max(bound, 2 * rel_err(same["softmax_form"], want))
        if name in ("cross", "divergence", "entropy", "ce"):
            scale = (at if name == "cross" else exact)[f"{name}_scale"][rows]
            bound = max(bound, online * _norm_ratio(scale, want))
        err = rel_err(value, want)
        assert err <= bound, f"pair {layout} {name}: {err:.3g} > {bound:.3g}"
    if w is not None:
        # As _check_grad: the exact gradient rounded once to the tile's dtype, within
        # twice that rounding's error, 3 eps of the dtype, or twice torch's plain fp32
        # expression rounded to the dtype; where the gradient's terms cancel (p − q, the
        # reverse p (u − v − μ), the hard term's −hT' at the target), 3 eps(fp32) of the
        # norm of their magnitudes, as the sums above.
        g, plain = exact["grad"], same["grad"].to(dtype)
        bound = max(3 * eps(dtype), 2 * rel_err(g.to(dtype), g), 2 * rel_err(plain, g))
        bound = max(bound, online * _norm_ratio(exact["grad_scale"], g))
        err = rel_err(s, g)
        assert err <= bound, f"pair {layout} grad: {err:.3g} > {bound:.3g}"
    else:
        assert torch.equal(s, x), "pair_ without a weight wrote a gradient"
    return got


@st.composite
def _pair_cases(draw):
    return dict(
        # 16 rows to a class-major vector and a thread's share: fewer, more, not multiples.
        rows=draw(st.one_of(st.sampled_from([1, 15, 17, 40]), st.integers(1, 40))),
        # Fewer than the 64 partial sums (row-major) or a block of 64 classes (class-major),
        # and not multiples of 64.
        classes=draw(st.one_of(st.integers(1, 70), st.integers(64, 2000))),
        pads=draw(st.sampled_from([(0, 0), (3, 64), (64, 5)])),
        cs=draw(st.sampled_from([1.0, 0.5, 1 / 0.7])),
        ct=draw(st.sampled_from([1.0, 0.8, 1 / 0.7])),
        spread=draw(st.sampled_from([0.3, 3.0, 10.0])),
        reverse=draw(st.booleans()),
        entropy=draw(st.booleans()),
        hard=draw(st.sampled_from(list(_PAIR_HARD))),
        weight=draw(st.booleans()),
        threads=draw(st.sampled_from([1, 2])),
        seed=draw(st.integers(0, 2**16)),
    )


def _pair_case(case, rows, classes):
    """The call's arguments of a drawn case: its target, hard weight and power."""
    kind, hard, power = _PAIR_HARD[case["hard"]]
    target = None if kind == "absent" else _targets(rows, classes, case["seed"], kind)
    return {**case, "target": target, "hard": hard, "power": power}


_PAIR_EDGE = dict(
    rows=37, classes=129, pads=(3, 64), cs=1 / 0.7, ct=0.8, spread=10.0, reverse=True,
    entropy=True, hard="hard-power", weight=True, threads=2, seed=5,
)  # fmt: skip


@pytest.mark.parametrize("layout", list(_FUSED_LAYOUTS))
@settings(max_examples=max(1, settings().max_examples // 2))
@given(case=_pair_cases())
@example(case=_PAIR_EDGE)
@example(case={**_PAIR_EDGE, "reverse": False, "hard": "hard"})
@example(case={**_PAIR_EDGE, "rows": 17, "classes": 63, "hard": "hard-all", "pads": (0, 0)})
@example(case={**_PAIR_EDGE, "rows": 1, "classes": 1, "hard": "none", "entropy": False})
@example(case={**_PAIR_EDGE, "classes": 1000, "hard": "hard-power-half", "reverse": False})
# Found by HYPOTHESIS_PROFILE=long: class-major Zs 3.5 eps (its rescalings; see _check_pair).
@example(
    case={**_PAIR_EDGE, "rows": 1, "classes": 1340, "pads": (0, 0), "cs": 1.0, "ct": 1.0,
          "reverse": False, "entropy": False, "hard": "none", "weight": False, "threads": 1,
          "seed": 45400}
)  # fmt: skip
def test_pair_against_float64(layout, case):
    """pair_ (forward and reverse KL, the entropy's sum or not, the hard term with and
    without its own normaliser, some targets -1, a weight or none) for bf16, fp16, fp32
    row-major tiles and fp32 class-major ones, slices of wider buffers with different
    strides for the student and the teacher, rows split over 1 or 2 threads: the maxima
    exact, sums and what a head forms from them at fp32's bound, the gradient at the
    tile's."""
    dtype, class_major = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    rows, classes = case["rows"], case["classes"]
    s_out, s, _, t = _pair_tiles(layout, rows, classes, case["spread"], case["seed"], case["pads"])
    if classes > 1:  # one class: a row-major tile's row stride is 1 as well (either way)
        assert loops.class_major(s) == class_major == loops.class_major(t)
    call = _pair_case(case, rows, classes)
    w = torch.randn(rows, generator=torch.Generator().manual_seed(case["seed"] + 7))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(case["threads"])
        _check_pair(loops, layout, s, t, s_out, call, w if case["weight"] else None)
    finally:
        torch.set_num_threads(before)


def _copy_in_layout(tile: torch.Tensor) -> torch.Tensor:
    """A copy of ``tile`` in its layout (``clone`` makes a row-major copy of a class-major
    slice of a wider buffer)."""
    return tile.T.contiguous().T if tile.stride(0) == 1 else tile.clone()


def _pair_args(reverse: bool = False, **change) -> dict:
    """A pair_ call's keyword arguments: forward KL (``reverse``: reverse KL), entropy."""
    args = dict(student_scale=1.0, teacher_scale=1.0, beta=float(reverse), entropy=True)
    return args | change


@pytest.mark.parametrize("layout", list(_FUSED_LAYOUTS))
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_pair_masked_student_classes(layout, reverse):
    """Student classes masked (-inf): where the teacher has mass there too the forward KL
    is +inf (as the plain expression's), the reverse KL its finite limit (p = 0 there adds
    nothing); where the teacher's same classes are masked both are finite; the entropy
    finite. The gradient on masked classes is 0 where p and q both are (reverse: wherever
    p is, the limit of p·(u − v − μ)), else the forward KL's −w·q; every other value at the
    bound of test_pair_against_float64. A whole block of 64 masked, not the first; and the
    first (the class-major kernel's first block)."""
    dtype, class_major = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    rows, classes = 20, 150
    s_out, s, _, t = _pair_tiles(layout, rows, classes, 3.0, 47, (3, 5))
    s[0, ::3] = -math.inf  # the teacher has mass there: forward KL +inf
    s[2, 70:] = -math.inf
    s[18, 64:128] = -math.inf
    s[19, :64] = -math.inf
    for i in (2, 18, 19):  # the teacher masked where the student is: both finite
        t[i][s[i].isinf()] = -math.inf
    target = _targets(rows, classes, 47, "some")
    target[:3] = torch.tensor([1, 5, 3])
    masked = s.isinf()
    w = torch.randn(rows, generator=torch.Generator().manual_seed(47))
    x = s.clone()
    online = _online(class_major, x, t, 1.0, 1.0)
    got = loops.pair_(s, t, **_pair_args(reverse=reverse), target=target, hard=0.5, weight=w)
    assert s_out.isnan().all() and not s.isnan().any()
    divergence = _pair_derived(got, reverse, 0.0)["divergence"]
    if reverse:
        assert divergence.isfinite().all()
    else:
        assert divergence[0] == math.inf and divergence[1:].isfinite().all()
    assert got.dot.isfinite().all() and got.sum_exp.isfinite().all()
    exact = _pair_formula(x, t, 1.0, 1.0, reverse, target, 0.5, 0.0, w, torch.float64)
    teacher_mass = (t.double() - t.double().amax(1, keepdim=True)).exp() > 0
    # A masked target's gradient is the hard term's one-hot alone: −w·h.
    owned = target >= 0
    at_target = torch.zeros_like(masked)
    at_target[torch.arange(rows)[owned], target[owned]] = True
    hit = masked & at_target
    assert hit.any()
    assert torch.equal(s[hit], (-0.5 * w[hit.nonzero()[:, 0]]).to(dtype))
    assert (s[masked & ~teacher_mass & ~at_target] == 0).all()
    if reverse:
        assert (s[masked & ~at_target] == 0).all()
    # The rows of finite outputs at the house bound, the gradient everywhere (a +inf
    # divergence's gradient is finite, the float64 limit).
    finite = divergence.isfinite()
    want = exact["divergence"][finite]
    bound = max(online, online * _norm_ratio(exact["divergence_scale"][finite], want))
    # (as _check_pair's divergence)
    assert rel_err(divergence[finite], want) <= bound
    g = exact["grad"]
    assert g.isfinite().all()
    bound = max(
        3 * eps(dtype),
        2 * rel_err(g.to(dtype), g),
        online * _norm_ratio(exact["grad_scale"], g),
    )  # as _check_pair's gradient
    assert rel_err(s, g) <= bound


@pytest.mark.parametrize("layout", list(_FUSED_LAYOUTS))
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_pair_nan_logit(layout, reverse):
    """A NaN logit, in the student's tile (row 1) or the teacher's (row 18), makes every
    sum and the whole gradient of its row NaN; the other rows (both sides of a 16-row
    boundary) are the bits of the same call without those rows' NaN."""
    dtype, _ = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    rows, classes = 20, 100
    s_out, s, _, t = _pair_tiles(layout, rows, classes, 2.0, 53, (3, 0))
    clean_s, clean_t = _copy_in_layout(s), _copy_in_layout(t)
    s[1, 40] = math.nan
    t[18, 99] = math.nan
    bad = torch.zeros(rows, dtype=torch.bool)
    bad[[1, 18]] = True
    target = _targets(rows, classes, 53, "all")
    w = torch.randn(rows, generator=torch.Generator().manual_seed(53))
    kwargs = _pair_args(reverse=reverse) | dict(target=target, hard=0.5, power=2.0, weight=w)
    got = loops.pair_(s, t, **kwargs)
    clean = loops.pair_(clean_s, clean_t, **kwargs)
    for name in ("row_max", "sum_exp", "teacher_max", "teacher_sum_exp", "cross", "dot", "z_1"):
        value = getattr(got, name)
        assert torch.equal(value.isnan(), bad), name
        assert torch.equal(value[~bad], getattr(clean, name)[~bad]), name
    assert got.target_u[bad].isnan().all()
    assert torch.equal(got.target_u[~bad], clean.target_u[~bad])
    assert s[bad].isnan().all() and torch.equal(s[~bad], clean_s[~bad])
    assert s_out.isnan().all()


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("rows, classes", [(17, 130), (40, 1000), (5, 50)])
def test_pair_layouts_agree(reverse, rows, classes):
    """pair_ on fp32 class-major tiles and on the same values row-major: the same maxima,
    sums and gradient to rounding."""
    loops = _loops(torch.float32)
    _, s, _, t = _pair_tiles("f32-class-major", rows, classes, 4.0, 59, (3, 7))
    rs, rt = (a.clone(memory_format=torch.contiguous_format) for a in (s, t))
    assert not loops.class_major(rs) and loops.class_major(s)
    x = rs.clone()
    # Each layout within its bound of the exact values (_check_pair), so within their sum
    # of each other: class-major's counts its rescalings.
    both = _online(False, x, rt, 1 / 0.7, 0.8) + _online(True, x, rt, 1 / 0.7, 0.8)
    target = _targets(rows, classes, 59, "some")
    w = torch.randn(rows, generator=torch.Generator().manual_seed(59))
    kwargs = _pair_args(reverse=reverse, student_scale=1 / 0.7, teacher_scale=0.8)
    kwargs |= dict(target=target, hard=0.5, power=1.5, weight=w)
    row_major = loops.pair_(rs, rt, **kwargs)
    class_major = loops.pair_(s, t, **kwargs)
    for name in ("row_max", "teacher_max"):
        assert torch.equal(getattr(class_major, name), getattr(row_major, name)), name
    args = (1 / 0.7, 0.8, reverse, target, 0.5, 1.5, w, torch.float64)
    at = _pair_formula(x, rt, *args, row_major.row_max, row_major.teacher_max)
    sums = (("sum_exp", "zs"), ("teacher_sum_exp", "zt"), ("dot", "dot"), ("z_1", "z1"))
    for name, key in (*sums, ("cross", "cross")):
        # Summed in another order (class-major: per block of 64 classes, rescaled as the
        # max grows): each within its bound of the exact sum, relative to its terms'
        # magnitudes where they cancel (C; test_pair_against_float64).
        bound = both * (_norm_ratio(at["cross_scale"], at[key]) if name == "cross" else 1)
        err = rel_err(getattr(class_major, name), getattr(row_major, name))
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"
    # u_t = x·c − m: each within an ulp of |x·c| (as test_fused_agrees_with_stats_and_grad).
    assert rel_err(class_major.target_u, row_major.target_u) <= 4 * eps(torch.float32)
    # The gradients: each within test_pair_against_float64's bound of the exact one.
    g = at["grad"]
    assert rel_err(s, rs) <= both * max(1, _norm_ratio(at["grad_scale"], g))


def test_pair_layout_mismatch_is_an_error():
    """The two tiles of a pair_ call in different layouts (one class-major, one not), or of
    different shapes: a ValueError naming the call, not a read at the wrong strides."""
    loops = _loops(torch.float32)
    _, s, _, t = _pair_tiles("f32-class-major", 17, 130, 3.0, 61, (0, 0))
    row_major = t.clone(memory_format=torch.contiguous_format)
    for student, teacher in ((s, row_major), (row_major, s), (s, t[:16]), (s, t[:, :129])):
        with pytest.raises(ValueError, match=r"native_rows\.pair_: the teacher's tile"):
            loops.pair_(student, teacher, **_pair_args())
    half = _loops(torch.bfloat16)
    with pytest.raises(ValueError, match="row-major"):
        half.pair_(s.bfloat16(), row_major.bfloat16().T.contiguous().T, **_pair_args())


@pytest.mark.parametrize("layout", ["bf16", "f32-class-major"])
def test_pair_split_over_threads(layout):
    """pair_'s rows (37, not a multiple of 16) split over 1, 2 and 3 threads: every row's
    sums and gradient the same bits."""
    dtype, _ = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    rows, classes = 37, 300
    _, s, _, t = _pair_tiles(layout, rows, classes, 3.0, 67, (5, 0))
    target = _targets(rows, classes, 67, "some")
    w = torch.randn(rows, generator=torch.Generator().manual_seed(67))
    kwargs = _pair_args(reverse=True) | dict(target=target, hard=0.5, power=2.0, weight=w)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            work = _copy_in_layout(s)
            got = loops.pair_(work, t, **kwargs)
            results.append([*dataclasses.astuple(got), work])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for one, many in zip(results[0], other, strict=True):
            assert torch.equal(one, many)


def _hard_grad(a, target, hard, power, w):
    """The gradient with respect to ``a`` of ``w · hard · CE`` at temperature 1 (logits
    ``a · T'``, ``T' = power`` or 1), by autograd in ``a``'s dtype; 0 without a target."""
    if target is None:
        return torch.zeros_like(a)
    a = a.detach().requires_grad_()
    scaled = a * (power if power > 0 else 1.0)
    ce = -scaled.log_softmax(-1).gather(-1, target[:, None])[:, 0]
    (grad,) = torch.autograd.grad((hard * ce * w.to(a.dtype)).sum(), a)
    return grad


def _mixture(a, b, beta, target, hard, power, w):
    """The mixture's divergence ``β KL(q‖r) + (1−β) KL(p‖r)`` of the logits ``a`` (student)
    and ``b`` (teacher) and the gradient with respect to ``a`` of ``w · (divergence + hard ·
    CE)``, in ``a``'s dtype, in its stable form: ``log p − log r = −log(1−β) − softplus(δ)``
    and ``log q − log r = −log β − softplus(−δ)`` from ``δ = log βq − log (1−β)p`` alone
    (the torch operations' form; the form of differences of logs cancels to ~100× this
    one's error at β = 0.001 with a near teacher), the gradient ``(1−β) p (g − Σ p g)``."""
    log_p, log_q = a.log_softmax(-1), b.log_softmax(-1)
    delta = (log_q + math.log(beta)) - (log_p + math.log1p(-beta))
    zero = torch.zeros((), dtype=a.dtype)
    g = -torch.logaddexp(delta, zero) - math.log1p(-beta)
    hq = -torch.logaddexp(-delta, zero) - math.log(beta)
    p, q = log_p.exp(), log_q.exp()
    mean_g = (p * g).sum(-1)
    div = beta * (q * hq).sum(-1) + (1 - beta) * mean_g
    grad = w.to(a.dtype)[:, None] * (1 - beta) * p * (g - mean_g[:, None])
    return div, grad + _hard_grad(a, target, hard, power, w)


@pytest.mark.parametrize("beta, noise", [(0.001, 0.3), (0.01, 0.01), (0.3, 3.0), (0.99, 0.3)])
@pytest.mark.parametrize("hard, power", [(0.0, 0.0), (0.6, 0.0), (0.6, 2.0)])
@pytest.mark.parametrize("layout", list(_FUSED_LAYOUTS))
def test_pair_mixture_against_float64(layout, beta, noise, hard, power):
    """pair_'s mixture (0 < beta < 1: the softplus terms from delta alone, the late sums
    C and C2) on every tile layout, a teacher ``noise`` away from the student: the
    divergence ``β C2/Zt + (1−β) C/Zs`` and the gradient (with the hard term, at T = 1 and
    with its own normaliser) against float64, within 3 eps of the tile's dtype or twice the
    error of the same stable form in fp32 on the same logits. A small ``beta`` with a near
    teacher puts every class where ``βq ≪ (1−β)p``: ``softplus(δ) ≈ e^δ``, whose low bits
    only ``log1p``'s correction keeps."""
    dtype, class_major = _FUSED_LAYOUTS[layout]
    loops = _loops(dtype)
    rows, classes = 23, 700
    gen = torch.Generator().manual_seed(71)
    logits = torch.randn(rows, classes, generator=gen) * 3
    pair = (logits, logits + noise * torch.randn(rows, classes, generator=gen))
    s, t = (x.T.contiguous().T if class_major else x.to(dtype) for x in pair)
    target = torch.randint(0, classes, (rows,), generator=gen) if hard else None
    w = torch.rand(rows, generator=gen) + 0.5
    cs, ct = 1 / 0.7, 0.8
    a, b = s.double() * _fp32(cs), t.double() * _fp32(ct)
    x = s.clone() if not class_major else s.T.contiguous().T
    got = loops.pair_(
        x, t, student_scale=cs, teacher_scale=ct, beta=beta, target=target, hard=hard,
        power=power, weight=w,
    )  # fmt: skip
    zs, zt = got.sum_exp.double(), got.teacher_sum_exp.double()
    divergence = beta * got.teacher_cross.double() / zt + (1 - beta) * got.cross.double() / zs
    exact = _mixture(a, b, beta, target, hard, power, w)
    same = _mixture(a.float(), b.float(), beta, target, hard, power, w)
    online = _online(class_major, s, t, cs, ct) / (3 * eps(torch.float32))
    for name, value, want, plain in (
        ("divergence", divergence, exact[0], same[0]),
        ("gradient", x, exact[1], same[1]),
    ):
        # The divergence is fp32 sums whatever the tile's dtype: 3 eps(fp32). The gradient
        # is rounded to the tile's dtype: 3 eps of it, or twice that rounding of the exact
        # gradient where larger (subnormals). On class-major tiles each raise of a running
        # max rounds the sums once more (_online: 1 + raises times the bound).
        gradient = name == "gradient"
        rounded = rel_err(want.to(x.dtype), want) if gradient else 0.0
        floor = 3 * eps(x.dtype if gradient else torch.float32)
        bound = max(floor, 2 * rel_err(plain, want), 2 * rounded) * online
        err = rel_err(value, want)
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_openmp_region_and_thread_pool_agree(threads):
    """The kernels split their rows in the library's OpenMP region where it has one, else
    over the module's thread pool: both give the same bits (stats, gradient, fused, pair),
    for row counts that split unevenly and class-major runs of 16 rows."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for openmp in (True, False):
            loops = _loops(torch.bfloat16)
            if openmp and not loops.openmp:
                pytest.skip("this build of the loops has no OpenMP")
            loops.openmp = openmp
            fp32 = _loops(torch.float32)
            fp32.openmp = openmp
            gen = torch.Generator().manual_seed(5)
            tile = (torch.randn(37, 300, generator=gen) * 3).bfloat16()
            cm = (torch.randn(300, 37, generator=gen) * 3).T
            teacher = (torch.randn(300, 37, generator=gen) * 3).T
            target = torch.randint(0, 300, (37,), generator=gen)
            w = torch.rand(37, generator=gen)
            stats = loops.stats(tile, target=target, dot=True)
            grad = loops.grad_(tile.clone(), stats.row_max, w, target=target, gamma=-w)
            fused = tile.clone()
            fused_sums = loops.fused_(fused, target, w, w * 0, -w)
            pair = cm.T.contiguous().T
            pair_sums = fp32.pair_(pair, teacher, student_scale=1.0, teacher_scale=1.0, beta=1.0,
                                   entropy=True, weight=w)  # fmt: skip
            results.append(
                [*dataclasses.astuple(stats)[:2], stats.dot, stats.target_u, grad, fused,
                 *dataclasses.astuple(fused_sums)[:2], pair, *dataclasses.astuple(pair_sums)]
            )  # fmt: skip
    finally:
        torch.set_num_threads(saved)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
