r"""Sequence-level objectives for :func:`linear_ce.sequence_objective`: ``fn(batch:
SequenceBatch) -> loss``, one loss per group or per sequence (see
:mod:`linear_ce.objectives`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from linear_ce.losses.sequence_objective import SequenceBatch, log_metric
from linear_ce.objectives.checks import check_choice, check_float
from linear_ce.objectives.token import Objective, log_clipping

__all__ = [
    "DPO_LOSSES",
    "SequenceObjective",
    "cpo",
    "dpo",
    "gspo",
    "kto",
    "orpo",
    "simpo",
    "token_mean",
]


_PER = ("group", "sequence")


class SequenceObjective:
    """A named sequence-level objective: ``fn(batch: SequenceBatch) -> loss``, one loss per
    group (``per="group"``) or per sequence (``per="sequence"``).

    ``group_size``: the groups it compares (2: chosen, rejected; ``None``: any);
    ``side`` / ``token_side``: the per-sequence / per-token side inputs it needs (checked
    before the pass); ``needs_entropy``: it reads the entropy. ``a + b`` sums two
    objectives of the same ``per``; ``w * a`` scales one.
    r"""

    def __init__(
        self,
        fn: Callable[[SequenceBatch], torch.Tensor],
        name: str,
        *,
        per: str,
        group_size: int | None = None,
        side: tuple[str, ...] = (),
        token_side: tuple[str, ...] = (),
        needs_entropy: bool = False,
    ) -> None:
        check_choice(name, "per", per, _PER)
        self.fn, self.name, self.per, self.group_size = fn, name, per, group_size
        self.side, self.token_side, self.needs_entropy = side, token_side, needs_entropy

    def __call__(self, batch: SequenceBatch) -> torch.Tensor:
        for names, given, kind in (
            (self.side, batch.side, "per sequence"),
            (self.token_side, batch.token_side, "per token"),
        ):
            missing = [k for k in names if k not in given]
            if missing:
                raise ValueError(
                    f"objective {self.name} needs the side input(s) {missing} {kind}; pass "
                    "them as keyword arguments"
                )
        if self.needs_entropy and batch.entropy is None:
            raise ValueError(f"objective {self.name} reads the entropy; pass entropy=True")
        return self.fn(batch)

    def __add__(self, other: SequenceObjective) -> SequenceObjective:
        if not isinstance(other, SequenceObjective):
            return NotImplemented
        if self.per != other.per:
            raise ValueError(
                f"cannot add {self.name} (one loss per {self.per}) and {other.name} (one loss "
                f"per {other.per}): write the sum as one objective"
            )
        sizes = {s for s in (self.group_size, other.group_size) if s is not None}
        if len(sizes) > 1:
            raise ValueError(
                f"cannot add {self.name} and {other.name}: they compare groups of "
                f"{self.group_size} and {other.group_size} sequences"
            )
        return SequenceObjective(
            lambda batch: self(batch) + other(batch),
            f"{self.name} + {other.name}",
            per=self.per,
            group_size=next(iter(sizes), None),
            side=tuple(dict.fromkeys(self.side + other.side)),
            token_side=tuple(dict.fromkeys(self.token_side + other.token_side)),
            needs_entropy=self.needs_entropy or other.needs_entropy,
        )

    def __mul__(self, weight: float) -> SequenceObjective:
        check_float(self.name, "the weight", weight)
        return SequenceObjective(
            lambda batch: weight * self(batch),
            f"{weight} * {self.name}",
            per=self.per,
            group_size=self.group_size,
            side=self.side,
            token_side=self.token_side,
            needs_entropy=self.needs_entropy,
        )

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return f"SequenceObjective({self.name})"


def _smoothed_sigmoid(z: torch.Tensor, smoothing: float) -> torch.Tensor:
    r""":math:`-(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z)`."""
    loss = -F.logsigmoid(z)
    return loss if smoothing == 0 else (1 - smoothing) * loss - smoothing * F.logsigmoid(-z)


def _log_rewards(chosen: torch.Tensor, rejected: torch.Tensor) -> None:
    """What preference trainers log from the rewards: each, the margin, the accuracy."""
    log_metric("rewards/chosen", chosen)
    log_metric("rewards/rejected", rejected)
    log_metric("rewards/margins", chosen - rejected)
    log_metric("rewards/accuracies", (chosen > rejected).to(chosen.dtype))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    r""":math:`\log(1 - e^{x})` for :math:`x < 0`, without cancellation (Mächler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


#: The loss types :func:`dpo` takes: TRL 1.16's but the batch-wide ``aot`` and ``aot_unpaired``.
DPO_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
#: Loss types whose comparison of the two answers goes through the f-divergence's scores.
_F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop")
_F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
#: Loss types of TRL that compare across the batch (sorted log-ratios): not group-local.
_BATCH_WIDE = ("aot", "aot_unpaired")


def _f_scores(logratio: torch.Tensor, divergence: str, alpha: float) -> torch.Tensor:
    r""":math:`f'(\pi/\pi_{ref})` of the f-divergence, as a function of the log-ratio."""
    if divergence == "reverse_kl" or (divergence == "alpha_divergence" and alpha == 1.0):
        return logratio
    if divergence == "forward_kl":
        return 1 - torch.exp(-logratio)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(logratio)
    return torch.expm1((alpha - 1) * logratio) / (alpha - 1)


def dpo(
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    *,
    label_smoothing: float = 0.0,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    discopop_tau: float = 0.05,
    reference_free: bool = False,
) -> SequenceObjective:
    r"""Direct Preference Optimization (Rafailov et al. 2023) and the loss types of TRL's
    ``DPOTrainer``, per pair of sequences (chosen :math:`c`, rejected :math:`r`).

    With the log-ratios :math:`\rho_c = L_c - L^{ref}_c`, :math:`\rho_r = L_r - L^{ref}_r`
    (:math:`L`: summed log-probabilities), the f-divergence scores
    :math:`\phi = f'(\cdot)` of ``f_divergence`` (``reverse_kl``: :math:`\phi(\rho) = \rho`;
    ``forward_kl``: :math:`1 - e^{-\rho}`; ``js_divergence``: :math:`\log 2 + \log\sigma(\rho)`;
    ``alpha_divergence``: :math:`(e^{(\alpha-1)\rho} - 1)/(\alpha - 1)`; Wang et al. 2023),
    :math:`\Delta = \phi(\rho_c) - \phi(\rho_r)`, :math:`\varepsilon` = ``label_smoothing``
    and :math:`\sigma` the logistic function:

    - ``sigmoid`` (DPO; cDPO with :math:`\varepsilon`):
      :math:`-(1-\varepsilon)\log\sigma(\beta\Delta) - \varepsilon\log\sigma(-\beta\Delta)`;
    - ``hinge`` (SLiC, Zhao et al. 2023): :math:`\max(0, 1 - \beta\Delta)`;
    - ``ipo`` (Azar et al. 2023, length-normalised as TRL):
      :math:`\big(\phi(\rho_c)/|c| - \phi(\rho_r)/|r| - \tfrac{1}{2\beta}\big)^2`;
    - ``exo_pair`` (Ji et al. 2024), :math:`0 < \varepsilon < 1`:
      :math:`q\,(\log q - \log(1-\varepsilon)) + \bar q\,(\log \bar q - \log\varepsilon)`,
      :math:`q = \sigma(\beta\Delta)`, :math:`\bar q = \sigma(-\beta\Delta)`;
    - ``nca_pair`` (Chen et al. 2024): :math:`-\log\sigma(\beta\rho_c)
      - \tfrac12\log\sigma(-\beta\rho_c) - \tfrac12\log\sigma(-\beta\rho_r)`;
    - ``robust`` (Chowdhury et al. 2024), :math:`0 \le \varepsilon < \tfrac12`:
      :math:`\frac{-(1-\varepsilon)\log\sigma(\beta\Delta) + \varepsilon\log\sigma(-\beta\Delta)}{1 - 2\varepsilon}`;
    - ``bco_pair`` (Jung et al. 2024, without the running shift):
      :math:`-\log\sigma(\beta\rho_c) - \log\sigma(-\beta\rho_r)`;
    - ``sppo_hard`` (Wu et al. 2024): :math:`(\rho_c - \tfrac{1}{2\beta})^2 + (\rho_r + \tfrac{1}{2\beta})^2`;
    - ``apo_zero`` / ``apo_down`` (D'Oosterlinck et al. 2024):
      :math:`1 - \sigma(\beta\rho_c) + \sigma(\beta\rho_r)` /
      :math:`\sigma(\beta\rho_c) + 1 - \sigma(\beta(\rho_c - \rho_r))`;
    - ``discopop`` (Chan et al. 2024), :math:`z = \beta\Delta`, :math:`m = \sigma(z/\tau)`:
      :math:`-\log\sigma(z)(1 - m) + e^{-z} m`;
    - ``sft``: the chosen answers' negative log-likelihood, a token mean over every chosen
      token of the call (TRL's), :math:`-L_c \cdot G / T_c` per pair (``G`` pairs,
      :math:`T_c` chosen tokens in the call: their mean over pairs is TRL's);
    - ``sigmoid_norm``: :math:`-\log\sigma\big(\beta(\phi(\rho_c)/|c| - \phi(\rho_r)/|r|)\big)`.

    TRL's ``aot`` and ``aot_unpaired`` sort the log-ratios across the whole batch: not a
    loss of each pair, so not a sequence objective (refused). Side input: ``ref_logprob``
    (per sequence, the reference model's summed log-probabilities; not with
    ``reference_free=True``, where :math:`L^{ref} = 0`). One loss per pair: the mean over
    pairs (``reduction="mean"``) is TRL's loss. Logs ``rewards/chosen``
    (:math:`\beta\rho_c`), ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``.
    """
    owner = "dpo"
    if loss_type in _BATCH_WIDE:
        raise ValueError(
            f"dpo: loss_type {loss_type!r} sorts the log-ratios across the whole batch, so "
            "it is not a loss of each pair; compute it from token_logprobs instead"
        )
    check_choice(owner, "loss_type", loss_type, DPO_LOSSES)
    check_choice(owner, "f_divergence", f_divergence, _F_DIVERGENCES)
    check_float(owner, "beta", beta)
    check_float(owner, "label_smoothing", label_smoothing, low=0.0)
    check_float(owner, "f_alpha", f_alpha)
    check_float(owner, "discopop_tau", discopop_tau)
    if beta <= 0:
        raise ValueError(f"dpo: beta must be > 0, got {beta!r}")
    if f_divergence != "reverse_kl" and loss_type not in _F_DIVERGENCE_LOSSES:
        raise ValueError(
            f"dpo: f_divergence={f_divergence!r} applies to the loss types "
            f"{_F_DIVERGENCE_LOSSES}, not {loss_type!r}"
        )
    if loss_type == "robust" and not label_smoothing < 0.5:
        raise ValueError(f"dpo: robust needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    if loss_type == "exo_pair" and not 0 < label_smoothing < 1:
        raise ValueError(f"dpo: exo_pair needs 0 < label_smoothing < 1, got {label_smoothing}")
    if label_smoothing >= 1:
        raise ValueError(f"dpo: label_smoothing must be < 1, got {label_smoothing}")

    def fn(batch: SequenceBatch) -> torch.Tensor:
        lp_c, lp_r = batch.pair(batch.logprob)
        if reference_free:
            rho_c, rho_r = lp_c, lp_r
        else:
            ref_c, ref_r = batch.pair(batch.side["ref_logprob"])
            rho_c, rho_r = lp_c - ref_c, lp_r - ref_r
        _log_rewards(beta * rho_c.detach(), beta * rho_r.detach())
        phi_c = _f_scores(rho_c, f_divergence, f_alpha)
        phi_r = _f_scores(rho_r, f_divergence, f_alpha)
        len_c, len_r = batch.pair(batch.length)
        z = beta * (phi_c - phi_r)
        if loss_type == "sigmoid":
            return _smoothed_sigmoid(z, label_smoothing)
        if loss_type == "hinge":
            return torch.relu(1 - z)
        if loss_type == "ipo":
            return (phi_c / len_c - phi_r / len_r - 1 / (2 * beta)) ** 2
        if loss_type == "exo_pair":
            q, q_bar = torch.sigmoid(z), torch.sigmoid(-z)
            return q * (F.logsigmoid(z) - math.log1p(-label_smoothing)) + q_bar * (
                F.logsigmoid(-z) - math.log(label_smoothing)
            )
        if loss_type == "nca_pair":
            return (
                -F.logsigmoid(beta * rho_c)
                - 0.5 * F.logsigmoid(-beta * rho_c)
                - 0.5 * F.logsigmoid(-beta * rho_r)
            )
        if loss_type == "robust":
            eps = label_smoothing
            return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
        if loss_type == "bco_pair":
            return -F.logsigmoid(beta * rho_c) - F.logsigmoid(-beta * rho_r)
        if loss_type == "sppo_hard":
            return (rho_c - 0.5 / beta) ** 2 + (rho_r + 0.5 / beta) ** 2
        if loss_type == "apo_zero":
            return 1 - torch.sigmoid(beta * rho_c) + torch.sigmoid(beta * rho_r)
        if loss_type == "apo_down":
            return torch.sigmoid(beta * rho_c) + 1 - torch.sigmoid(beta * (rho_c - rho_r))
        if loss_type == "discopop":
            m = torch.sigmoid(z / discopop_tau)
            return -F.logsigmoid(z) * (1 - m) + torch.exp(-z) * m
        if loss_type == "sft":
            return -lp_c * (batch.totals.groups / batch.totals.member_tokens[0])
        return -F.logsigmoid(beta * (phi_c / len_c - phi_r / len_r))

    needs_ref = () if reference_free else ("ref_logprob",)
    return SequenceObjective(
        fn, f"dpo({beta}, {loss_type!r})", per="group", group_size=2, side=needs_ref
    )


def _nll_term(batch: SequenceBatch, lp_c: torch.Tensor, len_c: torch.Tensor, nll: str):
    """The chosen answers' negative log-likelihood per pair: ``"batch"`` a token mean over
    every chosen token of the call (TRL's cross-entropy on the chosen rows; per pair
    :math:`-L_c G / T_c`, whose mean over pairs it is), ``"sequence"`` each answer's own
    token mean :math:`-L_c/|c|` (the ORPO paper's)."""
    if nll == "batch":
        return -lp_c * (batch.totals.groups / batch.totals.member_tokens[0])
    return -lp_c / len_c


_NLL = ("batch", "sequence")


def simpo(
    beta: float = 2.0, gamma: float = 1.0, *, label_smoothing: float = 0.0
) -> SequenceObjective:
    r"""SimPO (Meng et al. 2024), reference-free with length-normalised rewards:
    :math:`-(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z)`,
    :math:`z = \beta\,(L_c/|c| - L_r/|r|) - \gamma` (TRL's ``CPOTrainer`` with
    ``loss_type="simpo"``, ``cpo_alpha=0``; its ``simpo_gamma`` is :math:`\gamma`). One loss
    per pair (chosen, rejected). Logs the rewards :math:`\beta L/|y|` as :func:`dpo`."""
    check_float("simpo", "beta", beta)
    check_float("simpo", "gamma", gamma)
    check_float("simpo", "label_smoothing", label_smoothing, low=0.0)

    def fn(batch: SequenceBatch) -> torch.Tensor:
        avg_c, avg_r = batch.pair(batch.logprob / batch.length)
        _log_rewards(beta * avg_c.detach(), beta * avg_r.detach())
        return _smoothed_sigmoid(beta * (avg_c - avg_r) - gamma, label_smoothing)

    return SequenceObjective(fn, f"simpo({beta}, {gamma})", per="group", group_size=2)


_CPO_LOSSES = ("sigmoid", "hinge", "ipo", "simpo")


def cpo(
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    *,
    cpo_alpha: float = 1.0,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    nll: str = "batch",
) -> SequenceObjective:
    r"""Contrastive Preference Optimization (Xu et al. 2024), TRL's ``CPOTrainer``: a
    reference-free preference term plus ``cpo_alpha`` times the chosen answers' negative
    log-likelihood. With :math:`\ell_y = L_y` (``sigmoid``, ``hinge``) or :math:`L_y/|y|`
    (``ipo``, ``simpo``), and AlphaPO's rewards (Gupta et al. 2025) for ``alpha`` ≠ 0,
    :math:`\ell_y \to (1 - e^{-\alpha \ell_y})/\alpha`, the margin
    :math:`d = \ell_c - \ell_r` (minus :math:`\gamma/\beta` for ``simpo``):

    - ``sigmoid``, ``simpo``: :math:`-(1-\varepsilon)\log\sigma(\beta d) - \varepsilon\log\sigma(-\beta d)`;
    - ``hinge``: :math:`\max(0, 1 - \beta d)`; ``ipo``: :math:`(d - \tfrac{1}{2\beta})^2`;

    plus ``cpo_alpha`` times the NLL of ``nll``: ``"batch"`` the token mean over every
    chosen token of the call (TRL's), ``"sequence"`` each answer's own token mean. One loss
    per pair (chosen, rejected); the mean over pairs is TRL's loss. Logs the rewards
    :math:`\beta \ell` as :func:`dpo` and ``nll_loss``."""
    owner = "cpo"
    check_choice(owner, "loss_type", loss_type, _CPO_LOSSES)
    check_choice(owner, "nll", nll, _NLL)
    for key, value in (
        ("beta", beta),
        ("cpo_alpha", cpo_alpha),
        ("simpo_gamma", simpo_gamma),
        ("alpha", alpha),
    ):
        check_float(owner, key, value)
    check_float(owner, "label_smoothing", label_smoothing, low=0.0)
    average = loss_type in ("ipo", "simpo")

    def fn(batch: SequenceBatch) -> torch.Tensor:
        lp_c, lp_r = batch.pair(batch.logprob)
        len_c, len_r = batch.pair(batch.length)
        ell_c, ell_r = (lp_c / len_c, lp_r / len_r) if average else (lp_c, lp_r)
        if alpha != 0:
            ell_c = -torch.expm1(-alpha * ell_c) / alpha
            ell_r = -torch.expm1(-alpha * ell_r) / alpha
        _log_rewards(beta * ell_c.detach(), beta * ell_r.detach())
        d = ell_c - ell_r
        if loss_type == "simpo":
            d = d - simpo_gamma / beta
        if loss_type in ("sigmoid", "simpo"):
            loss = _smoothed_sigmoid(beta * d, label_smoothing)
        elif loss_type == "hinge":
            loss = torch.relu(1 - beta * d)
        else:
            loss = (d - 1 / (2 * beta)) ** 2
        if cpo_alpha == 0:
            return loss
        nll_term = _nll_term(batch, lp_c, len_c, nll)
        log_metric("nll_loss", nll_term.detach())
        return loss + cpo_alpha * nll_term

    return SequenceObjective(fn, f"cpo({beta}, {loss_type!r})", per="group", group_size=2)


def orpo(beta: float = 0.1, *, nll: str = "batch") -> SequenceObjective:
    r"""Odds Ratio Preference Optimization (Hong et al. 2024), TRL's ``ORPOTrainer``: with
    the mean log-probabilities :math:`a_y = L_y/|y|` and the log odds ratio
    :math:`\lambda = (a_c - a_r) - \big(\log(1 - e^{a_c}) - \log(1 - e^{a_r})\big)`, per pair
    :math:`\mathrm{NLL}_c - \beta\log\sigma(\lambda)`; the NLL as in :func:`cpo` (``"batch"``:
    TRL's token mean over every chosen token of the call). One loss per pair (chosen,
    rejected). Logs the rewards :math:`\beta a` as :func:`dpo`, ``log_odds_ratio``
    (:math:`\log\sigma(\lambda)`), ``log_odds_chosen`` (:math:`\lambda`) and ``nll_loss``."""
    check_float("orpo", "beta", beta)
    check_choice("orpo", "nll", nll, _NLL)

    def fn(batch: SequenceBatch) -> torch.Tensor:
        lp_c, lp_r = batch.pair(batch.logprob)
        len_c, len_r = batch.pair(batch.length)
        avg_c, avg_r = lp_c / len_c, lp_r / len_r
        log_odds = (avg_c - avg_r) - (_log1mexp(avg_c) - _log1mexp(avg_r))
        ratio = F.logsigmoid(log_odds)
        nll_term = _nll_term(batch, lp_c, len_c, nll)
        _log_rewards(beta * avg_c.detach(), beta * avg_r.detach())
        log_metric("log_odds_ratio", ratio.detach())
        log_metric("log_odds_chosen", log_odds.detach())
        log_metric("nll_loss", nll_term.detach())
        return nll_term - beta * ratio

    return SequenceObjective(fn, f"orpo({beta})", per="group", group_size=2)


_KTO_LOSSES = ("kto", "apo_zero_unpaired")


def kto(
    beta: float = 0.1,
    *,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> SequenceObjective:
    r"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024), TRL's ``KTOTrainer``: per
    sequence, with :math:`\rho = L - L^{ref}` and the reference point :math:`z_0` (side input
    ``kl``: TRL's detached, clamped batch KL estimate; 0 without it),

    .. math::
        \ell = \begin{cases}
            w_d\,\big(1 - \sigma(\beta(\rho - z_0))\big) & \text{desirable} \\
            w_u\,\big(1 - \sigma(\beta(z_0 - \rho))\big) & \text{undesirable}
        \end{cases}

    ``loss_type="apo_zero_unpaired"``: :math:`w_d(1 - \sigma(\beta\rho))` and
    :math:`w_u\,\sigma(\beta\rho)`, no reference point. Side inputs per sequence:
    ``ref_logprob``, ``label`` (true/1: desirable), optionally ``kl`` (a scalar or per
    sequence). One loss per sequence: their mean is TRL's loss. Logs ``rewards/chosen`` and
    ``rewards/rejected`` (:math:`\beta\rho` of each kind) and ``kl``."""
    owner = "kto"
    check_choice(owner, "loss_type", loss_type, _KTO_LOSSES)
    for key, value in (
        ("beta", beta),
        ("desirable_weight", desirable_weight),
        ("undesirable_weight", undesirable_weight),
    ):
        check_float(owner, key, value)

    def fn(batch: SequenceBatch) -> torch.Tensor:
        rho = batch.logprob - batch.side["ref_logprob"]
        desirable = batch.side["label"] > 0.5
        if loss_type == "kto":
            z0 = batch.side.get("kl", torch.zeros_like(rho))
            log_metric("kl", z0)
            good = 1 - torch.sigmoid(beta * (rho - z0))
            bad = 1 - torch.sigmoid(beta * (z0 - rho))
        else:
            good, bad = 1 - torch.sigmoid(beta * rho), torch.sigmoid(beta * rho)
        reward = beta * rho.detach()
        log_metric("rewards/chosen", reward, desirable.to(reward.dtype))
        log_metric("rewards/rejected", reward, (~desirable).to(reward.dtype))
        return torch.where(desirable, desirable_weight * good, undesirable_weight * bad)

    return SequenceObjective(
        fn, f"kto({beta}, {loss_type!r})", per="sequence", side=("ref_logprob", "label")
    )


def gspo(
    clip_low: float = 3e-4, clip_high: float = 4e-4, *, delta: float | None = None
) -> SequenceObjective:
    r"""Group Sequence Policy Optimization (Zheng et al. 2025; TRL's GRPO with
    ``importance_sampling_level="sequence"``): the importance ratio of a sequence is the
    geometric mean of its tokens',
    :math:`s = \exp\big((L - L_{old}) / |y|\big)`, and per sequence
    :math:`-\min\big(\min(s, \delta) A,\ \mathrm{clip}(s, 1-\varepsilon_{low}, 1+\varepsilon_{high}) A\big)`
    (``delta``: the two-sided clip, as :func:`clipped_policy_gradient`). Side inputs:
    ``advantage`` per sequence, ``old_logprob`` per sequence (summed) or per token (optional:
    on-policy without it, :math:`s = 1` with the gradient of :math:`L/|y|`). One loss per
    sequence: their mean is TRL's ``loss_type="grpo"`` loss. Logs the clip fractions and
    ``ratio`` as :func:`clipped_policy_gradient`, per sequence."""
    owner = "gspo"
    check_float(owner, "clip_low", clip_low, low=0.0)
    check_float(owner, "clip_high", clip_high, low=0.0)
    if delta is not None:
        check_float(owner, "delta", delta, low=1.0 + clip_high)

    def fn(batch: SequenceBatch) -> torch.Tensor:
        if "old_logprob" in batch.side:
            old = batch.side["old_logprob"]
        elif "old_logprob" in batch.token_side:
            old = batch.sum_tokens(batch.token_side["old_logprob"])
        else:
            old = batch.logprob.detach()
        ratio = torch.exp((batch.logprob - old) / batch.length)
        advantage = batch.side["advantage"]
        log_clipping(ratio, advantage, 1.0 - clip_low, 1.0 + clip_high)
        clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        capped = ratio if delta is None else ratio.clamp(max=delta)
        return -torch.min(capped * advantage, clipped * advantage)

    return SequenceObjective(
        fn, f"gspo({clip_low}, {clip_high})", per="sequence", side=("advantage",)
    )


def token_mean(objective: Objective) -> SequenceObjective:
    r"""A token-local :class:`Objective` as a sequence objective: per sequence, the mean of
    its tokens' losses, :math:`\frac{1}{|y|}\sum_{t \in y} \ell_t`. Their mean over sequences
    is GRPO's aggregation (TRL's ``loss_type="grpo"``): ``token_mean(clipped_policy_gradient())``.
    The token objective gets the per-token side inputs and the per-sequence ones repeated
    for each token (e.g. an ``advantage`` per sequence)."""
    if not isinstance(objective, Objective):
        raise ValueError(
            f"token_mean: objective must be a token-local Objective (linear_ce.objectives), "
            f"got {type(objective).__name__}"
        )

    def fn(batch: SequenceBatch) -> torch.Tensor:
        side = {k: batch.per_token(v) for k, v in batch.side.items()}
        side.update(batch.token_side)
        return batch.mean_tokens(objective(batch.token_logprob, batch.entropy, **side))

    return SequenceObjective(
        fn, f"token_mean({objective.name})", per="sequence", needs_entropy=objective.needs_entropy
    )
