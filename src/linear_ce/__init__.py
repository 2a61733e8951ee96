"""linear_ce: ``cross_entropy(linear(x, W, b), t)`` without the ``(N, V)`` logits.

>>> import torch, linear_ce
>>> x, W = torch.randn(8, 16, requires_grad=True), torch.randn(100, 16, requires_grad=True)
>>> loss = linear_ce.linear_cross_entropy(x, W, torch.randint(0, 100, (8,)))
"""

import importlib.metadata

from linear_ce import objectives, reference
from linear_ce.divergence import linear_divergence
from linear_ce.functional import linear_cross_entropy
from linear_ce.memory import kept_scratch_bytes, release_scratch
from linear_ce.module import LinearCrossEntropyLoss
from linear_ce.options import LinearCrossEntropyOptions
from linear_ce.outputs import LinearCrossEntropyOutput
from linear_ce.parallel.shard import VocabParallel
from linear_ce.sequence_objective import SequenceObjectiveOutput, sequence_objective
from linear_ce.sparse_divergence import sparse_divergence
from linear_ce.token_logprobs import (
    TokenLogprobs,
    token_logprobs,
    token_logprobs_and_stats,
    token_logprobs_vjp,
)
from linear_ce.token_objective import token_objective

__all__ = [
    "LinearCrossEntropyLoss",
    "LinearCrossEntropyOptions",
    "LinearCrossEntropyOutput",
    "SequenceObjectiveOutput",
    "TokenLogprobs",
    "VocabParallel",
    "kept_scratch_bytes",
    "linear_cross_entropy",
    "linear_divergence",
    "objectives",
    "reference",
    "release_scratch",
    "sequence_objective",
    "sparse_divergence",
    "token_logprobs",
    "token_logprobs_and_stats",
    "token_logprobs_vjp",
    "token_objective",
]

# pyproject.toml is the one place the version is written; the installed metadata carries it.
# A source tree put on sys.path without installing it has no metadata.
try:
    __version__ = importlib.metadata.version("linear-ce")
except importlib.metadata.PackageNotFoundError:
    __version__ = "0+unknown"
