"""The tile's row max and row sum (``engine.row_reductions``) against plain torch in float64,
in both layouts, with the classes a multiple of the slab count or not."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from linear_ce.engine.row_reductions import SPLIT, row_max, row_sum


def _tile(rows: int, classes: int, class_major: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if class_major:
        return (torch.randn(classes, rows, generator=g) * 4).T
    return torch.randn(rows, classes, generator=g) * 4


@given(
    rows=st.integers(1, 40),
    classes=st.sampled_from([1, 7, SPLIT * SPLIT - 1, SPLIT * SPLIT, SPLIT * SPLIT + 13, 9000]),
    class_major=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(rows=3, classes=SPLIT * SPLIT + 13, class_major=True, seed=0)
@example(rows=2, classes=SPLIT * SPLIT, class_major=True, seed=1)
def test_row_max_and_sum(rows: int, classes: int, class_major: bool, seed: int) -> None:
    tile = _tile(rows, classes, class_major, seed)
    # The max is exact in any order: the very value.
    assert torch.equal(row_max(tile), tile.amax(dim=1))
    out = torch.empty(rows)
    assert torch.equal(row_max(tile, out), tile.amax(dim=1))
    summed = row_sum(tile.exp(), torch.empty(rows))
    exact = tile.double().exp().sum(dim=1)
    # The house bound: 3 eps, or twice the plain fp32 sum's own error measured here.
    eps = torch.finfo(torch.float32).eps
    bound = max(3 * eps, 2 * ((tile.exp().sum(dim=1).double() - exact).abs() / exact).max().item())
    assert ((summed.double() - exact).abs() / exact).max().item() <= bound


def test_into_a_strided_column() -> None:
    """The chunk loop sums into column 0 of its ``(B, 1 + k)`` statistics."""
    tile = _tile(9, SPLIT * SPLIT + 5, True, 3)
    stats = torch.full((9, 3), math.nan)
    row_sum(tile, stats[:, 0])
    exact = tile.double().sum(1)
    # The house bound: 3 eps of the terms' magnitude, or twice the plain fp32 sum's own error.
    scale = tile.double().abs().sum(1)
    plain = ((tile.sum(1).double() - exact).abs() / scale).max().item()
    bound = max(3 * torch.finfo(torch.float32).eps, 2 * plain)
    assert ((stats[:, 0].double() - exact).abs() / scale).max().item() <= bound
    assert stats[:, 1:].isnan().all()


@pytest.mark.parametrize("special", [-math.inf, math.inf, math.nan])
def test_special_values_propagate_as_amax(special: float) -> None:
    tile = _tile(4, SPLIT * SPLIT + 3, True, 5)
    tile[1, 17] = special
    tile[2, -1] = special  # in the classes past the last whole slab
    tile[3].fill_(-math.inf)
    assert torch.equal(row_max(tile), tile.amax(dim=1)) or (
        math.isnan(special) and row_max(tile).isnan().equal(tile.amax(dim=1).isnan())
    )
