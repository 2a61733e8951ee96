r"""Vocab-parallel linear cross-entropy over ``torch.distributed``.

Tensor-parallel training shards the output projection along the vocabulary:
rank :math:`r` of a process group holds rows
:math:`[\mathrm{start}_r, \mathrm{start}_r + V_r)` of :math:`W` (and of the
bias), while every rank holds the same hidden states, targets, class weights
and token weights. Each rank runs the ordinary chunk loop
(:mod:`linear_ce.chunked`) on its shard; per chunk of rows and output position
the row statistics are combined with two collectives,

.. math::

    m_i = \max_r \max_{j \in r} s_{ij} \quad (\text{all\_reduce MAX}),
    \qquad
    \Big[\sum_j e^{s_{ij} - m_i},\; \sum_j a_{ij}(s_{ij} - m_i)\Big]
    \quad (\text{one all\_reduce SUM of a } (B, 2) \text{ tensor}),

after which the loss and the log-sum-exp are identical on every rank. The
logit gradient of a class lives on the rank that holds it, so ``grad_W`` and
``grad_b`` stay local, while the input gradient
:math:`\sum_r G_r W_r` is summed over ranks by one all_reduce of ``N·F``
values per call.

Collectives per call, with ``K = Σ_p ⌈N_p / B⌉`` chunks of ``B`` rows over the
``P`` output positions (``P = 1`` for ordinary ``(V, F)`` weights), where
``N_p`` counts the rows whose target at position ``p`` is not ``ignore_index``
(every rank sees the same targets, so every rank skips the same rows and runs
the same chunks):

- ``reduction`` "mean"/"sum": ``2·K`` all_reduce in forward, plus one
  all_reduce of the input gradient (in forward, where the gradients are
  computed) when ``input`` requires grad; backward communicates nothing.
- ``reduction="none"``: ``2·K`` in forward; backward recomputes the chunks,
  ``2·K`` again, plus one all_reduce of the input gradient.
- one all_gather of the shard sizes when ``vocab_start``/``num_classes`` are
  not given (see :func:`shard_layout` to do it once and pass the result).

:func:`vocab_parallel_token_logprobs` and :func:`vocab_parallel_token_objective` do the same
for the per-token heads. DTensor arguments of the public functions reach these functions
through :mod:`linear_ce.dtensor`.

Only ``torch.distributed`` collectives are used, so any backend that
implements all_reduce (MAX, SUM) and all_gather works: gloo for CPU tensors,
NCCL for CUDA tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from linear_ce.arguments import Call, check_call, check_token_call, check_top1_rule, with_scales
from linear_ce.chunked import run_chunks, tiles_for
from linear_ce.divergence import DivergenceCall, check_divergence_call
from linear_ce.functional import reported_dtype
from linear_ce.losses.cross_entropy import CrossEntropyHead, run_cross_entropy
from linear_ce.losses.token_logprob import TokenLogprobGradient, TokenLogprobHead, TokenOutputs
from linear_ce.ops import _check_targets, hand_over_gradients
from linear_ce.ops_divergence import run_divergence, scalar_row_weight
from linear_ce.ops_token import refuse_statistic_gradients
from linear_ce.options import LinearCrossEntropyOptions, resolve_options
from linear_ce.output import LinearCrossEntropyOutput
from linear_ce.plan import Plan, acc_dtype_for, make_plan
from linear_ce.token_logprobs import TokenLogprobs
from linear_ce.token_objective import objective_loss
from linear_ce.transform import check_scales
from linear_ce.vocab_pass import vocab_pass_gradients

__all__ = [
    "VocabShard",
    "shard_layout",
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_linear_divergence",
    "vocab_parallel_token_logprobs",
    "vocab_parallel_token_objective",
]

_NAME = "vocab_parallel_linear_cross_entropy"


class VocabShard:
    """Classes ``[start, start + V_local)`` of ``total`` classes split over ``group``.

    The vocab object of :func:`linear_ce.chunked.run_chunks`: row statistics
    are combined over the group by ``all_reduce``, in place.
    """

    def __init__(self, start: int, total: int, group: dist.ProcessGroup | None) -> None:
        self.start = start
        self.total = total
        self.group = group

    def max_(self, row_max: torch.Tensor) -> None:
        """Make ``row_max`` the maximum over every shard, in place."""
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=self.group)

    def sum_(self, row_sums: torch.Tensor) -> None:
        """Make ``row_sums`` the sum over every shard, in place."""
        dist.all_reduce(row_sums, op=dist.ReduceOp.SUM, group=self.group)


def shard_layout(
    linear_weight: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> tuple[int, int]:
    """``(vocab_start, num_classes)`` of this rank's shard, by one all_gather of the shard sizes.

    Ranks hold consecutive slices in rank order: ``vocab_start`` is the sum of
    the lower ranks' ``linear_weight.shape[0]``, ``num_classes`` the sum over
    all ranks. Shards may differ in size but none may be empty. Call it once
    and pass the result to :func:`vocab_parallel_linear_cross_entropy` to save
    the collective on every call.

    Example::

        >>> vocab_start, num_classes = shard_layout(lm_head_shard, group)
    """
    _require_group(process_group)
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    mine = torch.tensor([linear_weight.shape[0]], dtype=torch.int64, device=linear_weight.device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=process_group)
    counts = [int(s) for s in sizes]
    empty = [r for r, c in enumerate(counts) if c == 0]
    if empty:
        raise ValueError(
            f"{_NAME}: every rank must hold at least one class, but ranks {empty} hold an "
            f"empty shard (shard sizes {counts})"
        )
    return sum(counts[:rank]), sum(counts)


def _require_group(process_group: dist.ProcessGroup | None) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{_NAME}: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) first (or use "
            "linear_ce.linear_cross_entropy for a weight that is not sharded)"
        )
    if dist.get_rank(process_group) < 0:
        raise RuntimeError(f"{_NAME}: this process is not a member of process_group")


def _reject_dtensors(**tensors: torch.Tensor | None) -> None:
    """A DTensor would hide the shard layout behind its own dispatch; ask for local tensors."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    for name, value in tensors.items():
        if isinstance(value, DTensor):
            raise TypeError(
                f"{_NAME}: {name} is a DTensor, which these functions do not take; pass the "
                "DTensors to linear_ce.linear_cross_entropy (token_logprobs, token_objective) "
                "itself, which lays them out on their mesh, or pass plain tensors here: "
                "the local vocabulary shard linear_weight.to_local() (and linear_bias.to_local()) "
                "of a weight sharded on dim 0, the replicated input, target, weight and "
                "token_weight as local tensors (.to_local() / .full_tensor()), and "
                "process_group=linear_weight.device_mesh.get_group()"
            )


def _layout(
    linear_weight: torch.Tensor,
    process_group: dist.ProcessGroup | None,
    vocab_start: int | None,
    num_classes: int | None,
) -> tuple[int, int]:
    if vocab_start is None and num_classes is None:
        return shard_layout(linear_weight, process_group)
    if vocab_start is None or num_classes is None:
        raise ValueError(
            f"{_NAME}: pass both vocab_start and num_classes, or neither (then they are "
            f"gathered from the shard sizes); got vocab_start={vocab_start!r}, "
            f"num_classes={num_classes!r}"
        )
    for name, value in (("vocab_start", vocab_start), ("num_classes", num_classes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{_NAME}: {name} must be an int, got {value!r}")
    local = linear_weight.shape[0]
    if local == 0:
        raise ValueError(f"{_NAME}: the local shard linear_weight holds no class (shape[0] == 0)")
    if vocab_start < 0 or vocab_start + local > num_classes:
        raise ValueError(
            f"{_NAME}: the local shard [vocab_start, vocab_start + {local}) = "
            f"[{vocab_start}, {vocab_start + local}) does not lie in [0, num_classes={num_classes})"
        )
    return vocab_start, num_classes


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything about a call except the three differentiable tensors."""

    call: Call
    plan: Plan
    shard: VocabShard
    needs: tuple[bool, bool, bool]
    allow_retain_graph: bool
    loss_dtype: torch.dtype


def _with(call: Call, input, weight, bias) -> Call:
    return dataclasses.replace(call, input=input, linear_weight=weight, linear_bias=bias)


class _VocabParallelLoss(torch.autograd.Function):
    """Loss of one shard's call; see the module doc for what is communicated when."""

    @staticmethod
    def forward(ctx, input, weight, bias, spec: _Spec):
        call = _with(spec.call, input, weight, bias)
        shard = spec.shard
        scalar = call.reduction != "none"
        terms, head, grads = run_cross_entropy(
            call,
            spec.plan,
            needs=spec.needs if scalar else (False, False, False),
            vocab=shard,
            num_classes=shard.total,
        )
        ctx.spec = spec
        if scalar:
            if grads.input is not None:
                shard.sum_(grads.input)
            ctx.grads = [grads.input, grads.weight, grads.bias]
            loss = terms.reduce(head.row_loss).to(spec.loss_dtype)
            z_term = terms.reduce(terms.z_rows(head.lse))
        else:
            ctx.save_for_backward(
                input.detach(), weight.detach(), None if bias is None else bias.detach()
            )
            loss = head.row_loss.to(spec.loss_dtype)
            z_term = terms.z_rows(head.lse)
        ctx.mark_non_differentiable(z_term, head.lse)
        return loss, z_term, head.lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_z, _grad_lse):
        spec: _Spec = ctx.spec
        if spec.call.reduction != "none":
            scaled = hand_over_gradients(ctx, spec.needs, grad_loss, spec.allow_retain_graph)
            return (*scaled, None)

        input, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        call = _with(spec.call, input, weight, bias)
        shard = spec.shard
        _, _, grads = run_cross_entropy(
            call,
            spec.plan,
            needs=(need_x, need_w, need_b),
            grad_output=grad_loss.contiguous(),
            vocab=shard,
            num_classes=shard.total,
        )
        if grads.input is not None:
            shard.sum_(grads.input)
        return grads.input, grads.weight, grads.bias, None


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
            rank order (see :func:`shard_layout`). Shards may be uneven.
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
    _reject_dtensors(
        input=input,
        linear_weight=linear_weight,
        target=target,
        linear_bias=linear_bias,
        weight=weight,
        token_weight=token_weight,
    )
    if not isinstance(linear_weight, torch.Tensor) or linear_weight.dim() < 2:
        raise ValueError(
            f"{_NAME}: linear_weight must be this rank's shard, a Tensor of shape "
            f"(V_local, in_features) or (V_local, d1, ..., dK, in_features), got "
            f"{getattr(linear_weight, 'shape', type(linear_weight).__name__)}"
        )
    _require_group(process_group)
    vocab_start, num_classes = _layout(linear_weight, process_group, vocab_start, num_classes)
    options = resolve_options(options, _NAME)
    call = check_call(
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        weight=weight,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        shift=shift,
        token_weight=token_weight,
        num_classes=num_classes,
        name=_NAME,
    )
    check_scales(_NAME, logit_scale, temperature)
    call = with_scales(call, logit_scale, temperature)
    _check_targets(call, num_classes)

    rows, in_features = call.input.shape
    world = dist.get_world_size(process_group)
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and call.input.requires_grad,
        grad_on and call.linear_weight.requires_grad,
        grad_on and call.linear_bias is not None and call.linear_bias.requires_grad,
    )
    plan = make_plan(
        rows,
        in_features,
        -(-num_classes // world),
        call.input.dtype,
        call.input.device,
        options,
        tiles=tiles_for(CrossEntropyHead.keeps_logits, call.transform, True),
    )
    spec = _Spec(
        call=call,
        plan=plan,
        shard=VocabShard(vocab_start, num_classes, process_group),
        needs=needs,
        allow_retain_graph=options.allow_retain_graph,
        loss_dtype=reported_dtype(call.input, options, loss_dtype),
    )
    loss, z_term, lse = _VocabParallelLoss.apply(
        call.input, call.linear_weight, call.linear_bias, spec
    )
    if call.reduction == "none":
        loss, z_term = loss.view(call.loss_shape), z_term.view(call.loss_shape)
    if not (return_z_loss or return_lse):
        return loss
    return LinearCrossEntropyOutput(
        loss,
        z_term if return_z_loss else None,
        lse.view(call.loss_shape) if return_lse else None,
    )


@dataclasses.dataclass(frozen=True)
class _TokenSpec:
    call: Call
    plan: Plan
    shard: VocabShard
    outputs: TokenOutputs
    options: LinearCrossEntropyOptions


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    """Per-token outputs of one shard's call; backward runs the vocabulary pass over the
    shard with the forward's row statistics (no collective but the input gradient's
    all_reduce)."""

    @staticmethod
    def forward(ctx, input, weight, bias, spec: _TokenSpec):
        call, shard = spec.call, spec.shard
        asked = spec.outputs
        head = _token_head(call, shard, spec.plan, outputs=asked)
        run_chunks(
            input,
            weight,
            bias,
            head,
            call.transform,
            spec.plan,
            grad_input=False,
            grad_weight=False,
            grad_bias=False,
            vocab=shard,
        )
        ctx.spec = spec
        ctx.save_for_backward(
            input.detach(),
            weight.detach(),
            None if bias is None else bias.detach(),
            head.row_stats,
        )
        acc = head.logprob.dtype

        def given(value: torch.Tensor | None, on: bool, dtype: torch.dtype) -> torch.Tensor:
            return value if on else input.new_empty((0,), dtype=dtype)

        entropy = given(head.entropy, asked.entropy, acc)
        top1 = given(head.top1, asked.top1, torch.bool)
        sq = given(head.log_sum_sq_prob, asked.log_sum_sq_prob, acc)
        mean = given(head.mean_logit, asked.mean_logit, acc)
        # sq and mean stay in the graph: differentiating them is refused in backward.
        ctx.mark_non_differentiable(top1)
        ctx.set_materialize_grads(False)
        return head.logprob, entropy, top1, sq, mean

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprob, grad_entropy, _grad_top1, grad_sq, grad_mean):
        spec: _TokenSpec = ctx.spec
        input, weight, bias, row_stats = ctx.saved_tensors
        row_stats = refuse_statistic_gradients(
            "vocab_parallel_token_logprobs",
            {"log_sum_sq_prob": grad_sq, "mean_logit": grad_mean},
            row_stats,
        )
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None
        call = spec.call
        head = TokenLogprobGradient(
            call.target.long(),
            call.target != call.ignore_index,
            spec.shard.start,
            row_stats,
            grad_logprob,
            grad_entropy,
        )
        grads = vocab_pass_gradients(
            input,
            weight,
            bias,
            head,
            call.transform,
            spec.options,
            (need_x, need_w, need_b),
        )
        if grads.input is not None:
            spec.shard.sum_(grads.input)
        return grads.input, grads.weight, grads.bias, None


def _token_head(call: Call, shard: VocabShard, plan: Plan, **kwargs) -> TokenLogprobHead:
    return TokenLogprobHead(
        call.target.long(),
        call.target != call.ignore_index,
        shard.start,
        call.linear_weight.shape[0],
        plan.acc_dtype,
        num_classes=shard.total,
        **kwargs,
    )


def vocab_parallel_token_logprobs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    num_classes: int | None = None,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool | int = False,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    entropy: bool = False,
    top1: bool = False,
    top1_rule: str = "unique",
    log_sum_sq_prob: bool = False,
    mean_logit: bool = False,
    options: LinearCrossEntropyOptions | None = None,
) -> TokenLogprobs:
    """:func:`linear_ce.token_logprobs` with the weight sharded along the vocabulary.

    Every rank passes its shard ``(V_r, F)`` of the head (and bias) and the same
    ``input`` and ``target``; every rank gets the same outputs, equal to
    ``token_logprobs`` on the full weight. The row statistics are combined with the
    collectives of :mod:`linear_ce.distributed` (two all_reduce per chunk of valid
    rows in forward; backward uses the forward's row statistics and needs only one
    all_reduce, of the input gradient); the row sums of the entropy, top-1, ``log_sum_sq_prob`` and ``mean_logit`` ride in
    the same SUM all_reduce.

    Example (under ``torchrun``)::

        >>> out = vocab_parallel_token_logprobs(hidden, shard, ids, shift=True, entropy=True)
    """
    _reject_dtensors(
        input=input, linear_weight=linear_weight, target=target, linear_bias=linear_bias
    )
    name = "vocab_parallel_token_logprobs"
    if not isinstance(linear_weight, torch.Tensor) or linear_weight.dim() != 2:
        raise ValueError(
            f"{name}: linear_weight must be this rank's shard (V_local, in_features), got "
            f"{getattr(linear_weight, 'shape', type(linear_weight).__name__)}"
        )
    _require_group(process_group)
    vocab_start, num_classes = _layout(linear_weight, process_group, vocab_start, num_classes)
    options = resolve_options(options, name)
    call = check_token_call(
        name,
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        ignore_index=ignore_index,
        shift=shift,
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        flags={
            "entropy": entropy,
            "top1": top1,
            "log_sum_sq_prob": log_sum_sq_prob,
            "mean_logit": mean_logit,
        },
        num_classes=num_classes,
    )
    check_top1_rule(name, top1_rule)
    _check_targets(call, num_classes)
    rows, in_features = call.input.shape
    world = dist.get_world_size(process_group)
    plan = make_plan(
        rows,
        in_features,
        -(-num_classes // world),
        call.input.dtype,
        call.input.device,
        options,
        tiles=tiles_for(entropy, call.transform, False),
    )
    asked = TokenOutputs(entropy, top1, top1_rule, log_sum_sq_prob, mean_logit)
    shard = VocabShard(vocab_start, num_classes, process_group)
    spec = _TokenSpec(call, plan, shard, asked, options)
    logprob, ent, is_top1, sq, mean = _VocabParallelTokenLogprobs.apply(
        call.input, call.linear_weight, call.linear_bias, spec
    )
    shape = call.loss_shape
    return TokenLogprobs(
        logprob.view(shape),
        ent.view(shape) if entropy else None,
        is_top1.view(shape) if top1 else None,
        sq.view(shape) if log_sum_sq_prob else None,
        mean.view(shape) if mean_logit else None,
    )


@dataclasses.dataclass(frozen=True)
class _DivergenceSpec:
    checked: DivergenceCall
    shard: VocabShard
    options: LinearCrossEntropyOptions
    plan_classes: int
    needs: tuple[bool, bool, bool]
    entropy: bool


def _shard_divergence(
    spec: _DivergenceSpec, input, weight, bias, row_weight, needs, entropy: bool = False
):
    checked, call = spec.checked, spec.checked.call
    head, grads = run_divergence(
        input,
        weight,
        bias,
        *checked.teacher,
        call.target.long(),
        call.target != call.ignore_index,
        row_weight=row_weight,
        beta=checked.beta,
        hard_weight=checked.hard_weight,
        transform=call.transform,
        teacher_transform=checked.teacher_transform,
        entropy=entropy,
        options=spec.options,
        needs=needs,
        vocab=spec.shard,
        vocab_start=spec.shard.start,
        plan_classes=spec.plan_classes,
    )
    if grads.input is not None:
        spec.shard.sum_(grads.input)
    return head, grads


class _VocabParallelDivergence(torch.autograd.Function):
    """Distillation loss of one pair of shards; "mean"/"sum" form the gradients in forward."""

    @staticmethod
    def forward(ctx, input, weight, bias, spec: _DivergenceSpec):
        call = spec.checked.call
        valid = call.target != call.ignore_index
        reduction = spec.checked.reduction
        ctx.spec = spec
        if reduction == "none":
            head, _ = _shard_divergence(
                spec, input, weight, bias, None, (False, False, False), spec.entropy
            )
            ctx.save_for_backward(
                input.detach(), weight.detach(), None if bias is None else bias.detach()
            )
            loss = head.loss
        else:
            acc = acc_dtype_for(input.dtype, spec.options.acc_dtype)
            row_weight = scalar_row_weight(valid, reduction, acc)
            head, grads = _shard_divergence(
                spec, input, weight, bias, row_weight, spec.needs, spec.entropy
            )
            ctx.grads = [grads.input, grads.weight, grads.bias]
            loss = head.loss.sum()
            loss = loss / valid.sum() if reduction == "mean" else loss
        entropy = head.entropy if spec.entropy else loss.new_empty((0,))
        ctx.mark_non_differentiable(entropy)
        return loss, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_entropy):
        spec: _DivergenceSpec = ctx.spec
        if spec.checked.reduction != "none":
            scaled = hand_over_gradients(
                ctx, spec.needs, grad_loss, spec.options.allow_retain_graph
            )
            return (*scaled, None)
        input, weight, bias = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        _, grads = _shard_divergence(spec, input, weight, bias, grad_loss.contiguous(), needs)
        return grads.input, grads.weight, grads.bias, None


def vocab_parallel_linear_divergence(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    num_classes: int | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool | int = False,
    reduction: str = "mean",
    hard_weight: float = 0.0,
    return_entropy: bool = False,
    options: LinearCrossEntropyOptions | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_ce.linear_divergence` with both heads sharded along the vocabulary
    the same way.

    Every rank passes its shards ``(V_r, F_s)`` of the student's head and ``(V_r, F_t)``
    of the teacher's (and biases), and the same inputs and target; every rank gets the
    same loss, equal to ``linear_divergence`` on the full heads. Per chunk of valid rows:
    two all_reduce MAX (the student's and the teacher's row max) and one all_reduce SUM
    of the row sums; one more SUM for ``0 < beta < 1`` (the mixture's sums need both
    normalisers); "none" repeats them in backward; one all_reduce of the input gradient.

    Example (under ``torchrun``)::

        >>> loss = vocab_parallel_linear_divergence(
        ...     hidden, student_shard, teacher_hidden, teacher_shard, labels, shift=True
        ... )
    """
    name = "vocab_parallel_linear_divergence"
    _reject_dtensors(
        student_input=student_input,
        student_weight=student_weight,
        teacher_input=teacher_input,
        teacher_weight=teacher_weight,
        student_bias=student_bias,
        teacher_bias=teacher_bias,
    )
    if not isinstance(student_weight, torch.Tensor) or student_weight.dim() != 2:
        raise ValueError(
            f"{name}: student_weight must be this rank's shard (V_local, in_features), got "
            f"{getattr(student_weight, 'shape', type(student_weight).__name__)}"
        )
    _require_group(process_group)
    vocab_start, num_classes = _layout(student_weight, process_group, vocab_start, num_classes)
    checked = check_divergence_call(
        name,
        student_input,
        student_weight,
        teacher_input,
        teacher_weight,
        target,
        student_bias=student_bias,
        teacher_bias=teacher_bias,
        beta=beta,
        temperature=temperature,
        student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        student_softcap=student_softcap,
        teacher_softcap=teacher_softcap,
        ignore_index=ignore_index,
        shift=shift,
        reduction=reduction,
        hard_weight=hard_weight,
        return_entropy=return_entropy,
        num_classes=num_classes,
    )
    call = checked.call
    if checked.hard_weight > 0.0:
        _check_targets(call, num_classes)
    options = resolve_options(options, name)
    grad_on = torch.is_grad_enabled()
    spec = _DivergenceSpec(
        checked,
        VocabShard(vocab_start, num_classes, process_group),
        options,
        -(-num_classes // dist.get_world_size(process_group)),
        (
            grad_on and call.input.requires_grad,
            grad_on and call.linear_weight.requires_grad,
            grad_on and call.linear_bias is not None and call.linear_bias.requires_grad,
        ),
        return_entropy,
    )
    loss, entropy = _VocabParallelDivergence.apply(
        call.input, call.linear_weight, call.linear_bias, spec
    )
    if reduction == "none":
        loss = loss.view(call.loss_shape)
    return (loss, entropy.view(call.loss_shape)) if return_entropy else loss


def vocab_parallel_token_objective(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    objective: Callable[..., torch.Tensor],
    *,
    process_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    num_classes: int | None = None,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool | int = False,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    entropy: bool = False,
    options: LinearCrossEntropyOptions | None = None,
    **token_tensors: torch.Tensor,
) -> torch.Tensor:
    """:func:`linear_ce.token_objective` with the weight sharded along the vocabulary.

    Every rank passes its shard ``(V_r, F)`` of the head (and bias) and the same
    ``input``, ``target`` and side inputs; the row statistics are combined as in
    :func:`vocab_parallel_token_logprobs` (two all_reduce per chunk of valid rows, the
    entropy's sum riding in the SUM one), so every rank evaluates ``objective`` on the same
    log-probabilities and gets the same loss, equal to ``token_objective`` on the full
    weight. The gradients are computed in forward; one all_reduce sums the input gradient
    over the group, and backward communicates nothing.

    Example (under ``torchrun``)::

        >>> loss = vocab_parallel_token_objective(
        ...     hidden, shard, ids, obj.clipped_policy_gradient(0.2), shift=True,
        ...     old_logprob=old, advantage=adv, weight=mask / mask.sum(),
        ... )
    """
    name = "vocab_parallel_token_objective"
    _reject_dtensors(
        input=input, linear_weight=linear_weight, target=target, linear_bias=linear_bias
    )
    if not isinstance(linear_weight, torch.Tensor) or linear_weight.dim() != 2:
        raise ValueError(
            f"{name}: linear_weight must be this rank's shard (V_local, in_features), got "
            f"{getattr(linear_weight, 'shape', type(linear_weight).__name__)}"
        )
    _require_group(process_group)
    vocab_start, num_classes = _layout(linear_weight, process_group, vocab_start, num_classes)
    world = dist.get_world_size(process_group)
    return objective_loss(
        name,
        input,
        linear_weight,
        target,
        objective,
        linear_bias=linear_bias,
        ignore_index=ignore_index,
        shift=shift,
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        entropy=entropy,
        options=options,
        side=token_tensors,
        vocab=VocabShard(vocab_start, num_classes, process_group),
        num_classes=num_classes,
        planned_classes=-(-num_classes // world),
    )
