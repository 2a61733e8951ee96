"""``LinearCrossEntropyLoss``: an ``nn.Module`` owning the projection."""

from __future__ import annotations

import math

import torch
from torch import nn

from linear_ce.functional import linear_cross_entropy
from linear_ce.options import LinearCrossEntropyOptions
from linear_ce.outputs import LinearCrossEntropyOutput

__all__ = ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(nn.Module):
    r"""A linear layer followed by cross entropy, computed without the logits.

    Owns ``weight`` ``(num_classes, *out_features, in_features)`` (and ``bias``
    ``(num_classes, *out_features)`` if ``bias=True``), initialised like
    :class:`torch.nn.Linear`. ``forward(input, target)`` returns
    :func:`linear_ce.linear_cross_entropy` of them; the remaining arguments are
    that function's and are stored on the module. ``weight`` here is the class
    weight of the loss, as in :class:`torch.nn.CrossEntropyLoss`; it is kept as
    a buffer.

    Shape:
        - input: ``(*, in_features)``; target: ``(*)`` class indices (or
          ``(*, *out_features)`` for a K-dimensional loss), or probabilities
          ``(*, num_classes, *out_features)``.
        - output: scalar, or ``(*)`` with ``reduction="none"``.

    Example::

        >>> loss_fn = LinearCrossEntropyLoss(64, 1000)
        >>> loss = loss_fn(torch.randn(8, 64), torch.randint(0, 1000, (8,)))
        >>> loss.backward()
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        out_features: tuple[int, ...] = (),
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        reduction: str = "mean",
        weight: torch.Tensor | None = None,
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
        options: LinearCrossEntropyOptions | None = None,
        z_loss: float = 0.0,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("num_classes", num_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"LinearCrossEntropyLoss: {name} must be a positive int, got {value!r}"
                )
        out_features = tuple(out_features)
        if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in out_features):
            raise ValueError(
                f"LinearCrossEntropyLoss: out_features must be a tuple of positive ints, got {out_features!r}"
            )
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.num_classes = num_classes
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty((num_classes, *out_features, in_features), **factory)
        )
        self.bias = (
            nn.Parameter(torch.empty((num_classes, *out_features), **factory)) if bias else None
        )
        self.register_buffer("class_weight", weight)
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.options = options
        self.z_loss = z_loss
        self.softcap = softcap
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation: uniform in ±1/sqrt(in_features)."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(
        self, input: torch.Tensor, target: torch.Tensor, **extras
    ) -> torch.Tensor | LinearCrossEntropyOutput:
        """The loss of ``input`` against ``target``; ``extras`` are passed on
        (``shift``, ``token_weight``, ``return_lse``, ``return_z_loss``)."""
        return linear_cross_entropy(
            input,
            self.weight,
            target,
            linear_bias=self.bias,
            weight=self.class_weight,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            options=self.options,
            z_loss=self.z_loss,
            softcap=self.softcap,
            **extras,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"reduction={self.reduction!r}"
        )
