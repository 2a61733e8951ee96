r"""The row math of a logits tile in compiled loops: one read of the tile for the row
statistics, one read and one write for the gradient (half tiles, and fp32 tiles in either
layout: :mod:`linear_ce.engine.chunk_loop` says which calls take them).

The chunk loop's torch operations on a chunk's logits (:mod:`linear_ce.engine.chunk_loop`)
each pass over the whole tile: widen a step of rows to fp32, the transform, the row max,
``u = s − m``, ``eᵘ``, its row sum, the head's row sums, the gradient's products, the
rounding back. Each pass streams the tile through memory, and together they are most of
what separates a bf16 step from its three GEMMs. ``native_rows.c`` does the
same math a row at a time, the row held in the core's cache between its reads:

.. math::

    v_j = x_j\,c, \quad m = \max_j v_j, \quad u_j = v_j - m, \quad
    Z = \sum_j e^{u_j}, \quad D = \sum_j e^{u_j} u_j, \quad u_t,

    g_j = e^{u_j}\,\bigl(a + b\,(u_j - \mu)\bigr) + \gamma\,[j = t],

with ``a``, ``b``, ``μ``, ``γ`` per row from the head (:meth:`NativeRows.grad_`), ``g``
written over the tile in its dtype, rounded once. A distillation loss reads two tiles of the same rows, the
student's and the teacher's (:meth:`NativeRows.pair_`): both maxima, both normalisers and the
divergence's sums in one visit of each row pair, then the student's gradient written over its
tile (forward KL, reverse KL and their mixture, whose ``softplus`` terms take a ``log1p``
polynomial). The sums are fp32 in 64 partial sums
per row, ``eᵘ`` a polynomial within 2 ulp of fp32's: results agree with the torch
operations to rounding (the tests compare both with float64 at the house bound).

The library is compiled on first use by the C compiler (``$CC``, else ``cc``) for this
CPU (``-march=native``) and kept in the cache directory of
:mod:`linear_ce.engine.machine` (``LINEAR_CE_CACHE_DIR``), named by a hash of the source,
the compiler, its flags and the CPU, so a new CPU or compiler builds its own. What is
loaded from there must be what this user built:

- the directory must belong to this user and be writable by no one else (a world-writable
  one, sticky like ``/tmp`` or not, is refused: anyone could plant a library there whose
  constructor runs in the process); made where missing with mode ``0700``. The default
  directory, where an earlier version left it writable by its group under the user's
  umask, is made ``0700``; a directory named by ``LINEAR_CE_CACHE_DIR`` is never changed;
- beside each library, a record (JSON, ``native-rows-<key>.json``) holds the sha256 and
  size of the file as built; the library is loaded only where both files are this
  user's own, writable by no one else, and the file's bytes match the record, else it is
  built again with a warning that says what was wrong (truncated, corrupted, writable by
  others). A library without a record is built again;
- a build is compiled into a private scratch directory, flushed to the disk, loaded from
  there, then renamed into place before its record is written (each atomically), so a
  crash or a full disk leaves no library a record vouches for;
- the compiler runs in a process group of its own, killed whole (its children too) when
  it has run ``LINEAR_CE_BUILD_TIMEOUT`` seconds (default 120; a build takes seconds).

Every failure to build or to load (the compiler's, a refused directory, a library that
lacks a symbol) is the warning of ``auto`` below, or the error of ``1``. Rows are split over ``torch.get_num_threads()`` threads: in an OpenMP region of the runtime torch's
GEMMs run in (``-fopenmp``; its workers, still spinning after a GEMM, take the rows), else,
where the compiler has no OpenMP, over a pool of Python threads (the library releases the
GIL).

Environment (read on every call; a bad value is a ``ValueError`` naming it):

- ``LINEAR_CE_NATIVE_ROWS``: ``0`` never (the torch operations); ``1`` always where the
  chunk loop can (a library that does not build or load is an error saying why: the
  compiler's message, the refused directory, the missing symbol); ``auto`` or unset:
  where the library builds and loads (else a warning, once, and the torch operations).
- ``LINEAR_CE_BUILD_TIMEOUT``: the seconds the compiler may run (default 120).
- ``LINEAR_CE_CACHE_DIR``: see :mod:`linear_ce.engine.machine`.

Example::

    >>> rows = native_rows(torch.bfloat16)
    >>> tile = torch.randn(4, 1000).bfloat16()
    >>> stats = rows.stats(tile, target=torch.tensor([0, 1, 2, -1])) if rows else None
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import platform
import shlex
import signal
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import torch

from linear_ce.engine.capability import cpu_flags
from linear_ce.engine.environment import BUILD_TIMEOUT_ENV, cache_dir, default_cache_dir, read
from linear_ce.engine.stored_json import write_json

__all__ = ["NATIVE_ROWS_ENV", "NativeRows", "PairSums", "RowSums", "native_mode", "native_rows"]

NATIVE_ROWS_ENV = "LINEAR_CE_NATIVE_ROWS"
_CACHE_DIR_ENV = "LINEAR_CE_CACHE_DIR"
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
#: Flags of every build; x86 CPUs with AVX-512 run the loops 16 lanes wide.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math"]
_FLAGS += ["-shared", "-fPIC"]
_X86_FLAGS = ["-mprefer-vector-width=512"]
#: OpenMP (the kernels' parallel regions, :func:`_in_parallel`) where the compiler has it,
#: else its ``simd`` pragmas alone (the rows then split over :func:`_split`'s pool).
_OPENMP_FLAGS = (["-fopenmp"], ["-fopenmp-simd"])
_LIBS = ["-lm"]

_c_float_p = ctypes.POINTER(ctypes.c_float)
_c_long_p = ctypes.POINTER(ctypes.c_int64)
_STATS_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
_STATS_ARGS += [ctypes.c_float, ctypes.c_void_p]
_STATS_ARGS += [ctypes.c_void_p] * 4
_GRAD_ARGS = list(_STATS_ARGS[:6]) + [ctypes.c_void_p] * 6
_FUSED_ARGS = list(_STATS_ARGS[:6]) + [ctypes.c_void_p] * 7
_PAIR_ARGS = [ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_int64] * 3
_PAIR_ARGS += [ctypes.c_float] * 4 + [ctypes.c_int]
_PAIR_ARGS += [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]


def native_mode() -> str:
    """``LINEAR_CE_NATIVE_ROWS``: ``"0"``, ``"1"`` or ``"auto"``."""
    return read(NATIVE_ROWS_ENV)


@dataclasses.dataclass
class RowSums:
    """Per row, fp32 ``(B,)``: ``row_max`` m, ``sum_exp`` Z, ``dot`` D (``None`` unless
    asked) and ``target_u`` :math:`u_t` (0 where the target is ``-1``; ``None`` unless a
    target was given)."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor
    dot: torch.Tensor | None
    target_u: torch.Tensor | None


@dataclasses.dataclass
class PairSums:
    """Per row, fp32 ``(B,)``, from :meth:`NativeRows.pair_`: the student's ``row_max`` and
    ``sum_exp``, the teacher's, the divergence's ``cross`` sum, the student's ``dot``
    (entropy), the hard term's ``z_1`` and ``target_u``, and the mixture's ``teacher_cross``
    sum (0 where not formed)."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor
    teacher_max: torch.Tensor
    teacher_sum_exp: torch.Tensor
    cross: torch.Tensor
    dot: torch.Tensor
    z_1: torch.Tensor
    target_u: torch.Tensor
    teacher_cross: torch.Tensor


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Kernel:
    """One kernel of the library: ``plain`` over rows ``[r0, r1)`` on the calling thread, and
    ``parallel`` (its ``_par`` form, the same arguments after ``(threads, align)``), which
    splits them over an OpenMP region where the build has OpenMP."""

    def __init__(self, library: ctypes.CDLL, name: str, args: list, returns: bool = True) -> None:
        self.plain = getattr(library, name)
        # ``returns``: the plain kernel returns its status (``void`` ones cannot fail).
        self.plain.argtypes, self.plain.restype = args, ctypes.c_int if returns else None
        self.parallel = getattr(library, f"{name}_par")
        self.parallel.argtypes = [ctypes.c_int, ctypes.c_int64, *args]
        self.parallel.restype = ctypes.c_int


class NativeRows:
    """The compiled row loops for tiles of one dtype (see the module doc)."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = _SUFFIX[dtype]
        self.dtype = dtype
        #: Whether the kernels split their rows in an OpenMP region (else over _split's pool).
        self.openmp = bool(library.lce_openmp())
        self._stats = _Kernel(library, f"lce_stats_{suffix}", _STATS_ARGS, returns=False)
        self._grad = _Kernel(library, f"lce_grad_{suffix}", _GRAD_ARGS, returns=False)
        self._fused = _Kernel(library, f"lce_fused_{suffix}", _FUSED_ARGS)
        self._pair = _Kernel(library, f"lce_pair_{suffix}", _PAIR_ARGS)
        self._fused_cm = self._stats_cm = self._grad_cm = self._pair_cm = None
        if dtype == torch.float32:
            self._pair_cm = _Kernel(library, "lce_pair_cm_f32", _PAIR_ARGS)
            self._fused_cm = _Kernel(library, "lce_fused_cm_f32", _FUSED_ARGS)
            self._stats_cm = _Kernel(library, "lce_stats_cm_f32", _STATS_ARGS)
            self._grad_cm = _Kernel(library, "lce_grad_cm_f32", _GRAD_ARGS)

    def class_major(self, tile: torch.Tensor) -> bool:
        """Whether ``tile`` is a class-major fp32 tile (a ``(V, B)`` array's transpose)."""
        return self._fused_cm is not None and tile.dim() == 2 and tile.stride(0) == 1

    def _check(self, tile: torch.Tensor) -> None:
        if tile.dtype != self.dtype or tile.dim() != 2 or tile.stride(1) != 1:
            raise ValueError(
                f"native_rows: expected a row-major (B, V) {self.dtype} tile on the CPU; got "
                f"{tuple(tile.shape)} {tile.dtype} with strides {tile.stride()}"
            )
        if tile.device.type != "cpu":
            raise ValueError(f"native_rows: the tile must be on the CPU, not {tile.device}")

    def stats(
        self,
        tile: torch.Tensor,
        *,
        scale: float = 1.0,
        target: torch.Tensor | None = None,
        dot: bool = False,
        out: torch.Tensor | None = None,
    ) -> RowSums:
        """The row statistics of ``tile`` ``(B, V)`` (``v = x·scale``);
        ``target`` ``(B,)`` int64 local columns, ``-1`` where none. An fp32 tile may be
        class-major (:meth:`class_major`). ``out``: a contiguous ``(4, B)`` fp32 tensor the
        sums are written into (rows ``row_max, sum_exp, dot, target_u``; ``dot``'s only
        where asked), else a new one."""
        return self.stats_call(tile, scale=scale, target=target, dot=dot, out=out)()

    def stats_call(
        self,
        tile: torch.Tensor,
        *,
        scale: float = 1.0,
        target: torch.Tensor | None = None,
        dot: bool = False,
        out: torch.Tensor | None = None,
    ) -> Callable[[], RowSums]:
        """:meth:`stats` with its checks and arguments settled now: each call of the result
        runs the loops over what ``tile`` holds then. A pass that fills one tile block after
        block calls it right after each GEMM, with no tensor operation between: a torch
        operation right after a GEMM waits for the GEMM's threads to settle."""
        rows = tile.shape[0]
        class_major = self.class_major(tile)
        if not class_major:
            self._check(tile)
        if out is None:
            out = torch.empty((4, rows), dtype=torch.float32)
        elif out.shape != (4, rows) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(
                f"native_rows.stats: out must be a contiguous (4, {rows}) float32 tensor; got "
                f"{tuple(out.shape)} {out.dtype} with strides {out.stride()}"
            )
        target = _targets(target, rows)
        sums = RowSums(out[0], out[1], out[2] if dot else None, None if target is None else out[3])
        args = (sums.row_max, sums.sum_exp, sums.dot, sums.target_u)
        pointers = [_address(target), *[_address(t) for t in args]]
        kernel = self._stats_cm if class_major else self._stats
        run = _bound(kernel, self.openmp, tile, scale, pointers, class_major)
        # The call holds the targets' int64 copy, whose address it passes.
        return functools.partial(_run_then, run, sums, target)

    def grad_(
        self,
        tile: torch.Tensor,
        row_max: torch.Tensor,
        a: torch.Tensor,
        *,
        scale: float = 1.0,
        b: torch.Tensor | None = None,
        mu: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
        gamma: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``g`` (module doc) over ``tile``; ``row_max``, ``a``, ``b``, ``mu``,
        ``gamma`` fp32 ``(B,)``; ``b`` and ``mu`` together, ``target`` and ``gamma`` together.
        An fp32 tile may be class-major (:meth:`class_major`)."""
        class_major = self.class_major(tile)
        if not class_major:
            self._check(tile)
        rows = tile.shape[0]
        if (b is None) != (mu is None) or (target is None) != (gamma is None):
            raise ValueError("native_rows.grad_: b goes with mu, target with gamma")
        target = _targets(target, rows)
        vectors = [_rows_vector(t, rows) for t in (row_max, a, b, mu)]
        gamma = _rows_vector(gamma, rows)
        pointers = [*[_address(t) for t in vectors], _address(target), _address(gamma)]
        kernel = self._grad_cm if class_major else self._grad
        _run(kernel, self.openmp, tile, scale, pointers, class_major)
        return tile

    def fused_(
        self,
        tile: torch.Tensor,
        target: torch.Tensor,
        c0: torch.Tensor,
        c1: torch.Tensor,
        gamma: torch.Tensor,
        *,
        scale: float = 1.0,
    ) -> RowSums:
        """The row statistics of ``tile`` (as :meth:`stats` with a ``target``, no dot sum),
        and the gradient with ``a = (c0 + c1·lse) / Z``, ``b = 0`` written over it in the
        same visit of each row; ``c0``, ``c1``, ``gamma`` fp32 ``(B,)``. An fp32 tile may be
        class-major (:meth:`class_major`)."""
        class_major = self.class_major(tile)
        if not class_major:
            self._check(tile)
        rows = tile.shape[0]
        out = torch.empty((3, rows), dtype=torch.float32)
        target = _targets(target, rows)
        vectors = [_rows_vector(t, rows) for t in (c0, c1, gamma)]
        pointers = [_address(t) for t in (target, *vectors, *out)]
        kernel = self._fused_cm if class_major else self._fused
        _run(kernel, self.openmp, tile, scale, pointers, class_major)
        return RowSums(out[0], out[1], None, out[2])

    def pair_(
        self,
        student: torch.Tensor,
        teacher: torch.Tensor,
        *,
        student_scale: float,
        teacher_scale: float,
        beta: float,
        entropy: bool = False,
        target: torch.Tensor | None = None,
        hard: float = 0.0,
        power: float = 0.0,
        weight: torch.Tensor | None = None,
    ) -> PairSums:
        r"""The row sums of a distillation loss over the row-major tiles ``student`` and
        ``teacher`` ``(B, V)`` of the same rows (:math:`u = s\,c_s - m_s`,
        :math:`v = t\,c_t - m_t`): ``beta`` 0, forward KL's :math:`C = \sum e^v (v - u)`; 1,
        reverse KL's :math:`C = \sum e^u (u - v)`; between, the mixture's
        :math:`C = \sum e^u (\log p - \log r)` and :math:`C_2 = \sum e^v (\log q - \log r)`
        (:mod:`linear_ce.losses.divergence`); with ``entropy`` :math:`\sum e^u u`; with
        ``power`` :math:`> 0` the hard term's :math:`\sum e^{\mathrm{power}\,u}`; with
        ``target`` ``(B,)`` (int64 local columns, ``-1``: none) :math:`u_t`. With
        ``weight`` ``(B,)`` the gradient of ``weight`` times the rows' divergence plus
        ``hard`` times the student's cross-entropy against ``target`` (at temperature 1 by
        ``power``, where given) is written over ``student`` in its dtype, rounded once.
        fp32 tiles may both be class-major (:meth:`class_major`)."""
        class_major = self.class_major(student)
        if class_major != self.class_major(teacher) or teacher.shape != student.shape:
            raise ValueError(
                f"native_rows.pair_: the teacher's tile {tuple(teacher.shape)} with strides "
                f"{teacher.stride()} is not laid out as the student's {tuple(student.shape)} "
                f"with strides {student.stride()}"
            )
        if not class_major:
            for tile in (student, teacher):
                self._check(tile)
        kernel = self._pair_cm if class_major else self._pair
        axis = 1 if class_major else 0
        rows, classes = student.shape
        out = torch.zeros((9, rows), dtype=torch.float32)
        target = _targets(target, rows)
        weight = _rows_vector(weight, rows)
        tiles = (student.data_ptr(), student.stride(axis), teacher.data_ptr(), teacher.stride(axis))
        rest = [classes, student_scale, teacher_scale, beta, power, int(entropy)]
        rest += [_address(target), hard, _address(weight), out.data_ptr(), rows]
        _in_parallel(kernel, self.openmp, rows, tiles, rest, 16 if class_major else 1)
        return PairSums(*out)


def _run_then(run: Callable[[], None], sums: RowSums, _target: torch.Tensor | None) -> RowSums:
    run()
    return sums


def _run(
    kernel: _Kernel,
    openmp: bool,
    tile: torch.Tensor,
    scale: float,
    pointers: list,
    class_major: bool,
) -> None:
    """``kernel`` over ``tile``'s rows, split over threads (:func:`_bound`)."""
    _bound(kernel, openmp, tile, scale, pointers, class_major)()


def _bound(
    kernel: _Kernel,
    openmp: bool,
    tile: torch.Tensor,
    scale: float,
    pointers: list,
    class_major: bool,
) -> Callable[[], None]:
    """A call of ``kernel`` over ``tile``'s rows, split over threads. A class-major tile's
    rows go in runs of 16 per thread (a vector of rows, a cache line), its class stride
    ``tile.stride(1)``; a row-major tile's row stride is ``tile.stride(0)``."""
    stride = tile.stride(1) if class_major else tile.stride(0)
    rest = [tile.shape[1], scale, *pointers]
    align = 16 if class_major else 1
    before = (tile.data_ptr(), stride)
    return functools.partial(_in_parallel, kernel, openmp, tile.shape[0], before, rest, align)


def _in_parallel(
    kernel: _Kernel, openmp: bool, rows: int, before: tuple, after: list, align: int
) -> None:
    """``kernel(*before, r0, r1, *after)`` over ``[0, rows)`` split over
    ``torch.get_num_threads()`` threads, each range's start a multiple of ``align``: in the
    library's OpenMP region where it has one (the runtime of torch's GEMMs: their spinning
    workers take the ranges, where a thread of our own would share a core with one still
    spinning after the GEMM and run at half speed), else
    over :func:`_split`'s pool. A non-zero return: no memory for a range's scratch."""
    if openmp:
        threads = max(1, min(torch.get_num_threads(), -(-rows // align)))
        failed = kernel.parallel(threads, align, *before, 0, rows, *after)
    else:
        codes = []
        _split(rows, lambda r0, r1: codes.append(kernel.plain(*before, r0, r1, *after)), align)
        failed = any(code for code in codes if code is not None)
    if failed:
        raise MemoryError(f"native_rows: no memory for the scratch of {rows} rows")


def _rows_vector(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to(torch.float32).contiguous().expand(rows).contiguous()


def _targets(target: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    if target is None:
        return None
    if target.shape != (rows,):
        raise ValueError(f"native_rows: target must be ({rows},); got {tuple(target.shape)}")
    return target.to(torch.int64).contiguous()


_pool: ThreadPoolExecutor | None = None
_pool_threads = 0
#: The process that made the pool: a forked child (a DataLoader worker) has none of its
#: threads, so it makes its own.
_pool_pid = 0
_pool_lock = threading.Lock()


def _split(rows: int, run, align: int = 1) -> None:
    """``run(r0, r1)`` over ``torch.get_num_threads()`` ranges of rows, in parallel, each
    range's start a multiple of ``align``."""
    global _pool, _pool_threads, _pool_pid
    threads = max(1, min(torch.get_num_threads(), -(-rows // align)))
    if threads == 1:
        run(0, rows)
        return
    with _pool_lock:
        if _pool is None or _pool_threads < threads or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="linear_ce-rows")
            _pool_threads, _pool_pid = threads, os.getpid()
        pool = _pool
    bounds = [min(rows, rows * k // threads // align * align) for k in range(threads)] + [rows]
    futures = [pool.submit(run, bounds[k], bounds[k + 1]) for k in range(1, threads)]
    run(bounds[0], bounds[1])
    for future in futures:
        future.result()


class _Library:
    """The compiled library, built or loaded once per process (see the module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.library: ctypes.CDLL | None = None
        self.loops: dict[torch.dtype, NativeRows] = {}
        self.failure: str | None = None
        self.path: Path | None = None

    def get(self, required: bool) -> ctypes.CDLL | None:
        with self.lock:
            if self.library is None and self.failure is None:
                timeout, folder = read(BUILD_TIMEOUT_ENV), cache_dir()
                try:
                    path, library = _load(folder, timeout)
                    # Every symbol looked up now: a library of another source fails here.
                    self.loops = {dtype: NativeRows(library, dtype) for dtype in _SUFFIX}
                    self.library, self.path = library, path
                except (OSError, AttributeError, subprocess.SubprocessError, RuntimeError) as error:
                    self.failure = str(error)
                    if not required:
                        warnings.warn(
                            f"linear_ce: the compiled row loops did not build or load, so "
                            f"tiles take the torch operations ({NATIVE_ROWS_ENV}=0 silences "
                            f"this): {self.failure}",
                            RuntimeWarning,
                            stacklevel=4,
                        )
            if self.library is None and required:
                raise RuntimeError(
                    f"linear_ce: {NATIVE_ROWS_ENV}=1 but the compiled row loops did not "
                    f"build or load: {self.failure}"
                )
            return self.library


_library = _Library()


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "").strip() or "cc")


def _flags() -> list[str]:
    return _FLAGS + (_X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else [])


def _run_compiler(
    command: list[str], timeout: float, cwd: Path | None = None
) -> tuple[int, str, str]:
    """``command``'s exit status, output and errors. It runs in a process group of its own,
    killed whole (the compiler's own children too) once it has run ``timeout`` seconds."""
    try:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except FileNotFoundError as error:
        raise RuntimeError(f"no C compiler {command[0]!r} (set CC)") from error
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException as error:
        _kill_group(process)
        if isinstance(error, subprocess.TimeoutExpired):
            raise RuntimeError(
                f"{command[0]} did not finish within {timeout:g} s, so it was stopped with its "
                f"process group ({BUILD_TIMEOUT_ENV} sets the limit)"
            ) from None
        raise
    return process.returncode, out, err


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for pipe in (process.stdout, process.stderr):
        pipe.close()


def _not_private(path: Path, what: str) -> str | None:
    """Why ``path`` (not followed if a link) could hold what another user wrote, or
    ``None``: it must be this user's own, writable by no one else (``what``: directory or
    file, which it must be)."""
    info = os.lstat(path)
    kind = stat.S_ISDIR if what == "directory" else stat.S_ISREG
    if not kind(info.st_mode):
        return f"{what} {path} is not a {what} of its own (a link or another kind)"
    if info.st_uid != os.getuid():
        return f"{what} {path} belongs to uid {info.st_uid}, not to this process's {os.getuid()}"
    if info.st_mode & 0o022:
        return (
            f"{what} {path} is writable by its group or others (mode "
            f"{stat.S_IMODE(info.st_mode):#o}), who could plant a library there"
        )
    return None


def _private_folder(folder: Path) -> None:
    """``folder``, created ``0700`` where missing; a ``RuntimeError`` where it could hold what
    another user wrote (:func:`_not_private`), the default folder excepted, which is made
    private where it is this user's own."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    real = folder.resolve()
    problem = _not_private(real, "directory")
    if (
        problem is not None
        and folder == default_cache_dir()
        and os.stat(real).st_uid == os.getuid()
    ):
        # Made by an earlier version under the user's umask: this user's own, so made private.
        os.chmod(real, 0o700)
        problem = _not_private(real, "directory")
    if problem is not None:
        raise RuntimeError(
            f"the cache {problem}: the compiled row loops load only from a directory of this "
            f"user's, writable by no one else (set {_CACHE_DIR_ENV} to one, mode 0700)"
        )


def _digest(path: Path) -> tuple[str, int]:
    """``path``'s sha256 (hex) and size; its bytes flushed to the disk."""
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(functools.partial(file.read, 1 << 20), b""):
            sha.update(block)
        os.fsync(file.fileno())
        return sha.hexdigest(), file.tell()


def _record_path(path: Path) -> Path:
    return path.with_suffix(".json")


def _unverified(path: Path) -> str | None:
    """Why the cached library ``path``, which has a record (:func:`_record_path`: the sha256
    and size of the library as built), may not be loaded, or ``None``: both must be this
    user's own, writable by no one else, and agree."""
    record = _record_path(path)
    if not os.path.lexists(path):
        return "the library its record vouches for is missing"
    problem = _not_private(path, "file") or _not_private(record, "file")
    if problem is not None:
        return problem
    try:
        expected = json.loads(record.read_text())
        wanted, size = expected["sha256"], expected["bytes"]
    except (ValueError, TypeError, KeyError, RecursionError) as error:
        return f"{record.name} is not a record of the library ({type(error).__name__}: {error})"
    digest, found = _digest(path)
    if found != size:
        return f"it has {found} bytes, not the {size} built (truncated or overwritten)"
    if digest != wanted:
        return f"its sha256 {digest[:16]}… is not the {str(wanted)[:16]}… built (corrupted)"
    return None


def _load(folder: Path, timeout: float) -> tuple[Path, ctypes.CDLL]:
    """The library's path and the library, loaded from ``folder`` where it is there and
    verified (:func:`_unverified`), else built (a warning says why a cached one is not
    taken)."""
    source = resources.files("linear_ce.engine").joinpath("native_rows.c").read_text()
    compiler = _compiler()
    code, version, errors = _run_compiler([*compiler, "--version"], timeout)
    if code != 0:
        raise RuntimeError(f"{' '.join(compiler)} --version failed: {errors.strip()[-2000:]}")
    choices = [" ".join(flags) for flags in _OPENMP_FLAGS]
    key = "\n".join([source, version, *compiler, *_flags(), *choices, *_LIBS, platform.machine()])
    key += "\n" + " ".join(sorted(cpu_flags()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    _private_folder(folder)
    path = folder / f"native-rows-{digest}.so"
    # Without a record the file is no build of this package's to check (one interrupted
    # before its record, an earlier version's): built again, as where there is none.
    if os.path.lexists(_record_path(path)):
        problem = _unverified(path)
        if problem is None:
            return path, ctypes.CDLL(str(path))
        warnings.warn(
            f"linear_ce: not loading the cached row loops {path}: {problem}; building them again",
            RuntimeWarning,
            stacklevel=5,
        )
    return path, _build(path, source, compiler, timeout)


def _build(path: Path, source: str, compiler: list[str], timeout: float) -> ctypes.CDLL:
    """The library compiled from ``source`` and loaded, then kept as ``path`` with its
    record (:func:`_unverified`)."""
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        (Path(scratch) / "native_rows.c").write_text(source)
        built = Path(scratch) / path.name
        for openmp in _OPENMP_FLAGS:
            command = [*compiler, *_flags(), *openmp, "native_rows.c", "-o", path.name, *_LIBS]
            code, _, errors = _run_compiler(command, timeout, cwd=Path(scratch))
            if code == 0:
                break
        if code != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed: {errors.strip()[-2000:]}")
        os.chmod(built, 0o755)
        sha, size = _digest(built)
        # This process loads the file it built; the cache gets it whole: its bytes are on
        # the disk before the rename, the rename before the record that vouches for it.
        library = ctypes.CDLL(str(built))
        os.replace(built, path)
        write_json(_record_path(path), {"sha256": sha, "bytes": size})
    return library


def native_rows(dtype: torch.dtype) -> NativeRows | None:
    """The row loops for ``dtype`` tiles, or ``None`` where ``LINEAR_CE_NATIVE_ROWS=0``, the
    dtype has none, or (``auto``) the library does not build or load."""
    mode = native_mode()
    if mode == "0" or dtype not in _SUFFIX:
        return None
    if _library.get(required=mode == "1") is None:
        return None
    return _library.loops[dtype]


def library_path() -> Path | None:
    """Where this process's library lies (``None`` before it is built, or if it did not)."""
    return _library.path
