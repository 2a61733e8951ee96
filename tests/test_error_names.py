"""Every bad input is reported under the name of the public function the user called,
with the argument named as that function names it (``linear_divergence``'s
``student_input``, not the ``input`` of the checks it shares with the loss).

Each case is one bad argument, applied to every public entry point that takes it; the
expected message is written here from the function's own signature, not read from
the package.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.distributed as dist

import linear_ce
from conftest import eps, leave_gloo_group, rel_err
from linear_ce import LinearCrossEntropyOptions, VocabParallel

N, F_, V, FT = 6, 4, 5, 3


def _objective(logprob, entropy, **side):
    return -logprob


# The divergence's student head is checked by the per-token checks; its arguments keep
# the divergence's names in every message.
STUDENT = {
    "input": "student_input",
    "linear_weight": "student_weight",
    "linear_bias": "student_bias",
    "softcap": "student_softcap",
    "logit_scale": "student_logit_scale",
}


# The vocab-parallel calls get their layout: without it they gather the shard sizes,
# a collective, and on torch < 2.8 destroying a gloo group that ran one can deadlock
# (its destructor joins gloo's threads holding the GIL; pytorch PR 154976). With it,
# every case here fails before any collective.
LAYOUT = {"vocab_parallel": VocabParallel(None, 0, V)}
#: A registry key's suffix for the call with a vocab-parallel head; it reports under the
#: function's own name.
VP = "@vocab_parallel"


def _called(key: str) -> str:
    """The public function a registry key calls (the name its errors report under)."""
    return key.removesuffix(VP)


def _single_head(fn, *extra, **fixed):
    def call(input, linear_weight, target, **kwargs):
        return fn(input, linear_weight, target, *extra, **fixed, **kwargs)

    return call


def _vjp(input, linear_weight, target, **kwargs):
    return linear_ce.token_logprobs_vjp(input, linear_weight, target, torch.ones(N), None, **kwargs)


def _divergence(fn, **fixed):
    """The divergence with ``target`` as hard labels (``hard_weight > 0``): only then
    are its values class indices, checked against the vocabulary."""

    def call(input, linear_weight, target, **kwargs):
        kwargs = {STUDENT.get(k, k): v for k, v in kwargs.items()}
        teacher = (torch.randn(N, FT), torch.randn(V, FT))
        return fn(input, linear_weight, *teacher, target, hard_weight=0.5, **fixed, **kwargs)

    return call


def _sequence_objective(batch):
    return -batch.logprob


# The sequence objective's rows as two packed sequences of three tokens.
PACKED = {"cu_seqlens": torch.tensor([0, N // 2, N])}


def _sparse(fn, **fixed):
    """The sparse divergence with a stored teacher's two slots per position and ``target``
    as hard labels."""

    def call(input, linear_weight, target, **kwargs):
        ids = torch.tensor([[0, 1]] * N)
        logprobs = torch.tensor([[0.5, 0.25]] * N).log()
        return fn(input, linear_weight, ids, logprobs, target, hard_weight=0.5, **fixed, **kwargs)

    return call


# name -> (the call, taking the single-head arguments; the function's own name for each
# argument; the function, whose signature says which cases apply; needs a process group)
FUNCTIONS = {
    "linear_cross_entropy": (
        _single_head(linear_ce.linear_cross_entropy),
        {},
        linear_ce.linear_cross_entropy,
        False,
    ),
    "token_logprobs": (
        _single_head(linear_ce.token_logprobs),
        {},
        linear_ce.token_logprobs,
        False,
    ),
    "token_logprobs_and_stats": (
        _single_head(linear_ce.token_logprobs_and_stats),
        {},
        linear_ce.token_logprobs_and_stats,
        False,
    ),
    "token_logprobs_vjp": (_vjp, {}, linear_ce.token_logprobs_vjp, False),
    "token_objective": (
        _single_head(linear_ce.token_objective, _objective),
        {},
        linear_ce.token_objective,
        False,
    ),
    "linear_divergence": (
        _divergence(linear_ce.linear_divergence),
        STUDENT,
        linear_ce.linear_divergence,
        False,
    ),
    "sequence_objective": (
        _single_head(linear_ce.sequence_objective, _sequence_objective, **PACKED),
        {},
        linear_ce.sequence_objective,
        False,
    ),
    "sparse_divergence": (
        _sparse(linear_ce.sparse_divergence),
        {},
        linear_ce.sparse_divergence,
        False,
    ),
    "sequence_objective" + VP: (
        _single_head(linear_ce.sequence_objective, _sequence_objective, **PACKED, **LAYOUT),
        {},
        linear_ce.sequence_objective,
        True,
    ),
    "sparse_divergence" + VP: (
        _sparse(linear_ce.sparse_divergence, **LAYOUT),
        {},
        linear_ce.sparse_divergence,
        True,
    ),
    "linear_cross_entropy" + VP: (
        _single_head(linear_ce.linear_cross_entropy, **LAYOUT),
        {},
        linear_ce.linear_cross_entropy,
        True,
    ),
    "token_logprobs" + VP: (
        _single_head(linear_ce.token_logprobs, **LAYOUT),
        {},
        linear_ce.token_logprobs,
        True,
    ),
    "token_objective" + VP: (
        _single_head(linear_ce.token_objective, _objective, **LAYOUT),
        {},
        linear_ce.token_objective,
        True,
    ),
    "linear_divergence" + VP: (
        _divergence(linear_ce.linear_divergence, **LAYOUT),
        STUDENT,
        linear_ce.linear_divergence,
        True,
    ),
}


def _x():
    return torch.randn(N, F_)


def _w():
    return torch.randn(V, F_)


# case -> (changes to a good call, TypeError or ValueError, the message after "name: ",
# with {input}, {linear_weight}, ... standing for the function's names of them)
CASES = {
    "input not a tensor": (
        {"input": [[1.0] * F_] * N},
        ValueError,
        r"{input} must be a Tensor, got list",
    ),
    "integer input": (
        {
            "input": torch.ones(N, F_, dtype=torch.long),
            "linear_weight": torch.ones(V, F_, dtype=torch.long),
        },
        ValueError,
        r"{input} must be a floating tensor .*got torch.int64",
    ),
    "weight dtype": (
        {"linear_weight": torch.randn(V, F_, dtype=torch.float64)},
        ValueError,
        r"{linear_weight} dtype torch.float64 differs from {input} dtype torch.float32",
    ),
    "in_features": (
        {"linear_weight": torch.randn(V, F_ + 1)},
        ValueError,
        r"in_features mismatch: {input} has 4 features .* but {linear_weight} has 5",
    ),
    "bias shape": (
        {"linear_bias": torch.randn(V + 1)},
        ValueError,
        r"{linear_bias} must have shape \(5,\)",
    ),
    "bias dtype": (
        {"linear_bias": torch.randn(V, dtype=torch.float64)},
        ValueError,
        r"{linear_bias} dtype torch.float64 differs from {input} dtype",
    ),
    "target shape": (
        {"target": torch.zeros(N + 1, dtype=torch.long)},
        ValueError,
        r"class-index target must have shape \(6,\) \({input}'s batch shape",
    ),
    "bool target": (
        {"target": torch.zeros(N, dtype=torch.bool)},
        ValueError,
        r"class-index target must be an integer tensor "
        r"\(int64, int32, int16, int8 or uint8\), got torch.bool",
    ),
    "target out of range": (
        {"target": torch.full((N,), V)},
        ValueError,
        r"target contains class index 5, outside \[0, 5\)",
    ),
    # The meta device stands in for a second device. (A vocab-parallel shard on another
    # device is met first by the shard-layout collective, in distributed.py.)
    "input on another device": (
        {"input": torch.randn(N, F_, device="meta")},
        ValueError,
        r"all tensors must be on one device, got {input} on meta",
    ),
    "softcap": ({"softcap": 0.0}, ValueError, r"{softcap} must be None or a finite float > 0"),
    "logit_scale": ({"logit_scale": -1.0}, ValueError, r"{logit_scale} must be a finite float > 0"),
    "temperature": ({"temperature": 0.0}, ValueError, r"temperature must be a finite float > 0"),
    "ignore_index": ({"ignore_index": 1.5}, ValueError, r"ignore_index must be an int"),
    "ignore_index too large": (
        {"ignore_index": 2**70},
        ValueError,
        r"ignore_index must fit in int64",
    ),
    "shift": ({"shift": -1}, ValueError, r"shift must be a bool or an int >= 0, got -1"),
    "options": (
        {"options": {"batch_chunk_size": 2}},
        TypeError,
        r"options must be a linear_ce.LinearCrossEntropyOptions or None, got dict",
    ),
}


# (function, case) -> the message where the function meets the mistake in a check of its
# own first: the sparse divergence compares its teacher's slots with the input's device.
OWN_MESSAGES = {
    ("sparse_divergence", "input on another device"): r"target_ids is on cpu, the input on meta",
}


def _accepts(fn, labels, changes) -> bool:
    """Whether ``fn`` takes every keyword of ``changes`` (under its own name for it)."""
    params = inspect.signature(fn).parameters
    return all(
        key in ("input", "linear_weight", "target") or labels.get(key, key) in params
        for key in changes
    )


def _params():
    for function, (_, labels, fn, _) in FUNCTIONS.items():
        for case, (changes, _, _) in CASES.items():
            if not _accepts(fn, labels, changes):
                continue
            yield pytest.param(function, case, id=f"{function}-{case}")


@pytest.fixture(scope="module")
def group_for(tmp_path_factory):
    """Opens, for the first vocab-parallel function, a one-process gloo group that the
    module's tests share, closed after the last (see LAYOUT)."""
    opened = []

    def open_for(function: str) -> None:
        if FUNCTIONS[function][3] and not opened:
            assert not dist.is_initialized(), "a process group leaked from another test"
            store = tmp_path_factory.mktemp("group") / "store"
            with pytest.MonkeyPatch.context() as env:
                env.setenv("GLOO_SOCKET_IFNAME", "lo")
                dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
            opened.append(True)

    yield open_for
    if opened:
        leave_gloo_group()


@pytest.mark.parametrize(("function", "case"), list(_params()))
def test_error_names_function_and_argument(function, case, group_for):
    call, labels, _, _ = FUNCTIONS[function]
    changes, error, message = CASES[case]
    message = OWN_MESSAGES.get((_called(function), case), message)
    group_for(function)
    names = {k: labels.get(k, k) for k in ("input", "linear_weight", "linear_bias", "softcap")}
    names["logit_scale"] = labels.get("logit_scale", "logit_scale")
    expected = "^" + re.escape(_called(function)) + ": " + message.format(**names)
    args = {"input": _x(), "linear_weight": _w(), "target": torch.randint(0, V, (N,))}
    args.update(changes)
    with pytest.raises(error, match=expected):
        call(args.pop("input"), args.pop("linear_weight"), args.pop("target"), **args)


@pytest.mark.parametrize("function", ["linear_divergence", "linear_divergence" + VP], ids=str)
@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("teacher_softcap", 0.0, r"teacher_softcap must be None or a finite float > 0, got 0.0"),
        ("teacher_softcap", "1", r"teacher_softcap must be None or a finite float > 0"),
        ("teacher_logit_scale", 0.0, r"teacher_logit_scale must be a finite float > 0, got 0.0"),
        ("teacher_logit_scale", float("nan"), r"teacher_logit_scale must be a finite float > 0"),
        ("student_softcap", -2.0, r"student_softcap must be None or a finite float > 0"),
        ("student_logit_scale", True, r"student_logit_scale must be a finite float > 0"),
    ],
)
def test_divergence_names_teacher_and_student_arguments(
    function, argument, value, message, group_for
):
    """The two heads' transforms are told apart: ``teacher_softcap`` was reported as
    ``linear_cross_entropy: softcap``."""
    call = FUNCTIONS[function][0]
    group_for(function)
    with pytest.raises(ValueError, match=f"^{_called(function)}: {message}"):
        call(_x(), _w(), torch.randint(0, V, (N,)), **{argument: value})


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_chunk_size": 0}, ValueError, r"batch_chunk_size must be a positive int"),
        ({"chunking_method": "rows"}, ValueError, r"chunking_method must be None, 'auto'"),
        (
            {"batch_chunk_size": 8, "chunking_method": "budget"},
            ValueError,
            r"batch_chunk_size=8 and chunking_method='budget' both choose the chunk size",
        ),
        ({"acc_policy": "fast"}, ValueError, r"acc_policy must be one of"),
        ({"acc_dtype": torch.int32}, ValueError, r"acc_dtype must be None, torch.float16"),
        ({"allow_retain_graph": 1}, TypeError, r"allow_retain_graph must be a bool, got int"),
    ],
)
def test_options_errors_name_the_options_class(kwargs, error, message):
    with pytest.raises(error, match=f"^LinearCrossEntropyOptions: {message}"):
        LinearCrossEntropyOptions(**kwargs)


def _target():
    return torch.randint(0, V, (N,))


def _teacher_slots():
    """Two slots of a stored teacher per position: ids 0 and 1, probabilities 1/2 and 1/4."""
    return torch.tensor([[0, 1]] * N), torch.tensor([[0.5, 0.25]] * N).log()


# name -> (the call, from (student) input, head and target; the head's name; needs a group)
DISTILLATION = {
    "linear_divergence": (
        lambda x, w, t, **kw: linear_ce.linear_divergence(
            x, w, torch.randn(N, FT), torch.randn(V, FT), t, **kw
        ),
        "student_weight",
        False,
    ),
    "linear_divergence" + VP: (
        lambda x, w, t, **kw: linear_ce.linear_divergence(
            x, w, torch.randn(N, FT), torch.randn(V, FT), t, **kw
        ),
        "student_weight",
        True,
    ),
    "sparse_divergence": (
        lambda x, w, t, **kw: linear_ce.sparse_divergence(x, w, *_teacher_slots(), t, **kw),
        "linear_weight",
        False,
    ),
    "sparse_divergence" + VP: (
        lambda x, w, t, **kw: linear_ce.sparse_divergence(x, w, *_teacher_slots(), t, **kw),
        "linear_weight",
        True,
    ),
}

# A distillation target picks the positions that count (and with hard_weight > 0 holds
# their labels): whatever hard_weight, a bad one is an error, never a silently counted row.
TARGET_CASES = {
    "out of range": (torch.full((N,), V), r"target contains class index 5, outside \[0, 5\)"),
    # padding marked -1 under the default ignore_index=-100 would count every padded row
    "negative, not ignored": (
        torch.full((N,), -1),
        r"target contains class index -1, outside \[0, 5\) and not ignore_index=-100",
    ),
    "shape": (
        torch.zeros(N + 1, dtype=torch.long),
        r"class-index target must have shape \(6,\)",
    ),
    "floating": (
        torch.zeros(N),
        r"target must be an integer tensor of token ids, got torch.float32",
    ),
    "device": (
        torch.zeros(N, dtype=torch.long, device="meta"),
        r"all tensors must be on one device, got .*target on meta",
    ),
}


@pytest.mark.parametrize("hard_weight", [0.0, 0.5])
@pytest.mark.parametrize("case", list(TARGET_CASES))
@pytest.mark.parametrize("function", list(DISTILLATION))
def test_distillation_target_is_checked_whatever_hard_weight(
    function, case, hard_weight, group_for
):
    call, _, needs_group = DISTILLATION[function]
    target, message = TARGET_CASES[case]
    if needs_group:
        group_for("linear_cross_entropy" + VP)
    layout = LAYOUT if needs_group else {}
    with pytest.raises(ValueError, match=f"^{_called(function)}: {message}"):
        call(_x(), _w(), target, hard_weight=hard_weight, **layout)


@pytest.mark.parametrize("function", list(DISTILLATION))
def test_distillation_target_ignore_index_is_read(function, group_for):
    """The positive side of the case above: -1 is accepted where it is the ignore_index,
    and an ignored position carries no loss (the loss equals that of the other rows)."""
    call, _, needs_group = DISTILLATION[function]
    if needs_group:
        group_for("linear_cross_entropy" + VP)
    layout = LAYOUT if needs_group else {}
    torch.manual_seed(0)
    x, w, t = _x(), _w(), _target()
    t[::2] = -1
    rows = call(x, w, t, ignore_index=-1, reduction="none", **layout)
    assert bool((rows[::2] == 0).all()) and bool((rows[1::2] > 0).all())


# name -> (the call, from its head (only), with vocab_parallel; the head's name)
VOCAB_PARALLEL = {
    "linear_cross_entropy": (
        lambda w, **kw: linear_ce.linear_cross_entropy(_x(), w, _target(), **kw),
        "linear_weight",
    ),
    "token_logprobs": (
        lambda w, **kw: linear_ce.token_logprobs(_x(), w, _target(), **kw),
        "linear_weight",
    ),
    "token_objective": (
        lambda w, **kw: linear_ce.token_objective(_x(), w, _target(), _objective, **kw),
        "linear_weight",
    ),
    "sequence_objective": (
        lambda w, **kw: linear_ce.sequence_objective(
            _x()[None], w, _target()[None], _sequence_objective, **kw
        ),
        "linear_weight",
    ),
    **{
        _called(name): (lambda w, _call=call, **kw: _call(_x(), w, _target(), **kw), head)
        for name, (call, head, _) in DISTILLATION.items()
        if name.endswith(VP)
    },
}


@pytest.mark.parametrize(
    ("layout", "error", "message"),
    [
        (
            {"vocab_start": 0},
            ValueError,
            r"pass both vocab_start and num_classes, or neither .*got vocab_start=0, "
            "num_classes=None",
        ),
        ({"vocab_start": 0, "num_classes": 5.0}, TypeError, r"num_classes must be an int, got 5.0"),
        (
            {"vocab_start": True, "num_classes": V},
            TypeError,
            "vocab_start must be an int, got True",
        ),
        (
            {"vocab_start": -1, "num_classes": V},
            ValueError,
            r"vocab_start must lie in \[0, num_classes\), got vocab_start=-1, num_classes=5",
        ),
        (
            {"vocab_start": V, "num_classes": V},
            ValueError,
            r"vocab_start must lie in \[0, num_classes\), got vocab_start=5, num_classes=5",
        ),
        (
            {"process_group": "world"},
            TypeError,
            "process_group must be a torch.distributed ProcessGroup or None .*got str",
        ),
    ],
)
def test_vocab_parallel_errors_name_the_class(layout, error, message):
    with pytest.raises(error, match=f"^VocabParallel: {message}"):
        VocabParallel(**layout)


@pytest.mark.parametrize("function", list(VOCAB_PARALLEL))
def test_vocab_parallel_shard_outside_the_vocabulary_names_the_function(function, group_for):
    call, _ = VOCAB_PARALLEL[function]
    group_for("linear_cross_entropy" + VP)
    with pytest.raises(
        ValueError,
        match=rf"^{function}: the local shard \[vocab_start, vocab_start \+ 5\) = \[2, 7\) "
        r"does not lie in \[0, num_classes=5\)",
    ):
        call(_w(), vocab_parallel=VocabParallel(None, 2, V))


@pytest.mark.parametrize("function", list(VOCAB_PARALLEL))
def test_vocab_parallel_not_a_vocab_parallel_names_the_function(function):
    call, _ = VOCAB_PARALLEL[function]
    with pytest.raises(
        TypeError, match=rf"^{function}: vocab_parallel must be a linear_ce.VocabParallel or None"
    ):
        call(_w(), vocab_parallel={"vocab_start": 0, "num_classes": V})


@pytest.mark.parametrize("function", list(VOCAB_PARALLEL))
def test_vocab_parallel_shard_errors_name_the_function_and_its_head(function, group_for):
    call, head = VOCAB_PARALLEL[function]
    group_for("linear_cross_entropy" + VP)
    with pytest.raises(ValueError, match=f"^{function}: {head} must be this rank's shard, .*got"):
        call(torch.randn(V), **LAYOUT)


@pytest.mark.parametrize("function", list(VOCAB_PARALLEL))
def test_vocab_parallel_without_a_process_group_names_the_function(function, monkeypatch):
    call, _ = VOCAB_PARALLEL[function]
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(
        RuntimeError,
        match=rf"^{function}: torch.distributed is not initialised; .*pass vocab_parallel=None "
        "for a head that is not split",
    ):
        call(_w(), **LAYOUT)


def _sharded(tensor):
    """``tensor`` as a DTensor sharded along the vocabulary on a one-process mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(tensor, init_device_mesh("cpu", (1,)), [Shard(0)])


# name -> the call, from its (DTensor) head, of a public function that takes DTensors
DTENSOR = {
    "linear_cross_entropy": lambda w, **kw: linear_ce.linear_cross_entropy(
        _x(), w, _target(), **kw
    ),
    "token_logprobs": lambda w, **kw: linear_ce.token_logprobs(_x(), w, _target(), **kw),
    "token_objective": lambda w, **kw: linear_ce.token_objective(
        _x(), w, _target(), _objective, **kw
    ),
    "sequence_objective": lambda w, **kw: linear_ce.sequence_objective(
        _x()[None], w, _target()[None], _sequence_objective, **kw
    ),
    "linear_divergence": lambda w, **kw: linear_ce.linear_divergence(
        _x(), w, torch.randn(N, FT), _sharded(torch.randn(V, FT)), _target(), **kw
    ),
    "sparse_divergence": lambda w, **kw: linear_ce.sparse_divergence(
        _x(), w, *_teacher_slots(), _target(), **kw
    ),
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"temperature": 0.0}, r"temperature must be a finite float > 0, got 0.0"),
        ({"options": {}}, r"options must be a linear_ce.LinearCrossEntropyOptions or None"),
    ],
    ids=["temperature", "options"],
)
@pytest.mark.parametrize("function", list(DTENSOR))
def test_dtensor_call_errors_name_the_function_called(function, change, message, group_for):
    """A DTensor head runs the function with its vocab_parallel, whose checks report under
    the function the user called."""
    group_for("linear_cross_entropy" + VP)
    error = TypeError if "options" in change else ValueError
    with pytest.raises(error, match=f"^{function}: {message}"):
        DTENSOR[function](_sharded(_w()), **change)


@pytest.mark.parametrize("function", list(DTENSOR))
def test_dtensor_call_with_vocab_parallel_names_the_function_called(function, group_for):
    """A DTensor head's placements say how the vocabulary is split; a vocab_parallel given
    beside them is refused, not silently read or overridden."""
    group_for("linear_cross_entropy" + VP)
    with pytest.raises(ValueError, match=f"^{function}: vocab_parallel is given with DTensor"):
        DTENSOR[function](_sharded(_w()), **LAYOUT)


@pytest.mark.parametrize("ignore_index", [-100, 0, 3])
@pytest.mark.parametrize("function", ["linear_divergence", "sparse_divergence"])
def test_distillation_without_target_counts_every_position(function, ignore_index):
    """Without a target every position counts, whatever ``ignore_index`` (0 ignored them
    all: a NaN mean). Forward KL in float64 against the plain formula: the loop's rounding
    over the vocabulary's sums only (16 eps, as the divergence's own float64 tests)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, F_, generator=g, dtype=torch.float64)
    w = torch.randn(V, F_, generator=g, dtype=torch.float64)
    log_p = torch.log_softmax(x @ w.T, -1)
    if function == "linear_divergence":
        xt = torch.randn(N, FT, generator=g, dtype=torch.float64)
        wt = torch.randn(V, FT, generator=g, dtype=torch.float64)
        got = linear_ce.linear_divergence(x, w, xt, wt, None, ignore_index=ignore_index)
        log_q = torch.log_softmax(xt @ wt.T, -1)
        plain = (log_q.exp() * (log_q - log_p)).sum(-1).mean()
    else:
        ids, logprobs = _teacher_slots()
        got = linear_ce.sparse_divergence(
            x, w, ids, logprobs.double(), None, ignore_index=ignore_index
        )
        log_q = torch.log_softmax(logprobs.double(), -1)  # renormalised over the two slots
        plain = (log_q.exp() * (log_q - log_p.gather(-1, ids))).sum(-1).mean()
    assert rel_err(got, plain) <= 16 * eps(torch.float64)


# The functions whose result is a scalar loss: its gradients are formed in forward and
# the first backward hands them over (the per-token outputs recompute in backward).
SCALAR_LOSSES = [name for name in FUNCTIONS if "token_logprobs" not in name]


def _second_backward_raises(function: str, loss: torch.Tensor) -> None:
    loss.backward(retain_graph=True)
    with pytest.raises(
        RuntimeError, match=rf"^{function}: backward ran twice .*allow_retain_graph=True"
    ):
        loss.backward()


@pytest.mark.parametrize("function", SCALAR_LOSSES)
def test_second_backward_names_the_function_called(function, group_for):
    """A second backward through a scalar loss whose gradients were handed over raises
    under the public function called, each family's own (it said linear_cross_entropy
    for every head)."""
    call, _, _, _ = FUNCTIONS[function]
    group_for(function)
    out = call(_x().requires_grad_(), _w().requires_grad_(), torch.randint(0, V, (N,)))
    name = _called(function)
    _second_backward_raises(name, out.loss if name == "sequence_objective" else out)


@pytest.mark.parametrize("function", [name for name in DTENSOR if name != "token_logprobs"])
def test_second_backward_names_the_function_called_with_a_dtensor_head(function, group_for):
    """The DTensor head runs the function with its vocab_parallel; the second backward's
    error, raised after the call returned, names the function the user called."""
    group_for("linear_cross_entropy" + VP)
    out = DTENSOR[function](_sharded(_w()).requires_grad_())
    _second_backward_raises(function, out.loss if function == "sequence_objective" else out)
