r"""The cross-entropy head: the loss of :mod:`linear_ce.rows` on the loop's tiles.

Per row, with target weights :math:`a_{ij}` and their total :math:`A_i`
(:class:`~linear_ce.rows.RowTerms`), the loop's :math:`u = s - m` and
:math:`Z = \sum_j e^{u_j}`:

.. math::

    \ell_i = A_i \log Z_i - \sum_j a_{ij} u_{ij} + \lambda\omega_i\,\mathrm{lse}_i^2,
    \qquad
    \frac{\partial \ell_i}{\partial s_{ij}} = (A_i + 2\lambda\omega_i\,\mathrm{lse}_i)\,
        \frac{e^{u_{ij}}}{Z_i} - a_{ij}.
"""

from __future__ import annotations

import torch

from linear_ce.checks.call import Call
from linear_ce.engine.chunk_loop import Gradients, run_chunks
from linear_ce.engine.head import RowStats
from linear_ce.engine.plan import Plan
from linear_ce.engine.row_chunks import RowChunk
from linear_ce.engine.vocab import LocalVocab
from linear_ce.rows import RowTerms, row_terms

__all__ = ["CrossEntropyHead", "run_cross_entropy"]


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

    def sums_before_exp(self, u: torch.Tensor, rows: RowChunk, p: int, out: torch.Tensor) -> None:
        # Σ_j a_ij u_ij: the target logit, the smoothing term, the soft target.
        terms, lin = self.terms, out[:, 0]
        if terms.target is not None:
            local_t = terms.target[rows, p] - self.start
            self.owned = (local_t >= 0) & (local_t < self.local)
            self.safe_t = torch.where(self.owned, local_t, 0)[:, None]
            torch.mul(u.gather(1, self.safe_t)[:, 0], terms.alpha[rows, p] * self.owned, out=lin)
        else:
            lin.zero_()
        if self.smoothing:
            cw = self.class_weight
            lin.addcmul_(terms.beta[rows, p], u.sum(1) if cw is None else u @ cw)
        if terms.target is None:
            q = self.call.target[rows, self.start : self.start + self.local, p].to(u.dtype)
            self.q = q if self.class_weight is None else q * self.class_weight
            lin.add_((self.q * u).sum(1), alpha=terms.gamma)

    def sums_after_exp(self, u: torch.Tensor, e: torch.Tensor, out: torch.Tensor) -> None:
        pass

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        terms = self.terms
        self.A, self.zeta = terms.A[rows, p], terms.zeta[rows, p]
        loss = self.A * stats.log_sum_exp - stats.sums[:, 0] + self.zeta * stats.lse.square()
        self.row_loss[rows, p] = loss * terms.token[rows, p]
        self.lse[rows, p] = stats.lse

    def grad_tile(
        self,
        u: torch.Tensor,
        e: torch.Tensor,
        rows: RowChunk,
        p: int,
        stats: RowStats,
        factor: float,
    ) -> torch.Tensor:
        terms = self.terms
        r = terms.scale[rows, p] * factor
        e.mul_((r * (self.A + 2.0 * self.zeta * stats.lse) / stats.sum_exp)[:, None])
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


def run_cross_entropy(
    call: Call,
    plan: Plan,
    *,
    needs: tuple[bool, bool, bool] = (False, False, False),
    grad_output: torch.Tensor | None = None,
    vocab: LocalVocab | None = None,
    num_classes: int | None = None,
) -> tuple[RowTerms, CrossEntropyHead, Gradients]:
    """The chunk loop on ``call`` with the cross-entropy head: its row coefficients, the
    head (``row_loss``, ``lse``) and the gradients asked for by ``needs`` (input, weight,
    bias). ``grad_output``, ``vocab`` and ``num_classes`` as in
    :func:`~linear_ce.rows.row_terms` and :func:`~linear_ce.engine.chunk_loop.run_chunks`."""
    vocab = vocab or LocalVocab()
    terms = row_terms(call, plan.acc_dtype, grad_output=grad_output, num_classes=num_classes)
    head = CrossEntropyHead(call, terms, vocab.start, call.linear_weight.shape[0])
    need_x, need_w, need_b = needs
    grads = run_chunks(
        call.input,
        call.linear_weight,
        call.linear_bias,
        head,
        call.transform,
        plan,
        grad_input=need_x,
        grad_weight=need_w,
        grad_bias=need_b and call.linear_bias is not None,
        vocab=vocab,
    )
    return terms, head, grads
