"""The result types of the public functions that return more than one tensor."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["LinearCrossEntropyOutput", "TokenLogprobs"]


class LinearCrossEntropyOutput(NamedTuple):
    r"""``(loss, z_loss, lse)``, returned when ``return_z_loss`` or ``return_lse`` is set.

    ``z_loss`` is the z-loss term alone, reduced like ``loss`` (already included
    in ``loss``), detached (``requires_grad=False``): it is for logging. ``lse`` is
    the per-token log-sum-exp of the (transformed) logits, of the loss's per-token
    shape, 0 on ignored tokens, with its gradient
    (:math:`\partial\,\mathrm{lse}_i / \partial s_{ij} = \mathrm{softmax}(s_i)_j`;
    the constant 0 of an ignored token has none). A field that was not asked for is
    ``None``.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None
    lse: torch.Tensor | None


class TokenLogprobs(NamedTuple):
    """What :func:`linear_ce.token_logprobs` returns; each field has the target's shape.

    ``logprob``, ``entropy``, ``log_sum_sq_prob`` and ``mean_logit`` are in the
    accumulation dtype (float32 for float16/bfloat16 inputs, float64 for float64);
    ``top1`` is bool. ``topk_logprobs`` (accumulation dtype) and ``topk_ids`` (int64)
    have one more dimension, of ``k`` (``topk=k``): each token's ``k`` largest
    log-probabilities in descending order and their token ids, ``-inf`` and ``-1`` at an
    ignored token. A field that was not asked for is ``None``.
    """

    logprob: torch.Tensor
    entropy: torch.Tensor | None
    top1: torch.Tensor | None
    log_sum_sq_prob: torch.Tensor | None = None
    mean_logit: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
