"""The process that runs one variant: commands on stdin, JSON results on stdout.

Commands, one JSON object a line: ``{"op": "setup", "point": {...}}`` builds
the inputs and the call; ``{"op": "run"}`` measures one call and answers
``{"seconds": s, "peak_bytes": b}``; ``{"op": "plan"}`` answers ``{"plan": {...}}``,
what the variant's plan chose and the scratch kept since its warm-up call
(``None`` for variants without one); ``{"op": "free"}``
drops the inputs.
Any failure is answered ``{"error": "..."}`` and the worker keeps serving.
Started by :mod:`linear_ce.bench.runner` as ``python -m linear_ce.bench.worker NAME``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from linear_ce.bench.config import Point
from linear_ce.bench.measure import measure
from linear_ce.bench.variants import VARIANTS, make_inputs
from linear_ce.engine.scratch import kept_bytes


def serve(name: str, commands, answers) -> None:
    """Answer ``commands`` (an iterable of JSON lines) for the variant ``name``."""
    variant = VARIANTS[name]
    call, device = None, torch.device("cpu")
    for line in commands:
        request = json.loads(line)
        op = request["op"]
        try:
            if op == "setup":
                point = Point(**request["point"])
                device = torch.device(point.device)
                call = None
                reason = variant.unavailable(point)
                if reason is not None:
                    answer = {"unavailable": reason}
                else:
                    # The reduction reaches the builds that take one (Variant.reductions).
                    reduction = {} if point.reduction == "mean" else {"reduction": point.reduction}
                    call = variant.build(*make_inputs(point), **reduction)
                    answer = {"ok": True}
            elif op == "run":
                if call is None:
                    raise RuntimeError("run before a successful setup")
                sample = measure(call, device)
                answer = {"seconds": sample.seconds, "peak_bytes": sample.peak_bytes}
            elif op == "plan":
                describe = variant.describe
                plan = None if describe is None or call is None else describe(point)
                if plan is not None:
                    # After the warm-up: the scratch the measured calls find kept.
                    plan["kept_scratch_bytes"] = kept_bytes()
                answer = {"plan": plan}
            elif op == "free":
                call = None
                answer = {"ok": True}
            elif op == "exit":
                return
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as error:
            call = None
            traceback.print_exc(file=sys.stderr)
            answer = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main() -> None:
    # Results go to the original stdout; anything a library prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    serve(sys.argv[1], sys.stdin, answers)


if __name__ == "__main__":
    main()
