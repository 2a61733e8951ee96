"""The public function ``token_logprobs``: per-token log-probabilities, entropy, top-1
and two more statistics of each next-token distribution."""

from __future__ import annotations

from typing import NamedTuple

import torch

from linear_ce.arguments import check_token_call, check_top1_rule
from linear_ce.dtensor import accepts_dtensors
from linear_ce.losses.token_logprob import TokenOutputs
from linear_ce.ops_token import token_rows
from linear_ce.options import LinearCrossEntropyOptions, resolve_options

__all__ = ["TokenLogprobs", "token_logprobs", "token_logprobs_and_stats", "token_logprobs_vjp"]

_NAME = "token_logprobs"


class TokenLogprobs(NamedTuple):
    """What :func:`token_logprobs` returns; each field has the target's shape.

    ``logprob``, ``entropy``, ``log_sum_sq_prob`` and ``mean_logit`` are in the
    accumulation dtype (float32 for float16/bfloat16 inputs, float64 for float64);
    ``top1`` is bool. A field that was not asked for is ``None``.
    """

    logprob: torch.Tensor
    entropy: torch.Tensor | None
    top1: torch.Tensor | None
    log_sum_sq_prob: torch.Tensor | None = None
    mean_logit: torch.Tensor | None = None


@accepts_dtensors(
    rows=("input", "target"),
    heads=("linear_weight", "linear_bias"),
    vocab_parallel="vocab_parallel_token_logprobs",
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
    options: LinearCrossEntropyOptions | None = None,
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
    Tokens whose target is ``ignore_index`` take part in no GEMM; their outputs are
    ``0`` / ``False`` and their gradient is zero.

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
        options: :class:`LinearCrossEntropyOptions` (chunking, precision).

    Returns:
        :class:`TokenLogprobs` ``(logprob, entropy, top1, log_sum_sq_prob, mean_logit)``.

    Example (a policy-gradient loss with an entropy bonus)::

        >>> hidden = torch.randn(4, 32, 64, requires_grad=True)
        >>> lm_head = torch.randn(1000, 64, requires_grad=True)
        >>> ids = torch.randint(0, 1000, (4, 32))
        >>> out = linear_ce.token_logprobs(hidden, lm_head, ids, shift=True, entropy=True)
        >>> advantages = torch.randn(4, 1)
        >>> loss = -(advantages * out.logprob).mean() - 0.01 * out.entropy.mean()
        >>> loss.backward()
    """
    return token_logprobs_and_stats(
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        ignore_index=ignore_index,
        shift=shift,
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        entropy=entropy,
        top1=top1,
        top1_rule=top1_rule,
        log_sum_sq_prob=log_sum_sq_prob,
        mean_logit=mean_logit,
        options=options,
    )[0]


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
    call = check_token_call(
        _NAME,
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
    )
    check_top1_rule(_NAME, top1_rule)
    asked = TokenOutputs(entropy, top1, top1_rule, log_sum_sq_prob, mean_logit)
    options = resolve_options(options, _NAME)
    grad_on = torch.is_grad_enabled()
    logprob, row_stats, ent, is_top1, sq, mean = token_rows(
        call.input,
        call.linear_weight,
        call.target,
        call.linear_bias,
        None,
        None,
        None,
        call.ignore_index,
        call.transform.as_list(),
        asked.encode(),
        options.batch_chunk_size,
        options.chunking_method,
        options.acc_policy,
        options.acc_dtype,
        grad_on and call.input.requires_grad,
        grad_on and call.linear_weight.requires_grad,
        grad_on and call.linear_bias is not None and call.linear_bias.requires_grad,
    )[:6]
    shape = call.loss_shape
    outputs = TokenLogprobs(
        logprob.view(shape),
        ent.view(shape) if entropy else None,
        is_top1.view(shape) if top1 else None,
        sq.view(shape) if log_sum_sq_prob else None,
        mean.view(shape) if mean_logit else None,
    )
    return outputs, row_stats.detach()


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
    call = check_token_call(
        _NAME,
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        ignore_index=ignore_index,
        shift=False,
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        flags={},
    )
    need_x, need_w, need_b = needs
    need_b = need_b and linear_bias is not None
    if (grad_logprob is None and grad_entropy is None) or not (need_x or need_w or need_b):
        return None, None, None
    options = resolve_options(options, _NAME)
    if row_stats is not None:
        _check_row_stats(row_stats, call.target.shape, call.input)

    def rows(grad: torch.Tensor | None) -> torch.Tensor | None:
        return None if grad is None else grad.reshape(call.target.shape).contiguous()

    grads = token_rows(
        call.input,
        call.linear_weight,
        call.target,
        call.linear_bias,
        rows(grad_logprob),
        rows(grad_entropy),
        row_stats,
        call.ignore_index,
        call.transform.as_list(),
        TokenOutputs().encode(),
        options.batch_chunk_size,
        options.chunking_method,
        options.acc_policy,
        options.acc_dtype,
        need_x,
        need_w,
        need_b,
    )[-3:]
    return tuple(
        grad.view(like.shape) if need else None
        for grad, like, need in zip(
            grads, (input, linear_weight, linear_bias), (need_x, need_w, need_b), strict=True
        )
    )


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
