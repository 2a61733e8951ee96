"""LinearCrossEntropyOptions (frozen, validated, readable) and what its chunk rules promise.

The chunk rules are judged by their documented contract, never by sizes read off the
code: a ``"budget"`` plan's ``(chunk, V)`` tiles fit the budget the rule states (unless
the stated floor of efficient GEMM rows binds), ``"aspect_ratio"`` is torch's rule,
``batch_chunk_size`` is taken as given, and every rule computes the same loss and
gradients as the float64 plain expression. Which CPU path each setting takes, and that
each computes the same result, is in ``tests/test_cpu_paths.py``; the measured transient
memory of a call against the README's bounds in ``tests/test_memory_bounds.py``.
"""

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine.plan import (
    BUDGET_SHARE,
    HALF_CPU_BUDGET_SHARE,
    MIN_CLASS_BLOCK,
    MIN_EFFICIENT_ROWS,
    make_plan,
)


def test_defaults():
    opts = LinearCrossEntropyOptions()
    assert (opts.allow_retain_graph, opts.batch_chunk_size, opts.chunking_method) == (
        False,
        None,
        "auto",
    )
    assert (opts.acc_policy, opts.acc_dtype) == ("auto", None)


def test_frozen():
    opts = LinearCrossEntropyOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.batch_chunk_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.acc_policy = "compact"


def test_replace_validates():
    opts = LinearCrossEntropyOptions(batch_chunk_size=8, chunking_method=None)
    assert dataclasses.replace(opts, batch_chunk_size=16).batch_chunk_size == 16
    with pytest.raises(ValueError, match="batch_chunk_size must be a positive int"):
        dataclasses.replace(opts, batch_chunk_size=0)


def test_equal_and_hashable():
    a = LinearCrossEntropyOptions(acc_policy="compact", acc_dtype=torch.float32)
    b = LinearCrossEntropyOptions(acc_policy="compact", acc_dtype=torch.float32)
    assert a == b and hash(a) == hash(b)
    assert a != LinearCrossEntropyOptions(acc_policy="balanced", acc_dtype=torch.float32)


def test_repr_is_readable():
    opts = LinearCrossEntropyOptions(
        batch_chunk_size=256, acc_policy="compact", acc_dtype=torch.float32
    )
    assert repr(opts) == (
        "LinearCrossEntropyOptions(allow_retain_graph=False, batch_chunk_size=256, "
        "chunking_method='auto', acc_policy='compact', acc_dtype=torch.float32)"
    )


@pytest.mark.parametrize(
    "method", [None, "auto", "budget", "budget:3", "aspect_ratio", "aspect_ratio:2"]
)
def test_valid_chunking_methods(method):
    assert LinearCrossEntropyOptions(chunking_method=method).chunking_method == method


CPU = torch.device("cpu")
HALF = (torch.bfloat16, torch.float16)
#: Shapes from one row to 64k, features 8 to 4096 (the efficient-rows floor binds at
#: the small ones), vocabularies from 300 to Llama 3's 128256.
SHAPES = list(itertools.product([1, 100, 2048, 65536], [8, 64, 1024, 4096], [300, 32000, 128256]))


def _plan(rows, features, classes, dtype, tiles=1, vocab_pass=False, **options):
    return make_plan(
        rows,
        features,
        classes,
        dtype,
        CPU,
        LinearCrossEntropyOptions(**options),
        tiles=tiles,
        vocab_pass=vocab_pass,
    )


def _divisor(method: str) -> int:
    return int(method.partition(":")[2] or 1)


@pytest.fixture(params=["1", "0"], ids=["detected", "forced-upcast"])
def cpu_path(request, monkeypatch):
    """Both CPU paths of half inputs: detected (native half GEMMs where the CPU has
    them) and ``LINEAR_CE_NATIVE_HALF_GEMM=0``; the default memory budget."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", request.param)
    monkeypatch.delenv("LINEAR_CE_MEMORY_BUDGET", raising=False)
    return request.param


def _budget_share(plan, rows, features, classes) -> float:
    """The share of the gradients' bytes the plan's tiles may take, as documented in
    :func:`linear_ce.engine.plan.make_plan`: ``BUDGET_SHARE``; ``HALF_CPU_BUDGET_SHARE`` for half
    inputs summed in fp32 on a CPU (either path); plus the split sum's plane ``V·F``
    half values where the weight gradient is instead held in the result itself."""
    half_cpu = plan.input_dtype in HALF and plan.acc_dtype == torch.float32
    share = HALF_CPU_BUDGET_SHARE if half_cpu and plan.policy != "accurate" else BUDGET_SHARE
    if half_cpu and plan.policy == "balanced" and plan.weight_grad == "direct":
        share += classes / ((rows + classes) * plan.input_dtype.itemsize)
    return share


@pytest.mark.parametrize("method", ["auto", "budget:2", "budget:4"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tiles", [1, 2, 3])
def test_budget_plan_fits_its_budget(cpu_path, method, dtype, tiles):
    """The chunk loop's tiles (``tiles`` of ``(chunk, V)`` in the accumulation dtype, or
    one half tile of 2 bytes per logit where native half GEMMs keep one) take at most the
    stated share of the gradients' bytes ``(N + V)·F·itemsize``, divided by N for
    ``"budget:N"``, unless the chunk is the stated floor of ``MIN_EFFICIENT_ROWS / N``
    rows (or all rows)."""
    divisor = _divisor(method)
    for rows, features, classes in SHAPES:
        plan = _plan(rows, features, classes, dtype, tiles, chunking_method=method)
        chunk = plan.rows_per_chunk
        assert 1 <= chunk <= max(rows, 1)
        grads = (rows + classes) * features * dtype.itemsize
        if plan.rows_per_step < chunk:  # a half tile, the fp32 math a step of rows at a time
            tile_bytes = chunk * classes * dtype.itemsize
        else:
            tile_bytes = tiles * chunk * classes * plan.acc_dtype.itemsize
        allowed = _budget_share(plan, rows, features, classes) * grads / divisor
        floor = min(rows, MIN_EFFICIENT_ROWS // divisor)
        assert tile_bytes <= allowed or chunk <= floor, (
            f"{rows}x{features}x{classes}: {chunk} rows take {tile_bytes / grads:.3f} of the "
            f"gradients' bytes, the budget {allowed / grads:.3f}"
        )


@pytest.mark.parametrize("method", ["auto", "budget:4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_pass_blocks_fit_the_budget(cpu_path, method, dtype):
    """The vocabulary pass's ``(rows, C)`` tiles take at most ``BUDGET_SHARE / N`` of the
    gradients' bytes, unless the stated floors bind: blocks of ``MIN_CLASS_BLOCK / N``
    classes and groups of ``MIN_EFFICIENT_ROWS / N`` rows."""
    divisor = _divisor(method)
    for (rows, features, classes), tiles in itertools.product(SHAPES, (1, 2)):
        plan = _plan(rows, features, classes, dtype, tiles, True, chunking_method=method)
        group, block = plan.rows_per_chunk, plan.classes_per_block
        assert 1 <= group <= max(rows, 1) and 1 <= block <= classes
        grads = (rows + classes) * features * dtype.itemsize
        tile_bytes = tiles * group * block * plan.acc_dtype.itemsize
        at_floor = block <= min(classes, MIN_CLASS_BLOCK // divisor) or group <= min(
            rows, MIN_EFFICIENT_ROWS // divisor
        )
        assert tile_bytes <= BUDGET_SHARE * grads / divisor or at_floor, (rows, features, classes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_smaller_budget_never_gives_longer_chunks(cpu_path, dtype):
    for rows, features, classes in SHAPES:
        chunks = [
            _plan(rows, features, classes, dtype, chunking_method=m).rows_per_chunk
            for m in ("budget", "budget:2", "budget:4", "budget:16")
        ]
        assert chunks == sorted(chunks, reverse=True), (rows, features, classes, chunks)


@pytest.mark.parametrize("divisor", [1, 2, 4, 64])
def test_aspect_ratio_is_torchs_rule(divisor):
    """torch's rule: the ``(chunk, V)`` logits about as many elements as the ``(N, F)``
    input: ``chunk·N`` the power of two at or above ``ceil(rows / ceil(V / F))``, within
    ``[1, rows]``."""
    method = "aspect_ratio" if divisor == 1 else f"aspect_ratio:{divisor}"
    for rows, features, classes in [*SHAPES, (4096, 256, 50_000), (100, 512, 300)]:
        plan = _plan(rows, features, classes, torch.float32, chunking_method=method)
        chunk = plan.rows_per_chunk
        target = math.ceil(rows / math.ceil(classes / features))
        power = 1 << (target - 1).bit_length()
        assert chunk == max(1, min(power // divisor, rows)), (rows, features, classes, chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_chunk_size_is_taken_as_given(cpu_path, dtype):
    for rows, size in [(1000, 37), (20, 37), (0, 37), (4096, 1), (4096, 4096)]:
        for method in ("auto", None):
            plan = _plan(rows, 64, 50_000, dtype, batch_chunk_size=size, chunking_method=method)
            assert plan.rows_per_chunk == max(1, min(size, rows))
    assert _plan(1000, 64, 50_000, torch.float32, chunking_method=None).rows_per_chunk == 1000


def _training_step(options, dtype, x, W, t):
    x, W = (a.to(dtype).requires_grad_() for a in (x, W))
    loss = linear_ce.linear_cross_entropy(x, W, t, label_smoothing=0.1, options=options)
    return [loss.detach(), *torch.autograd.grad(loss, [x, W])]


def _plain_step(dtype, x, W, t):
    x, W = (a.to(dtype).requires_grad_() for a in (x, W))
    loss = F.cross_entropy(x @ W.T, t, label_smoothing=0.1)
    return [loss.detach(), *torch.autograd.grad(loss, [x, W])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_chunk_rule_computes_the_plain_result(cpu_path, dtype):
    """Each rule chooses other chunks (asserted: at least four different sizes, from
    one chunk to 58); each gives the float64 plain expression's loss and
    gradients within 3·eps(dtype), or twice the plain same-dtype expression's error
    (its own rounding, measured here)."""
    g = torch.Generator().manual_seed(7)
    rows, features, classes = 400, 16, 300
    x = torch.randn(rows, features, generator=g, dtype=torch.float64)
    W = torch.randn(classes, features, generator=g, dtype=torch.float64) / 2
    t = torch.randint(0, classes, (rows,), generator=g)
    t[::7] = -100
    exact = _plain_step(torch.float64, x.to(dtype), W.to(dtype), t)
    plain = _plain_step(dtype, x, W, t)
    bounds = [max(3 * eps(dtype), 2 * rel_err(p, e)) for p, e in zip(plain, exact, strict=True)]
    rules = [
        {"chunking_method": None},
        {"chunking_method": "auto"},
        {"chunking_method": "budget:4"},
        {"chunking_method": "aspect_ratio:2"},
        {"batch_chunk_size": 7},
    ]
    sizes = set()
    for rule in rules:
        options = LinearCrossEntropyOptions(**rule)
        sizes.add(make_plan(rows, features, classes, dtype, CPU, options).rows_per_chunk)
        got = _training_step(options, dtype, x, W, t)
        for name, a, e, bound in zip(("loss", "grad_x", "grad_W"), got, exact, bounds, strict=True):
            assert rel_err(a, e) <= bound, (rule, name, rel_err(a, e), bound)
    assert len(sizes) >= 4, sizes
