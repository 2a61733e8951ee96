"""The plan's machine-dependent choices (:mod:`linear_ce.engine.machine`): how they are decided,
cached and forced, and that every choice computes the same result.

The decision rules are tested on synthetic rates (``chunk_rates``/``half_speedup``
replaced), so they do not depend on the machine running the tests; one test runs the real
measurement at a tiny size. The results are tested under every forced choice against the
cross-entropy written here in float64.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine import machine
from linear_ce.engine import plan as plan_module
from linear_ce.engine.capability import native_half_gemm
from linear_ce.engine.gemm import BlockUpcast, NativeHalf, SameDtype
from linear_ce.engine.plan import make_plan

CPU = torch.device("cpu")
#: Large enough that the plan consults the measurement (``worth_measuring``).
BIG = (2048, 1024, 32768)
ENV = (
    machine.MEASURE_ENV,
    machine.CACHE_DIR_ENV,
    machine.MEMORY_BUDGET_ENV,
    machine.CHUNK_ROWS_ENV,
    machine.TILE_LAYOUT_ENV,
    machine.CLASS_BLOCK_ENV,
    machine.STEP_ROWS_ENV,
    machine.STATS_BLOCK_ENV,
    machine.EXP_ENV,
    "LINEAR_CE_NATIVE_HALF_GEMM",
)


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    """No override from the caller's environment, the disk cache in a fresh directory and
    no rates from an earlier test (each test sees the store empty)."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(machine.CACHE_DIR_ENV, str(tmp_path / "cache"))
    machine._STORE.clear()
    yield
    machine._STORE.clear()


def _synthetic(rate_of, spread=1.01, busy=0.98):
    """A ``chunk_rates`` stand-in: ``rate_of(rows, class_major)`` GFLOP/s for all three GEMMs,
    rounds agreeing within ``spread``, threads ``busy``; records the rows it measured."""
    asked = []

    def chunk_rates(dtype, features, rows, layouts=(True, False)):
        asked.append(list(rows))
        return {(b, lay): [rate_of(b, lay)] * 4 + [spread, busy] for b in rows for lay in layouts}

    chunk_rates.asked = asked
    return chunk_rates


def _fp32_plan(**options):
    return make_plan(*BIG, torch.float32, CPU, LinearCrossEntropyOptions(**options))


# --- the fallback and the forced choices ------------------------------------------------


def test_fallback_is_the_fixed_rule(monkeypatch):
    """``LINEAR_CE_MEASURE=0``: no measurement, the budget's rows (256 at this shape: a
    quarter of the gradients' bytes at V·4 bytes a row), a class-major tile."""
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    monkeypatch.setattr(machine, "chunk_rates", _fail("measured with LINEAR_CE_MEASURE=0"))
    plan = _fp32_plan()
    assert plan.rows_per_chunk == 256
    assert plan.gemm == SameDtype(torch.float32, class_major=True)
    assert plan.gemm.logits_buffer(4, 6, torch.float32, CPU).stride() == (1, 4)
    vocab = make_plan(*BIG, torch.float32, CPU, LinearCrossEntropyOptions(), vocab_pass=True)
    assert vocab.classes_per_block >= 512


def _fail(why):
    def fail(*args, **kwargs):
        raise AssertionError(why)

    return fail


@pytest.mark.parametrize("kind", ["half", "companion"])
def test_forced_rows_where_the_plan_keeps_the_longest(kind, monkeypatch):
    """Half inputs on a CPU and a companion's loop keep the budget's longest chunks, not the
    machine's choice; ``LINEAR_CE_CHUNK_ROWS`` still forces theirs (at most the budget's),
    not ignored in silence."""
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    dtype = torch.bfloat16 if kind == "half" else torch.float32
    options = LinearCrossEntropyOptions()

    def plan():
        return make_plan(4000, 64, 5000, dtype, CPU, options, longest=kind == "companion")

    longest = plan().rows_per_chunk
    assert longest > 64, longest
    monkeypatch.setenv(machine.CHUNK_ROWS_ENV, "64")
    assert plan().rows_per_chunk == 64
    monkeypatch.setenv(machine.CHUNK_ROWS_ENV, str(10 * longest))
    assert plan().rows_per_chunk == longest


def test_forced_rows_and_layout(monkeypatch):
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    monkeypatch.setenv(machine.CHUNK_ROWS_ENV, "128")
    monkeypatch.setenv(machine.TILE_LAYOUT_ENV, "row-major")
    plan = _fp32_plan()
    assert plan.rows_per_chunk == 128
    assert plan.gemm.class_major is False
    assert plan.gemm.logits_buffer(4, 6, torch.float32, CPU).stride() == (6, 1)
    # A forced choice is one the measurement could make: never above the budget's rows.
    monkeypatch.setenv(machine.CHUNK_ROWS_ENV, "1024")
    assert _fp32_plan().rows_per_chunk == 256
    # ... and it applies with measuring on too (no measurement is needed for it).
    monkeypatch.setenv(machine.MEASURE_ENV, "1")
    monkeypatch.setattr(machine, "chunk_rates", _fail("measured a forced choice"))
    monkeypatch.setenv(machine.TILE_LAYOUT_ENV, "class-major")
    plan = _fp32_plan()
    assert (plan.rows_per_chunk, plan.gemm.class_major) == (256, True)


@pytest.mark.parametrize("half_blocks", [True, False])
def test_half_blocks_are_budgeted_at_their_own_bytes(monkeypatch, half_blocks):
    """A vocabulary pass that takes half blocks holds one tile of bf16 logits: its blocks
    fill a quarter of the gradients' bytes at 2 bytes per logit (every row in one group);
    without half blocks, at fp32's 4 and the bf16 operand's 2."""
    if not native_half_gemm(torch.bfloat16, CPU):
        pytest.skip("no native bf16 GEMMs on this CPU (no half blocks)")
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", "1")
    plan = make_plan(
        *BIG, torch.bfloat16, CPU, LinearCrossEntropyOptions(), vocab_pass=True,
        gathered=False, half_blocks=half_blocks,
    )  # fmt: skip
    rows, features, classes = BIG
    budget = (rows + classes) * features * 2 // 4
    per_logit = 2 if half_blocks else 6
    assert isinstance(plan.gemm, NativeHalf) and plan.rows_per_chunk == rows
    assert budget - 128 * rows * per_logit < plan.classes_per_block * rows * per_logit <= budget


def test_memory_budget_scales_every_share(monkeypatch):
    """``LINEAR_CE_MEMORY_BUDGET=0.5`` doubles the fp32 share (512 rows here), the half
    paths' and the vocabulary pass's budgets with it."""
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    base = {
        dtype: make_plan(*BIG, dtype, CPU, LinearCrossEntropyOptions())
        for dtype in (torch.float32, torch.bfloat16)
    }
    vocab = make_plan(*BIG, torch.float32, CPU, LinearCrossEntropyOptions(), vocab_pass=True)
    monkeypatch.setenv(machine.MEMORY_BUDGET_ENV, "0.5")
    assert _fp32_plan().rows_per_chunk == 2 * base[torch.float32].rows_per_chunk == 512
    half = make_plan(*BIG, torch.bfloat16, CPU, LinearCrossEntropyOptions())
    assert half.rows_per_chunk >= base[torch.bfloat16].rows_per_chunk
    more = make_plan(*BIG, torch.float32, CPU, LinearCrossEntropyOptions(), vocab_pass=True)
    assert more.classes_per_block > vocab.classes_per_block


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        (machine.MEASURE_ENV, "yes", "LINEAR_CE_MEASURE must be one of 0 .*got 'yes'"),
        (machine.MEMORY_BUDGET_ENV, "-1", "LINEAR_CE_MEMORY_BUDGET must be a positive number"),
        (machine.MEMORY_BUDGET_ENV, "lots", "LINEAR_CE_MEMORY_BUDGET must be a positive"),
        (machine.CHUNK_ROWS_ENV, "0", "LINEAR_CE_CHUNK_ROWS must be a positive number of rows"),
        (machine.TILE_LAYOUT_ENV, "col", "LINEAR_CE_TILE_LAYOUT must be one of class-major"),
        (machine.CLASS_BLOCK_ENV, "x", "LINEAR_CE_CLASS_BLOCK must be a positive number"),
        (machine.STEP_ROWS_ENV, "-2", "LINEAR_CE_STEP_ROWS must be a positive number"),
        (machine.STATS_BLOCK_ENV, "none", "LINEAR_CE_STATS_BLOCK must be a positive number"),
        (machine.EXP_ENV, "e", "LINEAR_CE_EXP must be one of exp .*got 'e'"),
    ],
)
def test_bad_environment_values_are_clear_errors(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        linear_ce.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4).long())


# --- the decision rules, on synthetic rates ----------------------------------------------


def test_rows_the_budgets_unless_another_runs_faster(monkeypatch):
    """Rates 100 at 128 rows, 150 at 192, 158 at 256 and 384 (the best): the budget's own
    256 rows run at the best rate, so they are kept; with 154 at 192 (within 4% of the best)
    still 256: a tie goes to fewer chunks. With 256 at 150, 5.1% below 192's 158: the
    smallest within 4% of the best (192; 384 at 157 is within it too)."""
    monkeypatch.setenv(machine.MEASURE_ENV, "process")  # each clear() measures anew
    rates = {128: 100.0, 192: 150.0, 256: 158.0, 384: 158.0}
    fake = _synthetic(lambda b, lay: rates[b] * (1.0 if lay else 0.9))
    monkeypatch.setattr(machine, "chunk_rates", fake)
    assert _fp32_plan().rows_per_chunk == 256
    # The sizes the stretched budget allows (512 rows) that this call pays the measuring
    # of: 384 at most (6·N·F·V = 412 GFLOP against 8 × 48 for the sizes up to 384).
    assert fake.asked == [[128, 192, 256, 384]]
    machine._STORE.clear()
    rates[192] = 154.0
    assert _fp32_plan().rows_per_chunk == 256
    machine._STORE.clear()
    rates.update({192: 158.0, 256: 150.0, 384: 157.0})
    plan = _fp32_plan()
    assert plan.rows_per_chunk == 192 and plan.gemm.class_major is True


def test_rows_stretch_the_default_budget_where_longer_chunks_run_faster(monkeypatch):
    """384 rows measured 7.6% faster than 256: the plan takes them (six chunks, evened to
    352 rows), past the budget's 256 rows, up to ``MEASURED_STRETCH`` times it; never with
    the budget set by ``LINEAR_CE_MEMORY_BUDGET``, for a loop of two tiles, or where the
    measurement does not run (the fixed rule: the budget's rows)."""
    monkeypatch.setenv(machine.MEASURE_ENV, "process")
    rates = {128: 100.0, 192: 150.0, 256: 158.0, 384: 170.0}
    fake = _synthetic(lambda b, lay: rates[b])
    monkeypatch.setattr(machine, "chunk_rates", fake)
    assert _fp32_plan().rows_per_chunk == 352
    # Within the stretched budget: 0.5 of the gradients' bytes, at V·4 bytes a row.
    grad_bytes = (BIG[0] + BIG[2]) * BIG[1] * 4
    assert 352 * BIG[2] * 4 <= plan_module.MEASURED_STRETCH * 0.25 * grad_bytes
    two_tiles = make_plan(*BIG, torch.float32, CPU, LinearCrossEntropyOptions(), tiles=2)
    assert two_tiles.rows_per_chunk == 128
    monkeypatch.setenv(machine.MEMORY_BUDGET_ENV, "0.25")
    assert _fp32_plan().rows_per_chunk == 256
    monkeypatch.delenv(machine.MEMORY_BUDGET_ENV)
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    assert _fp32_plan().rows_per_chunk == 256


@pytest.mark.parametrize(("row_rate", "class_major"), [(120.0, False), (103.0, True)])
def test_layout_follows_the_faster_gemms(monkeypatch, row_rate, class_major):
    """Row-major where its GEMMs run more than ``TOLERANCE`` faster (20% here), else the
    fixed rule's class-major (3% is within the rounds' noise)."""
    rate = _synthetic(lambda b, lay: 100.0 if lay else row_rate)
    monkeypatch.setattr(machine, "chunk_rates", rate)
    plan = _fp32_plan()
    assert plan.gemm.class_major is class_major
    assert plan.rows_per_chunk == 256  # every size equally fast: the budget's rows


@pytest.mark.parametrize(("spread", "busy"), [(1.3, 0.98), (1.01, 0.3)], ids=["spread", "idle"])
def test_unsteady_measurement_falls_back_and_is_not_cached(monkeypatch, tmp_path, spread, busy):
    """Rounds that disagree by more than ``NOISE_LIMIT``, or threads that ran less than
    ``MIN_BUSY`` of the time (a busy machine), decide nothing: the fixed rule, and no cache
    file, so the next process measures again."""
    fake = _synthetic(lambda b, lay: 100.0 if b == 128 else 50.0, spread=spread, busy=busy)
    monkeypatch.setattr(machine, "chunk_rates", fake)
    plan = _fp32_plan()
    assert (plan.rows_per_chunk, plan.gemm.class_major) == (256, True)
    assert not list((tmp_path / "cache").glob("*.json"))
    _fp32_plan()
    assert len(fake.asked) == 1  # this process keeps it (no measurement per call)


def test_small_calls_are_never_measured(monkeypatch):
    """A call whose GEMMs cost less than ``MEASURE_RATIO`` times the measurement takes the
    fixed rule."""
    monkeypatch.setattr(machine, "chunk_rates", _fail("measured for a small call"))
    monkeypatch.setattr(machine, "half_speedup", _fail("measured for a small call"))
    plan = make_plan(512, 256, 8192, torch.float32, CPU, LinearCrossEntropyOptions())
    assert plan.gemm.class_major is True
    make_plan(512, 256, 8192, torch.bfloat16, CPU, LinearCrossEntropyOptions())
    assert not machine.worth_measuring(6 * 512 * 256 * 8192, 256, 256)
    assert machine.worth_measuring(6.0 * 2048 * 1024 * 32768, 1024, 256)


def test_no_measurement_outside_a_plain_cpu_call(monkeypatch):
    """CUDA, fake tensors and torch.distributed (ranks must plan alike) take the fallback."""
    monkeypatch.setattr(machine, "chunk_rates", _fail("measured"))
    flops = 6.0 * 2048 * 1024 * 32768
    assert not machine.tuning_for(torch.device("cuda"), torch.float32, 1024, flops).allowed
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not machine.tuning_for(CPU, torch.float32, 1024, flops).allowed
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert not machine.tuning_for(CPU, torch.float32, 1024, flops).allowed
    assert _fp32_plan().rows_per_chunk == 256


@pytest.mark.parametrize(("speedup", "native"), [(0.5, False), (0.9, True), (3.0, True)])
def test_half_path_taken_where_it_measures_faster(monkeypatch, speedup, native):
    """Where the flags promise native half GEMMs, the plan takes them only if they measure
    at least ``HALF_MIN_SPEEDUP`` times fp32's rate; ``LINEAR_CE_NATIVE_HALF_GEMM=1``
    takes them regardless, ``0`` never (the flags are assumed here: no GEMM runs)."""
    monkeypatch.setattr("linear_ce.engine.plan.native_half_gemm", lambda dtype, device: True)
    monkeypatch.setattr(machine, "half_speedup", lambda dtype, features: [speedup, 1.01, 0.9])
    monkeypatch.setattr(machine, "chunk_rates", _synthetic(lambda b, lay: 100.0))
    monkeypatch.setattr(
        machine, "step_rates", lambda dtype, steps: {b: [1.0, 1.0, 1.0] for b in steps}
    )
    plan = make_plan(*BIG, torch.float16, CPU, LinearCrossEntropyOptions())
    assert isinstance(plan.gemm, NativeHalf) is native
    assert isinstance(plan.gemm, BlockUpcast) is not native
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", "1")
    assert isinstance(
        make_plan(*BIG, torch.float16, CPU, LinearCrossEntropyOptions()).gemm, NativeHalf
    )


def test_half_inputs_keep_the_budgets_longest_chunks(monkeypatch):
    """The weight-gradient sum of half inputs pays a pass per chunk: the measured rows
    choice is not applied (nor asked for)."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", "0")
    monkeypatch.setattr(
        machine, "chunk_rates", _synthetic(lambda b, lay: 100.0 if b == 128 else 90.0)
    )
    measured = make_plan(*BIG, torch.bfloat16, CPU, LinearCrossEntropyOptions())
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    fixed = make_plan(*BIG, torch.bfloat16, CPU, LinearCrossEntropyOptions())
    assert measured.rows_per_chunk == fixed.rows_per_chunk == 512


def test_a_companion_loop_keeps_the_budgets_longest_chunks(monkeypatch):
    """A distillation loop (two tiles, ``longest=True``): rates 10% higher at 128 rows than
    at the others would give the smallest chunk; it keeps the budget's longest, 256 rows at
    ``DIVERGENCE_SHARE`` of the gradients' bytes (0.48 × 142.6 MB over two 128 KiB rows),
    as the fixed rule does, and the measurement of sizes is not asked for."""
    fake = _synthetic(lambda b, lay: 100.0 if b == 128 else 90.0)
    monkeypatch.setattr(machine, "chunk_rates", fake)
    share = plan_module.DIVERGENCE_SHARE

    def plan(**kwargs):
        return make_plan(
            *BIG, torch.float32, CPU, LinearCrossEntropyOptions(), tiles=2, share=share, **kwargs
        )

    assert plan().rows_per_chunk == 128
    fake.asked.clear()
    measured = plan(longest=True)
    assert all(len(rows) == 1 for rows in fake.asked)  # the layout's candidate only
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    assert measured.rows_per_chunk == plan(longest=True).rows_per_chunk == plan().rows_per_chunk
    assert measured.rows_per_chunk == 256


def test_class_block_smallest_at_full_rate(monkeypatch):
    """The vocabulary pass's fewest classes per block: the smallest candidate within
    ``TOLERANCE`` of the best rate (256 here); forced by ``LINEAR_CE_CLASS_BLOCK``."""
    rates = {128: 60.0, 192: 90.0, 256: 150.0, 384: 152.0, 512: 153.0, 768: 154.0, 1024: 155.0}
    monkeypatch.setattr(machine, "chunk_rates", _synthetic(lambda b, lay: rates[b]))
    tuning = machine.tuning_for(CPU, torch.float32, 1024, 1e15)
    assert tuning.min_class_block(512) == 256
    assert machine.tuning_for(CPU, torch.float32, 1024, 1e9).min_class_block(512) == 512
    monkeypatch.setenv(machine.CLASS_BLOCK_ENV, "4096")
    assert tuning.min_class_block(512) == 4096
    # With few classes per row's budget, groups of rows are sized for that many classes.
    options = LinearCrossEntropyOptions()
    plan = make_plan(1 << 20, 64, 32768, torch.float32, CPU, options, vocab_pass=True)
    assert plan.classes_per_block == 4096
    monkeypatch.setenv(machine.CLASS_BLOCK_ENV, "512")
    smaller = make_plan(1 << 20, 64, 32768, torch.float32, CPU, options, vocab_pass=True)
    assert smaller.classes_per_block == 512 and smaller.rows_per_chunk > plan.rows_per_chunk


def test_half_tile_step_measured(monkeypatch):
    """With native half GEMMs the half tile's fp32 math takes the largest step within
    ``TOLERANCE`` of the fastest (16 rows here, at 32768 classes), as many bytes per step
    at another vocabulary size; ``LINEAR_CE_STEP_ROWS`` forces it."""
    monkeypatch.setenv(machine.MEASURE_ENV, "process")
    monkeypatch.setattr("linear_ce.engine.plan.native_half_gemm", lambda dtype, device: True)
    monkeypatch.setattr(machine, "half_speedup", lambda dtype, features: [3.0, 1.01, 0.9])
    speed = {4: 0.9, 8: 1.0, 16: 0.97, 32: 0.8, 64: 0.7}
    monkeypatch.setattr(
        machine, "step_rates", lambda dtype, steps: {b: [speed[b], 1.01, 0.95] for b in steps}
    )
    options = LinearCrossEntropyOptions()
    plan = make_plan(*BIG, torch.bfloat16, CPU, options)
    assert isinstance(plan.gemm, NativeHalf)
    assert (plan.rows_per_chunk, plan.rows_per_step) == (1024, 16)
    assert make_plan(2048, 1024, 65536, torch.bfloat16, CPU, options).rows_per_step == 8
    monkeypatch.setenv(machine.STEP_ROWS_ENV, "4")
    assert make_plan(*BIG, torch.bfloat16, CPU, options).rows_per_step == 4
    monkeypatch.delenv(machine.STEP_ROWS_ENV)
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    assert make_plan(*BIG, torch.bfloat16, CPU, options).rows_per_step == 64


@pytest.mark.parametrize("amx", [False, True], ids=["no AMX", "AMX"])
@pytest.mark.parametrize(
    ("speedup", "spread", "expected"),
    [(2.0, 1.01, True), (0.5, 1.01, False), (0.5, 1.5, None)],
    ids=["exp2 faster", "exp faster", "unsteady: the fallback"],
)
def test_exp_form_measured(monkeypatch, speedup, spread, expected, amx):
    """Half inputs' fp32 math forms ``eᵘ`` in the form that measured faster
    (:func:`machine.exp_speedup`: exp2's rate over exp's); where the measurement was
    unsteady or not taken (``LINEAR_CE_MEASURE=0``, a call too small to pay for it), the
    fallback: ``exp`` on a CPU with AMX (``EXP_FLAG``), else ``exp2``. ``LINEAR_CE_EXP``
    forces either; fp32 inputs never take ``exp2``."""
    fallback = not amx
    flags = frozenset({"avx512f", "amx_tile"} if amx else {"avx512f"})
    monkeypatch.setattr("linear_ce.engine.plan.cpu_flags", lambda: flags)
    monkeypatch.setenv(machine.MEASURE_ENV, "process")
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", "0")
    monkeypatch.setattr(machine, "chunk_rates", _synthetic(lambda b, lay: 100.0))
    monkeypatch.setattr(machine, "exp_speedup", lambda: [speedup, spread, 0.95])
    options = LinearCrossEntropyOptions()
    measured = fallback if expected is None else expected
    assert make_plan(*BIG, torch.bfloat16, CPU, options).exp2 is measured
    assert make_plan(64, 64, 100, torch.bfloat16, CPU, options).exp2 is fallback
    assert make_plan(*BIG, torch.float32, CPU, options).exp2 is False
    for forced, form in ((True, "exp2"), (False, "exp")):
        monkeypatch.setenv(machine.EXP_ENV, form)
        assert make_plan(*BIG, torch.bfloat16, CPU, options).exp2 is forced
    monkeypatch.delenv(machine.EXP_ENV)
    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    assert make_plan(*BIG, torch.bfloat16, CPU, options).exp2 is fallback


def test_step_measurement_counts_the_per_step_operations(monkeypatch):
    """:func:`machine.step_rates` issues ``STEP_ROW_OPS`` small operations per step besides
    its passes (what the loop and a head issue per step, whatever its rows): counted here
    with a dispatch mode, so a change of the passes or of the count is seen."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(machine, "MEASURE_ROUNDS", 1)
    counts = {}
    for steps in ([64], [16]):
        Count.calls = 0
        with Count():
            machine._quietly(machine.step_rates, torch.bfloat16, steps)
        counts[steps[0]] = Count.calls
    # 2 passes (warm-up, one round) over 64 rows: 2 steps of 64 rows against 8 of 16.
    per_step = (counts[16] - counts[64]) / (8 - 2)
    assert per_step >= machine.STEP_ROW_OPS, counts


# --- the cache ----------------------------------------------------------------------------


def test_cache_is_written_checked_and_read_back(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "chunk_rates", _synthetic(lambda b, lay: 100.0 + b / 64))
    first = _fp32_plan()
    (path,) = (tmp_path / "cache").glob("machine-*.json")
    data = json.loads(path.read_text())
    assert data["machine"]["torch"] == torch.__version__
    assert set(data) == {"version", "machine", "rates", "checksum"}
    assert not list((tmp_path / "cache").glob("*.tmp"))  # written by rename, nothing left
    # Another process (here: a cleared store) reads it back without measuring.
    machine._STORE.clear()
    monkeypatch.setattr(machine, "chunk_rates", _fail("measured again despite the cache"))
    assert _fp32_plan() == first


def test_a_tampered_cache_is_measured_again_and_replaced(monkeypatch, tmp_path):
    fake = _synthetic(lambda b, lay: 100.0 if b == 128 else 101.0)
    monkeypatch.setattr(machine, "chunk_rates", fake)
    _fp32_plan()
    (path,) = (tmp_path / "cache").glob("machine-*.json")
    data = json.loads(path.read_text())
    key = next(iter(data["rates"]))
    data["rates"][key][0] *= 2  # the checksum no longer matches
    path.write_text(json.dumps(data))
    machine._STORE.clear()
    with pytest.warns(RuntimeWarning, match="ignoring the machine profile .*checksum"):
        _fp32_plan()
    assert len(fake.asked) == 2
    assert machine._check(json.loads(path.read_text()), machine._machine_key()) is None


@pytest.mark.parametrize("mode", ["process", "0"])
def test_no_disk_cache_when_asked(monkeypatch, tmp_path, mode):
    monkeypatch.setenv(machine.MEASURE_ENV, mode)
    monkeypatch.setattr(machine, "chunk_rates", _synthetic(lambda b, lay: 100.0))
    _fp32_plan()
    assert not (tmp_path / "cache").exists()


def test_unwritable_cache_warns_once_and_measures_per_process(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(machine.CACHE_DIR_ENV, str(blocker / "cache"))
    monkeypatch.setattr(
        machine, "chunk_rates", _synthetic(lambda b, lay: 100.0 if b == 128 else 90.0)
    )
    with pytest.warns(RuntimeWarning, match="cannot write the machine profile"):
        plan = _fp32_plan()
    assert plan.rows_per_chunk == 128
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fp32_plan()


def test_real_measurement_is_sane():
    """The real thing at a tiny size: positive finite rates, a spread ≥ 1, a positive finite
    busy share (no upper bound: BLAS helper threads and a loaded machine both push the process's
    CPU time past wall × threads — 2.45 was seen under load), both layouts, under
    autocast (which must not turn the fp32 GEMMs into bf16 ones: a bf16 result of an fp32
    ``out=`` would raise)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rates = machine.measured_rates(torch.float32, 64, [128, 192])
    assert set(rates) == {(128, True), (128, False), (192, True), (192, False)}
    for values in rates.values():
        # A spread is infinite where a busy machine stopped the measurement after one round.
        assert len(values) == 6 and all(math.isfinite(v) and v > 0 for v in values[:4])
        assert values[4] >= 1.0 and values[5] > 0 and math.isfinite(values[5])
    speedup, spread, busy = machine._quietly(machine.half_speedup, torch.bfloat16, 64)
    assert speedup > 0 and spread >= 1.0 and busy > 0 and math.isfinite(busy)


def test_a_busy_machine_stops_the_measurement_after_one_round(monkeypatch):
    """Threads busy less than ``MIN_BUSY`` of the first round (here: always, the limit set
    to infinity; 2.0 was not enough: the process's CPU time counts every thread, so OpenMP
    workers spinning after a region, or a thread count another test lowered, can make
    ``busy()`` exceed 2, as one CI run did) end the measurement there: one timed round, an
    infinite spread, unsteady."""
    monkeypatch.setattr(machine, "MIN_BUSY", math.inf)
    rates = machine._quietly(machine.chunk_rates, torch.float32, 32, [128, 192])
    assert all(r[4] == math.inf and not machine._steady(r) for r in rates.values())
    steps = machine._quietly(machine.step_rates, torch.bfloat16, [4, 8])
    assert all(r[1] == math.inf for r in steps.values())


def test_bench_reports_the_plan_and_its_rates(monkeypatch):
    """The bench's note and JSON name each ``linear_ce`` row's plan, the fixed rule's where
    it differs, and the rates it was chosen from."""
    from linear_ce.bench.config import Point
    from linear_ce.bench.report import machine as machine_report
    from linear_ce.bench.variants import describe_plan, plan_note

    monkeypatch.setenv(machine.MEASURE_ENV, "process")
    monkeypatch.setattr(machine, "chunk_rates", _synthetic(lambda b, lay: 100.0 if lay else 150.0))
    point = Point(*BIG, "fp32", "cpu")
    make_plan(*BIG, torch.float32, CPU, LinearCrossEntropyOptions())  # the warm-up's plan
    plan = describe_plan(point)
    assert (plan["rows_per_chunk"], plan["layout"]) == (256, "row-major")
    assert plan["fixed_rule"]["rows_per_chunk"] == 256
    assert set(plan["chunk_rates"]) == {
        f"{b} {lay}" for b in (128, 192, 256) for lay in ("class", "row")
    }
    note = plan_note(plan)
    loops = plan["row_loops"]
    assert loops in ("compiled", "torch")
    assert note.startswith(
        f"8×256 rows, row-major, SameDtype, {loops} row loops "
        f"(fixed rule: 8×256 rows, class-major, SameDtype, {loops} row loops)"
    )
    assert "GFLOP/s 128:150 192:150 256:150" in note
    info = machine_report()
    assert info["cpu_flags"] == machine.machine_info()["flags"]
    assert info["settings"][machine.MEASURE_ENV] == "process"


#: The distillation row's plan note past its chunks: bf16 inputs take bfloat16 half tiles
#: where the plan takes native bf16 GEMMs, else fp32 tiles of upcast weight blocks.
_NATIVE_BF16_NOTE = "bfloat16 row-major tiles, NativeHalf, compiled pair row loops"
_UPCAST_BF16_NOTE = "float32 class-major tiles, BlockUpcast, compiled pair row loops"


@pytest.mark.parametrize(
    "dtype, native, half, cpu",
    [
        ("fp32", "1", "1", "this"),
        ("fp32", "0", "1", "this"),
        ("bf16", "1", "1", "this"),
        ("bf16", "1", "1", "no-bf16"),
        ("bf16", "1", "0", "this"),
    ],
)
def test_bench_reports_the_distillation_plan(monkeypatch, dtype, native, half, cpu):
    """The bench's distillation row names the plan the call ran: its chunks of the valid
    rows, and whether the compiled pair loops took its tiles (in which dtype). Native bf16
    GEMMs depend on the CPU (AVX512-BF16 or AMX): ``this`` expects what this machine's
    flags give, ``no-bf16`` a CPU without them (an AVX2 one) on any machine."""
    from linear_ce.bench.config import Point
    from linear_ce.bench.variants import describe_divergence_plan, plan_note
    from linear_ce.engine.capability import NATIVE_HALF_GEMM_ENV

    monkeypatch.setenv(machine.MEASURE_ENV, "0")
    monkeypatch.setenv("LINEAR_CE_NATIVE_ROWS", native)
    monkeypatch.setenv(machine.TILE_LAYOUT_ENV, "class-major")
    monkeypatch.setenv(NATIVE_HALF_GEMM_ENV, half)
    monkeypatch.setenv(machine.CHUNK_ROWS_ENV, "16")
    if cpu == "no-bf16":
        monkeypatch.setattr("linear_ce.engine.plan.native_half_gemm", lambda dtype, device: False)
    if dtype == "fp32":
        note = "float32 class-major tiles, SameDtype, compiled pair row loops"
        if native == "0":
            note = "class-major, SameDtype, torch row loops"
    else:
        native_bf16 = cpu == "this" and native_half_gemm(torch.bfloat16, CPU)
        note = _NATIVE_BF16_NOTE if native_bf16 else _UPCAST_BF16_NOTE
    plan = describe_divergence_plan(Point(64, 16, 256, dtype, "cpu", head="divergence"))
    assert plan_note(plan) == f"4×16 rows, {note}"
    assert plan["row_loops"] == ("compiled pair" if native == "1" else "torch")


# --- the same result under every choice ----------------------------------------------------


def _exact(x, W, b, t, softcap):
    """Mean cross-entropy over the valid rows and its gradients, in float64."""
    x64, W64 = x.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    s = x64 @ W64.T + b.double()
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    valid = t != -100
    lse = torch.logsumexp(s[valid], dim=1)
    loss = (lse - s[valid].gather(1, t[valid, None])[:, 0]).mean()
    loss.backward()
    return loss, x64.grad, W64.grad


def _plain(x, W, b, t, softcap):
    x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
    s = F.linear(x, W, b)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    loss = F.cross_entropy(s, t)
    loss.backward()
    return loss, x.grad, W.grad


def _ours(x, W, b, t, softcap):
    x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
    loss = linear_ce.linear_cross_entropy(
        x, W, t, linear_bias=b, ignore_index=-100, softcap=softcap
    )
    loss.backward()
    return loss, x.grad, W.grad


CHOICES = {
    "fallback": {machine.MEASURE_ENV: "0"},
    "rows-48": {machine.CHUNK_ROWS_ENV: "48"},
    "rows-96": {machine.CHUNK_ROWS_ENV: "96"},
    "row-major": {machine.TILE_LAYOUT_ENV: "row-major", machine.CHUNK_ROWS_ENV: "64"},
    "class-major": {machine.TILE_LAYOUT_ENV: "class-major", machine.CHUNK_ROWS_ENV: "64"},
    "upcast": {"LINEAR_CE_NATIVE_HALF_GEMM": "0", machine.TILE_LAYOUT_ENV: "row-major"},
    "native": {"LINEAR_CE_NATIVE_HALF_GEMM": "1"},
    "native-step-4": {"LINEAR_CE_NATIVE_HALF_GEMM": "1", machine.STEP_ROWS_ENV: "4"},
    "native-exp": {"LINEAR_CE_NATIVE_HALF_GEMM": "1", machine.EXP_ENV: "exp"},
    "native-exp2": {"LINEAR_CE_NATIVE_HALF_GEMM": "1", machine.EXP_ENV: "exp2"},
    "upcast-exp": {"LINEAR_CE_NATIVE_HALF_GEMM": "0", machine.EXP_ENV: "exp"},
    "budget-small": {machine.MEMORY_BUDGET_ENV: "0.05"},
}


@pytest.mark.parametrize("softcap", [None, 20.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("choice", list(CHOICES))
def test_every_choice_computes_the_same_result(monkeypatch, choice, dtype, softcap):
    """Loss and gradients under each forced choice, many chunks (up to 16 of 48 rows),
    a quarter of the rows ignored and a bias, against float64: within 3·eps of the dtype or
    twice the plain expression's own error in that dtype, whichever is larger (the bound
    of every test; the chunks change how the sums are split, so their rounding)."""
    native = choice.startswith("native")
    if native and dtype != torch.float32 and not native_half_gemm(dtype, CPU):
        pytest.skip(f"no native {dtype} GEMMs on this CPU")
    for name, value in CHOICES[choice].items():
        monkeypatch.setenv(name, value)
    gen = torch.Generator().manual_seed(0)
    rows, features, classes = 700, 48, 900
    x = torch.randn(rows, features, generator=gen).to(dtype)
    W = (torch.randn(classes, features, generator=gen) / features**0.5).to(dtype)
    b = (torch.randn(classes, generator=gen) / 4).to(dtype)
    t = torch.randint(0, classes, (rows,), generator=gen)
    t[torch.rand(rows, generator=gen) < 0.25] = -100
    exact = _exact(x, W, b, t, softcap)
    plain = _plain(x, W, b, t, softcap)
    ours = _ours(x, W, b, t, softcap)
    for name, got, own, ref in zip(("loss", "grad x", "grad W"), ours, plain, exact, strict=True):
        assert got.dtype == dtype
        bound = max(3 * eps(dtype), 2 * rel_err(own, ref))
        assert rel_err(got, ref) <= bound, f"{choice} {dtype} {name}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("measure", ["process", "0"])
def test_a_call_without_gradients_takes_the_stretched_budgets_longest_chunks(monkeypatch, measure):
    """No gradients held: the one fp32 tile takes ``MEASURED_STRETCH`` times the default
    budget (512 rows at N=2048, D=1024, V=32768: 0.5 of the gradients' bytes), measured or
    not, and the rows are not measured for it; with gradients, a budget set by
    ``LINEAR_CE_MEMORY_BUDGET``, forced rows or half inputs, the plan is as before. The
    chunk loop asks for it when no gradient is wanted."""
    import linear_ce
    from linear_ce.engine import chunk_loop

    monkeypatch.setenv(machine.MEASURE_ENV, measure)
    fake = _synthetic(lambda b, lay: 100.0 if b == 128 else 90.0)
    monkeypatch.setattr(machine, "chunk_rates", fake)
    options = LinearCrossEntropyOptions()
    forward = make_plan(*BIG, torch.float32, CPU, options, gradients=False)
    assert forward.rows_per_chunk == 512 and not fake.asked
    grad_bytes = (BIG[0] + BIG[2]) * BIG[1] * 4
    assert 512 * BIG[2] * 4 <= plan_module.MEASURED_STRETCH * plan_module.BUDGET_SHARE * grad_bytes
    step = make_plan(*BIG, torch.float32, CPU, options).rows_per_chunk
    assert step == (128 if measure == "process" else 256)
    half = make_plan(*BIG, torch.bfloat16, CPU, options, gradients=False)
    assert half.rows_per_chunk == make_plan(*BIG, torch.bfloat16, CPU, options).rows_per_chunk
    monkeypatch.setenv(machine.MEMORY_BUDGET_ENV, "0.25")
    assert make_plan(*BIG, torch.float32, CPU, options, gradients=False) == make_plan(
        *BIG, torch.float32, CPU, options
    )
    monkeypatch.delenv(machine.MEMORY_BUDGET_ENV)
    monkeypatch.setenv("LINEAR_CE_CHUNK_ROWS", "192")
    assert make_plan(*BIG, torch.float32, CPU, options, gradients=False).rows_per_chunk == 192
    monkeypatch.delenv("LINEAR_CE_CHUNK_ROWS")

    seen = []
    original = chunk_loop.run_chunks

    def watched(input, weight, bias, head, transform, plan, **kwargs):
        seen.append(plan.rows_per_chunk)
        return original(input, weight, bias, head, transform, plan, **kwargs)

    monkeypatch.setattr(chunk_loop, "run_chunks", watched)
    # The budget's rows: 0.25 · (2048 + 1024) · 256 / 1024 = 192; stretched, 384 (six
    # chunks, evened to 352).
    x = torch.randn(2048, 256, dtype=torch.float64)
    w = torch.randn(1024, 256, dtype=torch.float64) / 16
    t = torch.randint(0, 1024, (2048,))
    with torch.no_grad():
        loss = linear_ce.linear_cross_entropy(x, w, t)
    linear_ce.linear_cross_entropy(x.requires_grad_(), w, t).backward()
    assert seen == [352, 192]
    expected = torch.nn.functional.cross_entropy(x.detach() @ w.T, t)
    # 3 eps(fp64): both sums run in fp64 over 2048 · 1024 logits of O(1).
    assert (loss - expected).abs() <= 3 * torch.finfo(torch.float64).eps * expected.abs()


def test_a_capped_instruction_set_keys_its_own_cache(monkeypatch):
    """A run with torch's or its BLAS's instruction set capped below the CPU's (an AVX2-only
    CPU reproduced on a wider one) measures other rates: its cache key differs; without a
    cap the key is the plain one, so existing caches stay valid."""
    from linear_ce.engine import machine

    for name in (
        "ATEN_CPU_CAPABILITY",
        "ONEDNN_MAX_CPU_ISA",
        "MKL_CBWR",
        "MKL_ENABLE_INSTRUCTIONS",
    ):
        monkeypatch.delenv(name, raising=False)
    plain = machine._machine_key()
    assert set(plain) == {"cpu", "flags", "torch"}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = machine._machine_key()
    assert capped["isa"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"} and capped != plain
