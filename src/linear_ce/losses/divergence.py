r"""The distillation head: a divergence between the student's and a teacher's softmax.

The loop hands over the student's :math:`u = s - m_s` (its own tile) and the
teacher's :math:`v = t - m_t` (the companion tile), both after their logits
transforms. With :math:`Z_s = \sum_j e^{u_j}`, :math:`Z_t = \sum_j e^{v_j}`,
:math:`p = e^{u}/Z_s`, :math:`q = e^{v}/Z_t` and
:math:`d = \log p - \log q = u - v - \log Z_s + \log Z_t`, per row:

.. math::

    \beta = 0:&\quad \mathrm{KL}(q\,\|\,p) = \tfrac{1}{Z_t}\textstyle\sum_j e^{v_j}(v_j - u_j)
        - \log Z_t + \log Z_s, &\quad \partial/\partial s = p - q,

    \beta = 1:&\quad \mathrm{KL}(p\,\|\,q) = \mu - \log Z_s + \log Z_t,\
        \mu = \textstyle\sum_j p_j (u_j - v_j), &\quad \partial/\partial s = p \odot (u - v - \mu),

    0<\beta<1:&\quad \beta\,\mathrm{KL}(q\,\|\,r) + (1-\beta)\,\mathrm{KL}(p\,\|\,r),\
        r = \beta q + (1-\beta) p, &\quad \partial/\partial s = (1-\beta)\,p \odot (g - B),

with :math:`g = \log p - \log r` and :math:`B = \sum_j p_j g_j` (the mixture
needs :math:`Z_s, Z_t` first: its sums are the loop's late sums). The
differences :math:`u - v - \mu` and :math:`g - B` are formed before the
product with :math:`p`, so the gradient does not cancel where they are small.
The mixture's gaps come from :math:`\delta = \log\beta q - \log(1-\beta)p` alone,
:math:`g = -\log(1-\beta) - \operatorname{softplus}(\delta)` and
:math:`\log q - \log r = -\log\beta - \operatorname{softplus}(-\delta)`, not as
differences of logs, which cancel where :math:`r` is near :math:`p` or :math:`q`.

``hard_weight`` :math:`h` adds :math:`h` times the student's cross-entropy
against the target at temperature 1: with the student's temperature
:math:`T`, :math:`\log Z_1 - T u_t` where :math:`Z_1 = \sum_j e^{T u_j}`
(:math:`= Z_s` when :math:`T = 1`), and :math:`hT(e^{Tu}/Z_1 - [j = t])` to
the gradient.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from linear_ce.engine.head import HeadFrame, RowStats, Tile
from linear_ce.engine.native_rows import PairSums
from linear_ce.engine.row_chunks import RowChunk

__all__ = ["DistillationHead", "DistillationTerms", "DivergenceHead", "spans"]

#: Bytes of one tile's block of columns in the blocked passes (all rows of the chunk): the
#: blocks a pass touches (both tiles' and a scratch block or three) stay in a core's L2
#: (2 MiB or more on the CPUs measured): wider blocks spill it, narrower ones pay the fixed
#: cost of a torch call per block.
_BLOCK_BYTES = 1 << 19
#: ... and a block is at most this share of the columns (at least ``_MIN_WIDTH``): the
#: scratch blocks are not in the chunk planner's budget, so they stay a small part of it.
_MAX_BLOCK_SHARE = 1 / 16
_MIN_WIDTH = 128


def _width(u: torch.Tensor) -> int:
    """Columns per block of the tile ``u``."""
    rows, columns = u.shape
    by_bytes = _BLOCK_BYTES // max(rows * u.element_size(), 1)
    return max(1, min(by_bytes, max(int(columns * _MAX_BLOCK_SHARE), _MIN_WIDTH)))


def spans(u: torch.Tensor) -> list[slice]:
    """Consecutive blocks of the tile ``u``'s columns (:func:`_width` each), a step of the
    blocked passes each."""
    columns, width = u.shape[1], _width(u)
    return [slice(start, min(start + width, columns)) for start in range(0, columns, width)]


@dataclasses.dataclass(frozen=True)
class DistillationTerms:
    """What a distillation loss is made of: ``beta`` (0: forward KL, 1: reverse KL,
    between: the generalised JSD), ``hard_weight`` (the weight of the student's
    cross-entropy against the target at temperature 1; 0: none), the student's
    ``temperature``, and ``row_weight`` ``(N, P)``, the upstream gradient of each row's
    loss (``None``: no gradient is formed)."""

    beta: float
    hard_weight: float
    temperature: float
    row_weight: torch.Tensor | None = None


class DistillationHead:
    """What the two distillation heads share: the divergence's mode, the hard term (its
    target logit, its normaliser at temperature 1 where ``T != 1``, its loss and its
    gradient), the named row sums, the ``loss`` ``(N, P)`` they write (zero on ignored
    rows) and the scratch blocks of their blocked passes. A head numbers its own row sums
    with :meth:`name_sums`."""

    def __init__(self, frame: HeadFrame, terms: DistillationTerms) -> None:
        self.frame, self.target, self.valid = frame, frame.target, frame.valid
        beta, temperature = terms.beta, terms.temperature
        self.beta, self.hard, self.temperature = beta, terms.hard_weight, temperature
        self.row_weight = terms.row_weight
        self.mode = "forward" if beta == 0.0 else "reverse" if beta == 1.0 else "mixed"
        self.hard_on = terms.hard_weight > 0.0
        # The hard term at temperature 1 needs its own normaliser unless T = 1.
        self.own_z1 = self.hard_on and temperature != 1.0
        self.loss = frame.zeros()
        self._scratch: torch.Tensor | None = None

    def name_sums(self, own: list[tuple[str, bool]]) -> None:
        """Number the row sums the head adds to the loop's statistics: those of ``own``
        (name, wanted) that are wanted, then the hard term's."""
        wanted = [*own, ("picked", self.hard_on), ("z_1", self.own_z1)]
        self.index = {name: i for i, name in enumerate(n for n, on in wanted if on)}
        self.extra_sums = len(self.index)

    def sum_of(self, out: torch.Tensor, name: str) -> torch.Tensor:
        """The row sum ``name``'s column of ``out``."""
        return out[:, self.index[name]]

    def scratch_blocks(self, like: torch.Tensor, count: int) -> list[torch.Tensor]:
        """``count`` ``(B, width)`` scratch blocks in ``like``'s layout (:func:`spans`)."""
        rows, width = like.shape[0], _width(like)
        have = self._scratch
        if have is None or have.shape[1:] != (rows, width) or have.shape[0] < count:
            # In the tile's own layout (class-major on CPU): a row-major scratch written
            # from class-major operands runs several times slower.
            if like.stride(0) == 1:
                have = torch.empty(
                    (count, width, rows), dtype=like.dtype, device=like.device
                ).transpose(1, 2)
            else:
                have = torch.empty((count, rows, width), dtype=like.dtype, device=like.device)
            self._scratch = have
        return [have[i, :rows] for i in range(count)]

    def pick_target(self, u: Tile, rows: RowChunk, p: int, out: torch.Tensor) -> None:
        """The hard term's :math:`u_t` into its row sum (0 where another shard has the
        target); nothing without the hard term."""
        if not self.hard_on:
            return
        self.owned_t, column = self.frame.local_columns(self.target[rows, p])
        self.safe_t = column[:, None]
        # Selected, not multiplied by the mask: a stand-in column 0 may be -inf (-inf * 0 = NaN).
        picked = torch.where(self.owned_t, u.gather(1, self.safe_t)[:, 0], 0.0)
        self.sum_of(out, "picked").copy_(picked)

    def with_hard_loss(
        self, divergence: torch.Tensor, sums: torch.Tensor, log_zs: torch.Tensor
    ) -> torch.Tensor:
        r"""``divergence`` plus the hard term's cross-entropy, :math:`h(\log Z_1 - T u_t)`
        (:math:`\log Z_1 = \log Z_s` where :math:`T = 1`)."""
        if not self.hard_on:
            return divergence
        picked = self.sum_of(sums, "picked")
        if self.own_z1:
            self.z_1 = self.sum_of(sums, "z_1")
            return divergence + self.hard * (self.z_1.log() - self.temperature * picked)
        return divergence + self.hard * (log_zs - picked)

    def add_hard_softmax(
        self,
        out: torch.Tensor,
        e: torch.Tensor,
        span: slice,
        w: torch.Tensor,
        first: torch.Tensor | None = None,
    ) -> None:
        """``out[:, span]`` (set to ``first · e`` first, when given) plus the hard term's
        ``h T e^{Tu} / Z_1`` where ``Z_1`` is the student's own normaliser at temperature 1."""
        (a,) = self.scratch_blocks(out, 1)
        part = a[:, : span.stop - span.start]
        if self.own_z1:
            torch.pow(e[:, span], self.temperature, out=part)
        if first is not None:
            torch.mul(e[:, span], first, out=out[:, span])
        if self.own_z1:
            out[:, span].addcmul_(part, (w * self.hard * self.temperature / self.z_1)[:, None])

    def add_hard_target(self, out: torch.Tensor, w: torch.Tensor) -> None:
        """The hard term's :math:`-hT` (:math:`-h` where :math:`T = 1`) at each row's target
        column, times the row's ``w``; nothing without the hard term."""
        if self.hard_on:
            onehot = -w * self.hard * (self.temperature if self.own_z1 else 1.0) * self.owned_t
            out.scatter_add_(1, self.safe_t, onehot[:, None])


class DivergenceHead(DistillationHead):
    """Writes ``loss`` ``(N, P)`` (the divergence plus ``hard_weight`` × cross-entropy,
    zero on ignored rows) and, with ``entropy``, the student's entropy ``(N, P)``."""

    #: The compiled pair loops take the head where the call allows them
    #: (:func:`~linear_ce.engine.chunk_loop.run_chunks`).
    native_pair = True

    def __init__(self, frame: HeadFrame, terms: DistillationTerms, *, entropy: bool) -> None:
        super().__init__(frame, terms)
        self.entropy_on = entropy
        self.keeps_logits = self.mode == "mixed" or entropy
        self.late_sums = 2 if self.mode == "mixed" else 0
        self.name_sums([("z_t", True), ("cross", self.mode != "mixed"), ("eu", entropy)])
        self.entropy = frame.zeros() if entropy else None

    def pair_terms(self, rows: RowChunk, p: int, factor: float | None) -> dict:
        """The arguments of :meth:`~linear_ce.engine.native_rows.NativeRows.pair_` for
        ``rows`` at ``p`` (``factor``: the gradient's, ``None``: no gradient)."""
        target = None
        if self.hard_on:
            owned, column = self.frame.local_columns(self.target[rows, p])
            target = torch.where(owned, column, -1)
        weight = None if factor is None else self.row_weight[rows, p].float() * factor
        return {
            "beta": self.beta,
            "entropy": self.entropy_on,
            "target": target,
            "hard": self.hard,
            "power": self.temperature if self.own_z1 else 0.0,
            "weight": weight,
        }

    def pair_sums(self, sums: PairSums, out: torch.Tensor) -> torch.Tensor | None:
        """The head's row sums (:meth:`name_sums`) from the pair loops' ``sums`` into ``out``;
        returns the late sums (the mixture's, as :meth:`sums_after_stats` forms them)."""
        named = {
            "z_t": sums.teacher_sum_exp,
            "cross": sums.cross,
            "eu": sums.dot,
            "picked": sums.target_u,
            "z_1": sums.z_1,
        }
        for name, column in self.index.items():
            out[:, column] = named[name]
        return torch.stack([sums.teacher_cross, sums.cross], 1) if self.late_sums else None

    def companion_tile(self, t: Tile, rows: RowChunk, p: int) -> None:
        self.t = t

    def sums_before_exp(self, u: Tile, rows: RowChunk, p: int, out: torch.Tensor) -> None:
        t = self.t
        out.zero_()
        z_t = self.sum_of(out, "z_t")
        (a,) = self.scratch_blocks(u, 1)
        for span in spans(u):
            part = a[:, : span.stop - span.start]
            t_blk, u_blk = t[:, span], u[:, span]
            if self.mode == "forward":
                # t ← e^v; Σ e^v (v − u).
                torch.sub(t_blk, u_blk, out=part)
                t_blk.exp_()
                z_t.add_(t_blk.sum(1))
                self.sum_of(out, "cross").add_(part.mul_(t_blk).sum(1))
            else:
                z_t.add_(torch.exp(t_blk, out=part).sum(1))
                if self.mode == "reverse":
                    # t ← u − v: the teacher's logits are not needed past their Z.
                    torch.sub(u_blk, t_blk, out=t_blk)
        self.pick_target(u, rows, p, out)

    def sums_after_exp(self, u: Tile, e: Tile, out: torch.Tensor) -> None:
        if not (self.mode == "reverse" or self.own_z1 or self.entropy_on):
            return
        (a,) = self.scratch_blocks(u, 1)
        for span in spans(u):
            part = a[:, : span.stop - span.start]
            e_blk = e[:, span]
            if self.mode == "reverse":
                self.sum_of(out, "cross").add_(torch.mul(e_blk, self.t[:, span], out=part).sum(1))
            if self.own_z1:
                self.sum_of(out, "z_1").add_(torch.pow(e_blk, self.temperature, out=part).sum(1))
            if self.entropy_on:
                self.sum_of(out, "eu").add_(torch.mul(e_blk, u[:, span], out=part).sum(1))

    def sums_after_stats(self, u: Tile, e: Tile, stats: RowStats, out: torch.Tensor) -> None:
        # u ← g = log p − log r and t ← log q − log r, out = (Σ e^v (log q − log r),
        # Σ e^u (log p − log r)), from δ = log(βq) − log((1−β)p) alone:
        # log p − log r = −log(1−β) − softplus(δ), log q − log r = −log β − softplus(−δ).
        # Each is formed from its own small term; log p − log r as a difference of logs
        # cancelled (the bias gradient 30 eps at β = 0.01, 5 eps at 0.1, float64).
        t, beta = self.t, self.beta
        log_zt = self.sum_of(stats.sums, "z_t").log()
        shift = (stats.log_sum_exp - log_zt + math.log(beta / (1.0 - beta)))[:, None]
        log_beta, log_rest = math.log(beta), math.log1p(-beta)
        zero = u.new_zeros(())
        out.zero_()
        a, b = self.scratch_blocks(u, 2)
        for span in spans(u):
            width = span.stop - span.start
            delta, ev = a[:, :width], b[:, :width]
            t_blk, u_blk = t[:, span], u[:, span]
            torch.sub(t_blk, u_blk, out=delta).add_(shift)
            torch.exp(t_blk, out=ev)
            torch.logaddexp(delta, zero, out=u_blk).add_(log_rest).neg_()
            torch.logaddexp(delta.neg_(), zero, out=t_blk).add_(log_beta).neg_()
            out[:, 0].add_(ev.mul_(t_blk).sum(1))
            out[:, 1].add_(torch.mul(e[:, span], u_blk, out=delta).sum(1))

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        sums = stats.sums
        z_s, log_zs = stats.sum_exp, stats.log_sum_exp
        z_t = self.sum_of(sums, "z_t")
        log_zt = z_t.log()
        self.z_t = z_t
        if self.mode == "forward":
            divergence = self.sum_of(sums, "cross") / z_t - log_zt + log_zs
        elif self.mode == "reverse":
            self.mu = self.sum_of(sums, "cross") / z_s
            divergence = self.mu - log_zs + log_zt
        else:
            self.mean_g = stats.late[:, 1] / z_s
            divergence = self.beta * stats.late[:, 0] / z_t + (1.0 - self.beta) * self.mean_g
        self.loss[rows, p] = self.with_hard_loss(divergence, sums, log_zs)
        if self.entropy_on:
            self.entropy[rows, p] = log_zs - self.sum_of(sums, "eu") / z_s

    def grad_tile(
        self, u: Tile, e: Tile, rows: RowChunk, p: int, stats: RowStats, factor: float
    ) -> Tile:
        w = self.row_weight[rows, p].to(stats.sum_exp.dtype) * factor
        z_s = stats.sum_exp
        # The hard term's softmax at temperature 1 folds into p's coefficient when T = 1.
        soft_hard = self.hard if self.hard_on and not self.own_z1 else 0.0
        if self.mode == "forward":
            out = u
            c_s = (w * (1.0 + soft_hard) / z_s)[:, None]
            c_t = (-w / self.z_t)[:, None]
            for span in spans(u):
                self.add_hard_softmax(out, e, span, w, first=c_s)
                out[:, span].addcmul_(self.t[:, span], c_t)
        else:
            if self.mode == "reverse":
                out = self.t.sub_(self.mu[:, None])
                scale = w / z_s
            else:
                out = u.sub_(self.mean_g[:, None])
                scale = w * (1.0 - self.beta) / z_s
            out.mul_(e).mul_(scale[:, None])
            if soft_hard:
                out.addcmul_(e, (w * soft_hard / z_s)[:, None])
            if self.own_z1:
                for span in spans(u):
                    self.add_hard_softmax(out, e, span, w)
        self.add_hard_target(out, w)
        return out
