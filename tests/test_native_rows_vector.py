"""The compiled row loops vectorise at every x86 width: 8 fp32 lanes with AVX2 alone.

``native_rows.c`` is built for the CPU it runs on (``-march=native``), so a CPU with AVX2
and no AVX-512 (Zen 3, Haswell to Comet Lake) builds it with 32-byte vectors. The test
compiles the source for both instruction sets (``-march=x86-64-v4``: AVX-512;
``-march=x86-64-v3``: AVX2 and FMA) and reads gcc's vectoriser report: every loop the
AVX-512 build vectorises, the AVX2 build vectorises with 32-byte vectors, but for the
loops that store a row's target entry (a scatter: AVX-512 has one, AVX2 not; one store a
row, not a pass over the logits).
"""

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import pytest

_VECTORISED = re.compile(r":(\d+):\d+: optimized: loop vectorized using (\d+) byte vectors")


def _report(source: Path, march: str, out: Path) -> dict[int, set[int]]:
    # The build's own flags (engine/native_rows.py) with the instruction set named.
    flags = ["-O3", f"-march={march}", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
    flags += ["-fopt-info-vec-optimized", "-shared", "-fPIC"]
    done = subprocess.run(
        ["gcc", *flags, str(source), "-o", str(out), "-lm"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    widths: dict[int, set[int]] = {}
    for line, width in _VECTORISED.findall(done.stderr):
        widths.setdefault(int(line), set()).add(int(width))
    return widths


def _gcc_targets_x86_levels() -> bool:
    if shutil.which("gcc") is None:
        return False
    probe = subprocess.run(
        ["gcc", "-march=x86-64-v3", "-x", "c", "-E", "-"],
        input="",
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _gcc_targets_x86_levels(), reason="needs gcc targeting x86-64-v3/v4")
def test_row_loops_vectorise_eight_lanes_wide_with_avx2_alone(tmp_path):
    source = Path(str(resources.files("linear_ce.engine") / "native_rows.c"))
    lines = source.read_text().splitlines()
    with ThreadPoolExecutor(2) as pool:
        wide, avx2 = pool.map(
            lambda march: _report(source, march, tmp_path / f"{march}.so"),
            ["x86-64-v4", "x86-64-v3"],
        )
    assert wide and all(64 in widths for widths in wide.values())
    missing = [line for line in wide if 32 not in avx2.get(line, set())]
    scatters = [
        line for line in missing if "target[" in " ".join(lines[line : line + 2])
    ]  # fmt: skip
    assert missing == scatters, [lines[line - 1].strip() for line in missing]
    assert len(scatters) <= 3
    assert all(64 not in widths for widths in avx2.values())
