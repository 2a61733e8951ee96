r"""The logits transform, the same for every head of the package.

The raw projection :math:`a = x W^\top + b` becomes

.. math::

    z = a \cdot \sigma, \qquad
    z \leftarrow c \tanh(z / c) \;\; (\text{softcap } c, \text{ if set}), \qquad
    s = z / T,

with logit scale :math:`\sigma`, softcap :math:`c` and temperature :math:`T`,
in that order. Its derivative is
:math:`\partial s / \partial a = (\sigma / T)\,\mathrm{sech}^2(a\sigma/c)`; the
constant :math:`\sigma / T` is folded into each head's row scale, so only the
softcap costs a pass over the tile in backward.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["LogitTransform"]


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """``logit_scale`` σ, ``softcap`` c (``None``: none) and ``temperature`` T."""

    logit_scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    @property
    def factor(self) -> float:
        """The constant part σ/T of ∂s/∂a."""
        return self.logit_scale / self.temperature

    def as_list(self) -> list[float]:
        """Flat form for custom-op signatures (``float[]``); softcap ``None`` is ``0``."""
        return [self.logit_scale, self.softcap or 0.0, self.temperature]

    def as_tuple(self) -> tuple[float, float | None, float]:
        return self.logit_scale, self.softcap, self.temperature

    @classmethod
    def from_list(cls, values: list[float]) -> LogitTransform:
        scale, cap, temperature = values
        return cls(float(scale), float(cap) if cap else None, float(temperature))

    def apply_(self, logits: torch.Tensor, sech2: torch.Tensor | None) -> None:
        """Turn raw ``logits`` into ``s`` in place; with a softcap and a ``sech2``
        buffer of the same shape, store ``sech²(aσ/c)`` there for the backward."""
        cap = self.softcap
        if cap is None:
            if self.logit_scale != 1.0:
                logits.mul_(self.logit_scale)
            if self.temperature != 1.0:
                logits.div_(self.temperature)
            return
        if self.logit_scale == 1.0:
            logits.div_(cap)
        else:
            logits.mul_(self.logit_scale / cap)
        if sech2 is not None:
            # tanh' = sech², not 1 - tanh²: the latter cancels to nothing where tanh
            # saturates, losing every digit of the gradient of large logits.
            torch.cosh(logits, out=sech2).reciprocal_().square_()
        logits.tanh_().mul_(cap)
        if self.temperature != 1.0:
            logits.div_(self.temperature)

    def plain(self, logits: torch.Tensor) -> torch.Tensor:
        """The transform out of place, for the plain expressions of :mod:`linear_ce.reference`."""
        z = logits * self.logit_scale if self.logit_scale != 1.0 else logits
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / self.temperature if self.temperature != 1.0 else z
