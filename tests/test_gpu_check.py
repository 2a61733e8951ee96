"""``scripts/gpu_check.sh --dry-run`` on any machine: it prints the commands the GPU check
runs (the CUDA tests with the eager and the Triton rows, the benchmark's two runs) and
collects the CUDA tests, which must import and be found without a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
