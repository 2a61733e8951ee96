"""``python -m linear_ce.bench``: the benchmark report.

Measures every variant (see :mod:`linear_ce.bench.variants`) at the given
shapes and dtypes and along a sweep of one dimension, prints a table (time,
ratio to the floor, transient memory, ratio to the gradients' bytes) and
writes a PNG plot and a JSON file. With ``--in-process`` every point is measured a second
time with all variants in this one process, a transformer block's forward and backward
before each call (:func:`linear_ce.bench.runner.run_points_in_process`); the table gives
those ratios too and the targets read them. Outside a terminal (a pipe, a CI log) a line
is printed per finished point, with an estimate of the time left.

Example::

    python -m linear_ce.bench                                  # the default report
    python -m linear_ce.bench --shapes 4096,2048,50257 --dtype fp32 --sweep none
    python -m linear_ce.bench --shapes 4096,1024,32768 --dtype fp32 --sweep none --ignored 0.75
    python -m linear_ce.bench --sweep none --heads ce,logprobs,objective,divergence \
        --extra-dtype fp32,bf16 --reductions mean,none --repeats 5      # every target, one run
    python -m linear_ce.bench --sweep none --ignored none --in-process  # as training runs it
    python -m linear_ce.bench --device cuda --shapes 8192,4096,128256
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from linear_ce.bench import config, report, targets
from linear_ce.bench.runner import point_work, run_points, run_points_in_process
from linear_ce.bench.variants import DEFAULT, VARIANTS, measured_at

_DEFAULT_SHAPES = "2048,1024,32768"
_DEFAULT_SWEEP = "V=4096,8192,32768"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments, each list parsed and checked (a bad one is the
    parser's usage error, naming the option)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _parsed_lists(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m linear_ce.bench",
        description="Time and memory of linear_ce against the GEMM floor and its peers.",
    )
    parser.add_argument(
        "--shapes",
        default=_DEFAULT_SHAPES,
        help=f"'N,D,V[;N,D,V...]' rows, features, classes (default {_DEFAULT_SHAPES})",
    )
    parser.add_argument(
        "--dtype",
        default="fp32,bf16",
        help="comma-separated dtypes: fp32, bf16, fp16, fp64 (default fp32,bf16)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--sweep",
        default=_DEFAULT_SWEEP,
        help="one dimension of the first shape to vary, for the plot: "
        f"'V=a,b,...', 'N=...' or 'D=...', or 'none' (default {_DEFAULT_SWEEP})",
    )
    parser.add_argument(
        "--sweep-dtype",
        default=None,
        help="dtypes the sweep runs in (default: the first of --dtype)",
    )
    parser.add_argument(
        "--ignored",
        default="0.75",
        help="shares of targets set to the ignore index, each measured at the first shape "
        "in each --extra-dtype and --reductions (rows then cost no GEMM in linear_ce); "
        "'none' to skip (default 0.75)",
    )
    parser.add_argument(
        "--reductions",
        default="mean",
        help="the loss reductions the --ignored points take: mean, sum, none ('none' "
        "backpropagates the sum of the per-row losses; default mean)",
    )
    parser.add_argument(
        "--heads",
        default="ce",
        help="what is computed: 'ce' (the loss; every shape and the sweep), 'logprobs' "
        "(per-token log-probabilities and entropy with upstream gradients on both) and "
        "'objective' (a clipped policy-gradient step with an entropy bonus), 'divergence' (distillation: forward "
        "KL to a teacher head of the same shape, against a four-GEMM floor), 'sparse' "
        "(distillation from a stored teacher's top-64, against the three-GEMM floor), 'dpo' "
        "(a DPO step on pairs of 256-token sequences; its rows are named with --variants), "
        "all but 'ce' at the first shape in each --extra-dtype (default ce, to keep the "
        "default run short)",
    )
    parser.add_argument(
        "--extra-dtype",
        default=None,
        help="dtypes the extra points (--ignored, --heads) run in (default: the first of --dtype)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed calls per variant and point, interleaved (default 3)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT),
        help=f"comma-separated, from: {', '.join(VARIANTS)} (default: all but "
        "the per-policy linear_ce-* rows; unavailable ones are listed as such)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="measure every point again with all variants in this process, a transformer "
        "block's forward and backward before each call (as a training step runs the head); "
        "the targets read these ratios",
    )
    parser.add_argument("--json", default="bench-out/bench.json", help="JSON output path")
    parser.add_argument("--plot", default="bench-out/bench.png", help="PNG output path")
    parser.add_argument(
        "--replot",
        metavar="JSON",
        default=None,
        help="measure nothing: print the table and draw --plot from a stored run's JSON",
    )
    return parser


def _parsed_lists(args: argparse.Namespace) -> None:
    """Sets ``args``' parsed lists; a ``ValueError`` names the option that is wrong."""
    args.shape_list = config.parse_shapes(args.shapes)
    args.dtype_list = config.parse_dtypes(args.dtype)
    args.sweep_spec = config.parse_sweep(args.sweep)
    args.ignored_list = config.parse_fractions(args.ignored)
    args.head_list = config.parse_heads(args.heads)
    args.reduction_list = config.parse_reductions(args.reductions)
    args.extra_dtypes = (
        args.dtype_list[:1] if args.extra_dtype is None else config.parse_dtypes(args.extra_dtype)
    )
    args.sweep_dtypes = (
        args.dtype_list[:1] if args.sweep_dtype is None else config.parse_dtypes(args.sweep_dtype)
    )
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown or not args.variant_list:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be 'cpu' or 'cuda', got {args.device!r}")


def _title(meta: dict) -> str:
    info = meta["machine"]
    flags = info.get("cpu_flags")
    settings = info.get("settings")
    return (
        f"{info['cpu']}"
        + (f" ({info['cpu_identity']})" if info.get("cpu_identity") else "")
        + f", {info['cores']} cores"
        + (f" ({' '.join(flags) or 'no AVX2/AVX-512/AMX'})" if flags is not None else "")
        + f", torch {info['torch']}"
        + (" " + " ".join(f"{k}={v}" for k, v in settings.items()) if settings else "")
        + (f", {info['gpu']}" if meta["device"] == "cuda" and "gpu" in info else "")
        + f"; median of {meta['repeats']} interleaved repeats"
    )


def _replot(args: argparse.Namespace) -> int:
    """The table and the plot of a stored run; the swept dimension is the one that varies."""
    from rich.console import Console

    meta, summaries = report.read_json(Path(args.replot))
    varies = [d for d in "NDV" if len({getattr(p, d) for p, _ in summaries}) > 1]
    console = Console(width=None if sys.stdout.isatty() else 160)
    in_process = meta.get("in_process_points")
    console.print(report.table(summaries, _title(meta), in_process))
    if "shape" in meta:
        _print_targets(console, in_process or summaries, meta["shape"], in_process is not None)
    report.write_plot(summaries, varies[0] if varies else "V", Path(args.plot), _title(meta))
    print(f"plot: {args.plot}")
    return 0


def _print_targets(console, summaries, shape, in_process: bool = False) -> list[targets.Target]:
    found = targets.check(summaries, shape)
    if found:
        n, d, v = shape
        where = ", in-process (a model's step between calls)" if in_process else ""
        console.print(targets.table(found, f"Targets at N={n} D={d} V={v}, this run{where}"))
    return found


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


class _Reporter:
    """Progress: the bar's text in a terminal; elsewhere one line per finished point, each
    with the elapsed time and an estimate of the time left (the flops still to run at the
    rate of those run, :func:`linear_ce.bench.runner.point_work`)."""

    def __init__(self, work: list[float], pipe) -> None:
        import time

        self.clock = time.perf_counter
        self.start = self.clock()
        self.work, self.done, self.pipe = work, 0, pipe

    def left(self) -> str:
        # From the second point on, the rate of the points since the first: the first also
        # pays the workers' start, compiling and the plan's measurements, once a run.
        skip = 1 if self.done > 1 else 0
        ran = sum(self.work[skip : self.done])
        if not ran:
            return "estimating the time left"
        elapsed = self.clock() - (self.first if skip else self.start)
        return f"~{_minutes(elapsed * (sum(self.work) - sum(self.work[: self.done])) / ran)} left"

    def finished(self, label: str, rows: list) -> None:
        self.done += 1
        if self.done == 1:
            self.first = self.clock()
        if self.pipe is None:
            return
        head = next((r for r in rows if r.variant.endswith("linear_ce") and r.ratio), None)
        result = f"; {head.variant} {head.ratio:.2f}× {head.reference}" if head else ""
        print(
            f"[{self.done}/{len(self.work)}] {label}{result}; "
            f"{_minutes(self.clock() - self.start)} elapsed, {self.left()}",
            file=self.pipe,
            flush=True,
        )


def _slow_half_lines(summaries) -> list[str]:
    """Where peers were measured at fewer rows (slow half GEMMs): what their step and
    linear_ce's cost against the fp32 floor."""
    lines = []
    for point, rows in summaries:
        reduced = [r for r in rows if r.note.startswith("measured at N=") and r.ratio]
        if not reduced:
            continue
        why = reduced[0].note.split(": ", 1)[1]
        peers = ", ".join(f"{r.variant} {r.ratio:.0f}×" for r in reduced)
        line = f"{point.label}: {why}; peers (fewer rows, time scaled) {peers} the fp32 floor"
        ours = next((r for r in rows if r.variant.endswith("linear_ce") and r.ratio), None)
        if ours is not None:
            slowest = max(r.seconds for r in reduced)
            line += (
                f"; {ours.variant} {ours.ratio:.2f}×, the slowest peer "
                f"{slowest / ours.seconds:.0f}× its time"
            )
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return _replot(args)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: torch sees no CUDA device", file=sys.stderr)
            return 2
    # A pipe or CI log gets a table wide enough to read, not the 80-column default.
    console = Console(width=None if sys.stdout.isatty() else 160)
    points = config.points(
        args.shape_list,
        args.dtype_list,
        args.device,
        args.sweep_spec,
        args.sweep_dtypes,
        tuple(args.ignored_list),
        tuple(args.head_list),
        args.extra_dtypes,
        tuple(args.reduction_list),
    )
    passes = 2 if args.in_process else 1
    total = sum(sum(measured_at(name, point) for name in args.variant_list) for point in points) * (
        args.repeats + 1
    ) * passes  # fmt: skip
    pipe = None if sys.stdout.isatty() else sys.stdout
    work = [point_work(p, args.variant_list, args.repeats) for p in points]
    if args.in_process:
        work += [point_work(p, args.variant_list, args.repeats, model=True) for p in points]
    reporter = _Reporter(work, pipe)

    def finished(kind: str):
        def done(point, measured) -> None:
            reporter.finished(f"{point.label}{kind}", report.summarize(point, measured))

        return done

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("starting workers", total=total)

        def advance(text: str, calls: int) -> None:
            progress.update(task, advance=calls, description=f"{text} ({reporter.left()})")

        results = run_points(points, args.variant_list, args.repeats, advance, finished(""))
        in_process = None
        if args.in_process:
            in_process = run_points_in_process(
                points, args.variant_list, args.repeats, advance, finished(", in-process")
            )

    def summarized(found):
        return report.with_unmasked(
            [(p, report.summarize(p, m)) for p, m in zip(points, found, strict=True)]
        )

    summaries = summarized(results)
    in_summaries = None if in_process is None else summarized(in_process)
    meta = {
        "machine": report.machine(),
        "repeats": args.repeats,
        "device": args.device,
        "command": " ".join(
            ["python -m linear_ce.bench", *(argv if argv is not None else sys.argv[1:])]
        ),
        "shape": list(args.shape_list[0]),
        "in_process": args.in_process,
    }
    title = _title(meta)
    console.print(report.table(summaries, title, in_summaries))
    for line in _slow_half_lines(summaries):
        console.print(line)
    checked = summaries if in_summaries is None else in_summaries
    meta["targets"] = [
        dataclasses.asdict(t)
        for t in _print_targets(console, checked, args.shape_list[0], args.in_process)
    ]
    dim = args.sweep_spec[0] if args.sweep_spec else "V"
    report.write_json(summaries, meta, Path(args.json), in_summaries)
    report.write_plot([s for s in summaries if s[0].swept], dim, Path(args.plot), title)
    console.print(f"plot: {args.plot}   json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
