"""This machine's GEMM rates, measured once: the plan's machine-dependent choices.

How many rows a chunk needs before a CPU's GEMMs reach their rate, which layout of the
``(chunk, V)`` logits tile its BLAS prefers, and whether its half-precision GEMMs beat
fp32 ones differ from one CPU to the next: one CPU runs the three GEMMs of a 256-row chunk
near their 2048-row rate where another loses a quarter of its weight-gradient GEMM's rate
there, and fp16 GEMMs may run at the fp32 rate (AVX512-FP16 without AMX-FP16) while bf16
ones (AMX) run several times faster (the stored runs of each CPU: results/runs.jsonl).
So :func:`linear_ce.engine.plan.make_plan` asks this module, which answers from a short
measurement of this machine's GEMMs at the call's shape class (its feature count, at
most ``MAX_MEASURE_FEATURES``, and dtype), taken once per process and cached on disk per
machine and torch version.

What is measured (:func:`chunk_rates`): the three GEMMs of a chunk of ``B`` rows against
a block of ``MEASURE_CLASSES`` classes per thread of a random weight (logits, input
gradient, the weight gradient added into an accumulator, as the chunk loop issues them),
for each candidate ``B`` of ``CANDIDATE_ROWS`` the memory budget allows and for both tile
layouts, ``MEASURE_ROUNDS`` interleaved rounds, the fastest of each (a busy machine only
slows a GEMM down; interleaving gives every candidate the same slow spells). And the
logits GEMM in a half dtype against fp32 (:func:`half_speedup`). A measurement whose
rounds disagree by more than ``NOISE_LIMIT``, or during which the process's threads ran
less than ``MIN_BUSY`` of the time (other work had the cores), decides nothing and is
not cached: the process takes the fallback below. The choices:

- **rows per chunk** (:meth:`Tuning.rows`): the budget's rows where they run the three
  GEMMs within ``TOLERANCE`` of the best rate measured among the candidates the budget
  allows, else the smallest candidate that does (the budget's own rows where that is the
  largest candidate under them): a tie goes to fewer chunks, since each streams the whole
  weight, which the measurement's blocks do not show. Under the default budget a one-tile loop's
  candidates go up to ``linear_ce.engine.plan.MEASURED_STRETCH`` times it (at most half
  the gradients' bytes), as far as the call pays for measuring them: longer chunks are
  taken only where they measured faster. fp32/fp64 inputs; half inputs keep the
  budget's longest chunks, since their weight-gradient sum pays a pass per chunk.
- **tile layout** (:meth:`Tuning.class_major`): class-major (a ``(V, B)`` array used as its
  transpose, so the logits GEMM is ``W·xᵀ``), or row-major where that ran the three GEMMs
  faster by more than ``TOLERANCE`` at the chosen rows.
- **half tile step** (:meth:`Tuning.step_rows`): with native half GEMMs the chunk's
  logits live in a half tile whose fp32 math runs a step of rows at a time
  (:mod:`linear_ce.engine.chunk_loop`); the step is the largest candidate of ``STEP_CANDIDATES``
  within ``TOLERANCE`` of the fastest (:func:`step_rates`, its small per-step operations
  included), scaled to the call's classes (the same bytes per step: what fits a core's
  cache).
- **exponential** (:meth:`Tuning.exp2`): half inputs' fp32 math forms ``eᵘ`` with
  ``torch.exp`` or as ``2^(u·log₂e)``, whichever ran faster (:func:`exp_speedup`): which
  one torch vectorises better differs between CPU generations by a factor of two or more
  either way.
- **vocabulary block** (:meth:`Tuning.min_class_block`): the fewest classes per block of the
  vocabulary pass before its rows are split into groups. A block of ``C`` classes against
  ``M`` rows issues the same three GEMM shapes as a chunk of ``C`` rows against ``M``
  classes (the roles of rows and classes swap), so it is the smallest candidate up to the
  fixed rule's within ``TOLERANCE`` of the best rate among them.
- **half path** (:func:`half_gemm_pays`): a CPU whose flags promise native fp16/bf16 GEMMs
  (:func:`linear_ce.engine.capability.native_half_gemm`) takes them only if the measured half
  GEMM runs at least ``HALF_MIN_SPEEDUP`` times its fp32 rate; else the fp32 path.

A call uses measured choices only where measuring costs at most ``1/MEASURE_RATIO`` of
its own GEMMs (:func:`worth_measuring`), on a CPU, outside ``torch.compile`` tracing and
fake tensors, and without ``torch.distributed`` initialised (the ranks of a
vocabulary-parallel call must plan the same chunks, and each would measure its own
rates). Everywhere else the plan takes the **fallback**, the fixed rule: the budget's
longest chunks, a class-major tile, the half path the CPU's flags promise,
``linear_ce.engine.plan.HALF_TILE_STEP_ROWS`` rows per half tile step, ``torch.exp`` on a CPU with AMX
(``linear_ce.engine.plan.EXP_FLAG``) and ``2^(u·log₂e)`` elsewhere, and
``linear_ce.engine.plan.MIN_CLASS_BLOCK`` classes. Every choice changes how the work is split, never what is computed: results
agree to rounding.

Environment (read on every call; a bad value is a ``ValueError`` naming the variable):

- ``LINEAR_CE_MEASURE``: ``0`` never measures (every call takes the fallback); ``1`` or
  unset measures and caches the rates in ``LINEAR_CE_CACHE_DIR`` (default
  ``$XDG_CACHE_HOME/linear_ce``, else ``~/.cache/linear_ce``), one JSON file per machine
  (CPU model, flags) and torch version, written atomically, with a checksum: a file that
  fails its checks is measured again and replaced; ``process`` measures but keeps the
  rates in this process only.
- ``LINEAR_CE_MEMORY_BUDGET``: the share of the gradients' bytes the chunk loop's scratch
  may take for fp32 inputs (default ``0.25``, ``linear_ce.engine.plan.BUDGET_SHARE``: a training
  step's transient peak ≈ 1.25× the gradients, which a measured plan may stretch to 0.5,
  ≈ 1.5×, where longer chunks run faster); set, it is a hard cap, and every other budget
  of the plan (half inputs, the vocabulary pass, distillation's teacher) scales with it.
- ``LINEAR_CE_CHUNK_ROWS``: a number of rows forces the rows-per-chunk choice (at most
  the budget's rows, unstretched); ``auto`` or unset: measured.
- ``LINEAR_CE_TILE_LAYOUT``: ``class-major`` or ``row-major`` forces the layout, the
  vocabulary pass's too; ``auto`` or unset: measured (the vocabulary pass: the backend's).
- ``LINEAR_CE_CLASS_BLOCK``: a number of classes forces the vocabulary pass's fewest
  classes per block; ``auto`` or unset: measured.
- ``LINEAR_CE_STATS_BLOCK``: a number of classes forces the block of the statistics pass
  of a call without gradients (:mod:`linear_ce.engine.stats_pass`), ``off`` turns the
  pass off (the chunk loop's chunks of whole rows); ``auto`` or unset: the plan's block.
- ``LINEAR_CE_STEP_ROWS``: a number of rows forces a half tile's step; ``auto`` or unset:
  measured.
- ``LINEAR_CE_EXP``: ``exp`` or ``exp2`` forces how half inputs' fp32 math forms ``eᵘ``;
  ``auto`` or unset: measured.
- ``LINEAR_CE_NATIVE_HALF_GEMM`` (:mod:`linear_ce.engine.capability`): ``0`` forces the fp32
  path, ``1`` the native path wherever the flags allow it; ``auto`` or unset: measured.

Example::

    >>> tuning = tuning_for(torch.device("cpu"), torch.float32, 1024, 6 * 2048 * 1024 * 32768)
    >>> tuning.rows(256) in (128, 192, 256)  # measured once per machine, then cached
    True
    >>> tuning_for(torch.device("cpu"), torch.float32, 64, 6 * 64 * 64 * 100).rows(48)
    48
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import threading
import time
import warnings
from pathlib import Path

import torch

from linear_ce.engine.capability import HALF_DTYPES, cpu_flags, native_half_mode
from linear_ce.engine.environment import cache_dir, read
from linear_ce.engine.stored_json import write_json

__all__ = [
    "CACHE_DIR_ENV",
    "CANDIDATE_ROWS",
    "CHUNK_ROWS_ENV",
    "CLASS_BLOCK_ENV",
    "EXP_ENV",
    "HALF_MIN_SPEEDUP",
    "MAX_MEASURE_FEATURES",
    "MEASURE_CLASSES",
    "MEASURE_ENV",
    "MEASURE_RATIO",
    "MEASURE_ROUNDS",
    "MEMORY_BUDGET_ENV",
    "MIN_BUSY",
    "NOISE_LIMIT",
    "STATS_BLOCK_ENV",
    "STEP_CANDIDATES",
    "STEP_ROWS_ENV",
    "STEP_ROW_OPS",
    "TILE_LAYOUT_ENV",
    "TOLERANCE",
    "Tuning",
    "chunk_rates",
    "exp_speedup",
    "forced_stats_block",
    "half_gemm_pays",
    "half_speedup",
    "known_rates",
    "machine_info",
    "measured_rates",
    "memory_budget",
    "step_rates",
    "tuning_for",
    "worth_measuring",
    "worth_measuring_steps",
]

MEASURE_ENV = "LINEAR_CE_MEASURE"
CACHE_DIR_ENV = "LINEAR_CE_CACHE_DIR"
MEMORY_BUDGET_ENV = "LINEAR_CE_MEMORY_BUDGET"
CHUNK_ROWS_ENV = "LINEAR_CE_CHUNK_ROWS"
TILE_LAYOUT_ENV = "LINEAR_CE_TILE_LAYOUT"
CLASS_BLOCK_ENV = "LINEAR_CE_CLASS_BLOCK"
STEP_ROWS_ENV = "LINEAR_CE_STEP_ROWS"
STATS_BLOCK_ENV = "LINEAR_CE_STATS_BLOCK"
EXP_ENV = "LINEAR_CE_EXP"

#: Chunk sizes measured. Above 1024 rows the weight-gradient GEMM's inner dimension is
#: as long as a typical feature count and its rate flat, so larger chunks are taken as
#: fast as 1024 rows (never measured, never preferred for speed alone).
CANDIDATE_ROWS = (128, 192, 256, 384, 512, 768, 1024)
#: Classes of the weight block the measurement multiplies, per thread (at least two):
#: large enough that each GEMM runs for milliseconds on every thread (timer and thread
#: start-up negligible), small enough that the measurement of the default budget's
#: candidates costs ~1/16 of a step at N=2048, F=1024, V=32768 (2 threads: 1024 classes).
MEASURE_CLASSES = 512
#: Feature counts above this are measured at it: the measurement's cost grows with them,
#: the candidates' relative rates (what the choices use) change little (the weight
#: gradient's inner dimension is the chunk's rows whatever the feature count).
MAX_MEASURE_FEATURES = 1024
#: Rows of the half-against-fp32 comparison.
HALF_MEASURE_ROWS = 512
#: Rows per step of a half tile's fp32 math measured (:func:`step_rates`), at
#: ``STEP_MEASURE_CLASSES`` classes; a call with ``V`` classes takes the best one's bytes.
STEP_CANDIDATES = (4, 8, 16, 32, 64)
STEP_MEASURE_CLASSES = 32768
#: Rows of the half block stepped through per candidate and round.
STEP_MEASURE_ROWS = 64
#: Small operations on a step's row vectors that :func:`step_rates` issues per step, as the
#: chunk loop and a cross-entropy head do (views, row statistics, the head's gathers and
#: per-row outputs: 45–70 per step of a bf16 step counted with ``torch.profiler``, torch
#: 2.13). They cost the same whatever the step's rows, so they are what a short step pays:
#: measured without them, the steps picked are too short, and a training step pays their
#: small operations once per step.
STEP_ROW_OPS = 48
#: What :func:`step_rates` and :func:`exp_speedup` cost, counted as GEMM flops that take as
#: long on a CPU with fast native bf16 GEMMs (AMX), where they cost the least against the
#: GEMMs: the gate of :func:`worth_measuring_steps`.
STEP_MEASURE_FLOPS = 40e9
#: Elements of the fp32 block :func:`exp_speedup` exponentiates (2 MiB: a step's tile that
#: stays in a core's L2, as the chunk loop's does).
EXP_MEASURE_ELEMENTS = 1 << 19
#: Timed rounds per candidate, interleaved; the fastest round of each counts.
MEASURE_ROUNDS = 3
#: A candidate within this share of the best measured rate is as good as the best: twice
#: the spread of repeated measurements on a quiet machine.
TOLERANCE = 0.04
#: A measurement whose two fastest rounds differ by more than this share is unsteady (the
#: machine was busy): its choices fall back to the fixed rule in this process, and it is
#: not written to the disk cache, so a later process measures again.
NOISE_LIMIT = 0.05
#: ... and so is one during which the process's threads ran less than this share of the
#: wall time (``time.process_time`` over the wall time × threads): a machine busy with
#: other work slows every round alike, so the rounds agree, but its rates are those of
#: a share of the cores, a tenth of the machine's own or less, and small GEMMs lose more
#: than large ones).
MIN_BUSY = 0.8
#: Measured choices are used by calls whose GEMMs take at least this many times the
#: measurement's flops, so measuring (once per process, and none once cached) costs at most
#: this fraction of one call.
MEASURE_RATIO = 8
#: Native half GEMMs are taken where they run at least this multiple of the fp32 rate: the
#: native path also saves the fp32 path's conversions of the weight (two per chunk) and
#: keeps longer chunks, so it wins at equal GEMM rates; emulated half GEMMs run 10–100×
#: slower, far below this.
HALF_MIN_SPEEDUP = 0.85
#: Bumped when what is measured changes; older cache files are then measured again.
CACHE_VERSION = 3

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
#: The CPU flags the choices depend on, shown by :func:`machine_info`.
_SHOWN_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)


def _measure_mode() -> str:
    return read(MEASURE_ENV)


def memory_budget() -> float | None:
    """``LINEAR_CE_MEMORY_BUDGET``: the fp32 chunk loop's scratch as a share of the
    gradients' bytes, or ``None`` where unset (``linear_ce.engine.plan.BUDGET_SHARE``)."""
    return read(MEMORY_BUDGET_ENV)


def _forced_rows() -> int | None:
    return read(CHUNK_ROWS_ENV)


def _forced_class_block() -> int | None:
    return read(CLASS_BLOCK_ENV)


def forced_stats_block() -> int | None:
    """``LINEAR_CE_STATS_BLOCK``: the classes per block it forces on the statistics pass
    (:mod:`linear_ce.engine.stats_pass`), ``0`` for ``off`` (no statistics pass: chunks of
    whole rows), ``None`` for ``auto`` (the plan's choice)."""
    return read(STATS_BLOCK_ENV)


def _forced_step_rows() -> int | None:
    return read(STEP_ROWS_ENV)


def _forced_either(name: str, yes: str) -> bool | None:
    """A two-way choice forced by ``name``: whether it is ``yes``, or ``None`` for ``auto``
    (measured)."""
    value = read(name)
    return None if value == "auto" else value == yes


def _forced_exp2() -> bool | None:
    return _forced_either(EXP_ENV, "exp2")


def _forced_layout() -> bool | None:
    return _forced_either(TILE_LAYOUT_ENV, "class-major")


def _can_measure(device: torch.device) -> bool:
    """Whether a measurement may run now: a CPU, real tensors, one process planning alone."""
    if device.type != "cpu" or _measure_mode() == "0":
        return False
    if torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None:
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _measure_classes() -> int:
    return MEASURE_CLASSES * max(2, torch.get_num_threads())


def worth_measuring(flops: float, features: int, cap: int) -> bool:
    """Whether a call of ``flops`` GEMM flops (``6·N·F·V`` for a training step) at ``features``
    pays for measuring the candidates up to ``cap`` rows in both layouts (the warm-up round
    included): at most ``1/MEASURE_RATIO`` of it."""
    rows = [b for b in CANDIDATE_ROWS if b <= cap] or [CANDIDATE_ROWS[0]]
    cost = (MEASURE_ROUNDS + 1) * 2 * sum(6 * b * features * _measure_classes() for b in rows)
    return flops >= MEASURE_RATIO * cost


def worth_measuring_steps(flops: float) -> bool:
    """As :func:`worth_measuring`, for the half tile's step rows (:func:`step_rates`)."""
    return flops >= MEASURE_RATIO * STEP_MEASURE_FLOPS


def _worth_half_measurement(flops: float, features: int) -> bool:
    """As :func:`worth_measuring`, for :func:`half_speedup` (one GEMM in two dtypes)."""
    cost = (MEASURE_ROUNDS + 1) * 2 * 2 * HALF_MEASURE_ROWS * features * _measure_classes()
    return flops >= MEASURE_RATIO * cost


# ---------------------------------------------------------------------------------------
# The store: this process's measurements, backed by one JSON file per machine.


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """The machine as the choices see it: CPU model, the flags they depend on, torch
    version and threads (the cache is per model, every flag and torch version; its
    entries per thread count)."""
    flags = cpu_flags()
    return {
        "cpu": _cpu_model(),
        "flags": [f for f in _SHOWN_FLAGS if f in flags],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


#: Settings that cap the instruction set torch's kernels and BLAS libraries use below what
#: the CPU's flags promise; a capped run measures other rates, so they key the cache too.
_ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def _machine_key() -> dict:
    key = {"cpu": _cpu_model(), "flags": sorted(cpu_flags()), "torch": torch.__version__}
    capped = {name: os.environ[name] for name in _ISA_ENV if os.environ.get(name)}
    return key | ({"isa": capped} if capped else {})


def _fingerprint() -> str:
    text = json.dumps([CACHE_VERSION, _machine_key()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _checksum(machine: dict, rates: dict) -> str:
    text = json.dumps([CACHE_VERSION, machine, rates], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class _Store:
    """Measured rates (GFLOP/s) by key: this process's, and the disk cache's once read."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.rates: dict[str, list[float]] = {}
        self.loaded_from: Path | None = None
        self.warned = False

    def clear(self) -> None:
        """Forget this process's rates (the disk cache is read again on the next use)."""
        with self.lock:
            self.rates.clear()
            self.loaded_from = None
            self.warned = False

    def _path(self) -> Path | None:
        if _measure_mode() == "process":
            return None
        return cache_dir() / f"machine-{_fingerprint()}.json"

    def _warn(self, text: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"linear_ce: {text}", RuntimeWarning, stacklevel=4)

    def _load(self, path: Path) -> None:
        if self.loaded_from == path:
            return
        self.loaded_from = path
        if not path.exists():
            return
        try:
            data = json.loads(path.read_text())
            problem = _check(data, _machine_key())
        except (OSError, ValueError, RecursionError) as error:
            # RecursionError: JSON nested deeper than the parser's stack.
            problem = f"{type(error).__name__}: {error}"
        if problem is not None:
            self._warn(f"ignoring the machine profile {path} ({problem}); measuring again")
            return
        for key, value in data["rates"].items():
            self.rates.setdefault(key, value)

    def get(self, keys: list[str]) -> dict[str, list[float]]:
        with self.lock:
            path = self._path()
            if path is not None:
                self._load(path)
            return {k: self.rates[k] for k in keys if k in self.rates}

    def put(self, new: dict[str, list[float]]) -> None:
        with self.lock:
            self.rates.update(new)
            path = self._path()
            if path is None:
                return
            steady = {k: v for k, v in new.items() if _steady(v)}
            if not steady:
                return
            # Another process may have added entries since: keep theirs too.
            merged = {k: v for k, v in self.rates.items() if _steady(v)}
            try:
                if path.exists():
                    data = json.loads(path.read_text())
                    if _check(data, _machine_key()) is None:
                        merged = {**data["rates"], **merged}
                _write_atomically(path, merged)
            except (OSError, ValueError, RecursionError) as error:
                self._warn(
                    f"cannot write the machine profile {path} ({error}); measured per process"
                )


def _steady(rates: list[float]) -> bool:
    """Whether a measurement (its last two values: the spread of its rounds, the share of
    the time its threads ran) was taken on a machine that let it run: rounds within
    ``NOISE_LIMIT``, threads busy at least ``MIN_BUSY``. Only such a measurement decides a
    choice or is written to disk."""
    return rates[-2] <= 1 + NOISE_LIMIT and rates[-1] >= MIN_BUSY


#: The values of an entry, by its kind (a key's first part): a chunk's four rates, a
#: half, step or exp measurement's one, each then its spread and busy share.
_ENTRY_LENGTHS = {"chunk": 6, "half": 3, "step": 3, "exp": 3}


def _check(data: object, machine: dict) -> str | None:
    """Why ``data`` is not a usable cache file for ``machine``, or ``None``."""
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return "another version"
    if data.get("machine") != machine:
        return "another machine or torch"
    rates = data.get("rates")
    if not isinstance(rates, dict) or data.get("checksum") != _checksum(machine, rates):
        return "checksum mismatch"
    for key, value in rates.items():
        if not (
            isinstance(key, str)
            and isinstance(value, list)
            and len(value) == _ENTRY_LENGTHS.get(key.split("/")[0])
            and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in value)
        ):
            return f"bad entry {key!r}"
    return None


def _write_atomically(path: Path, rates: dict[str, list[float]]) -> None:
    machine = _machine_key()
    data = {
        "version": CACHE_VERSION,
        "machine": machine,
        "rates": rates,
        "checksum": _checksum(machine, rates),
    }
    # Private to its user (the compiled row loops are loaded from it too).
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_json(path, data, indent=0, sort_keys=True)


_STORE = _Store()


# ---------------------------------------------------------------------------------------
# Measuring.


def _key(kind: str, dtype: torch.dtype, features: int, *rest: object) -> str:
    parts = [kind, _DTYPE_NAMES[dtype], f"F{features}", f"t{torch.get_num_threads()}"]
    return "/".join(parts + [str(r) for r in rest])


def _layout_name(class_major: bool) -> str:
    return "class" if class_major else "row"


class _Clock:
    """Times of labelled operations over repeated rounds, and how busy the process's
    threads were meanwhile."""

    def __init__(self) -> None:
        self.times: dict[tuple, list[float]] = {}
        self.wall = self.cpu = 0.0

    def time(self, label: tuple, fn) -> None:
        cpu, start = time.process_time(), time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        self.cpu += time.process_time() - cpu
        self.wall += seconds
        self.times.setdefault(label, []).append(seconds)

    def busy(self) -> float:
        """CPU time of the process over the wall time of the timed operations × threads."""
        return self.cpu / max(self.wall * torch.get_num_threads(), 1e-9)

    def best(self, label: tuple) -> float:
        return min(self.times[label])

    def spread(self, label: tuple) -> float:
        """The second-fastest time over the fastest: near 1 where the rounds agree
        (infinite after one round)."""
        times = sorted(self.times[label])
        return times[1] / times[0] if len(times) > 1 else math.inf

    def rounds(self, run_round) -> None:
        """``run_round(r)`` for ``MEASURE_ROUNDS`` rounds, stopping after the first where
        the threads were busy less than ``MIN_BUSY`` of it (the result is unsteady anyway:
        on a busy machine the measurement costs one round, not all)."""
        for r in range(MEASURE_ROUNDS):
            run_round(r)
            if self.busy() < MIN_BUSY:
                return


def chunk_rates(
    dtype: torch.dtype, features: int, rows: list[int], layouts: tuple[bool, ...] = (True, False)
) -> dict[tuple[int, bool], list[float]]:
    """Measure the three GEMMs of a chunk of each of ``rows`` rows in each layout
    (``True``: class-major) against ``MEASURE_CLASSES`` classes per thread, ``MEASURE_ROUNDS``
    interleaved rounds after a warm-up round: ``(rows, class_major) -> [logits, input
    gradient, weight gradient, all three]`` in GFLOP/s (each the fastest round), then the
    spread of the rounds of all three (:meth:`_Clock.spread`) and how busy the threads
    were (:meth:`_Clock.busy`)."""
    gen = torch.Generator().manual_seed(0)
    classes, most = _measure_classes(), max(rows)
    weight = torch.randn(classes, features, generator=gen).to(dtype)
    x = torch.randn(most, features, generator=gen).to(dtype)
    grad_w = torch.zeros(classes, features, dtype=dtype)
    grad_x = torch.zeros(most, features, dtype=dtype)
    store = {layout: torch.empty(classes * most, dtype=dtype) for layout in layouts}
    cases = [(b, layout) for b in rows for layout in layouts]

    def tile(b: int, class_major: bool) -> torch.Tensor:
        flat = store[class_major][: b * classes]
        return flat.view(classes, b).T if class_major else flat.view(b, classes)

    def chunk(b: int, layout: bool) -> None:
        t, xb = tile(b, layout), x[:b]
        clock.time((b, layout, 0), lambda: torch.mm(xb, weight.T, out=t))
        clock.time((b, layout, 1), lambda: grad_x[:b].addmm_(t, weight))
        clock.time((b, layout, 2), lambda: grad_w.addmm_(t.T, xb))

    clock = _Clock()
    for b, layout in cases:
        # A warm-up round: page faults, the BLAS's kernels and packing buffers.
        chunk(b, layout)

    def run_round(r: int) -> None:
        shift = r % len(cases)
        for b, layout in cases[shift:] + cases[:shift]:
            chunk(b, layout)

    clock = _Clock()
    clock.rounds(run_round)
    result = {}
    for b, layout in cases:
        gflop = 2 * b * features * classes / 1e9
        seconds = [clock.best((b, layout, g)) for g in range(3)]
        rounds = [
            sum(t) for t in zip(*(clock.times[(b, layout, g)] for g in range(3)), strict=True)
        ]
        rounds.sort()
        spread = rounds[1] / rounds[0] if len(rounds) > 1 else math.inf
        result[(b, layout)] = [gflop / s for s in seconds] + [3 * gflop / sum(seconds)]
        result[(b, layout)] += [spread, clock.busy()]
    return result


def half_speedup(dtype: torch.dtype, features: int) -> list[float]:
    """``[speedup, spread, busy]``: the logits GEMM's rate in ``dtype`` over its fp32
    rate, ``HALF_MEASURE_ROWS`` rows against the measurement's classes, the fastest of
    ``MEASURE_ROUNDS`` interleaved rounds after a warm-up; the larger spread of the two
    dtypes' rounds (:meth:`_Clock.spread`) and how busy the threads were."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(_measure_classes(), features, generator=gen)
    x = torch.randn(HALF_MEASURE_ROWS, features, generator=gen)
    operands = {d: (weight.to(d), x.to(d)) for d in (dtype, torch.float32)}
    for w, xd in operands.values():
        torch.mm(w, xd.T)

    def run_round(r: int) -> None:
        for d in (dtype, torch.float32) if r % 2 else (torch.float32, dtype):
            w, xd = operands[d]
            clock.time((d,), lambda w=w, xd=xd: torch.mm(w, xd.T))

    clock = _Clock()
    clock.rounds(run_round)
    speedup = clock.best((torch.float32,)) / clock.best((dtype,))
    return [speedup, max(clock.spread((d,)) for d in operands), clock.busy()]


def step_rates(dtype: torch.dtype, steps: list[int]) -> dict[int, list[float]]:
    """Measure a half tile's fp32 math (:mod:`linear_ce.engine.chunk_loop`) a step of each of
    ``steps`` rows at a time, over ``STEP_MEASURE_ROWS`` rows of ``STEP_MEASURE_CLASSES``
    classes of ``dtype``: widen the step to fp32, row max, subtract, ``exp``, row sums,
    scale, write back (the passes a cross-entropy head makes) and ``STEP_ROW_OPS`` small
    operations on the step's row vectors (what the loop and a head issue per step). ``step
    -> [G elements/s, spread, busy]``, the fastest of ``MEASURE_ROUNDS`` interleaved rounds
    after a warm-up."""
    gen = torch.Generator().manual_seed(0)
    rows, classes = STEP_MEASURE_ROWS, STEP_MEASURE_CLASSES
    half = (torch.randn(rows, classes, generator=gen) / 4).to(dtype)
    tile = torch.empty(max(steps), classes)
    stats = torch.empty(max(steps))

    def pass_over(step: int) -> None:
        for start in range(0, rows, step):
            part = half[start : start + step]
            n = part.shape[0]
            u = tile[:n]
            u.copy_(part)
            row_max = u.amax(dim=1)
            u.sub_(row_max[:, None])
            torch.exp(u, out=u)
            sums = stats[:n]
            torch.sum(u, dim=1, out=sums)
            for _ in range(STEP_ROW_OPS // 4):
                sums = torch.where(sums[:n] > 0, sums, row_max).mul(0.5)
            u.div_(sums[:, None])
            part.copy_(u)

    for step in steps:
        pass_over(step)

    def run_round(r: int) -> None:
        shift = r % len(steps)
        for step in steps[shift:] + steps[:shift]:
            clock.time((step,), lambda step=step: pass_over(step))

    clock = _Clock()
    clock.rounds(run_round)
    return {
        step: [rows * classes / 1e9 / clock.best((step,)), clock.spread((step,)), clock.busy()]
        for step in steps
    }


def exp_speedup() -> list[float]:
    """``[speedup, spread, busy]``: how many times faster ``2^(u·log₂e)`` (``torch.mul``, then
    ``exp2_``) forms ``eᵘ`` than ``torch.exp`` over an fp32 block of ``EXP_MEASURE_ELEMENTS``
    values in ``[−32, 0]`` (a step's ``u``), each written into a second block; the fastest
    of ``MEASURE_ROUNDS`` interleaved rounds after a warm-up, the larger spread of the two."""
    gen = torch.Generator().manual_seed(0)
    u = -32 * torch.rand(EXP_MEASURE_ELEMENTS, generator=gen)
    out = torch.empty_like(u)
    forms = {
        "exp": lambda: torch.exp(u, out=out),
        "exp2": lambda: torch.mul(u, 1.4426950408889634, out=out).exp2_(),
    }

    def run_round(r: int) -> None:
        for name in forms if r % 2 else reversed(forms):
            # Enough repeats that a round takes milliseconds, not the timer's resolution.
            clock.time((name,), lambda f=forms[name]: [f() for _ in range(8)])

    for form in forms.values():
        form()
    clock = _Clock()
    clock.rounds(run_round)
    speedup = clock.best(("exp",)) / clock.best(("exp2",))
    return [speedup, max(clock.spread((name,)) for name in forms), clock.busy()]


def _quietly(fn, *args):
    """``fn(*args)`` with no autocast or autograd around it (their dtypes and graphs are
    the caller's, not the measurement's)."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        return fn(*args)


def measured_rates(dtype: torch.dtype, features: int, rows: list[int]) -> dict:
    """``(rows, class_major) -> [logits, grad input, grad weight, all three]`` GFLOP/s for
    each of ``rows``, both layouts: from the store, measuring what it lacks."""
    keys = {
        (b, layout): _key("chunk", dtype, features, _layout_name(layout), f"B{b}")
        for b in rows
        for layout in (True, False)
    }
    with _STORE.lock:
        known = _STORE.get(list(keys.values()))
        missing = sorted({b for (b, _), k in keys.items() if k not in known})
        if missing:
            fresh = _quietly(chunk_rates, dtype, features, missing)
            _STORE.put({keys[case]: rates for case, rates in fresh.items()})
            known = _STORE.get(list(keys.values()))
    return {case: known[k] for case, k in keys.items()}


def known_rates(dtype: torch.dtype, features: int) -> dict:
    """What this process knows (measured or read from the disk cache) without measuring:
    ``{"chunk": {(rows, class_major): [logits, grad input, grad weight, all three,
    spread, busy]}, "half": [speedup, spread, busy] or None, "step": {rows: [G elements/s,
    spread, busy]}, "exp2": [speedup, spread, busy] or None}`` for GEMMs in ``dtype`` at
    ``features`` (the half entry: ``dtype``'s GEMMs against fp32's; the exp2 entry:
    :func:`exp_speedup`)."""
    keys = {
        (b, layout): _key("chunk", dtype, features, _layout_name(layout), f"B{b}")
        for b in CANDIDATE_ROWS
        for layout in (True, False)
    }
    half_key = _key("half", dtype, features, f"B{HALF_MEASURE_ROWS}")
    steps = {b: _key("step", dtype, 0, f"B{b}") for b in STEP_CANDIDATES}
    exp_key = _key("exp", torch.float32, 0)
    known = _STORE.get([*keys.values(), half_key, *steps.values(), exp_key])
    return {
        "chunk": {case: known[k] for case, k in keys.items() if k in known},
        "half": known.get(half_key),
        "step": {b: known[k] for b, k in steps.items() if k in known},
        "exp2": known.get(exp_key),
    }


# ---------------------------------------------------------------------------------------
# The choices.


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How one call's plan applies this machine's measurements, or the fallback rule.

    ``allowed``: a measurement may run for the call (a CPU, real tensors, one process
    planning alone, ``LINEAR_CE_MEASURE`` not ``0``); ``dtype`` and ``features``: its GEMMs'
    operand dtype and inner dimension; ``flops``: what its GEMMs cost (``6·N·F·V`` for a
    training step), which decides what is worth measuring (:func:`worth_measuring`).
    """

    allowed: bool
    dtype: torch.dtype
    features: int
    flops: float

    def measures(self, cap: int) -> bool:
        """Whether choices among chunks of up to ``cap`` rows are measured for this call."""
        return self.allowed and worth_measuring(self.flops, self.features, cap)

    def rows(self, cap: int, wide: int | None = None) -> int:
        """Rows per chunk for a budget of ``cap`` rows that may stretch to ``wide`` where
        longer chunks run faster: ``LINEAR_CE_CHUNK_ROWS`` (at most ``cap``), else ``cap``
        itself where the largest candidate under it runs within ``TOLERANCE`` of the best
        rate among those up to the most rows (at most ``wide``, at least ``cap``) whose
        measurement the call pays for, else the smallest candidate within ``TOLERANCE`` of
        that best (those most rows themselves where that is the largest candidate), else
        ``cap``.

        A tie goes to the budget's rows, not to shorter chunks: every chunk's GEMMs stream
        the whole weight and weight-gradient sum, which the measurement's cache-sized
        blocks of classes do not see: where the rates of several candidates agree, the
        longest of them runs the step nearer its floor."""
        forced = _forced_rows()
        if forced is not None:
            return min(forced, cap)
        wide = max(cap, wide or cap)
        above = [b for b in CANDIDATE_ROWS if cap < b < wide]
        limit = next((b for b in [wide, *reversed(above)] if self.measures(b)), cap)
        candidates = [b for b in CANDIDATE_ROWS if b <= limit]
        if len(candidates) < 2 or not self.measures(limit):
            return cap
        best = self._best_rates(candidates)
        if best is None:
            return cap
        top = max(best.values())
        under = [b for b in candidates if b <= cap]
        if under and best[under[-1]] >= (1 - TOLERANCE) * top:
            return cap
        chosen = _smallest_near(best, top)
        return limit if chosen == candidates[-1] else chosen

    def forced_rows(self) -> int | None:
        """The rows per chunk ``LINEAR_CE_CHUNK_ROWS`` forces, else ``None``."""
        return _forced_rows()

    def forced_class_major(self) -> bool | None:
        """The layout ``LINEAR_CE_TILE_LAYOUT`` forces (``True``: class-major), else
        ``None``: the vocabulary pass, whose layout is not measured, follows it too."""
        return _forced_layout()

    def class_major(self, rows: int) -> bool:
        """The logits tile's layout for chunks of ``rows`` rows: ``LINEAR_CE_TILE_LAYOUT``,
        else class-major unless the three GEMMs ran faster by more than ``TOLERANCE``
        row-major at the candidate nearest below ``rows`` (so rounds' noise does not flip
        it), else class-major."""
        forced = _forced_layout()
        if forced is not None:
            return forced
        b = max([c for c in CANDIDATE_ROWS if c <= rows] or [CANDIDATE_ROWS[0]])
        if not self.measures(b):
            return True
        rates = measured_rates(self.dtype, self.features, [b])
        if not all(_steady(r) for r in rates.values()):
            return True
        return rates[(b, False)][3] <= (1 + TOLERANCE) * rates[(b, True)][3]

    def min_class_block(self, fallback: int) -> int:
        """The vocabulary pass's fewest classes per block: the smallest candidate up to
        ``fallback`` whose GEMMs run within ``TOLERANCE`` of the best of them (a block of
        ``C`` classes issues a ``C``-row chunk's GEMM shapes: blocks no larger than the
        fixed rule's, so rows are split into groups no sooner), else ``fallback``;
        ``LINEAR_CE_CLASS_BLOCK`` forces it."""
        forced = _forced_class_block()
        if forced is not None:
            return forced
        candidates = [b for b in CANDIDATE_ROWS if b <= fallback]
        if len(candidates) < 2 or not self.measures(fallback):
            return fallback
        best = self._best_rates(candidates)
        return fallback if best is None else _smallest_near(best, max(best.values()))

    def step_rows(self, classes: int, fallback: int) -> int:
        """Rows per step of a half tile's fp32 math for ``classes`` classes:
        ``LINEAR_CE_STEP_ROWS``, else the measured step of the largest size within
        ``TOLERANCE`` of the fastest (at ``STEP_MEASURE_CLASSES`` classes; as many bytes per
        step at ``classes``: the steps that stay in a core's cache), else ``fallback``."""
        forced = _forced_step_rows()
        if forced is not None:
            return forced
        if not (self.allowed and worth_measuring_steps(self.flops)):
            return fallback
        keys = {b: _key("step", self.dtype, 0, f"B{b}") for b in STEP_CANDIDATES}
        with _STORE.lock:
            known = _STORE.get(list(keys.values()))
            missing = [b for b, k in keys.items() if k not in known]
            if missing:
                fresh = _quietly(step_rates, self.dtype, missing)
                _STORE.put({keys[b]: rates for b, rates in fresh.items()})
                known = _STORE.get(list(keys.values()))
        rates = {b: known[k] for b, k in keys.items()}
        if not all(_steady(r) for r in rates.values()):
            return fallback
        top = max(r[0] for r in rates.values())
        best = max(b for b, r in rates.items() if r[0] >= (1 - TOLERANCE) * top)
        return max(1, best * STEP_MEASURE_CLASSES // max(classes, 1))

    def exp2(self, fallback: bool) -> bool:
        """Whether the chunk loop forms ``eᵘ`` as ``2^(u·log₂e)`` (``Plan.exp2``):
        ``LINEAR_CE_EXP``, else where that measured faster than ``torch.exp``
        (:func:`exp_speedup`, with the half tile's steps, :meth:`step_rows`), else
        ``fallback``."""
        forced = _forced_exp2()
        if forced is not None:
            return forced
        if not (self.allowed and worth_measuring_steps(self.flops)):
            return fallback
        key = _key("exp", torch.float32, 0)
        with _STORE.lock:
            known = _STORE.get([key])
            if key not in known:
                _STORE.put({key: _quietly(exp_speedup)})
                known = _STORE.get([key])
        if not _steady(known[key]):
            return fallback
        return known[key][0] > 1.0

    def _best_rates(self, rows: list[int]) -> dict[int, float] | None:
        """The rate of the three GEMMs at each of ``rows``, in its faster layout; ``None``
        if a measurement was unsteady."""
        rates = measured_rates(self.dtype, self.features, rows)
        if not all(_steady(r) for r in rates.values()):
            return None
        return {b: max(rates[(b, True)][3], rates[(b, False)][3]) for b in rows}


def _smallest_near(best: dict[int, float], top: float) -> int:
    """The fewest rows of ``best`` whose rate is within ``TOLERANCE`` of ``top``."""
    return min(b for b, rate in best.items() if rate >= (1 - TOLERANCE) * top)


def tuning_for(device: torch.device, dtype: torch.dtype, features: int, flops: float) -> Tuning:
    """The :class:`Tuning` of a call on ``device`` whose GEMMs (operands ``dtype``, inner
    dimension ``features``) take ``flops``; measured at ``min(features,
    MAX_MEASURE_FEATURES)`` features."""
    allowed = dtype in _DTYPE_NAMES and features > 0 and _can_measure(device)
    return Tuning(allowed, dtype, min(features, MAX_MEASURE_FEATURES), float(flops))


def half_gemm_pays(dtype: torch.dtype, device: torch.device, features: int, flops: float) -> bool:
    """For a CPU whose flags promise native ``dtype`` GEMMs: whether to take them.
    ``LINEAR_CE_NATIVE_HALF_GEMM=1`` says yes; else, where the call is worth measuring
    for, whether the half logits GEMM runs at least ``HALF_MIN_SPEEDUP`` times its fp32
    rate (measured once per process and machine); else (the fallback) yes."""
    if native_half_mode() == "1":
        return True
    features = min(features, MAX_MEASURE_FEATURES)
    if not (
        dtype in HALF_DTYPES and _can_measure(device) and _worth_half_measurement(flops, features)
    ):
        return True
    key = _key("half", dtype, features, f"B{HALF_MEASURE_ROWS}")
    with _STORE.lock:
        known = _STORE.get([key])
        if key not in known:
            _STORE.put({key: _quietly(half_speedup, dtype, features)})
            known = _STORE.get([key])
    return not _steady(known[key]) or known[key][0] >= HALF_MIN_SPEEDUP
