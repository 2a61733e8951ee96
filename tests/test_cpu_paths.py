"""Every CPU path of every head computes the float64 plain expression's result.

A path is what the plan makes of a call: same-dtype GEMMs, fp32 copies of half inputs
(``acc_policy="accurate"``), native half GEMMs (a CPU with AVX512-BF16/FP16 or AMX), the
weight upcast a vocabulary block at a time (``LINEAR_CE_NATIVE_HALF_GEMM=0``, what a CPU
without them runs), the weight gradient summed in the result (``"compact"``, or few
chunks) or split over two planes (many chunks), an fp64 accumulation. Each is forced
here through the environment override and the options, the path is checked to be the one
meant (else a forced path could silently test the default one), and each head's outputs
and gradients are compared with the plain expression written here, in float64 on the same
rounded inputs: within ``3·eps(dtype)``, or twice the plain same-dtype expression's own
error where that is larger (measured here). So all paths agree with each other too.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine.capability import native_half_gemm
from linear_ce.engine.plan import make_plan

ROWS, FEATURES, CLASSES = 500, 24, 500
CPU = torch.device("cpu")
HEADS = ("cross_entropy", "token_logprobs", "token_objective", "linear_divergence")
#: ``None``: the chunk rule's own choice (4 chunks of 128 rows at this size: a half weight
#: gradient is summed in the result); 64 rows: 8 chunks (summed split over two planes).
CHUNKS = (None, 64)


@dataclasses.dataclass(frozen=True)
class Path:
    dtype: torch.dtype
    native: str  # LINEAR_CE_NATIVE_HALF_GEMM
    gemm: str  # the GEMM backend the plan must choose (linear_ce.engine.gemm)
    policy: str = "auto"
    acc_dtype: torch.dtype | None = None

    def options(self, chunk: int | None) -> LinearCrossEntropyOptions:
        return LinearCrossEntropyOptions(
            batch_chunk_size=chunk, acc_policy=self.policy, acc_dtype=self.acc_dtype
        )


# float64 inputs run the same-dtype path as fp32; a float64 reference cannot judge them to
# 3 eps (it has rounding errors of its own): test_properties.py does, against 80-bit truth.
PATHS = {
    "fp32": Path(torch.float32, "1", "SameDtype"),
    "fp32-acc-fp64": Path(torch.float32, "1", "Upcast", acc_dtype=torch.float64),
}
for _name, _dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
    PATHS |= {
        f"{_name}-native": Path(_dtype, "1", "NativeHalf"),
        f"{_name}-native-compact": Path(_dtype, "1", "NativeHalf", policy="compact"),
        f"{_name}-upcast-blocks": Path(_dtype, "0", "BlockUpcast"),
        f"{_name}-upcast-blocks-compact": Path(_dtype, "0", "BlockUpcast", policy="compact"),
        f"{_name}-accurate": Path(_dtype, "1", "Upcast", policy="accurate"),
        f"{_name}-acc-fp64": Path(_dtype, "1", "Upcast", acc_dtype=torch.float64),
        f"{_name}-acc-same": Path(_dtype, "1", "SameDtype", acc_dtype=_dtype),
    }


@functools.cache
def _data():
    g = torch.Generator().manual_seed(29)
    x = torch.randn(ROWS, FEATURES, generator=g, dtype=torch.float64)
    W = torch.randn(CLASSES, FEATURES, generator=g, dtype=torch.float64) * 2 / FEATURES**0.5
    teacher_x = torch.randn(ROWS, FEATURES, generator=g, dtype=torch.float64)
    teacher_W = torch.randn(CLASSES, FEATURES, generator=g, dtype=torch.float64) * 2 / FEATURES**0.5
    t = torch.randint(0, CLASSES, (ROWS,), generator=g)
    t[::5] = -100
    t[100:160] = -100  # a run of ignored rows across a chunk boundary
    return {
        "x": x,
        "W": W,
        "teacher_x": teacher_x,
        "teacher_W": teacher_W,
        "t": t,
        "up_logprob": torch.randn(ROWS, generator=g, dtype=torch.float64),
        "up_entropy": torch.randn(ROWS, generator=g, dtype=torch.float64),
        "advantage": torch.randn(ROWS, generator=g, dtype=torch.float64),
    }


def _objective(logprob, entropy, advantage):
    return -advantage * logprob - 0.01 * entropy


def _linear_ce(head, x, W, d, options):
    """The head's outputs (compared as values) and the scalar its gradients come from."""
    t = d["t"]
    if head == "cross_entropy":
        loss = linear_ce.linear_cross_entropy(x, W, t, label_smoothing=0.1, options=options)
        return [loss], loss
    if head == "token_logprobs":
        out = linear_ce.token_logprobs(x, W, t, entropy=True, options=options)
        up_lp, up_h = (d[k].to(out.logprob.dtype) for k in ("up_logprob", "up_entropy"))
        return [out.logprob, out.entropy], (out.logprob * up_lp + out.entropy * up_h).sum()
    if head == "token_objective":
        advantage = d["advantage"].to(torch.promote_types(x.dtype, torch.float32))
        loss = linear_ce.token_objective(
            x, W, t, _objective, entropy=True, options=options, advantage=advantage
        )
        return [loss], loss
    teacher = [d[k].to(x.dtype) for k in ("teacher_x", "teacher_W")]
    loss = linear_ce.linear_divergence(x, W, *teacher, t, beta=0.5, options=options)
    return [loss], loss


def _plain(head, x, W, d):
    """The plain expression on full logits, in the dtype of ``x``."""
    t = d["t"]
    s = x @ W.T
    valid = t != -100
    if head == "cross_entropy":
        # Per-row losses, then their mean: torch's fp16 "mean" sums the smoothing term over
        # the whole batch first, which overflows fp16 here (500 rows · 500 classes).
        rows = F.cross_entropy(s, t, label_smoothing=0.1, reduction="none")
        loss = rows.sum() / valid.sum()
        return [loss], loss
    logp = torch.log_softmax(s, -1)
    if head == "linear_divergence":
        # The generalised JSD at β = 1/2 in the form a careful user writes for half
        # precision: the mixture's log by logsumexp, so no 0·log 0 appears.
        teacher = torch.log_softmax(d["teacher_x"].to(x.dtype) @ d["teacher_W"].to(x.dtype).T, -1)
        mix = torch.logsumexp(torch.stack([teacher, logp]), 0) - math.log(2)
        rows = (teacher.exp() * (teacher - mix)).sum(-1) + (logp.exp() * (logp - mix)).sum(-1)
        loss = 0.5 * rows[valid].sum() / valid.sum()
        return [loss], loss
    lp = torch.where(valid, logp.gather(-1, torch.where(valid, t, 0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    if head == "token_logprobs":
        up_lp, up_h = (d[k].to(x.dtype) for k in ("up_logprob", "up_entropy"))
        return [lp, ent], (lp * up_lp + ent * up_h).sum()
    loss = _objective(lp, ent, d["advantage"].to(x.dtype))[valid].sum()
    return [loss], loss


def _evaluate(fn, head, dtype, *args):
    d = _data()
    x, W = (d[k].to(dtype).requires_grad_() for k in ("x", "W"))
    outputs, scalar = fn(head, x, W, d, *args)
    return [o.detach() for o in outputs] + list(torch.autograd.grad(scalar, [x, W]))


@functools.cache
def _reference(head: str, dtype: torch.dtype):
    """``(float64 result on inputs rounded to dtype, bound per output)``."""

    def rounded(head, x, W, d):
        return _plain(head, x.to(dtype).double(), W.to(dtype).double(), d)

    exact = _evaluate(rounded, head, torch.float64)
    same = _evaluate(_plain, head, dtype)
    bounds = []
    for s, e in zip(same, exact, strict=True):
        own = rel_err(s, e)
        # The plain same-dtype expression must itself be a usable result, else "twice its
        # error" would be a bound nothing fails.
        assert own < 0.1, f"{head} in {dtype}: the plain expression is {own:.2g} off"
        bounds.append(max(3 * eps(dtype), 2 * own))
    return exact, bounds


@pytest.mark.parametrize("chunk", CHUNKS, ids=["auto-chunks", "chunks-of-64"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("name", list(PATHS))
def test_path_computes_the_plain_result(monkeypatch, name, head, chunk):
    path = PATHS[name]
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", path.native)
    if path.gemm == "NativeHalf" and not native_half_gemm(path.dtype, CPU):
        pytest.skip(f"this CPU has no native {path.dtype} GEMMs")
    options = path.options(chunk)
    plan = make_plan(ROWS, FEATURES, CLASSES, path.dtype, CPU, options)
    assert type(plan.gemm).__name__ == path.gemm, f"{name} runs {plan.gemm}, not {path.gemm}"
    if path.policy == "auto" and path.gemm in ("NativeHalf", "BlockUpcast"):
        # Both ways of holding the half weight gradient's fp32 sum are exercised.
        assert plan.weight_grad == ("direct" if chunk is None else "split"), plan
    got = _evaluate(_linear_ce, head, path.dtype, options)
    exact, bounds = _reference(head, path.dtype)
    names = ["output"] * (len(got) - 2) + ["grad_input", "grad_weight"]
    for what, a, e, bound in zip(names, got, exact, bounds, strict=True):
        err = rel_err(a, e)
        assert err <= bound, f"{name} {head} {what}: {err:.3g} > {bound:.3g}"
