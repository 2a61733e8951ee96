r"""The per-token head: log-probability of the target, entropy, top-1 and two more
statistics of each next-token distribution.

Per row, with the loop's :math:`u = s - m`, :math:`e = e^{u}`,
:math:`Z = \sum_j e_j` and :math:`p = e / Z`:

.. math::

    \log p_t = u_t - \log Z, \qquad
    H = -\sum_j p_j \log p_j = \log Z - \frac{1}{Z}\sum_j e_j u_j,

    \log \sum_j p_j^2 = \log \sum_j e_j^2 - 2 \log Z, \qquad
    \bar s = \frac{1}{V} \sum_j s_j = m + \frac{1}{V} \sum_j u_j,

    \frac{\partial \log p_t}{\partial s_j} = [j = t] - p_j, \qquad
    \frac{\partial H}{\partial s_j} = -p_j\,(u_j - \log Z + H).

With upstream gradients :math:`g` (of :math:`\log p_t`) and :math:`h` (of
:math:`H`) the logits gradient is, with :math:`\mu = \sum_j p_j u_j = \log Z - H`,

.. math::

    g\,[j = t] - \frac{g}{Z}\, e_j - \frac{h}{Z}\, e_j (u_j - \mu),

where :math:`u - \mu` is formed before the product with :math:`e`, so the
entropy gradient does not cancel where :math:`u_j \approx \mu`. The sum of squared
probabilities and the mean logit are statistics without a gradient.

``top1`` says whether the target is the argmax; the maximum is where :math:`u = 0`
exactly, or, where the row maximum is infinite, where :math:`u` is NaN
(:math:`\infty - \infty`: a logit equal to the maximum; every other one gives
:math:`u = -\infty`), so a class at the maximum is one with :math:`u \not< 0`. A
row whose maximum is NaN (a NaN logit) has no class at its maximum: ``top1`` is
false there. Two rules for ties: ``"unique"`` (the target is the only class at the
maximum; any tie is false) and ``"argmax"`` (the target is ``torch.argmax``'s pick,
the first class at the maximum: a tie with a later class counts, one with an
earlier class does not). Both are row sums over the vocabulary, so they hold
across vocabulary shards: the number of classes at the maximum, and whether a
class before the target reaches it.

``topk`` keeps each row's ``k`` largest :math:`u` (one ``torch.topk`` of the tile
per chunk, before the exponential overwrites it) and their class ids; once
:math:`\log Z` is known they become :math:`\log p = u - \log Z`. On a shard these
are the shard's candidates (ids of the whole vocabulary, ``-inf`` / ``-1`` where
the shard holds fewer than ``k`` classes), merged over the shards after the loop
(:meth:`linear_ce.engine.vocab.Vocab.merge_topk`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from linear_ce.engine.head import HeadFrame, NativeGrad, RowStats, Tile
from linear_ce.engine.native_rows import NativeRows, native_rows
from linear_ce.engine.row_chunks import RowChunk

__all__ = ["TokenLogprobGradient", "TokenLogprobHead", "TokenOutputs"]

#: Vocabulary columns per step of the blocked row dot products (a small scratch).
_BLOCK = 2048
#: Elements of one cache-sized piece of a tile that the vocabulary pass's gradient works
#: through at once (256 KiB in fp32: its exponential and the tile's piece stay in L2).
_PIECE_ELEMENTS = 1 << 16


@dataclasses.dataclass(frozen=True)
class TokenOutputs:
    """Which optional per-token outputs a call computes besides ``logprob`` (a group of
    the op's arguments: a new output is one field here, not one argument per op).
    ``top1_rule`` is one of :data:`linear_ce.checks.call.TOP1_RULES`."""

    entropy: bool = False
    top1: bool = False
    top1_rule: str = "unique"
    log_sum_sq_prob: bool = False
    mean_logit: bool = False
    #: The number of largest log-probabilities (and their ids) per row; 0: none.
    topk: int = 0


class TokenLogprobHead:
    """Writes ``logprob`` and the ``outputs`` asked for, each ``(N, P)`` (zero/False
    where ignored): ``entropy``, ``top1``, ``log_sum_sq_prob``, ``mean_logit``; and
    ``topk_logprobs`` / ``topk_ids`` ``(N, P, k)`` (``-inf`` / ``-1`` where ignored, and
    in the slots beyond a shard's classes).

    ``grad_logprob`` / ``grad_entropy`` ``(N, P)`` are the upstream gradients
    (``None``: none flows from that output). ``num_classes`` is the full vocabulary
    (the mean logit's divisor; ``local_classes`` when the vocabulary is not sharded).
    """

    late_sums = 0
    #: fp32 tiles keep torch's row math (see chunk_loop._native_rows): log-probabilities
    #: the same bits with and without ``top1``/``topk``, which the loops do not form.
    native_fp32 = False

    def __init__(
        self,
        frame: HeadFrame,
        *,
        outputs: TokenOutputs,
        num_classes: int | None = None,
        grad_logprob: torch.Tensor | None = None,
        grad_entropy: torch.Tensor | None = None,
    ) -> None:
        target, valid, acc_dtype = frame.target, frame.valid, frame.acc_dtype
        self.target, self.valid = target, valid
        self.start, self.local = frame.vocab_start, frame.local_classes
        self.num_classes = frame.local_classes if num_classes is None else num_classes
        self.entropy_on = outputs.entropy or grad_entropy is not None
        self.top1_on = outputs.top1
        self.top1_rule = outputs.top1_rule
        self.sq_on, self.mean_on = outputs.log_sum_sq_prob, outputs.mean_logit
        self.grad_logprob, self.grad_entropy = grad_logprob, grad_entropy
        self.keeps_logits = self.entropy_on
        # Column of each row sum in the loop's statistics (after its sum of e).
        wanted = [
            ("target", True),
            ("dot", self.entropy_on),
            ("sq", self.sq_on),
            ("sum_u", self.mean_on),
            ("target_is_max", self.top1_on),
            ("ties", self.top1_on),
        ]
        self.slot = {name: i for i, name in enumerate(n for n, on in wanted if on)}
        self.extra_sums = len(self.slot)

        def zeros(on: bool, dtype: torch.dtype = acc_dtype) -> torch.Tensor | None:
            return torch.zeros(valid.shape, dtype=dtype, device=target.device) if on else None

        self.logprob = zeros(True)
        #: Per row: the row max m, log Z and μ (zero without entropy): what the
        #: vocabulary pass's gradient (TokenLogprobGradient) needs from this forward.
        self.row_stats = torch.zeros((*valid.shape, 3), dtype=acc_dtype, device=target.device)
        self.entropy = zeros(self.entropy_on)
        self.top1 = zeros(self.top1_on, torch.bool)
        self.log_sum_sq_prob = zeros(self.sq_on)
        self.mean_logit = zeros(self.mean_on)
        self.topk = outputs.topk
        self.topk_logprobs: torch.Tensor | None = None
        self.topk_ids: torch.Tensor | None = None
        if self.topk:
            shape = (*valid.shape, self.topk)
            self.topk_logprobs = torch.full(shape, -math.inf, dtype=acc_dtype, device=target.device)
            self.topk_ids = torch.full(shape, -1, dtype=torch.int64, device=target.device)
        self._is_max: torch.Tensor | None = None
        self._block: torch.Tensor | None = None
        # The compiled row loops form u_t and Σ eᵘu, not the other statistics.
        self.native = not (self.top1_on or self.sq_on or self.mean_on or self.topk)

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

    def _row_dot(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """``out = Σ_j a_j b_j`` per row, in vocabulary blocks (no ``(B, V)`` temporary).
        The first block's sum is written, not added to a zeroed ``out``: the chunk loop
        hands one block of ``eᵘ`` at a time (~500 per forward at N=2048, V=32768)."""
        if a.shape[1] == 0:
            out.zero_()
            return
        block = self._block_buffer(a)
        for start in range(0, a.shape[1], _BLOCK):
            stop = min(start + _BLOCK, a.shape[1])
            part = block[:, : stop - start]
            torch.mul(a[:, start:stop], b[:, start:stop], out=part)
            if start == 0:
                torch.sum(part, dim=1, out=out)
            else:
                out.add_(part.sum(1))

    def sums_before_exp(self, u: Tile, rows: RowChunk, p: int, out: torch.Tensor) -> None:
        slot = self.slot
        target = self.target[rows, p]
        local_t = target - self.start
        self.owned = (local_t >= 0) & (local_t < self.local)
        self.safe_t = torch.where(self.owned, local_t, 0)[:, None]
        picked = u.gather(1, self.safe_t)[:, 0]
        # Selected, not multiplied by the mask: a stand-in column 0 may be -inf (-inf * 0 = NaN).
        out[:, slot["target"]].copy_(torch.where(self.owned, picked, 0.0))
        if self.mean_on:
            torch.sum(u, dim=1, out=out[:, slot["sum_u"]])
        if self.top1_on:
            out[:, slot["target_is_max"]].copy_(~(picked < 0.0) & self.owned)
            out[:, slot["ties"]].copy_(self._ties(u, target))
        if self.topk:
            # Before the exponential, which may overwrite u; log Z comes in rows_done.
            values, ids = u.topk(min(self.topk, u.shape[1]), dim=1)
            width = values.shape[1]
            self.topk_logprobs[rows, p, :width] = values
            self.topk_ids[rows, p, :width] = ids + self.start

    def _ties(self, u: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per row, what breaks a top-1 at the maximum under the rule: the number of
        classes at it ("unique": more than one breaks it), or whether a class before
        the target reaches it ("argmax")."""
        if self.top1_rule == "argmax":
            # argmax takes a NaN for the maximum: with an infinite row maximum, the
            # first class at it.
            first = u.argmax(1)
            reaches = ~(u.gather(1, first[:, None])[:, 0] < 0.0)
            return reaches & (first + self.start < target)
        if self._is_max is None or self._is_max.shape[0] < u.shape[0]:
            self._is_max = torch.empty(u.shape, dtype=torch.bool, device=u.device)
        is_max = self._is_max[: u.shape[0]]
        torch.lt(u, 0.0, out=is_max)
        return is_max.logical_not_().sum(1)

    def sums_after_exp(self, u: Tile, e: Tile, out: torch.Tensor) -> None:
        if self.entropy_on:
            # u must survive for the gradient, so the product goes through a block scratch.
            self._row_dot(u, e, out[:, self.slot["dot"]])
        if self.sq_on:
            self._row_dot(e, e, out[:, self.slot["sq"]])

    def native_targets(self, rows: RowChunk, p: int) -> tuple[torch.Tensor, bool]:
        local_t = self.target[rows, p] - self.start
        self.owned = (local_t >= 0) & (local_t < self.local)
        return torch.where(self.owned, local_t, -1), self.entropy_on

    def native_sums(
        self, target_u: torch.Tensor, dot: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        out[:, self.slot["target"]] = target_u
        if self.entropy_on:
            out[:, self.slot["dot"]] = dot

    def native_fused(
        self, rows: RowChunk, p: int, factor: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return None

    def native_grad(self, rows: RowChunk, p: int, stats: RowStats, factor: float) -> NativeGrad:
        z = stats.sum_exp
        g, h = self.upstream(rows, p)
        g = torch.zeros_like(z) if g is None else g.to(z.dtype) * factor
        if h is None:
            return NativeGrad(a=-g / z, gamma=g * self.owned)
        # Σ eᵘu / Z of these rows (rows_done's μ is the last step's, these may be a chunk's).
        mu = stats.sums[:, self.slot["dot"]] / z
        return NativeGrad(a=-g / z, gamma=g * self.owned, b=-(h.to(z.dtype) * factor) / z, mu=mu)

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        sums, slot = stats.sums, self.slot
        self.logprob[rows, p] = sums[:, slot["target"]] - stats.log_sum_exp
        self.row_stats[rows, p, 0] = stats.row_max
        self.row_stats[rows, p, 1] = stats.log_sum_exp
        if self.entropy_on:
            self.row_mean_u = sums[:, slot["dot"]] / stats.sum_exp
            self.entropy[rows, p] = stats.log_sum_exp - self.row_mean_u
            self.row_stats[rows, p, 2] = self.row_mean_u
        if self.sq_on:
            self.log_sum_sq_prob[rows, p] = sums[:, slot["sq"]].log() - 2 * stats.log_sum_exp
        if self.mean_on:
            self.mean_logit[rows, p] = stats.row_max + sums[:, slot["sum_u"]] / self.num_classes
        if self.topk:
            self.topk_logprobs[rows, p] -= stats.log_sum_exp[:, None]
        if self.top1_on:
            ties = sums[:, slot["ties"]]
            clear = ties == 0 if self.top1_rule == "argmax" else ties == 1
            at_max = (sums[:, slot["target_is_max"]] > 0) & ~stats.row_max.isnan()
            self.top1[rows, p] = at_max & clear

    def grad_tile(
        self, u: Tile, e: Tile, rows: RowChunk, p: int, stats: RowStats, factor: float
    ) -> Tile:
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


class TokenLogprobGradient:
    r"""The gradient of :class:`TokenLogprobHead`'s ``logprob`` and ``entropy`` from the
    forward's row statistics, for the vocabulary pass (:mod:`linear_ce.engine.vocab_pass`).

    With the forward's ``row_stats`` ``(N, P, 3)`` (:attr:`TokenLogprobHead.row_stats`:
    the row max :math:`m`, :math:`\log Z` and :math:`\mu`), upstream gradients
    :math:`g` (of :math:`\log p_t`) and :math:`h` (of :math:`H`), and
    :math:`u = s - m`:

    .. math::

        \frac{\partial L}{\partial s_j} = g\,[j = t]
            - p_j \left(g + h\,(u_j - \mu)\right), \qquad
        p_j = e^{u_j - \log Z}.

    :math:`u - \mu` is formed from the three statistics as the chunk loop forms it
    (:meth:`TokenLogprobHead.grad_tile`), not as :math:`\log p + H`, whose two
    :math:`\log Z` terms cancel and cost ~3× the rounding in the entropy's gradient.
    ``grad_logprob`` / ``grad_entropy`` are ``(N, P)`` (``None``: none flows; not both);
    ``target`` indexes the whole vocabulary, of which this process holds
    ``[vocab_start, vocab_start + local_classes)``.
    """

    def __init__(
        self,
        target: torch.Tensor,
        valid: torch.Tensor,
        vocab_start: int,
        row_stats: torch.Tensor,
        grad_logprob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> None:
        if grad_logprob is None and grad_entropy is None:
            raise ValueError("TokenLogprobGradient needs grad_logprob or grad_entropy")
        self.target, self.valid, self.start = target, valid, vocab_start
        self.row_stats = row_stats
        self.grad_logprob, self.grad_entropy = grad_logprob, grad_entropy
        self._piece: torch.Tensor | None = None

    #: Its blocks may be half tiles of raw logits (the vocabulary pass's half blocks).
    half_blocks = True

    def grad_block(self, s: Tile, rows: RowChunk, p: int, classes: slice, factor: float) -> None:
        dtype = s.dtype
        loops = native_rows(dtype) if dtype == torch.float32 and s.device.type == "cpu" else None
        if loops is not None and (loops.class_major(s) or s.stride(1) == 1):
            self._grad_block_loops(loops, s, rows, p, classes, factor)
            return
        # Each statistic as a contiguous column: a ``(rows, 1)`` operand strided by 3 (a
        # column of ``row_stats``) against the class-major tile's contiguous rows runs its
        # broadcast several times slower: torch's broadcast loop does not vectorise over a
        # strided operand.
        stats = self.row_stats[rows, p].to(dtype).T.contiguous()
        row_max, log_z, mean_u = (stats[i][:, None] for i in range(3))
        g = None if self.grad_logprob is None else self.grad_logprob[rows, p].to(dtype) * factor
        neg_g = None if g is None else (-g)[:, None]
        neg_h = (
            None
            if self.grad_entropy is None
            else (-(self.grad_entropy[rows, p].to(dtype) * factor))[:, None]
        )
        step = max(1, _PIECE_ELEMENTS // max(s.shape[0], 1))
        # One view of the piece buffer serves every full piece (a view per piece is three
        # more operations, ~1000 times a step at N=2048, V=32768).
        full = None if neg_h is None else self._piece_buffer(s[:, :step])
        for start in range(0, s.shape[1], step):
            part = s[:, start : start + step]
            u = part.sub_(row_max)
            if neg_h is None:
                # Only log p_t flows: −g·p, then the target's g.
                u.sub_(log_z).exp_().mul_(neg_g)
                continue
            e = full if part.shape[1] == full.shape[1] else full[:, : part.shape[1]]
            torch.sub(u, log_z, out=e).exp_()
            u.sub_(mean_u)
            if neg_g is None:
                u.mul_(neg_h)
            else:
                torch.addcmul(neg_g, u, neg_h, out=u)
            u.mul_(e)
        if g is not None:
            local = self.target[rows, p] - self.start - classes.start
            hit = ((local >= 0) & (local < s.shape[1])).nonzero()[:, 0]
            s.index_put_((hit, local[hit]), g[hit], accumulate=True)

    def grad_half_block(
        self, s: Tile, rows: RowChunk, p: int, classes: slice, factor: float
    ) -> None:
        self._grad_block_loops(native_rows(s.dtype), s, rows, p, classes, factor, scale=factor)

    def _grad_block_loops(
        self,
        loops: NativeRows,
        s: Tile,
        rows: RowChunk,
        p: int,
        classes: slice,
        factor: float,
        scale: float = 1.0,
    ) -> None:
        """:meth:`grad_block` by the compiled row loops (:mod:`linear_ce.engine.native_rows`):
        :math:`e^{u}(a + b(u - \\mu)) + \\gamma[j = t]` with :math:`a = -g/Z`,
        :math:`b = -h/Z`, :math:`\\gamma = g`, one visit of each row of the block; the
        transformed logits are ``s·scale`` (1 for a block the pass has transformed, the
        transform's factor for a half block's raw logits)."""
        stats = self.row_stats[rows, p]
        acc = stats.dtype
        z = stats[:, 1].exp()
        n = stats.shape[0]
        g = (
            torch.zeros(n, dtype=acc, device=s.device)
            if self.grad_logprob is None
            else self.grad_logprob[rows, p].to(acc) * factor
        )
        h = None if self.grad_entropy is None else self.grad_entropy[rows, p].to(acc) * factor
        local = self.target[rows, p] - self.start - classes.start
        owned = (local >= 0) & (local < s.shape[1])
        loops.grad_(
            s,
            stats[:, 0],
            -g / z,
            scale=scale,
            b=None if h is None else -h / z,
            mu=None if h is None else stats[:, 2],
            target=torch.where(owned, local, -1),
            gamma=g * owned,
        )

    def _piece_buffer(self, part: torch.Tensor) -> torch.Tensor:
        rows, width = part.shape
        if self._piece is None or self._piece.numel() < rows * width:
            self._piece = torch.empty(
                max(_PIECE_ELEMENTS, rows * width), dtype=part.dtype, device=part.device
            )
        flat = self._piece[: rows * width]
        # In the tile's own layout (class-major on CPU), so both are read in the same order.
        return flat.view(width, rows).T if part.stride(0) == 1 else flat.view(rows, width)
