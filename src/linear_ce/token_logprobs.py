"""The per-token family's public functions: ``token_logprobs`` (per-token
log-probabilities, entropy, top-1 and two more statistics of each next-token
distribution), and its forms for a custom ``autograd.Function``."""

from __future__ import annotations

import torch

from linear_ce.checks.call import (
    Call,
    Caller,
    HeadArguments,
    TransformArguments,
    check_flags,
    check_token_call,
    check_top1_rule,
)
from linear_ce.engine.chunk_loop import Needs
from linear_ce.losses.token_logprob import TokenOutputs
from linear_ce.ops.schema import PlanOptions
from linear_ce.ops.token_logprobs import (
    SCHEMA,
    TokenArguments,
    token_logprobs_on_shard,
    token_rows,
)
from linear_ce.options import LinearCrossEntropyOptions, resolve_options
from linear_ce.outputs import TokenLogprobs
from linear_ce.parallel.dtensor import accepts_dtensors
from linear_ce.parallel.shard import VocabParallel, vocab_shard

__all__ = [
    "TokenLogprobs",
    "token_logprobs",
    "token_logprobs_and_stats",
    "token_logprobs_vjp",
]

_NAME = "token_logprobs"


def _arguments(
    call: Call, outputs: TokenOutputs, options: LinearCrossEntropyOptions, needs: Needs
) -> TokenArguments:
    return TokenArguments(
        call.input,
        call.linear_weight,
        call.linear_bias,
        call.target,
        None,
        None,
        None,
        call.ignore_index,
        call.transform,
        outputs,
        PlanOptions.of(options),
        needs,
        call.name,
    )


def _result(outputs: tuple[torch.Tensor, ...], call: Call, asked: TokenOutputs) -> TokenLogprobs:
    """The :class:`TokenLogprobs` of ``(logprob, entropy, top1, log_sum_sq_prob,
    mean_logit, topk_logprobs, topk_ids)``, in the target's shape (the top-k with one more
    dimension of ``k``); the outputs not asked for are ``None``."""
    logprob, entropy, top1, sq, mean, topk_logprobs, topk_ids = outputs
    shape = call.loss_shape
    topk_shape = (*shape, asked.topk)
    return TokenLogprobs(
        logprob.view(shape),
        entropy.view(shape) if asked.entropy else None,
        top1.view(shape) if asked.top1 else None,
        sq.view(shape) if asked.log_sum_sq_prob else None,
        mean.view(shape) if asked.mean_logit else None,
        topk_logprobs.view(topk_shape) if asked.topk else None,
        topk_ids.view(topk_shape) if asked.topk else None,
    )


def _checked(
    name: str,
    head: HeadArguments,
    transform: TransformArguments,
    asked: TokenOutputs,
    num_classes: int | None = None,
) -> tuple[Call, TokenOutputs]:
    """The call and the outputs ``asked`` of a token_logprobs function (as given: ``topk``
    ``None`` or a count), checked (errors name ``name``), with ``topk`` as the op's count
    (0: none asked). ``num_classes`` is the whole vocabulary of a shard (``None``: no shard)."""
    caller = Caller(name)
    flags = {
        "entropy": asked.entropy,
        "top1": asked.top1,
        "log_sum_sq_prob": asked.log_sum_sq_prob,
        "mean_logit": asked.mean_logit,
    }
    check_flags(caller, flags)
    call = check_token_call(name, head, transform, num_classes=num_classes)
    check_top1_rule(name, asked.top1_rule)
    classes = call.linear_weight.shape[0] if num_classes is None else num_classes
    topk = asked.topk
    if topk is None:
        topk = 0
    elif isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= classes:
        caller.fail(
            f"topk must be None or an int in [1, {classes}] (the number of classes), got {topk!r}"
        )
    return call, TokenOutputs(
        asked.entropy, asked.top1, asked.top1_rule, asked.log_sum_sq_prob, asked.mean_logit, topk
    )


def _with_stats(
    name: str,
    head: HeadArguments,
    transform: TransformArguments,
    asked: TokenOutputs,
    options: LinearCrossEntropyOptions | None,
) -> tuple[TokenLogprobs, torch.Tensor]:
    """:func:`token_logprobs_and_stats`, its errors naming ``name``."""
    call, asked = _checked(name, head, transform, asked)
    options = resolve_options(options, name)
    needs = Needs.of(call.input, call.linear_weight, call.linear_bias)
    logprob, row_stats, *statistics = token_rows(
        *SCHEMA.flatten(_arguments(call, asked, options, needs))
    )[:8]
    return _result((logprob, *statistics), call, asked), row_stats.detach()


@accepts_dtensors(
    rows=("input", "target"),
    heads=("linear_weight", "linear_bias"),
    vocab_parallel=True,
)
def token_logprobs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
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
    topk: int | None = None,
    options: LinearCrossEntropyOptions | None = None,
    vocab_parallel: VocabParallel | None = None,
) -> TokenLogprobs:
    r"""Log-probability of each target token, and optionally the entropy, top-1, the log
    of the summed squared probabilities and the mean logit of each next-token
    distribution, without materialising the logits.

    With logits :math:`s = \mathrm{softcap}\big((x W^\top + b)\,\sigma\big) / T`
    (logit scale :math:`\sigma`, softcap :math:`c\tanh(\cdot/c)` if set,
    temperature :math:`T`) and :math:`p = \mathrm{softmax}(s)` per token:

    .. math::
        \mathrm{logprob} = \log p_{t}, \qquad
        \mathrm{entropy} = -\sum_v p_v \log p_v, \qquad
        \mathrm{top1} = [\,t = \arg\max_v s_v \text{ and the maximum is unique}\,],

        \mathrm{log\_sum\_sq\_prob} = \log \sum_v p_v^2, \qquad
        \mathrm{mean\_logit} = \frac{1}{V} \sum_v s_v.

    Equal to ``torch.log_softmax(s, -1).gather(-1, t)`` (and the entropy of the
    same distribution) computed over chunks of tokens: nothing of size ``N·V`` is
    ever held. Gradients flow to ``input``, ``linear_weight`` and ``linear_bias``
    from ``logprob`` and ``entropy`` (either may be unused: no work is done for a
    gradient that does not flow); the backward recomputes the logits a block of the
    vocabulary at a time, from the forward's per-row statistics.
    ``log_sum_sq_prob`` and ``mean_logit`` are statistics without a gradient (as
    ``top1``): differentiating one, alone or inside a loss, raises a ``RuntimeError`` in
    backward (use ``.detach()`` where it enters a loss).
    ``topk=k`` also returns each token's ``k`` largest log-probabilities
    (``topk_logprobs``, descending, in the accumulation dtype) and their token ids
    (``topk_ids``, int64): ``torch.log_softmax(s, -1).topk(k)``, from one ``torch.topk``
    of each chunk's logits tile (equal values: torch.topk's choice among them, which
    torch does not order; vocab-parallel, a stable merge of the shards' candidates).
    They have no gradient: differentiating ``topk_logprobs`` raises in backward, as for
    ``log_sum_sq_prob``.
    Tokens whose target is ``ignore_index`` take part in no GEMM; their outputs are
    ``0`` / ``False`` and their gradient is zero; their top-k slots are ``-inf`` with id
    ``-1`` (the empty slot of :func:`linear_ce.sparse_divergence`).

    Args:
        input: ``(*, F)`` hidden states.
        linear_weight: ``(V, F)`` output projection.
        target: ``(*)`` token ids (integer), ``ignore_index`` where there is none.
        linear_bias: ``(V,)`` or ``None``.
        ignore_index: the target value of tokens without an output.
        shift: ``True`` or ``k``: position ``t`` is scored against ``target[..., t + k]``
            (the last ``k`` positions get no output), as in
            :func:`linear_ce.linear_cross_entropy`.
        temperature: :math:`T > 0`.
        logit_scale: :math:`\sigma > 0`.
        softcap: :math:`c > 0` or ``None``.
        entropy: also return the entropy.
        top1: also return whether the target is the argmax (not differentiable).
        top1_rule: how ``top1`` treats ties at the maximum: ``"unique"`` (any tie is
            ``False``) or ``"argmax"`` (``target == s.argmax(-1)``: torch's first-index
            rule, as TRL and transformers' token accuracy count it).
        log_sum_sq_prob: also return :math:`\log \sum_v p_v^2` (not differentiable).
        mean_logit: also return the mean of the transformed logits :math:`s` over the
            vocabulary (not differentiable).
        topk: ``None``, or an int ``k`` in ``[1, V]``: also return the ``k`` largest
            log-probabilities of each token and their ids, each ``(*target.shape, k)``
            (not differentiable).
        options: :class:`LinearCrossEntropyOptions` (chunking, precision).
        vocab_parallel: ``None`` for a whole head, or a :class:`~linear_ce.VocabParallel`:
            the head given is this rank's shard of one split along the vocabulary (what that
            means, the same for every family, is said there). Collectives: per chunk of
            valid rows, one all_reduce MAX of the row maxima and one all_reduce SUM of the
            row sums (the entropy's, top-1's, log_sum_sq_prob's and mean_logit's ride in
            it); backward uses the forward's row statistics and needs one all_reduce, of the
            input gradient. With topk=k each rank keeps its shard's k largest per token and,
            after the loop, one all_gather of the (N, k) values and one of their ids merge
            them exactly (equal values ordered by id).

    Returns:
        :class:`TokenLogprobs` ``(logprob, entropy, top1, log_sum_sq_prob, mean_logit,
        topk_logprobs, topk_ids)``.

    Example (a policy-gradient loss with an entropy bonus)::

        >>> hidden = torch.randn(4, 32, 64, requires_grad=True)
        >>> lm_head = torch.randn(1000, 64, requires_grad=True)
        >>> ids = torch.randint(0, 1000, (4, 32))
        >>> out = linear_ce.token_logprobs(hidden, lm_head, ids, shift=True, entropy=True)
        >>> advantages = torch.randn(4, 1)
        >>> loss = -(advantages * out.logprob).mean() - 0.01 * out.entropy.mean()
        >>> loss.backward()
    """

    head = HeadArguments(input, linear_weight, target, linear_bias, ignore_index, shift)
    transform = TransformArguments(temperature, logit_scale, softcap)
    asked = TokenOutputs(entropy, top1, top1_rule, log_sum_sq_prob, mean_logit, topk)
    shard = vocab_shard(_NAME, "linear_weight", linear_weight, vocab_parallel)
    if shard is None:
        return _with_stats(_NAME, head, transform, asked, options)[0]
    options = resolve_options(options, _NAME)
    call, asked = _checked(_NAME, head, transform, asked, shard.total)
    arguments = _arguments(call, asked, options, Needs(False, False, False))
    return _result(token_logprobs_on_shard(arguments, shard), call, asked)


def token_logprobs_and_stats(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
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
    topk: int | None = None,
    options: LinearCrossEntropyOptions | None = None,
) -> tuple[TokenLogprobs, torch.Tensor]:
    """:func:`token_logprobs` (same arguments, plain tensors only) and the per-row
    statistics its backward uses, an opaque tensor to hand to
    :func:`token_logprobs_vjp` as ``row_stats`` (detached): for an
    ``autograd.Function`` that runs its own backward, which then costs what
    ``token_logprobs``'s does.

    Example::

        >>> x, W = torch.randn(6, 16), torch.randn(50, 16)
        >>> t = torch.randint(0, 50, (6,))
        >>> out, stats = token_logprobs_and_stats(x, W, t, entropy=True)
        >>> gx, gW, _ = token_logprobs_vjp(x, W, t, torch.ones(6), None, row_stats=stats)
    """

    head = HeadArguments(input, linear_weight, target, linear_bias, ignore_index, shift)
    transform = TransformArguments(temperature, logit_scale, softcap)
    asked = TokenOutputs(entropy, top1, top1_rule, log_sum_sq_prob, mean_logit, topk)
    return _with_stats("token_logprobs_and_stats", head, transform, asked, options)


def token_logprobs_vjp(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    *,
    linear_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    options: LinearCrossEntropyOptions | None = None,
    row_stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    r"""The gradients of :func:`token_logprobs` (``shift=False``) for the upstream
    gradients ``grad_logprob`` and ``grad_entropy`` (target's shape, ``None``: none
    flows), computed directly, without an autograd graph.

    For an ``autograd.Function`` that holds the weight itself and must read it again in
    its own backward (a head that is gathered again under DeepSpeed ZeRO-3, as in
    :mod:`linear_ce.integrations.trl`). With ``row_stats`` from
    :func:`token_logprobs_and_stats` (same inputs, same transform) it is
    ``token_logprobs``'s backward: the vocabulary pass, one logits GEMM; without, it
    first reruns the forward's row reductions over chunks of rows (the same GEMM count,
    more passes over each tile). ``needs`` says which of ``(input, linear_weight,
    linear_bias)`` get a gradient; the others are ``None``, as is every one when no
    upstream gradient flows.

    Example::

        >>> x, W = torch.randn(6, 16), torch.randn(50, 16)
        >>> t = torch.randint(0, 50, (6,))
        >>> gx, gW, _ = token_logprobs_vjp(x, W, t, torch.ones(6), None)
    """

    name = "token_logprobs_vjp"
    head = HeadArguments(input, linear_weight, target, linear_bias, ignore_index)
    call = check_token_call(name, head, TransformArguments(temperature, logit_scale, softcap))
    need_x, need_w, need_b = needs
    needs = Needs(need_x, need_w, need_b and linear_bias is not None)
    upstream = {"grad_logprob": grad_logprob, "grad_entropy": grad_entropy}
    _check_upstream(name, upstream, target, call.input)
    if (grad_logprob is None and grad_entropy is None) or not any(needs):
        return None, None, None
    options = resolve_options(options, name)
    if row_stats is not None:
        _check_row_stats(row_stats, call.target.shape, call.input)

    def as_rows(grad: torch.Tensor | None) -> torch.Tensor | None:
        return None if grad is None else grad.reshape(call.target.shape).contiguous()

    arguments = _arguments(call, TokenOutputs(), options, needs)._replace(
        grad_logprob=as_rows(grad_logprob), grad_entropy=as_rows(grad_entropy), row_stats=row_stats
    )
    grads = token_rows(*SCHEMA.flatten(arguments))[-3:]
    return tuple(
        grad.view(like.shape) if need else None
        for grad, like, need in zip(grads, (input, linear_weight, linear_bias), needs, strict=True)
    )


def _check_upstream(
    name: str, upstream: dict[str, torch.Tensor | None], target: torch.Tensor, input: torch.Tensor
) -> None:
    """The upstream gradients given (not ``None``) are floating tensors of the target's
    shape on the input's device."""
    for arg, grad in upstream.items():
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
            got = grad.dtype if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise ValueError(f"{name}: {arg} must be a floating tensor or None, got {got}")
        if grad.shape != target.shape:
            raise ValueError(
                f"{name}: {arg} must have the target's shape {tuple(target.shape)}, got "
                f"{tuple(grad.shape)}"
            )
        if grad.device != input.device:
            raise ValueError(f"{name}: {arg} is on {grad.device}, the input on {input.device}")


def _check_row_stats(row_stats: torch.Tensor, rows_shape: torch.Size, input: torch.Tensor) -> None:
    want = (*rows_shape, 3)
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    if (
        not isinstance(row_stats, torch.Tensor)
        or tuple(row_stats.shape) != want
        or row_stats.device != input.device
    ):
        raise ValueError(
            f"token_logprobs_vjp: row_stats must be the statistics token_logprobs_and_stats "
            f"returned for these inputs, shape {want} on {input.device}, got "
            f"{getattr(row_stats, 'shape', type(row_stats).__name__)}"
            f"{'' if not isinstance(row_stats, torch.Tensor) else f' on {row_stats.device}'}"
        )
    if not row_stats.dtype.is_floating_point or row_stats.dtype.itemsize < acc.itemsize:
        raise ValueError(
            f"token_logprobs_vjp: row_stats must have dtype {acc} (from "
            f"token_logprobs_and_stats), got {row_stats.dtype}"
        )
