"""Every bad input is a clear error raised before any work.

Each case must raise with a message that names the offending argument and says
what was expected; the chunk loop is replaced by a tripwire, so an error that
came only after work had started (or a partial result) fails the test.
"""

from __future__ import annotations

import sys

import pytest
import torch

import linear_ce
import linear_ce.ops
from linear_ce import LinearCrossEntropyLoss, LinearCrossEntropyOptions

N, F_, V = 6, 4, 5


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Fail loudly if the chunk loop is ever entered."""

    def tripwire(*args, **kwargs):
        raise AssertionError("the chunk loop ran before the bad input was reported")

    for name, module in list(sys.modules.items()):
        if name.startswith("linear_ce") and hasattr(module, "run_chunks"):
            monkeypatch.setattr(module, "run_chunks", tripwire)


def _good(**changes):
    g = torch.Generator().manual_seed(0)
    args = {
        "input": torch.randn(N, F_, generator=g, requires_grad=True),
        "linear_weight": torch.randn(V, F_, generator=g, requires_grad=True),
        "target": torch.randint(0, V, (N,), generator=g),
    }
    args.update(changes)
    return args


def _call(**changes):
    args = _good(**changes)
    kwargs = {k: v for k, v in args.items() if k not in ("input", "linear_weight", "target")}
    return linear_ce.linear_cross_entropy(
        args["input"], args["linear_weight"], args["target"], **kwargs
    )


def test_tripwire_is_armed():
    """A valid call does reach the loop (so the fixture really guards the others)."""
    with pytest.raises(AssertionError, match="chunk loop ran"):
        _call()


BAD_TENSORS = {
    "input 0-d": ({"input": torch.tensor(1.0)}, r"input must have shape \(\*, in_features\)"),
    "weight 1-d": ({"linear_weight": torch.randn(F_)}, r"linear_weight must have shape"),
    "in_features": (
        {"linear_weight": torch.randn(V, F_ + 1)},
        r"in_features mismatch: input has 4",
    ),
    "no classes": (
        {"linear_weight": torch.randn(0, F_)},
        r"linear_weight must have at least one class",
    ),
    "target batch": (
        {"target": torch.zeros(N + 1, dtype=torch.long)},
        r"class-index target must have shape \(6,\).*got \(7,\)",
    ),
    "target rank": (
        {"target": torch.zeros(N, 1, dtype=torch.long)},
        r"class-index target must have shape \(6,\)",
    ),
    "float target shape": (
        {"target": torch.rand(N, V + 1)},
        r"floating target .* must have the logits' shape \(6, 5\)",
    ),
    "float target 1-d": ({"target": torch.rand(N)}, r"floating target .* shape \(6, 5\)"),
    "prob target dtype": (
        {"target": torch.rand(N, V, dtype=torch.float64)},
        r"probability target dtype torch.float64 differs from input dtype",
    ),
    "prob target grad": (
        {"target": torch.rand(N, V, requires_grad=True)},
        r"probability target that requires grad",
    ),
    "bool target": (
        {"target": torch.zeros(N, dtype=torch.bool)},
        r"class-index target must be an integer tensor",
    ),
    "integer input": (
        {
            "input": torch.ones(N, F_, dtype=torch.long),
            "linear_weight": torch.ones(V, F_, dtype=torch.long),
        },
        r"input must be a floating tensor .* got torch.int64",
    ),
    "complex input": (
        {"input": torch.ones(N, F_, dtype=torch.complex64)},
        r"input must be a floating tensor",
    ),
    "dtype mismatch": (
        {"linear_weight": torch.randn(V, F_, dtype=torch.float64)},
        r"linear_weight dtype torch.float64 differs from input dtype torch.float32",
    ),
    "bias shape": ({"linear_bias": torch.randn(V + 1)}, r"linear_bias must have shape \(5,\)"),
    "bias dtype": (
        {"linear_bias": torch.randn(V, dtype=torch.float64)},
        r"linear_bias dtype torch.float64 differs",
    ),
    "class weight shape": (
        {"weight": torch.rand(V - 1)},
        r"weight \(class weights\) must have shape \(5,\), got \(4,\)",
    ),
    "class weight 2-d": ({"weight": torch.rand(1, V)}, r"weight \(class weights\) must have shape"),
    "class weight dtype": (
        {"weight": torch.rand(V, dtype=torch.float64)},
        r"weight \(class weights\) must have the input's dtype torch.float32",
    ),
    "class weight grad": (
        {"weight": torch.rand(V, requires_grad=True)},
        r"weight \(class weights\) that requires grad is not supported",
    ),
    "token weight shape": (
        {"token_weight": torch.rand(N + 1)},
        r"token_weight must have the per-token loss shape \(6,\)",
    ),
    "token weight int": (
        {"token_weight": torch.ones(N, dtype=torch.long)},
        r"token_weight must be a floating tensor",
    ),
    "token weight grad": (
        {"token_weight": torch.rand(N, requires_grad=True)},
        r"token_weight that requires grad",
    ),
    "input not a tensor": ({"input": [[1.0] * F_] * N}, r"input must be a Tensor, got list"),
    "target not a tensor": ({"target": [0] * N}, r"target must be a Tensor, got list"),
    "weight not a tensor": ({"weight": [1.0] * V}, r"weight must be a Tensor or None, got list"),
}


@pytest.mark.parametrize("name", list(BAD_TENSORS))
def test_bad_tensor_is_named(name):
    changes, message = BAD_TENSORS[name]
    with pytest.raises(ValueError, match=message):
        _call(**changes)


@pytest.mark.parametrize(
    "where", ["input", "linear_weight", "target", "linear_bias", "weight", "token_weight"]
)
def test_tensors_on_different_devices(where):
    """The ``meta`` device stands in for a second device: every argument is compared."""
    args = _good(linear_bias=torch.randn(V), weight=torch.rand(V), token_weight=torch.rand(N))
    args[where] = args[where].detach().to("meta")
    with pytest.raises(ValueError, match=rf"one device, got .*{where} on meta"):
        _call(**args)


@pytest.mark.parametrize("value", [V, 7, -1, -101])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_target_out_of_range_names_the_value(value, reduction):
    target = torch.randint(0, V, (N,))
    target[3] = value
    with pytest.raises(
        ValueError,
        match=rf"target contains class index {value}, outside \[0, 5\) "
        r"and not ignore_index=-100",
    ):
        _call(target=target, reduction=reduction)


def test_out_of_range_target_with_custom_ignore_index():
    target = torch.tensor([0, 1, -100, 2, 3, 4])
    with pytest.raises(ValueError, match=r"class index -100, .* not ignore_index=-1"):
        _call(target=target, ignore_index=-1)


def test_out_of_range_target_in_kdim_loss():
    target = torch.randint(0, V, (N, 3))
    target[2, 1] = 9
    with pytest.raises(ValueError, match="class index 9"):
        _call(linear_weight=torch.randn(V, 3, F_), target=target)


BAD_OPTIONS = {
    "reduction": (
        {"reduction": "avg"},
        r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'",
    ),
    "smoothing range": ({"label_smoothing": 1.5}, r"label_smoothing must be in \[0, 1\], got 1.5"),
    "smoothing nan": ({"label_smoothing": float("nan")}, r"label_smoothing must be in \[0, 1\]"),
    "smoothing type": ({"label_smoothing": "0.1"}, r"label_smoothing must be a float"),
    "ignore_index type": ({"ignore_index": 1.5}, r"ignore_index must be an int or None, got 1.5"),
    "ignore_index bool": ({"ignore_index": True}, r"ignore_index must be an int or None"),
    "z_loss negative": ({"z_loss": -1e-4}, r"z_loss must be a finite float >= 0"),
    "z_loss inf": ({"z_loss": float("inf")}, r"z_loss must be a finite float >= 0, got inf"),
    "z_loss nan": ({"z_loss": float("nan")}, r"z_loss must be a finite float >= 0"),
    "softcap zero": ({"softcap": 0.0}, r"softcap must be None or a finite float > 0"),
    "softcap inf": ({"softcap": float("inf")}, r"softcap must be None or a finite float > 0"),
    "shift negative": ({"shift": -1}, r"shift must be a bool or an int >= 0, got -1"),
    "shift without sequence": (
        {"input": torch.randn(F_), "target": torch.tensor(1), "shift": 1},
        r"shift needs input of shape \(..., T, in_features\)",
    ),
    "ignore_index with prob": (
        {"target": torch.rand(N, V), "ignore_index": 0},
        r"ignore_index cannot be used with probability targets",
    ),
    "options type": ({"options": {"batch_chunk_size": 4}}, r"options must be a linear_ce"),
}


@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_bad_option_is_named(name):
    changes, message = BAD_OPTIONS[name]
    with pytest.raises((ValueError, TypeError), match=message):
        _call(**changes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_chunk_size": 0}, r"batch_chunk_size must be a positive int or None, got 0"),
        ({"batch_chunk_size": 2.5}, r"batch_chunk_size must be a positive int"),
        ({"batch_chunk_size": True}, r"batch_chunk_size must be a positive int"),
        ({"chunking_method": "rows"}, r"chunking_method must be None, 'auto'.*got 'rows'"),
        ({"chunking_method": "budget:0"}, r"chunking_method must be"),
        ({"chunking_method": "auto:2"}, r"chunking_method must be"),
        ({"batch_chunk_size": 8, "chunking_method": "budget"}, r"both choose the chunk size"),
        ({"acc_policy": "fast"}, r"acc_policy must be one of .*got 'fast'"),
        ({"acc_dtype": torch.int32}, r"acc_dtype must be None, torch.float16"),
        ({"allow_retain_graph": 1}, r"allow_retain_graph must be a bool, got int"),
    ],
)
def test_invalid_options_object(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LinearCrossEntropyOptions(**kwargs)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_acc_dtype_narrower_than_input(reduction):
    x = torch.randn(N, F_, dtype=torch.float64)
    W = torch.randn(V, F_, dtype=torch.float64)
    options = LinearCrossEntropyOptions(acc_dtype=torch.float32)
    with pytest.raises(
        ValueError,
        match=r"acc_dtype=torch.float32 is narrower than the input "
        r"dtype torch.float64",
    ):
        _call(input=x, linear_weight=W, options=options, reduction=reduction)


def test_module_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"in_features must be a positive int, got 0"):
        LinearCrossEntropyLoss(0, V)
    with pytest.raises(ValueError, match=r"out_features must be a tuple of positive ints"):
        LinearCrossEntropyLoss(F_, V, out_features=(2, 0))


def test_reference_rejects_the_same_inputs():
    """The plain expression shares the checks: a bad call fails the same way there."""
    args = _good(linear_weight=torch.randn(V, F_ + 1))
    with pytest.raises(ValueError, match="in_features mismatch"):
        linear_ce.reference.linear_cross_entropy(
            args["input"], args["linear_weight"], args["target"]
        )
