"""``LinearCrossEntropyLoss``: every constructor argument and forward extra reaches the loss.

Each case builds the module with a set of arguments, runs ``forward`` and
``backward``, and compares the loss, the returned lse and z-loss term and the
gradients of the input, ``weight`` and ``bias`` with the float64 formula of
``loss_formula`` evaluated on the module's own parameters. Every argument in a
case changes the result, so a module that drops one fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyLoss, LinearCrossEntropyOptions
from loss_formula import loss_formula

BATCH, FEATURES, CLASSES = (2, 5), 6, 9
REDUCTIONS = ("mean", "sum", "none")
TOL = 6 * eps(torch.float64)


def _class_weight() -> torch.Tensor:
    return torch.linspace(0.4, 1.6, CLASSES, dtype=torch.float64)


def _every_argument(out_features: tuple[int, ...], reduction: str) -> dict:
    return {
        "out_features": out_features,
        "bias": True,
        "reduction": reduction,
        "weight": _class_weight(),
        "ignore_index": 2,
        "label_smoothing": 0.1,
        "options": LinearCrossEntropyOptions(batch_chunk_size=3),
        "z_loss": 0.05,
        "softcap": 3.0,
    }


CASES = {
    **{
        f"every-argument-{r}": (_every_argument((), r), ("shift", "token_weight", "returns"))
        for r in REDUCTIONS
    },
    **{
        f"every-argument-kdim-{r}": (_every_argument((2, 3), r), ("token_weight", "returns"))
        for r in REDUCTIONS
    },
    **{
        f"probabilities-{r}": (
            {"reduction": r, "weight": _class_weight(), "label_smoothing": 0.2, "bias": True},
            ("probabilities",),
        )
        for r in REDUCTIONS
    },
    "defaults": ({}, ()),
}


def _inputs(module: LinearCrossEntropyLoss, forward: tuple[str, ...], seed: int):
    g = torch.Generator().manual_seed(seed)
    loss_shape = (*BATCH, *module.out_features)
    x = torch.randn(*BATCH, FEATURES, generator=g, dtype=torch.float64)
    if "probabilities" in forward:
        logits_shape = (*BATCH, CLASSES, *module.out_features)
        target = torch.softmax(
            torch.randn(logits_shape, generator=g, dtype=torch.float64), len(BATCH)
        )
    else:
        target = torch.randint(0, CLASSES, loss_shape, generator=g)
        target.view(-1)[::4] = 2 if module.ignore_index == 2 else -100
    extras = {}
    if "shift" in forward:
        extras["shift"] = 1
    if "token_weight" in forward:
        extras["token_weight"] = torch.rand(loss_shape, generator=g, dtype=torch.float64) + 0.2
    if "returns" in forward:
        extras["return_lse"] = extras["return_z_loss"] = True
    upstream = torch.rand(loss_shape, generator=g, dtype=torch.float64) + 0.5
    return x, target, extras, upstream if module.reduction == "none" else 1.0


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_float64_formula(name):
    arguments, forward = CASES[name]
    torch.manual_seed(len(name))
    module = LinearCrossEntropyLoss(
        FEATURES, CLASSES, device="cpu", dtype=torch.float64, **arguments
    )
    x, target, extras, upstream = _inputs(module, forward, seed=len(name))
    x.requires_grad_()
    out = module(x, target, **extras)
    returns = "returns" in forward
    loss = out.loss if returns else out
    loss.backward(torch.as_tensor(upstream, dtype=loss.dtype).expand(loss.shape))

    want = loss_formula(
        x,
        module.weight,
        target,
        b=module.bias,
        class_weight=arguments.get("weight"),
        reduction=arguments.get("reduction", "mean"),
        ignore_index=arguments.get("ignore_index", -100),
        label_smoothing=arguments.get("label_smoothing", 0.0),
        z_loss=arguments.get("z_loss", 0.0),
        softcap=arguments.get("softcap"),
        shift=extras.get("shift", 0),
        token_weight=extras.get("token_weight"),
        upstream=upstream,
    )
    got = {"loss": loss, "grad_input": x.grad, "grad_weight": module.weight.grad}
    ref = {"loss": want.loss, "grad_input": want.grads[0], "grad_weight": want.grads[1]}
    if module.bias is not None:
        got["grad_bias"], ref["grad_bias"] = module.bias.grad, want.grads[2]
    if returns:
        got["lse"], got["z_loss"] = out.lse, out.z_loss
        ref["lse"], ref["z_loss"] = want.lse, want.z_loss
    else:
        assert isinstance(out, torch.Tensor)
    for key, value in got.items():
        assert value is not None, f"{name}: no {key}"
        assert value.shape == ref[key].shape, (key, tuple(value.shape), tuple(ref[key].shape))
    errors = {k: rel_err(got[k], ref[k]) for k in got}
    bad = {k: f"{v / eps(torch.float64):.1f} eps" for k, v in errors.items() if not v <= TOL}
    assert not bad, f"{name}: {bad}"


def test_options_reach_the_function():
    """``acc_dtype=float64`` on a float32 module: lse comes back in float64 and the loss
    is as accurate as float64 accumulation makes it."""
    options = LinearCrossEntropyOptions(acc_dtype=torch.float64, batch_chunk_size=4)
    module = LinearCrossEntropyLoss(FEATURES, CLASSES, options=options, softcap=2.0)
    x, target, _, _ = _inputs(module, (), seed=3)
    x = x.float().requires_grad_()
    out = module(x, target, return_lse=True)
    assert out.lse.dtype == torch.float64
    want = loss_formula(x, module.weight, target, softcap=2.0)
    assert rel_err(out.lse, want.lse) <= 3 * eps(torch.float32)
    assert rel_err(out.loss, want.loss) <= 3 * eps(torch.float32)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [(), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, None], ids=str)
def test_parameters_shapes_dtype_and_initialisation(dtype, out_features, bias):
    torch.manual_seed(0)
    module = LinearCrossEntropyLoss(
        FEATURES, CLASSES, out_features=out_features, bias=bias, dtype=dtype, device="cpu"
    )
    expected_dtype = dtype or torch.get_default_dtype()
    assert module.weight.shape == (CLASSES, *out_features, FEATURES)
    assert module.weight.dtype == expected_dtype and module.weight.device.type == "cpu"
    parameters = [module.weight]
    if bias:
        assert module.bias.shape == (CLASSES, *out_features)
        assert module.bias.dtype == expected_dtype
        parameters.append(module.bias)
    else:
        assert module.bias is None
    assert [p for _, p in module.named_parameters()] == parameters
    bound = 1 / math.sqrt(FEATURES)
    for p in parameters:
        values = p.detach().double()
        # nn.Linear's uniform(-1/sqrt(F), 1/sqrt(F)): inside the bound, spread across it.
        assert values.abs().max() <= bound
        assert values.max() > bound / 2 and values.min() < -bound / 2


def test_class_weight_is_a_buffer_and_the_repr_names_the_settings():
    weight = _class_weight().float()
    module = LinearCrossEntropyLoss(FEATURES, CLASSES, weight=weight, reduction="sum")
    assert torch.equal(module.state_dict()["class_weight"], weight)
    assert "class_weight" not in dict(module.named_parameters())
    text = repr(module)
    for piece in (f"in_features={FEATURES}", f"num_classes={CLASSES}", "reduction='sum'"):
        assert piece in text
