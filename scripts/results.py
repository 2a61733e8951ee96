"""The results store and what is drawn from it.

Every stored benchmark run is one line of ``results/runs.jsonl``: what ``python -m
linear_ce.bench --json`` writes (the machine: CPU model, family and flags, cores, torch; the
command; each point's rows: every variant's time, ratios and memory) plus

- ``id``: the run's name, unique in the store;
- ``cpu_label``: the CPU in words ("AMD EPYC, Zen 5"): a virtual machine may name every
  generation of a vendor's CPU alike, so the label is given when the run is added;
- ``date``, ``commit``: when and at which commit it was measured (``commit`` is ``null`` for a
  run whose commit was not recorded), ``stored_in``: the commit that stored it;
- ``headline``: the run a machine's row of the headline table reads (one per ``cpu_label``).

This script draws, from the store alone, the tables between ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->`` markers in README.md and docs/*.md, and a PNG::

    python scripts/results.py render         # rewrite the tables in place, draw docs/results.png
    python scripts/results.py check          # exit 1 if a committed table differs from the store
    python scripts/results.py add RUN.json --id ID --cpu-label LABEL --commit HASH [--headline]
    python scripts/results.py export ID OUT.json  # one run as the bench's JSON (for --replot)

Table names: ``headline`` (one row per CPU), ``machines`` (every run at the default point),
``run ID`` (one run's every point and variant), ``targets ID`` (a run's targets table).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "results" / "runs.jsonl"
PLOT = ROOT / "docs" / "results.png"
#: The pages whose marked tables come from the store.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: The default point every machine is compared at: N, D, V.
SHAPE = (2048, 1024, 32768)
_REQUIRED = ("id", "cpu_label", "date", "commit", "stored_in", "headline", "machine", "command")
_MARKER = re.compile(
    r"(<!-- results:([a-z]+)(?: ([\w.-]+))? -->\n)(.*?)(<!-- /results:\2 -->)", re.S
)


def load(path: Path = STORE) -> list[dict]:
    """Every run of the store, in the order stored; raises ``ValueError`` naming the line of
    a run that lacks a field or repeats an id."""
    runs, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        run = json.loads(line)
        missing = [key for key in (*_REQUIRED, "points") if key not in run]
        if missing:
            raise ValueError(f"{path.name}:{number}: run lacks {missing}; expected {_REQUIRED}")
        if run["id"] in seen:
            raise ValueError(f"{path.name}:{number}: id {run['id']!r} is already in the store")
        seen.add(run["id"])
        runs.append(run)
    return runs


def _find(runs: list[dict], run_id: str) -> dict:
    for run in runs:
        if run["id"] == run_id:
            return run
    raise ValueError(f"no run {run_id!r} in the store; expected one of {[r['id'] for r in runs]}")


def _rows(run: dict, dtype: str, head: str = "ce", ignored: float = 0.0) -> dict[str, dict]:
    """The variants measured at the default point (mean reduction) in ``dtype``."""
    for point in run["points"]:
        if (
            (point["N"], point["D"], point["V"]) == SHAPE
            and point["dtype"] == dtype
            and point.get("head", "ce") == head
            and (point.get("ignored") or 0.0) == ignored
            and point.get("reduction", "mean") == "mean"
        ):
            return {row["variant"]: row for row in point["rows"]}
    return {}


def _paired(times: list[float] | None, ref: list[float] | None) -> float | None:
    """The median over rounds of ``times[i] / ref[i]``, as the bench reads a peer."""
    if not times or not ref or len(times) != len(ref):
        return None
    return statistics.median(t / r for t, r in zip(times, ref, strict=True))


def _own(rows: dict[str, dict], name: str) -> float | None:
    """``name``'s ratio to the floor in its own dtype (a run that predates ``own_ratio``
    divides by its own-dtype floor's ratio to the fp32 one)."""
    row = rows.get(name)
    if row is None or row.get("ratio") is None:
        return None
    if row.get("own_ratio") is not None:
        return row["own_ratio"]
    if "floor-fp32" in rows and rows.get("floor", {}).get("ratio"):
        return row["ratio"] / rows["floor"]["ratio"]
    return row["ratio"]


def metrics(run: dict) -> dict[str, float | None]:
    """The default point's figures of one run (``None`` where not measured)."""
    fp32, bf16 = _rows(run, "fp32"), _rows(run, "bf16")
    masked = _rows(run, "fp32", ignored=0.75).get("linear_ce", {})
    step = fp32.get("linear_ce", {})
    unmasked = masked.get("unmasked_ratio")
    if unmasked is None and masked.get("ratio") and step.get("ratio"):
        # A run that predates unmasked_ratio: the two points' ratios to their floors.
        unmasked = masked["ratio"] / step["ratio"]
    compiled = fp32.get("plain-compile", {})
    return {
        "fp32": step.get("ratio"),
        "bf16": _own(bf16, "linear_ce"),
        "fwd32": fp32.get("linear_ce-fwd", {}).get("ratio"),
        "fwd16": bf16.get("linear_ce-fwd", {}).get("ratio"),
        "masked": unmasked,
        "grads": step.get("peak_ratio"),
        "compile": _paired(step.get("repeat_seconds"), compiled.get("repeat_seconds"))
        or (
            step["ratio"] / compiled["ratio"]
            if step.get("ratio") and compiled.get("ratio")
            else None
        ),
    }


def _f(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


_FEATURES = {
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "amx_bf16": "AMX-BF16",
    "avx512_fp16": "AVX512-FP16",
}


def _cpu(run: dict) -> str:
    flags = run["machine"].get("cpu_flags")
    if flags is None:
        features = "flags not recorded"
    else:
        features = ", ".join(name for flag, name in _FEATURES.items() if flag in flags) or "AVX2"
    return f"{run['cpu_label']} ({run['machine']['cores']} cores; {features})"


def headline(runs: list[dict]) -> str:
    """One row per CPU: its ``headline`` run at the default point."""
    lines = [
        f"N={SHAPE[0]}, D={SHAPE[1]}, V={SHAPE[2]}, torch CPU build, each CPU alone on a 2-core "
        "machine. Time: a multiple of the same dtype's GEMMs alone, in the same round (below "
        "1: faster than the bare GEMMs); × `plain-compile`: over `torch.compile` of the plain "
        "expression, paired (below 1: faster); memory: the fp32 step's transient peak over "
        "the gradients' bytes.",
        "",
        "| CPU | fp32 step | bf16 step | forward fp32, bf16 | step × `plain-compile` | memory × grads | run |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for run in (r for r in runs if r["headline"]):
        m = metrics(run)
        lines.append(
            f"| {_cpu(run)} | {_f(m['fp32'])} | {_f(m['bf16'])} | {_f(m['fwd32'])}, "
            f"{_f(m['fwd16'])} | {_f(m['compile'])} | {_f(m['grads'])} | `{run['id']}` |"
        )
    return "\n".join(lines) + "\n"


def machines(runs: list[dict]) -> str:
    """Every run that measured the default cross-entropy point, in the order stored."""
    lines = [
        "| run | CPU | date | repeats | fp32 step | bf16 step | forward fp32, bf16 "
        "| 75% ignored × unmasked | fp32 memory × grads |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        m = metrics(run)
        if all(m[key] is None for key in ("fp32", "bf16")):
            continue
        lines.append(
            f"| `{run['id']}` | {run['cpu_label']} | {run['date']} | {run['repeats']} "
            f"| {_f(m['fp32'])} | {_f(m['bf16'])} | {_f(m['fwd32'])}, {_f(m['fwd16'])} "
            f"| {_f(m['masked'])} | {_f(m['grads'])} |"
        )
    return "\n".join(lines) + "\n"


def _command(run: dict) -> str:
    """The run's command without its output paths."""
    return re.sub(r" --(json|plot) \S+", "", run["command"] or "")


def run_table(runs: list[dict], run_id: str) -> str:
    """Every point and variant of one run, as the bench prints them."""
    run = _find(runs, run_id)
    lines = [
        f"{_cpu(run)}, torch {run['machine']['torch']}, {run['repeats']} interleaved repeats, "
        f"`{_command(run)}`:",
        "",
        "| point | variant | time s | × floor | peak MiB | × grads |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for point in run["points"]:
        name = f"N={point['N']} D={point['D']} V={point['V']} {point['dtype']}"
        if point.get("head", "ce") != "ce":
            name += f" {point['head']}"
        if point.get("ignored"):
            name += f", {point['ignored']:.0%} ignored"
        for row in point["rows"]:
            if row["seconds"] is None:
                continue
            bold = "**" if row["variant"] == "linear_ce" else ""
            lines.append(
                f"| {name} | {row['variant']} | {row['seconds']:.2f} "
                f"| {bold}{_f(row['ratio'])}{bold} | {row['peak_bytes'] / 2**20:.0f} "
                f"| {_f(row['peak_ratio'])} |"
            )
            name = ""
    return "\n".join(lines) + "\n"


def targets_table(runs: list[dict], run_id: str) -> str:
    """A run's targets: each measured ratio against its bound."""
    run = _find(runs, run_id)
    met = sum(target["met"] for target in run["targets"])
    lines = [
        f"{_cpu(run)}, {run['repeats']} repeats, {met} of {len(run['targets'])} targets met:",
        "",
        "| target | dtype | measured | bound | met |",
        "|---|---|---:|---:|---|",
    ]
    for target in run["targets"]:
        lines.append(
            f"| {target['name']} | {target['dtype']} | {target['measured']:.3f} "
            f"| {target['bound']:.2f} | {'yes' if target['met'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def table(runs: list[dict], name: str, argument: str | None) -> str:
    """The text of the table ``name`` (with its argument, a run's id, where it takes one)."""
    draw = {"headline": headline, "machines": machines, "run": run_table, "targets": targets_table}
    if name not in draw:
        raise ValueError(f"unknown results table {name!r}; expected one of {sorted(draw)}")
    return draw[name](runs) if argument is None else draw[name](runs, argument)


def rendered(text: str, runs: list[dict]) -> str:
    """``text`` with every marked table redrawn from ``runs``."""
    return _MARKER.sub(
        lambda m: m.group(1) + "\n" + table(runs, m.group(2), m.group(3)) + "\n" + m.group(5), text
    )


def stale(runs: list[dict]) -> list[str]:
    """The pages whose marked tables differ from what the store draws."""
    return [
        str(page.relative_to(ROOT))
        for page in PAGES
        if _MARKER.search(page.read_text()) and rendered(page.read_text(), runs) != page.read_text()
    ]


def plot(runs: list[dict], path: Path) -> None:
    """Bars of each CPU's headline figures: time and memory against the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [run for run in runs if run["headline"]]
    series = [("fp32 step", "fp32"), ("bf16 step", "bf16"), ("fp32 forward", "fwd32")]
    fig, (time_axes, memory_axes) = plt.subplots(1, 2, figsize=(10, 3.6), width_ratios=[3, 1.4])
    width = 0.8 / len(series)
    for index, (label, key) in enumerate(series):
        values = [metrics(run)[key] or 0.0 for run in chosen]
        xs = [i + (index - 1) * width for i in range(len(chosen))]
        bars = time_axes.bar(xs, values, width, label=label)
        time_axes.bar_label(bars, fmt="%.2f", fontsize=7)
    time_axes.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    time_axes.set_xticks(range(len(chosen)), [run["cpu_label"] for run in chosen], fontsize=8)
    time_axes.set_ylabel("time × the GEMMs alone")
    time_axes.legend(fontsize=8, loc="lower right")
    grads = [metrics(run)["grads"] or 0.0 for run in chosen]
    bars = memory_axes.bar(range(len(chosen)), grads, color="tab:gray")
    memory_axes.bar_label(bars, fmt="%.2f", fontsize=7)
    memory_axes.set_xticks(range(len(chosen)), [run["cpu_label"].split(", ")[-1] for run in chosen])
    memory_axes.set_ylabel("fp32 step memory × grads")
    fig.suptitle(f"linear_ce at N={SHAPE[0]}, D={SHAPE[1]}, V={SHAPE[2]} (2 cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def add(runs: list[dict], source: Path, run_id: str, label: str, commit: str, head: bool) -> dict:
    """A bench JSON file as a store line (checked: the id is new, the bench wrote it)."""
    data = json.loads(source.read_text())
    if "points" not in data or "machine" not in data:
        raise ValueError(f"{source} is not a bench JSON file (no 'points' or 'machine')")
    if any(run["id"] == run_id for run in runs):
        raise ValueError(f"id {run_id!r} is already in the store; choose another")
    stored_in = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.strip()
    date = subprocess.run(["date", "-u", "+%F"], capture_output=True, text=True, check=True).stdout
    return {
        "id": run_id,
        "cpu_label": label,
        "date": date.strip(),
        "commit": commit,
        "stored_in": stored_in,
        "headline": head,
        **data,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/results.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("render", help="redraw the marked tables and docs/results.png")
    sub.add_parser("check", help="exit 1 if a committed table differs from the store")
    adding = sub.add_parser("add", help="append a bench JSON run to the store")
    adding.add_argument("source", type=Path)
    adding.add_argument("--id", required=True)
    adding.add_argument("--cpu-label", required=True)
    adding.add_argument("--commit", required=True)
    adding.add_argument("--headline", action="store_true", help="make it its CPU's headline run")
    export = sub.add_parser("export", help="write one run as the bench's JSON")
    export.add_argument("id")
    export.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    runs = load()
    if args.action == "check":
        pages = stale(runs)
        if pages:
            print(
                f"tables differ from {STORE.name} in {pages}: run `python scripts/results.py render`"
            )
            return 1
        return 0
    if args.action == "export":
        run = _find(runs, args.id)
        args.out.write_text(json.dumps({k: v for k, v in run.items() if k not in _REQUIRED[:6]}))
        return 0
    if args.action == "add":
        run = add(runs, args.source, args.id, args.cpu_label, args.commit, args.headline)
        if args.headline:
            for old in runs:
                old["headline"] = old["headline"] and old["cpu_label"] != args.cpu_label
        runs.append(run)
        STORE.write_text(
            "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in runs)
        )
    for page in PAGES:
        text = page.read_text()
        if _MARKER.search(text):
            page.write_text(rendered(text, runs))
    plot(runs, PLOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
