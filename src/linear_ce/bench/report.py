"""Turning measurements into the report: summary rows, a rich table, a PNG, JSON.

Time is the median over repeats; the ratio to the floor is the median of the
per-repeat ratios (each repeat's variant time over the same repeat's floor),
so a slow spell of the machine cancels. Half-precision rows are divided by the
fp32 floor and, where the floor in their own dtype was measured, by the faster of the
two in each round too ("× own floor"; on a CPU whose half GEMMs are not native that is
the fp32 one, the upcast floor).
Memory is the largest transient peak over the repeats, also given as a multiple
of the gradients' bytes (``grad_input`` + ``grad_weight`` in the input dtype); a peer
measured at fewer rows (:func:`linear_ce.bench.runner.reduced_rows`) has no memory.
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
from linear_ce.bench.variants import VARIANTS, own_floor_variant, plan_note, reference_variant

__all__ = [
    "COLORS",
    "Row",
    "machine",
    "plot",
    "read_json",
    "summarize",
    "table",
    "with_unmasked",
    "write_json",
    "write_plot",
]

_MIB = 2**20
#: Settings that run torch's kernels, oneDNN or MKL below the CPU's instruction set (an
#: AVX2-only CPU reproduced on a wider one).
_ISA_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


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
    own_ratio: float | None = None
    #: What the variant's plan chose (:func:`linear_ce.bench.variants.describe_plan`).
    plan: dict | None = None
    #: Each timed call's seconds, in the order measured (repeat by repeat).
    repeat_seconds: list[float] | None = None
    #: At a masked point: this row's ratio over its ratio at the unmasked point of the same
    #: shape and dtype (:func:`with_unmasked`), each a paired median, so the machine's
    #: speed between the two points cancels.
    unmasked_ratio: float | None = None


def paired_ratio(times: list[float], ref: list[float]) -> float | None:
    """The median over rounds of ``times[i] / ref[i]`` (each round's machine state
    cancels); the ratio of the medians where the two were not measured round by round."""
    if not times or not ref:
        return None
    if len(times) == len(ref):
        return statistics.median(t / r for t, r in zip(times, ref, strict=True))
    return statistics.median(times) / statistics.median(ref)


def _faster(own: list[float], fp32: list[float]) -> list[float]:
    """Round by round, the faster of the own-dtype floor and the fp32 floor (``own`` where
    the two were not measured round by round)."""
    if len(own) != len(fp32):
        return own
    return [min(a, b) for a, b in zip(own, fp32, strict=True)]


def summarize(point: Point, measured: dict[str, Measured]) -> list[Row]:
    """Rows in the order measured, with ratios to each row's reference floor."""
    rows = []
    for name, m in measured.items():
        kind = VARIANTS[name].kind
        reference = reference_variant(point, kind)
        ref = measured.get(reference)
        note = m.unavailable or m.error or plan_note(m.plan)
        if not m.seconds:
            rows.append(Row(name, kind, reference, None, None, None, None, note or "no samples"))
            continue
        peak = max(m.peak_bytes) if m.peak_bytes else None
        own = measured.get(own_floor_variant(point, kind) or "")
        if m.rows is not None:
            note = f"measured at N={m.rows}, time scaled to N={point.N}: {m.reduced_because}"
        rows.append(
            Row(
                variant=name,
                kind=kind,
                reference=reference,
                seconds=statistics.median(m.seconds),
                ratio=paired_ratio(m.seconds, ref.seconds) if ref is not None else None,
                peak_bytes=peak,
                peak_ratio=None if peak is None else peak / point.grad_bytes,
                note=note,
                own_ratio=None
                if own is None or not own.seconds
                else paired_ratio(m.seconds, _faster(own.seconds, ref.seconds if ref else [])),
                plan=m.plan,
                repeat_seconds=list(m.seconds),
            )
        )
    return rows


def with_unmasked(summaries: list[tuple[Point, list[Row]]]) -> list[tuple[Point, list[Row]]]:
    """``summaries`` with :attr:`Row.unmasked_ratio` filled for the variants (not the
    floors) at each masked point whose unmasked point (same shape, dtype and reduction, the
    cross-entropy head) was measured: the ratio to
    the floor in the input's own dtype where there is one, else to the reference floor."""

    def steady(row: Row) -> float | None:
        return row.own_ratio if row.own_ratio is not None else row.ratio

    unmasked = {
        (p.N, p.D, p.V, p.dtype, p.reduction): {row.variant: row for row in rows}
        for p, rows in summaries
        if p.head == "ce" and not p.ignored
    }
    result = []
    for point, rows in summaries:
        key = (point.N, point.D, point.V, point.dtype, point.reduction)
        base = unmasked.get(key) if point.ignored else None
        if base is not None:
            rows = [
                dataclasses.replace(row, unmasked_ratio=steady(row) / steady(base[row.variant]))
                if not row.variant.startswith("floor")
                and row.variant in base
                and steady(row)
                and steady(base[row.variant])
                else row
                for row in rows
            ]
        result.append((point, rows))
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(
    summaries: list[tuple[Point, list[Row]]],
    title: str,
    in_process: list[tuple[Point, list[Row]]] | None = None,
):
    """A :class:`rich.table.Table` of every point and variant; given the summaries of an
    in-process run of the same points, its ratios in a column of their own ("in-process",
    × the floor, × the own floor in parentheses)."""
    from rich.table import Table

    inside = {
        (point, row.variant): row for point, rows in (in_process or []) for row in rows
    }  # fmt: skip

    out = Table(title=title, show_lines=False)
    for header, justify in [
        ("shape", "left"),
        ("variant", "left"),
        ("time s", "right"),
        ("× floor", "right"),
        ("× own floor", "right"),
        *([("in-process", "right")] if in_process is not None else []),
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
            there = inside.get((point, row.variant))
            paired = _fmt(None if there is None else there.ratio, ".2f")
            if there is not None and there.own_ratio is not None:
                paired += f" ({there.own_ratio:.2f})"
            out.add_row(
                point.label if j == 0 else "",
                row.variant,
                _fmt(row.seconds, ".3f"),
                ratio,
                _fmt(row.own_ratio, ".2f"),
                *([paired] if in_process is not None else []),
                _fmt(None if row.peak_bytes is None else row.peak_bytes / _MIB, ".0f"),
                _fmt(row.peak_ratio, ".2f"),
                (
                    f"{row.unmasked_ratio:.2f}× the unmasked step"
                    + (f"; {row.note}" if row.note else "")
                    if row.unmasked_ratio is not None
                    else row.note
                ),
            )
    return out


# One colour per variant, the same in every panel, picked by hand so that variants drawn
# together cannot be confused: linear_ce red and its forward-only row blue, the floors in
# greys (and dashed), the plain expression greens, torch's builtin purple and brown.
COLORS = {
    "floor": "#000000",
    "floor-fp32": "#555555",
    "plain": "#2ca02c",
    "plain-compile": "#a6c93a",
    "torch": "#9467bd",
    "torch-512": "#8c564b",
    "linear_ce": "#d62728",
    "linear_ce-accurate": "#ff7f0e",
    "linear_ce-balanced": "#e377c2",
    "linear_ce-compact": "#17becf",
    "cce": "#f2c500",
    "liger": "#004d40",
    "floor-fwd": "#a0a0a0",
    "floor-scored": "#000060",
    "floor-scored-fp32": "#d9d9d9",
    "linear_ce-fwd": "#1f4fd6",
    "logprobs-plain": "#6b8e23",
    "logprobs-linear_ce": "#8b0000",
    "logprobs-trl": "#daa520",
    "logprobs-trl-patched": "#ff1493",
    "objective-plain": "#00ff7f",
    "objective-logprobs": "#4b0082",
    "objective-linear_ce": "#ffa07a",
    "floor-2heads": "#ff00ff",
    "floor-2heads-fp32": "#8000ff",
    "divergence-plain": "#cc0099",
    "divergence-linear_ce": "#00ff00",
    "divergence-trl": "#80ccff",
    "dpo-plain": "#0000ff",
    "dpo-logprobs": "#404000",
    "dpo-linear_ce": "#60df80",
    "sparse-plain": "#009f80",
    "sparse-linear_ce": "#60df00",
}


def _style(variant: str) -> dict:
    """Colour per variant; dashed for the floors; triangles for forward-only rows."""
    return {
        "color": COLORS[variant],
        "linestyle": "--" if variant.startswith("floor") else "-",
        "marker": "^" if VARIANTS[variant].kind == "forward" else "o",
        "linewidth": 2.5 if variant == "linear_ce" else 1.5,
    }


_PANELS = (
    ("ratio", "time / floor (same run)"),
    ("peak_ratio", "transient peak / gradients' bytes"),
)


def _draw_lines(axes, summaries: list[tuple[Point, list[Row]]], dim: str) -> None:
    """Each variant a line against ``dim``; one line per shape of the other two dimensions."""
    fixed = [d for d in "NDV" if d != dim]
    series: dict[tuple, list[tuple[int, Row]]] = {}
    for point, rows in summaries:
        others = tuple(getattr(point, d) for d in fixed)
        for row in rows:
            if row.ratio is not None:
                series.setdefault((others, row.variant), []).append((getattr(point, dim), row))
    several = len({others for others, _ in series}) > 1
    order = list(VARIANTS)
    for (others, variant), line in sorted(
        series.items(), key=lambda i: (i[0][0], order.index(i[0][1]))
    ):
        line.sort(key=lambda item: item[0])
        where = ", ".join(f"{d}={v}" for d, v in zip(fixed, others, strict=True))
        label = f"{variant} ({where})" if several else variant
        for ax, (field, _) in zip(axes, _PANELS, strict=True):
            # A peer measured at fewer rows has no memory: its points are left out.
            drawn = [(x, getattr(row, field)) for x, row in line if getattr(row, field) is not None]
            ax.plot([x for x, _ in drawn], [y for _, y in drawn], label=label, **_style(variant))
    for ax, (_, ylabel) in zip(axes, _PANELS, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(dim)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)


def _draw_bars(axes, summaries: list[tuple[Point, list[Row]]]) -> None:
    """One group of bars per measured point (no sweep to draw a line through), each bar a
    variant, its value written on it; a line at 1 marks the floor."""
    measured_rows = [[row for row in rows if row.ratio is not None] for _, rows in summaries]
    width = 0.8 / max(1, *map(len, measured_rows))
    for group, measured in enumerate(measured_rows):
        for i, row in enumerate(measured):
            x = group + (i - (len(measured) - 1) / 2) * width
            style = _style(row.variant)
            for ax, (field, _) in zip(axes, _PANELS, strict=True):
                value = getattr(row, field)
                if value is None:  # a peer measured at fewer rows has no memory
                    continue
                ax.bar(
                    x,
                    value,
                    width * 0.9,
                    color=style["color"],
                    hatch="//" if row.variant.startswith("floor") else None,
                    edgecolor="white",
                    label=row.variant if group == 0 else None,
                )
                ax.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom", fontsize=6)
    for ax, (_, ylabel) in zip(axes, _PANELS, strict=True):
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
        ax.set_xticks(range(len(summaries)), [p.label for p, _ in summaries], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)


def plot(summaries: list[tuple[Point, list[Row]]], dim: str, title: str):
    """A :class:`matplotlib.figure.Figure` of time (× the floor measured in the same run)
    and transient memory (× grads), one column per dtype. A dtype measured at several
    values of ``dim`` (N, D or V) is drawn as lines against it (points that share the
    other two dimensions form a line); a dtype measured at one value, as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(p.dtype for p, _ in summaries))
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6.5 * len(dtypes), 8), squeeze=False)
    for col, dtype in enumerate(dtypes):
        mine = [(p, rows) for p, rows in summaries if p.dtype == dtype]
        column = (axes[0][col], axes[1][col])
        if len({getattr(p, dim) for p, _ in mine}) > 1:
            _draw_lines(column, mine, dim)
        else:
            _draw_bars(column, mine)
        axes[0][col].set_title(f"{dtype} (train: forward + backward; ▲ *-fwd: forward only)")
        axes[0][col].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def write_plot(summaries: list[tuple[Point, list[Row]]], dim: str, path: Path, title: str) -> None:
    """:func:`plot` written to ``path`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = plot(summaries, dim, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_identity(cpuinfo: str, cache_bytes: int | None) -> str | None:
    """``"family F, model M, L3 S MiB"`` of the first CPU in ``cpuinfo`` (the text of
    ``/proc/cpuinfo``) and its last-level cache's ``cache_bytes``, or ``None`` where it
    names no family: a virtual machine may name every generation of a vendor's CPU alike
    ("AMD EPYC" on a Zen 4 and a Zen 5, with the same AVX-512 flags), so the model name
    alone does not tell which was measured."""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("cpu family", "model"):
            fields[key] = value.strip()
        if not line.strip() and fields:
            break
    if "cpu family" not in fields:
        return None
    text = f"family {fields['cpu family']}, model {fields.get('model', '?')}"
    return text + (f", L3 {cache_bytes / (1 << 20):g} MiB" if cache_bytes else "")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def machine() -> dict:
    """CPU model (and :func:`cpu_identity`), the CPU features the plan's choices depend on,
    cores, torch version, the ``LINEAR_CE_*`` settings of the run, GPU name where one is
    present."""
    from linear_ce.engine.capability import last_level_cache_bytes
    from linear_ce.engine.machine import machine_info

    own = machine_info()
    info = {
        "cpu": own["cpu"],
        "cpu_identity": cpu_identity(_cpuinfo(), last_level_cache_bytes()),
        "cpu_flags": own["flags"],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        # The run's linear_ce settings, and those capping torch's or its BLAS's instruction set.
        "settings": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("LINEAR_CE_") or k in _ISA_SETTINGS
        },
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _points_json(summaries: list[tuple[Point, list[Row]]]) -> list[dict]:
    return [
        {
            **dataclasses.asdict(point),
            "grad_bytes": point.grad_bytes,
            "rows": [dataclasses.asdict(row) for row in rows],
        }
        for point, rows in summaries
    ]


def write_json(
    summaries: list[tuple[Point, list[Row]]],
    meta: dict,
    path: Path,
    in_process: list[tuple[Point, list[Row]]] | None = None,
) -> None:
    """Everything measured, with the machine and the command's settings; an in-process
    run's summaries (``--in-process``) under ``"in_process_points"``."""
    data = {**meta, "points": _points_json(summaries)}
    if in_process is not None:
        data["in_process_points"] = _points_json(in_process)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def read_json(path: Path) -> tuple[dict, list[tuple[Point, list[Row]]]]:
    """What :func:`write_json` wrote: the run's settings and its summaries (an in-process
    run's, where stored, as summaries under the settings' ``"in_process_points"``)."""
    data = json.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(Point)}

    def parse(points: list[dict]) -> list[tuple[Point, list[Row]]]:
        return [
            (
                Point(**{k: v for k, v in point.items() if k in fields}),
                [Row(**row) for row in point["rows"]],
            )
            for point in points
        ]

    if "in_process_points" in data:
        data["in_process_points"] = parse(data["in_process_points"])
    return data, parse(data.pop("points"))
