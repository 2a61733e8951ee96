"""The result type when extra outputs are asked for."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["LinearCrossEntropyOutput"]


class LinearCrossEntropyOutput(NamedTuple):
    """``(loss, z_loss, lse)``, returned when ``return_z_loss`` or ``return_lse`` is set.

    ``z_loss`` is the z-loss term alone, reduced like ``loss`` (already included
    in ``loss``); ``lse`` is the per-token log-sum-exp of the (softcapped)
    logits, of the loss's per-token shape. Both are detached: they are for
    logging. A field that was not asked for is ``None``.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None
    lse: torch.Tensor | None
