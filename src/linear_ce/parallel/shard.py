"""A vocabulary split over a process group: which classes this rank holds, and the
collectives that combine row statistics over the ranks that hold the others.

Every vocab-parallel function starts with :func:`vocab_shard`: plain tensors only, the
local shard of the head, a process group this rank is in, and where the shard lies
(given, or gathered from the shard sizes by :func:`shard_layout`). What it returns is
the vocabulary the ops run on (:class:`~linear_ce.engine.vocab.Vocab`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["VocabShard", "shard_layout", "vocab_shard"]


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
    and pass the result to :func:`linear_ce.distributed.vocab_parallel_linear_cross_entropy`
    (and the other vocab-parallel functions) to save the collective on every call.

    Example::

        >>> vocab_start, num_classes = shard_layout(lm_head_shard, group)
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
            "torch.distributed.init_process_group(...) first (or use "
            f"linear_ce.{name.removeprefix('vocab_parallel_')} for a weight that is not sharded)"
        )
    if dist.get_rank(process_group) < 0:
        raise RuntimeError(f"{name}: this process is not a member of process_group")


def _reject_dtensors(name: str, tensors: Mapping[str, torch.Tensor | None]) -> None:
    """A DTensor would hide the shard layout behind its own dispatch; ask for local tensors."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    for arg, value in tensors.items():
        if isinstance(value, DTensor):
            raise TypeError(
                f"{name}: {arg} is a DTensor, which the vocab-parallel functions do not take; "
                f"pass the DTensors to linear_ce.{name.removeprefix('vocab_parallel_')} itself, "
                "which lays them out on their mesh, or pass plain tensors here: the local "
                "vocabulary shard of a head sharded on dim 0 (.to_local()), the replicated "
                "tensors as local tensors (.to_local() / .full_tensor()), and "
                "process_group=<the head>.device_mesh.get_group()"
            )


def _given_layout(
    name: str, local: int, vocab_start: int | None, num_classes: int | None
) -> tuple[int, int]:
    if vocab_start is None or num_classes is None:
        raise ValueError(
            f"{name}: pass both vocab_start and num_classes, or neither (then they are "
            f"gathered from the shard sizes); got vocab_start={vocab_start!r}, "
            f"num_classes={num_classes!r}"
        )
    for arg, value in (("vocab_start", vocab_start), ("num_classes", num_classes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: {arg} must be an int, got {value!r}")
    if local == 0:
        raise ValueError(f"{name}: the local shard holds no class (shape[0] == 0)")
    if vocab_start < 0 or vocab_start + local > num_classes:
        raise ValueError(
            f"{name}: the local shard [vocab_start, vocab_start + {local}) = "
            f"[{vocab_start}, {vocab_start + local}) does not lie in [0, num_classes={num_classes})"
        )
    return vocab_start, num_classes


def vocab_shard(
    name: str,
    tensors: Mapping[str, torch.Tensor | None],
    head: str,
    process_group: dist.ProcessGroup | None,
    vocab_start: int | None,
    num_classes: int | None,
    *,
    out_features: bool = False,
) -> VocabShard:
    """The vocabulary of the vocab-parallel function ``name`` (errors name it): every one
    of ``tensors`` plain (not a DTensor), ``tensors[head]`` this rank's shard of the head
    (``(V_local, in_features)``, or with ``out_features`` also
    ``(V_local, d1, ..., dK, in_features)``), this process in ``process_group``, and the
    shard at ``vocab_start`` of ``num_classes`` (both, or neither: then gathered)."""
    _reject_dtensors(name, tensors)
    weight = tensors[head]
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
    _require_group(name, process_group)
    if vocab_start is None and num_classes is None:
        start, total = _gathered_layout(name, weight, process_group)
    else:
        start, total = _given_layout(name, weight.shape[0], vocab_start, num_classes)
    return VocabShard(start, total, process_group)
