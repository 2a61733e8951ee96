r"""The token-objective head: a user's token-local loss, differentiated in the same pass.

Per chunk the head computes each valid token's log-probability (and entropy),
hands them to ``objective(logprob, entropy, **side)`` as leaf tensors, sums the
per-token losses and takes their gradients :math:`g = \partial L/\partial \log p_t`,
:math:`h = \partial L/\partial H` by the objective's own autograd on the
chunk's ``(B,)`` tensors. These are the upstream gradients of
:class:`~linear_ce.losses.token_logprob.TokenLogprobHead`, known while the
chunk's logits are still in the tile: the loop goes straight on to the
gradient GEMMs, three per training step. Without autograd at the call
(``torch.no_grad()``) the objective runs without a graph; with it, a result
that depends on any other tensor requiring grad is refused, as its gradient
could not flow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from linear_ce.engine.head import HeadFrame, RowStats
from linear_ce.engine.row_chunks import RowChunk
from linear_ce.losses.token_logprob import TokenLogprobHead, TokenOutputs

__all__ = ["ObjectiveHead", "TokenObjective", "other_leaf"]


@dataclasses.dataclass(frozen=True)
class TokenObjective:
    """A token objective as a call gives it: ``function(logprob, entropy, **side)``, whether
    it reads the entropy, its per-token ``side`` inputs ``(N, P)`` and the public function
    called (``name``: the objective's errors name it)."""

    function: Callable[..., torch.Tensor]
    entropy: bool
    side: dict[str, torch.Tensor]
    name: str


class ObjectiveHead(TokenLogprobHead):
    """Accumulates ``total`` (the objective summed over valid tokens, float64) and per-chunk
    upstream gradients. The objective's ``side`` inputs are sliced and compacted like the
    tokens before they reach it. ``grad_mode``: the call runs with autograd;
    ``differentiate``: a gradient is wanted."""

    #: Its outputs are the log-probabilities and entropy the loops form, on fp32 tiles too.
    native_fp32 = True

    def __init__(
        self, frame: HeadFrame, objective: TokenObjective, *, grad_mode: bool, differentiate: bool
    ) -> None:
        super().__init__(frame, outputs=TokenOutputs(entropy=objective.entropy))
        self.objective, self.side, self.name = objective.function, objective.side, objective.name
        self.grad_mode, self.differentiate = grad_mode, differentiate
        # A scalar: summed in float64 so the chunk sums do not round against each other.
        self.total = torch.zeros((), dtype=torch.float64, device=frame.target.device)
        self.chunk_grads: list[torch.Tensor | None] = [None, None]

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        super().rows_done(rows, p, stats)
        acc = self.logprob.dtype
        side = {k: v[rows, p] for k, v in self.side.items()}
        logprob = self.logprob[rows, p]
        entropy = self.entropy[rows, p] if self.entropy_on else None
        if not self.grad_mode:
            # The caller runs without autograd: no gradient is wanted, none is taken.
            self.total += self._losses(logprob, entropy, side).sum().double()
            return
        with torch.enable_grad():
            logprob = logprob.detach().requires_grad_(self.differentiate)
            if entropy is not None:
                entropy = entropy.detach().requires_grad_(self.differentiate)
            leaves = [logprob] if entropy is None else [logprob, entropy]
            total = self._losses(logprob, entropy, side).sum()
            self._refuse_other_leaves(total, leaves)
            grads = (
                torch.autograd.grad(total, leaves, allow_unused=True)
                if self.differentiate and total.requires_grad
                else [None] * len(leaves)
            )
        self.total += total.detach().double()
        # No finiteness check: a NaN (in the hidden state, a side input, or made by the
        # objective) reaches the gradients of the rows it touches, as in plain autograd.
        self.chunk_grads = [None if g is None else g.to(acc) for g in (*grads, None)[:2]]

    def _losses(
        self, logprob: torch.Tensor, entropy: torch.Tensor | None, side: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        loss = self.objective(logprob, entropy, **side)
        if not isinstance(loss, torch.Tensor) or loss.shape != logprob.shape:
            raise ValueError(
                f"{self.name}: objective must return one loss per token, a tensor of shape "
                f"{tuple(logprob.shape)} (the chunk's valid tokens), got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            )
        return loss

    def _refuse_other_leaves(self, total: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        """Raises when the chunk's loss depends on a tensor that requires grad other than
        ``leaves`` (:func:`other_leaf`): only ``leaves`` are differentiated, so its gradient
        would be lost."""
        variable = other_leaf(total, leaves)
        if variable is not None:
            raise ValueError(
                f"{self.name}: objective's result depends on a tensor that requires grad "
                f"other than its logprob and entropy arguments (shape "
                f"{tuple(variable.shape)}, e.g. one it closes over); {self.name} "
                "differentiates the objective with respect to logprob and entropy only, "
                "so that tensor's gradient would be lost. Pass per-token data as a side "
                f"input ({self.name}(..., name=tensor.detach())), detach the tensor, or "
                f"apply a learnable factor outside the call (coef * {self.name}(...))"
            )

    def upstream(self, rows: RowChunk, p: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.chunk_grads[0], self.chunk_grads[1]


def other_leaf(total: torch.Tensor, leaves: list[torch.Tensor]) -> torch.Tensor | None:
    """A tensor that requires grad, other than ``leaves``, that ``total`` depends on (one an
    objective closes over; side inputs are detached data), or ``None``. A walk of the
    objective's graph on the host: tens of nodes, no device work."""
    if not total.requires_grad:
        return None
    stack, seen = [total.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is None:
            stack.extend(next_node for next_node, _ in node.next_functions)
        elif not any(variable is leaf for leaf in leaves):
            return variable
    return None
