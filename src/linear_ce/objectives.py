r"""Built-in token-local objectives for :func:`linear_ce.token_objective`.

An objective is a callable ``objective(logprob, entropy, **side) -> loss``: 1-D
tensors of one chunk's valid tokens in, one loss per token out, written with
ordinary torch operations (its autograd gives the gradients). ``entropy`` is
``None`` unless ``token_objective(..., entropy=True)``; ``side`` holds the
per-token side inputs passed to ``token_objective`` (e.g. ``old_logprob``,
``advantage``, ``ref_logprob``, ``weight``), sliced the same way. Every built-in
multiplies its loss by the side input ``weight`` when one is given: that is how
token-mean or sequence-mean aggregation is expressed (see docs/per-token.md).

Objectives add: ``clipped_policy_gradient() + kl_penalty(0.04) + entropy_bonus(0.01)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "Objective",
    "clipped_policy_gradient",
    "entropy_bonus",
    "kl_penalty",
]


class Objective:
    """A named token-local objective; ``a + b`` is the objective whose loss is the sum.

    ``needs_entropy`` says whether it reads ``entropy`` (``token_objective`` then
    requires ``entropy=True``); ``side`` names the side inputs it reads.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        name: str,
        *,
        needs_entropy: bool = False,
        side: tuple[str, ...] = (),
    ) -> None:
        self.fn, self.name, self.needs_entropy, self.side = fn, name, needs_entropy, side

    def __call__(self, logprob, entropy, **side) -> torch.Tensor:
        missing = [k for k in self.side if k not in side]
        if missing:
            raise ValueError(
                f"objective {self.name} needs the side input(s) {missing}; pass them to "
                f"token_objective as keyword arguments of the target's shape"
            )
        if self.needs_entropy and entropy is None:
            raise ValueError(
                f"objective {self.name} reads the entropy; call token_objective(..., entropy=True)"
            )
        return self.fn(logprob, entropy, **side)

    def __add__(self, other: Objective) -> Objective:
        if not isinstance(other, Objective):
            return NotImplemented
        return Objective(
            lambda lp, ent, **side: self(lp, ent, **side) + other(lp, ent, **side),
            f"{self.name} + {other.name}",
            needs_entropy=self.needs_entropy or other.needs_entropy,
            side=tuple(dict.fromkeys(self.side + other.side)),
        )

    def __repr__(self) -> str:
        return f"Objective({self.name})"


def _weighted(loss: torch.Tensor, side: dict) -> torch.Tensor:
    weight = side.get("weight")
    return loss if weight is None else loss * weight


def clipped_policy_gradient(clip_low: float = 0.2, clip_high: float = 0.2) -> Objective:
    r"""The PPO/GRPO/DAPO clipped surrogate,
    :math:`-\min\big(r A,\ \mathrm{clip}(r, 1-\varepsilon_{low}, 1+\varepsilon_{high}) A\big)`
    with :math:`r = \exp(\log p - \log p_{old})`. Side inputs: ``old_logprob``,
    ``advantage`` (and optionally ``weight``)."""
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"clipped_policy_gradient: {name} must be a float >= 0, got {value!r}")

    def fn(logprob, entropy, *, old_logprob, advantage, **side):
        ratio = torch.exp(logprob - old_logprob)
        clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        return _weighted(-torch.min(ratio * advantage, clipped * advantage), side)

    return Objective(
        fn,
        f"clipped_policy_gradient({clip_low}, {clip_high})",
        side=("old_logprob", "advantage"),
    )


_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(coef: float, estimator: str = "k3") -> Objective:
    r"""``coef`` times an estimate of :math:`\mathrm{KL}(\pi \,\|\, \pi_{ref})` per token from
    :math:`\delta = \log p_{ref} - \log p`: ``"k1"`` :math:`-\delta`, ``"k2"``
    :math:`\delta^2/2`, ``"k3"`` :math:`e^{\delta} - \delta - 1`. Side input:
    ``ref_logprob`` (and optionally ``weight``)."""
    if estimator not in _ESTIMATORS:
        raise ValueError(f"kl_penalty: estimator must be one of {_ESTIMATORS}, got {estimator!r}")
    if isinstance(coef, bool) or not isinstance(coef, (int, float)):
        raise ValueError(f"kl_penalty: coef must be a float, got {coef!r}")

    def fn(logprob, entropy, *, ref_logprob, **side):
        delta = ref_logprob - logprob
        if estimator == "k1":
            kl = -delta
        elif estimator == "k2":
            kl = 0.5 * delta.square()
        else:
            kl = torch.expm1(delta) - delta
        return _weighted(coef * kl, side)

    return Objective(fn, f"kl_penalty({coef}, {estimator!r})", side=("ref_logprob",))


def entropy_bonus(coef: float) -> Objective:
    r"""``-coef · H`` per token: maximises the entropy. Side input: optionally ``weight``."""
    if isinstance(coef, bool) or not isinstance(coef, (int, float)):
        raise ValueError(f"entropy_bonus: coef must be a float, got {coef!r}")

    def fn(logprob, entropy, **side):
        return _weighted(-coef * entropy, side)

    return Objective(fn, f"entropy_bonus({coef})", needs_entropy=True)
