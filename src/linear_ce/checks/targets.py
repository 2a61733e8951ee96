"""The one check of the targets' values: class indices in range.

It runs inside the ops, where the targets are read anyway, so a compiled graph does not
guard on their values; it reads one bool on the host.
"""

from __future__ import annotations

import torch

from linear_ce.checks.call import Call

__all__ = ["check_class_indices", "check_targets"]


def check_class_indices(
    target: torch.Tensor, ignore_index: int, num_classes: int, name: str = "linear_cross_entropy"
) -> None:
    """Class indices must lie in [0, C) or equal ignore_index; say which value does not
    (errors name ``name``)."""
    if target.numel() == 0:
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(
            f"{name}: target contains class index {value}, outside [0, "
            f"{num_classes}) and not ignore_index={ignore_index}"
        )


def check_targets(call: Call, num_classes: int) -> None:
    """:func:`check_class_indices` of a class-index call over ``num_classes`` classes (the
    whole vocabulary's for a vocab-parallel shard); errors name ``call.name``."""
    if not call.probability_target:
        check_class_indices(call.target, call.ignore_index, num_classes, call.name)
