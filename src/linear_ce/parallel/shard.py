"""A vocabulary split over a process group: which classes this rank holds, and the
collectives that combine row statistics over the ranks that hold the others.

A public function called with ``vocab_parallel=`` a :class:`VocabParallel` (what the
caller says about the split) starts with :func:`vocab_shard`: plain tensors only, the
local shard of the head, a process group this rank is in, and where the shard lies
(given, or gathered from the shard sizes by :func:`shard_layout`). What it returns is
the vocabulary the ops run on (:class:`~linear_ce.engine.vocab.Vocab`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = ["VocabParallel", "VocabShard", "shard_layout", "vocab_shard"]


@dataclasses.dataclass(frozen=True)
class VocabParallel:
    r"""A head split along the vocabulary over a process group: this rank holds classes
    ``[vocab_start, vocab_start + V_r)`` of ``num_classes``, ``V_r`` its shard's rows.

    Passed as ``vocab_parallel=`` to a public function (:func:`linear_ce.linear_cross_entropy`,
    :func:`~linear_ce.token_logprobs`, :func:`~linear_ce.token_objective`,
    :func:`~linear_ce.sequence_objective`, :func:`~linear_ce.linear_divergence`,
    :func:`~linear_ce.sparse_divergence`), it says the same for every family: the head
    tensors given (weights, biases) are this rank's shard ``(V_r, ...)``, rows
    ``[vocab_start, vocab_start + V_r)`` of the whole head, and every other argument is the
    same on every rank (class ids and class weights of the whole vocabulary). Every rank
    gets the same result, equal to the call on the whole head; the head's shard gets the
    gradient of its own rows, the input the whole gradient (summed over the group). Every
    rank must make the same calls with the same shapes, options and ``requires_grad``
    flags (the chunk size is planned from ``⌈num_classes / world⌉`` classes, so every rank
    runs the same chunks), or the collectives do not match up. Each function's
    ``vocab_parallel`` entry lists its collectives (:mod:`linear_ce.distributed`: how they
    combine the row statistics). A DTensor head split along the vocabulary (``Shard(0)``)
    needs no ``VocabParallel``: its placements say where its shard lies.

    Args:
        process_group: the group the vocabulary is split over; ``None`` is the default
            (world) group.
        vocab_start: the first class of this rank's shard. With ``num_classes``, or
            neither: then every call gathers both by one all_gather of the shard sizes, in
            rank order (:func:`~linear_ce.distributed.shard_layout` does it once).
        num_classes: the classes of the whole vocabulary (``vocab_start < num_classes``).

    Example::

        >>> group = dist.new_group([0, 1])
        >>> layout = VocabParallel(group, *shard_layout(lm_head_shard, group))
        >>> loss = linear_ce.linear_cross_entropy(hidden, lm_head_shard, labels,
        ...                                       vocab_parallel=layout)
    """

    process_group: dist.ProcessGroup | None = None
    vocab_start: int | None = None
    num_classes: int | None = None

    def __post_init__(self) -> None:
        group = self.process_group
        if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError(
                "VocabParallel: process_group must be a torch.distributed ProcessGroup or "
                f"None (the default group), got {type(group).__name__}"
            )
        start, total = self.vocab_start, self.num_classes
        if (start is None) != (total is None):
            raise ValueError(
                "VocabParallel: pass both vocab_start and num_classes, or neither (then they "
                f"are gathered from the shard sizes); got vocab_start={start!r}, "
                f"num_classes={total!r}"
            )
        if start is None:
            return
        for field, value in (("vocab_start", start), ("num_classes", total)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"VocabParallel: {field} must be an int, got {value!r}")
        if not 0 <= start < total:
            raise ValueError(
                "VocabParallel: vocab_start must lie in [0, num_classes), got "
                f"vocab_start={start}, num_classes={total}"
            )


class VocabShard:
    """Classes ``[start, start + V_local)`` of ``total`` classes split over ``group``.

    The vocabulary of :func:`linear_ce.engine.chunk_loop.run_chunks`
    (:class:`~linear_ce.engine.vocab.Vocab`): row statistics are combined over the group
    by ``all_reduce``, in place; the chunk size is planned for ``⌈total / world⌉``
    classes on every rank, so every rank runs the same chunks.
    """

    def __init__(self, start: int, total: int, group: dist.ProcessGroup | None) -> None:
        self.start = start
        self.total = total
        self.group = group

    @property
    def plan_classes(self) -> int:
        """The classes the chunk size is planned for: ``⌈total / world⌉``."""
        return -(-self.total // dist.get_world_size(self.group))

    def max_(self, row_max: torch.Tensor) -> None:
        """Make ``row_max`` the maximum over every shard, in place."""
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=self.group)

    def sum_(self, row_sums: torch.Tensor) -> None:
        """Make ``row_sums`` the sum over every shard, in place."""
        dist.all_reduce(row_sums, op=dist.ReduceOp.SUM, group=self.group)

    def merge_topk(
        self, values: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest of every rank's ``(..., k)`` candidates, per row, sorted in
        descending order: one all_gather of the values and one of the ids, then the first
        ``k`` of a stable descending sort of the ``world·k`` candidates ordered by id. Each rank's
        candidates are its shard's ``k`` largest, so those of the whole vocabulary are among
        them. Equal values come in the order of their ids, and a slot without a class (id
        ``-1``, ``-inf``) after every class, so a class whose log-probability is ``-inf``
        still fills a slot before it."""
        k = values.shape[-1]
        world = dist.get_world_size(self.group)
        gathered = []
        for local in (values.contiguous(), ids.contiguous()):
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local, group=self.group)
            gathered.append(torch.cat(parts, dim=-1))
        all_values, all_ids = gathered
        # By id (empty slots last), then a stable descending sort by value: equal values
        # in the order of their ids, every class before an empty slot.
        by_id = torch.where(all_ids < 0, self.total, all_ids).sort(dim=-1, stable=True).indices
        all_values, all_ids = all_values.gather(-1, by_id), all_ids.gather(-1, by_id)
        order = all_values.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        return all_values.gather(-1, order), all_ids.gather(-1, order)


def shard_layout(
    linear_weight: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> tuple[int, int]:
    """``(vocab_start, num_classes)`` of this rank's shard, by one all_gather of the shard sizes.

    Ranks hold consecutive slices in rank order: ``vocab_start`` is the sum of
    the lower ranks' ``linear_weight.shape[0]``, ``num_classes`` the sum over
    all ranks. Shards may differ in size but none may be empty. Call it once
    and pass the result in a :class:`VocabParallel` to save the collective on every call.

    Example::

        >>> layout = VocabParallel(group, *shard_layout(lm_head_shard, group))
    """
    return _gathered_layout("shard_layout", linear_weight, process_group)


def _gathered_layout(
    name: str, linear_weight: torch.Tensor, process_group: dist.ProcessGroup | None
) -> tuple[int, int]:
    _require_group(name, process_group)
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    mine = torch.tensor([linear_weight.shape[0]], dtype=torch.int64, device=linear_weight.device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=process_group)
    counts = [int(s) for s in sizes]
    empty = [r for r, c in enumerate(counts) if c == 0]
    if empty:
        raise ValueError(
            f"{name}: every rank must hold at least one class, but ranks {empty} hold an "
            f"empty shard (shard sizes {counts})"
        )
    return sum(counts[:rank]), sum(counts)


def _require_group(name: str, process_group: dist.ProcessGroup | None) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{name}: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) first (or pass vocab_parallel=None "
            "for a head that is not split)"
        )
    if dist.get_rank(process_group) < 0:
        raise RuntimeError(f"{name}: this process is not a member of vocab_parallel.process_group")


def vocab_shard(
    name: str,
    head: str,
    weight: torch.Tensor,
    vocab_parallel: VocabParallel | None,
    *,
    out_features: bool = False,
) -> VocabShard | None:
    """The vocabulary of the public function ``name`` (errors name it) called with
    ``vocab_parallel``: ``None`` for a whole head; else ``weight`` (the argument ``head``)
    this rank's shard of the head (``(V_local, in_features)``, or with ``out_features``
    also ``(V_local, d1, ..., dK, in_features)``), this process in the group, and the shard
    inside the vocabulary (given, or gathered from the shard sizes)."""
    if vocab_parallel is None:
        return None
    if not isinstance(vocab_parallel, VocabParallel):
        raise TypeError(
            f"{name}: vocab_parallel must be a linear_ce.VocabParallel or None, got "
            f"{type(vocab_parallel).__name__}"
        )
    if not isinstance(weight, torch.Tensor) or (
        weight.dim() < 2 if out_features else weight.dim() != 2
    ):
        shapes = (
            "a Tensor of shape (V_local, in_features) or (V_local, d1, ..., dK, in_features)"
            if out_features
            else "(V_local, in_features)"
        )
        raise ValueError(
            f"{name}: {head} must be this rank's shard, {shapes}, got "
            f"{getattr(weight, 'shape', type(weight).__name__)}"
        )
    group = vocab_parallel.process_group
    _require_group(name, group)
    start, total = vocab_parallel.vocab_start, vocab_parallel.num_classes
    if start is None or total is None:
        start, total = _gathered_layout(name, weight, group)
    local = weight.shape[0]
    if local == 0:
        raise ValueError(f"{name}: the local shard {head} holds no class (shape[0] == 0)")
    if start + local > total:
        raise ValueError(
            f"{name}: the local shard [vocab_start, vocab_start + {local}) = "
            f"[{start}, {start + local}) does not lie in [0, num_classes={total})"
        )
    return VocabShard(start, total, group)
