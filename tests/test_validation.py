"""Every bad argument fails before any work, with a message naming the problem."""

import pytest
import torch

import linear_ce
from linear_ce import LinearCrossEntropyOptions, reference

N, FEAT, C = 4, 3, 5
FUNCTIONS = [linear_ce.linear_cross_entropy, reference.linear_cross_entropy]


def _args(**overrides):
    args = {
        "input": torch.randn(N, FEAT),
        "linear_weight": torch.randn(C, FEAT),
        "target": torch.randint(0, C, (N,)),
    }
    args.update(overrides)
    return args


def _call(fn, **overrides):
    positional = {
        k: overrides.pop(k) for k in ("input", "linear_weight", "target") if k in overrides
    }
    args = _args(**positional)
    return fn(args["input"], args["linear_weight"], args["target"], **overrides)


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        # ranks
        ({"input": torch.tensor(1.0)}, r"input must have shape \(\*, in_features\).*0-d"),
        (
            {"linear_weight": torch.randn(FEAT)},
            r"linear_weight must have shape \(num_classes, in_features\)",
        ),
        (
            {
                "linear_weight": torch.randn(C, 2, FEAT),
                "input": torch.randn(FEAT),
                "target": torch.tensor([1, 2]),
            },
            r"K-dimensional loss .* needs batched input",
        ),
        # in_features
        (
            {"linear_weight": torch.randn(C, FEAT + 1)},
            r"in_features mismatch: input has 3 features .* linear_weight has 4",
        ),
        # bias
        ({"linear_bias": torch.randn(C + 1)}, r"linear_bias must have shape \(5,\).*got \(6,\)"),
        ({"linear_bias": torch.randn(C, 1)}, r"linear_bias must have shape \(5,\).*got \(5, 1\)"),
        (
            {"linear_bias": torch.randn(C, dtype=torch.float64)},
            r"linear_bias dtype torch.float64 differs",
        ),
        # target batch / shape / dtype
        (
            {"target": torch.randint(0, C, (N + 1,))},
            r"class-index target must have shape \(4,\).*got \(5,\)",
        ),
        ({"target": torch.randint(0, C, (N, 2))}, r"class-index target must have shape \(4,\)"),
        (
            {"target": torch.rand(N)},
            r"floating target is read as class probabilities .* shape \(4, 5\)",
        ),
        (
            {"target": torch.ones(N, dtype=torch.bool)},
            r"class-index target must be an integer tensor .* got torch.bool",
        ),
        (
            {"target": torch.ones(N, dtype=torch.complex64)},
            r"class-index target must be an integer tensor",
        ),
        (
            {"target": torch.rand(N, C, dtype=torch.float64)},
            r"probability target dtype torch.float64 differs",
        ),
        (
            {"target": torch.rand(N, C), "ignore_index": 0},
            r"ignore_index cannot be used with probability targets",
        ),
        (
            {"target": torch.rand(N, C, requires_grad=True)},
            r"probability target that requires grad",
        ),
        # class weights
        (
            {"weight": torch.rand(C + 1)},
            r"weight \(class weights\) must have shape \(5,\), got \(6,\)",
        ),
        ({"weight": torch.rand(C, 1)}, r"weight \(class weights\) must have shape \(5,\)"),
        (
            {"weight": torch.rand(C, dtype=torch.float64)},
            r"weight \(class weights\) must have the input's dtype",
        ),
        ({"weight": [1.0] * C}, r"weight must be a Tensor or None, got list"),
        # scalars
        ({"label_smoothing": -0.1}, r"label_smoothing must be in \[0, 1\], got -0.1"),
        ({"label_smoothing": 1.5}, r"label_smoothing must be in \[0, 1\], got 1.5"),
        ({"label_smoothing": "0.1"}, r"label_smoothing must be a float"),
        ({"reduction": "avg"}, r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'"),
        ({"ignore_index": 1.5}, r"ignore_index must be an int or None, got 1.5"),
        # devices and dtypes
        (
            {"linear_weight": torch.randn(C, FEAT, device="meta")},
            r"all tensors must be on one device.*linear_weight on meta",
        ),
        (
            {"target": torch.randint(0, C, (N,), device="meta")},
            r"all tensors must be on one device.*target on meta",
        ),
        (
            {"linear_weight": torch.randn(C, FEAT, dtype=torch.float64)},
            r"linear_weight dtype torch.float64 differs from input dtype torch.float32",
        ),
        (
            {
                "input": torch.ones(N, FEAT, dtype=torch.int64),
                "linear_weight": torch.ones(C, FEAT, dtype=torch.int64),
            },
            r"input must be a floating tensor .* got torch.int64",
        ),
        ({"input": [[1.0] * FEAT] * N}, r"input must be a Tensor, got list"),
    ],
)
def test_bad_arguments(fn, overrides, match):
    with pytest.raises(ValueError, match=match):
        _call(fn, **overrides)


@pytest.mark.parametrize("bad", [-1, C, 1000, -100])
def test_target_class_out_of_range_is_named(bad):
    target = torch.randint(0, C, (N,))
    target[2] = bad
    ignore_index = 7 if bad == -100 else None
    with pytest.raises(ValueError, match=rf"target contains class index {bad}, outside \[0, 5\)"):
        linear_ce.linear_cross_entropy(
            torch.randn(N, FEAT), torch.randn(C, FEAT), target, ignore_index=ignore_index
        )


def test_options_must_be_options():
    with pytest.raises(TypeError, match=r"options must be a linear_ce\.LinearCrossEntropyOptions"):
        _call(linear_ce.linear_cross_entropy, options={"batch_chunk_size": 2})


def test_acc_dtype_narrower_than_input():
    options = LinearCrossEntropyOptions(acc_dtype=torch.float32)
    x, W = torch.randn(N, FEAT, dtype=torch.float64), torch.randn(C, FEAT, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"acc_dtype=torch.float32 is narrower than the input dtype torch.float64"
    ):
        linear_ce.linear_cross_entropy(x, W, torch.randint(0, C, (N,)), options=options)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"batch_chunk_size": 0},
            ValueError,
            r"batch_chunk_size must be a positive int or None, got 0",
        ),
        (
            {"batch_chunk_size": -3},
            ValueError,
            r"batch_chunk_size must be a positive int or None, got -3",
        ),
        (
            {"batch_chunk_size": 2.0},
            ValueError,
            r"batch_chunk_size must be a positive int or None, got 2.0",
        ),
        (
            {"batch_chunk_size": True},
            ValueError,
            r"batch_chunk_size must be a positive int or None, got True",
        ),
        (
            {"batch_chunk_size": 4, "chunking_method": "aspect_ratio"},
            ValueError,
            r"both choose the chunk size",
        ),
        (
            {"chunking_method": "fixed"},
            ValueError,
            r"chunking_method must be None, 'auto'.*got 'fixed'",
        ),
        (
            {"chunking_method": "aspect_ratio:0"},
            ValueError,
            r"chunking_method must be .*got 'aspect_ratio:0'",
        ),
        (
            {"chunking_method": "aspect_ratio:x"},
            ValueError,
            r"chunking_method must be .*got 'aspect_ratio:x'",
        ),
        ({"chunking_method": "auto:2"}, ValueError, r"chunking_method must be .*got 'auto:2'"),
        ({"chunking_method": 3}, ValueError, r"chunking_method must be .*got 3"),
        (
            {"acc_policy": "fast"},
            ValueError,
            r"acc_policy must be one of \('auto', 'accurate', 'balanced', 'compact'\), got 'fast'",
        ),
        (
            {"acc_dtype": torch.int32},
            ValueError,
            r"acc_dtype must be None, torch.float16.*got torch.int32",
        ),
        ({"acc_dtype": "float32"}, ValueError, r"acc_dtype must be None.*got 'float32'"),
        ({"allow_retain_graph": 1}, TypeError, r"allow_retain_graph must be a bool, got int"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        LinearCrossEntropyOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"in_features": 0, "num_classes": C}, r"in_features must be a positive int, got 0"),
        ({"in_features": FEAT, "num_classes": 2.5}, r"num_classes must be a positive int, got 2.5"),
        (
            {"in_features": FEAT, "num_classes": C, "out_features": (0,)},
            r"out_features must be a tuple of positive ints",
        ),
    ],
)
def test_bad_module_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        linear_ce.LinearCrossEntropyLoss(**kwargs)


def _plain_nll64(x, W, target, ignore_index):
    """Per-row cross-entropy in float64 from the formula (rows at ignore_index are 0),
    the targets compared as Python ints."""
    logits = x.double() @ W.double().T
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.zeros(len(target), dtype=torch.float64)
    for row, cls in enumerate(target.tolist()):
        if cls != ignore_index:
            out[row] = lse[row] - logits[row, cls]
    return out


# Class indices whose dtype cannot hold ignore_index: compared in that dtype, the
# ignore_index wrapped onto a class (-100 is 156 in uint8, -1000 is 24 in int8, 2**32 is
# 0 in int32) and that class was silently ignored.
@pytest.mark.parametrize(
    ("dtype", "wrapped_class", "ignore_index"),
    [
        (torch.uint8, 156, None),
        (torch.int8, 24, -1000),
        (torch.int16, 0, 2**16),
        (torch.int32, 0, 2**32),
    ],
)
@pytest.mark.parametrize("fn", ["linear_cross_entropy", "token_logprobs"])
def test_narrow_index_target_keeps_the_class_ignore_index_wraps_onto(
    fn, dtype, wrapped_class, ignore_index
):
    g = torch.Generator().manual_seed(3)
    classes = 200
    x = torch.randn(4, FEAT, generator=g, dtype=torch.float64)
    W = torch.randn(classes, FEAT, generator=g, dtype=torch.float64)
    target = torch.tensor([wrapped_class, 1, wrapped_class, 7], dtype=dtype)
    resolved = -100 if ignore_index is None else ignore_index
    ref = _plain_nll64(x, W, target, resolved)
    assert (ref[[0, 2]] > 0).all()  # the wrapped class counts
    if fn == "linear_cross_entropy":
        got = linear_ce.linear_cross_entropy(
            x, W, target, ignore_index=ignore_index, reduction="none"
        )
    else:
        got = -linear_ce.token_logprobs(x, W, target, ignore_index=resolved).logprob
    # float64 throughout: a few eps of the plain formula's own rounding.
    assert torch.allclose(got, ref, rtol=8 * torch.finfo(torch.float64).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_narrow_index_target_with_shift(dtype):
    """The positions a shift vacates hold ignore_index, which a uint8 target cannot hold."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, FEAT, generator=g, dtype=torch.float64)
    W = torch.randn(C, FEAT, generator=g, dtype=torch.float64)
    target = torch.randint(0, C, (2, 5), generator=g)
    got = linear_ce.linear_cross_entropy(x, W, target.to(dtype), shift=True, reduction="none")
    ref = torch.stack(
        [
            torch.cat([_plain_nll64(x[b, :-1], W, target[b, 1:], -100), torch.zeros(1).double()])
            for b in range(2)
        ]
    )
    assert torch.allclose(got, ref, rtol=8 * torch.finfo(torch.float64).eps, atol=0)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool,
        torch.complex64,
        *[getattr(torch, n) for n in ("uint16", "uint32") if hasattr(torch, n)],
    ],
)
def test_unsupported_index_dtype_lists_the_supported_ones(dtype):
    target = torch.zeros(N, dtype=dtype)
    with pytest.raises(
        ValueError,
        match=r"^linear_cross_entropy: class-index target must be an integer tensor "
        rf"\(int64, int32, int16, int8 or uint8\), got {dtype}$",
    ):
        linear_ce.linear_cross_entropy(torch.randn(N, FEAT), torch.randn(C, FEAT), target)
