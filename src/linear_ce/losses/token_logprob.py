r"""The per-token head: log-probability of the target, entropy, top-1.

Per row, with the loop's :math:`u = s - m`, :math:`e = e^{u}`,
:math:`Z = \sum_j e_j` and :math:`p = e / Z`:

.. math::

    \log p_t = u_t - \log Z, \qquad
    H = -\sum_j p_j \log p_j = \log Z - \frac{1}{Z}\sum_j e_j u_j,

    \frac{\partial \log p_t}{\partial s_j} = [j = t] - p_j, \qquad
    \frac{\partial H}{\partial s_j} = -p_j\,(u_j - \log Z + H).

With upstream gradients :math:`g` (of :math:`\log p_t`) and :math:`h` (of
:math:`H`) the logits gradient is, with :math:`\mu = \sum_j p_j u_j = \log Z - H`,

.. math::

    g\,[j = t] - \frac{g}{Z}\, e_j - \frac{h}{Z}\, e_j (u_j - \mu),

where :math:`u - \mu` is formed before the product with :math:`e`, so the
entropy gradient does not cancel where :math:`u_j \approx \mu`. ``top1`` is true where :math:`u_t = 0` and no other
class reaches the maximum (ties are false).
"""

from __future__ import annotations

import torch

from linear_ce.losses.base import RowStats
from linear_ce.row_chunks import RowChunk

__all__ = ["TokenLogprobHead"]

#: Vocabulary columns per step of the blocked row dot product (a small scratch).
_BLOCK = 2048


class TokenLogprobHead:
    """Writes ``logprob``, ``entropy`` and ``top1`` ``(N, P)`` (zero/False where ignored).

    ``grad_logprob`` / ``grad_entropy`` ``(N, P)`` are the upstream gradients
    (``None``: none flows from that output); ``entropy`` and ``top1`` say which
    outputs are computed at all.
    """

    late_sums = 0

    def __init__(
        self,
        target: torch.Tensor,
        valid: torch.Tensor,
        vocab_start: int,
        local_classes: int,
        acc_dtype: torch.dtype,
        *,
        entropy: bool,
        top1: bool,
        grad_logprob: torch.Tensor | None = None,
        grad_entropy: torch.Tensor | None = None,
    ) -> None:
        self.target, self.valid = target, valid
        self.start, self.local = vocab_start, local_classes
        self.entropy_on = entropy or grad_entropy is not None
        self.top1_on = top1
        self.grad_logprob, self.grad_entropy = grad_logprob, grad_entropy
        self.keeps_logits = self.entropy_on
        self.extra_sums = 1 + int(self.entropy_on) + 2 * int(top1)
        device = target.device
        self.logprob = torch.zeros(valid.shape, dtype=acc_dtype, device=device)
        self.entropy = (
            torch.zeros(valid.shape, dtype=acc_dtype, device=device) if self.entropy_on else None
        )
        self.top1 = torch.zeros(valid.shape, dtype=torch.bool, device=device) if top1 else None
        self._is_max: torch.Tensor | None = None
        self._block: torch.Tensor | None = None

    def _block_buffer(self, u: torch.Tensor) -> torch.Tensor:
        rows = u.shape[0]
        if self._block is None or self._block.shape[0] < rows:
            # In the tile's own layout (class-major on CPU): a row-major scratch written
            # from class-major operands runs ~8x slower.
            if u.stride(0) == 1:
                self._block = torch.empty((_BLOCK, rows), dtype=u.dtype, device=u.device).T
            else:
                self._block = torch.empty((rows, _BLOCK), dtype=u.dtype, device=u.device)
        return self._block[:rows]

    def sums_before_exp(self, u: torch.Tensor, rows: RowChunk, p: int, out: torch.Tensor) -> None:
        local_t = self.target[rows, p] - self.start
        self.owned = (local_t >= 0) & (local_t < self.local)
        self.safe_t = torch.where(self.owned, local_t, 0)[:, None]
        picked = u.gather(1, self.safe_t)[:, 0]
        torch.mul(picked, self.owned, out=out[:, 0])
        if self.top1_on:
            if self._is_max is None or self._is_max.shape[0] < u.shape[0]:
                self._is_max = torch.empty(u.shape, dtype=torch.bool, device=u.device)
            is_max = self._is_max[: u.shape[0]]
            torch.eq(u, 0.0, out=is_max)
            out[:, -2].copy_(is_max.sum(1))
            out[:, -1].copy_((picked == 0.0) & self.owned)

    def sums_after_exp(self, u: torch.Tensor, e: torch.Tensor, out: torch.Tensor) -> None:
        if self.entropy_on:
            # Σ_j e_j u_j in vocabulary blocks: u must survive for the gradient.
            dot = out[:, 1]
            dot.zero_()
            block = self._block_buffer(u)
            for start in range(0, u.shape[1], _BLOCK):
                stop = min(start + _BLOCK, u.shape[1])
                part = block[:, : stop - start]
                torch.mul(u[:, start:stop], e[:, start:stop], out=part)
                dot.add_(part.sum(1))

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        sums = stats.sums
        self.logprob[rows, p] = sums[:, 0] - stats.log_sum_exp
        if self.entropy_on:
            self.row_mean_u = sums[:, 1] / stats.sum_exp
            self.entropy[rows, p] = stats.log_sum_exp - self.row_mean_u
        if self.top1_on:
            self.top1[rows, p] = (sums[:, -1] > 0) & (sums[:, -2] == 1)

    def grad_tile(
        self,
        u: torch.Tensor,
        e: torch.Tensor,
        rows: RowChunk,
        p: int,
        stats: RowStats,
        factor: float,
    ) -> torch.Tensor:
        z = stats.sum_exp
        g, h = self.upstream(rows, p)
        g = torch.zeros_like(z) if g is None else g.to(z.dtype) * factor
        if h is None:
            out = e.mul_((-g / z)[:, None])
        else:
            h = h.to(z.dtype) * factor
            out = u.sub_(self.row_mean_u[:, None]).mul_(e).mul_((-h / z)[:, None])
            out.addcmul_(e, (-g / z)[:, None])
        out.scatter_add_(1, self.safe_t, (g * self.owned)[:, None])
        return out

    def upstream(self, rows: RowChunk, p: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The chunk's upstream gradients of logprob and entropy (``None``: none flows)."""
        return (
            None if self.grad_logprob is None else self.grad_logprob[rows, p],
            None if self.grad_entropy is None else self.grad_entropy[rows, p],
        )
