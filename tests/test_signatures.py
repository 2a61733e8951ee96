"""The public functions' signatures, pinned: what ``inspect.signature``, ``help()`` and the
type hints show a user. Written out here from the documented parameter lists (each
function's Args section, which must name every parameter), so a refactor of the code
behind them (issue 30: shared checks and preludes) cannot change one unnoticed. Each
family has one public function; a head split along the vocabulary is its
``vocab_parallel`` argument (issue 48), not a second function."""

from __future__ import annotations

import inspect
import re
import typing

import pytest

import linear_ce
import linear_ce.distributed
import linear_ce.reference

SIGNATURES = {
    "linear_cross_entropy": (
        "input: torch.Tensor",
        "linear_weight: torch.Tensor",
        "target: torch.Tensor",
        "*",
        "linear_bias: torch.Tensor | None = None",
        "weight: torch.Tensor | None = None",
        "reduction: str = 'mean'",
        "ignore_index: int | None = None",
        "label_smoothing: float = 0.0",
        "options: LinearCrossEntropyOptions | None = None",
        "z_loss: float = 0.0",
        "return_z_loss: bool = False",
        "return_lse: bool = False",
        "softcap: float | None = None",
        "shift: bool | int = False",
        "token_weight: torch.Tensor | None = None",
        "logit_scale: float = 1.0",
        "temperature: float = 1.0",
        "loss_dtype: torch.dtype | None = None",
        "-> torch.Tensor | LinearCrossEntropyOutput",
    ),
    "reference.linear_cross_entropy": (
        "input: torch.Tensor",
        "linear_weight: torch.Tensor",
        "target: torch.Tensor",
        "*",
        "linear_bias: torch.Tensor | None = None",
        "weight: torch.Tensor | None = None",
        "reduction: str = 'mean'",
        "ignore_index: int | None = None",
        "label_smoothing: float = 0.0",
        "options: object = None",
        "z_loss: float = 0.0",
        "return_z_loss: bool = False",
        "return_lse: bool = False",
        "softcap: float | None = None",
        "shift: bool | int = False",
        "token_weight: torch.Tensor | None = None",
        "logit_scale: float = 1.0",
        "temperature: float = 1.0",
        "-> torch.Tensor | LinearCrossEntropyOutput",
    ),
    "token_logprobs": (
        "input: torch.Tensor",
        "linear_weight: torch.Tensor",
        "target: torch.Tensor",
        "*",
        "linear_bias: torch.Tensor | None = None",
        "ignore_index: int = -100",
        "shift: bool | int = False",
        "temperature: float = 1.0",
        "logit_scale: float = 1.0",
        "softcap: float | None = None",
        "entropy: bool = False",
        "top1: bool = False",
        "top1_rule: str = 'unique'",
        "log_sum_sq_prob: bool = False",
        "mean_logit: bool = False",
        "topk: int | None = None",
        "options: LinearCrossEntropyOptions | None = None",
        "-> TokenLogprobs",
    ),
    "token_logprobs_vjp": (
        "input: torch.Tensor",
        "linear_weight: torch.Tensor",
        "target: torch.Tensor",
        "grad_logprob: torch.Tensor | None",
        "grad_entropy: torch.Tensor | None",
        "*",
        "linear_bias: torch.Tensor | None = None",
        "ignore_index: int = -100",
        "temperature: float = 1.0",
        "logit_scale: float = 1.0",
        "softcap: float | None = None",
        "needs: tuple[bool, bool, bool] = (True, True, True)",
        "options: LinearCrossEntropyOptions | None = None",
        "row_stats: torch.Tensor | None = None",
        "-> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]",
    ),
    "token_objective": (
        "input: torch.Tensor",
        "linear_weight: torch.Tensor",
        "target: torch.Tensor",
        "objective: Callable[..., torch.Tensor]",
        "*",
        "linear_bias: torch.Tensor | None = None",
        "ignore_index: int = -100",
        "shift: bool | int = False",
        "temperature: float = 1.0",
        "logit_scale: float = 1.0",
        "softcap: float | None = None",
        "entropy: bool = False",
        "options: LinearCrossEntropyOptions | None = None",
        "**token_tensors: torch.Tensor",
        "-> torch.Tensor",
    ),
    "linear_divergence": (
        "student_input: torch.Tensor",
        "student_weight: torch.Tensor",
        "teacher_input: torch.Tensor",
        "teacher_weight: torch.Tensor",
        "target: torch.Tensor | None = None",
        "*",
        "student_bias: torch.Tensor | None = None",
        "teacher_bias: torch.Tensor | None = None",
        "beta: float = 0.0",
        "temperature: float = 1.0",
        "student_logit_scale: float = 1.0",
        "teacher_logit_scale: float = 1.0",
        "student_softcap: float | None = None",
        "teacher_softcap: float | None = None",
        "ignore_index: int = -100",
        "shift: bool | int = False",
        "reduction: str = 'mean'",
        "hard_weight: float = 0.0",
        "return_entropy: bool = False",
        "options: LinearCrossEntropyOptions | None = None",
        "-> torch.Tensor | tuple[torch.Tensor, torch.Tensor]",
    ),
    "sparse_divergence": (
        "input: torch.Tensor",
        "linear_weight: torch.Tensor",
        "target_ids: torch.Tensor",
        "target_logprobs: torch.Tensor",
        "target: torch.Tensor | None = None",
        "*",
        "linear_bias: torch.Tensor | None = None",
        "beta: float = 0.0",
        "mass: str = 'renormalize'",
        "temperature: float = 1.0",
        "target_temperature: float = 1.0",
        "logit_scale: float = 1.0",
        "softcap: float | None = None",
        "ignore_index: int = -100",
        "shift: bool | int = False",
        "reduction: str = 'mean'",
        "hard_weight: float = 0.0",
        "options: LinearCrossEntropyOptions | None = None",
        "-> torch.Tensor",
    ),
    "sequence_objective": (
        "input: torch.Tensor",
        "linear_weight: torch.Tensor",
        "target: torch.Tensor",
        "objective: Callable[[SequenceBatch], torch.Tensor]",
        "*",
        "sequence: torch.Tensor | None = None",
        "cu_seqlens: torch.Tensor | None = None",
        "group: torch.Tensor | str | None = None",
        "linear_bias: torch.Tensor | None = None",
        "ignore_index: int = -100",
        "shift: bool | int = False",
        "temperature: float = 1.0",
        "logit_scale: float = 1.0",
        "softcap: float | None = None",
        "entropy: bool = False",
        "reduction: str = 'mean'",
        "options: LinearCrossEntropyOptions | None = None",
        "**side_inputs: torch.Tensor",
        "-> SequenceObjectiveOutput",
    ),
}
# token_logprobs' parameters, returning the per-token statistics beside its outputs.
SIGNATURES["token_logprobs_and_stats"] = (
    *SIGNATURES["token_logprobs"][:-1],
    "-> tuple[TokenLogprobs, torch.Tensor]",
)

# The families' public functions take a head split along the vocabulary as their last
# named keyword (before a catch-all of side inputs).
VOCAB_PARALLEL = "vocab_parallel: VocabParallel | None = None"
FAMILIES = (
    "linear_cross_entropy",
    "token_logprobs",
    "token_objective",
    "linear_divergence",
    "sparse_divergence",
    "sequence_objective",
)
for _name in FAMILIES:
    _end = next(i for i, e in enumerate(SIGNATURES[_name]) if e.startswith(("**", "->")))
    SIGNATURES[_name] = (*SIGNATURES[_name][:_end], VOCAB_PARALLEL, *SIGNATURES[_name][_end:])


def _function(name: str):
    module, _, attribute = name.rpartition(".")
    return getattr(linear_ce.reference if module == "reference" else linear_ce, attribute)


def _entries(fn) -> tuple[str, ...]:
    """The signature as the tables above write it: ``name: annotation = default`` per
    parameter, ``*`` before the keyword-only ones, ``**`` on a catch-all, then the return."""
    signature = inspect.signature(fn)
    entries, starred = [], False
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY and not starred:
            entries.append("*")
            starred = True
        text = ("**" if parameter.kind is parameter.VAR_KEYWORD else "") + parameter.name
        text += f": {parameter.annotation}"
        if parameter.default is not parameter.empty:
            text += f" = {parameter.default!r}"
        entries.append(text)
    return (*entries, f"-> {signature.return_annotation}")


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_public_signature_is_pinned(name):
    assert _entries(_function(name)) == SIGNATURES[name]


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_type_hints_resolve(name):
    """``typing.get_type_hints`` (what IDEs and ``help()`` read) resolves every annotation."""
    fn = _function(name)
    hints = typing.get_type_hints(fn)
    assert set(hints) == {*inspect.signature(fn).parameters, "return"}


# The functions whose docstring has an Args section (the others say "as in" another one).
WITH_ARGS = sorted(
    set(SIGNATURES)
    - {"reference.linear_cross_entropy", "token_logprobs_and_stats", "token_logprobs_vjp"}
)


@pytest.mark.parametrize("name", WITH_ARGS)
def test_every_parameter_is_documented(name):
    """Each parameter is named in the docstring's Args section."""
    fn = _function(name)
    args = inspect.getdoc(fn).split("Args:")[1].split("Returns:")[0]
    missing = [p for p in inspect.signature(fn).parameters if not re.search(rf"\b{p}\b", args)]
    assert not missing, f"{name}: not in Args: {missing}"


def test_one_public_function_per_family():
    """No ``vocab_parallel_<function>`` twin is left, in ``linear_ce`` or in
    ``linear_ce.distributed`` (which holds only what is not a head)."""
    for module in (linear_ce, linear_ce.distributed):
        twins = [name for name in dir(module) if name.startswith("vocab_parallel_")]
        assert not twins, f"{module.__name__}: {twins}"
    assert sorted(linear_ce.distributed.__all__) == ["VocabParallel", "VocabShard", "shard_layout"]


@pytest.mark.parametrize("name", FAMILIES)
def test_vocab_parallel_is_documented_once_for_every_family(name):
    """Every family's ``vocab_parallel`` entry points at :class:`linear_ce.VocabParallel`,
    where what every family shares is written once, and lists the family's own
    collectives (the docstrings are read statically by the docs site, so the entry is
    written in each, not inserted at import)."""
    args = inspect.getdoc(_function(name)).split("Args:")[1].split("Returns:")[0]
    entry = re.search(r"^    vocab_parallel: (.*?)(?=^    \S|\Z)", args, re.M | re.S)
    assert entry, f"{name}: no vocab_parallel entry in Args"
    text = " ".join(entry.group(1).split())
    assert text.startswith("``None`` for a whole head, or a :class:`~linear_ce.VocabParallel`")
    assert "all_reduce" in text.split("Collectives: ")[1]
    shared = " ".join(inspect.getdoc(linear_ce.VocabParallel).split())
    assert "the head's shard gets the gradient of its own rows" in shared
    assert "the input the whole gradient (summed over the group)" in shared
