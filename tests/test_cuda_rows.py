"""Every head the row loops take, on CUDA: with torch's operations for the row math
(``LINEAR_CE_NATIVE_ROWS=0``) and with the Triton row kernels (``=1``,
:mod:`linear_ce.engine.triton_rows`), each checked to have taken the path asked, against
the plain float64 expression on the CPU at the house bound (3 eps of the dtype, 4 where an
entropy's gradient enters, or twice the plain same-dtype expression's error on the GPU).
bf16 inputs take the ``"balanced"`` policy (bf16 GEMMs with fp32 results), fp32 ones the
default. Skipped without a GPU (``scripts/gpu_check.sh`` runs them; its dry run collects
them on every machine).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linear_ce
import linear_ce.objectives as obj
import sequence_formula as seqref
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions
from linear_ce.engine import triton_rows as tr
from test_divergence import plain_divergence

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(params=["0", "1"], ids=["eager-rows", "triton-rows"])
def rows(request, monkeypatch):
    """The row math's path, and after the test a check that it was taken: the Triton rows
    called under ``=1``, never under ``=0``."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_ROWS", request.param)
    calls = []
    for name in ("stats_call", "grad_", "fused_", "pair_"):
        original = getattr(tr.TritonRows, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(tr.TritonRows, name, counted)
    yield request.param
    assert bool(calls) == (request.param == "1"), calls


def _options(dtype: torch.dtype, chunk: int = 48) -> LinearCrossEntropyOptions:
    policy = "balanced" if dtype == torch.bfloat16 else "auto"
    return LinearCrossEntropyOptions(batch_chunk_size=chunk, acc_policy=policy)


def _data(seed, rows, feat, classes, ignored=0.25):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, feat, generator=gen, dtype=torch.float64)
    W = torch.randn(classes, feat, generator=gen, dtype=torch.float64) * 2 / feat**0.5
    t = torch.randint(0, classes, (rows,), generator=gen)
    t[torch.rand(rows, generator=gen) < ignored] = -100
    return x, W, t


def _leaves(values, dtype, device):
    return [v.to(device=device, dtype=dtype, copy=True).requires_grad_() for v in values]


def _check(got, exact, same, dtype, what, floor=3):
    """The house bound per output: ``floor`` eps of ``dtype`` or twice the plain
    same-dtype expression's error."""
    for i, (g, e, s) in enumerate(zip(got, exact, same, strict=True)):
        bound = max(floor * eps(dtype), 2 * rel_err(s, e))
        err = rel_err(g, e)
        assert err <= bound, f"{what}[{i}]: {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy(dtype, rows):
    """linear_cross_entropy with a z-loss, a logit scale and a temperature, a quarter of
    the rows ignored, chunks of 48 rows: the loss and both gradients."""
    x, W, t = _data(3, 300, 32, 500)

    def run(fn, dt, device):
        leaves = _leaves((x, W), dt, device)
        loss = fn(*leaves, t.to(device))
        return [loss.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(loss, leaves))]

    def ours(x_, W_, t_):
        return linear_ce.linear_cross_entropy(
            x_, W_, t_, z_loss=1e-2, logit_scale=1.3, temperature=0.8, options=_options(dtype)
        )

    def plain(x_, W_, t_):
        z = F.linear(x_, W_) * 1.3 / 0.8
        valid = t_ != -100
        z, target = z[valid], t_[valid]
        loss = F.cross_entropy(z, target, reduction="sum")
        return (loss + 1e-2 * torch.logsumexp(z, -1).square().sum()) / valid.sum()

    got = run(ours, dtype, CUDA)
    _check(got, run(plain, torch.float64, CPU), run(plain, dtype, CUDA), dtype, "cross_entropy")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_logprobs(dtype, rows):
    """token_logprobs with its entropy, and its vjp with both upstream gradients."""
    x, W, t = _data(7, 150, 16, 300)
    gen = torch.Generator().manual_seed(8)
    up_lp, up_h = torch.randn(2, 150, generator=gen, dtype=torch.float64)
    transform = dict(logit_scale=1.2, temperature=0.9)
    options = _options(dtype, 40)
    xs, Ws = (v.to(device=CUDA, dtype=dtype) for v in (x, W))
    out = linear_ce.token_logprobs(xs, Ws, t.to(CUDA), entropy=True, options=options, **transform)
    gx, gW, _ = linear_ce.token_logprobs_vjp(
        xs, Ws, t.to(CUDA), up_lp.to(CUDA, dtype), up_h.to(CUDA, dtype), options=options,
        **transform,
    )  # fmt: skip
    got = [v.cpu() for v in (out.logprob, out.entropy, gx, gW)]

    def plain(dt, device):
        leaves = _leaves((x, W), dt, device)
        tt = t.to(device)
        lp, ent, _ = seqref.token_terms(*leaves, None, tt, torch.zeros_like(tt), **transform)
        loss = (lp * up_lp.to(device, dt)).sum() + (ent * up_h.to(device, dt)).sum()
        grads = torch.autograd.grad(loss, leaves)
        return [v.detach().cpu() for v in (lp, ent, *grads)]

    _check(got, plain(torch.float64, CPU), plain(dtype, CUDA), dtype, "token_logprobs", floor=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_objective(dtype, rows):
    """token_objective of the clipped surrogate with an entropy bonus."""
    n = 160
    x, W, t = _data(9, n, 16, 250)
    gen = torch.Generator().manual_seed(10)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    old = -5.0 + torch.randn(n, generator=gen, dtype=torch.float64)
    objective = obj.clipped_policy_gradient(0.2, 0.28) + obj.entropy_bonus(0.05)
    leaves = _leaves((x, W), dtype, CUDA)
    loss = linear_ce.token_objective(
        *leaves, t.to(CUDA), objective, entropy=True, options=_options(dtype),
        advantage=adv.to(CUDA, dtype), old_logprob=old.to(CUDA, dtype),
    )  # fmt: skip
    got = [loss.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(loss, leaves))]

    def plain(dt, device):
        wide = _leaves((x, W), dt, device)
        tt = t.to(device)
        lp, ent, scored = seqref.token_terms(*wide, None, tt, torch.zeros_like(tt))
        ratio = torch.exp(lp - old.to(device, dt))
        a = adv.to(device, dt)
        terms = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a) - 0.05 * ent
        total = torch.where(scored, terms, 0.0).sum()
        return [total.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(total, wide))]

    _check(got, plain(torch.float64, CPU), plain(dtype, CUDA), dtype, "token_objective", floor=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sequence_objective_dpo(dtype, rows):
    """sequence_objective of DPO over 6 pairs of padded sequences, chunks of whole pairs."""
    seqs, length, feat, classes = 12, 20, 16, 150
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(seqs, length, feat, generator=gen, dtype=torch.float64)
    W = torch.randn(classes, feat, generator=gen, dtype=torch.float64) * 2 / feat**0.5
    t = torch.randint(0, classes, (seqs, length), generator=gen)
    t[torch.rand(seqs, length, generator=gen) < 0.25] = -100
    t[:, 0] = torch.randint(0, classes, (seqs,), generator=gen)
    refs = -length * 3 + torch.randn(seqs, generator=gen, dtype=torch.float64)
    leaves = _leaves((x, W), dtype, CUDA)
    out = linear_ce.sequence_objective(
        *leaves, t.to(CUDA), obj.dpo(0.1), group="pairs", options=_options(dtype),
        ref_logprob=refs.to(CUDA, dtype),
    )  # fmt: skip
    got = [out.loss.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(out.loss, leaves))]

    def plain(dt, device):
        wide = _leaves((x, W), dt, device)
        ids = torch.arange(seqs, device=device)[:, None].expand(seqs, length)
        lp, _, scored = seqref.token_terms(*wide, None, t.to(device), ids)
        per_seq = seqref.per_sequence(lp, ids, scored, seqs)
        n = scored.sum(1).to(dt)
        loss = seqref.dpo_loss("sigmoid", per_seq, refs.to(device, dt), n, 0.1).mean()
        return [loss.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(loss, wide))]

    _check(got, plain(torch.float64, CPU), plain(dtype, CUDA), dtype, "sequence_objective", 4)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3], ids=["forward", "reverse", "mixture"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_distillation(dtype, beta, rows):
    """linear_divergence to a teacher head (hard term, temperature, logit scales): the
    pair loops on CUDA."""
    gen = torch.Generator().manual_seed(11)
    n, length, fs, ft, classes = 3, 40, 16, 12, 130
    xs = torch.randn(n, length, fs, generator=gen, dtype=torch.float64)
    ws = torch.randn(classes, fs, generator=gen, dtype=torch.float64) * 2 / fs**0.5
    xt = torch.randn(n, length, ft, generator=gen, dtype=torch.float64)
    wt = torch.randn(classes, ft, generator=gen, dtype=torch.float64) * 2 / ft**0.5
    t = torch.randint(0, classes, (n, length), generator=gen)
    t[torch.rand(n, length, generator=gen) < 0.25] = -100
    terms = dict(beta=beta, temperature=2.0, hard_weight=0.5, reduction="mean")
    scales = dict(student_logit_scale=1.3, teacher_logit_scale=0.8)
    leaves = _leaves((xs, ws), dtype, CUDA)
    teacher = [v.to(CUDA, dtype) for v in (xt, wt)]
    loss = linear_ce.linear_divergence(
        *leaves, *teacher, t.to(CUDA), options=_options(dtype, 16), **terms, **scales
    )
    got = [loss.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(loss, leaves))]

    def plain(dt, device):
        wide = _leaves((xs, ws), dt, device)
        ref = plain_divergence(
            *wide, xt.to(device, dt), wt.to(device, dt), t.to(device), **terms,
            scale_s=1.3, scale_t=0.8,
        )  # fmt: skip
        return [ref.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(ref, wide))]

    _check(got, plain(torch.float64, CPU), plain(dtype, CUDA), dtype, f"divergence {beta}")
