"""Vocab-parallel top-k log-probabilities and sparse distillation over gloo on loopback,
2 and 4 processes.

``token_logprobs(topk=k, vocab_parallel=...)``: every rank's shard candidates merged (uneven
shards, k above some shard sizes, ties across shard boundaries, ignored rows), against
``torch.topk`` of the float64 log-softmax of the full logits written here.
``sparse_divergence(vocab_parallel=...)``: the teacher's support split across the shards,
against the single-process ``sparse_divergence`` on the full head (itself checked against
float64 in ``test_sparse_divergence``) and the float64 formula of the forward KL.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.multiprocessing as mp

import linear_ce
from conftest import run_gloo_rank
from linear_ce import VocabParallel

# fp32 against the single-process fp32 call: the same math summed in another order over
# the shards (a few eps of the accumulated row sums), well above a hair.
TOL = 1e-5


def _rel(got, ref):
    ref = ref.double()
    scale = ref.norm().item()
    diff = (got.double() - ref).norm().item()
    return diff / scale if scale > 0 else diff


def _check_topk(rank: int, world: int) -> list[str]:
    g = torch.Generator().manual_seed(21)
    V = {2: 61, 4: 103}[world]
    sizes = [len(p) for p in torch.arange(V).tensor_split(world)]
    sizes[0] += 3  # uneven
    sizes[-1] -= 3
    start = sum(sizes[:rank])
    k = sizes[-1] + 4  # more than the last shard holds: its candidates are padded
    # Integer-valued inputs (exact logits) with ties across every shard boundary.
    x = torch.randint(-2, 3, (37, 12), generator=g).float()
    W = torch.randint(-40, 41, (V, 12), generator=g).float() / 8
    for r in range(world - 1):
        bound = sum(sizes[: r + 1])
        W[bound] = W[bound - 1]
    b = torch.randint(-8, 9, (V,), generator=g).float() / 4
    t = torch.randint(0, V, (37,), generator=g)
    t[5:9] = -100
    valid = t != -100
    failures = []
    for transform in ({}, {"temperature": 0.5, "softcap": 6.0}):
        shard = slice(start, start + sizes[rank])
        out = linear_ce.token_logprobs(
            x,
            W[shard],
            t,
            linear_bias=b[shard],
            topk=k,
            options=linear_ce.LinearCrossEntropyOptions(batch_chunk_size=8),
            **transform,
            vocab_parallel=VocabParallel(),
        )
        s = x.double() @ W.double().T + b.double()
        if "softcap" in transform:
            s = transform["softcap"] * torch.tanh(s / transform["softcap"])
        s = s / transform.get("temperature", 1.0)
        ref64 = torch.log_softmax(s, -1)
        # The documented rule: descending, equal values by id (a stable sort of the row).
        order = ref64.sort(dim=-1, descending=True, stable=True)
        want_ids, want_values = order.indices[:, :k], order.values[:, :k]
        # Where the k-th value ties with the (k+1)-th, which tied class fills the last
        # slots is torch.topk's choice on each shard: compare the values and that each id
        # holds its value there, the ids everywhere else.
        boundary = order.values[:, k - 1] == order.values[:, k]
        name = f"rank {rank}/{world} {transform}"
        if not torch.equal(out.topk_ids[valid & ~boundary], want_ids[valid & ~boundary]):
            failures.append(f"{name}: ids differ from the stable float64 order")
        at = ref64.gather(-1, out.topk_ids.clamp(min=0))
        if _rel(out.topk_logprobs[valid], want_values[valid]) > 3e-7 * 4:
            failures.append(f"{name}: values {_rel(out.topk_logprobs[valid], want_values[valid])}")
        if _rel(at[valid], want_values[valid]) > 1e-12:
            failures.append(f"{name}: an id does not hold its value")
        if not (
            (out.topk_ids[~valid] == -1).all() and (out.topk_logprobs[~valid] == -math.inf).all()
        ):
            failures.append(f"{name}: ignored rows not empty slots")
        if (out.topk_ids[valid] < 0).any():
            failures.append(f"{name}: an empty slot among the classes")
        single = linear_ce.token_logprobs(x, W, t, linear_bias=b, topk=k, **transform)
        if _rel(out.topk_logprobs[valid], single.topk_logprobs[valid]) > TOL:
            failures.append(f"{name}: values differ from the single process")
    return failures


def _teacher_slots(g, rows, V, k):
    """Slots of a random float64 teacher: its top-k (some slots emptied), bf16 storage."""
    teacher = torch.log_softmax(torch.randn(rows, V, generator=g, dtype=torch.float64) * 2, -1)
    top = teacher.topk(k)
    ids, lp = top.indices.clone(), top.values.clone()
    ids[3, -2:] = -1
    lp[4, -1] = -math.inf
    return ids, lp.bfloat16()


def _check_sparse(rank: int, world: int) -> list[str]:
    g = torch.Generator().manual_seed(31)
    V = {2: 57, 4: 97}[world]
    sizes = [len(p) for p in torch.arange(V).tensor_split(world)]
    start = sum(sizes[:rank])
    shard = slice(start, start + sizes[rank])
    N, D, k = 29, 10, 20
    x = torch.randn(N, D, generator=g)
    W = torch.randn(V, D, generator=g) / 2
    b = torch.randn(V, generator=g) / 4
    ids, lp = _teacher_slots(g, N, V, k)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[7:10] = -100
    up = torch.randn(N, generator=g)
    failures = []
    cases = [
        dict(reduction="mean"),
        dict(reduction="none", beta=0.5, temperature=0.8, target_temperature=0.8),
        dict(reduction="sum", mass="rest", beta=1.0, hard_weight=0.3),
        dict(reduction="none", mass="rest", softcap=3.0),
    ]
    for kw in cases:
        xs, Ws, bs = (
            x.clone().requires_grad_(),
            W[shard].clone().requires_grad_(),
            b[shard].clone().requires_grad_(),
        )
        loss = linear_ce.sparse_divergence(
            xs,
            Ws,
            ids,
            lp,
            labels,
            linear_bias=bs,
            options=linear_ce.LinearCrossEntropyOptions(batch_chunk_size=8),
            **kw,
            vocab_parallel=VocabParallel(),
        )
        (loss * up if kw["reduction"] == "none" else loss).sum().backward()
        xr, Wr, br = (v.clone().requires_grad_() for v in (x, W, b))
        ref = linear_ce.sparse_divergence(xr, Wr, ids, lp, labels, linear_bias=br, **kw)
        (ref * up if kw["reduction"] == "none" else ref).sum().backward()
        pairs = {
            "loss": (loss, ref),
            "grad_input": (xs.grad, xr.grad),
            "grad_weight": (Ws.grad, Wr.grad[shard]),
            "grad_bias": (bs.grad, br.grad[shard]),
        }
        for name, (got, want) in pairs.items():
            if not _rel(got, want) <= TOL:
                failures.append(f"rank {rank}/{world} {kw} {name}: {_rel(got, want):.3g}")
    # The forward KL against the renormalised teacher, float64, written here.
    loss = linear_ce.sparse_divergence(
        x.double(),
        W[shard].double(),
        ids,
        lp,
        labels,
        reduction="none",
        vocab_parallel=VocabParallel(),
    )
    logp = torch.log_softmax(x.double() @ W.double().T, -1)
    filled = (ids >= 0) & (lp.double() > -math.inf)
    lq = torch.where(filled, lp.double(), -math.inf)
    lq = lq - torch.logsumexp(lq, -1, keepdim=True)
    term = torch.where(filled, lq.exp() * (lq - logp.gather(-1, ids.clamp(min=0))), 0.0)
    want = torch.where(labels != -100, term.sum(-1), 0.0)
    # float64 throughout: 3 eps of float64 over the row sums, with headroom for k terms.
    if _rel(loss, want) > 1e-13:
        failures.append(f"rank {rank}/{world} float64 forward KL: {_rel(loss, want):.3g}")
    bad = ids.clone()
    bad[0, 0] = V  # one past the whole vocabulary
    try:
        linear_ce.sparse_divergence(x, W[shard], bad, lp, labels, vocab_parallel=VocabParallel())
        failures.append(f"rank {rank}/{world}: an id of V passed")
    except ValueError as error:
        if "sparse_divergence: " not in str(error):
            failures.append(f"rank {rank}/{world}: error does not name the function: {error}")
    return failures


def _worker(rank: int, world: int, folder: str) -> None:
    run_gloo_rank(
        rank, world, folder, lambda: _check_topk(rank, world) + _check_sparse(rank, world)
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_topk_and_sparse_divergence_match(tmp_path, world):
    mp.spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    failures = [
        f for r in range(world) for f in json.loads((tmp_path / f"rank{r}.json").read_text())
    ]
    assert not failures, failures
