"""Claims of the post-training heads that only counting or a device can check (issue 29, item 6).

- GEMMs are counted by a ``TorchDispatchMode`` that sees every matrix product aten runs, also
  inside ``linear_ce``'s custom ops (their Python implementation runs under the mode). Each
  product's shape names the rows it multiplies: with ``F`` features and ``V`` classes larger
  than any chunk of rows, a GEMM over ``(r, F)`` rows and ``V`` classes has the shape
  ``{r, F, V}``. "Ignored rows take part in no GEMM" and "four GEMMs" are then one equality: the
  rows all GEMMs of a step see add up to four times the valid rows, and the FLOPs to
  ``4 · 2 · valid · F · V``.
- Devices: a ``meta`` tensor is on another device than the CPU inputs, so it tests the device
  checks without a GPU.
- The vocabulary pass's row-major tile (the layout of CUDA's ``out_dtype`` GEMM) forced on a CPU
  by ``LINEAR_CE_TILE_LAYOUT=row-major``, against float64.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine import machine
from linear_ce.losses.token_logprob import TokenLogprobGradient

aten = torch.ops.aten
#: Every aten matrix product (``matmul`` and ``linear`` decompose into these before dispatch).
_PRODUCTS = {
    aten.mm,
    aten.addmm,
    aten.addmm_,
    aten.bmm,
    aten.baddbmm,
    aten.baddbmm_,
    aten.addbmm,
    aten.addbmm_,
    aten.mv,
    aten.addmv,
    aten.addmv_,
    aten.dot,
    aten.vdot,
    aten.matmul,
    aten._int_mm,
}
_ADDS_FIRST = {aten.addmm, aten.addmm_, aten.baddbmm, aten.baddbmm_, aten.addbmm, aten.addbmm_}


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix product: ``(m, k) @ (k, n)``, ``batch`` of them."""

    m: int
    k: int
    n: int
    batch: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(sorted((self.m, self.k, self.n)))


class GemmCounter(TorchDispatchMode):
    """Records every matrix product run while active, including those inside ``linear_ce``'s
    custom ops."""

    def __init__(self) -> None:
        super().__init__()
        self.products: list[Product] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("linear_ce::"):
            # The op's own Python body, under this mode again: its GEMMs are seen.
            with self:
                return OPDEFS[name]._init_fn(*args, **kwargs)
        if func.overloadpacket in _PRODUCTS:
            self.products.append(_product(func, args, kwargs))
        return func(*args, **kwargs)

    def flops(self) -> int:
        return sum(p.flops for p in self.products)


def _product(func, args, kwargs) -> Product:
    a, b = args[1:3] if func.overloadpacket in _ADDS_FIRST else args[:2]
    if a.dim() == 3:
        return Product(a.shape[1], a.shape[2], b.shape[2], a.shape[0])
    m = a.shape[0] if a.dim() == 2 else 1
    n = b.shape[1] if b.dim() == 2 else 1
    return Product(m, a.shape[-1], n, 1)


def rows_seen(products: list[Product], features: int, classes: int) -> int:
    """The rows all ``products`` multiply, each of shape ``{rows, features, classes}``;
    fails on any other product."""
    total = 0
    for p in products:
        dims = list(p.dims)
        assert p.batch == 1 and features in dims and classes in dims, p
        dims.remove(features)
        dims.remove(classes)
        total += dims[0]
    return total


# --- token_logprobs ------------------------------------------------------------------------

# Rows per chunk (8 and 5 below) stay under F and V, so a product's shape tells its rows.
N, F, V = 64, 40, 97
CHUNKS = LinearCrossEntropyOptions(batch_chunk_size=8)


def _token_inputs(seed: int, dtype: torch.dtype = torch.float32, ignored: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, F, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    W = (torch.randn(V, F, generator=g, dtype=torch.float64) / F**0.5).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < ignored] = -100
    return x, W, b, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "forced-upcast"])
@pytest.mark.parametrize("ignored", [0.0, 0.4, 1.0])
def test_token_logprobs_four_gemms_over_valid_rows_only(monkeypatch, dtype, native, ignored):
    """A training step (log-prob and entropy both differentiated) is four GEMMs (forward
    logits; backward logits, input and weight gradients), each over the valid rows only:
    the rows the products see add up to four times the valid rows, on every CPU GEMM path."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", native)
    x, W, b, t = _token_inputs(1, dtype, ignored)
    valid = int((t != -100).sum())
    with GemmCounter() as forward:
        out = linear_ce.token_logprobs(x, W, t, linear_bias=b, entropy=True, options=CHUNKS)
    with GemmCounter() as backward:
        (out.logprob.sum() + out.entropy.sum()).backward()
    assert rows_seen(forward.products, F, V) == valid
    assert rows_seen(backward.products, F, V) == 3 * valid
    assert forward.flops() + backward.flops() == 4 * 2 * valid * F * V


def test_token_logprobs_forward_alone_is_one_gemm():
    """Without gradients (``no_grad``, or nothing requires one) only the logits GEMM runs,
    whichever statistics are asked for."""
    x, W, b, t = _token_inputs(2)
    valid = int((t != -100).sum())
    stats = dict(entropy=True, top1=True, log_sum_sq_prob=True, mean_logit=True)
    with GemmCounter() as counter, torch.no_grad():
        linear_ce.token_logprobs(x, W, t, linear_bias=b, options=CHUNKS, **stats)
    assert rows_seen(counter.products, F, V) == valid
    with GemmCounter() as counter:
        linear_ce.token_logprobs(
            x.detach(), W.detach(), t, linear_bias=b.detach(), options=CHUNKS, **stats
        )
    assert rows_seen(counter.products, F, V) == valid


@pytest.mark.parametrize(
    ("wants", "gemms"),
    [((True, True), 3), ((False, True), 2), ((True, False), 2)],
    ids=["both", "weight-only", "input-only"],
)
def test_token_logprobs_backward_forms_only_wanted_gradients(wants, gemms):
    """A gradient nobody asks for costs no GEMM: the backward is the logits GEMM plus one
    GEMM per gradient that flows."""
    x, W, b, t = _token_inputs(3)
    valid = int((t != -100).sum())
    x.requires_grad_(wants[0])
    W.requires_grad_(wants[1])
    out = linear_ce.token_logprobs(x, W, t, linear_bias=b, options=CHUNKS)
    with GemmCounter() as backward:
        out.logprob.sum().backward()
    assert rows_seen(backward.products, F, V) == gemms * valid


class OpLog(TorchDispatchMode):
    """Every aten op run while active (inside ``linear_ce``'s ops too), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("linear_ce::"):
            with self:
                return OPDEFS[name]._init_fn(*args, **kwargs)
        self.ops.append(str(func))
        return func(*args, **kwargs)


def _backward_ops(**asked) -> list[str]:
    x, W, b, t = _token_inputs(4)
    out = linear_ce.token_logprobs(x, W, t, linear_bias=b, options=CHUNKS, **asked)
    with OpLog() as log:
        out.logprob.sum().backward()
    return sorted(log.ops)


def test_an_output_nobody_differentiates_costs_nothing_in_backward():
    """An entropy that is only logged, and the statistics, add no work to the backward: it
    runs exactly the ops (every aten op, not only GEMMs) of a call that never asked for them."""
    plain = _backward_ops()
    assert any("mm" in op for op in plain)
    assert _backward_ops(entropy=True) == plain
    assert _backward_ops(entropy=True, top1=True, log_sum_sq_prob=True, mean_logit=True) == plain


# --- linear_divergence ---------------------------------------------------------------------

F_TEACHER = 48  # the teacher's features differ from the student's: each product names its head


def _divergence_inputs(seed: int, ignored: float):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, F, generator=g).requires_grad_()
    Ws = (torch.randn(V, F, generator=g) / F**0.5).requires_grad_()
    xt = torch.randn(N, F_TEACHER, generator=g)
    Wt = torch.randn(V, F_TEACHER, generator=g) / F_TEACHER**0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < ignored] = -100
    return xs, Ws, xt, Wt, t


def _by_head(products: list[Product]) -> tuple[list[Product], list[Product]]:
    teacher = [p for p in products if F_TEACHER in p.dims]
    return [p for p in products if p not in teacher], teacher


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignored", [0.0, 0.4])
def test_divergence_step_is_four_gemms_over_valid_positions(beta, reduction, ignored):
    """A training step of ``linear_divergence`` (gradients formed in forward) is four GEMMs:
    the teacher's logits, the student's logits and the student's two gradients, each over
    the positions that count only; the backward runs none."""
    xs, Ws, xt, Wt, t = _divergence_inputs(5, ignored)
    valid = int((t != -100).sum())
    with GemmCounter() as forward:
        loss = linear_ce.linear_divergence(
            xs, Ws, xt, Wt, t, beta=beta, reduction=reduction, hard_weight=0.5, options=CHUNKS
        )
    with GemmCounter() as backward:
        loss.backward()
    student, teacher = _by_head(forward.products)
    assert rows_seen(teacher, F_TEACHER, V) == valid
    assert rows_seen(student, F, V) == 3 * valid
    assert backward.products == []


def test_divergence_none_recomputes_both_heads_in_backward():
    """``reduction="none"``: the forward forms both heads' logits; the backward recomputes
    them and forms the student's two gradients, over the valid positions only."""
    xs, Ws, xt, Wt, t = _divergence_inputs(6, 0.4)
    valid = int((t != -100).sum())
    with GemmCounter() as forward:
        loss = linear_ce.linear_divergence(xs, Ws, xt, Wt, t, reduction="none", options=CHUNKS)
    with GemmCounter() as backward:
        loss.sum().backward()
    for counter, student_gemms in ((forward, 1), (backward, 3)):
        student, teacher = _by_head(counter.products)
        assert rows_seen(teacher, F_TEACHER, V) == valid
        assert rows_seen(student, F, V) == student_gemms * valid


# --- devices -------------------------------------------------------------------------------


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _token_call(**changed):
    x, W, b, t = _token_inputs(7)
    return {"input": x, "linear_weight": W, "target": t, "linear_bias": b, **changed}


@pytest.mark.parametrize("name", ["linear_weight", "target", "linear_bias"])
def test_token_logprobs_tensor_on_another_device_is_an_error(name):
    call = _token_call()
    call[name] = _meta(call[name])
    with pytest.raises(ValueError, match=rf"^token_logprobs: .*{name} on meta"):
        linear_ce.token_logprobs(**call)


def test_token_objective_side_input_on_another_device_is_an_error():
    call = _token_call()
    advantage = torch.randn(N, device="meta")
    with pytest.raises(ValueError, match=r"^token_objective: .*advantage.* meta"):
        linear_ce.token_objective(
            **call, objective=lambda lp, ent, advantage: -advantage * lp, advantage=advantage
        )


@pytest.mark.parametrize("name", ["teacher_input", "teacher_weight", "target"])
def test_divergence_tensor_on_another_device_is_an_error(name):
    xs, Ws, xt, Wt, t = _divergence_inputs(8, 0.4)
    call = {"teacher_input": xt, "teacher_weight": Wt, "target": t}
    call[name] = _meta(call[name])
    with pytest.raises(ValueError, match=rf"^linear_divergence: .*{name} (is )?on meta"):
        linear_ce.linear_divergence(xs, Ws, **call)


@pytest.mark.parametrize("name", ["grad_logprob", "grad_entropy"])
def test_vjp_upstream_gradient_on_another_device_is_an_error(name):
    x, W, _, t = _token_inputs(9)
    ups = {"grad_logprob": torch.randn(N), "grad_entropy": torch.randn(N)}
    ups[name] = _meta(ups[name])
    with pytest.raises(ValueError, match=rf"^token_logprobs_vjp: .*{name}.* meta"):
        linear_ce.token_logprobs_vjp(x.detach(), W.detach(), t, **ups)


# --- the vocabulary pass's row-major tile ----------------------------------------------------


def _logits64(x, W, b, softcap, temperature):
    s = x @ W.T + b
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return s / temperature


def _logprob_entropy64(s, t):
    valid = t != -100
    logp = torch.log_softmax(s, -1)
    lp = logp.gather(-1, torch.where(valid, t, 0)[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _vocab_pass_case(dtype, softcap, layout, monkeypatch):
    """token_logprobs's outputs and gradients (its backward is the vocabulary pass), those of
    the plain expression in ``dtype`` and float64's, and the tiles the vocabulary pass used;
    600 rows (a third ignored) of 12 features against 1100 classes, in groups of 64 rows."""
    if layout is not None:
        monkeypatch.setenv(machine.TILE_LAYOUT_ENV, layout)
    tiles = []
    grad_block = TokenLogprobGradient.grad_block

    def recorded(self, s, *args):
        # The tile the head turns into the logits' gradient: the logits GEMM's output and
        # the gradient GEMMs' operand.
        tiles.append((tuple(s.shape), s.stride()))
        return grad_block(self, s, *args)

    monkeypatch.setattr(TokenLogprobGradient, "grad_block", recorded)
    g = torch.Generator().manual_seed(10)
    rows, features, classes = 600, 12, 1100
    x = torch.randn(rows, features, generator=g, dtype=torch.float64)
    W = torch.randn(classes, features, generator=g, dtype=torch.float64) * 2 / features**0.5
    b = torch.randn(classes, generator=g, dtype=torch.float64)
    t = torch.randint(0, classes, (rows,), generator=g)
    t[torch.rand(rows, generator=g) < 1 / 3] = -100
    up = torch.randn(2, rows, generator=g, dtype=torch.float64)
    transform = dict(softcap=softcap, temperature=0.8)

    def grads(outputs, leaves):
        total = sum((o * u.to(o.dtype)).sum() for o, u in zip(outputs, up, strict=True))
        return list(torch.autograd.grad(total, leaves))

    leaves = [v.to(dtype).requires_grad_() for v in (x, W, b)]
    out = linear_ce.token_logprobs(
        *leaves[:2],
        t,
        linear_bias=leaves[2],
        entropy=True,
        options=LinearCrossEntropyOptions(batch_chunk_size=64),
        **transform,
    )
    got = [out.logprob, out.entropy, *grads((out.logprob, out.entropy), leaves)]
    wide = [v.clone().requires_grad_() for v in (x, W, b)]
    ref_out = _logprob_entropy64(_logits64(*wide, **transform), t)
    ref = [*ref_out, *grads(ref_out, wide)]
    # The plain expression in the inputs' dtype (the functions above run in their inputs'),
    # in float32 for float64 inputs: there float64 is the reference itself.
    plain_dtype = torch.float32 if dtype == torch.float64 else dtype
    same = [v.detach().to(plain_dtype).requires_grad_() for v in leaves]
    plain_out = _logprob_entropy64(_logits64(*same, **transform), t)
    plain = [*plain_out, *grads(plain_out, same)]
    return got, plain, ref, tiles, plain_dtype


@pytest.mark.parametrize(
    ("dtype", "native"),
    [
        (torch.float64, "1"),
        (torch.float32, "1"),
        (torch.bfloat16, "1"),
        (torch.bfloat16, "0"),
    ],
    ids=["fp64", "fp32", "bf16-native", "bf16-forced-upcast"],
)
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["plain", "softcap"])
def test_row_major_vocab_tile_matches_float64(monkeypatch, dtype, native, softcap):
    """``LINEAR_CE_TILE_LAYOUT=row-major`` (the layout of CUDA's tile) on a CPU: every tile of
    the backward's vocabulary pass is a dense row-major view, in several class blocks and row
    groups with a narrower last one of each, and every output and gradient is within 3 eps of
    float64, or 2x the plain same-dtype expression's own error where that is larger (for
    float64 inputs, the plain float32 expression's error scaled to float64)."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", native)
    got, plain, ref, tiles, plain_dtype = _vocab_pass_case(dtype, softcap, "row-major", monkeypatch)
    assert tiles and all(stride == (shape[1], 1) for shape, stride in tiles), tiles
    shapes = {shape for shape, _ in tiles}
    assert len({r for r, _ in shapes}) > 1 and len({c for _, c in shapes}) > 1, shapes
    for a, p, r in zip(got, plain, ref, strict=True):
        # The plain expression's own error in ``dtype``; for float64 its float32 error scaled
        # by eps(float64)/eps(float32): the sums over ~1000 classes and ~400 rows round in
        # float64 too, and the reference (not exact either) by as much.
        err, own = rel_err(a, r), rel_err(p, r) * eps(dtype) / eps(plain_dtype)
        assert err <= max(3 * eps(dtype), 2 * own), (err, own)


def test_vocab_tile_defaults_to_the_backends_layout(monkeypatch):
    """Unset, ``auto`` or forced ``class-major``, a CPU's vocabulary-pass tile is
    class-major, so the row-major override above changes the layout."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", "1")
    for layout in (None, "auto", "class-major"):
        tiles = _vocab_pass_case(torch.float32, None, layout, monkeypatch)[3]
        assert tiles and all(stride == (1, shape[0]) for shape, stride in tiles), tiles
