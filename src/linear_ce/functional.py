"""The cross-entropy family's public functions: ``linear_cross_entropy`` and its
vocab-parallel front (documented under :mod:`linear_ce.distributed`).

Each checks its call, then runs the same op path (:mod:`linear_ce.ops.cross_entropy`)
on the vocabulary it sees: the whole of it, or this rank's shard of a process group.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

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
from linear_ce.parallel.dtensor import accepts_dtensors, called_as
from linear_ce.parallel.shard import vocab_shard

__all__ = ["linear_cross_entropy", "vocab_parallel_linear_cross_entropy"]

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
        lse.view(call.loss_shape).detach() if return_lse else None,
    )


def vocab_parallel_linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    num_classes: int | None = None,
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
) -> torch.Tensor | LinearCrossEntropyOutput:
    r""":func:`linear_ce.linear_cross_entropy` with the weight sharded along the vocabulary.

    Every rank of ``process_group`` calls this with its own shard of the
    output projection and the same ``input``, ``target``, ``weight`` and
    ``token_weight``; every rank gets the same loss, equal to
    ``linear_cross_entropy(input, W, target, ...)`` on the full
    :math:`W = \mathrm{cat}(\text{shards})`. Gradients: ``linear_weight`` and
    ``linear_bias`` get the gradient of their own rows (the matching slice of
    the full one), ``input`` the full gradient (summed over ranks). The
    collectives per call are listed in :mod:`linear_ce.distributed`.

    All ranks must make the same calls with the same shapes, options,
    ``requires_grad`` flags and upstream gradient (as when the loss is used
    the same way on every rank); otherwise the collectives do not match up.

    Args:
        input: ``(*, F)`` hidden states, the same on every rank.
        linear_weight: this rank's shard ``(V_r, F)`` (or ``(V_r, d1, …, dK, F)``),
            rows ``[vocab_start, vocab_start + V_r)`` of the full weight. A
            DTensor is rejected: pass ``.to_local()`` and its mesh's group.
        target: class indices into the whole vocabulary ``[0, num_classes)``, or
            probabilities ``(*, num_classes, d1, …, dK)`` over the whole vocabulary.
        process_group: the group the vocabulary is sharded over; ``None`` is the
            default (world) group.
        vocab_start: first class of this rank's shard. With ``num_classes``, or
            neither: then both come from one all_gather of the shard sizes, in
            rank order (see :func:`~linear_ce.distributed.shard_layout`). Shards may be uneven.
        num_classes: classes of the whole vocabulary.
        linear_bias: this rank's bias shard ``(V_r, d1, …, dK)`` or ``None``.
        weight: class weights of the whole vocabulary ``(num_classes,)``.
        reduction, ignore_index, label_smoothing, options, z_loss, return_z_loss,
        return_lse, softcap, shift, token_weight, logit_scale, temperature, loss_dtype: as in
            :func:`linear_ce.linear_cross_entropy`; ``options`` must be the same
            on every rank (the chunk size is planned from ``⌈num_classes / world⌉``
            so that every rank runs the same number of chunks).

    Returns:
        The loss (identical on every rank), or :class:`LinearCrossEntropyOutput`
        ``(loss, z_loss, lse)`` when ``return_z_loss`` or ``return_lse`` is set.

    Example (one process per GPU, e.g. under ``torchrun``)::

        >>> dist.init_process_group("nccl")
        >>> rank, world = dist.get_rank(), dist.get_world_size()
        >>> shard = full_lm_head.chunk(world)[rank].clone().requires_grad_()  # (V_r, F)
        >>> loss = vocab_parallel_linear_cross_entropy(hidden, shard, labels, shift=True)
        >>> loss.backward()   # shard.grad: its rows; hidden.grad: summed over ranks
    """

    name = called_as("vocab_parallel_linear_cross_entropy")
    head = HeadArguments(input, linear_weight, target, linear_bias, ignore_index, shift)
    transform = TransformArguments(temperature, logit_scale, softcap)
    terms = LossArguments(weight, reduction, label_smoothing, z_loss, token_weight)
    tensors = {**head.tensors(), "weight": weight, "token_weight": token_weight}
    shard = vocab_shard(
        name, tensors, "linear_weight", process_group, vocab_start, num_classes, out_features=True
    )
    options = resolve_options(options, name)
    call = check_call(name, head, transform, terms, num_classes=shard.total)
    reported = reported_dtype(name, call.input, options, loss_dtype)
    loss, z_term, lse = cross_entropy_on_shard(call, options, shard, reported)
    return _result(loss, z_term, lse, call, return_z_loss, return_lse)


@accepts_dtensors(
    rows=("input", "target", "token_weight"),
    heads=("linear_weight", "linear_bias"),
    whole=("weight",),
    vocab_parallel=vocab_parallel_linear_cross_entropy,
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
        return_lse: also return the per-row log-sum-exp (detached), shape as ``"none"``.
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
    call = check_call(_NAME, head, transform, terms)
    options = resolve_options(options, _NAME)
    reported = reported_dtype(_NAME, call.input, options, loss_dtype)
    if call.reduction == "none":
        arguments = CrossEntropyArguments.of(call, options, Needs(False, False, False))
        loss, z_term, lse = chunked_rows(*SCHEMA.flatten(arguments))[:3]
    else:
        allow_retain_graph = options.allow_retain_graph
        if not allow_retain_graph and torch.compiler.is_compiling():
            allow_retain_graph = _promote_retain_graph()
        needs = Needs.of(call.input, call.linear_weight, call.linear_bias)
        arguments = CrossEntropyArguments.of(call, options, needs, allow_retain_graph)
        loss, z_term, lse = chunked_scalar(*SCHEMA.flatten(arguments))[:3]
    return _result(loss.to(reported), z_term, lse, call, return_z_loss, return_lse)
