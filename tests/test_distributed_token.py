"""Vocab-parallel ``token_logprobs`` over gloo on loopback, 2 and 4 processes.

Every rank builds the same full inputs, runs its (uneven) shard with logprob, entropy
and top-1 and a backward with upstream gradients on both, and compares with the
single-process ``linear_ce.token_logprobs`` on the full weight (itself checked against
float64 in ``test_token_logprobs``) and with the float64 plain expression. The backward
(the vocabulary pass on the forward's row statistics) makes one all_reduce, of
``grad_input``, as documented in docs/distributed.md.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import linear_ce
from conftest import run_gloo_rank
from linear_ce import VocabParallel

TOL = 1e-5


def _rel(got, ref):
    ref = ref.double()
    scale = ref.norm().item()
    diff = (got.double() - ref).norm().item()
    return diff / scale if scale > 0 else diff


def _check(rank: int, world: int) -> list[str]:
    g = torch.Generator().manual_seed(11)
    V = {2: 101, 4: 1001}[world]
    x = torch.randn(2, 23, 16, generator=g)
    W = torch.randn(V, 16, generator=g) / 2
    b = torch.randn(V, generator=g)
    t = torch.randint(0, V, (2, 23), generator=g)
    t[0, 3:9] = -100
    up_lp, up_h = torch.randn(2, 23, generator=g), torch.randn(2, 23, generator=g)
    sizes = [len(p) for p in torch.arange(V).tensor_split(world)]
    start = sum(sizes[:rank])
    kw = dict(
        shift=True,
        temperature=0.8,
        softcap=4.0,
        entropy=True,
        top1=True,
        log_sum_sq_prob=True,
        mean_logit=True,
    )
    options = linear_ce.LinearCrossEntropyOptions(batch_chunk_size=8)

    xs = x.clone().requires_grad_()
    Ws = W[start : start + sizes[rank]].clone().requires_grad_()
    bs = b[start : start + sizes[rank]].clone().requires_grad_()
    out = linear_ce.token_logprobs(
        xs, Ws, t, linear_bias=bs, options=options, **kw, vocab_parallel=VocabParallel()
    )
    reduced = _count_all_reduce(
        lambda: ((out.logprob * up_lp).sum() + (out.entropy * up_h).sum()).backward()
    )

    xr, Wr, br = (v.clone().requires_grad_() for v in (x, W, b))
    ref = linear_ce.token_logprobs(xr, Wr, t, linear_bias=br, options=options, **kw)
    ((ref.logprob * up_lp).sum() + (ref.entropy * up_h).sum()).backward()

    failures = []
    pairs = {
        "logprob": (out.logprob, ref.logprob),
        "entropy": (out.entropy, ref.entropy),
        "log_sum_sq_prob": (out.log_sum_sq_prob, ref.log_sum_sq_prob),
        "mean_logit": (out.mean_logit, ref.mean_logit),
        "grad_input": (xs.grad, xr.grad),
        "grad_weight": (Ws.grad, Wr.grad[start : start + sizes[rank]]),
        "grad_bias": (bs.grad, br.grad[start : start + sizes[rank]]),
    }
    for name, (got, want) in pairs.items():
        if not _rel(got, want) <= TOL:
            failures.append(f"rank {rank}/{world} {name}: {_rel(got, want):.3g}")
    if reduced != [xs.numel()]:
        failures.append(
            f"rank {rank}/{world} backward all_reduce sizes {reduced}, documented one of "
            f"grad_input ({xs.numel()})"
        )
    if not torch.equal(out.top1, ref.top1):
        failures.append(f"rank {rank}/{world} top1 differs")
    return failures + _check_ties(rank, world, sizes) + _check_masked_shard_starts(rank, world)


def _check_masked_shard_starts(rank: int, world: int) -> list[str]:
    """A -inf logit (a masked class) first in every shard: a token whose target another
    shard holds must not read it as its target logit (-inf * 0 was NaN)."""
    g = torch.Generator().manual_seed(12)
    V = {2: 101, 4: 1001}[world]
    x, W, b = torch.randn(30, 16, generator=g), torch.randn(V, 16, generator=g), torch.zeros(V)
    sizes = [len(p) for p in torch.arange(V).tensor_split(world)]
    starts = torch.tensor([sum(sizes[:k]) for k in range(world)])
    b[starts] = -torch.inf
    t = torch.randint(0, V, (30,), generator=g)
    t[torch.isin(t, starts)] += 1
    up = torch.randn(30, generator=g)
    shard = slice(starts[rank], starts[rank] + sizes[rank])
    xs, Ws = x.clone().requires_grad_(), W[shard].clone().requires_grad_()
    got = linear_ce.token_logprobs(
        xs, Ws, t, linear_bias=b[shard], vocab_parallel=VocabParallel()
    ).logprob
    (got * up).sum().backward()
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    want = linear_ce.token_logprobs(xr, Wr, t, linear_bias=b).logprob
    (want * up).sum().backward()
    pairs = {
        "logprob": (got, want),
        "grad_input": (xs.grad, xr.grad),
        "grad_weight": (Ws.grad, Wr.grad[shard]),
    }
    return [
        f"rank {rank}/{world} masked shard starts {name}: {_rel(a, w):.3g}"
        for name, (a, w) in pairs.items()
        if not _rel(a, w) <= TOL
    ]


def _count_all_reduce(fn) -> list[int]:
    """Sizes of the all_reduce calls ``fn`` makes."""
    sizes, real = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        fn()
    finally:
        dist.all_reduce = real
    return sizes


def _check_ties(rank: int, world: int, sizes: list[int]) -> list[str]:
    """Both top-1 rules where the maximum ties across a shard boundary: integer inputs
    make every logit exact, the class before and after each boundary are the same row."""
    g = torch.Generator().manual_seed(5)
    V = sum(sizes)
    W = torch.randint(-3, 4, (V, 16), generator=g).float()
    x = torch.randint(-2, 3, (40, 16), generator=g).float()
    bounds = [sum(sizes[: r + 1]) for r in range(world - 1)]
    for i, bound in enumerate(bounds):
        W[bound - 1] = W[bound] = 0
        x[4 * i : 4 * i + 4] = 0
        W[bound - 1, 0] = W[bound, 0] = 9.0
        x[4 * i : 4 * i + 4, 0] = 1.0
    t = torch.randint(0, V, (40,), generator=g)
    for i, bound in enumerate(bounds):
        t[4 * i : 4 * i + 4] = torch.tensor([bound - 1, bound, bound - 1, bound])
    start = sum(sizes[:rank])
    shard = W[start : start + sizes[rank]]
    s = x.double() @ W.double().T
    want = {
        "argmax": s.argmax(-1) == t,
        "unique": (s.argmax(-1) == t) & ((s == s.amax(-1, keepdim=True)).sum(-1) == 1),
    }
    failures = []
    for rule, expected in want.items():
        got = linear_ce.token_logprobs(
            x, shard, t, top1=True, top1_rule=rule, vocab_parallel=VocabParallel()
        ).top1
        if not torch.equal(got, expected):
            failures.append(f"rank {rank}/{world} top1_rule={rule} differs at ties")
    return failures


def _worker(rank: int, world: int, folder: str) -> None:
    run_gloo_rank(rank, world, folder, lambda: _check(rank, world))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process(tmp_path, world):
    mp.spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    failures = [
        f for r in range(world) for f in json.loads((tmp_path / f"rank{r}.json").read_text())
    ]
    assert not failures, failures
