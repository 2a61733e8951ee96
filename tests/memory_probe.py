"""Transient peak memory of one call, measured in a fresh Python process.

``transient_peak(setup, call)`` runs ``setup`` (builds the inputs, warms up),
reads ``VmRSS`` and resets the peak (``echo 5 > /proc/self/clear_refs``), runs
``call``, and returns ``VmHWM`` minus that ``VmRSS`` in bytes: the peak
resident growth caused by the call, inputs excluded. A separate process per
measurement keeps earlier allocations (and the allocator's cache) out of it.

Run as a script it reads the two code strings as JSON from stdin and prints
the number of bytes.

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

__all__ = ["transient_peak"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _measure(setup: str, call: str) -> int:
    scope: dict = {}
    exec(setup, scope)
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    exec(call, scope)
    return (_status_kib("VmHWM") - before) * 1024


def transient_peak(setup: str, call: str, *, timeout: float = 600.0) -> int:
    """Peak RSS growth in bytes of running ``call`` after ``setup``, in a new process."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise RuntimeError("transient_peak needs Linux /proc (clear_refs, VmHWM)")
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        input=json.dumps({"setup": setup, "call": call}),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed (exit {done.returncode}):\n{done.stderr}")
    return int(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    request = json.load(sys.stdin)
    print(_measure(request["setup"], request["call"]))
