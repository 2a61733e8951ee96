"""Argument checking of a call whose loss is a Python callable run on the chunks' valid
tokens (``token_objective``, ``sequence_objective``, on a whole head or a vocab-parallel
shard)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from linear_ce.checks.call import (
    Call,
    Caller,
    HeadArguments,
    TransformArguments,
    check_not_vmapped,
    check_token_call,
)
from linear_ce.checks.targets import check_class_indices
from linear_ce.engine.vocab import LocalVocab, Vocab

__all__ = ["check_objective_call"]


def check_objective_call(
    name: str,
    head: HeadArguments,
    transform: TransformArguments,
    objective: Callable[..., object],
    entropy: bool,
    others: Mapping[str, object],
    vocab: Vocab | None,
) -> tuple[Call, Vocab]:
    """The checked per-token call of an objective function (errors name ``name``) and the
    vocabulary it runs on: ``vocab``, a vocab-parallel shard, or ``None`` for the whole
    vocabulary in the head. None of the tensors (the head's and ``others``, the side
    inputs and layout) is batched by ``vmap``, the objective is callable and gets the
    entropy it reads, and the class indices lie in the vocabulary: the objective runs
    outside any custom op, so they are checked here, once, before the loop."""
    caller = Caller(name)
    check_not_vmapped(
        caller,
        {**head.tensors(), **others},
        f"call {name} on the whole batch instead: it takes any leading dimensions itself",
    )
    if not callable(objective):
        caller.fail(f"objective must be callable, got {type(objective).__name__}")
    if getattr(objective, "needs_entropy", False) and entropy is False:
        caller.fail(f"objective {objective!r} reads the entropy; pass entropy=True")
    call = check_token_call(
        name,
        head,
        transform,
        flags={"entropy": entropy},
        num_classes=None if vocab is None else vocab.total,
    )
    vocab = LocalVocab(call.linear_weight.shape[0]) if vocab is None else vocab
    check_class_indices(call.target, call.ignore_index, vocab.total, name)
    return call, vocab
