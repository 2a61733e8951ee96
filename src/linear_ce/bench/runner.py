"""Runs the variants point by point, repeats interleaved: each alone in its own worker
process (:func:`run_points`), or all in this one between the steps of a model
(:func:`run_points_in_process`).

At each point every variant builds the same inputs, makes one warm-up call (compilation,
first-touch of pages), then the repeats go round robin — repeat ``r`` starts at variant
``r`` — so a slow spell of the machine hits every variant alike and each variant's ratio
to its floor can be taken repeat by repeat.

A peer whose GEMMs run in a half dtype that this CPU multiplies slowly (no native bf16
GEMM: the plain bf16 expression then takes minutes a step) is measured at fewer rows,
:func:`reduced_rows`, and its seconds scaled to the point's rows (each of its GEMMs is
linear in the rows); its memory is not reported.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable

from linear_ce.bench.config import Point
from linear_ce.bench.variants import VARIANTS, half_gemm_rates, measured_at, slow_half_gemm

__all__ = [
    "SLOW_PEER_SECONDS",
    "Measured",
    "point_work",
    "reduced_rows",
    "run_points",
    "run_points_in_process",
]

#: The seconds all calls of one slow peer at one point may take (:func:`reduced_rows`).
SLOW_PEER_SECONDS = 20.0


@dataclasses.dataclass
class Measured:
    """One variant at one point: per-repeat seconds and peak bytes, or why there are none."""

    seconds: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: list[int] = dataclasses.field(default_factory=list)
    unavailable: str | None = None
    error: str | None = None
    #: What the variant's plan chose (rows, layout, measured rates), asked after the warm-up.
    plan: dict | None = None
    #: The rows it was measured at where fewer than the point's (:func:`reduced_rows`);
    #: ``seconds`` are then scaled to the point's rows and ``peak_bytes`` left empty.
    rows: int | None = None
    #: Why it was measured at ``rows``: its half GEMMs' rate against fp32's, GFLOP/s.
    reduced_because: str | None = None

    def record(self, point: Point, answer: dict) -> None:
        """Adds one timed call (``{"seconds", "peak_bytes"}``) measured at ``self.rows``."""
        if self.rows is None:
            self.seconds.append(answer["seconds"])
            self.peak_bytes.append(answer["peak_bytes"])
        else:
            self.seconds.append(answer["seconds"] * point.N / self.rows)


def _gemms(point: Point) -> int:
    return 4 if point.head == "divergence" else 3


def reduced_rows(point: Point, name: str, repeats: int) -> int | None:
    """The rows at which variant ``name`` is measured at ``point`` where fewer than
    ``point.N``, else ``None``: a :attr:`~linear_ce.bench.variants.Variant.half_gemms` peer at a
    point whose half GEMMs are slow (:func:`~linear_ce.bench.variants.slow_half_gemm`) gets
    as many rows as its ``repeats + 1`` calls run in :data:`SLOW_PEER_SECONDS` at the
    measured half GEMM rate (one thread's: a lower bound on the call's; at least one row)."""
    if not VARIANTS[name].half_gemms or not slow_half_gemm(point):
        return None
    half, _ = half_gemm_rates(point.torch_dtype, point.D)
    seconds_per_row = 2 * _gemms(point) * point.D * point.V / (half * 1e9) * (repeats + 1)
    rows = int(SLOW_PEER_SECONDS / seconds_per_row)
    return max(1, rows) if rows < point.N else None


def point_work(point: Point, names: list[str], repeats: int, model: bool = False) -> float:
    """The flops of every call measured at ``point`` (the GEMMs of the variants that can run
    there; a reduced peer's at its rows; ``model``: the transformer block's step before each
    call too): what the time left is estimated from."""
    total = 0.0
    for name in names:
        variant = VARIANTS[name]
        if measured_at(name, point) and variant.unavailable(point) is None:
            rows = reduced_rows(point, name, repeats) or point.N
            gemms = 1 if variant.kind == "forward" else _gemms(point)
            call = 2 * gemms * rows * point.D * point.V
            total += (repeats + 1) * (call + (72 * point.N * point.D**2 if model else 0))
    return total


def _reduce(point: Point, name: str, repeats: int, measured: Measured) -> Point | None:
    """The point ``name`` is measured at (``point`` or fewer rows, noted in ``measured``),
    or ``None`` where the variant cannot take fewer rows (noted as unavailable)."""
    rows = reduced_rows(point, name, repeats)
    if rows is None:
        return point
    half, single = half_gemm_rates(point.torch_dtype, point.D)
    because = f"its {point.dtype} GEMMs run at {half:.2g} GFLOP/s a thread here (fp32 {single:.0f})"
    small = dataclasses.replace(point, N=rows)
    reason = VARIANTS[name].unavailable(small)
    if reason is not None:
        call = 2 * _gemms(point) * point.N * point.D * point.V / (half * 1e9)
        measured.unavailable = f"not measured: {because}, a call would take ~{call:.0f} s"
        return None
    measured.rows, measured.reduced_because = rows, because
    return small


class _Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "linear_ce.bench.worker", name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )

    def send(self, request: dict) -> None:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = self.log.read()[-400:].strip().replace("\n", " | ")
            return {"error": f"worker exited (code {self.process.wait()}): {tail}", "dead": True}
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self.send(request)
        return self.receive()

    def close(self) -> None:
        if self.process.poll() is None:
            self.send({"op": "exit"})
            self.process.wait()
        self.log.close()


def run_points(
    points: list[Point],
    names: list[str],
    repeats: int,
    advance: Callable[[str, int], None],
    finished: Callable[[Point, dict[str, Measured]], None] | None = None,
) -> list[dict[str, Measured]]:
    """Measure ``names`` at each point (those :func:`~linear_ce.bench.variants.measured_at` it),
    each variant in its own worker process; ``advance(text, calls)`` reports progress
    (``repeats + 1`` calls per variant and point, skipped ones included), ``finished(point,
    measured)`` each point done.

    Returns, for each point, the measurements by variant name.
    """
    # A worker (a process that imports torch) only for the variants some point measures:
    # the per-token and distillation variants stay idle in the default run.
    workers = {name: _Worker(name) for name in names if any(measured_at(name, p) for p in points)}
    results = []
    try:
        for point in points:
            here = [name for name in names if measured_at(name, point)]
            measured = {name: Measured() for name in here}
            sent = []
            for name in here:
                at = _reduce(point, name, repeats, measured[name])
                if at is not None:
                    workers[name].send({"op": "setup", "point": dataclasses.asdict(at)})
                    sent.append(name)
            live = []
            for name in sent:
                worker = workers[name]
                answer = worker.receive()
                if "unavailable" in answer:
                    measured[name].unavailable = answer["unavailable"]
                elif "error" in answer:
                    measured[name].error = answer["error"]
                else:
                    live.append(name)
            advance(f"{point.label}: setup", (len(here) - len(live)) * (repeats + 1))
            for name in live:
                answer = workers[name].ask({"op": "run"})
                advance(f"{point.label}: {name} warm-up", 1)
                if "error" in answer:
                    measured[name].error = answer["error"]
                    continue
                answer = workers[name].ask({"op": "plan"})
                measured[name].plan = answer.get("plan")
            for r in range(repeats):
                shift = r % max(len(live), 1)
                for name in live[shift:] + live[:shift]:
                    if measured[name].error is not None:
                        advance(f"{point.label}: {name} failed", 1)
                        continue
                    answer = workers[name].ask({"op": "run"})
                    advance(f"{point.label}: {name} repeat {r + 1}/{repeats}", 1)
                    if "error" in answer:
                        measured[name].error = answer["error"]
                    else:
                        measured[name].record(point, answer)
            for name in sent:
                worker = workers[name]
                if worker.process.poll() is not None:
                    worker.close()
                    workers[name] = _Worker(name)
                else:
                    worker.ask({"op": "free"})
            results.append(measured)
            if finished is not None:
                finished(point, measured)
    finally:
        for worker in workers.values():
            worker.close()
    return results


def _error(error: Exception) -> str:
    traceback.print_exc(file=sys.stderr)
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def run_points_in_process(
    points: list[Point],
    names: list[str],
    repeats: int,
    advance: Callable[[str, int], None],
    finished: Callable[[Point, dict[str, Measured]], None] | None = None,
) -> list[dict[str, Measured]]:
    """:func:`run_points` with every variant in this process, as a training step runs the
    head: before each call (warm-up and repeats alike) one forward and backward of a
    transformer block at the point's ``N`` and ``D`` (:func:`linear_ce.bench.workload.model_step`),
    outside the timed call. The variants share the point's inputs (each call drops the
    gradients of the one before)."""
    from linear_ce.bench.measure import measure
    from linear_ce.bench.variants import make_inputs
    from linear_ce.bench.workload import model_step
    from linear_ce.engine.scratch import kept_bytes

    results = []
    for point in points:
        import torch

        device = torch.device(point.device)
        here = [name for name in names if measured_at(name, point)]
        measured = {name: Measured() for name in here}
        step = model_step(point)
        inputs: dict[int, tuple] = {}
        calls = {}
        for name in here:
            variant = VARIANTS[name]
            at = _reduce(point, name, repeats, measured[name])
            reason = None if at is None else variant.unavailable(at)
            if at is None or reason is not None:
                measured[name].unavailable = measured[name].unavailable or reason
                advance(f"{point.label}: {name} unavailable", repeats + 1)
                continue
            if at.N not in inputs:
                inputs[at.N] = make_inputs(at)
            reduction = {} if at.reduction == "mean" else {"reduction": at.reduction}
            try:
                calls[name] = variant.build(*inputs[at.N], **reduction)
                step()
                measure(calls[name], device)
                if variant.describe is not None:
                    plan = variant.describe(at)
                    plan["kept_scratch_bytes"] = kept_bytes()
                    measured[name].plan = plan
            except Exception as error:
                measured[name].error = _error(error)
                calls.pop(name, None)
            advance(f"{point.label}: {name} warm-up", 1)
        live = list(calls)
        for r in range(repeats):
            shift = r % max(len(live), 1)
            for name in live[shift:] + live[:shift]:
                if measured[name].error is None:
                    try:
                        step()
                        sample = measure(calls[name], device)
                        answer = {"seconds": sample.seconds, "peak_bytes": sample.peak_bytes}
                        measured[name].record(point, answer)
                    except Exception as error:
                        measured[name].error = _error(error)
                advance(f"{point.label}: {name} repeat {r + 1}/{repeats}", 1)
        for name in here:
            if name not in live and measured[name].error is not None:
                advance(f"{point.label}: {name} failed", repeats)
        del calls, inputs, step
        gc.collect()
        results.append(measured)
        if finished is not None:
            finished(point, measured)
    return results
