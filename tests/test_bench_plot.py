"""The benchmark plot: colours that cannot be confused, lines for a sweep, bars for a single
point, and a stored run redrawn from its JSON."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import matplotlib.colors
import matplotlib.pyplot as plt

from linear_ce.bench import report
from linear_ce.bench.config import Point
from linear_ce.bench.variants import VARIANTS

ROOT = Path(__file__).resolve().parent.parent


def _row(variant: str, ratio: float, peak_ratio: float) -> report.Row:
    kind = VARIANTS[variant].kind
    reference = "floor-fwd" if kind == "forward" else "floor"
    return report.Row(variant, kind, reference, 1.0, ratio, 1000, peak_ratio, "")


def _summaries() -> list[tuple[Point, list[report.Row]]]:
    """fp32 at two values of V (a sweep), bf16 at one."""
    return [
        (Point(8, 4, 16, "fp32", "cpu"), [_row("floor", 1.0, 2.0), _row("linear_ce", 1.1, 1.2)]),
        (Point(8, 4, 32, "fp32", "cpu"), [_row("floor", 1.0, 2.5), _row("linear_ce", 0.9, 1.3)]),
        (
            Point(8, 4, 16, "bf16", "cpu"),
            [_row("linear_ce", 0.5, 1.7), _row("linear_ce-fwd", 1.15, 0.36)],
        ),
    ]


def test_every_variant_has_its_own_colour():
    assert set(report.COLORS) == set(VARIANTS)
    rgb = {name: matplotlib.colors.to_rgb(color) for name, color in report.COLORS.items()}
    for a, b in itertools.combinations(rgb, 2):
        distance = sum((x - y) ** 2 for x, y in zip(rgb[a], rgb[b], strict=True)) ** 0.5
        assert distance > 0.2, f"{a} and {b} have colours too close to tell apart"
    red, blue = rgb["linear_ce"], rgb["linear_ce-fwd"]
    assert red[0] > 0.7 > red[2] and blue[2] > 0.7 > blue[0]


def test_sweep_is_drawn_as_lines_and_a_single_point_as_bars():
    fig = report.plot(_summaries(), "V", "title")
    # Row by row: time then memory; one column per dtype, fp32 then bf16.
    time_fp32, time_bf16, memory_fp32, memory_bf16 = fig.axes
    time_lines = {line.get_label(): line for line in time_fp32.get_lines()}
    memory_lines = {line.get_label(): line for line in memory_fp32.get_lines()}
    assert list(time_lines["linear_ce"].get_xdata()) == [16, 32]
    assert list(time_lines["linear_ce"].get_ydata()) == [1.1, 0.9]
    assert list(memory_lines["floor"].get_ydata()) == [2.0, 2.5]
    assert not time_fp32.patches
    assert [bar.get_height() for bar in time_bf16.patches] == [0.5, 1.15]
    assert [bar.get_height() for bar in memory_bf16.patches] == [1.7, 0.36]
    colors = [matplotlib.colors.to_hex(bar.get_facecolor()) for bar in time_bf16.patches]
    assert colors == [report.COLORS["linear_ce"], report.COLORS["linear_ce-fwd"]]
    plt.close(fig)


def test_json_round_trip(tmp_path):
    path = tmp_path / "bench.json"
    report.write_json(_summaries(), {"repeats": 1, "device": "cpu"}, path)
    meta, summaries = report.read_json(path)
    assert meta == {"repeats": 1, "device": "cpu"}
    assert summaries == _summaries()


def test_replot_the_stored_run(tmp_path):
    plot, stored = tmp_path / "bench.png", tmp_path / "stored.json"
    export = [sys.executable, ROOT / "scripts" / "results.py", "export", "zen4-default", stored]
    subprocess.run(export, check=True, timeout=60)
    done = subprocess.run(
        [sys.executable, "-m", "linear_ce.bench", "--replot", stored, "--plot", plot],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "linear_ce-fwd" in done.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
