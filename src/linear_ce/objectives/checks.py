"""Checks of the built-in objectives' arguments, shared by the token-local and the
sequence-level ones."""

from __future__ import annotations

import math

__all__ = ["check_choice", "check_float"]


def check_float(owner: str, name: str, value: object, *, low: float | None = None) -> None:
    """``value`` is a real number (not a bool), at least ``low`` when given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{owner}: {name} must be a float, got {value!r}")
    if low is not None and not value >= low:
        raise ValueError(f"{owner}: {name} must be a float >= {low}, got {value!r}")


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}")
