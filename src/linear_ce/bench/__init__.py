"""The benchmark report: ``python -m linear_ce.bench``.

Every variant of the same computation — the three-GEMM floor, the plain
expression (eager and compiled), torch's builtin chunked path, ``linear_ce``
and optional peers — runs in its own worker process; the parent interleaves
their repeats, so each ratio to the floor is a paired measurement taken side
by side. See :mod:`linear_ce.bench.__main__` for the options.

Modules: :mod:`~linear_ce.bench.config` (shapes and CLI values),
:mod:`~linear_ce.bench.variants` (what is measured),
:mod:`~linear_ce.bench.measure` (one call: time and transient memory),
:mod:`~linear_ce.bench.worker` (the per-variant process),
:mod:`~linear_ce.bench.runner` (interleaving and progress),
:mod:`~linear_ce.bench.report` (table, PNG, JSON).
"""
