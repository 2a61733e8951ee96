"""``scripts/gpu_check.sh --dry-run`` on any machine: it prints the commands the GPU check
runs (the CUDA tests with the eager and the Triton rows, the benchmark's two runs) and
collects the CUDA tests, which must import and be found without a GPU; the Triton row
kernels compile for a GPU; a CUDA call's plan."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Compiles one variant of each Triton row kernel for an H100 (sm_90) to PTX, in a process
#: without Triton's interpreter: what the interpreter accepts but a GPU's compiler would
#: refuse (a type that differs between branches, an unsupported construct) fails here.
_COMPILE = """
import sys, time
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from linear_ce.engine import triton_row_kernels as kernels

assert not kernels.interpreted
common = {"stride_r": "i64", "stride_c": "i64", "B": "i32", "V": "i32", "scale": "fp32"}
blocks = {"BLOCK_R": 2, "BLOCK_V": 256}
cases = {
    "stats": ({"X": "*i16", **common, "T": "*i64", "OUT": "*fp32", "out_stride": "i32"},
              {"HAS_T": True, "DOT": True, "BF16": True}),
    "grad": ({"X": "*fp16", **common, "M": "*fp32", "A": "*fp32", "Bv": "*fp32",
              "MU": "*fp32", "T": "*i64", "G": "*fp32"},
             {"HAS_B": True, "HAS_T": True, "BF16": False}),
    "fused": ({"X": "*fp32", **common, "T": "*i64", "C0": "*fp32", "C1": "*fp32",
               "G": "*fp32", "OUT": "*fp32", "out_stride": "i32"}, {"BF16": False}),
    "pair": ({"S": "*i16", "ss_r": "i64", "ss_c": "i64", "Tt": "*i16", "st_r": "i64",
              "st_c": "i64", "B": "i32", "V": "i32", "cs": "fp32", "ct": "fp32",
              "rest": "fp32", "log_beta": "fp32", "log_rest": "fp32", "power": "fp32",
              "h": "fp32", "TG": "*i64", "W": "*fp32", "OUT": "*fp32", "out_stride": "i32"},
             {"MODE": 2, "ENTROPY": True, "POWER": True, "HAS_T": True, "HAS_W": True,
              "BF16": True}),
}
for name, (signature, flags) in cases.items():
    fn = getattr(kernels, name + "_kernel").fn
    constants = {**flags, **blocks}
    signature = {**signature, **{k: "constexpr" for k in constants}}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    ptx = compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ".entry" in ptx, name
    print(name, "compiled")
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="the GPU check is a bash script")
def test_gpu_check_dry_run():
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for rows in ("0", "1"):
        assert f"LINEAR_CE_NATIVE_ROWS={rows} TRITON_INTERPRET= " in out
    bench = [line for line in out.splitlines() if "-m linear_ce.bench" in line]
    assert len(bench) == 2 and all("--device cuda --shapes 8192,4096,128256" in b for b in bench)
    assert "plain-compile" in bench[0] and "liger" in bench[0] and "cce" in bench[0]
    # Every head's CUDA test, on both paths, was collected.
    for head in ("cross_entropy", "token_logprobs", "token_objective", "sequence_objective",
                 "distillation"):  # fmt: skip
        for rows in ("eager-rows", "triton-rows"):
            assert any(head in line and rows in line for line in out.splitlines()), (head, rows)


def test_gpu_check_needs_a_folder():
    """Without ``--dry-run`` and without an output folder: usage, exit status 2."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
        timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and "usage: scripts/gpu_check.sh OUT" in done.stderr


def test_cuda_plan_from_the_gpu_memory(monkeypatch):
    """The CUDA plan (no GPU needed to plan): the budget's chunks where the GPU's free
    memory holds them, fewer rows where a quarter of it does not (its tiles within that
    quarter), and row-major tiles (the row kernels' coalesced layout)."""
    import torch

    from linear_ce import LinearCrossEntropyOptions
    from linear_ce.engine import plan

    cuda, options = torch.device("cuda"), LinearCrossEntropyOptions(acc_policy="balanced")
    shape = (8192, 4096, 128256, torch.bfloat16, cuda, options)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    roomy = plan.make_plan(*shape)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (256 << 20, 80 << 30))
    tight = plan.make_plan(*shape)
    tile_row = 128256 * 4
    # The budget: a quarter of the gradients' bytes in fp32 tiles, evened over 16 chunks.
    assert roomy.rows_per_chunk == 512
    assert tight.rows_per_chunk * tile_row <= plan.CUDA_FREE_MEMORY_SHARE * (256 << 20)
    assert tight.rows_per_chunk == plan.MIN_EFFICIENT_ROWS
    assert not roomy.gemm.class_major and not tight.gemm.class_major


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_compile_for_a_gpu():
    """Each Triton row kernel (stats, grad, fused, the mixture's pair) compiles for sm_90
    without a GPU (Triton's own ptxas)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600,
        cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["stats", "compiled", "grad", "compiled", "fused", "compiled",
                                   "pair", "compiled"]  # fmt: skip
