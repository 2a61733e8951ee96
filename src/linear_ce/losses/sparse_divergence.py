r"""The sparse distillation head: a divergence against a stored teacher's top-k.

Per row the teacher is ``k`` slots of (token id, log-probability); the support
:math:`K` is its non-empty slots. It is prepared once per call
(:func:`sparse_teacher`) as a distribution over :math:`K` and one more outcome,
the *rest* (every other class): probabilities :math:`q_j` on :math:`K` and
:math:`r_t` on the rest, with :math:`r_t = 0` when the teacher is renormalised
over its :math:`k` classes, :math:`r_t = 1 - \sum_K q` when its residual is kept.
The student is the same partition of its softmax: :math:`p_j = e^{u_j}/Z` on
:math:`K` (:math:`u = s - m`, the loop's tile) and :math:`r_s = R/Z` with
:math:`R = \sum_{i \notin K} e^{u_i}` summed over the complement itself (not
:math:`Z - \sum_K e^u`, which cancels where the student puts little mass
outside :math:`K`). Over these :math:`k + 1` outcomes (:math:`\mathcal{O}`):

.. math::

    \beta = 0:&\quad \textstyle\sum_{o} Q_o (\log Q_o - \log P_o),
        &\quad \partial/\partial s_i = \Sigma_Q\,p_i - Q_{o(i)}\,p_i / P_{o(i)},

    \beta = 1:&\quad D = \textstyle\sum_{o} P_o d_o,\ d_o = \log P_o - \log Q_o,
        &\quad \partial/\partial s_i = p_i (d_{o(i)} - D),

    0<\beta<1:&\quad \beta \textstyle\sum_o Q_o h_o + (1-\beta) B,\
        B = \textstyle\sum_o P_o g_o,
        &\quad \partial/\partial s_i = (1-\beta)\,p_i (g_{o(i)} - B),

with :math:`Q = (q, r_t)`, :math:`P = (p_K, r_s)`, :math:`\Sigma_Q = \sum_o Q_o`,
:math:`o(i)` the outcome of class :math:`i` (itself on :math:`K`, the rest
elsewhere), :math:`M = \beta Q + (1-\beta) P`, :math:`g = \log P - \log M` and
:math:`h = \log Q - \log M`. With :math:`r_t = 0` the rest's terms are those of
the dense divergence against a teacher that is zero outside :math:`K`
(:math:`g_\text{rest} = -\log(1-\beta)`), so the renormalised teacher's
forward KL and JSD are exact over the whole vocabulary.

Each class's gradient is a row coefficient times :math:`e^{u_i}` outside
:math:`K` and a per-slot value on :math:`K`: where :math:`R` is needed, the
tile's :math:`K` entries are zeroed in ``sums_after_exp`` (their sum is then
:math:`R`), and ``grad_tile`` scales the tile by the coefficient and adds the
per-slot values at :math:`K` (a ``(B, k)`` scatter). Every per-slot quantity
needs :math:`\log Z`, so the slot sums are late sums (a second, ``(B, 1–2)``
combination over vocabulary shards). Slots outside this shard's classes are
masked (``torch.where``: a masked slot's arithmetic may be non-finite).

``hard_weight`` :math:`h` adds :math:`h` times the student's cross-entropy at
temperature 1, as :class:`linear_ce.losses.divergence.DivergenceHead`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from linear_ce.engine.head import HeadFrame, RowStats, Tile
from linear_ce.engine.row_chunks import RowChunk
from linear_ce.losses.divergence import DistillationHead, DistillationTerms, spans

__all__ = ["SparseDivergenceHead", "SparseTeacher", "sparse_teacher"]


@dataclasses.dataclass(frozen=True)
class SparseTeacher:
    """A prepared sparse teacher, ``(N, k)`` per slot and ``(N,)`` per row, in the
    accumulation dtype: ``ids`` (int64, ``-1`` in empty slots), ``log_q`` (``-inf`` in
    empty slots), ``q``, the rest's ``r_t`` and ``total`` :math:`\\sum_K q + r_t`; ``rest``
    says whether the residual is kept (``False``: ``r_t`` is zero)."""

    ids: torch.Tensor
    log_q: torch.Tensor
    q: torch.Tensor
    r_t: torch.Tensor
    total: torch.Tensor
    rest: bool


def sparse_teacher(
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    num_classes: int,
    acc: torch.dtype,
    *,
    rest: bool,
    scale: float,
) -> SparseTeacher:
    r"""The teacher of ``ids``, ``logprobs`` ``(N, k)`` (a slot is empty where its id is
    ``-1`` or its log-probability ``-inf``) over ``num_classes`` classes.

    ``rest=False``: :math:`\log q = \mathrm{log\_softmax}_K(\ell \cdot \mathrm{scale})`
    (``scale`` is the stored temperature over the loss's), :math:`r_t = 0`.
    ``rest=True``: :math:`\log q = \ell`, :math:`r_t = 1 - \sum_K e^{\ell}`; where that
    sum rounds above 1, or the support is the whole vocabulary (nothing is outside it,
    so the residual is rounding), the :math:`q` are scaled to sum to 1 and
    :math:`r_t = 0`."""
    lp = logprobs.to(acc)
    empty = (ids == -1) | (lp == -math.inf)
    lp = lp.masked_fill(empty, -math.inf)
    if rest:
        log_total = torch.logsumexp(lp, dim=-1)
        full = (~empty).sum(-1) == num_classes
        excess = torch.where(full, log_total, log_total.clamp(min=0.0))
        # No valid slot: log_total = -inf, excess 0, r_t = 1.
        excess = torch.where(excess.isinf(), 0.0, excess)
        log_q = lp - excess[:, None]
        r_t = torch.where(full, 0.0, -torch.expm1(log_total.clamp(max=0.0)))
    else:
        if scale != 1.0:
            lp = lp * scale
        log_q = torch.log_softmax(lp, dim=-1).masked_fill(empty, -math.inf)
        r_t = torch.zeros(lp.shape[:-1], dtype=acc, device=lp.device)
    q = log_q.exp()
    return SparseTeacher(
        ids=ids.long().masked_fill(empty, -1),
        log_q=log_q,
        q=q,
        r_t=r_t,
        total=q.sum(-1) + r_t,
        rest=rest,
    )


class SparseDivergenceHead(DistillationHead):
    """Writes ``loss`` ``(N, P)`` (the divergence plus ``hard_weight`` × cross-entropy,
    zero on ignored rows), the divergence against ``teacher``."""

    keeps_logits = False

    def __init__(self, teacher: SparseTeacher, frame: HeadFrame, terms: DistillationTerms) -> None:
        super().__init__(frame, terms)
        self.teacher = teacher
        # R (and the zeroed support) is needed unless the rest's terms vanish: forward
        # KL against a teacher without residual.
        self.zeroes_support = teacher.rest or self.mode != "forward"
        self.name_sums([("rest", self.zeroes_support)])
        self.late_sums = 2 if self.mode == "mixed" else 1

    def sums_before_exp(self, u: Tile, rows: RowChunk, p: int, out: torch.Tensor) -> None:
        self.rows = rows
        self.owned, self.safe = self.frame.local_columns(self.teacher.ids[rows])
        self.u_k = u.gather(1, self.safe)
        self.pick_target(u, rows, p, out)

    def sums_after_exp(self, u: Tile, e: Tile, out: torch.Tensor) -> None:
        if self.own_z1:
            z_1 = self.sum_of(out, "z_1").zero_()
            (block,) = self.scratch_blocks(e, 1)
            for span in spans(e):
                part = block[:, : span.stop - span.start]
                z_1.add_(torch.pow(e[:, span], self.temperature, out=part).sum(1))
        if self.zeroes_support:
            # x + (-x) is exactly 0, and a masked slot adds 0 to the class it points at.
            e_k = e.gather(1, self.safe)
            e.scatter_add_(1, self.safe, torch.where(self.owned, -e_k, 0.0))
            torch.sum(e, dim=1, out=self.sum_of(out, "rest"))

    def sums_after_stats(self, u: Tile, e: Tile, stats: RowStats, out: torch.Tensor) -> None:
        teacher, rows, owned = self.teacher, self.rows, self.owned
        log_q, q = teacher.log_q[rows], teacher.q[rows]
        log_p = self.u_k - stats.log_sum_exp[:, None]
        self.p_k = log_p.exp()
        if self.mode == "forward":
            out[:, 0] = torch.where(owned, q * (log_q - log_p), 0.0).sum(1)
        elif self.mode == "reverse":
            self.d_k = log_p - log_q
            out[:, 0] = torch.where(owned, self.p_k * self.d_k, 0.0).sum(1)
        else:
            beta = self.beta
            log_m = torch.logaddexp(log_q + math.log(beta), log_p + math.log1p(-beta))
            self.g_k = log_p - log_m
            out[:, 0] = torch.where(owned, q * (log_q - log_m), 0.0).sum(1)
            out[:, 1] = torch.where(owned, self.p_k * self.g_k, 0.0).sum(1)

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        teacher, late = self.teacher, stats.late
        z, log_z = stats.sum_exp, stats.log_sum_exp
        r_t = teacher.r_t[rows]
        self.r_t, self.total = r_t, teacher.total[rows]
        if self.zeroes_support:
            rest = self.sum_of(stats.sums, "rest")
            self.rest, self.has_rest = rest, rest > 0
            log_rs = rest.log() - log_z
            r_s = rest / z
        if self.mode == "forward":
            divergence = late[:, 0]
            if teacher.rest:
                divergence = divergence + torch.where(r_t > 0, r_t * (r_t.log() - log_rs), 0.0)
        elif self.mode == "reverse":
            self.d_rest = log_rs - r_t.log()
            divergence = late[:, 0] + torch.where(self.has_rest, r_s * self.d_rest, 0.0)
            self.mean_d = divergence
        else:
            beta = self.beta
            log_mr = torch.logaddexp(r_t.log() + math.log(beta), log_rs + math.log1p(-beta))
            self.g_rest = log_rs - log_mr
            self.mean_g = late[:, 1] + torch.where(self.has_rest, r_s * self.g_rest, 0.0)
            teacher_side = late[:, 0] + torch.where(r_t > 0, r_t * (r_t.log() - log_mr), 0.0)
            divergence = beta * teacher_side + (1.0 - beta) * self.mean_g
        self.loss[rows, p] = self.with_hard_loss(divergence, stats.sums, log_z)

    def grad_tile(
        self, u: Tile, e: Tile, rows: RowChunk, p: int, stats: RowStats, factor: float
    ) -> Tile:
        w = self.row_weight[rows, p].to(stats.sum_exp.dtype) * factor
        z = stats.sum_exp
        p_k, q = self.p_k, self.teacher.q[rows]
        # Outside K: coefficient · e^u; on K: the slot's own value (the tile is zero there
        # when zeroes_support, else it holds coefficient · e^u already).
        if self.mode == "forward":
            total = self.total
            if self.zeroes_support:
                outside = total / z - torch.where(self.has_rest, self.r_t / self.rest, 0.0)
                slot = total[:, None] * p_k - q
            else:
                outside, slot = total / z, -q
        elif self.mode == "reverse":
            mean_d = self.mean_d[:, None]
            outside = torch.where(self.has_rest, (self.d_rest - self.mean_d) / z, 0.0)
            slot = p_k * (self.d_k - mean_d)
        else:
            rest_share = 1.0 - self.beta
            outside = torch.where(self.has_rest, rest_share * (self.g_rest - self.mean_g) / z, 0.0)
            slot = rest_share * p_k * (self.g_k - self.mean_g[:, None])
        if self.hard_on and not self.own_z1:
            outside = outside + self.hard / z
            if self.zeroes_support:
                slot = slot + self.hard * p_k
        outside = outside * w
        if self.own_z1:
            # The hard term's softmax at temperature 1, e^{Tu} / Z_1, next to the scaling.
            for span in spans(e):
                self.add_hard_softmax(e, e, span, w, first=outside[:, None])
            if self.zeroes_support:
                log_z1 = self.z_1.log()[:, None]
                slot = slot + self.hard * self.temperature * torch.exp(
                    self.temperature * self.u_k - log_z1
                )
        else:
            e.mul_(outside[:, None])
        e.scatter_add_(1, self.safe, torch.where(self.owned, slot * w[:, None], 0.0))
        self.add_hard_target(e, w)
        return e
