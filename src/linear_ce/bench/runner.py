"""Runs the variants point by point, one worker process each, repeats interleaved.

At each point every worker builds the same inputs (in parallel), makes one
warm-up call (compilation, first-touch of pages), then the repeats go round
robin — repeat ``r`` starts at variant ``r`` — so a slow spell of the machine
hits every variant alike and each variant's ratio to its floor can be taken
repeat by repeat.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable

from linear_ce.bench.config import Point
from linear_ce.bench.variants import measured_at

__all__ = ["Measured", "run_points"]


@dataclasses.dataclass
class Measured:
    """One variant at one point: per-repeat seconds and peak bytes, or why there are none."""

    seconds: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: list[int] = dataclasses.field(default_factory=list)
    unavailable: str | None = None
    error: str | None = None
    #: What the variant's plan chose (rows, layout, measured rates), asked after the warm-up.
    plan: dict | None = None


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
) -> list[dict[str, Measured]]:
    """Measure ``names`` at each point (those :func:`~linear_ce.bench.variants.measured_at` it);
    ``advance(text, calls)`` reports progress (``repeats + 1`` calls per variant and
    point, skipped ones included).

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
            for name in here:
                workers[name].send({"op": "setup", "point": dataclasses.asdict(point)})
            live = []
            for name in here:
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
                        measured[name].seconds.append(answer["seconds"])
                        measured[name].peak_bytes.append(answer["peak_bytes"])
            for name in here:
                worker = workers[name]
                if worker.process.poll() is not None:
                    worker.close()
                    workers[name] = _Worker(name)
                else:
                    worker.ask({"op": "free"})
            results.append(measured)
    finally:
        for worker in workers.values():
            worker.close()
    return results
