"""The native-half-GEMM answer against the CPU's own flags, read here from /proc/cpuinfo.

oneDNN runs bf16 GEMMs natively with AVX512-BF16 or AMX-BF16, fp16 ones with
AVX512-FP16 or AMX-FP16; the expectations below come from the flags this
test reads itself, not from :func:`linear_ce.engine.capability.native_half_gemm`.
``LINEAR_CE_NATIVE_HALF_GEMM=0`` in the environment (issue 16) forces the
answer to "not native"; any other value of it is not this test's business.
"""

from __future__ import annotations

import os

import pytest
import torch

from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine.capability import native_half_gemm
from linear_ce.engine.gemm import NativeHalf
from linear_ce.engine.plan import make_plan

CPU = torch.device("cpu")
#: The instructions oneDNN needs for each half dtype (any one of them suffices).
INSTRUCTIONS = {
    torch.bfloat16: {"avx512_bf16", "amx_bf16"},
    torch.float16: {"avx512_fp16", "amx_fp16"},
}
OVERRIDE = os.environ.get("LINEAR_CE_NATIVE_HALF_GEMM")


def _flags_of_every_cpu() -> set[str]:
    flags: set[str] = set()
    with open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                flags.update(value.split())
    return flags


def _expected_native(dtype: torch.dtype) -> bool:
    if OVERRIDE == "0":
        return False
    if OVERRIDE is not None:
        pytest.skip(f"LINEAR_CE_NATIVE_HALF_GEMM={OVERRIDE!r} decides the answer")
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo to read the CPU flags from")
    has_instructions = bool(INSTRUCTIONS[dtype] & _flags_of_every_cpu())
    return has_instructions and torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("dtype", list(INSTRUCTIONS), ids=str)
def test_cpu_answer_follows_the_cpu_flags(dtype):
    assert native_half_gemm(dtype, CPU) is _expected_native(dtype)


@pytest.mark.parametrize("dtype", list(INSTRUCTIONS), ids=str)
def test_plan_takes_native_half_gemms_exactly_where_the_cpu_has_them(dtype):
    native = _expected_native(dtype)
    plan = make_plan(256, 64, 1000, dtype, CPU, LinearCrossEntropyOptions(batch_chunk_size=16))
    assert isinstance(plan.gemm, NativeHalf) is native
    # On both paths a sum over many chunks is held in fp32, split over the half result.
    assert (plan.weight_grad_dtype, plan.weight_grad) == (torch.float32, "split")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_full_precision_is_never_a_half_gemm(dtype):
    assert native_half_gemm(dtype, CPU) is False
    assert native_half_gemm(dtype, torch.device("cuda")) is False


@pytest.mark.parametrize("dtype", list(INSTRUCTIONS), ids=str)
def test_cuda_is_native_and_other_devices_are_not(dtype):
    assert native_half_gemm(dtype, torch.device("cuda")) is True
    assert native_half_gemm(dtype, torch.device("meta")) is False
