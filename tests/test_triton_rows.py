"""The Triton row kernels (:mod:`linear_ce.engine.triton_rows`) against the compiled loops'
contract, on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).

The contract's tests of ``test_native_rows.py`` run a second time with its ``_loops``
handing out :class:`~linear_ce.engine.triton_rows.TritonRows` (each at a few of its
cases: the interpreter runs a kernel's every operation in Python): the statistics and
the gradient against float64, every bf16 and fp16 bit pattern read exactly, NaN and ±inf
rows, masked classes, the dot sum, the rounding to nearest even, the exponential's 2 ulp,
the fused loops and the pair loops (forward, reverse KL and their mixture); then rows
split over programs and classes over blocks (the online max's rescaling), and the
environment's choice of implementation. Each head's step goes through the chunk loop with
the Triton rows forced (``LINEAR_CE_ROW_KERNELS=triton``) against float64 at the house
bound: cross-entropy, ``token_logprobs``, ``token_objective``, ``sequence_objective``
and a distillation loss. Skipped where Triton is not installed, or where this process
already imported the kernels for a GPU.
"""

from __future__ import annotations

import importlib.util
import math
import types

import pytest
import torch

import test_divergence as div
import test_native_rows as base
from linear_ce.engine import native_rows as nr
from linear_ce.engine import triton_rows as tr

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed: the Triton row kernels' tests run in its interpreter",
)

TILES = base.TILES


@pytest.fixture(autouse=True)
def triton_rows(monkeypatch):
    """The Triton rows forced on CPU tensors (under the interpreter, which conftest.py
    turns on before Triton is imported), and ``test_native_rows``' helpers pointed at
    them: its ``_loops``, and its ``nr.NativeRows`` (the class its counters patch)."""
    if not tr._kernels().interpreted:
        pytest.skip("Triton's interpreter is off in this process (TRITON_INTERPRET unset)")
    monkeypatch.setenv(tr.ROW_KERNELS_ENV, "triton")
    monkeypatch.setattr(base, "_loops", tr.TritonRows)
    monkeypatch.setattr(base, "_need_compiler", lambda: None)
    monkeypatch.setattr(
        base, "nr", types.SimpleNamespace(**{**vars(nr), "NativeRows": tr.TritonRows})
    )


# The contract, case by case (test_native_rows' tests and examples).


@pytest.mark.parametrize("dtype", TILES, ids=str)
@pytest.mark.parametrize("classes, rows", [(129, 40), (1, 3)])
def test_loops_against_float64(dtype, classes, rows):
    """stats (row max exact; Z, D, u_t at fp32's bound) and grad_ at the tile's rounding,
    on strided slices of wider NaN-padded tiles: 40 rows over three programs, 129 classes
    over blocks of 128 and 1 (the online rescaling), one class."""
    case = {**base._EDGE_CASE, "classes": classes, "rows": rows}
    base.test_loops_against_float64.hypothesis.inner_test(dtype, case)


@pytest.mark.parametrize("dtype", TILES, ids=str)
def test_masked_classes(dtype):
    base.test_masked_classes(dtype)


@pytest.mark.parametrize("dtype", TILES, ids=str)
def test_nan_logit(dtype):
    base.test_nan_logit(dtype)


def test_stats_into_a_given_tensor():
    base.test_stats_into_a_given_tensor()


@pytest.mark.parametrize("dtype", base.HALF, ids=str)
def test_every_half_value_read_exactly(dtype):
    """Each of the 65536 bit patterns in a row of 3 copies (subnormals, ±0, ±inf, NaN)."""
    base.test_every_half_value_read_exactly(dtype, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_very_negative_logits(dtype):
    base.test_very_negative_logits(dtype)


@pytest.mark.parametrize("dtype", base.HALF, ids=str)
def test_gradient_rounds_to_nearest_even(dtype):
    base.test_gradient_rounds_to_nearest_even(dtype)


def test_exp_within_two_ulps():
    """The kernels' eᵘ within 2 ulp of fp32 over [-87, 0] (5001 points; the compiled
    loops' test takes 100001) and down to the smallest normal."""
    gen = torch.Generator().manual_seed(17)
    u = torch.cat([torch.linspace(-87.0, 0.0, 2501), -87 * torch.rand(2500, generator=gen)])
    assert base._exp_ulps(u).max() <= 2
    base.test_exp_within_two_ulps_down_to_the_smallest_normal()


def test_target_in_a_masked_class_with_b():
    base.test_target_in_a_masked_class_with_b()


@pytest.mark.parametrize("layout", list(base._FUSED_LAYOUTS))
def test_fused_against_float64(layout):
    """fused_ on each layout at the edge case (40 rows, 129 classes) and one row, one class."""
    for case in (base._FUSED_EDGE, {**base._FUSED_EDGE, "rows": 1, "classes": 1, "pad": 0}):
        base.test_fused_against_float64.hypothesis.inner_test(layout, case)


@pytest.mark.parametrize("layout", list(base._FUSED_LAYOUTS))
def test_fused_agrees_with_stats_and_grad(layout):
    base.test_fused_agrees_with_stats_and_grad(layout, *base._AGREE_CASES[0])


@pytest.mark.parametrize("layout", list(base._FUSED_LAYOUTS))
def test_fused_masked_classes(layout):
    base.test_fused_masked_classes(layout)


@pytest.mark.parametrize("layout", list(base._FUSED_LAYOUTS))
def test_fused_nan_logit(layout):
    base.test_fused_nan_logit(layout)


def test_class_major_grad_against_float64():
    """grad_ on a class-major fp32 tile (the kernels take any strides)."""
    inner = base.test_class_major_grad_against_float64.hypothesis.inner_test
    inner(rows=17, classes=65, targets="some", with_b=True, seed=3)


@pytest.mark.parametrize("layout", ["bf16", "f16", "f32"])
def test_pair_against_float64(layout):
    """pair_ at the edge case (reverse KL, the entropy, the hard term with its own
    normaliser, a weight) and forward KL with the hard term at T = 1."""
    for change in ({}, {"reverse": False, "hard": "hard"}):
        case = {**base._PAIR_EDGE, **change}
        base.test_pair_against_float64.hypothesis.inner_test(layout, case)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_pair_masked_student_classes(reverse):
    base.test_pair_masked_student_classes("bf16", reverse)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_pair_nan_logit(reverse):
    base.test_pair_nan_logit("f32", reverse)


@pytest.mark.parametrize("beta, noise", [(0.01, 0.01), (0.3, 3.0)])
def test_pair_mixture_against_float64(beta, noise):
    """The mixture's sums and gradient, with the hard term at T = 1 and with its own
    normaliser."""
    base.test_pair_mixture_against_float64("bf16", beta, noise, 0.6, 0.0)
    base.test_pair_mixture_against_float64("f32", beta, noise, 0.6, 2.0)


def test_pair_shape_mismatch_is_an_error():
    """The two tiles of a pair_ call of different shapes: a ValueError naming the call."""
    loops = tr.TritonRows(torch.float32)
    s, t = torch.randn(4, 10), torch.randn(4, 9)
    with pytest.raises(ValueError, match=r"triton_rows\.pair_: the teacher's tile"):
        loops.pair_(s, t, **base._pair_args())


# Rows over programs, classes over blocks.


def test_rows_split_over_programs(monkeypatch):
    """A program's rows are independent: 16 rows to a program give each row's result as
    1024 to a program do, bit for bit (stats, grad_, fused_, pair_)."""
    _, tile = base._tile(40, 150, torch.bfloat16, 3.0, 19, 0)
    teacher = base._tile(40, 150, torch.bfloat16, 2.0, 20, 0)[1]
    target = base._targets(40, 150, 19, "some")
    a, b, mu, gamma = base._row_vectors(40, 19, True)
    loops = tr.TritonRows(torch.bfloat16)
    results = []
    for most in (16, 1024):
        monkeypatch.setattr(tr, "INTERPRETER_BLOCKS", (most, 64))
        monkeypatch.setattr(tr, "_INTERPRETER_MIN_ROWS", most)
        got = loops.stats(tile, target=target, dot=True)
        grad = loops.grad_(tile.clone(), got.row_max, a, b=b, mu=mu, target=target, gamma=gamma)
        fused_tile = tile.clone()
        fused = loops.fused_(fused_tile, target, a, b, gamma)
        student = tile.clone()
        pair = loops.pair_(student, teacher, **base._pair_args(target=target, weight=a.abs()))
        results.append([*vars(got).values(), grad, *vars(fused).values(), fused_tile])
        results[-1] += [*vars(pair).values(), student]
    for one, many in zip(*results, strict=True):
        assert (one is None) == (many is None)
        if one is not None:
            assert torch.equal(one.isnan(), many.isnan())
            assert torch.equal(one.nan_to_num(), many.nan_to_num())


@pytest.mark.parametrize("dtype", TILES, ids=str)
def test_small_blocks_against_float64(dtype, monkeypatch):
    """Blocks of 16 classes (a row's max grows block after block: its sums rescaled each
    time, from a first block of -inf too) keep stats and the gradient at the bound."""
    monkeypatch.setattr(tr, "INTERPRETER_BLOCKS", (1024, 16))
    loops = tr.TritonRows(dtype)
    wide, tile = base._tile(5, 200, dtype, 10.0, 29, 3)
    # Rising logits: every block raises the max; row 1's first blocks are masked.
    tile += torch.linspace(0.0, 30.0, 200).to(dtype)
    tile[1, :40] = -math.inf
    target = torch.tensor([0, 150, 199, -1, 17])
    got = base._check_stats(loops, tile, 1 / 0.7, target, True, dtype)
    assert got.sum_exp.isfinite().all() and got.dot.isfinite().all()
    base._check_grad(loops, wide, tile, 1 / 0.7, target, True, 29, dtype)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_pair_small_blocks_against_float64(reverse, monkeypatch):
    """The pair loops over blocks of 16 classes (both maxima grow block after block: the
    divergence's, the entropy's and the hard term's sums rescaled each time)."""
    monkeypatch.setattr(tr, "INTERPRETER_BLOCKS", (1024, 16))
    case = {**base._PAIR_EDGE, "reverse": reverse}
    base.test_pair_against_float64.hypothesis.inner_test("f32", case)


# The implementation a device's tiles take.


def test_row_loops_choice(monkeypatch):
    """``LINEAR_CE_ROW_KERNELS=triton``: the Triton rows on CPU tensors (one per dtype);
    ``auto``: the compiled loops on a CPU; ``LINEAR_CE_NATIVE_ROWS=0``: none; a float64
    tile: none; a bad value: an error naming the variable."""
    cpu = torch.device("cpu")
    rows = tr.row_loops(torch.bfloat16, cpu)
    assert isinstance(rows, tr.TritonRows) and rows is tr.row_loops(torch.bfloat16, cpu)
    assert tr.row_loops(torch.float64, cpu) is None
    monkeypatch.setenv(base.ENV, "0")
    assert tr.row_loops(torch.float32, cpu) is None
    monkeypatch.setenv(base.ENV, "auto")
    monkeypatch.setenv(tr.ROW_KERNELS_ENV, "auto")
    assert not isinstance(tr.row_loops(torch.float32, cpu), tr.TritonRows)
    monkeypatch.setenv(tr.ROW_KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="LINEAR_CE_ROW_KERNELS must be auto"):
        tr.row_loops(torch.float32, cpu)


def test_without_triton(monkeypatch):
    """Where Triton is not installed: CUDA tiles take torch's operations (``auto`` warns
    once), and ``LINEAR_CE_NATIVE_ROWS=1`` or a forced Triton is an error saying so."""
    monkeypatch.setattr(tr, "triton_available", lambda: False)
    monkeypatch.setattr(tr, "_warned", False)
    with pytest.raises(RuntimeError, match="LINEAR_CE_ROW_KERNELS=triton but Triton is not"):
        tr.row_loops(torch.float32, torch.device("cpu"))
    monkeypatch.setenv(tr.ROW_KERNELS_ENV, "auto")
    cuda = torch.device("cuda")
    with pytest.warns(RuntimeWarning, match="Triton is not installed, so cuda tiles"):
        assert tr.row_loops(torch.float32, cuda) is None
    assert tr.row_loops(torch.float32, cuda) is None  # once
    monkeypatch.setenv(base.ENV, "1")
    with pytest.raises(RuntimeError, match="LINEAR_CE_NATIVE_ROWS=1 but Triton is not"):
        tr.row_loops(torch.float32, cuda)


def test_bad_tiles_are_errors():
    """A tile of another dtype or not 2-D, a target of another shape: errors naming the call."""
    loops = tr.TritonRows(torch.float32)
    with pytest.raises(ValueError, match=r"triton_rows\.stats: expected a 2-D \(B, V\)"):
        loops.stats(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"triton_rows\.grad_: expected a 2-D"):
        loops.grad_(torch.zeros(3), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"target must be \(3,\)"):
        loops.stats(torch.zeros(3, 4), target=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"no kernels for torch\.float64"):
        tr.TritonRows(torch.float64)


# Each head's step through the chunk loop, the Triton rows forced, against float64.


@pytest.mark.parametrize("tile", ["bf16", "bf16-fp32-tile"])
def test_cross_entropy_step(tile, monkeypatch):
    """Cross-entropy (z-loss, logit scale, temperature; a quarter of the rows ignored) on
    a half tile and on an fp32 tile, both paths against float64."""
    base.test_cross_entropy_both_paths(tile, "mean", 1e-2, 1.3, 0.8, monkeypatch)


def test_fp32_cross_entropy_step(monkeypatch):
    """fp32 cross-entropy with class weights on a row-major tile (CUDA's layout), and its
    forward alone (the statistics pass's blocks, ``stats_call``)."""
    base.test_fp32_cross_entropy_both_paths("row-major", "sum", "weighted-zloss", monkeypatch)
    base.test_fp32_cross_entropy_forward_both_paths("row-major", monkeypatch)


@pytest.mark.parametrize("tile, entropy", [("bf16", True), ("f32-row-major", False)])
def test_token_objective_step(tile, entropy, monkeypatch):
    base.test_token_objective_both_paths(tile, entropy, monkeypatch)


@pytest.mark.parametrize("tile, entropy", [("bf16", False), ("f32-row-major", True)])
def test_sequence_objective_step(tile, entropy, monkeypatch):
    base.test_sequence_objective_dpo_both_paths(tile, entropy, monkeypatch)


def test_token_logprobs_step(monkeypatch):
    base.test_token_logprobs_both_paths(torch.bfloat16, monkeypatch)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3], ids=["forward", "reverse", "mixture"])
@pytest.mark.parametrize("path", ["bf16-half-tiles", "f32-row-major"])
def test_distillation_step(path, beta, monkeypatch):
    """A distillation loss (hard term, temperature, logit scales; chunks of 16 rows) by
    the Triton pair kernels on every chunk, against float64."""
    dtype, tile, _ = div._pair_path(monkeypatch, path)
    calls = []
    original = tr.TritonRows.pair_

    def counted(self, student, teacher, **kwargs):
        calls.append(student.dtype)
        return original(self, student, teacher, **kwargs)

    monkeypatch.setattr(tr.TritonRows, "pair_", counted)
    div._pair_check(dtype, beta, div._PAIR_VARIANTS["mean-hard-temperature"])
    assert calls and set(calls) == {tile}
