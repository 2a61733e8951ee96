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
