"""Whether a CPU multiplies half matrices natively: judged by what the answer promises.

``native_half_gemm`` says a ``dtype`` GEMM runs natively (fast) on a device. The tests
here check that promise from outside the implementation: where the answer is "native",
a half GEMM measures about as fast as an fp32 one (emulation is one to two orders of
magnitude slower), and it agrees with torch's own CPU-capability query where torch has
one. ``LINEAR_CE_NATIVE_HALF_GEMM=0`` forces "not native" and any value it does not
know is a clear error. Which path each answer selects, and that every path computes the
same result, is tested in ``tests/test_cpu_paths.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

from linear_ce.engine.capability import NATIVE_HALF_GEMM_ENV, native_half_gemm

CPU = torch.device("cpu")
HALF = [torch.bfloat16, torch.float16]


def _best_seconds(dtype: torch.dtype, size: int = 256, repeats: int = 10) -> float:
    """The fastest of ``repeats`` ``size``³ GEMMs in ``dtype`` (the minimum is what the
    hardware can do; other processes on the machine only ever add to it)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    a @ b  # first call: oneDNN's kernel selection and allocation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_native_means_as_fast_as_fp32(monkeypatch, dtype):
    """Where the answer is "native", a half GEMM runs within 4× of fp32's time: native
    bf16 (AVX512-BF16/AMX) and fp16 (AVX512-FP16/AMX) GEMMs measure 0.3–1.1× fp32 on a
    Sapphire Rapids, emulated ones 10–100× (scalar conversion loops)."""
    monkeypatch.delenv(NATIVE_HALF_GEMM_ENV, raising=False)
    if not native_half_gemm(dtype, CPU):
        pytest.skip(f"this CPU has no native {dtype} GEMMs (nothing is promised)")
    ratio = min(_best_seconds(dtype) / _best_seconds(torch.float32) for _ in range(2))
    assert ratio < 4, f"{dtype} GEMM {ratio:.1f}x the fp32 one: emulated, not native"


def test_bf16_answer_agrees_with_torchs_cpu_query(monkeypatch):
    """torch reports AVX512-BF16 and AMX through its own CPU-feature library (not
    ``/proc/cpuinfo``); oneDNN runs bf16 GEMMs natively with either."""
    query = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported",
                                                         "_is_amx_tile_supported")]  # fmt: skip
    if None in query or not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no CPU-feature query for bf16 (or no oneDNN)")
    monkeypatch.delenv(NATIVE_HALF_GEMM_ENV, raising=False)
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    assert native_half_gemm(torch.bfloat16, CPU) is any(ask() for ask in query)


@pytest.mark.parametrize(
    ("cap", "bf16", "fp16"),
    [
        ("AVX2", False, False),
        ("avx512_core_vnni", False, False),
        ("AVX512_CORE_BF16", None, False),
        ("avx10_1_512", None, None),
        ("AVX512_CORE_AMX", None, None),
        ("ALL", None, None),
        ("", None, None),
    ],
)
def test_a_capped_onednn_is_not_native(monkeypatch, cap, bf16, fp16):
    """oneDNN capped below a half dtype's instructions (``ONEDNN_MAX_CPU_ISA``, how the
    suite reproduces an AVX2-only CPU) emulates its GEMMs whatever the CPU's flags say;
    ``None``: the uncapped answer (the flags')."""
    monkeypatch.delenv(NATIVE_HALF_GEMM_ENV, raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    flags = {dtype: native_half_gemm(dtype, CPU) for dtype in HALF}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    for dtype, expected in ((torch.bfloat16, bf16), (torch.float16, fp16)):
        want = flags[dtype] if expected is None else expected
        assert native_half_gemm(dtype, CPU) is want, (cap, dtype)


def test_amx_fp16_means_native_fp16(monkeypatch):
    ask = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    if ask is None or not ask() or not torch.backends.mkldnn.is_available():
        pytest.skip("no AMX-FP16 reported by torch")
    monkeypatch.delenv(NATIVE_HALF_GEMM_ENV, raising=False)
    assert native_half_gemm(torch.float16, CPU) is True


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_override_zero_forces_not_native(monkeypatch, dtype):
    monkeypatch.setenv(NATIVE_HALF_GEMM_ENV, "0")
    assert native_half_gemm(dtype, CPU) is False
    # CUDA's half GEMMs are always native: the override is about CPUs only.
    assert native_half_gemm(dtype, torch.device("cuda")) is True


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_unknown_override_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv(NATIVE_HALF_GEMM_ENV, value)
    with pytest.raises(ValueError, match=rf"{NATIVE_HALF_GEMM_ENV} must be 0 .*got '{value}'"):
        native_half_gemm(torch.bfloat16, CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_full_precision_is_never_a_half_gemm(dtype):
    assert native_half_gemm(dtype, CPU) is False
    assert native_half_gemm(dtype, torch.device("cuda")) is False


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cuda_is_native_and_other_devices_are_not(dtype):
    assert native_half_gemm(dtype, torch.device("cuda")) is True
    assert native_half_gemm(dtype, torch.device("meta")) is False
