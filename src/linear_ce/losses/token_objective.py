r"""The token-objective head: a user's token-local loss, differentiated in the same pass.

Per chunk the head computes each valid token's log-probability (and entropy),
hands them to ``objective(logprob, entropy, **side)`` as leaf tensors, sums the
per-token losses and takes their gradients :math:`g = \partial L/\partial \log p_t`,
:math:`h = \partial L/\partial H` by the objective's own autograd on the
chunk's ``(B,)`` tensors. These are the upstream gradients of
:class:`~linear_ce.losses.token_logprob.TokenLogprobHead`, known while the
chunk's logits are still in the tile: the loop goes straight on to the
gradient GEMMs, three per training step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from linear_ce.engine.head import RowStats
from linear_ce.engine.row_chunks import RowChunk
from linear_ce.losses.token_logprob import TokenLogprobHead, TokenOutputs

__all__ = ["ObjectiveHead"]


class ObjectiveHead(TokenLogprobHead):
    """Accumulates ``total`` (the objective summed over valid tokens, float64) and per-chunk
    upstream gradients. ``side`` maps names to ``(N, P)`` per-token tensors, sliced
    and compacted like the tokens before they reach ``objective``."""

    def __init__(
        self,
        target: torch.Tensor,
        valid: torch.Tensor,
        vocab_start: int,
        local_classes: int,
        acc_dtype: torch.dtype,
        *,
        objective: Callable[..., torch.Tensor],
        entropy: bool,
        side: dict[str, torch.Tensor],
        name: str,
    ) -> None:
        super().__init__(
            target,
            valid,
            vocab_start,
            local_classes,
            acc_dtype,
            outputs=TokenOutputs(entropy=entropy),
        )
        self.objective, self.side, self.name = objective, side, name
        # A scalar: summed in float64 so the chunk sums do not round against each other.
        self.total = torch.zeros((), dtype=torch.float64, device=target.device)

    def rows_done(self, rows: RowChunk, p: int, stats: RowStats) -> None:
        super().rows_done(rows, p, stats)
        acc = self.logprob.dtype
        with torch.enable_grad():
            logprob = self.logprob[rows, p].detach().requires_grad_()
            entropy = self.entropy[rows, p].detach().requires_grad_() if self.entropy_on else None
            side = {k: v[rows, p] for k, v in self.side.items()}
            loss = self.objective(logprob, entropy, **side)
            if not isinstance(loss, torch.Tensor) or loss.shape != logprob.shape:
                raise ValueError(
                    f"{self.name}: objective must return one loss per token, a tensor of shape "
                    f"{tuple(logprob.shape)} (the chunk's valid tokens), got "
                    f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
                )
            leaves = [logprob] if entropy is None else [logprob, entropy]
            total = loss.sum()
            grads = (
                torch.autograd.grad(total, leaves, allow_unused=True)
                if total.requires_grad
                else [None] * len(leaves)
            )
        self.total += total.detach().double()
        self.chunk_grads = [None if g is None else g.to(acc) for g in (*grads, None)[:2]]
        for label, g in zip(("logprob", "entropy"), self.chunk_grads, strict=True):
            if g is not None and not bool(torch.isfinite(g).all()):
                raise FloatingPointError(
                    f"{self.name}: the objective's gradient with respect to {label} is not "
                    "finite for some token; check the objective and its side inputs"
                )

    def upstream(self, rows: RowChunk, p: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.chunk_grads[0], self.chunk_grads[1]
