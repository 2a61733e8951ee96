r"""Run TRL's fused LM head on :func:`linear_ce.token_logprobs`.

TRL (``trl>=1.16,<1.17``) gives every model its SFT, DPO, GRPO, RLOO and KTO trainers
train a fused LM head (``trl.trainer.utils.add_fused_lm_head``): called with
``fused_lm_head=True``, the model returns per-token log-probabilities (and the
statistics a trainer asks for) computed by TRL's own chunked kernel,
``ChunkedLogProbFunction``, instead of logits. After :func:`patch` that one call runs on
``linear_ce``; everything around it stays TRL's: the backbone, the label shift, the
masking of ignored labels, the loss, the MoE auxiliary loss, the ``FusedCausalLMOutput``.

What the replaced call computes, for TRL's arguments ``(hidden, weight, bias, targets,
temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)``, with logits
:math:`s = \mathrm{softcap}((h W^\top + b)\,\sigma) / T` and :math:`p = \mathrm{softmax}(s)`:

=====================  ==========================================  ===============
TRL's output           value per token                             gradient
=====================  ==========================================  ===============
``log_probs``          :math:`\log p_t`                            yes
``entropy``            :math:`-\sum_v p_v \log p_v`                yes
``log_sum_sq_probs``   :math:`\log \sum_v p_v^2`                   none (as TRL)
``mean_logits``        :math:`\frac{1}{V}\sum_v s_v`               none (as TRL)
``is_top1``            ``s.argmax(-1) == t`` (first index on ties)  none (bool)
=====================  ==========================================  ===============

as :func:`linear_ce.token_logprobs` with ``top1_rule="argmax"``, an output not named in
``outputs`` being ``None``. Kept from TRL:

- the compute dtype without autocast: the hidden states' dtype; the weight and bias
  are cast to it. With ``cast_lm_head_to_fp32=True`` TRL hands over fp32 hidden states
  with autocast off, so the head runs in fp32. Under autocast the head runs in the wider
  of the autocast dtype and the weight's dtype (TRL: the autocast dtype, see below);
- temperature, logit scale and softcap, in TRL's order (scale, softcap, temperature);
- ignored labels: their outputs are zero and they carry no gradient. TRL scores only
  the valid positions on Triton devices and every position elsewhere; patched, the
  valid positions alone are scored on every device (``linear_ce`` has no per-shape
  compilation to protect), so ignored positions cost no GEMM on CPU either;
- ZeRO-3 / FSDP: TRL gathers the head's weight (``maybe_gather_lm_head_ctx``, and
  ``DTensor.full_tensor()`` for FSDP2) around the forward call; the backward, which
  recomputes the logits, enters ``maybe_gather_lm_head_ctx`` again with the weight and
  bias the forward was given, as TRL's own backward does.

``DistillationTrainer``'s loss (``_chunked_divergence_loss``, which calls TRL's
``ChunkedDivergenceFunction``) is replaced as a whole by
:func:`linear_ce.integrations.trl_distillation.chunked_divergence_loss`: the same
arguments and results (loss, the student's entropy sum, the number of valid positions),
computed by :func:`linear_ce.linear_divergence` on the completion positions only, with
the student's gradients formed in forward inside TRL's gather of both heads.

``DPOTrainer._compute_loss`` is replaced by
:class:`linear_ce.integrations.trl_sequence.DPOLoss`: for every loss type but ``aot`` /
``aot_unpaired``, and without WPO weighting or ``ld_alpha``, the policy's fused head computes
the DPO loss itself with :func:`linear_ce.sequence_objective` (three GEMMs, gradients in the
same pass); the other settings run TRL's own loss. That route does not log ``logits/*`` and
``mean_token_accuracy`` (see :mod:`linear_ce.integrations.trl_sequence`).
``GRPOTrainer._compute_loss`` at ``importance_sampling_level="sequence"`` (GSPO) and
``KTOTrainer``'s loss are routed the same way (:mod:`linear_ce.integrations.trl_grpo`,
:mod:`linear_ce.integrations.trl_kto`); what each keeps on TRL's own loss is listed in
docs/sequence-objectives.md.

Differences: TRL's ``chunk_size`` (its vocabulary tile) is ignored, ``linear_ce`` plans
its own chunks (``options``). Under autocast with fp32 parameters (TRL's default config:
bf16 autocast, also on CPU) the head runs in fp32, the parameters' dtype, where TRL's
kernel rounds its operands and logits to bf16 and sums the gradient products in fp32: the
weight and input gradients are fp32 sums within fp32 rounding of the float64 gradient
(1e-7 against TRL's 2e-3 in a tiny Llama's SFT step). bf16 operands with fp32 sums would
only tie with TRL's error, a bf16 result is 1.1-1.5x worse. The price is speed where a
bf16 head would have run half GEMMs: none on CUDA with the default ``acc_policy`` (bf16
inputs run fp32 GEMMs there too); fp32 GEMMs in place of bf16 ones on a CPU with native
bf16 GEMMs, or on CUDA under ``acc_policy="balanced"``/``"compact"``. A weight in the
autocast dtype (a bf16 model) keeps a bf16 head. ``docs/integrations.md`` ("Autocast with
fp32 parameters") has the measurements. A softcap or logit scale that is not a finite
float > 0 is an error (TRL would run with it).

Fail loudly: :func:`patch` first checks that the installed TRL has the functions,
signatures and call site this adapter was written against and raises
:class:`UnsupportedTRLVersion`, naming the supported range, if it does not.

Patching is process-wide and thread-safe. :func:`patch` twice patches once (the second
call's options apply); :func:`patched` blocks may nest or overlap, also across threads:
TRL stays patched, with the options of the last block entered among those open, until
the last one exits, then is as :func:`patch`/:func:`unpatch` left it. :func:`unpatch`
leaves another library's patch of the same TRL attribute, made after ours, in place
(with a ``RuntimeWarning``) rather than overwrite it with TRL's original.

Example::

    >>> from linear_ce.integrations import trl as linear_ce_trl
    >>> linear_ce_trl.patch()          # every fused LM head, from now on
    >>> trainer = SFTTrainer(model=model, args=args, train_dataset=data)
    >>> trainer.train()
    >>> linear_ce_trl.unpatch()
    >>> with linear_ce_trl.patched():  # or for one block
    ...     trainer.train()
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import inspect
import threading
import types
import warnings
from collections.abc import Callable, Iterator

import torch

from linear_ce.integrations.trl_distillation import DIVERGENCE_LOSS_ARGS, chunked_divergence_loss
from linear_ce.integrations.trl_grpo import GRPO_MODULE, GRPOLoss, check_grpo_loss
from linear_ce.integrations.trl_kto import KTO_MODULE, KTOLoss, check_kto_loss
from linear_ce.integrations.trl_sequence import (
    DPO_MODULE,
    DPOLoss,
    TrainerLoss,
    check_dpo_loss,
    routed_head,
)
from linear_ce.options import LinearCrossEntropyOptions
from linear_ce.token_logprobs import token_logprobs_and_stats, token_logprobs_vjp

__all__ = [
    "SUPPORTED_TRL",
    "TokenLogprobsFunction",
    "UnsupportedTRLVersion",
    "is_patched",
    "patch",
    "patched",
    "unpatch",
]

#: The TRL releases this adapter was written against (pip's version specifier).
SUPPORTED_TRL = ">=1.16,<1.17"

#: TRL's optional per-token outputs (``trl.kernels.chunked_logprob.OPTIONAL_OUTPUTS``).
TRL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

_UTILS = "trl.trainer.utils"
_KERNEL = "trl.kernels.chunked_logprob"
_LOGPROB_ARGS = (
    "ctx",
    "hidden",
    "weight",
    "bias",
    "targets",
    "temperature",
    "chunk_size",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
)
#: TRL's call of its kernel (``ChunkedLogProbFunction.apply``): its arguments after ``ctx``,
#: with the defaults of the kernel's own signature.
_KernelCall = collections.namedtuple(
    "_KernelCall", _LOGPROB_ARGS[1:], defaults=(None, 1.0, TRL_OUTPUTS)
)
_FUSED_HEAD_ARGS = ("model", "temperature", "cast_lm_head_to_fp32", "outputs")
# The globals of trl.trainer.utils the fused forward reads at each call: the two this
# module replaces and the gather context its own backward enters again.
_FUSED_FORWARD_READS = ("_ChunkedLogProbFunction", "_use_triton", "maybe_gather_lm_head_ctx")


class UnsupportedTRLVersion(RuntimeError):
    """The installed TRL is not the one :func:`patch` was written against, or another
    library has replaced what :func:`patch` replaces (the message names what it found)."""


def _gather_context(weight: torch.Tensor, bias: torch.Tensor | None):
    """TRL's ZeRO-3 gather of the head (a null context without ZeRO-3), looked up at
    each call so the context TRL has at that moment is the one entered."""
    return importlib.import_module(_UTILS).maybe_gather_lm_head_ctx(weight, bias)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head runs in: the hidden states' without autocast (as TRL); under
    autocast the wider of its dtype and the weight's, so fp32 parameters get fp32
    gradient sums (TRL's are fp32 too; a bf16 head's come back bf16-rounded, see the
    module doc)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.promote_types(torch.get_autocast_dtype(device), weight.dtype)
    return hidden.dtype


def _transform(
    temperature: float, logit_scale: float, final_logit_softcapping: float | None
) -> dict[str, float | None]:
    """TRL's logits transform as ``linear_ce``'s keyword arguments."""
    return {
        "temperature": float(temperature),
        "logit_scale": float(logit_scale),
        "softcap": None if final_logit_softcapping is None else float(final_logit_softcapping),
    }


class TokenLogprobsFunction(torch.autograd.Function):
    """TRL's ``ChunkedLogProbFunction`` (same arguments, same five outputs) computed by
    :func:`linear_ce.token_logprobs`; ``options`` (last argument) chunking and precision.

    The weight and bias are saved as given, so the backward reads them again inside
    TRL's gather context (ZeRO-3 frees them in between).
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None,
        logit_scale: float,
        outputs: tuple[str, ...],
        options: LinearCrossEntropyOptions | None,
    ) -> tuple[torch.Tensor | None, ...]:
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(hidden, weight)
        transform = _transform(temperature, logit_scale, final_logit_softcapping)
        with torch.autocast(hidden.device.type, enabled=False):
            out, row_stats = token_logprobs_and_stats(
                hidden.to(dtype),
                weight.to(dtype),
                targets,
                linear_bias=None if bias is None else bias.to(dtype),
                entropy="entropy" in outputs,
                top1="is_top1" in outputs,
                top1_rule="argmax",
                log_sum_sq_prob="log_sum_sq_probs" in outputs,
                mean_logit="mean_logits" in outputs,
                options=options,
                **transform,
            )
        ctx.save_for_backward(hidden, weight, bias, targets, row_stats)
        ctx.dtype, ctx.transform, ctx.options = dtype, transform, options
        statistics = [v for v in (out.log_sum_sq_prob, out.mean_logit, out.top1) if v is not None]
        ctx.mark_non_differentiable(*statistics)
        return out.logprob, out.entropy, out.log_sum_sq_prob, out.mean_logit, out.top1

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, *_statistics):
        hidden, weight, bias, targets, row_stats = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype = ctx.dtype
        with _gather_context(weight, bias), torch.autocast(hidden.device.type, enabled=False):
            grads = token_logprobs_vjp(
                hidden.to(dtype),
                weight.to(dtype),
                targets,
                grad_logprob,
                grad_entropy,
                linear_bias=None if bias is None else bias.to(dtype),
                needs=(need_hidden, need_weight, need_bias),
                options=ctx.options,
                row_stats=row_stats,
                **ctx.transform,
            )
        grads = tuple(
            None if g is None else g.to(like.dtype)
            for g, like in zip(grads, (hidden, weight, bias), strict=True)
        )
        return (*grads, *([None] * 7))


class _FusedHead:
    """What replaces ``trl.trainer.utils._ChunkedLogProbFunction``: TRL's fused forward
    calls its ``apply`` with the kernel's arguments."""

    def __init__(self, options: LinearCrossEntropyOptions | None) -> None:
        self.options = options

    def apply(self, *arguments: object, **by_name: object) -> tuple[torch.Tensor | None, ...]:
        """The kernel's outputs for TRL's call: its arguments are those of
        ``ChunkedLogProbFunction.forward`` after ``ctx`` (``_LOGPROB_ARGS``, which
        :func:`patch` checks against the installed TRL)."""
        call = _KernelCall(*arguments, **by_name)
        routed = routed_head(
            call.hidden,
            call.weight,
            call.bias,
            call.targets,
            _compute_dtype(call.hidden, call.weight),
            _transform(call.temperature, call.logit_scale, call.final_logit_softcapping),
        )
        if routed is not None:  # the policy forward of a DPO step on linear_ce's DPO loss
            return routed
        return TokenLogprobsFunction.apply(*call, self.options)


def _compact_everywhere(device: torch.device) -> bool:
    """Replaces ``_use_triton`` in the TRL modules that call its kernels, where it only
    decides whether ignored positions are dropped before the head: always, here."""
    return True


@dataclasses.dataclass(frozen=True)
class _Swap:
    """One attribute of a TRL module that :func:`patch` replaces: ``check`` returns what
    differs from the TRL this adapter was written for (``None``: nothing), ``make``
    builds the replacement from the patch's options."""

    module: str
    name: str
    check: Callable[[object], str | None]
    make: Callable[[LinearCrossEntropyOptions | None], object]


def _parameters(fn: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _check_logprob_function(current: object) -> str | None:
    if isinstance(current, _FusedHead):
        return None
    kernel = importlib.import_module(_KERNEL)
    original = getattr(kernel, "ChunkedLogProbFunction", None)
    if original is None:
        return f"{_KERNEL}.ChunkedLogProbFunction is missing"
    if current is not original:
        return f"{_UTILS}._ChunkedLogProbFunction is not {_KERNEL}.ChunkedLogProbFunction"
    if _parameters(original.forward) != _LOGPROB_ARGS:
        return f"ChunkedLogProbFunction.forward takes {_parameters(original.forward)}, not {_LOGPROB_ARGS}"
    if tuple(getattr(kernel, "OPTIONAL_OUTPUTS", ())) != TRL_OUTPUTS:
        return f"{_KERNEL}.OPTIONAL_OUTPUTS is {getattr(kernel, 'OPTIONAL_OUTPUTS', None)}, not {TRL_OUTPUTS}"
    return _check_fused_forward()


def _check_fused_forward() -> str | None:
    utils = importlib.import_module(_UTILS)
    add = getattr(utils, "add_fused_lm_head", None)
    if add is None:
        return f"{_UTILS}.add_fused_lm_head is missing"
    if _parameters(add) != _FUSED_HEAD_ARGS:
        return f"add_fused_lm_head takes {_parameters(add)}, not {_FUSED_HEAD_ARGS}"
    reads = {
        name
        for const in add.__code__.co_consts
        if isinstance(const, types.CodeType)
        for name in const.co_names
    }
    missing = [name for name in _FUSED_FORWARD_READS if name not in reads]
    if missing:
        return f"add_fused_lm_head's forward no longer reads {', '.join(missing)}"
    gather = getattr(utils, "maybe_gather_lm_head_ctx", None)
    if gather is None or [p.kind for p in inspect.signature(gather).parameters.values()] != [
        inspect.Parameter.VAR_POSITIONAL
    ]:
        return f"{_UTILS}.maybe_gather_lm_head_ctx is not a function of (*params)"
    return None


def _compaction(module: str) -> _Swap:
    """The swap of ``module``'s ``_use_triton`` (TRL's kernels' caller imports it by name),
    which there only decides whether ignored positions are dropped before the head."""

    def check(current: object) -> str | None:
        if current is _compact_everywhere:
            return None
        if not callable(current) or len(_parameters(current)) != 1:
            return f"{module}._use_triton is not a function of a device"
        return None

    return _Swap(module, "_use_triton", check, lambda options: _compact_everywhere)


_DISTILLATION = "trl.trainer.distillation_trainer"


class _DistillationLoss:
    """Stands in for ``DistillationTrainer``'s ``_chunked_divergence_loss``: the same
    arguments and results, computed by :func:`linear_ce.linear_divergence`."""

    def __init__(self, options: LinearCrossEntropyOptions | None) -> None:
        self.options = options

    def __call__(self, *args, **kwargs):
        return chunked_divergence_loss(*args, **kwargs, options=self.options)


def _check_divergence_loss(current: object) -> str | None:
    if isinstance(current, _DistillationLoss):
        return None
    if not callable(current) or _parameters(current) != DIVERGENCE_LOSS_ARGS:
        return (
            f"{_DISTILLATION}._chunked_divergence_loss takes "
            f"{_parameters(current) if callable(current) else current!r}, not "
            f"{DIVERGENCE_LOSS_ARGS}"
        )
    trainer = getattr(importlib.import_module(_DISTILLATION), "DistillationTrainer", None)
    method = getattr(trainer, "_compute_loss", None)
    if method is None or "_chunked_divergence_loss" not in method.__code__.co_names:
        return "DistillationTrainer._compute_loss no longer calls _chunked_divergence_loss"
    return None


#: Every replacement :func:`patch` makes, checked all together before any is made.
_SWAPS = (
    _Swap(_UTILS, "_ChunkedLogProbFunction", _check_logprob_function, _FusedHead),
    _compaction(_UTILS),
    _Swap(_DISTILLATION, "_chunked_divergence_loss", _check_divergence_loss, _DistillationLoss),
    _Swap(DPO_MODULE, "DPOTrainer._compute_loss", check_dpo_loss, DPOLoss),
    _Swap(GRPO_MODULE, "GRPOTrainer._compute_loss", check_grpo_loss, GRPOLoss),
    _Swap(KTO_MODULE, "KTOTrainer._compute_loss", check_kto_loss, KTOLoss),
)

_PATCH = "linear_ce.integrations.trl.patch"
_PATCHED = "linear_ce.integrations.trl.patched"


class _Unpatched:
    """What TRL is wanted as when neither :func:`patch` nor a :func:`patched` block is in effect."""


_UNPATCHED = _Unpatched()

# Every change of the state below runs under this lock, so that patch(), unpatch() and
# patched() blocks entered and left by several threads leave TRL in one defined state.
_lock = threading.RLock()
# (module, name) -> the attribute before the first patch; empty when unpatched.
_originals: dict[tuple[str, str], object] = {}
# (module, name) -> the replacement installed there (its options updated in place).
_installed: dict[tuple[str, str], object] = {}
# The options of the last patch() not undone by unpatch(), or _UNPATCHED.
_explicit: LinearCrossEntropyOptions | _Unpatched | None = _UNPATCHED
# The patched() blocks now open, in the order they were entered: (block, options).
_blocks: list[tuple[object, LinearCrossEntropyOptions | None]] = []


def _import_trl() -> str:
    try:
        trl = importlib.import_module("trl")
    except ImportError as error:
        raise ImportError(
            f"linear_ce.integrations.trl needs trl{SUPPORTED_TRL}: pip install 'linear-ce[trl]'"
        ) from error
    return getattr(trl, "__version__", "unknown")


def _owner(module: str, name: str) -> tuple[object, str]:
    """Where ``module``'s attribute ``name`` lives (``"Class.method"``: on the class)."""
    owner: object = importlib.import_module(module)
    *path, attribute = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attribute


def _missing_attribute(swap: _Swap) -> str | None:
    try:
        owner, attribute = _owner(swap.module, swap.name)
    except ImportError as error:
        return f"{swap.module} cannot be imported ({error})"
    except AttributeError:
        return f"{swap.module}.{swap.name} is missing"
    if not hasattr(owner, attribute):
        return f"{swap.module}.{swap.name} is missing"
    return None


def _another_patch(current: object) -> str | None:
    """Who put ``current`` where TRL's own callable belongs, where that is neither TRL nor
    linear_ce (another library's wrapper): its qualified name and the module that defines
    it, read from its code (``functools.wraps`` copies the wrapped one's names); ``None``
    for TRL's, linear_ce's or what is not callable."""
    while isinstance(current, functools.partial):
        current = current.func
    if not callable(current):
        return None
    code = getattr(current, "__code__", None)
    if isinstance(current, types.FunctionType) and code is not None:
        module = current.__globals__.get("__name__", "?")
        name = getattr(code, "co_qualname", code.co_name)
    else:
        kind = current if isinstance(current, type) else type(current)
        module, name = kind.__module__, kind.__qualname__
    if module.split(".")[0] in ("trl", "linear_ce"):
        return None
    where = f" in {code.co_filename}" if code is not None else ""
    inner = getattr(current, "__wrapped__", None)
    wraps = "" if inner is None else f" wrapping {_qualified(inner)}"
    return f"{module}.{name}{where}{wraps}"


def _qualified(thing: object) -> str:
    return f"{getattr(thing, '__module__', '?')}.{getattr(thing, '__qualname__', '?')}"


def _install(options: LinearCrossEntropyOptions | None) -> None:
    """TRL patched with ``options``: the replacements made (after checking every one)
    the first time, their options updated after that."""
    if _installed:
        for replacement in _installed.values():
            replacement.options = options
        return
    version = _import_trl()
    problems, found = [], []
    for swap in _SWAPS:
        problem = _missing_attribute(swap)
        if problem is None:
            current = getattr(*_owner(swap.module, swap.name))
            problem = swap.check(current)
            other = None if problem is None else _another_patch(current)
            if other is not None:
                found.append(f"{swap.module}.{swap.name} is {other} ({problem})")
                continue
        if problem is not None:
            problems.append(problem)
    if found or problems:
        parts = []
        if found:
            parts.append(
                f"another library has replaced what linear_ce.integrations.trl patches: "
                f"{'; '.join(found)}. Undo that patch, or call patch() before it."
            )
        if problems:
            parts.append(
                f"linear_ce.integrations.trl supports trl{SUPPORTED_TRL}; the installed trl "
                f"{version} differs: {'; '.join(problems)}. Install a supported TRL "
                "(pip install 'linear-ce[trl]') or leave TRL unpatched."
            )
        raise UnsupportedTRLVersion(" ".join(parts))
    for swap in _SWAPS:
        owner, attribute = _owner(swap.module, swap.name)
        replacement = swap.make(options)
        original = getattr(owner, attribute)
        if isinstance(replacement, TrainerLoss):
            replacement.original = original  # the calls it leaves on TRL's route
        _originals[swap.module, swap.name] = original
        _installed[swap.module, swap.name] = replacement
        setattr(owner, attribute, replacement)


def _restore() -> None:
    """TRL's own attributes back, except where another patch now sits on top of ours:
    that one stays (it may call ours, or have saved ours to restore later), with a
    warning, and ours is forgotten."""
    covered = []
    for key, replacement in _installed.items():
        owner, attribute = _owner(*key)
        if getattr(owner, attribute, None) is replacement:
            setattr(owner, attribute, _originals[key])
        else:
            covered.append(".".join(key))
    _installed.clear()
    _originals.clear()
    if covered:
        warnings.warn(
            f"linear_ce.integrations.trl: {', '.join(covered)} was patched again after "
            "linear_ce patched it; that patch is left in place (TRL's own is not restored "
            "there), so undo it yourself to get TRL's back",
            RuntimeWarning,
            stacklevel=3,
        )


def _settle() -> None:
    """TRL as the open :func:`patched` blocks (the last entered) or else :func:`patch`
    want it."""
    wanted = _blocks[-1][1] if _blocks else _explicit
    if wanted is _UNPATCHED:
        if _installed:
            _restore()
    else:
        _install(wanted)


def _check_options(options: object, name: str) -> None:
    if options is not None and not isinstance(options, LinearCrossEntropyOptions):
        raise TypeError(
            f"{name}: options must be a linear_ce.LinearCrossEntropyOptions or None, got "
            f"{type(options).__name__} {options!r}"
        )


def patch(options: LinearCrossEntropyOptions | None = None) -> None:
    """Make TRL's fused LM head run on :func:`linear_ce.token_logprobs`, for every
    model, including those TRL patched before this call.

    ``options`` (:class:`~linear_ce.LinearCrossEntropyOptions`) set the chunking and
    precision; anything else is a ``TypeError``, here rather than at the first forward.
    Calling ``patch`` again replaces the options (TRL is patched once). Inside an open
    :func:`patched` block that block's options apply; these apply once every block has
    ended. Raises :class:`UnsupportedTRLVersion` (nothing is patched) when the installed
    TRL differs from ``trl`` :data:`SUPPORTED_TRL` in what this adapter relies on, and
    ``ImportError`` without TRL. Thread-safe.
    """
    global _explicit
    _check_options(options, _PATCH)
    with _lock:
        before = _explicit
        _explicit = options
        try:
            _settle()
        except BaseException:
            _explicit = before
            raise


def unpatch() -> None:
    """Give TRL its own fused LM head back (nothing happens when it is not patched).

    Where another patch was applied on top of linear_ce's to the same TRL attribute,
    that patch is left in place and a ``RuntimeWarning`` says so. Raises
    ``RuntimeError`` (and changes nothing) while a :func:`patched` block is open: that
    block ends the patch itself when it exits.
    """
    global _explicit
    with _lock:
        if _blocks:
            raise RuntimeError(
                f"linear_ce.integrations.trl.unpatch: {len(_blocks)} patched() block(s) are "
                "open; TRL is unpatched when the last one exits"
            )
        _explicit = _UNPATCHED
        _settle()


def is_patched() -> bool:
    """Whether TRL's fused LM head currently runs on ``linear_ce``."""
    with _lock:
        return bool(_installed)


@contextlib.contextmanager
def patched(options: LinearCrossEntropyOptions | None = None) -> Iterator[None]:
    """:func:`patch` for the duration of a ``with`` block.

    Blocks may nest or overlap (in several threads): while any is open TRL is patched,
    with the options of the one entered last among those still open; when the last
    one exits, TRL is as :func:`patch`/:func:`unpatch` left it (unpatched, or patched
    with :func:`patch`'s options), whatever order the blocks exit in.
    """
    _check_options(options, _PATCHED)
    block = object()
    with _lock:
        _blocks.append((block, options))
        try:
            _settle()
        except BaseException:
            _blocks.pop()
            raise
    try:
        yield
    finally:
        with _lock:
            _blocks[:] = [entry for entry in _blocks if entry[0] is not block]
            _settle()
