"""Issue 29, items 1-3: the token heads drop no gradient in silence, and a NaN follows the
loss's policy (docs/guarantees.md).

- ``token_objective`` differentiates its objective with respect to ``logprob`` and
  ``entropy`` only: an objective whose result depends on any other tensor that requires
  grad (one it closes over) is refused, never differentiated partially.
- ``log_sum_sq_prob`` and ``mean_logit`` of ``token_logprobs`` have no gradient: one that
  is part of a differentiated graph is an error, alone or added to a loss, eagerly, under
  ``torch.compile`` and in the vocab-parallel form.
- A NaN in the hidden state or a side input reaches exactly the outputs and gradient rows
  the plain expression's NaN reaches, with no exception, also under ``torch.no_grad()``,
  and the chunk loop makes no host synchronisation.

References are written here: full float64 logits, ``log_softmax``, the objective's formula,
gradients by autograd.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

import linear_ce
from conftest import eps, rel_err, run_gloo_rank
from linear_ce import LinearCrossEntropyOptions, VocabParallel
from linear_ce.losses.token_objective import ObjectiveHead

B, T, FEAT, V = 2, 9, 8, 23
CHUNK = LinearCrossEntropyOptions(batch_chunk_size=4)
STATISTICS = ("log_sum_sq_prob", "mean_logit")


def _data(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (B, T), generator=g)
    t[0, 2:4] = -100
    return {
        "x": torch.randn(B, T, FEAT, generator=g, dtype=dtype),
        "W": (torch.randn(V, FEAT, generator=g) * 2 / FEAT**0.5).to(dtype),
        "b": torch.randn(V, generator=g, dtype=dtype),
        "t": t,
        "old": (-3 + 0.3 * torch.randn(B, T, generator=g)).to(dtype),
        "adv": torch.randn(B, T, generator=g, dtype=dtype),
    }


def _leaves(d: dict[str, torch.Tensor], requires_grad: bool = True) -> list[torch.Tensor]:
    return [d[k].clone().requires_grad_(requires_grad) for k in ("x", "W", "b")]


def _plain_logprob(x, W, b, t):
    """Per-token log-probability of the full logits, and the valid mask."""
    logp = torch.log_softmax(x @ W.T + b, -1)
    valid = t != -100
    return logp.gather(-1, torch.where(valid, t, 0)[..., None])[..., 0], valid


def _clipped(lp, old, adv, weight):
    """The PPO/GRPO clipped surrogate, written out: ``-min(r·A, clip(r, 0.8, 1.2)·A)·w``."""
    r = torch.exp(lp - old)
    return -torch.min(r * adv, r.clamp(0.8, 1.2) * adv) * weight


def _policy_objective(lp, ent, *, old_logprob, advantage, weight):
    return _clipped(lp, old_logprob, advantage, weight)


# Item 1: an objective closing over a tensor that requires grad.


def _captured(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coef, leaf)``: the scalar the objective closes over and the leaf it comes from."""
    if kind == "leaf":
        leaf = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        return leaf, leaf
    leaf = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True)
    return (leaf[0] if kind == "view" else leaf.square().sum()), leaf


@pytest.mark.parametrize("kind", ["leaf", "view", "computed"])
@pytest.mark.parametrize("head_requires_grad", [True, False])
def test_objective_closing_over_a_tensor_that_requires_grad_is_refused(kind, head_requires_grad):
    """The gradient of ``coef`` cannot flow out of the per-chunk autograd: refused, also
    when the head itself is frozen (the loss would not even require grad)."""
    d = _data(1)
    x, W, b = _leaves(d, head_requires_grad)
    coef, _ = _captured(kind)
    with pytest.raises(ValueError, match=r"token_objective: objective's result depends on a"):
        linear_ce.token_objective(
            x, W, d["t"], lambda lp, ent, **_: coef * lp, linear_bias=b, options=CHUNK
        )


def test_objective_closing_over_data_or_under_no_grad_runs_without_a_graph():
    """A captured tensor without grad is data; under ``torch.no_grad()`` nothing is
    differentiated, so a captured tensor that requires grad is not refused either, and the
    objective sees tensors without a graph (no per-chunk autograd)."""
    d = _data(2)
    coef, _ = _captured("leaf")
    seen = []

    def objective(lp, ent, **_):
        seen.append(lp.requires_grad)
        return coef * lp

    with torch.no_grad():
        got = linear_ce.token_objective(
            d["x"], d["W"], d["t"], objective, linear_bias=d["b"], options=CHUNK
        )
    lp, valid = _plain_logprob(d["x"], d["W"], d["b"], d["t"])
    want = coef.detach() * lp[valid].sum()
    assert len(seen) > 1 and not any(seen)
    # Sums of ~15 log-probabilities of one sign, float64: a few eps.
    assert rel_err(got, want) <= 8 * eps(torch.float64)

    x, W, b = _leaves(d)
    got = linear_ce.token_objective(
        x, W, d["t"], lambda lp, ent, **_: coef.detach() * lp, linear_bias=b, options=CHUNK
    )
    got.backward()
    ref = _leaves(d)
    lp, valid = _plain_logprob(*ref, d["t"])
    (coef.detach() * lp[valid].sum()).backward()
    assert rel_err(got, want) <= 8 * eps(torch.float64)
    for mine, plain in zip((x, W, b), ref, strict=True):
        # Gradient sums over a few tokens of mixed signs, float64.
        assert rel_err(mine.grad, plain.grad) <= 32 * eps(torch.float64)


def test_a_learnable_factor_applied_outside_the_call_gets_its_gradient():
    """What the error recommends: ``coef * token_objective(...)`` differentiates ``coef``."""
    d = _data(3)
    coef, leaf = _captured("computed")
    x, W, b = _leaves(d)
    loss = coef * linear_ce.token_objective(
        x, W, d["t"], lambda lp, ent, **_: lp, linear_bias=b, options=CHUNK
    )
    got = torch.autograd.grad(loss, [leaf, x, W, b])
    ref = _leaves(d)
    ref_coef, ref_leaf = _captured("computed")
    lp, valid = _plain_logprob(*ref, d["t"])
    want = torch.autograd.grad(ref_coef * lp[valid].sum(), [ref_leaf, *ref])
    for mine, plain in zip(got, want, strict=True):
        # One sum of ~15 log-probabilities and its gradient, float64.
        assert rel_err(mine, plain) <= 32 * eps(torch.float64)


# Item 2: differentiating a statistic of token_logprobs.


@pytest.mark.parametrize("statistic", STATISTICS)
@pytest.mark.parametrize("alone", [True, False])
def test_differentiating_a_statistic_is_an_error(statistic, alone):
    d = _data(4)
    x, W, b = _leaves(d)
    out = linear_ce.token_logprobs(
        x, W, d["t"], linear_bias=b, entropy=True, options=CHUNK, **{statistic: True}
    )
    loss = 1000 * getattr(out, statistic).sum()
    if not alone:
        loss = loss + out.logprob.sum() + out.entropy.sum()
    with pytest.raises(RuntimeError, match=f"token_logprobs: {statistic} is a statistic without"):
        loss.backward()
    assert x.grad is None and W.grad is None and b.grad is None


def test_an_undifferentiated_statistic_leaves_the_gradients_exact():
    d = _data(5)
    x, W, b = _leaves(d)
    out = linear_ce.token_logprobs(
        x, W, d["t"], linear_bias=b, log_sum_sq_prob=True, mean_logit=True, options=CHUNK
    )
    out.logprob.sum().backward()
    ref = _leaves(d)
    lp, valid = _plain_logprob(*ref, d["t"])
    lp[valid].sum().backward()
    for mine, plain in zip((x, W, b), ref, strict=True):
        # Gradient sums over ~15 tokens of mixed signs, float64.
        assert rel_err(mine.grad, plain.grad) <= 32 * eps(torch.float64)


def test_compiled_statistics_are_checked_when_the_backward_runs():
    """A compiled graph gives every output a gradient (zeros if unused): returning a
    statistic is fine, adding it to the loss is the same error as eagerly."""
    d = _data(6, torch.float32)
    t = d["t"]

    def step(x, W):
        out = linear_ce.token_logprobs(x, W, t, log_sum_sq_prob=True, mean_logit=True)
        return out.logprob, out.log_sum_sq_prob, out.mean_logit

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x, W = (d[k].clone().requires_grad_() for k in ("x", "W"))
    lp = compiled(x, W)[0]
    lp.sum().backward()
    ref_x, ref_W = (d[k].clone().requires_grad_() for k in ("x", "W"))
    step(ref_x, ref_W)[0].sum().backward()
    for mine, eager in ((lp, step(d["x"], d["W"])[0]), (x.grad, ref_x.grad), (W.grad, ref_W.grad)):
        # The same op compiled and eager; fp32 GEMMs may block differently: a few eps.
        assert rel_err(mine, eager) <= 3 * eps(torch.float32)
    for index, statistic in ((1, "log_sum_sq_prob"), (2, "mean_logit")):
        outs = compiled(*(d[k].clone().requires_grad_() for k in ("x", "W")))
        with pytest.raises(RuntimeError, match=f"token_logprobs: {statistic} is a statistic"):
            (outs[0].sum() + 1000 * outs[index].sum()).backward()


# Item 3: NaN follows the loss's policy.


def _objective_case(d, where: str) -> dict[str, torch.Tensor]:
    """The inputs with one NaN: in a valid token's hidden state, or in its advantage (a
    GRPO group whose reward spread is zero), or none (the objective makes one itself)."""
    d = {k: v.clone() for k, v in d.items()}
    valid = (d["t"] != -100).double()
    d["weight"] = valid / valid.sum()
    if where == "hidden":
        d["x"][1, 4, 3] = float("nan")
    elif where == "advantage":
        d["adv"][0, 6] = float("nan")
    return d


def _sqrt_objective(lp, ent, **side):
    # log p < 0: the square root is NaN for every token, as is its gradient.
    return torch.sqrt(lp) * side["weight"]


@pytest.mark.parametrize("where", ["hidden", "advantage", "objective"])
def test_nan_reaches_what_it_reaches_in_plain_autograd(where):
    d = _objective_case(_data(7), where)
    objective = _sqrt_objective if where == "objective" else _policy_objective
    side = {"old_logprob": d["old"], "advantage": d["adv"], "weight": d["weight"]}
    x, W, b = _leaves(d)
    loss = linear_ce.token_objective(x, W, d["t"], objective, linear_bias=b, options=CHUNK, **side)
    got = [loss, *torch.autograd.grad(loss, [x, W, b])]
    with torch.no_grad():
        unrecorded = linear_ce.token_objective(
            d["x"], d["W"], d["t"], objective, linear_bias=d["b"], options=CHUNK, **side
        )

    ref = _leaves(d)
    lp, valid = _plain_logprob(*ref, d["t"])
    # The objective sees the valid tokens only, as token_objective documents.
    plain_loss = objective(lp[valid], None, **{k: v[valid] for k, v in side.items()}).sum()
    want = [plain_loss, *torch.autograd.grad(plain_loss, ref)]
    assert torch.isnan(plain_loss) and torch.isnan(unrecorded)
    if where != "objective":
        # The NaN token's row of grad_input; every class's gradient sums over it.
        assert not torch.isnan(want[1]).all()
    for mine, plain in zip(got, want, strict=True):
        assert torch.equal(torch.isnan(mine), torch.isnan(plain))
        finite = ~torch.isnan(plain)
        if finite.any():
            # The other rows, float64 sums of a few tokens: a few eps.
            assert rel_err(mine[finite], plain[finite]) <= 32 * eps(torch.float64)


def test_nan_in_an_ignored_token_touches_nothing():
    """An ignored token takes part in no GEMM: a NaN in its hidden state reaches neither
    the loss nor any gradient (plain autograd, which forms every row's log-softmax, would
    spread it to the whole weight gradient). Reference: the plain formula on the valid
    rows alone."""
    d = _objective_case(_data(10), "none")
    d["x"][0, 2, 1] = float("nan")
    assert d["t"][0, 2] == -100
    side = {"old_logprob": d["old"], "advantage": d["adv"], "weight": d["weight"]}
    x, W, b = _leaves(d)
    loss = linear_ce.token_objective(
        x, W, d["t"], _policy_objective, linear_bias=b, options=CHUNK, **side
    )
    got = [loss, *torch.autograd.grad(loss, [x, W, b])]
    ref = _leaves(d)
    valid = d["t"] != -100
    lp, _ = _plain_logprob(ref[0][valid], ref[1], ref[2], d["t"][valid])
    plain_loss = _policy_objective(lp, None, **{k: v[valid] for k, v in side.items()}).sum()
    want = [plain_loss, *torch.autograd.grad(plain_loss, ref)]
    for mine, plain in zip(got, want, strict=True):
        assert not torch.isnan(mine).any()
        # Sums over ~15 tokens of mixed signs, float64.
        assert rel_err(mine, plain) <= 32 * eps(torch.float64)


def test_the_objective_head_reads_nothing_back_per_chunk(monkeypatch):
    """What the head does per chunk (the objective, its autograd, the gradients it hands
    on) reads no tensor's value on the host (``bool``, ``item``, ``tolist``...): on a GPU
    each read would wait for the device once per chunk. The row chunking reads the
    validity mask on the host once per call; that is not the head's."""
    d = _objective_case(_data(8), "none")
    side = {"old_logprob": d["old"], "advantage": d["adv"], "weight": d["weight"]}
    inside, reads = [False], []
    for method in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, method)

        def counted(self, *args, _real=real, _method=method):
            if inside[0]:
                reads.append(_method)
            return _real(self, *args)

        monkeypatch.setattr(torch.Tensor, method, counted)
    real_rows_done = ObjectiveHead.rows_done

    def rows_done(self, *args):
        inside[0] = True
        try:
            real_rows_done(self, *args)
        finally:
            inside[0] = False

    monkeypatch.setattr(ObjectiveHead, "rows_done", rows_done)
    for rows_per_chunk in (2, 16):
        x, W, b = _leaves(d)
        linear_ce.token_objective(
            x,
            W,
            d["t"],
            _policy_objective,
            linear_bias=b,
            options=LinearCrossEntropyOptions(batch_chunk_size=rows_per_chunk),
            **side,
        ).backward()
    assert reads == []


# The vocab-parallel forms (gloo, 2 processes).


def _check_vocab_parallel(rank: int, world: int) -> list[str]:
    d = _data(9)
    sizes = [len(p) for p in torch.arange(V).tensor_split(world)]
    start = sum(sizes[:rank])
    shard = slice(start, start + sizes[rank])
    failures = []

    def local_leaves(case: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [
            case["x"].clone().requires_grad_(),
            case["W"][shard].clone().requires_grad_(),
            case["b"][shard].clone().requires_grad_(),
        ]

    for statistic in STATISTICS:
        x, W, b = local_leaves(d)
        out = linear_ce.token_logprobs(
            x,
            W,
            d["t"],
            linear_bias=b,
            options=CHUNK,
            **{statistic: True},
            vocab_parallel=VocabParallel(),
        )
        try:
            (out.logprob.sum() + 1000 * getattr(out, statistic).sum()).backward()
            failures.append(f"rank {rank}: differentiating {statistic} raised nothing")
        except RuntimeError as error:
            if f"token_logprobs: {statistic} is a statistic" not in str(error):
                failures.append(f"rank {rank}: {statistic}: {error}")

    x, W, b = local_leaves(d)
    out = linear_ce.token_logprobs(
        x,
        W,
        d["t"],
        linear_bias=b,
        options=CHUNK,
        log_sum_sq_prob=True,
        mean_logit=True,
        vocab_parallel=VocabParallel(),
    )
    out.logprob.sum().backward()
    ref = _leaves(d)
    lp, valid = _plain_logprob(*ref, d["t"])
    lp[valid].sum().backward()
    for name, mine, plain in (
        ("grad_input", x.grad, ref[0].grad),
        ("grad_weight", W.grad, ref[1].grad[shard]),
        ("grad_bias", b.grad, ref[2].grad[shard]),
    ):
        # Gradient sums over ~15 tokens, float64, and one all_reduce of two shards.
        if not rel_err(mine, plain) <= 32 * eps(torch.float64):
            failures.append(f"rank {rank}: {name} {rel_err(mine, plain):.3g}")

    coef, _ = _captured("leaf")
    x, W, b = local_leaves(d)
    try:
        linear_ce.token_objective(
            x,
            W,
            d["t"],
            lambda lp, ent, **_: coef * lp,
            linear_bias=b,
            vocab_parallel=VocabParallel(),
        )
        failures.append(f"rank {rank}: an objective closing over coef was not refused")
    except ValueError as error:
        if "token_objective: objective's result depends on" not in str(error):
            failures.append(f"rank {rank}: closure: {error}")

    case = _objective_case(d, "advantage")
    side = {"old_logprob": case["old"], "advantage": case["adv"], "weight": case["weight"]}
    x, W, b = local_leaves(case)
    try:
        loss = linear_ce.token_objective(
            x,
            W,
            case["t"],
            _policy_objective,
            linear_bias=b,
            options=CHUNK,
            **side,
            vocab_parallel=VocabParallel(),
        )
        got = [loss, *torch.autograd.grad(loss, [x, W, b])]
    except Exception as error:  # reported to the parent process
        return [*failures, f"rank {rank}: NaN advantage: {type(error).__name__}: {error}"]
    ref = _leaves(case)
    lp, valid = _plain_logprob(*ref, case["t"])
    plain_loss = _policy_objective(lp[valid], None, **{k: v[valid] for k, v in side.items()}).sum()
    want = torch.autograd.grad(plain_loss, ref)
    want = [plain_loss, want[0], want[1][shard], want[2][shard]]
    for name, mine, plain in zip(
        ("loss", "grad_input", "grad_weight", "grad_bias"), got, want, strict=True
    ):
        if not torch.equal(torch.isnan(mine), torch.isnan(plain)):
            failures.append(f"rank {rank}: NaN advantage: {name}'s NaN pattern differs")
    return failures


def _worker(rank: int, world: int, folder: str) -> None:
    run_gloo_rank(rank, world, folder, lambda: _check_vocab_parallel(rank, world))


def test_vocab_parallel_forms_refuse_and_propagate_the_same(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    failures = [
        f for r in range(world) for f in json.loads((tmp_path / f"rank{r}.json").read_text())
    ]
    assert not failures, failures
