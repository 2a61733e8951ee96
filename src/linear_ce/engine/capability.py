"""Whether a device multiplies fp16/bf16 matrices natively (fast) or by emulation.

A CPU without the matching instructions runs a bf16 GEMM one to two orders of
magnitude slower than fp32 (scalar conversion loops), so the plan upcasts
there. The answer comes from the CPU's feature flags, not from timing, so it
is the same on every call.

The environment variable ``LINEAR_CE_NATIVE_HALF_GEMM=0`` makes every CPU
answer ``False``, so the path for CPUs without native half GEMMs runs (and is
tested and benchmarked) on any machine; ``1``, ``auto`` or unset means detect. It
is read on every call. Whether the plan then *takes* the native GEMMs the flags
promise is :func:`linear_ce.engine.machine.half_gemm_pays`'s answer: measured under
``auto`` (a CPU's fp16 GEMMs may run no faster than its fp32 ones), always under ``1``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from linear_ce.engine.environment import read

__all__ = [
    "HALF_DTYPES",
    "NATIVE_HALF_GEMM_ENV",
    "cpu_flags",
    "last_level_cache_bytes",
    "native_half_gemm",
    "native_half_mode",
]

NATIVE_HALF_GEMM_ENV = "LINEAR_CE_NATIVE_HALF_GEMM"
#: The half dtypes: computed in fp32 by default, with their own GEMM paths.
HALF_DTYPES = (torch.float16, torch.bfloat16)

# oneDNN's fast bf16 GEMM needs AVX512-BF16 or AMX; fp16 needs AVX512-FP16 or AMX-FP16.
_CPU_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


# oneDNN's instruction sets in rising order (its names for ONEDNN_MAX_CPU_ISA; the avx10
# names alias the ones before them), and the lowest that holds each half dtype's GEMM.
_ONEDNN_ISAS = (
    "sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni",
    "avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx", "avx512_core_amx_fp16",
)  # fmt: skip
_ONEDNN_ALIASES = {
    "avx10_1_512": "avx512_core_fp16",
    "avx10_1_512_amx": "avx512_core_amx",
    "avx10_1_512_amx_fp16": "avx512_core_amx_fp16",
}
_ONEDNN_LOWEST = {torch.bfloat16: "avx512_core_bf16", torch.float16: "avx512_core_fp16"}


def _onednn_allows(dtype: torch.dtype) -> bool:
    """False where ``ONEDNN_MAX_CPU_ISA`` (or its older name ``DNNL_MAX_CPU_ISA``) caps
    oneDNN below the instructions of ``dtype``'s native GEMM: oneDNN then emulates it,
    whatever the CPU's flags say (how an AVX2-only CPU is reproduced on a newer one). An
    unknown name, ``ALL`` or ``DEFAULT`` caps nothing."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    cap = cap.strip().lower()
    cap = _ONEDNN_ALIASES.get(cap, cap)
    if cap not in _ONEDNN_ISAS:
        return True
    return _ONEDNN_ISAS.index(cap) >= _ONEDNN_ISAS.index(_ONEDNN_LOWEST[dtype])


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    return _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def last_level_cache_bytes() -> int | None:
    """The size of the CPU's last-level cache in bytes (Linux sysfs, ``cpu0``'s highest
    level; ``None`` where unknown)."""
    return _last_level_cache_bytes()


@functools.cache
def _last_level_cache_bytes() -> int | None:
    best: tuple[int, int] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        number, unit = (size[:-1], units[size[-1]]) if size[-1:] in units else (size, 1)
        if number.isdigit() and (best is None or level > best[0]):
            best = (level, int(number) * unit)
    return None if best is None else best[1]


def native_half_gemm(dtype: torch.dtype, device: torch.device) -> bool:
    """True where ``torch.mm`` of two ``dtype`` (fp16/bf16) matrices runs natively.

    CUDA: always. CPU: when the CPU advertises the instructions oneDNN uses
    (Linux ``/proc/cpuinfo`` flags; elsewhere ``False``, the safe answer) and
    ``ONEDNN_MAX_CPU_ISA`` does not cap oneDNN below them, unless
    ``LINEAR_CE_NATIVE_HALF_GEMM=0`` (see the module doc).
    (This is whether they exist; :func:`linear_ce.engine.machine.half_gemm_pays` decides
    whether the plan takes them.)

    Example::

        >>> native_half_gemm(torch.float16, torch.device("cuda"))
        True
    """
    if dtype not in _CPU_FLAGS:
        return False
    if device.type == "cuda":
        return True
    if device.type != "cpu" or not _detect_on_cpu() or not torch.backends.mkldnn.is_available():
        return False
    if not _onednn_allows(dtype):
        return False
    return any(flag in _cpu_flags() for flag in _CPU_FLAGS[dtype])


def native_half_mode() -> str:
    """``LINEAR_CE_NATIVE_HALF_GEMM``: ``"0"`` (never native), ``"1"`` (native wherever
    the flags allow) or ``"auto"`` (unset: native where the flags allow and it measures
    faster)."""
    return read(NATIVE_HALF_GEMM_ENV)


def _detect_on_cpu() -> bool:
    """False when ``LINEAR_CE_NATIVE_HALF_GEMM=0`` forces the non-native path."""
    return native_half_mode() != "0"
