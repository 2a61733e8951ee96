r"""The cross-entropy head, and the per-row coefficients of its loss: the one place that
knows what each feature means.

For row :math:`i` with (softcapped) logits :math:`s_i`, softmax :math:`p_i`
and :math:`\mathrm{lse}_i = \log\sum_j e^{s_{ij}}`, every supported loss is

.. math::

    \ell_i = \sum_j a_{ij}\,(\mathrm{lse}_i - s_{ij}) + \lambda\,\omega_i\,\mathrm{lse}_i^2,
    \qquad
    \frac{\partial \ell_i}{\partial s_{ij}}
        = (A_i + 2\lambda\,\omega_i\,\mathrm{lse}_i)\,p_{ij} - a_{ij},
    \qquad A_i = \sum_j a_{ij},

with target weights :math:`a_{ij} = \alpha_i\,[j = t_i] + \beta_i\,w_j + \gamma_i\,w_j\,q_{ij}`:

- class-index target :math:`t_i`: :math:`\alpha_i = (1-\varepsilon)\,w_{t_i}`,
  :math:`\beta_i = \varepsilon / C`, :math:`\gamma_i = 0`, row weight
  :math:`\omega_i = w_{t_i}`; all zero on ignored rows;
- probability target :math:`q_i`: :math:`\alpha_i = 0`, :math:`\beta_i = \varepsilon/C`,
  :math:`\gamma_i = 1 - \varepsilon`, :math:`\omega_i = 1`,

where :math:`w` are the class weights (ones if none), :math:`\varepsilon` the
label smoothing and :math:`\lambda` the z-loss. This is exactly torch's
``cross_entropy`` with ``weight`` and ``label_smoothing`` (plus the z-loss).
The result is :math:`\sum_i \tau_i \ell_i` scaled by :math:`1/\sum_i\omega_i`
for ``"mean"`` (:math:`1/N` for probability targets), where :math:`\tau` is
the token weight; the gradient of row :math:`i` is scaled by
:math:`r_i = \tau_i` (times the upstream gradient for ``"none"``), and every
gradient by the normaliser of ``"mean"``, which the loop applies to its fp32 sums
(``RowTerms.grad_scale``): folded into a half gradient tile, a mean's
:math:`1/\sum_i\omega_i` pushes its entries towards the half dtype's subnormals.

A returned :math:`\mathrm{lse}` carries its gradient, :math:`\partial\,\mathrm{lse}_i /
\partial s_{ij} = p_{ij}`: its upstream gradient :math:`g_i` (known in backward only) adds
to the coefficient of the softmax, :math:`(r_i(A_i + 2\lambda\omega_i\,\mathrm{lse}_i) + g_i)
\,p_{ij} - r_i a_{ij}`, in the same pass as the loss's gradient. An ignored row's lse is the
constant zero, so its :math:`g_i` has nothing to reach.

The head (:class:`CrossEntropyHead`) computes it on the loop's tiles: per row, with
the coefficients of :class:`RowTerms`, the loop's :math:`u = s - m` and
:math:`Z = \sum_j e^{u_j}`:

.. math::

    \ell_i = A_i \log Z_i - \sum_j a_{ij} u_{ij} + \lambda\omega_i\,\mathrm{lse}_i^2,
    \qquad
    \frac{\partial \ell_i}{\partial s_{ij}} = (A_i + 2\lambda\omega_i\,\mathrm{lse}_i)\,
        \frac{e^{u_{ij}}}{Z_i} - a_{ij}.
"""

from __future__ import annotations

import dataclasses

import torch

from linear_ce.checks.call import Call
from linear_ce.engine.head import RowStats, Tile
from linear_ce.engine.row_chunks import RowChunk

__all__ = [
    "CrossEntropyHead",
    "RowTerms",
    "loss_upstream",
    "mean_denominator",
    "row_terms",
    "row_weights",
]


@dataclasses.dataclass(frozen=True)
class RowTerms:
    """Per-row coefficients, each ``(N, P)`` in the accumulation dtype (see module doc).

    ``target`` holds class indices made safe to index with (ignored rows point
    at class 0); ``valid`` is False on ignored rows. ``A`` is the total target
    weight :math:`A_i`; ``zeta`` is :math:`\\lambda\\,\\omega_i`; ``scale`` is
    :math:`r_i`; ``token`` is :math:`\\tau_i`; ``normaliser`` the scalar that
    turns the sum into the requested reduction; ``grad_scale`` the factor of every
    gradient the loop applies to its sums (the normaliser of a ``"mean"`` forward, zero
    where no row counts; ``None``: one); ``lse_grad`` the upstream gradient :math:`g_i` of
    each row's returned lse (backward only; ``None``: none).
    """

    target: torch.Tensor | None
    valid: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    gamma: float
    A: torch.Tensor
    zeta: torch.Tensor
    token: torch.Tensor
    scale: torch.Tensor
    normaliser: torch.Tensor
    class_weight: torch.Tensor | None
    grad_scale: torch.Tensor | None = None
    lse_grad: torch.Tensor | None = None

    def z_rows(self, lse: torch.Tensor) -> torch.Tensor:
        """The z-loss term of each row, :math:`\\tau_i\\,\\lambda\\,\\omega_i\\,\\mathrm{lse}_i^2`."""
        return self.zeta * self.token * lse.square()

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        """The ``"mean"``/``"sum"`` reduction of per-row values: their sum times ``normaliser``."""
        return rows.sum() * self.normaliser


#: Elements of a probability target upcast at a time: the row sums need a
#: bounded scratch, not an acc-dtype copy of the whole ``(N, C)`` target.
_TARGET_BLOCK_ELEMENTS = 1 << 22


def _weighted_target_sum(
    target: torch.Tensor, class_weight: torch.Tensor | None, acc_dtype: torch.dtype
) -> torch.Tensor:
    """:math:`\\sum_c w_c q_{icp}` of an ``(N, C, P)`` target, ``(N, P)`` in ``acc_dtype``."""
    rows, classes, positions = target.shape
    block = max(1, _TARGET_BLOCK_ELEMENTS // max(classes * positions, 1))
    out = torch.empty((rows, positions), dtype=acc_dtype, device=target.device)
    for start in range(0, rows, block):
        q = target[start : start + block].to(acc_dtype)
        out[start : start + block] = (
            q.sum(1) if class_weight is None else torch.einsum("ncp,c->np", q, class_weight)
        )
    return out


def row_weights(
    call: Call, acc_dtype: torch.dtype, class_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """The row weights :math:`\\omega` ``(N, P)`` in ``acc_dtype``: the class weight of the
    target (one without class weights), zero on ignored rows; one per row for probability
    targets. ``class_weight`` is ``call.class_weight`` already in ``acc_dtype``, if at hand."""
    rows, positions = call.input.shape[0], call.linear_weight.shape[1]
    if call.probability_target:
        return torch.ones((rows, positions), dtype=acc_dtype, device=call.input.device)
    if class_weight is None and call.class_weight is not None:
        class_weight = call.class_weight.to(acc_dtype)
    valid = call.target != call.ignore_index
    omega = valid.to(acc_dtype)
    if class_weight is not None:
        omega = omega * class_weight[torch.where(valid, call.target, 0).long()]
    return omega


def mean_denominator(call: Call, acc_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """:math:`\\sum_i \\omega_i`, what ``reduction="mean"`` divides the summed loss by."""
    return row_weights(call, acc_dtype).sum()


def loss_upstream(
    call: Call, acc_dtype: torch.dtype, grad_loss: torch.Tensor | None
) -> torch.Tensor:
    """The upstream gradient of each row's loss ``(N, P)`` in ``acc_dtype``, from the
    upstream gradient ``grad_loss`` of the call's loss: itself for ``"none"``; for
    ``"mean"``/``"sum"`` the scalar times the reduction's normaliser (one, or
    :math:`1/\\sum_i\\omega_i`, zero where no row counts, as torch's gradients are);
    zero where ``grad_loss`` is ``None`` (only the lse has an upstream gradient)."""
    rows, positions = call.input.shape[0], call.linear_weight.shape[1]
    if grad_loss is None:
        return torch.zeros((rows, positions), dtype=acc_dtype, device=call.input.device)
    grad = grad_loss.to(acc_dtype)
    if call.reduction == "none":
        return grad.reshape(rows, positions)
    if call.reduction == "mean":
        total = mean_denominator(call, acc_dtype)
        grad = torch.where(total == 0, 0.0, grad / total)
    return grad.expand(rows, positions)


def row_terms(
    call: Call,
    acc_dtype: torch.dtype,
    grad_output: torch.Tensor | None = None,
    num_classes: int | None = None,
    grad_lse: torch.Tensor | None = None,
) -> RowTerms:
    """Coefficients of every row of ``call`` in ``acc_dtype``.

    ``grad_output`` (backward only) is the upstream ``(N, P)`` gradient of the rows'
    losses (:func:`loss_upstream`); it replaces the reduction's normaliser in ``scale``.
    ``grad_lse`` (backward only, with ``grad_output``) is the upstream ``(N, P)`` gradient
    of the returned lse.
    ``num_classes`` is the whole vocabulary's ``C`` when ``call.linear_weight``
    is a vocab-parallel shard (:mod:`linear_ce.distributed`); ``None`` means
    the weight's own first dimension.
    """
    rows, positions = call.input.shape[0], call.linear_weight.shape[1]
    if num_classes is None:
        num_classes = call.linear_weight.shape[0]
    device = call.input.device
    eps = call.label_smoothing
    class_weight = None if call.class_weight is None else call.class_weight.to(acc_dtype)
    weight_total = float(num_classes) if class_weight is None else class_weight.sum()

    omega = row_weights(call, acc_dtype, class_weight)
    if call.probability_target:
        target = None
        valid = torch.ones((rows, positions), dtype=torch.bool, device=device)
        alpha = torch.zeros_like(omega)
        weighted_q = _weighted_target_sum(call.target, class_weight, acc_dtype)
        A = (1.0 - eps) * weighted_q + (eps / num_classes) * weight_total
        beta, gamma = torch.full_like(omega, eps / num_classes), 1.0 - eps
    else:
        valid = call.target != call.ignore_index
        target = torch.where(valid, call.target, 0).long()
        alpha = (1.0 - eps) * omega
        A = alpha + (eps / num_classes) * weight_total * valid.to(acc_dtype)
        beta, gamma = (eps / num_classes) * valid.to(acc_dtype), 0.0

    token = (
        torch.ones((rows, positions), dtype=acc_dtype, device=device)
        if call.token_weight is None
        else call.token_weight.to(acc_dtype)
    )
    if call.reduction == "mean":
        total = omega.sum()
        normaliser = torch.where(total == 0, torch.nan, 1.0 / total)
    else:
        normaliser = torch.ones((), dtype=acc_dtype, device=device)
    grad_scale = None
    if grad_output is not None:
        scale = token * grad_output.to(acc_dtype).reshape(rows, positions)
    else:
        # Ignored rows get exactly zero gradient.
        scale = torch.where(valid, token, 0.0)
        if call.reduction == "mean":
            # Zero, not NaN, where every row is ignored: torch returns zero gradients.
            grad_scale = torch.where(total == 0, 0.0, normaliser)
    return RowTerms(
        target=target,
        valid=valid,
        alpha=alpha,
        beta=beta,
        gamma=gamma,
        A=A,
        zeta=call.z_loss * omega,
        token=token,
        scale=scale,
        normaliser=normaliser,
        class_weight=class_weight,
        grad_scale=grad_scale,
        # Read on the rows the loop visits only: an ignored row's entry is never used.
        lse_grad=None if grad_lse is None else grad_lse.to(acc_dtype).reshape(rows, positions),
    )


class CrossEntropyHead:
    """Writes ``row_loss`` :math:`\\tau_i \\ell_i` and ``lse`` ``(N, P)`` (zero on ignored rows)."""

    extra_sums = 1
    keeps_logits = False
    late_sums = 0

    def __init__(self, call: Call, terms: RowTerms, vocab_start: int, local_classes: int) -> None:
        self.call, self.terms = call, terms
        self.start, self.local = vocab_start, local_classes
        self.valid = terms.valid
        self.smoothing = call.label_smoothing > 0.0
        cw = terms.class_weight
        self.class_weight = None if cw is None else cw[vocab_start : vocab_start + local_classes]
        shape, acc = terms.valid.shape, terms.A.dtype
        self.row_loss = torch.zeros(shape, dtype=acc, device=terms.A.device)
        self.lse = torch.zeros(shape, dtype=acc, device=terms.A.device)
        # The compiled row loops form u_t, not the smoothing term's Σu or a soft target's Σqu.
        self.native = terms.target is not None and not self.smoothing
        #: Its fp32 tiles take the loops too (see chunk_loop._native_rows).
        self.native_fp32 = self.native

    def sums_before_exp(self, u: Tile, rows: RowChunk, p: int, out: torch.Tensor) -> None:
        # Σ_j a_ij u_ij: the target logit, the smoothing term, the soft target.
        terms, lin = self.terms, out[:, 0]
        if terms.target is not None:
            local_t = terms.target[rows, p] - self.start
            self.owned = (local_t >= 0) & (local_t < self.local)
            self.safe_t = torch.where(self.owned, local_t, 0)[:, None]
            # Selected, not multiplied by the mask: the stand-in column 0 of a row whose
            # target another shard holds may be -inf (a masked class), and -inf * 0 is NaN.
            picked = torch.where(self.owned, u.gather(1, self.safe_t)[:, 0], 0.0)
            torch.mul(picked, terms.alpha[rows, p], out=lin)
        else:
            lin.zero_()
        if self.smoothing:
            cw = self.class_weight
            lin.addcmul_(terms.beta[rows, p], u.sum(1) if cw is None else u @ cw)
        if terms.target is None:
            q = self.call.target[rows, self.start : self.start + self.local, p].to(u.dtype)
            self.q = q if self.class_weight is None else q * self.class_weight
            lin.add_((self.q * u).sum(1), alpha=terms.gamma)

    def sums_after_exp(self, u: Tile, e: Tile, out: torch.Tensor) -> None:
        pass

    def native_targets(self, rows: RowChunk, p: int) -> tuple[torch.Tensor, bool]:
        local_t = self.terms.target[rows, p] - self.start
        self.owned = (local_t >= 0) & (local_t < self.local)
        self.alpha_rows = self.terms.alpha[rows, p]
        return torch.where(self.owned, local_t, -1), False

    def native_sums(
        self, target_u: torch.Tensor, dot: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        torch.mul(target_u, self.alpha_rows, out=out[:, 0])

    def native_fused(
        self, rows: RowChunk, p: int, factor: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(c0, c1, gamma)`` of the gradient :math:`a = (c_0 + c_1\\,\\mathrm{lse}) / Z`
        (known before the row statistics: the loops write the gradient in the same visit, so
        this head needs no ``native_grad``), after ``native_targets``."""
        terms = self.terms
        r = factor * terms.scale[rows, p]
        c1 = 2.0 * r * terms.zeta[rows, p]
        c0 = r * terms.A[rows, p]
        if terms.lse_grad is not None:
            c0 = c0 + factor * terms.lse_grad[rows, p]
        return c0, c1, -(r * self.alpha_rows) * self.owned

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        terms = self.terms
        self.A, self.zeta = terms.A[rows, p], terms.zeta[rows, p]
        loss = self.A * stats.log_sum_exp - stats.sums[:, 0] + self.zeta * stats.lse.square()
        self.row_loss[rows, p] = loss * terms.token[rows, p]
        self.lse[rows, p] = stats.lse

    def grad_tile(
        self, u: Tile, e: Tile, rows: RowChunk, p: int, stats: RowStats, factor: float
    ) -> Tile:
        terms = self.terms
        r = terms.scale[rows, p] * factor
        softmax = r * (self.A + 2.0 * self.zeta * stats.lse)
        if terms.lse_grad is not None:
            softmax = softmax + factor * terms.lse_grad[rows, p]
        e.mul_((softmax / stats.sum_exp)[:, None])
        if terms.target is not None:
            e.scatter_add_(1, self.safe_t, (-(r * terms.alpha[rows, p]) * self.owned)[:, None])
        else:
            e.addcmul_(self.q, (r * terms.gamma)[:, None], value=-1.0)
        if self.smoothing:
            beta = terms.beta[rows, p]
            if self.class_weight is None:
                e.sub_((r * beta)[:, None])
            else:
                e.addr_(r * beta, self.class_weight, alpha=-1.0)
        return e
