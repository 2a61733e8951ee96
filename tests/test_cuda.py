"""The CUDA branches of the engine, against the float64 plain expression on the CPU.

``"balanced"``/``"compact"`` with fp16/bf16 inputs issue half-precision GEMMs with
fp32 results (``torch.mm(..., out_dtype=torch.float32)``, which CPU torch does not
implement); ``"accurate"`` upcasts the operands to fp32. Skipped without a GPU.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine.gemm import CudaOutDtype, SameDtype, Upcast
from linear_ce.engine.plan import make_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
HALF = [torch.float16, torch.bfloat16]
POLICIES = ["accurate", "balanced", "compact", "auto"]
BACKEND = {"accurate": Upcast, "auto": Upcast, "balanced": CudaOutDtype, "compact": CudaOutDtype}


def _inputs(n, f, c, dtype, seed):
    """CPU inputs rounded to ``dtype``: x, W, bias, class weights, targets (some ignored), upstream."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=gen, dtype=torch.float64).to(dtype)
    W = (torch.randn(c, f, generator=gen, dtype=torch.float64) * (2 / f**0.5)).to(dtype)
    b = torch.randn(c, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.2).to(dtype)
    t = torch.randint(0, c, (n,), generator=gen)
    t[::4] = 1000
    up = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    return x, W, b, w, t, up


def _run(fn, device, x, W, b, w, t, up, reduction, **kwargs):
    """``[loss, grad_x, grad_W, grad_b]`` of ``fn`` on ``device``, returned on the CPU."""
    leaves = [a.detach().to(device, copy=True).requires_grad_() for a in (x, W, b)]
    loss = fn(
        leaves[0],
        leaves[1],
        t.to(device),
        linear_bias=leaves[2],
        weight=w.to(device),
        reduction=reduction,
        ignore_index=1000,
        **kwargs,
    )
    loss.backward(up.to(device=device, dtype=loss.dtype) if reduction == "none" else None)
    return [r.cpu() for r in [loss.detach()] + [leaf.grad for leaf in leaves]]


def _plain(x, W, t, *, linear_bias, weight, reduction, ignore_index):
    return F.cross_entropy(
        F.linear(x, W, linear_bias),
        t,
        weight=weight,
        reduction=reduction,
        ignore_index=ignore_index,
    )


def _reference(x, W, b, w, t, up, reduction):
    return _run(
        _plain, "cpu", x.double(), W.double(), b.double(), w.double(), t, up.double(), reduction
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_plan_uses_the_cuda_backend(dtype, policy):
    plan = make_plan(64, 16, 100, dtype, CUDA, LinearCrossEntropyOptions(acc_policy=policy))
    assert type(plan.gemm) is BACKEND[policy]
    assert plan.acc_dtype == torch.float32
    assert plan.weight_grad_dtype == (dtype if policy == "compact" else torch.float32)


def test_out_dtype_mm_is_available():
    a = torch.randn(8, 16, device=CUDA, dtype=torch.bfloat16)
    out = torch.mm(a, a.T, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel_err(out, a.double() @ a.double().T) <= 3 * eps(torch.float32)


@pytest.mark.parametrize(
    ("shape", "chunk"), [((13, 5, 7), 4), ((252, 123, 507), 64)], ids=["small", "large"]
)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("dtype", "policy"), list(itertools.product(HALF, POLICIES)), ids=str)
def test_half_precision_accuracy(dtype, policy, reduction, shape, chunk):
    x, W, b, w, t, up = _inputs(*shape, dtype, seed=0)
    options = LinearCrossEntropyOptions(batch_chunk_size=chunk, acc_policy=policy)
    got = _run(linear_ce.linear_cross_entropy, CUDA, x, W, b, w, t, up, reduction, options=options)
    ref = _reference(x, W, b, w, t, up, reduction)
    for name, g, r in zip(
        ["loss", "grad_input", "grad_weight", "grad_bias"], got, ref, strict=True
    ):
        assert g.dtype == dtype
        err = rel_err(g, r)
        assert err <= 3 * eps(dtype), f"{name}: {err / eps(dtype):.2f} eps"


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_float32_accuracy(reduction):
    # fp32 on CUDA runs SameDtype GEMMs; cuBLAS sums in its own order, so the rule is
    # 3 eps or twice the error of the plain fp32 expression on the same device.
    x, W, b, w, t, up = _inputs(252, 123, 507, torch.float32, seed=1)
    plan = make_plan(252, 123, 507, torch.float32, CUDA, LinearCrossEntropyOptions())
    assert type(plan.gemm) is SameDtype
    options = LinearCrossEntropyOptions(batch_chunk_size=64)
    got = _run(linear_ce.linear_cross_entropy, CUDA, x, W, b, w, t, up, reduction, options=options)
    plain32 = _run(_plain, CUDA, x, W, b, w, t, up, reduction)
    ref = _reference(x, W, b, w, t, up, reduction)
    for g, p, r in zip(got, plain32, ref, strict=True):
        assert rel_err(g, r) <= max(3 * eps(torch.float32), 2 * rel_err(p, r))


@pytest.mark.parametrize(
    ("dtype", "policy"), [(torch.float32, "auto"), (torch.bfloat16, "compact")], ids=str
)
def test_cuda_memory_without_logits(dtype, policy):
    n, f, v = 4096, 256, 50000
    gen = torch.Generator(device=CUDA).manual_seed(2)
    x = torch.randn(n, f, device=CUDA, generator=gen).to(dtype).requires_grad_()
    W = (torch.randn(v, f, device=CUDA, generator=gen) * 0.05).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=CUDA, generator=gen)
    options = LinearCrossEntropyOptions(acc_policy=policy)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = linear_ce.linear_cross_entropy(x, W, t, options=options)
    loss.backward()
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - before
    assert torch.isfinite(loss) and torch.isfinite(W.grad).all()
    logits_bytes = n * v * dtype.itemsize
    assert growth < 0.25 * logits_bytes, f"peak grew by {growth / 2**20:.0f} MiB"
