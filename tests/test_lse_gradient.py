"""A returned lse carries its gradient (issue 49): ``loss + f(lse)`` for a few ``f``, every
reduction, shift and ignored rows, the extras, the compiled row loops, the custom op's
registration, ``torch.compile`` and a vocab-parallel shard, against the plain float64
expression written here: ``F.cross_entropy`` on the full logits and ``torch.logsumexp``,
masked to zero on ignored rows (the package's convention: an ignored row's lse is the
constant 0, so no gradient reaches it; ``torch.where`` gives the plain expression the same).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import linear_ce
from conftest import eps, rel_err, run_gloo_rank
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine import native_rows as nr

B, T, FEATURES, CLASSES = 3, 6, 10, 37
IGNORE = -100
REDUCTIONS = ("mean", "sum", "none")

#: The functions of ``(loss, lse, R)`` differentiated: a z-loss written on the lse, its sum,
#: a random weighting of it, the lse alone (the loss unused). "none" losses are weighted by
#: ``R + 1`` and a scalar loss by 3, so the loss's upstream gradient is not one either.
FUNCTIONS = {
    "mean_sq": lambda lse, R: 0.1 * lse.square().mean(),
    "sum": lambda lse, R: lse.sum(),
    "weighted": lambda lse, R: (R * lse).sum(),
}


def _objective(loss, lse, R, f, with_loss=True):
    total = FUNCTIONS[f](lse, R)
    if not with_loss:
        return total
    return total + ((R + 1) * loss).sum() if loss.dim() else total + 3 * loss


def _data(seed, *, ignored=0.2, dtype=torch.float64, extras=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, FEATURES, generator=gen, dtype=torch.float64)
    W = torch.randn(CLASSES, FEATURES, generator=gen, dtype=torch.float64) / 2
    b = torch.randn(CLASSES, generator=gen, dtype=torch.float64)
    t = torch.randint(0, CLASSES, (B, T), generator=gen)
    t[torch.rand(B, T, generator=gen) < ignored] = IGNORE
    R = torch.randn(B, T, generator=gen, dtype=torch.float64)
    kw = {}
    if extras:
        kw = dict(
            weight=torch.rand(CLASSES, generator=gen, dtype=torch.float64) + 0.5,
            token_weight=torch.rand(B, T, generator=gen, dtype=torch.float64) + 0.5,
            label_smoothing=0.1,
            z_loss=0.05,
            softcap=3.0,
        )
    cast = {k: v.to(dtype) if torch.is_tensor(v) else v for k, v in kw.items()}
    return [v.to(dtype) for v in (x, W, b)], t, R, cast


def _plain(x, W, b, t, *, reduction, shift, weight=None, token_weight=None,
           label_smoothing=0.0, z_loss=0.0, softcap=None):  # fmt: skip
    """The plain expression: ``(loss, lse)``, the lse zero where the label is ignored."""
    logits = F.linear(x, W, b)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    labels = t
    if shift:
        labels = torch.cat([t[:, 1:], torch.full_like(t[:, :1], IGNORE)], dim=1)
    valid = labels != IGNORE
    rows = F.cross_entropy(
        logits.reshape(-1, CLASSES), labels.reshape(-1), weight=weight, ignore_index=IGNORE,
        reduction="none", label_smoothing=label_smoothing,
    ).view(B, T)  # fmt: skip
    lse = torch.where(valid, torch.logsumexp(logits, -1), 0.0)
    omega = valid.to(x.dtype)
    if weight is not None:
        omega = omega * weight[labels.clamp(min=0)]
    rows = rows + z_loss * omega * lse.square()
    if token_weight is not None:
        rows = rows * token_weight
    if reduction == "none":
        return rows, lse
    return (rows.sum() / omega.sum() if reduction == "mean" else rows.sum()), lse


def _ours(x, W, b, t, *, reduction, shift, options=None, **kw):
    out = linear_ce.linear_cross_entropy(
        x, W, t, linear_bias=b, reduction=reduction, shift=shift, return_lse=True,
        options=options, **kw,
    )  # fmt: skip
    return out.loss, out.lse


def _run(fn, leaves, t, R, f, with_loss=True, **kw):
    """``[objective, lse, grad x, grad W, grad b]`` of ``fn`` on copies of ``leaves``."""
    leaves = [v.clone().requires_grad_() for v in leaves]
    loss, lse = fn(*leaves, t, **kw)
    total = _objective(loss, lse, R.to(lse.dtype), f, with_loss)
    return [total.detach(), lse.detach(), *torch.autograd.grad(total, leaves)]


NAMES = ("objective", "lse", "grad_input", "grad_weight", "grad_bias")


def _check(got, exact, bound, what):
    for name, g, e in zip(NAMES, got, exact, strict=True):
        err = rel_err(g, e)
        assert err <= bound, f"{what} {name}: {err:.3g} > {bound:.3g}"


#: float64: the plain expression rounds as much as ours does, so their distance holds both
#: shares: 2 × the house bound of 3 eps (as tests/test_extras.py's float64 tolerance).
F64_BOUND = 6 * eps(torch.float64)


@pytest.mark.parametrize("layout", ["shift-ignored", "unshifted"])
@pytest.mark.parametrize("f", list(FUNCTIONS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_loss_plus_function_of_lse_float64(reduction, f, layout):
    """``loss + f(lse)``: the objective, the lse and the gradients of input, weight and
    bias against the plain expression; shifted with a fifth of the labels ignored, or
    neither."""
    shift = layout == "shift-ignored"
    leaves, t, R, _ = _data(1, ignored=0.2 if shift else 0.0)
    options = LinearCrossEntropyOptions(batch_chunk_size=5)
    kw = dict(reduction=reduction, shift=shift)
    got = _run(_ours, leaves, t, R, f, options=options, **kw)
    exact = _run(_plain, leaves, t, R, f, **kw)
    _check(got, exact, F64_BOUND, f"{reduction} {f} {layout}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_lse_alone_float64(reduction):
    """The lse alone in the objective (the loss unused: its upstream gradient is None)."""
    leaves, t, R, _ = _data(2)
    kw = dict(reduction=reduction, shift=True)
    got = _run(_ours, leaves, t, R, "weighted", with_loss=False, **kw)
    exact = _run(_plain, leaves, t, R, "weighted", with_loss=False, **kw)
    _check(got, exact, F64_BOUND, f"lse alone {reduction}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_lse_with_every_extra_float64(reduction):
    """Class weights, token weights, label smoothing, a z-loss and a softcap, with a
    weighted lse in the objective."""
    leaves, t, R, extras = _data(3, extras=True)
    kw = dict(reduction=reduction, shift=True, **extras)
    options = LinearCrossEntropyOptions(batch_chunk_size=4)
    got = _run(_ours, leaves, t, R, "weighted", options=options, **kw)
    exact = _run(_plain, leaves, t, R, "weighted", **kw)
    _check(got, exact, F64_BOUND, f"extras {reduction}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_k_dimensional_and_probability_targets_float64(reduction):
    """A K-dimensional loss (weight ``(C, P, F)``, an lse per row and position) and
    probability targets with label smoothing (every row counts), a weighted lse."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(7, FEATURES, generator=gen, dtype=torch.float64).requires_grad_()
    Wk = torch.randn(CLASSES, 3, FEATURES, generator=gen, dtype=torch.float64).requires_grad_()
    W = torch.randn(CLASSES, FEATURES, generator=gen, dtype=torch.float64).requires_grad_()
    t = torch.randint(0, CLASSES, (7, 3), generator=gen)
    t[0, 1] = t[4, 2] = IGNORE
    q = torch.randn(7, CLASSES, generator=gen, dtype=torch.float64).softmax(-1)
    R = torch.randn(7, 3, generator=gen, dtype=torch.float64)

    def kdim(ours):
        if ours:
            out = linear_ce.linear_cross_entropy(x, Wk, t, reduction=reduction, return_lse=True)
            return out.loss, out.lse
        logits = torch.einsum("nf,cpf->ncp", x, Wk)
        lse = torch.where(t != IGNORE, torch.logsumexp(logits, 1), 0.0)
        return F.cross_entropy(logits, t, ignore_index=IGNORE, reduction=reduction), lse

    def probability(ours):
        kw = dict(reduction=reduction, label_smoothing=0.1)
        if ours:
            out = linear_ce.linear_cross_entropy(x, W, q, return_lse=True, **kw)
            return out.loss, out.lse
        logits = x @ W.T
        return F.cross_entropy(logits, q, **kw), torch.logsumexp(logits, -1)

    for name, fn, leaves, weights in (
        ("kdim", kdim, (x, Wk), R),
        ("prob", probability, (x, W), R[:, 0]),
    ):
        results = []
        for ours in (True, False):
            loss, lse = fn(ours)
            total = _objective(loss, lse, weights, "weighted")
            results.append([total, lse, *torch.autograd.grad(total, leaves)])
        for what, g, e in zip(NAMES, *results, strict=False):
            assert rel_err(g, e) <= F64_BOUND, f"{name} {reduction} {what}"


def test_every_row_ignored_gives_zero_gradients():
    """A "mean" whose rows are all ignored: NaN loss, lse 0, every gradient exactly zero
    (torch's), also with the lse in the objective."""
    leaves, t, R, _ = _data(4)
    t = torch.full_like(t, IGNORE)
    got = _run(_ours, leaves, t, R, "sum", with_loss=False, reduction="mean", shift=False)
    assert torch.equal(got[1], torch.zeros(B, T, dtype=torch.float64))
    for grad in got[2:]:
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("mode", ["0", "1"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_float32_on_both_row_paths(reduction, mode, monkeypatch):
    """fp32 with the compiled row loops off and on (on: every chunk's gradient by their
    fused visit, whose softmax coefficient takes the lse's upstream gradient): the house
    bound against float64, 3 eps or twice the plain fp32 expression's own error."""
    if mode == "1" and shutil.which(nr._compiler()[0]) is None:
        pytest.skip("no C compiler to build the row loops")
    monkeypatch.setenv(nr.NATIVE_ROWS_ENV, mode)
    fused = []
    original = nr.NativeRows.fused_

    def counted(self, *args, **kwargs):
        fused.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nr.NativeRows, "fused_", counted)
    (x, W, _), t, R, _ = _data(5)
    kw = dict(reduction=reduction, shift=True, z_loss=0.01)
    options = LinearCrossEntropyOptions(batch_chunk_size=5)

    def ours(x_, W_, t_, **kw_):  # no bias: a bias keeps the torch operations
        return _ours(x_, W_, None, t_, **kw_)

    def plain(x_, W_, t_, **kw_):
        return _plain(x_, W_, None, t_, **kw_)

    got = _run(ours, [x.float(), W.float()], t, R, "mean_sq", options=options, **kw)
    assert bool(fused) == (mode == "1")
    exact = _run(plain, [x, W], t, R, "mean_sq", **kw)
    same = _run(plain, [x.float(), W.float()], t, R, "mean_sq", **kw)
    for name, g, e, s in zip(NAMES, got, exact, same, strict=False):
        bound = max(3 * eps(torch.float32), 2 * rel_err(s, e))
        assert rel_err(g, e) <= bound, f"fp32 {reduction} {mode} {name}"


def test_logging_the_lse_keeps_the_gradients_formed_in_forward(monkeypatch):
    """A returned lse that gets no gradient (logged) costs no recomputation: a "mean"
    backward hands over the forward's gradients (no second run of the loop)."""
    import linear_ce.ops.cross_entropy as ops

    runs = []
    original = ops.run_head

    def counted(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ops, "run_head", counted)
    leaves, t, _, _ = _data(6)
    x, W, b = (v.clone().requires_grad_() for v in leaves)
    out = linear_ce.linear_cross_entropy(x, W, t, linear_bias=b, return_lse=True)
    out.loss.backward()
    assert len(runs) == 1
    with_lse = linear_ce.linear_cross_entropy(x, W, t, linear_bias=b, return_lse=True)
    (with_lse.loss + with_lse.lse.sum()).backward()
    assert len(runs) == 3  # its forward, and one recomputing pass with both upstreams


def test_z_loss_output_stays_detached():
    """The returned z-loss term is for logging (its docstring says detached): it has no
    gradient, so a backward from it alone raises rather than returning nothing."""
    leaves, t, _, _ = _data(7)
    x, W, b = (v.clone().requires_grad_() for v in leaves)
    out = linear_ce.linear_cross_entropy(
        x, W, t, linear_bias=b, z_loss=0.1, return_z_loss=True, return_lse=True
    )
    assert out.lse.requires_grad and not out.z_loss.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.z_loss.backward()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_custom_op_registration_with_a_differentiable_lse(monkeypatch, reduction):
    """torch.library.opcheck on the arguments a ``return_lse`` call passes (its AOT check
    differentiates every output, the lse included)."""
    import linear_ce.functional

    op_name = "chunked_rows" if reduction == "none" else "chunked_scalar"
    op = getattr(linear_ce.functional, op_name)
    recorded = []

    def recording(*args):
        recorded.append(args)
        return op(*args)

    monkeypatch.setattr(linear_ce.functional, op_name, recording)
    leaves, t, _, _ = _data(8)
    x, W, b = (v.clone().requires_grad_() for v in leaves)
    linear_ce.linear_cross_entropy(x, W, t, linear_bias=b, reduction=reduction, return_lse=True)
    (args,) = recorded
    result = torch.library.opcheck(getattr(torch.ops.linear_ce, op_name).default, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_torch_compile_and_vmap():
    """``loss + f(lse)`` under ``torch.compile(fullgraph=True)``, and under
    ``torch.func.vmap`` over a leading batch, against the plain expression."""
    leaves, t, R, _ = _data(9)
    kw = dict(reduction="mean", shift=True)
    compiled = torch.compile(_ours, backend="aot_eager", fullgraph=True)
    # What compile promotes the default to (with a warning): tests/test_extras.py.
    options = LinearCrossEntropyOptions(allow_retain_graph=True)
    got = _run(compiled, leaves, t, R, "mean_sq", options=options, **kw)
    exact = _run(_plain, leaves, t, R, "mean_sq", **kw)
    _check(got, exact, F64_BOUND, "compiled")

    x, W, b = leaves
    W = W.clone().requires_grad_()

    def per_sample(x_, t_):
        out = linear_ce.linear_cross_entropy(x_, W, t_, linear_bias=b, return_lse=True)
        return out.loss + out.lse.square().sum()

    def plain_sample(x_, t_):
        logits = F.linear(x_, W, b)
        lse = torch.where(t_ != IGNORE, torch.logsumexp(logits, -1), 0.0)
        return F.cross_entropy(logits, t_, ignore_index=IGNORE) + lse.square().sum()

    # vmap runs the op once per sample; autograd differentiates the batch afterwards.
    got = torch.func.vmap(per_sample)(x, t)
    (got_grad,) = torch.autograd.grad((R[:, 0] * got).sum(), [W])
    plain = torch.stack([plain_sample(x[i], t[i]) for i in range(B)])
    (plain_grad,) = torch.autograd.grad((R[:, 0] * plain).sum(), [W])
    assert rel_err(got, plain) <= F64_BOUND
    assert rel_err(got_grad, plain_grad) <= F64_BOUND


# ----------------------------------------------------------------------------- vocab-parallel, DTensor


def _shard_case(rank: int, world: int) -> list[str]:
    """On this rank's shard of the classes: ``loss + f(lse)`` for every reduction against
    the plain float64 expression on the full weight (the input's gradient whole, the
    weight's and bias's this rank's rows)."""
    failures = []
    leaves, t, R, extras = _data(10, extras=True)
    x, W, b = leaves
    sizes = [CLASSES // world + (r < CLASSES % world) for r in range(world)]
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    layout = linear_ce.VocabParallel(None, start, CLASSES)
    for reduction in REDUCTIONS:
        kw = dict(reduction=reduction, shift=True, **extras)
        got = _run(_ours, [x, W[rows], b[rows]], t, R, "weighted", vocab_parallel=layout, **kw)
        exact = _run(_plain, leaves, t, R, "weighted", **kw)
        exact[3:] = [g[rows] for g in exact[3:]]
        for name, g, e in zip(NAMES, got, exact, strict=True):
            err = rel_err(g, e)
            if not err <= F64_BOUND:
                failures.append(f"rank {rank}/{world} {reduction} {name}: {err:.3g}")
    return failures


def _dtensor_case(rank: int, world: int) -> list[str]:
    """DTensor arguments: the weight split along the vocabulary (the input replicated), or
    the input's rows split (the weight replicated); the lse's gradient through
    ``full_tensor`` against the plain float64 expression."""
    failures = []
    mesh = init_device_mesh("cpu", (world,))
    leaves, t, R, extras = _data(11, extras=True)
    token_weight = extras.pop("token_weight")
    layouts = {"vocab": (Replicate(), Shard(0)), "rows": (Shard(0), Replicate())}
    for layout, (rows_pl, head_pl) in layouts.items():
        for reduction in REDUCTIONS:
            kw = dict(reduction=reduction, shift=True, **extras)
            x = distribute_tensor(leaves[0], mesh, [rows_pl]).requires_grad_()
            W, b = (distribute_tensor(v, mesh, [head_pl]).requires_grad_() for v in leaves[1:])
            out = linear_ce.linear_cross_entropy(
                x, W, distribute_tensor(t, mesh, [rows_pl]), linear_bias=b, return_lse=True,
                token_weight=distribute_tensor(token_weight, mesh, [rows_pl]), **kw,
            )  # fmt: skip
            loss, lse = out.loss.full_tensor(), out.lse.full_tensor()
            total = _objective(loss, lse, R, "weighted")
            got = [total.detach(), lse.detach()]
            got += [g.full_tensor() for g in torch.autograd.grad(total, [x, W, b])]
            exact = _run(_plain, leaves, t, R, "weighted", token_weight=token_weight, **kw)
            for name, g, e in zip(NAMES, got, exact, strict=True):
                err = rel_err(g, e)
                if not err <= F64_BOUND:
                    failures.append(f"DTensor {layout} rank {rank} {reduction} {name}: {err:.3g}")
    return failures


def _worker(rank: int, world: int, folder: str) -> None:
    run_gloo_rank(
        rank, world, folder, lambda: _shard_case(rank, world) + _dtensor_case(rank, world)
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_vocab_parallel_and_dtensor_lse_gradient(tmp_path):
    """Two ranks over gloo: each shard's lse gradient is the softmax over the whole
    vocabulary (the global lse) times its upstream gradient; DTensor arguments split along
    the vocabulary or the rows."""
    assert not dist.is_initialized()
    world = 2
    mp.spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [f for rank in found for f in rank] == []
