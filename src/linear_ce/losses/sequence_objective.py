r"""The sequence-objective head: a loss of each sequence's summed log-probabilities,
differentiated in the same pass.

The loop's chunks hold whole groups of sequences (:mod:`linear_ce.engine.sequence_layout`). Per
chunk the head computes each scored token's log-probability :math:`\log p_t` (and entropy),
hands the objective a :class:`SequenceBatch` built from them as leaf tensors (the sums
:math:`L_s = \sum_{t \in s} \log p_t` by an ``index_add`` of the leaves), and takes the
gradient of the objective's summed losses with respect to the leaves by the objective's
own autograd on those few values:

.. math::

    g_t = \frac{\partial \mathcal{L}}{\partial \log p_t}
        = \frac{\partial \mathcal{L}}{\partial L_{s(t)}}
        + \frac{\partial \mathcal{L}}{\partial \log p_t}\Big|_{\text{token terms}}.

These are the upstream gradients of
:class:`~linear_ce.losses.token_logprob.TokenLogprobHead`, known while the chunk's logits
are still in the tile: the loop goes on to the two gradient GEMMs, three GEMMs per
training step. The sequence-level values are formed in float64 (``float32`` where the
device has no float64): a preference loss takes differences of sums of hundreds of
log-probabilities.

The same :class:`SequenceEvaluation` serves the four-GEMM path (groups longer than a
chunk), called once on every group after a statistics pass.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping

import torch

from linear_ce.engine.head import HeadFrame, RowStats
from linear_ce.engine.row_chunks import RowChunk, chunk_size
from linear_ce.engine.sequence_layout import GroupChunk, SequenceTotals
from linear_ce.losses.token_logprob import TokenLogprobHead, TokenOutputs
from linear_ce.losses.token_objective import other_leaf

__all__ = [
    "Metrics",
    "SequenceBatch",
    "SequenceEvaluation",
    "SequenceHead",
    "collect_metrics",
    "log_metric",
    "sequence_dtype",
]


def sequence_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the sequence-level values: float64, or float32 on a device without it."""
    return torch.float32 if device.type == "mps" else torch.float64


class Metrics(Mapping[str, torch.Tensor]):
    """The means of the values logged by :func:`log_metric` while it collected, by name:
    each a 0-d float64 tensor without gradient, on the values' device (nothing is read
    back to the host)."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor | float] = {}

    def add(self, name: str, values: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add ``values`` (any shape) to the running mean of ``name``, each value counted
        ``weight`` times (``weight`` of the values' shape; ``None``: once)."""
        values = values.detach().to(torch.float64)
        if weight is None:
            total, count = values.sum(), float(values.numel())
        else:
            weight = weight.detach().to(torch.float64)
            total, count = (values * weight).sum(), weight.sum()
        self._sums[name] = self._sums[name] + total if name in self._sums else total
        self._weights[name] = self._weights.get(name, 0.0) + count

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sums[name] / self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sums)

    def __len__(self) -> int:
        return len(self._sums)

    def __repr__(self) -> str:
        return f"Metrics({sorted(self._sums)})"


_COLLECTING: contextvars.ContextVar[tuple[Metrics, ...]] = contextvars.ContextVar(
    "linear_ce_metrics", default=()
)


def log_metric(name: str, values: torch.Tensor, weight: torch.Tensor | None = None) -> None:
    """Log ``values`` (detached; ``weight``: how much each counts, e.g. a 0/1 mask) under
    ``name`` into every :func:`collect_metrics` that is collecting; a no-op otherwise.
    Objectives call it for what trainers log (clip fractions, mean ratios, KL, rewards);
    the mean is over every value logged in the call, in every chunk."""
    for metrics in _COLLECTING.get():
        metrics.add(name, values, weight)


@contextlib.contextmanager
def collect_metrics() -> Iterator[Metrics]:
    """Collect the metrics objectives log inside the block (the calls' own pass, no second
    one); read them after the call.

    Example::

        >>> with linear_ce.objectives.collect_metrics() as metrics:
        ...     loss = linear_ce.token_objective(x, W, t, obj.clipped_policy_gradient(), **side)
        >>> metrics["clip_fraction"]
    """
    metrics = Metrics()
    token = _COLLECTING.set((*_COLLECTING.get(), metrics))
    try:
        yield metrics
    finally:
        _COLLECTING.reset(token)


@dataclasses.dataclass
class SequenceBatch:
    r"""What a sequence objective sees: the sequences of one chunk (whole groups), listed
    group by group, each group's members in order (with ``group="pairs"``: chosen, then
    rejected). ``S`` sequences, ``G`` groups, ``n`` scored tokens; every tensor is in the
    sequence dtype (float64) unless said otherwise.

    Attributes:
        logprob: ``(S,)`` :math:`\sum_t \log p_t` over each sequence's scored tokens
            (differentiable).
        length: ``(S,)`` the number of scored tokens of each sequence.
        group: ``(S,)`` int64, each sequence's group, ``0 … G-1`` (non-decreasing).
        num_groups: ``G``.
        group_size: the size every group of the call shares, or ``None``.
        token_logprob: ``(n,)`` each scored token's :math:`\log p_t` (differentiable).
        token_sequence: ``(n,)`` int64, each token's sequence (an index into ``logprob``).
        entropy: ``(n,)`` each token's entropy (differentiable), or ``None`` unless the call
            asked for it.
        side: per-sequence side inputs, ``(S,)`` each.
        token_side: per-token side inputs, ``(n,)`` each.
        totals: counts over the whole call (:class:`~linear_ce.engine.sequence_layout.SequenceTotals`):
            normalisers known before the pass, e.g. all chosen answers' tokens.
    """

    logprob: torch.Tensor
    length: torch.Tensor
    group: torch.Tensor
    num_groups: int
    group_size: int | None
    token_logprob: torch.Tensor
    token_sequence: torch.Tensor
    entropy: torch.Tensor | None
    side: dict[str, torch.Tensor]
    token_side: dict[str, torch.Tensor]
    totals: SequenceTotals

    def by_group(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence ``values`` ``(S,)`` as ``(G, k)``, a row per group (groups of one size)."""
        if self.group_size is None:
            raise ValueError(
                "SequenceBatch.by_group: the groups of this call differ in size; use "
                "sum_groups or index by SequenceBatch.group"
            )
        return values.view(self.num_groups, self.group_size)

    def pair(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence ``values`` split into the first and second member of each group of two
        (``(G,)`` each: chosen, rejected)."""
        if self.group_size != 2:
            raise ValueError(
                f"SequenceBatch.pair: groups of 2 sequences (chosen, rejected) expected, got "
                f"groups of {self.group_size or 'different sizes'}"
            )
        first, second = self.by_group(values).unbind(1)
        return first, second

    def sum_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token ``values`` ``(n,)`` summed over each sequence: ``(S,)``."""
        out = values.new_zeros(self.logprob.shape)
        return out.index_add(0, self.token_sequence, values)

    def mean_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token ``values`` ``(n,)`` averaged over each sequence's scored tokens: ``(S,)``."""
        return self.sum_tokens(values) / self.length

    def sum_groups(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence ``values`` ``(S,)`` summed over each group: ``(G,)``."""
        return values.new_zeros(self.num_groups).index_add(0, self.group, values)

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence ``values`` ``(S,)`` repeated for each of the sequence's tokens: ``(n,)``."""
        return values[self.token_sequence]


class SequenceEvaluation:
    """Evaluates ``objective`` on chunks of whole groups and keeps what the call returns:
    ``total`` (the summed losses, float64), ``count`` (how many losses), ``logprob_sum``
    ``(S,)`` and ``metrics``. ``side`` ``(S,)`` and ``token_side`` ``(N,)`` (indexed by row)
    are in the sequence dtype.

    With ``mean``, the gradients it returns are those of the mean already where the first
    chunk tells how many losses the call has (one per group or per sequence, from the
    totals): ``folded_count``, the count they are divided by (1 where the first chunk's
    groups and sequences are as many but the call's are not); the caller scales by
    ``folded_count / count`` afterwards, exactly 1 unless the objective changed its kind of
    loss between chunks. A mean's scale then costs no pass over the gradients."""

    def __init__(
        self,
        objective: Callable[[SequenceBatch], torch.Tensor],
        *,
        name: str,
        lengths: torch.Tensor,
        side: dict[str, torch.Tensor],
        token_side: dict[str, torch.Tensor],
        totals: SequenceTotals,
        group_size: int | None,
        want_grads: bool,
        mean: bool = False,
    ) -> None:
        self.objective, self.name, self.mean = objective, name, mean
        self.folded_count: int | None = None
        self.dtype = lengths.dtype
        self.lengths, self.side, self.token_side = lengths, side, token_side
        self.totals, self.group_size, self.want_grads = totals, group_size, want_grads
        device = lengths.device
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0
        self.logprob_sum = torch.zeros(totals.sequences, dtype=self.dtype, device=device)
        self.metrics = Metrics()

    def __call__(
        self,
        chunk: GroupChunk,
        rows: RowChunk,
        logprob: torch.Tensor,
        entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The chunk's upstream gradients of ``logprob`` and ``entropy`` ``(n,)`` in their
        dtype (``None`` where none flows or none is wanted)."""
        acc = logprob.dtype
        grad_mode = torch.enable_grad() if self.want_grads else torch.no_grad()
        with grad_mode:
            lp = logprob.detach().to(self.dtype).requires_grad_(self.want_grads)
            ent = (
                None
                if entropy is None
                else entropy.detach().to(self.dtype).requires_grad_(self.want_grads)
            )
            sequences = chunk.sequences
            sums = lp.new_zeros(sequences.shape).index_add(0, chunk.local_sequence, lp)
            batch = SequenceBatch(
                logprob=sums,
                length=self.lengths[sequences],
                group=chunk.group,
                num_groups=chunk.num_groups,
                group_size=self.group_size,
                token_logprob=lp,
                token_sequence=chunk.local_sequence,
                entropy=ent,
                side={k: v[sequences] for k, v in self.side.items()},
                token_side={k: v[rows] for k, v in self.token_side.items()},
                totals=self.totals,
            )
            token = _COLLECTING.set((*_COLLECTING.get(), self.metrics))
            try:
                loss = self.objective(batch)
            finally:
                _COLLECTING.reset(token)
            self._check_loss(loss, batch)
            if self.folded_count is None:
                self.folded_count = self._count_to_fold(loss, batch)
            total = loss.sum()
            leaves = [lp] if ent is None else [lp, ent]
            self._refuse_other_leaves(total, leaves)
            grads = (
                torch.autograd.grad(total, leaves, allow_unused=True)
                if self.want_grads and total.requires_grad
                else [None] * len(leaves)
            )
        self.total += total.detach().to(torch.float64)
        self.count += loss.numel()
        self.logprob_sum[sequences] = sums.detach()
        # No finiteness check (as token_objective): a NaN reaches the gradients of the rows
        # it touches, as in plain autograd, without a host sync per chunk.
        scale = 1.0 / self.folded_count
        g, h = ((None if g is None else (g * scale).to(acc)) for g in (*grads, None)[:2])
        return g, h

    def _count_to_fold(self, loss: torch.Tensor, batch: SequenceBatch) -> int:
        """The number of losses of the whole call, read from the first chunk's kind of loss
        (``mean``; otherwise 1): the groups' or the sequences' total, or 1 where the chunk
        cannot tell them apart but the call can."""
        if not self.mean:
            return 1
        per_group = loss.numel() == batch.num_groups
        per_sequence = loss.numel() == batch.logprob.numel()
        if per_group and per_sequence:
            same = self.totals.groups == self.totals.sequences
            return self.totals.groups if same else 1
        return self.totals.groups if per_group else self.totals.sequences

    def _check_loss(self, loss: object, batch: SequenceBatch) -> None:
        shapes = {(batch.num_groups,), tuple(batch.logprob.shape)}
        if not isinstance(loss, torch.Tensor) or tuple(loss.shape) not in shapes:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"{self.name}: objective must return one loss per group ({batch.num_groups},) or "
                f"per sequence {tuple(batch.logprob.shape)} of the chunk, got {got}"
            )

    def _refuse_other_leaves(self, total: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        """Raise when the loss depends on a tensor that requires grad besides ``leaves``
        (:func:`~linear_ce.losses.token_objective.other_leaf`): only ``leaves`` are
        differentiated, so its gradient would be lost."""
        variable = other_leaf(total, leaves)
        if variable is not None:
            raise ValueError(
                f"{self.name}: the objective's loss depends on a tensor that requires grad "
                f"besides the log-probabilities and entropies (shape "
                f"{tuple(variable.shape)}, e.g. one it closes over); only those are "
                "differentiated, so that tensor's gradient would be lost: pass data as a "
                "side input, detach it, or apply a learnable factor outside the call"
            )


class SequenceHead(TokenLogprobHead):
    r"""The token log-probability head whose upstream gradients come from ``evaluation`` on
    each of ``chunks`` (the loop's chunks, visited in their order, at position 0).

    A chunk's rows may come a step at a time (a half tile's first sweep,
    :mod:`linear_ce.engine.chunk_loop`): the objective is evaluated once the chunk's last
    row is done, and its gradients are kept per row for ``grad_tile`` (the second sweep,
    a step at a time). With ``scaled_rows`` (no entropy, no bias gradient: each row's
    gradient is :math:`g_t\,(\delta_t - p)`, its upstream times the gradient of
    :math:`\log p_t`), there is no second sweep: ``grad_tile`` gives
    :math:`\delta_t - p` as each step is done, and ``row_factors`` the :math:`g_t` the
    loop scales the chunk's half tile by."""

    #: The objective needs every sequence of a chunk before any row's gradient is known.
    grads_after_chunk = True
    #: Its outputs are the log-probabilities and entropy the loops form, on fp32 tiles too.
    native_fp32 = True

    def __init__(
        self,
        frame: HeadFrame,
        *,
        entropy: bool,
        evaluation: SequenceEvaluation,
        chunks: list[GroupChunk],
        num_classes: int | None = None,
        scaled_rows: bool = False,
    ) -> None:
        super().__init__(frame, outputs=TokenOutputs(entropy=entropy), num_classes=num_classes)
        self.evaluation, self.chunks, self.visited, self.rows_seen = evaluation, chunks, 0, 0
        # Each row's upstream gradients, written as its chunk is evaluated.
        self.grad_logprob = torch.zeros_like(self.logprob)
        self.grad_entropy = torch.zeros_like(self.logprob) if self.entropy_on else None
        self.flows = (False, False)
        if scaled_rows and entropy:
            raise ValueError("SequenceHead: scaled_rows is for a head without entropy")
        self.scaled_rows = scaled_rows

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        super().rows_done(rows, p, stats)
        chunk = self.chunks[self.visited]
        self.rows_seen += chunk_size(rows)
        if self.rows_seen > chunk.size:
            raise RuntimeError(
                "SequenceHead: the loop went past the planned chunk's rows (chunks must be "
                "the planned chunks of whole groups)"
            )
        if self.rows_seen < chunk.size:
            return
        self.visited, self.rows_seen = self.visited + 1, 0
        whole = chunk.rows
        entropy = self.entropy[whole, 0] if self.entropy_on else None
        g, h = self.evaluation(chunk, whole, self.logprob[whole, 0], entropy)
        self.flows = (g is not None, h is not None)
        if g is not None:
            self.grad_logprob[whole, 0] = g
        if h is not None:
            self.grad_entropy[whole, 0] = h

    def grad_tile(
        self, u: torch.Tensor, e: torch.Tensor, rows: RowChunk, p: int, stats: RowStats, factor
    ) -> torch.Tensor:
        if self.scaled_rows:
            # factor · (δ_t − p), the unit upstream's tile of TokenLogprobHead (the same
            # operations on the same values) in one sweep, where sums_before_exp has just
            # kept these rows' target columns: ~10 small operations a step fewer (16-row
            # steps: ~1000 of a bf16 DPO step at N=2048).
            z = stats.sum_exp
            # A tensor's division, as there: a float over a tensor is a reciprocal and a product.
            out = e.mul_((z.new_tensor(-factor) / z)[:, None])
            return out.scatter_add_(1, self.safe_t, (factor * self.owned)[:, None])
        # The rows' own target columns and entropy mean: with two sweeps the last step of
        # the first sweep left its own (TokenLogprobHead keeps them from sums_before_exp
        # and rows_done).
        local_t = self.target[rows, p] - self.start
        self.owned = (local_t >= 0) & (local_t < self.local)
        self.safe_t = torch.where(self.owned, local_t, 0)[:, None]
        if self.entropy_on:
            self.row_mean_u = stats.sums[:, self.slot["dot"]] / stats.sum_exp
        return super().grad_tile(u, e, rows, p, stats, factor)

    def native_fused(
        self, rows: RowChunk, p: int, factor: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if not self.scaled_rows:
            return None
        # factor · (δ_t − p), as grad_tile's: a = −factor / Z, γ = factor.
        owned = self.owned.to(self.logprob.dtype)
        return torch.full_like(owned, -factor), torch.zeros_like(owned), factor * owned

    def row_factors(self, rows: RowChunk, p: int) -> torch.Tensor:
        r"""Each row's upstream gradient of :math:`\log p_t` (``scaled_rows``; 0 where none
        flows)."""
        return self.grad_logprob[rows, p]

    def upstream(self, rows: RowChunk, p: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        g_on, h_on = self.flows
        return (
            self.grad_logprob[rows, p] if g_on else None,
            self.grad_entropy[rows, p] if h_on else None,
        )
