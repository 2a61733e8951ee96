r"""Token-local objectives for :func:`linear_ce.token_objective`: ``objective(logprob,
entropy, **side) -> loss``, one loss per token (see :mod:`linear_ce.objectives`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from linear_ce.losses.sequence_objective import log_metric
from linear_ce.objectives.checks import check_choice, check_float

__all__ = [
    "Objective",
    "cispo",
    "clipped_policy_gradient",
    "entropy_bonus",
    "kl_penalty",
    "log_clipping",
    "sapo",
]


class Objective:
    """A named token-local objective; ``a + b`` is the objective whose loss is the sum.

    ``needs_entropy`` says whether it reads ``entropy`` (``token_objective`` then
    requires ``entropy=True``); ``side`` names the side inputs it needs.
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
                f"objective {self.name} needs the side input(s) {missing}; pass them as "
                "keyword arguments (per token: the target's shape)"
            )
        if self.needs_entropy and entropy is None:
            raise ValueError(f"objective {self.name} reads the entropy; pass entropy=True")
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


def _log_ratio(logprob: torch.Tensor, old_logprob: torch.Tensor | None) -> torch.Tensor:
    r""":math:`\log p - \log p_{old}`; on-policy (``None``): :math:`\log p - sg(\log p)`,
    zero with the gradient of :math:`\log p`."""
    return logprob - (logprob.detach() if old_logprob is None else old_logprob)


def log_clipping(ratio, advantage, low: float, high: float, weight=None) -> None:
    """TRL's clip fractions: below ``low`` with a negative advantage, above ``high`` with a
    positive one, either; and the mean ratio."""
    below = ((ratio < low) & (advantage < 0)).to(ratio.dtype)
    above = ((ratio > high) & (advantage > 0)).to(ratio.dtype)
    log_metric("clip_fraction/low", below, weight)
    log_metric("clip_fraction/high", above, weight)
    log_metric("clip_fraction", below + above, weight)
    log_metric("ratio", ratio, weight)


def clipped_policy_gradient(
    clip_low: float = 0.2, clip_high: float = 0.2, *, delta: float | None = None
) -> Objective:
    r"""The PPO/GRPO/DAPO clipped surrogate,
    :math:`-\min\big(\min(r, \delta) A,\ \mathrm{clip}(r, 1-\varepsilon_{low}, 1+\varepsilon_{high}) A\big)`
    with :math:`r = \exp(\log p - \log p_{old})` (PPO, Schulman et al. 2017; DAPO's
    asymmetric :math:`\varepsilon`, Yu et al. 2025). ``delta``: the two-sided clip of
    INTELLECT-2 (the unclipped ratio capped at :math:`\delta`; ``None``: no cap). Side
    inputs: ``advantage``, ``old_logprob`` (optional: on-policy without it) and optionally
    ``weight``. Logs ``clip_fraction``, ``clip_fraction/low``, ``clip_fraction/high`` and
    ``ratio``."""
    owner = "clipped_policy_gradient"
    check_float(owner, "clip_low", clip_low, low=0.0)
    check_float(owner, "clip_high", clip_high, low=0.0)
    if delta is not None:
        check_float(owner, "delta", delta, low=1.0 + clip_high)

    def fn(logprob, entropy, *, advantage, old_logprob=None, **side):
        ratio = torch.exp(_log_ratio(logprob, old_logprob))
        clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        log_clipping(ratio, advantage, 1.0 - clip_low, 1.0 + clip_high)
        capped = ratio if delta is None else ratio.clamp(max=delta)
        return _weighted(-torch.min(capped * advantage, clipped * advantage), side)

    suffix = "" if delta is None else f", delta={delta}"
    return Objective(fn, f"{owner}({clip_low}, {clip_high}{suffix})", side=("advantage",))


def cispo(max_ratio: float = 5.0) -> Objective:
    r"""CISPO (MiniMax-M1, 2025; ScaleRL's :math:`\varepsilon_{max}`):
    :math:`-\operatorname{sg}\big(\min(r, \varepsilon_{max})\big)\, A \log p`: the clipped
    ratio only weights the policy gradient, so every token keeps a gradient. As TRL's
    ``loss_type="cispo"`` (``epsilon_high`` is ``max_ratio``). Side inputs: ``advantage``,
    ``old_logprob`` (optional: on-policy) and optionally ``weight``. Logs
    ``clip_fraction`` (ratio above ``max_ratio`` with a positive advantage) and ``ratio``."""
    check_float("cispo", "max_ratio", max_ratio, low=0.0)

    def fn(logprob, entropy, *, advantage, old_logprob=None, **side):
        ratio = torch.exp(_log_ratio(logprob, old_logprob)).detach()
        log_metric("clip_fraction", ((ratio > max_ratio) & (advantage > 0)).to(ratio.dtype))
        log_metric("ratio", ratio)
        return _weighted(-ratio.clamp(max=max_ratio) * advantage * logprob, side)

    return Objective(fn, f"cispo({max_ratio})", side=("advantage",))


def sapo(temperature_pos: float = 1.0, temperature_neg: float = 1.05) -> Objective:
    r"""SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025): a smooth gate instead of
    the hard clip, :math:`-\frac{4}{\tau}\sigma\big(\tau (r - 1)\big) A` with
    :math:`\tau = \tau_{pos}` where :math:`A > 0`, else :math:`\tau_{neg}` (TRL's
    ``loss_type="sapo"``; its gradient is :math:`r A` times
    :math:`4\sigma(1-\sigma)`, 1 at :math:`r = 1`). Side inputs: ``advantage``,
    ``old_logprob`` (optional: on-policy) and optionally ``weight``. Logs ``ratio``."""
    check_float("sapo", "temperature_pos", temperature_pos, low=0.0)
    check_float("sapo", "temperature_neg", temperature_neg, low=0.0)
    if temperature_pos == 0 or temperature_neg == 0:
        raise ValueError("sapo: the temperatures must be > 0")

    def fn(logprob, entropy, *, advantage, old_logprob=None, **side):
        ratio = torch.exp(_log_ratio(logprob, old_logprob))
        log_metric("ratio", ratio)
        tau = torch.where(advantage > 0, temperature_pos, temperature_neg).to(ratio.dtype)
        return _weighted(-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantage, side)

    return Objective(fn, f"sapo({temperature_pos}, {temperature_neg})", side=("advantage",))


_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(coef: float, estimator: str = "k3", *, bias_correction: bool = False) -> Objective:
    r"""``coef`` times an estimate of :math:`\mathrm{KL}(\pi \,\|\, \pi_{ref})` per token from
    :math:`\delta = \log p_{ref} - \log p`: ``"k1"`` :math:`-\delta`, ``"k2"``
    :math:`\delta^2/2`, ``"k3"`` :math:`e^{\delta} - \delta - 1` (Schulman, "Approximating KL
    divergence", 2020). ``bias_correction``: the estimate times the importance ratio
    :math:`r = \exp(\log p - \log p_{old})`, with its gradient (DeepSeek-V3.2; TRL's
    ``use_bias_correction_kl``), which makes the gradient the unbiased reverse-KL one for
    samples of :math:`\pi_{old}`; on-policy (no ``old_logprob``) :math:`r = 1` and its gradient
    still counts. Side input: ``ref_logprob`` (``old_logprob`` with ``bias_correction``;
    optionally ``weight``). Logs ``kl`` (the estimate, corrected, before ``coef``)."""
    check_choice("kl_penalty", "estimator", estimator, _ESTIMATORS)
    check_float("kl_penalty", "coef", coef)
    if not isinstance(bias_correction, bool):
        raise ValueError(f"kl_penalty: bias_correction must be a bool, got {bias_correction!r}")

    def fn(logprob, entropy, *, ref_logprob, old_logprob=None, **side):
        delta = ref_logprob - logprob
        if estimator == "k1":
            kl = -delta
        elif estimator == "k2":
            kl = 0.5 * delta.square()
        else:
            kl = torch.expm1(delta) - delta
        if bias_correction:
            kl = kl * torch.exp(_log_ratio(logprob, old_logprob))
        log_metric("kl", kl)
        return _weighted(coef * kl, side)

    suffix = ", bias_correction=True" if bias_correction else ""
    return Objective(fn, f"kl_penalty({coef}, {estimator!r}{suffix})", side=("ref_logprob",))


def entropy_bonus(coef: float) -> Objective:
    r"""``-coef · H`` per token: maximises the entropy. Side input: optionally ``weight``.
    Logs ``entropy``."""
    check_float("entropy_bonus", "coef", coef)

    def fn(logprob, entropy, **side):
        log_metric("entropy", entropy)
        return _weighted(-coef * entropy, side)

    return Objective(fn, f"entropy_bonus({coef})", needs_entropy=True)
