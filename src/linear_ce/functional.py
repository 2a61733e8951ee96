"""The cross-entropy family's public function, ``linear_cross_entropy``.

It checks its call, then runs the op path (:mod:`linear_ce.ops.cross_entropy`) on the
vocabulary it sees: the whole of it, or (``vocab_parallel``) this rank's shard of a
process group.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from linear_ce.checks.call import (
    Call,
    HeadArguments,
    LossArguments,
    TransformArguments,
    check_call,
    gathered,
)
from linear_ce.engine.chunk_loop import Needs
from linear_ce.engine.plan import reported_dtype
from linear_ce.losses.cross_entropy import mean_denominator
from linear_ce.ops.cross_entropy import (
    SCHEMA,
    CrossEntropyArguments,
    chunked_rows,
    chunked_scalar,
    cross_entropy_on_shard,
)
from linear_ce.options import LinearCrossEntropyOptions, resolve_options
from linear_ce.outputs import LinearCrossEntropyOutput
from linear_ce.parallel.dtensor import accepts_dtensors
from linear_ce.parallel.shard import VocabParallel, vocab_shard

__all__ = ["linear_cross_entropy"]

_NAME = "linear_cross_entropy"


@torch.compiler.assume_constant_result
def _promote_retain_graph() -> bool:
    """Warn that ``allow_retain_graph`` becomes True and return True.

    A compiled backward cannot guard a second backward (the hand-over of the
    stored gradients is a Python-side mutation the compiled graph does not
    replay), so it must copy. Marked constant so Dynamo runs it once while
    tracing instead of breaking the graph on ``warnings.warn``.
    """
    warnings.warn(
        "linear_cross_entropy: allow_retain_graph is set to True under torch.compile "
        "(a compiled backward cannot guard a second backward); this costs one "
        "gradient-sized copy per backward. Pass allow_retain_graph=True to silence.",
        stacklevel=3,
    )
    return True


def _weight_total(arguments: Mapping[str, Any], num_classes: int | None) -> torch.Tensor:
    """What "mean" divides this rank's summed loss by (its rows' weights), for DTensor
    inputs split along rows."""
    head = gathered(HeadArguments, arguments)
    transform = gathered(TransformArguments, arguments)
    terms = gathered(LossArguments, {**arguments, "reduction": "sum"})
    return mean_denominator(check_call(_NAME, head, transform, terms, num_classes=num_classes))


def _result(
    loss: torch.Tensor,
    z_term: torch.Tensor,
    lse: torch.Tensor,
    call: Call,
    return_z_loss: bool,
    return_lse: bool,
) -> torch.Tensor | LinearCrossEntropyOutput:
    if call.reduction == "none":
        loss, z_term = loss.view(call.loss_shape), z_term.view(call.loss_shape)
    if not (return_z_loss or return_lse):
        return loss
    return LinearCrossEntropyOutput(
        loss,
        z_term.detach() if return_z_loss else None,
        lse.view(call.loss_shape) if return_lse else None,
    )


@accepts_dtensors(
    rows=("input", "target", "token_weight"),
    heads=("linear_weight", "linear_bias"),
    whole=("weight",),
    vocab_parallel=True,
    mean=_weight_total,
)
def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options: LinearCrossEntropyOptions | None = None,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    return_lse: bool = False,
    softcap: float | None = None,
    shift: bool | int = False,
    token_weight: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
    loss_dtype: torch.dtype | None = None,
    vocab_parallel: VocabParallel | None = None,
) -> torch.Tensor | LinearCrossEntropyOutput:
    r"""Cross entropy of a linear projection, without materialising the logits.

    Equal to ``cross_entropy(linear(input, linear_weight, linear_bias)
    .view(*batch, C, *out_features), target, weight=weight,
    ignore_index=ignore_index, reduction=reduction,
    label_smoothing=label_smoothing)`` but computed over chunks of rows, so
    no ``(N, C)`` tensor ever exists: for ``reduction`` "mean"/"sum" the
    gradients are computed during forward (one pass, three GEMMs) and
    backward only scales them; for "none" backward recomputes each chunk.

    Per row :math:`i` with logits :math:`s_i` (after softcap) the loss is

    .. math::
        \ell_i = \tau_i\Big[\sum_j a_{ij}\big(\mathrm{lse}(s_i) - s_{ij}\big)
                 + \lambda\,\omega_i\,\mathrm{lse}(s_i)^2\Big]

    where :math:`a_{ij}` is torch's (class-weighted, smoothed) target
    distribution, :math:`\omega_i` the class weight of the target,
    :math:`\tau_i` the token weight and :math:`\lambda` the z-loss; "mean"
    divides :math:`\sum_i \ell_i` by :math:`\sum_i \omega_i` (by the number of
    rows for probability targets), exactly as torch does without extras.

    Args:
        input: ``(*, F)`` hidden states (``(F)`` for one row).
        linear_weight: ``(C, F)``, or ``(C, d1, …, dK, F)`` for a K-dimensional loss.
        target: class indices ``(*)`` / ``(*, d1, …, dK)`` (int64, int32, int16, int8 or
            uint8), or probabilities of the logits' shape ``(*, C, d1, …, dK)`` in the input
            dtype.
        linear_bias: ``(C, d1, …, dK)`` or ``None``.
        weight: class weights ``(C,)`` in the input dtype, or ``None``.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (shape ``(*)`` / ``(*, d1, …, dK)``).
        ignore_index: class index whose rows are skipped; ``None`` means -100.
            Not allowed with probability targets.
        label_smoothing: in ``[0, 1]``, torch's definition.
        options: :class:`LinearCrossEntropyOptions`; ``None`` means the defaults
            (chunked). The plain expression is :func:`linear_ce.reference.linear_cross_entropy`.
        z_loss: :math:`\lambda \ge 0`, adds :math:`\lambda\,\omega_i\,\mathrm{lse}_i^2`
            per row, reduced like the loss (PaLM's auxiliary loss).
        return_z_loss: also return the z-loss term alone (detached).
        return_lse: also return the per-row log-sum-exp, shape as ``"none"``, with its
            gradient (softmax times its upstream gradient; for ``"mean"``/``"sum"`` a
            backward where it gets one recomputes the gradients in one more pass).
        softcap: if set, logits become ``softcap·tanh(logits/softcap)`` (Gemma 2).
        shift: ``True`` or ``k``: position ``t`` of the sequence (second-to-last
            input dimension) predicts label ``t+k``; the last ``k`` positions are
            ignored. The hidden states are not copied.
        token_weight: ``(*)`` per-row weights :math:`\tau` multiplied into each
            row's loss; the "mean" denominator does not include them.
        logit_scale: :math:`\sigma > 0`; the logits are ``(input Wᵀ + b)·σ`` before the
            softcap (Cohere, Granite, Falcon-H1 scale their logits).
        temperature: :math:`T > 0`; the (softcapped) logits are divided by it last.
        loss_dtype: the dtype of the returned loss (per-row losses for ``"none"``):
            ``None`` is the input dtype, as torch, except under ``torch.autocast``, where
            it is the accumulation dtype (fp32 for half inputs), as autocast's
            ``cross_entropy``; or the accumulation dtype explicitly (the loss is computed
            there, so a bf16 run can log it unrounded). Gradients keep the parameters' dtypes.
        vocab_parallel: ``None`` for a whole head, or a :class:`~linear_ce.VocabParallel`:
            the head given is this rank's shard of one split along the vocabulary (what that
            means, the same for every family, is said there). Collectives: per chunk of
            valid rows and output position, one all_reduce MAX of the row maxima and one
            all_reduce SUM of the row sums; one all_reduce of the input gradient when input
            requires grad ("mean"/"sum": all in forward, backward communicates nothing;
            "none": backward recomputes the chunks and repeats them); one all_gather of the
            shard sizes when vocab_parallel does not place the shard.

    Rows whose target is ``ignore_index`` cost nothing: they take part in no GEMM;
    their ``"none"`` loss, lse and gradient are exactly zero.

    Returns:
        The loss, or :class:`LinearCrossEntropyOutput` ``(loss, z_loss, lse)``
        when ``return_z_loss`` or ``return_lse`` is set.

    Example::

        >>> import torch, linear_ce
        >>> hidden = torch.randn(2, 16, 64, requires_grad=True)   # (B, T, F)
        >>> lm_head = torch.randn(1000, 64, requires_grad=True)   # (V, F)
        >>> labels = torch.randint(0, 1000, (2, 16))
        >>> loss = linear_ce.linear_cross_entropy(hidden, lm_head, labels, shift=True)
        >>> loss.backward()
    """

    head = HeadArguments(input, linear_weight, target, linear_bias, ignore_index, shift)
    transform = TransformArguments(temperature, logit_scale, softcap)
    terms = LossArguments(weight, reduction, label_smoothing, z_loss, token_weight)
    shard = vocab_shard(_NAME, "linear_weight", linear_weight, vocab_parallel, out_features=True)
    call = check_call(
        _NAME, head, transform, terms, num_classes=None if shard is None else shard.total
    )
    options = resolve_options(options, _NAME)
    reported = reported_dtype(_NAME, call.input, options, loss_dtype)
    if shard is not None:
        loss, z_term, lse = cross_entropy_on_shard(call, options, shard, reported, return_lse)
        return _result(loss, z_term, lse, call, return_z_loss, return_lse)
    if call.reduction == "none":
        arguments = CrossEntropyArguments.of(call, options, Needs(False, False, False))
        loss, z_term, lse = chunked_rows(*SCHEMA.flatten(arguments))[:3]
    else:
        allow_retain_graph = options.allow_retain_graph
        if not allow_retain_graph and torch.compiler.is_compiling():
            allow_retain_graph = _promote_retain_graph()
        needs = Needs.of(call.input, call.linear_weight, call.linear_bias)
        arguments = CrossEntropyArguments.of(call, options, needs, allow_retain_graph, return_lse)
        loss, z_term, lse = chunked_scalar(*SCHEMA.flatten(arguments))[:3]
    return _result(loss.to(reported), z_term, lse, call, return_z_loss, return_lse)
