r"""Which tokens form which sequence, which sequences form a group, and chunks of whole groups.

A sequence objective (:func:`linear_ce.sequence_objective`) sees each sequence's summed
token log-probabilities, so a chunk of the loop must hold every scored token of the
sequences it holds, and every sequence of the groups it holds (a chosen/rejected pair, a
GRPO group): the objective's gradient is then known while the chunk's logits are in the
tile. This module reads the layout on the host once per call (the one synchronisation of
a call, as :mod:`linear_ce.engine.row_chunks`) and packs whole groups, in group order, into chunks
of at most a given number of scored tokens.

Layouts (the flattened token order is the target's, row-major):

- **padded** ``(B, T)``: sequence ``b`` is row ``b``; ``S = B``;
- **packed**, per-token ids: ``sequence`` of the target's shape, sequence ``s`` is the
  tokens with id ``s`` (``S = max + 1``; a negative id is a token of no sequence);
- **packed**, boundaries: ``cu_seqlens`` ``(S + 1,)``, sequence ``s`` is the flattened
  tokens ``[cu_seqlens[s], cu_seqlens[s + 1])`` (tokens after the last boundary belong to
  none).

With ``shift = k`` a position is scored only if its label (``k`` places on) lies in the
same sequence: a packed sequence's last position does not predict the next one's first
token.

Groups: ``None`` (each sequence alone), ``"pairs"`` (TRL's convention: the first ``S/2``
sequences are the chosen answers, the last ``S/2`` the rejected ones, sequence ``i`` paired
with ``i + S/2``, chosen first) or an integer group id per sequence (members in sequence
order). Groups are visited in ascending id order; inside a chunk the sequences are listed
group by group, each group's members in their order.
"""

from __future__ import annotations

import dataclasses

import torch

from linear_ce.engine.row_chunks import RowChunk

__all__ = ["GroupChunk", "SequenceLayout", "SequenceTotals", "sequence_layout"]


@dataclasses.dataclass(frozen=True)
class SequenceTotals:
    """Counts over the whole call (plain ints): ``sequences``, ``groups``, scored ``tokens``,
    and when every group has the same size ``k``, ``member_tokens[m]``: the scored tokens
    of every group's ``m``-th member together (``member_tokens[0]``: all chosen answers'
    tokens), else ``None``."""

    sequences: int
    groups: int
    tokens: int
    member_tokens: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class GroupChunk:
    """One chunk of whole groups: its ``rows`` (a ``slice`` or device index tensor, ascending),
    each row's sequence as an index into ``sequences`` (``local_sequence``, device), the
    chunk's ``sequences`` (global ids, device, group by group), each of those sequences'
    group as an index from 0 (``group``, device) and the number of groups."""

    rows: RowChunk
    size: int
    local_sequence: torch.Tensor
    sequences: torch.Tensor
    group: torch.Tensor
    num_groups: int


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """The layout of one call. ``valid`` ``(N, 1)`` (device) marks the scored tokens;
    ``lengths`` ``(S,)`` (device, int64) counts each sequence's; ``group_size`` is the size
    every group shares (``None`` if they differ); ``max_group_tokens`` the most scored tokens
    of one group (a chunk must hold that many)."""

    valid: torch.Tensor
    lengths: torch.Tensor
    totals: SequenceTotals
    group_size: int | None
    max_group_tokens: int
    # Host-side. A sequence's rank is its place in (group, member) order: the sequences in
    # rank order, the group of each rank, the scored tokens of each group, the scored rows
    # sorted by rank then row with the rank of each, and the scored tokens of each rank.
    _order: torch.Tensor
    _group_of_rank: torch.Tensor
    _group_tokens: torch.Tensor
    _rows_by_rank: torch.Tensor
    _rank_of_row: torch.Tensor
    _seq_tokens_by_rank: torch.Tensor

    def chunks(self, capacity: int, device: torch.device) -> list[GroupChunk] | None:
        """Whole groups, in group order, packed into chunks of at most ``capacity`` scored
        tokens (a chunk is closed when the next group does not fit); ``None`` when one group
        alone has more than ``capacity`` tokens."""
        if self.max_group_tokens > capacity:
            return None
        return self._make_chunks(self._spans(capacity), device)

    def least_capacity(self, capacity: int, most_chunks: int) -> int:
        """The fewest scored tokens per chunk (at least ``max_group_tokens``, at most
        ``capacity``) that pack the groups as :meth:`chunks` does into at most
        ``most_chunks`` chunks, or as few as ``capacity`` does where that makes more. Fewer
        tokens never make fewer chunks (whole groups, in order, a chunk closed when the next
        does not fit), so it is searched by bisection."""
        low, high = self.max_group_tokens, max(capacity, self.max_group_tokens)
        most_chunks = max(most_chunks, len(self._spans(high)))
        while low < high:
            middle = (low + high) // 2
            if len(self._spans(middle)) <= most_chunks:
                high = middle
            else:
                low = middle + 1
        return high

    def _spans(self, capacity: int) -> list[tuple[int, int]]:
        """``(first group, end group)`` of each chunk of at most ``capacity`` tokens."""
        spans = []
        start, used = 0, 0
        for g, n in enumerate(self._group_tokens.tolist()):
            if used + n > capacity and g > start:
                spans.append((start, g))
                start, used = g, 0
            used += n
        if self.totals.groups:
            spans.append((start, self.totals.groups))
        return spans

    def one_chunk(self, device: torch.device) -> GroupChunk:
        """Every group in one chunk (the objective of the four-GEMM path)."""
        return self._make_chunks([(0, self.totals.groups)], device)[0]

    def _make_chunks(self, spans: list[tuple[int, int]], device: torch.device) -> list[GroupChunk]:
        # First rank (sequence) of each group, and first token (in rank order) of each rank.
        group_first_rank = _starts(
            torch.bincount(self._group_of_rank, minlength=self.totals.groups)
        )
        rank_first_token = _starts(self._seq_tokens_by_rank)
        rows_parts, local_parts, sizes, ranks = [], [], [], []
        for g0, g1 in spans:
            r0, r1 = int(group_first_rank[g0]), int(group_first_rank[g1])
            t0, t1 = int(rank_first_token[r0]), int(rank_first_token[r1])
            rows, perm = torch.sort(self._rows_by_rank[t0:t1])
            rows_parts.append(rows)
            local_parts.append(self._rank_of_row[t0:t1][perm] - r0)
            sizes.append(t1 - t0)
            ranks.append((r0, r1, g0, g1))
        # One transfer each for every chunk's rows and sequence indices.
        all_rows = torch.cat(rows_parts).to(device, non_blocking=True)
        all_local = torch.cat(local_parts).to(device, non_blocking=True)
        order = self._order.to(device, non_blocking=True)
        group_of_rank = self._group_of_rank.to(device, non_blocking=True)
        chunks, offset = [], 0
        for rows, size, (r0, r1, g0, g1) in zip(rows_parts, sizes, ranks, strict=True):
            first, last = (int(rows[0]), int(rows[-1])) if size else (0, -1)
            consecutive = last - first + 1 == size
            chunks.append(
                GroupChunk(
                    rows=slice(first, last + 1)
                    if consecutive
                    else all_rows[offset : offset + size],
                    size=size,
                    local_sequence=all_local[offset : offset + size],
                    sequences=order[r0:r1],
                    group=group_of_rank[r0:r1] - g0,
                    num_groups=g1 - g0,
                )
            )
            offset += size
        return chunks


def _starts(counts: torch.Tensor) -> torch.Tensor:
    """``[0, c0, c0 + c1, …]``: where each of ``counts``' segments starts, and the end."""
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def _sequence_ids(
    name: str,
    target: torch.Tensor,
    sequence: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """Each token's sequence id (host, int64, the target's shape; -1: none) and ``S``."""
    if sequence is not None and cu_seqlens is not None:
        _fail(name, "pass sequence= (an id per token) or cu_seqlens= (boundaries), not both")
    if sequence is not None:
        if (
            not isinstance(sequence, torch.Tensor)
            or sequence.is_floating_point()
            or (sequence.dtype == torch.bool)
        ):
            got = sequence.dtype if isinstance(sequence, torch.Tensor) else type(sequence).__name__
            _fail(name, f"sequence must be an integer tensor of sequence ids, got {got}")
        if tuple(sequence.shape) != tuple(target.shape):
            _fail(
                name,
                f"sequence must have the target's shape {tuple(target.shape)} (a sequence id "
                f"per token), got {tuple(sequence.shape)}",
            )
        ids = sequence.detach().to("cpu", torch.int64)
        ids = torch.where(ids < 0, -1, ids)
        return ids, int(ids.max()) + 1 if ids.numel() else 0
    if cu_seqlens is not None:
        if (
            not isinstance(cu_seqlens, torch.Tensor)
            or cu_seqlens.dim() != 1
            or cu_seqlens.is_floating_point()
            or cu_seqlens.dtype == torch.bool
            or cu_seqlens.numel() < 2
        ):
            got = (
                f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
                if isinstance(cu_seqlens, torch.Tensor)
                else type(cu_seqlens).__name__
            )
            _fail(
                name, f"cu_seqlens must be a 1-D integer tensor (S + 1,) of boundaries, got {got}"
            )
        bounds = cu_seqlens.detach().to("cpu", torch.int64)
        total = target.numel()
        if int(bounds[0]) != 0 or bool((bounds[1:] < bounds[:-1]).any()) or int(bounds[-1]) > total:
            _fail(
                name,
                "cu_seqlens must start at 0, never decrease and end at most at the number of "
                f"tokens {total}, got {bounds.tolist()}",
            )
        flat = torch.searchsorted(bounds, torch.arange(total), right=True) - 1
        flat = torch.where(torch.arange(total) >= bounds[-1], -1, flat)
        return flat.view(target.shape), bounds.numel() - 1
    if target.dim() != 2:
        _fail(
            name,
            f"target has shape {tuple(target.shape)}; a padded batch is (B, T), one sequence per "
            "row; for packed sequences pass sequence= (an id per token) or cu_seqlens=",
        )
    rows = target.shape[0]
    return torch.arange(rows).repeat_interleave(target.shape[1]).view(target.shape), rows


def _group_ids(name: str, group: torch.Tensor | str | None, sequences: int) -> torch.Tensor:
    """Each sequence's group index (host, int64, 0..G-1 in ascending group order)."""
    if group is None:
        return torch.arange(sequences)
    if isinstance(group, str):
        if group != "pairs":
            _fail(name, f'group must be None, "pairs" or a tensor of group ids, got {group!r}')
        if sequences % 2:
            _fail(
                name,
                f'group="pairs" pairs sequence i with i + S/2 (chosen first, then rejected), '
                f"but there are {sequences} sequences, an odd number: a pair is split across "
                "the batch",
            )
        return torch.arange(sequences) % max(sequences // 2, 1)
    if (
        not isinstance(group, torch.Tensor)
        or group.is_floating_point()
        or group.dtype == torch.bool
        or tuple(group.shape) != (sequences,)
    ):
        got = (
            f"{group.dtype} of shape {tuple(group.shape)}"
            if isinstance(group, torch.Tensor)
            else type(group).__name__
        )
        _fail(
            name,
            f"group must be an integer tensor of shape ({sequences},) (a group id per "
            f"sequence), got {got}",
        )
    return torch.unique(group.detach().to("cpu", torch.int64), return_inverse=True)[1]


def sequence_layout(
    name: str,
    target: torch.Tensor,
    shifted: torch.Tensor,
    ignore_index: int,
    shift: int,
    *,
    sequence: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    group: torch.Tensor | str | None,
    device: torch.device,
) -> SequenceLayout:
    """The layout of a call: ``target`` as the caller gave it, ``shifted`` its labels after
    the shift (the target's shape); errors name ``name``."""
    ids, sequences = _sequence_ids(name, target, sequence, cu_seqlens)
    labels = shifted.detach().cpu()
    scored = (labels != ignore_index) & (ids >= 0)
    if shift:
        length = ids.shape[-1]
        same = torch.zeros_like(scored)
        same[..., : max(length - shift, 0)] = ids[..., : max(length - shift, 0)] == ids[..., shift:]
        scored &= same
    ids, scored = ids.reshape(-1), scored.reshape(-1)
    rows = torch.nonzero(scored)[:, 0]
    row_seq = ids[rows]
    lengths = torch.bincount(row_seq, minlength=sequences)
    empty = torch.nonzero(lengths == 0)[:, 0]
    if empty.numel():
        _fail(
            name,
            f"{empty.numel()} sequence(s) have no scored token (e.g. sequence "
            f"{empty[:5].tolist()}): every label of theirs is ignore_index={ignore_index} (or, with "
            "shift, lies in another sequence); a sequence objective needs at least one scored "
            "token per sequence: drop those sequences",
        )
    group_of = _group_ids(name, group, sequences)
    groups = int(group_of.max()) + 1 if sequences else 0
    # Sequences in (group, member) order: a stable sort keeps members in sequence order,
    # and "pairs" numbers the chosen answer (i < S/2) first.
    order = torch.sort(group_of, stable=True)[1]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(sequences)
    group_of_rank = group_of[order]
    sizes = torch.bincount(group_of, minlength=groups)
    uniform = int(sizes[0]) if groups and bool((sizes == sizes[0]).all()) else None
    group_tokens = torch.zeros(groups, dtype=torch.int64).index_add_(0, group_of, lengths)
    member_tokens = tuple(lengths[order].view(groups, uniform).sum(0).tolist()) if uniform else None
    row_rank = rank[row_seq]
    by_rank = torch.sort(row_rank, stable=True)[1]
    return SequenceLayout(
        valid=scored.view(-1, 1).to(device, non_blocking=True),
        lengths=lengths.to(device, non_blocking=True),
        totals=SequenceTotals(sequences, groups, int(rows.numel()), member_tokens),
        group_size=uniform,
        max_group_tokens=int(group_tokens.max()) if groups else 0,
        _order=order,
        _group_of_rank=group_of_rank,
        _group_tokens=group_tokens,
        _rows_by_rank=rows[by_rank],
        _rank_of_row=row_rank[by_rank],
        _seq_tokens_by_rank=lengths[order],
    )
