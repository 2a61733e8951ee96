"""Turning measurements into the report: summary rows, a rich table, a PNG, JSON.

Time is the median over repeats; the ratio to the floor is the median of the
per-repeat ratios (each repeat's variant time over the same repeat's floor),
so a slow spell of the machine cancels. Memory is the largest transient peak
over the repeats, also given as a multiple of the gradients' bytes
(``grad_input`` + ``grad_weight`` in the input dtype).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from linear_ce.bench.config import Point
from linear_ce.bench.runner import Measured
from linear_ce.bench.variants import VARIANTS, reference_variant

__all__ = ["Row", "machine", "summarize", "table", "write_json", "write_plot"]

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Row:
    """One variant at one point, summarized."""

    variant: str
    kind: str
    reference: str
    seconds: float | None
    ratio: float | None
    peak_bytes: int | None
    peak_ratio: float | None
    note: str


def _paired_ratio(times: list[float], ref: list[float]) -> float | None:
    if not times or not ref:
        return None
    if len(times) == len(ref):
        return statistics.median(t / r for t, r in zip(times, ref, strict=True))
    return statistics.median(times) / statistics.median(ref)


def summarize(point: Point, measured: dict[str, Measured]) -> list[Row]:
    """Rows in the order measured, with ratios to each row's reference floor."""
    rows = []
    for name, m in measured.items():
        kind = VARIANTS[name].kind
        reference = reference_variant(point, kind)
        ref = measured.get(reference)
        note = m.unavailable or m.error or ""
        if not m.seconds:
            rows.append(Row(name, kind, reference, None, None, None, None, note or "no samples"))
            continue
        peak = max(m.peak_bytes)
        rows.append(
            Row(
                variant=name,
                kind=kind,
                reference=reference,
                seconds=statistics.median(m.seconds),
                ratio=_paired_ratio(m.seconds, ref.seconds) if ref is not None else None,
                peak_bytes=peak,
                peak_ratio=peak / point.grad_bytes,
                note=note,
            )
        )
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(summaries: list[tuple[Point, list[Row]]], title: str):
    """A :class:`rich.table.Table` of every point and variant."""
    from rich.table import Table

    out = Table(title=title, show_lines=False)
    for header, justify in [
        ("shape", "left"),
        ("variant", "left"),
        ("time s", "right"),
        ("× floor", "right"),
        ("peak MiB", "right"),
        ("× grads", "right"),
        ("note", "left"),
    ]:
        out.add_column(header, justify=justify, overflow="fold")
    for i, (point, rows) in enumerate(summaries):
        if i:
            out.add_section()
        for j, row in enumerate(rows):
            ratio = _fmt(row.ratio, ".2f")
            if row.ratio is not None and row.reference != "floor":
                ratio += f" ({row.reference.removeprefix('floor-').removeprefix('floor')})"
            out.add_row(
                point.label if j == 0 else "",
                row.variant,
                _fmt(row.seconds, ".3f"),
                ratio,
                _fmt(None if row.peak_bytes is None else row.peak_bytes / _MIB, ".0f"),
                _fmt(row.peak_ratio, ".2f"),
                row.note,
            )
    return out


def _color(variant: str):
    import matplotlib

    # tab20's dark shades first, then its light ones: 20 distinguishable colours.
    index = list(VARIANTS).index(variant)
    return matplotlib.colormaps["tab20"]((2 * index) % 20 + (2 * index) // 20 % 2)


def write_plot(summaries: list[tuple[Point, list[Row]]], dim: str, path: Path, title: str) -> None:
    """PNG of time (× the floor measured in the same run) and transient memory
    (× grads) against ``dim`` (N, D or V), one column per dtype; points that share
    the other two dimensions form a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(p.dtype for p, _ in summaries))
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6.5 * len(dtypes), 8), squeeze=False)
    for col, dtype in enumerate(dtypes):
        series: dict[tuple, dict[str, list]] = {}
        for point, rows in summaries:
            if point.dtype != dtype:
                continue
            others = tuple(getattr(point, d) for d in "NDV" if d != dim)
            for row in rows:
                if row.ratio is None:
                    continue
                line = series.setdefault((others, row.variant), {"x": [], "t": [], "m": []})
                line["x"].append(getattr(point, dim))
                line["t"].append(row.ratio)
                line["m"].append(row.peak_ratio)
        fixed = [d for d in "NDV" if d != dim]
        for (others, variant), line in sorted(series.items()):
            order = sorted(range(len(line["x"])), key=line["x"].__getitem__)
            xs = [line["x"][i] for i in order]
            label = (
                variant
                if len({o for o, _ in series}) == 1
                else (
                    f"{variant} ({', '.join(f'{d}={v}' for d, v in zip(fixed, others, strict=True))})"
                )
            )
            # One colour per variant in every panel.
            style = {
                "linestyle": "--" if variant.startswith("floor") else "-",
                "marker": "o",
                "color": _color(variant),
                "label": label,
            }
            axes[0][col].plot(xs, [line["t"][i] for i in order], **style)
            axes[1][col].plot(xs, [line["m"][i] for i in order], **style)
        for row, ylabel in enumerate(
            ["time / floor (same run)", "transient peak / gradients' bytes"]
        ):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(dim)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].set_title(f"{dtype} (train: forward + backward; *-fwd: forward only)")
        axes[0][col].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    """CPU model, cores, torch version, GPU name where one is present."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_json(summaries: list[tuple[Point, list[Row]]], meta: dict, path: Path) -> None:
    """Everything measured, with the machine and the command's settings."""
    data = {
        **meta,
        "points": [
            {
                **dataclasses.asdict(point),
                "grad_bytes": point.grad_bytes,
                "rows": [dataclasses.asdict(row) for row in rows],
            }
            for point, rows in summaries
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
