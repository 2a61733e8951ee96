r"""Train Hugging Face ``*ForCausalLM`` models with :func:`linear_ce.linear_cross_entropy`.

A patched model computes its training loss straight from the last hidden
states and ``lm_head``: when ``labels`` are given, the ``(batch, seq, vocab)``
logits are never built. Without ``labels`` (inference, ``generate``) the
model's own ``forward`` runs unchanged.

With labels the patched ``forward`` returns the model's usual output with
``loss`` set and ``logits=None``; the loss equals the model's own
(``ForCausalLMLoss``) up to float rounding:

.. math::
    \mathcal{L} = \frac{1}{D}\sum_{b,t\,:\,y_{b,t+1}\neq -100}
        \Big[\mathrm{lse}(s_{b,t}) - s_{b,t,y_{b,t+1}}\Big],
    \qquad s_{b,t} = c\,\tanh\!\big(W h_{b,t} / c\big)\ \text{(Gemma 2/3)}\ \text{or}\ W h_{b,t} + b

where :math:`D` is ``num_items_in_batch`` when given (so micro-batches of
one accumulated step add up to the big batch's loss and gradients), else the
number of non-ignored labels. Handled exactly like the model does:

- the label shift (position ``t`` predicts ``labels[:, t+1]``), or
  ``shift_labels`` used as given;
- ``ignore_index`` (-100 unless passed as a keyword, as the model accepts);
- ``num_items_in_batch`` (passed by ``Trainer`` for gradient accumulation);
- tied embeddings (``lm_head.weight`` *is* ``embed_tokens.weight``; both
  uses add into one gradient);
- ``config.final_logit_softcapping`` of Gemma 2 and Gemma 3;
- the logit scale of Cohere (``logit_scale``), Granite (``1 / logits_scaling``) and
  Falcon-H1 (``lm_head_multiplier``), as ``logit_scale`` of the loss;
- ``lm_head.bias`` (Phi);
- autocast: the loss runs in the wider of the autocast dtype and
  ``lm_head.weight``'s dtype. A bf16 model under bf16 autocast computes in bf16,
  as ``lm_head`` itself would; fp32 parameters keep fp32 (where ``lm_head`` would
  run a bf16 GEMM), so their gradients are fp32 sums within fp32 rounding of the
  float64 gradient (2e-7, against the model's own head's 2.4e-3 and a bf16 loss's
  2.85e-3 in a tiny Llama), at the price of fp32 GEMMs where the model's head ran
  bf16 ones (``docs/integrations.md``).

``logits_to_keep`` only selects which logits are returned; with labels none
are, and the loss always covers every position. ``return_dict=False`` gives
``output.to_tuple()``, which skips ``None`` fields: the tuple starts
``(loss, cache, ...)`` without logits.

The loss runs *inside a call of* ``lm_head`` (its ``forward`` is swapped for
that one call), so hooks registered on it still fire around the loss:
FSDP2's unshard/reshard and DeepSpeed ZeRO-3's parameter gathering see an
ordinary ``lm_head`` call, and ``lm_head.weight`` is read at that moment,
never cached. Wrappers that replace ``lm_head.forward`` itself are bypassed
for that call. Under ``torch.compile`` that call runs eagerly (one graph
break); the rest of the model is compiled as usual.

Example::

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from linear_ce.integrations.transformers import patch
    >>> config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
    ...                      num_hidden_layers=2, num_attention_heads=4)
    >>> model = patch(LlamaForCausalLM(config))
    >>> ids = torch.randint(0, 1000, (2, 32))
    >>> out = model(input_ids=ids, labels=ids)       # out.logits is None
    >>> out.loss.backward()
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import transformers
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from linear_ce.functional import linear_cross_entropy

__all__ = [
    "LOGIT_SCALES",
    "SUPPORTED_MODELS",
    "is_patched",
    "patch",
    "patch_model_class",
    "unpatch",
    "unpatch_model_class",
]

#: Class names whose ``forward`` is "base model → last hidden states → lm_head
#: (→ final-logit softcap) → ForCausalLMLoss"; the value says whether the
#: softcap step exists.
SUPPORTED_MODELS: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": False,
    "Qwen3ForCausalLM": False,
    "GemmaForCausalLM": False,
    "Gemma2ForCausalLM": True,
    "Gemma3ForCausalLM": True,
    "Phi3ForCausalLM": False,
    "PhiForCausalLM": False,
    "Olmo2ForCausalLM": False,
    "Starcoder2ForCausalLM": False,
    "SmolLM3ForCausalLM": False,
    "CohereForCausalLM": False,
    "Cohere2ForCausalLM": False,
    "GraniteForCausalLM": False,
    "FalconH1ForCausalLM": False,
}

#: Families that scale their logits after ``lm_head``: how to read the factor off the model
#: (Cohere multiplies by ``logit_scale``, Granite divides by ``config.logits_scaling``,
#: Falcon-H1 multiplies by ``lm_head_multiplier``). It becomes ``logit_scale`` of the loss.
LOGIT_SCALES: dict[str, Callable[[nn.Module], float]] = {
    "CohereForCausalLM": lambda model: model.logit_scale,
    "Cohere2ForCausalLM": lambda model: model.logit_scale,
    "GraniteForCausalLM": lambda model: 1.0 / model.config.logits_scaling,
    "FalconH1ForCausalLM": lambda model: model.model.lm_head_multiplier,
}

_MARK = "__linear_ce_original__"
# Patching and unpatching check, then change, a forward: one lock makes that one step
# when several threads patch (the same model or class) at once.
_lock = threading.RLock()
# The forwards _fused_forward made. functools.wraps copies _MARK onto a wrapper put on top
# of ours; only identity tells ours from it.
_ours: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
# Each class patch_model_class() patched -> the forward it installed there.
_class_patches: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()
# One lock per lm_head: its forward is swapped for one call (see _loss_through_head).
_head_locks: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
# Keywords that only shape the logits output, which the training path does not build.
_LOGITS_KEYWORDS = ("logits_to_keep", "num_logits_to_keep")

ModelT = TypeVar("ModelT", bound=nn.Module)
ClassT = TypeVar("ClassT", bound=type)


def _supported_names() -> str:
    return ", ".join(name for name in SUPPORTED_MODELS if hasattr(transformers, name))


def _family(cls: type) -> type:
    """The supported transformers class ``cls`` is or derives from, with an unchanged ``forward``."""
    for base in cls.__mro__:
        if (
            SUPPORTED_MODELS.get(base.__name__) is not None
            and getattr(transformers, base.__name__, None) is base
        ):
            if _original(cls.forward) is not _original(base.forward):
                raise TypeError(
                    f"{cls.__name__} overrides forward() of {base.__name__}; linear_ce can only "
                    f"replace the forward of the supported classes: {_supported_names()}"
                )
            return base
    raise TypeError(
        f"{cls.__name__} is not supported by linear_ce.integrations.transformers; supported "
        f"classes (in transformers {transformers.__version__}): {_supported_names()}"
    )


def _original(forward: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(forward, _MARK, forward)


def _is_ours(forward: object) -> bool:
    """Whether ``forward`` (a function or a method bound to a model) is one :func:`patch` or
    :func:`patch_model_class` installed, not a wrapper around one."""
    function = getattr(forward, "__func__", forward)
    try:
        return function in _ours
    except TypeError:  # not weak-referenceable: no function of ours
        return False


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` (by :func:`patch`) or its class (by :func:`patch_model_class`) is patched."""
    return hasattr(getattr(model.forward, "__func__", model.forward), _MARK)


def patch(model: ModelT) -> ModelT:
    """Make ``model`` compute its training loss with ``linear_cross_entropy``.

    Replaces ``model.forward`` on this instance only (see the module
    docstring for what changes); patching a patched model does nothing.

    Args:
        model: an instance of one of :data:`SUPPORTED_MODELS` (or of a subclass
            that does not override ``forward``), e.g. ``LlamaForCausalLM``.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: for an unsupported model (the message lists the supported
            classes), an ``lm_head`` that is not an ``nn.Linear``, a model
            whose loss function is not transformers' ``ForCausalLMLoss``, or
            one whose ``forward`` was already replaced on the instance.
    """
    family = _family(type(model))
    _check_instance(model)
    with _lock:
        own_forward = vars(model).get("forward")
        if own_forward is not None and not _is_ours(own_forward):
            if is_patched(model):  # ours, under a wrapper that copied its attributes
                return model
            raise TypeError(
                f"this {type(model).__name__} already has its own forward on the instance (e.g. "
                "accelerate's device hooks); call patch(model) before wrapping or dispatching it"
            )
        if not is_patched(model):
            model.forward = _fused_forward(_original(family.forward)).__get__(model)
    return model


def unpatch(model: ModelT) -> ModelT:
    """Undo :func:`patch`: ``model`` computes its loss from the logits again. Returns ``model``.

    Raises ``ValueError``, changing nothing, when ``model`` was not patched by
    :func:`patch`, or when another wrapper replaced its ``forward`` after :func:`patch`
    (undoing ours would drop that one): remove that wrapper first.
    """
    with _lock:
        own_forward = vars(model).get("forward")
        if own_forward is not None and _is_ours(own_forward):
            del model.forward
            return model
    name = type(model).__name__
    if own_forward is not None and is_patched(model):
        raise ValueError(
            f"unpatch: this {name}'s forward was wrapped again after patch() (by "
            f"{own_forward!r}); linear_ce's patch is under that wrapper and stays: remove the "
            "wrapper first"
        )
    raise ValueError(
        f"unpatch: this {name} was not patched by patch() (or its forward was replaced since); "
        "a class patched by patch_model_class() is undone with unpatch_model_class()"
    )


def patch_model_class(cls: ClassT) -> ClassT:
    """Patch ``cls.forward`` so every instance, existing or future, uses ``linear_cross_entropy``.

    Args:
        cls: one of :data:`SUPPORTED_MODELS`, e.g. ``transformers.LlamaForCausalLM``.

    Returns:
        ``cls`` itself; patching twice does nothing.
    """
    if not isinstance(cls, type):
        raise TypeError(
            f"patch_model_class expects a model class, got {type(cls).__name__}; "
            "use patch(model) for an instance"
        )
    family = _family(cls)
    if family is not cls:
        raise TypeError(
            f"patch_model_class: patch {family.__name__} itself, not its subclass {cls.__name__}"
        )
    with _lock:
        if not hasattr(cls.forward, _MARK):
            forward = _fused_forward(cls.forward)
            _class_patches[cls] = forward
            cls.forward = forward
    return cls


def unpatch_model_class(cls: ClassT) -> ClassT:
    """Undo :func:`patch_model_class`. Returns ``cls``.

    Raises ``ValueError``, changing nothing, when ``cls`` was not patched by
    :func:`patch_model_class`, or when another patch replaced ``cls.forward`` after it
    (undoing ours would drop that one): undo that patch first.
    """
    name = getattr(cls, "__name__", cls)
    with _lock:
        forward = vars(cls).get("forward") if isinstance(cls, type) else None
        ours = _class_patches.get(cls) if isinstance(cls, type) else None
        if ours is not None and forward is ours:
            cls.forward = getattr(forward, _MARK)
            del _class_patches[cls]
            return cls
    if ours is not None and hasattr(forward, _MARK):
        raise ValueError(
            f"unpatch_model_class: {name}.forward was patched again after patch_model_class() "
            f"(by {forward!r}); linear_ce's patch is under it and stays: undo that patch first"
        )
    raise ValueError(f"unpatch_model_class: {name!r} was not patched by patch_model_class()")


def _check_instance(model: nn.Module) -> None:
    name = type(model).__name__
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"{name}.lm_head must be a torch.nn.Linear for linear_ce to read its weight, got "
            f"{type(head).__name__}"
        )
    if not isinstance(getattr(model, "model", None), nn.Module):
        raise TypeError(
            f"{name} has no base model at .model; linear_ce needs its last hidden states"
        )
    if model.loss_function is not ForCausalLMLoss:
        raise TypeError(
            f"{name} uses the loss function {getattr(model.loss_function, '__name__', '?')} "
            "(a custom loss_function or config.loss_type); linear_ce replaces only "
            "transformers' ForCausalLMLoss"
        )


def _fused_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a supported class's forward) with its labels branch computed by linear_ce."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("labels") is None:
            return original(self, *args, **kwargs)
        arguments: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            else:
                arguments[name] = value
        del arguments[next(iter(signature.parameters))]
        _check_instance(self)
        return _training_forward(self, arguments)

    setattr(forward, _MARK, original)
    _ours.add(forward)
    return forward


def _training_forward(model: nn.Module, arguments: dict[str, Any]) -> Any:
    labels = arguments.pop("labels")
    # The model hands these to its loss function; the base model has no use for them.
    num_items_in_batch = arguments.pop("num_items_in_batch", None)
    shift_labels = arguments.pop("shift_labels", None)
    ignore_index = arguments.pop("ignore_index", -100)
    return_dict = arguments.pop("return_dict", None)
    for name in _LOGITS_KEYWORDS:
        arguments.pop(name, None)

    outputs = model.model(**arguments, return_dict=True)
    hidden = outputs.last_hidden_state
    target = labels if shift_labels is None else shift_labels
    family = _family(type(model)).__name__
    softcap = (
        getattr(model.config, "final_logit_softcapping", None) if SUPPORTED_MODELS[family] else None
    )
    scale = LOGIT_SCALES.get(family)
    loss = _loss_through_head(
        model.lm_head,
        hidden,
        target.to(hidden.device),
        shift=shift_labels is None,
        ignore_index=ignore_index,
        softcap=softcap,
        logit_scale=1.0 if scale is None else float(scale(model)),
        reduction="mean" if num_items_in_batch is None else "sum",
    ).float()
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch

    fields = {key: value for key, value in outputs.items() if key != "last_hidden_state"}
    output = CausalLMOutputWithPast(loss=loss, logits=None, **fields)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return output if return_dict else output.to_tuple()


# Dynamo cannot trace swapping a module's forward: under torch.compile this call runs
# eagerly (one graph break) while the rest of the model stays compiled.
@torch.compiler.disable
def _loss_through_head(
    head: nn.Linear, hidden: torch.Tensor, target: torch.Tensor, **loss_args: Any
) -> torch.Tensor:
    """The loss, computed as the ``forward`` of one call of ``head`` so its hooks fire around it."""

    def loss_forward(input: torch.Tensor) -> torch.Tensor:
        weight, bias = head.weight, head.bias
        device = input.device.type
        if torch.is_autocast_enabled(device):
            # Parameters wider than autocast's dtype keep theirs: their gradients are then
            # sums in that dtype, not bf16-rounded ones (see the module doc).
            dtype = torch.promote_types(torch.get_autocast_dtype(device), weight.dtype)
            input, weight = input.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        # The model's own loss upcasts the logits: report the loss at fp32, unrounded.
        wide = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else None
        return linear_cross_entropy(
            input, weight, target, linear_bias=bias, loss_dtype=wide, **loss_args
        )

    # Overlapping calls through one head (threads) would each restore the forward they saw
    # on entry, one of them the other's loss: the swap, call and restore run one at a time.
    with _lock:
        head_lock = _head_locks.setdefault(head, threading.RLock())
    with head_lock:
        own_forward = vars(head).get("forward")
        head.forward = loss_forward
        try:
            return head(hidden)
        finally:
            if own_forward is None:
                del head.forward
            else:
                head.forward = own_forward
