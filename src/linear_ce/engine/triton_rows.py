r"""The row loops' contract (:mod:`linear_ce.engine.native_rows`) as Triton kernels: the
implementation a CUDA tile takes, where the compiled C loops take a CPU's.

:class:`TritonRows` has :class:`~linear_ce.engine.native_rows.NativeRows`' entry points
(``stats``, ``stats_call``, ``grad_``, ``fused_``, ``pair_``) with the same arguments,
outputs, math and rules (NaN and ±inf rows, masked classes, the dot sum, the pair loops'
divergences), on bf16, fp16 and fp32 tiles of any strides; the kernels
(:mod:`linear_ce.engine.triton_row_kernels`) walk each row's classes in blocks with an
online max (one read for the statistics, one read and one write for the gradient), sum in
fp32 and write the gradient over the tile in its dtype, rounded once. On a GPU each
kernel's block shape is chosen by ``triton.autotune`` per number of classes and dtype;
under Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported: kernels on
CPU tensors, through numpy) one fixed small shape, :data:`INTERPRETER_BLOCKS`.

Which implementation a tile takes (:func:`row_loops`) follows ``LINEAR_CE_NATIVE_ROWS``
(``0``: neither; ``1``: an error where the device's cannot run; ``auto``: where they can)
and the device: the compiled loops on a CPU, the Triton kernels on CUDA, where Triton
is installed (else torch's operations: ``auto`` warns once, ``1`` is an error).
``LINEAR_CE_ROW_KERNELS=triton`` is a test knob: the Triton kernels on CPU tensors too,
under the interpreter (an error without ``TRITON_INTERPRET=1``). Importing this module
imports no Triton; the first kernel does.

Example::

    >>> rows = row_loops(torch.float32, torch.device("cuda"))  # None without Triton
    >>> tile = torch.randn(4, 1000, device="cuda")
    >>> sums = rows.stats(tile, target=torch.tensor([0, 1, 2, -1], device="cuda"))
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from linear_ce.engine.environment import read
from linear_ce.engine.native_rows import (
    NATIVE_ROWS_ENV,
    NativeRows,
    PairSums,
    RowSums,
    native_mode,
    native_rows,
)

__all__ = [
    "INTERPRETER_BLOCKS",
    "ROW_KERNELS_ENV",
    "RowLoops",
    "TritonRows",
    "row_kernels_choice",
    "row_loops",
    "triton_available",
]

ROW_KERNELS_ENV = "LINEAR_CE_ROW_KERNELS"
#: ``(BLOCK_R, BLOCK_V)`` at most under the interpreter, where each operation's Python
#: overhead is what costs (a few milliseconds a call of a helper kernel): a quarter of the
#: rows per program (at least the first, a power of two), at most the second's classes per
#: block (fewer for a shorter row), so a test's rows span several programs and its longer
#: rows several blocks (the online max's rescaling).
INTERPRETER_BLOCKS = (1024, 256)
_INTERPRETER_MIN_ROWS = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def row_kernels_choice() -> str:
    """``LINEAR_CE_ROW_KERNELS`` (read by :mod:`linear_ce.engine.environment`): ``"auto"``
    (by device) or ``"triton"`` (a test knob: the Triton kernels on CPU tensors too, under
    the interpreter)."""
    return read(ROW_KERNELS_ENV)


def triton_available() -> bool:
    """Whether Triton is installed (found, not imported)."""
    return importlib.util.find_spec("triton") is not None


_warned = False


def row_loops(dtype: torch.dtype, device: torch.device) -> NativeRows | TritonRows | None:
    """The row loops for ``dtype`` tiles on ``device`` (module doc), or ``None`` where
    ``LINEAR_CE_NATIVE_ROWS=0``, the dtype has none, or (``auto``) the device's cannot run:
    the compiled loops did not build, or Triton is not installed."""
    global _warned
    mode = native_mode()
    forced = row_kernels_choice() == "triton"
    if not (forced or device.type == "cuda"):
        return native_rows(dtype) if device.type == "cpu" else None
    if mode == "0" or dtype not in _DTYPES:
        return None
    if not triton_available():
        why = f"Triton is not installed, so {device.type} tiles take torch's operations"
        if mode == "1" or forced:
            setting = f"{ROW_KERNELS_ENV}=triton" if forced else f"{NATIVE_ROWS_ENV}=1"
            raise RuntimeError(f"linear_ce: {setting} but {why} (pip install triton)")
        if not _warned:
            _warned = True
            warnings.warn(
                f"linear_ce: {why} ({NATIVE_ROWS_ENV}=0 silences this)", RuntimeWarning, 3
            )
        return None
    if device.type == "cpu" and not _kernels().interpreted:
        raise RuntimeError(
            f"linear_ce: {ROW_KERNELS_ENV}=triton on CPU tensors runs Triton's interpreter, "
            f"which needs TRITON_INTERPRET=1 set before triton is first imported"
        )
    return _triton_rows(dtype)


@functools.cache
def _kernels() -> ModuleType:
    from linear_ce.engine import triton_row_kernels

    return triton_row_kernels


@functools.cache
def _triton_rows(dtype: torch.dtype) -> TritonRows:
    return TritonRows(dtype)


def _grid(rows: int) -> Callable[[dict], tuple[int]]:
    """The programs of an autotuned launch: one per ``BLOCK_R`` rows."""

    def grid(meta: dict) -> tuple[int]:
        return (-(-rows // meta["BLOCK_R"]),)

    return grid


class TritonRows:
    """The row loops for tiles of one dtype as Triton kernels (see the module doc)."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in _DTYPES:
            raise ValueError(
                f"triton_rows: no kernels for {dtype} tiles; expected one of {_DTYPES}"
            )
        self.dtype = dtype
        self._bf16 = dtype == torch.bfloat16

    def class_major(self, tile: torch.Tensor) -> bool:
        """Whether ``tile`` is a class-major fp32 tile (a ``(V, B)`` array's transpose), as
        :meth:`NativeRows.class_major` says: the kernels take any strides."""
        return self.dtype == torch.float32 and tile.dim() == 2 and tile.stride(0) == 1

    def _check(self, tile: torch.Tensor, what: str) -> None:
        if tile.dtype != self.dtype or tile.dim() != 2:
            raise ValueError(
                f"triton_rows.{what}: expected a 2-D (B, V) {self.dtype} tile; got "
                f"{tuple(tile.shape)} {tile.dtype}"
            )
        interpreted = _kernels().interpreted
        if tile.device.type != ("cpu" if interpreted else "cuda"):
            where = "CPU (Triton's interpreter)" if interpreted else "CUDA"
            raise ValueError(f"triton_rows.{what}: the tile must be on {where}, not {tile.device}")

    def _launch(self, kernel, rows: int, classes: int, *args, **constants) -> None:
        """``kernel`` over ``rows`` rows of ``classes`` classes: autotuned on a GPU, one fixed block shape under
        the interpreter (numpy's warnings about the NaN and ±inf it is handed silenced:
        they are the contract's values)."""
        if rows == 0:
            return
        if not _kernels().interpreted:
            kernel[_grid(rows)](*args, **constants)
            return
        import numpy

        block_r, block_v = _interpreter_blocks(rows, classes)
        with numpy.errstate(all="ignore"):
            grid = (-(-rows // block_r),)
            kernel[grid](*args, **constants, BLOCK_R=block_r, BLOCK_V=block_v)

    def _data(self, tile: torch.Tensor) -> torch.Tensor:
        """The tile as the kernels read it: bf16 by its bits."""
        return tile.view(torch.int16) if self._bf16 else tile

    def stats(
        self,
        tile: torch.Tensor,
        *,
        scale: float = 1.0,
        target: torch.Tensor | None = None,
        dot: bool = False,
        out: torch.Tensor | None = None,
    ) -> RowSums:
        """As :meth:`NativeRows.stats`: ``(B,)`` fp32 ``row_max``, ``sum_exp``, ``dot``
        (where asked) and ``target_u`` (where a ``target`` is given), into ``out``
        ``(4, B)`` where given."""
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
        """:meth:`stats` with its checks and arguments settled now (as
        :meth:`NativeRows.stats_call`)."""
        self._check(tile, "stats")
        rows, classes = tile.shape
        if out is None:
            out = torch.empty((4, rows), dtype=torch.float32, device=tile.device)
        elif out.shape != (4, rows) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(
                f"triton_rows.stats: out must be a contiguous (4, {rows}) float32 tensor; got "
                f"{tuple(out.shape)} {out.dtype} with strides {out.stride()}"
            )
        target = _targets(target, rows, tile.device)
        sums = RowSums(out[0], out[1], out[2] if dot else None, None if target is None else out[3])
        data = self._data(tile)
        args = (data, *data.stride(), rows, classes, _f32(scale), _or(target, out), out, rows)
        flags = dict(HAS_T=target is not None, DOT=dot, BF16=self._bf16)
        kernel = _kernels().stats_kernel

        def run() -> RowSums:
            self._launch(kernel, rows, classes, *args, **flags)
            return sums

        return run

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
        """As :meth:`NativeRows.grad_`: ``g`` written over ``tile``."""
        self._check(tile, "grad_")
        rows, classes = tile.shape
        if (b is None) != (mu is None) or (target is None) != (gamma is None):
            raise ValueError("triton_rows.grad_: b goes with mu, target with gamma")
        device = tile.device
        target = _targets(target, rows, device)
        m, a, b, mu, gamma = (_rows_vector(t, rows, device) for t in (row_max, a, b, mu, gamma))
        data = self._data(tile)
        vectors = (m, a, _or(b, a), _or(mu, a), _or(target, a), _or(gamma, a))
        flags = dict(HAS_B=b is not None, HAS_T=target is not None, BF16=self._bf16)
        self._launch(
            _kernels().grad_kernel, rows, classes, data, *data.stride(), rows, classes, _f32(scale),
            *vectors, **flags,
        )  # fmt: skip
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
        """As :meth:`NativeRows.fused_`: the statistics (``row_max``, ``sum_exp``,
        ``target_u``) and the gradient with ``a = (c0 + c1·lse) / Z`` written over ``tile``."""
        self._check(tile, "fused_")
        rows, classes = tile.shape
        device = tile.device
        out = torch.empty((3, rows), dtype=torch.float32, device=device)
        target = _targets(target, rows, device)
        c0, c1, gamma = (_rows_vector(t, rows, device) for t in (c0, c1, gamma))
        data = self._data(tile)
        self._launch(
            _kernels().fused_kernel, rows, classes, data, *data.stride(), rows, classes, _f32(scale),
            target, c0, c1, gamma, out, rows, BF16=self._bf16,
        )  # fmt: skip
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
        """As :meth:`NativeRows.pair_`: a distillation loss's row sums over ``student`` and
        ``teacher`` ``(B, V)``, and (with ``weight``) the student's gradient written over
        its tile."""
        if self.class_major(student) != self.class_major(teacher) or (
            teacher.shape != student.shape
        ):
            raise ValueError(
                f"triton_rows.pair_: the teacher's tile {tuple(teacher.shape)} with strides "
                f"{teacher.stride()} is not laid out as the student's {tuple(student.shape)} "
                f"with strides {student.stride()}"
            )
        self._check(student, "pair_")
        self._check(teacher, "pair_")
        rows, classes = student.shape
        device = student.device
        out = torch.zeros((9, rows), dtype=torch.float32, device=device)
        target = _targets(target, rows, device)
        weight = _rows_vector(weight, rows, device)
        beta = _f32(beta)
        mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
        log_beta = _f32(math.log(beta)) if mode == 2 else 0.0
        log_rest = _f32(math.log1p(-beta)) if mode == 2 else 0.0
        s, t = self._data(student), self._data(teacher)
        flags = dict(
            MODE=mode,
            ENTROPY=bool(entropy),
            POWER=power > 0.0,
            HAS_T=target is not None,
            HAS_W=weight is not None,
            BF16=self._bf16,
        )
        self._launch(
            _kernels().pair_kernel, rows, classes, s, *s.stride(), t, *t.stride(), rows, classes,
            _f32(student_scale), _f32(teacher_scale), _f32(1.0 - beta), log_beta, log_rest,
            _f32(power), _f32(hard), _or(target, out), _or(weight, out), out, rows, **flags,
        )  # fmt: skip
        return PairSums(*out)


def _interpreter_blocks(rows: int, classes: int) -> tuple[int, int]:
    """The interpreter's block shape for a tile (:data:`INTERPRETER_BLOCKS`)."""
    most_rows, most_classes = INTERPRETER_BLOCKS
    block_r = 1 << max(0, -(-rows // 4) - 1).bit_length()
    block_r = min(most_rows, max(_INTERPRETER_MIN_ROWS, block_r))
    return block_r, min(most_classes, 1 << max(0, classes - 1).bit_length())


#: Either implementation of the row loops' contract (what :func:`row_loops` returns).
RowLoops = NativeRows | TritonRows


def _f32(value: float) -> float:
    """``value`` rounded to fp32, as the compiled loops' C float arguments take it."""
    return float(torch.tensor(value, dtype=torch.float32))


def _or(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """``t``, or a tensor the kernel is handed but never reads (its flag says so)."""
    return stand_in if t is None else t


def _rows_vector(t: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to(device=device, dtype=torch.float32).contiguous().expand(rows).contiguous()


def _targets(t: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if t.shape != (rows,):
        raise ValueError(f"triton_rows: target must be ({rows},); got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64).contiguous()
