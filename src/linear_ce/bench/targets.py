"""The speed and memory targets a CPU run is held to, checked on one run's summaries.

Each target reads ratios that were measured side by side in the same run (paired
round by round, :mod:`linear_ce.bench.report`), at the first shape of ``--shapes``:

* the training step: ≤ 1.05× its floor (a half step: its floor in its own dtype), and
  faster than ``plain``, ``plain-compile`` and ``torch-512`` (a half step: than
  ``plain-compile``) — "faster": the step's time over the peer's, paired round by
  round (the median of the rounds' quotients), is below 1 (two ratios to the floor
  would carry the floor's noise twice);
* forward only: ≤ 1.05× the forward floor;
* ``token_objective`` and ``linear_divergence``: ≤ 1.10× their floors (distillation's is
  the four-GEMM ``floor-2heads``);
* ``token_logprobs`` with a differentiated entropy: ≤ 1.05× its four GEMMs, the three-GEMM
  floor's ratio times 3/4 (the fourth GEMM, recomputing the logits, costs as much as each
  of the three);
* a share ``s`` of targets ignored: ≤ (1 − s) + 0.05 of the unmasked step of the same
  reduction (0.30× at 75%), in every dtype and reduction measured;
* fp32 transient memory: ≤ 1.5× the gradients' bytes.

A target whose points the run did not measure is left out.
"""

from __future__ import annotations

import dataclasses

from linear_ce.bench.config import Point
from linear_ce.bench.report import Row, paired_ratio

__all__ = ["Target", "check", "table"]

_STEP, _HEAD, _FOUR_OVER_THREE, _MEMORY = 1.05, 1.10, 3 / 4, 1.5
_MASKED_SLACK = 0.05


@dataclasses.dataclass(frozen=True)
class Target:
    """One target: what is measured, the measured value, its bound, whether it was met."""

    name: str
    dtype: str
    measured: float
    bound: float
    met: bool


def _steady(row: Row) -> float | None:
    """The ratio a target reads: to the floor in the input's own dtype where measured."""
    return row.own_ratio if row.own_ratio is not None else row.ratio


def check(summaries: list[tuple[Point, list[Row]]], shape: tuple[int, int, int]) -> list[Target]:
    """The targets the run measured at ``shape`` (``N, D, V``), in the order above."""
    found: list[Target] = []

    def at_most(name: str, dtype: str, value: float | None, bound: float) -> None:
        if value is not None:
            found.append(Target(name, dtype, value, bound, value <= bound))

    def faster(name: str, dtype: str, row: Row, peer: Row) -> None:
        value = paired_ratio(
            row.repeat_seconds or [row.seconds], peer.repeat_seconds or [peer.seconds]
        )
        if value is not None:
            found.append(Target(name, dtype, value, 1.0, value < 1.0))

    for point, rows in summaries:
        if tuple(shape) != (point.N, point.D, point.V):
            continue
        by = {row.variant: row for row in rows if row.seconds is not None}
        dtype = point.dtype
        if point.head == "ce" and point.ignored:
            row = by.get("linear_ce")
            at_most(
                f"step, {point.ignored:.0%} ignored, reduction={point.reduction}"
                " (× the unmasked step)",
                dtype,
                None if row is None else row.unmasked_ratio,
                round(1 - point.ignored + _MASKED_SLACK, 6),
            )
        elif point.head == "ce" and point.reduction == "mean":
            row = by.get("linear_ce")
            if row is not None:
                at_most("step (× its floor)", dtype, _steady(row), _STEP)
                peers = ("plain-compile",) if row.own_ratio is not None else (
                    "plain", "plain-compile", "torch-512"
                )  # fmt: skip
                for peer in peers:
                    if peer in by:
                        faster(f"step × {peer}'s (paired; below 1: faster)", dtype, row, by[peer])
                if point.dtype == "fp32":
                    at_most("step's transient memory (× grads)", dtype, row.peak_ratio, _MEMORY)
            if "linear_ce-fwd" in by:
                at_most("forward only (× its floor)", dtype, by["linear_ce-fwd"].ratio, _STEP)
        elif point.head != "ce":
            name = f"{point.head}-linear_ce"
            row = by.get(name)
            value = None if row is None else _steady(row)
            if point.head == "objective":
                at_most("token_objective (× its floor)", dtype, value, _HEAD)
            elif point.head == "divergence":
                at_most("linear_divergence (× floor-2heads)", dtype, value, _HEAD)
            elif point.head == "logprobs" and value is not None:
                at_most(
                    "token_logprobs with entropy (× its four GEMMs)",
                    dtype,
                    value * _FOUR_OVER_THREE,
                    _STEP,
                )
    return found


def table(targets: list[Target], title: str):
    """A :class:`rich.table.Table` of ``targets``, with how many were met in its caption."""
    from rich.table import Table

    out = Table(title=title, caption=f"{sum(t.met for t in targets)} of {len(targets)} targets met")
    for header, justify in [
        ("target", "left"),
        ("dtype", "left"),
        ("measured", "right"),
        ("bound", "right"),
        ("met", "center"),
    ]:
        out.add_column(header, justify=justify)
    for t in targets:
        out.add_row(
            t.name, t.dtype, f"{t.measured:.3f}", f"{t.bound:.3f}", "yes" if t.met else "NO"
        )
    return out
