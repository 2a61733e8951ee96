"""Transient peak memory of one call, measured in a process of its own.

``transient_peak(setup, call)`` runs ``setup`` (builds the inputs, warms up),
reads ``VmRSS`` and resets the peak (``echo 5 > /proc/self/clear_refs``), runs
``call``, and returns ``VmHWM`` minus that ``VmRSS`` in bytes: the peak
resident growth caused by the call, inputs excluded. Scratch that linear_ce kept
from a warm-up call (``linear_ce.kept_scratch_bytes()``) counts as the call's: it is
memory the call needs, found already there. A separate process per
measurement keeps earlier allocations (and the allocator's cache) out of it.

``transient_peaks(preamble, cases)`` measures several ``(setup, call)`` pairs
the same way: one new process runs ``preamble`` (the imports, which take
seconds) once, then forks a child per case, so each case still starts from a
clean heap but the imports are paid once. The preamble must not run torch
operations (a forked child cannot use the parent's thread pool).

Run as a script it reads the request as JSON from stdin and prints one line
per case: the number of bytes.

Example::

    >>> peak = transient_peak(
    ...     "import torch; x = torch.randn(1000, 1000)",
    ...     "y = x @ x",
    ... )  # about 4 MB
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

__all__ = ["transient_peak", "transient_peaks"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _kept_kib() -> int:
    linear_ce = sys.modules.get("linear_ce")
    return 0 if linear_ce is None else linear_ce.kept_scratch_bytes() // 1024


def _measure(scope: dict, setup: str, call: str) -> int:
    exec(setup, scope)
    before = _status_kib("VmRSS") - _kept_kib()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    exec(call, scope)
    return (_status_kib("VmHWM") - before) * 1024


def _measure_in_child(scope: dict, setup: str, call: str) -> str:
    """The case's peak in bytes, measured in a forked child; a failure's traceback
    comes back as the error text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        status = 0
        try:
            answer = str(_measure(dict(scope), setup, call))
        except BaseException:
            answer, status = traceback.format_exc(), 1
        with os.fdopen(write_end, "w") as out:
            out.write(answer)
        os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end) as answer_pipe:
        answer = answer_pipe.read()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"memory probe case failed:\n--- setup\n{setup}\n--- error\n{answer}")
    return answer


def transient_peaks(
    preamble: str, cases: list[tuple[str, str]], *, timeout: float = 600.0
) -> list[int]:
    """Peak RSS growth in bytes of each ``(setup, call)`` of ``cases``, each in a
    child forked from one new process that ran ``preamble``."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise RuntimeError("transient_peak needs Linux /proc (clear_refs, VmHWM)")
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        input=json.dumps({"preamble": preamble, "cases": cases}),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed (exit {done.returncode}):\n{done.stderr}")
    return [int(line) for line in done.stdout.strip().splitlines()[-len(cases) :]]


def transient_peak(setup: str, call: str, *, timeout: float = 600.0) -> int:
    """Peak RSS growth in bytes of running ``call`` after ``setup``, in a new process."""
    return transient_peaks("", [(setup, call)], timeout=timeout)[0]


if __name__ == "__main__":
    request = json.load(sys.stdin)
    shared: dict = {}
    exec(request["preamble"], shared)
    for case_setup, case_call in request["cases"]:
        print(_measure_in_child(shared, case_setup, case_call), flush=True)
