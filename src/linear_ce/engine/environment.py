"""Every ``LINEAR_CE_*`` environment variable, read and checked in one place.

Each variable is read on every call that uses it, and :func:`check_all` reads every
one of them at the start of each call's plan (:func:`linear_ce.engine.plan.make_plan`):
a bad value is the same ``ValueError`` on every call, naming the variable, the value
and the form expected, whether or not the call's path reads that variable. For every
variable, unset, empty or only whitespace means its default.

===============================  ===================================================
``LINEAR_CE_MEASURE``            ``0``, ``1``, ``process`` or ``auto`` (default)
``LINEAR_CE_CACHE_DIR``          a directory (default ``$XDG_CACHE_HOME/linear_ce``,
                                 else ``~/.cache/linear_ce``)
``LINEAR_CE_MEMORY_BUDGET``      a positive number (default: the plan's share)
``LINEAR_CE_CHUNK_ROWS``         a positive whole number or ``auto`` (default)
``LINEAR_CE_CLASS_BLOCK``        a positive whole number or ``auto`` (default)
``LINEAR_CE_STEP_ROWS``          a positive whole number or ``auto`` (default)
``LINEAR_CE_STATS_BLOCK``        a positive whole number, ``off`` or ``auto`` (default)
``LINEAR_CE_TILE_LAYOUT``        ``class-major``, ``row-major`` or ``auto`` (default)
``LINEAR_CE_EXP``                ``exp``, ``exp2`` or ``auto`` (default)
``LINEAR_CE_NATIVE_HALF_GEMM``   ``0``, ``1`` or ``auto`` (default)
``LINEAR_CE_NATIVE_ROWS``        ``0``, ``1`` or ``auto`` (default)
``LINEAR_CE_ROW_KERNELS``        ``triton`` or ``auto`` (default)
``LINEAR_CE_BUILD_TIMEOUT``      seconds, a positive number (default 120)
``LINEAR_CE_KEEP_SCRATCH``       ``0`` or ``1`` (default)
===============================  ===================================================

What each one does is documented where it is used: :mod:`linear_ce.engine.machine`
(the plan's choices and the cache directory), :mod:`linear_ce.engine.capability`,
:mod:`linear_ce.engine.native_rows` and :mod:`linear_ce.engine.scratch`. A whole number
is written in the digits ``0``–``9`` only (``"²"`` or ``"٣"`` are not numbers here).

Example::

    >>> os.environ["LINEAR_CE_CHUNK_ROWS"] = "256"
    >>> read("LINEAR_CE_CHUNK_ROWS")
    256
    >>> os.environ["LINEAR_CE_CHUNK_ROWS"] = ""
    >>> read("LINEAR_CE_CHUNK_ROWS") is None  # auto
    True
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "BUILD_TIMEOUT_ENV",
    "BUILD_TIMEOUT_SECONDS",
    "VARIABLES",
    "cache_dir",
    "check_all",
    "default_cache_dir",
    "read",
]

BUILD_TIMEOUT_ENV = "LINEAR_CE_BUILD_TIMEOUT"
#: The compiled row loops' build normally takes seconds (:mod:`linear_ce.engine.native_rows`);
#: a compiler still running after this many is killed, with its whole process group.
BUILD_TIMEOUT_SECONDS = 120.0

_DIGITS = frozenset("0123456789")


def _choice(
    allowed: dict[str, str], default: str, lead: str = ""
) -> tuple[Callable[[str], object], str]:
    def parse(text: str) -> object:
        if text not in allowed:
            raise _Bad
        return text

    *first, last = (f"{k} ({v})" for k, v in allowed.items())
    return parse, f"{lead}{', '.join(first)} or {last}; default {default}"


def _whole(text: str) -> int:
    """A positive whole number in ASCII digits (``str.isdigit`` accepts ``"²"``, which
    ``int`` refuses)."""
    if not text or not set(text) <= _DIGITS or int(text) < 1:
        raise _Bad
    return int(text)


def _count(what: str, words: dict[str, object]) -> tuple[Callable[[str], object], str]:
    def parse(text: str) -> object:
        return words[text] if text in words else _whole(text)

    others = " or ".join(words)
    return parse, f"a positive number of {what}, in the digits 0-9, or {others}"


def _positive(what: str) -> tuple[Callable[[str], object], str]:
    def parse(text: str) -> object:
        if not text.isascii():
            raise _Bad  # float() reads other scripts' digits too
        try:
            value = float(text)
        except ValueError:
            raise _Bad from None
        if not (math.isfinite(value) and value > 0):
            raise _Bad
        return value

    return parse, f"a positive number, {what}"


def _path(text: str) -> object:
    return Path(os.path.expanduser(text))


class _Bad(Exception):
    """A value outside a variable's form (:func:`read` turns it into the ``ValueError``)."""


#: Name → (parse of a non-empty stripped value, the form expected, the default's value).
VARIABLES: dict[str, tuple[Callable[[str], object], str, object]] = {
    "LINEAR_CE_MEASURE": (
        *_choice(
            {
                "0": "never measure: the fixed fallback rule",
                "1": "measure, cache per machine on disk",
                "auto": "the same as 1",
                "process": "measure, cache in this process only",
            },
            "auto",
            "one of ",
        ),
        "auto",
    ),
    "LINEAR_CE_CACHE_DIR": (_path, "a directory", None),
    "LINEAR_CE_MEMORY_BUDGET": (
        *_positive("the share of the gradients' bytes the chunk scratch may take (0.25)"),
        None,
    ),
    "LINEAR_CE_CHUNK_ROWS": (
        *_count("rows per chunk (forcing the plan's choice)", {"auto": None}),
        None,
    ),
    "LINEAR_CE_CLASS_BLOCK": (
        *_count("classes (forcing the vocabulary pass's block)", {"auto": None}),
        None,
    ),
    "LINEAR_CE_STEP_ROWS": (*_count("rows (forcing a half tile's step)", {"auto": None}), None),
    "LINEAR_CE_STATS_BLOCK": (
        *_count("classes per block of the statistics pass", {"off": 0, "auto": None}),
        None,
    ),
    "LINEAR_CE_TILE_LAYOUT": (
        *_choice(
            {
                "class-major": "a (V, B) array used as its transpose",
                "row-major": "a (B, V) array",
                "auto": "measured",
            },
            "auto",
            "one of ",
        ),
        "auto",
    ),
    "LINEAR_CE_EXP": (
        *_choice(
            {
                "exp": "e^u with torch.exp",
                "exp2": "e^u as 2^(u log2 e) with torch.exp2",
                "auto": "measured",
            },
            "auto",
            "one of ",
        ),
        "auto",
    ),
    "LINEAR_CE_NATIVE_HALF_GEMM": (
        *_choice(
            {
                "0": "CPUs use the path without native half GEMMs",
                "1": "native half GEMMs wherever the CPU has them",
                "auto": "where it has them and they measure faster than fp32",
            },
            "auto",
        ),
        "auto",
    ),
    "LINEAR_CE_NATIVE_ROWS": (
        *_choice(
            {
                "0": "the torch operations",
                "1": "the compiled row loops, an error if they do not build or load",
                "auto": "the compiled row loops where they build and load, else a warning",
            },
            "auto",
        ),
        "auto",
    ),
    "LINEAR_CE_ROW_KERNELS": (
        *_choice(
            {
                "auto": "the compiled loops on a CPU, Triton on CUDA",
                "triton": "Triton on every device; CPU tensors need TRITON_INTERPRET=1",
            },
            "auto",
        ),
        "auto",
    ),
    BUILD_TIMEOUT_ENV: (
        *_positive("the seconds the row loops' compiler may run"),
        BUILD_TIMEOUT_SECONDS,
    ),
    "LINEAR_CE_KEEP_SCRATCH": (
        *_choice(
            {"1": "keep the loops' scratch between calls", "0": "fresh scratch every call"}, "1"
        ),
        "1",
    ),
}


def read(name: str) -> object:
    """The value of the variable ``name`` (one of :data:`VARIABLES`): parsed, or its
    default where it is unset, empty or whitespace; a ``ValueError`` naming it, the
    value and the form expected where that does not parse."""
    parse, expected, default = VARIABLES[name]
    raw = os.environ.get(name)
    text = "" if raw is None else raw.strip()
    if not text:
        return default
    try:
        return parse(text)
    except _Bad:
        raise ValueError(f"{name} must be {expected}; got {raw!r}") from None


def check_all() -> None:
    """Read every variable of :data:`VARIABLES`: the first bad one's ``ValueError``."""
    for name in VARIABLES:
        read(name)


def cache_dir() -> Path:
    """Where the package keeps what it stores between runs (the machine profile, the
    compiled row loops): ``LINEAR_CE_CACHE_DIR``, else ``$XDG_CACHE_HOME/linear_ce``,
    else ``~/.cache/linear_ce``."""
    root = read("LINEAR_CE_CACHE_DIR")
    return default_cache_dir() if root is None else root


def default_cache_dir() -> Path:
    """:func:`cache_dir` where ``LINEAR_CE_CACHE_DIR`` is not set."""
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return Path(xdg or Path(os.path.expanduser("~")) / ".cache") / "linear_ce"
