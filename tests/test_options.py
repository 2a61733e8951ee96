"""LinearCrossEntropyOptions (frozen, validated, readable) and the chunk-size rule it selects."""

import dataclasses

import pytest
import torch

from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine.capability import native_half_gemm
from linear_ce.engine.gemm import BlockUpcast, CudaOutDtype, NativeHalf, SameDtype, Upcast
from linear_ce.engine.plan import choose_chunk_rows, choose_vocab_blocks, make_plan


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


def _rows(rows, feat, classes, dtype=torch.float32, acc=None, tiles=1, **options):
    return choose_chunk_rows(
        rows, feat, classes, LinearCrossEntropyOptions(**options), dtype, acc or dtype, tiles
    )


def test_explicit_batch_chunk_size():
    assert _rows(1000, 64, 50_000, batch_chunk_size=37) == 37
    assert _rows(1000, 64, 50_000, batch_chunk_size=37, chunking_method=None) == 37
    assert _rows(20, 64, 50_000, batch_chunk_size=37) == 20  # never more than the rows
    assert _rows(0, 64, 50_000, batch_chunk_size=37) == 1


def test_no_chunking_is_one_chunk():
    assert _rows(1000, 64, 50_000, chunking_method=None) == 1000


def test_aspect_ratio_rule():
    # ceil(50000/256) = 196 classes per feature; ceil(4096/196) = 21 -> next power of two 32.
    assert _rows(4096, 256, 50_000, chunking_method="aspect_ratio") == 32
    assert _rows(4096, 256, 50_000, chunking_method="aspect_ratio:4") == 8
    assert _rows(4096, 256, 50_000, chunking_method="aspect_ratio:64") == 1  # at least one row
    # V <= F: ratio 1, all 100 rows -> 128, clamped to the rows.
    assert _rows(100, 512, 300, chunking_method="aspect_ratio") == 100
    # ceil(128256/4096) = 32; 8192/32 = 256 exactly (already a power of two).
    assert _rows(8192, 4096, 128_256, chunking_method="aspect_ratio") == 256


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", ["1", "0"])
def test_plan_share_by_path(monkeypatch, dtype, native):
    """Half inputs on the non-native CPU path take the larger share (their gradients have
    half the bytes, the scratch stays fp32). The native path keeps a half tile (the same
    share at 2 bytes per logit) whose fp32 math runs 64 rows at a time. At 2048/1024/32768
    both then have at most 4 chunks, so the weight gradient is summed in the result
    itself and the split sum's plane (V·F bytes) goes to the chunks: 512 rows
    (non-native; 256 without it) and 1056 evened out to 2 × 1024 (native; 544 without
    it). fp32: 256 rows."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", native)
    plan = make_plan(2048, 1024, 32768, dtype, torch.device("cpu"), LinearCrossEntropyOptions())
    if dtype == torch.float32:
        assert plan.rows_per_chunk == plan.rows_per_step == 256
    elif isinstance(plan.gemm, BlockUpcast):
        assert plan.rows_per_chunk == plan.rows_per_step == 512
        assert plan.weight_grad == "direct"
    else:
        assert isinstance(plan.gemm, NativeHalf)
        assert (plan.rows_per_chunk, plan.rows_per_step) == (1024, 64)
        assert plan.weight_grad == "direct"
    if native == "0" and dtype != torch.float32:
        assert isinstance(plan.gemm, BlockUpcast)


@pytest.mark.parametrize(
    ("native", "rows", "chunk", "held"),
    [
        ("1", 4352, 1088, "direct"),  # 4 chunks with the plane's bytes
        ("1", 4480, 576, "split"),  # 5 with them: the plane and half-share chunks
        ("0", 2048, 512, "direct"),
        ("0", 4096, 288, "split"),
    ],
)
def test_direct_sum_at_most_four_chunks(monkeypatch, native, rows, chunk, held):
    """``"auto"`` (``"balanced"``) on either CPU path: the weight gradient is summed in
    the result itself exactly when the chunks planned without the split sum's plane
    number at most ``DIRECT_SUM_MAX_CHUNKS`` (4); else split, with chunks of the plain share."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", native)
    plan = make_plan(
        rows, 1024, 32768, torch.bfloat16, torch.device("cpu"), LinearCrossEntropyOptions()
    )
    if native == "1" and not isinstance(plan.gemm, NativeHalf):
        pytest.skip("this CPU has no native bf16 GEMMs")
    assert (plan.rows_per_chunk, plan.weight_grad) == (chunk, held)
    assert plan.weight_grad_dtype == (torch.bfloat16 if held == "direct" else torch.float32)


def _blocks(rows, features, classes, bytes_per_logit=4, bytes_per_row=0, **options):
    return choose_vocab_blocks(
        rows,
        features,
        classes,
        LinearCrossEntropyOptions(**options),
        torch.float32,
        torch.float32,
        bytes_per_logit,
        bytes_per_row,
    )


def test_vocab_pass_rule():
    # Gradients (2048 + 32768)·1024·4 B = 142 606 336 B; a quarter over all 2048 rows of
    # 4-byte logits is 4352 classes (a multiple of 128).
    assert _blocks(2048, 1024, 32_768) == (2048, 4352)
    assert _blocks(2048, 1024, 32_768, bytes_per_logit=8) == (2048, 2176)
    assert _blocks(2048, 1024, 32_768, chunking_method="budget:2") == (2048, 2176)
    # 64k rows would leave 384 classes: rows go into groups sized for 512 classes,
    # (98 304·1024·4 / 4) / (512·4) = 49 152 rows.
    assert _blocks(65_536, 1024, 32_768) == (49_152, 512)
    # Gathered rows (8 KiB of buffers per row) come out of the same budget:
    # (35 651 584 − 2048·8192) / (2048·4) = 2304 classes.
    assert _blocks(2048, 1024, 32_768, bytes_per_row=8192) == (2048, 2304)
    # ... and size the groups when they would leave fewer than 512 classes:
    # 100 663 296 // (512·4 + 8192) = 9830 rows -> 9824, then 513 classes -> 512.
    assert _blocks(65_536, 1024, 32_768, bytes_per_row=8192) == (9824, 512)
    # Tiny features: groups of at least 128 rows, blocks of at least 512 classes.
    assert _blocks(2400, 8, 700) == (128, 512)
    # Never more classes than the vocabulary; batch_chunk_size sets the groups.
    assert _blocks(64, 1024, 300) == (64, 300)
    assert _blocks(2048, 1024, 32_768, batch_chunk_size=100) == (100, 32_768)
    assert _blocks(0, 1024, 300) == (1, 300)


def test_budget_rule():
    # Gradients (8192 + 32000)·4096·4 B = 658 505 728 B; a quarter is 164 626 432 B;
    # a (1, 32000) fp32 row of scratch is 128 000 B -> 1286 rows, rounded down to a
    # multiple of 32 for the GEMM -> 1280; evened out over its 7 chunks: 1171 -> 1184.
    assert _rows(8192, 4096, 32_000) == 1184
    assert _rows(8192, 4096, 32_000, chunking_method="budget") == 1184
    # A budget that divides the rows evenly stays: 272 rows -> 256, 8 chunks of 256.
    assert _rows(2048, 1024, 32_768) == 256
    assert _rows(8192, 4096, 32_000, chunking_method="budget:2") == 640  # 643 rounded
    assert _rows(8192, 4096, 32_000, tiles=2) == 640  # two scratch tiles (e.g. softcap)
    # bf16 gradients with fp32 scratch: half the budget for the same row bytes.
    assert _rows(8192, 4096, 32_000, dtype=torch.bfloat16, acc=torch.float32) == 640
    # A budget under 32 rows is not rounded (to zero).
    assert _rows(64, 16, 100_000, chunking_method="budget:128") == 1
    # Budget below 128 rows: 128 for efficient GEMMs (here the budget gives 69).
    assert _rows(4096, 256, 50_000) == 128
    assert _rows(4096, 256, 50_000, chunking_method="budget:4") == 32
    # Never more than the rows.
    assert _rows(100, 4096, 32_000) == 100
    assert _rows(0, 4096, 32_000) == 1


def test_plan_resolves_policy_and_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def plan(dtype, device, **options):
        return make_plan(64, 16, 100, dtype, device, LinearCrossEntropyOptions(**options))

    p = plan(torch.float32, cpu)
    assert (p.policy, p.acc_dtype, p.weight_grad_dtype, type(p.gemm)) == (
        "accurate",
        torch.float32,
        torch.float32,
        SameDtype,
    )
    p = plan(torch.bfloat16, cpu, acc_policy="accurate")
    assert (p.policy, p.acc_dtype, p.weight_grad_dtype, p.weight_grad, type(p.gemm)) == (
        "accurate",
        torch.float32,
        torch.float32,
        "wide",
        Upcast,
    )
    # "auto" for half inputs on a CPU: "balanced", native half GEMMs where the CPU has them,
    # else the weight upcast in vocabulary blocks; an fp32 weight-gradient sum held split
    # over more than DIRECT_SUM_MAX_CHUNKS chunks, in the result itself over fewer.
    for dtype in (torch.bfloat16, torch.float16):
        backend = NativeHalf if native_half_gemm(dtype, cpu) else BlockUpcast
        for chunk, held, sum_dtype in [(4, "split", torch.float32), (16, "direct", dtype)]:
            p = plan(dtype, cpu, batch_chunk_size=chunk)
            assert (p.policy, p.weight_grad_dtype, p.weight_grad, type(p.gemm)) == (
                "balanced",
                sum_dtype,
                held,
                backend,
            )
    p = plan(torch.float16, cpu, acc_policy="compact")
    assert (p.weight_grad_dtype, p.weight_grad, type(p.gemm)) == (
        torch.float16,
        "direct",
        NativeHalf if native_half_gemm(torch.float16, cpu) else BlockUpcast,
    )
    p = plan(torch.bfloat16, cpu, acc_dtype=torch.bfloat16)
    assert (p.acc_dtype, type(p.gemm)) == (torch.bfloat16, SameDtype)
    # CUDA: native half GEMMs with fp32 results, except for "accurate".
    for policy, backend in [
        ("accurate", Upcast),
        ("auto", Upcast),
        ("balanced", CudaOutDtype),
        ("compact", CudaOutDtype),
    ]:
        assert type(plan(torch.bfloat16, cuda, acc_policy=policy).gemm) is backend
    assert type(plan(torch.float32, cuda, acc_policy="compact").gemm) is SameDtype
    assert plan(torch.float32, cpu, batch_chunk_size=7).rows_per_chunk == 7
