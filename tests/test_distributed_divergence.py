"""Vocab-parallel ``linear_divergence`` over gloo on loopback, 2 and 4 processes.

Every rank builds the same full inputs, runs its (uneven) shards of both heads with
every divergence, reduction and the hard-label term, and compares the loss and the
student's gradients with the single-process ``linear_ce.linear_divergence`` on the full
heads (itself checked against float64 in ``test_divergence``).
"""

from __future__ import annotations

import json

import pytest
import torch
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
    g = torch.Generator().manual_seed(5)
    V = {2: 101, 4: 1001}[world]
    xs, xt = torch.randn(2, 19, 16, generator=g), torch.randn(2, 19, 12, generator=g)
    ws, wt = torch.randn(V, 16, generator=g) / 2, torch.randn(V, 12, generator=g) / 2
    bs, bt = torch.randn(V, generator=g), torch.randn(V, generator=g)
    t = torch.randint(0, V, (2, 19), generator=g)
    t[1, 4:11] = -100
    sizes = [len(p) for p in torch.arange(V).tensor_split(world)]
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    options = linear_ce.LinearCrossEntropyOptions(batch_chunk_size=8)
    failures = []
    cases = [
        dict(beta=0.0, reduction="mean", hard_weight=0.5),
        dict(beta=1.0, reduction="sum", temperature=0.7, student_softcap=3.0),
        dict(beta=0.5, reduction="none", hard_weight=0.2, temperature=1.5, shift=True),
        dict(beta=0.0, reduction="mean", return_entropy=True),
    ]
    for kw in cases:
        up = torch.randn(2, 19, generator=g) if kw["reduction"] == "none" else None
        leaves = [
            xs.clone().requires_grad_(),
            ws[mine].clone().requires_grad_(),
            bs[mine].clone().requires_grad_(),
        ]
        out = linear_ce.linear_divergence(
            leaves[0],
            leaves[1],
            xt,
            wt[mine],
            t,
            student_bias=leaves[2],
            teacher_bias=bt[mine],
            options=options,
            **kw,
            vocab_parallel=VocabParallel(),
        )
        full = [v.clone().requires_grad_() for v in (xs, ws, bs)]
        ref = linear_ce.linear_divergence(
            full[0],
            full[1],
            xt,
            wt,
            t,
            student_bias=full[2],
            teacher_bias=bt,
            options=options,
            **kw,
        )
        pairs = {}
        if kw.get("return_entropy"):
            (out, pairs["entropy"]), (ref, ref_entropy) = out, ref
            pairs["entropy"] = (pairs["entropy"], ref_entropy)
        (out if up is None else out * up).sum().backward()
        (ref if up is None else ref * up).sum().backward()
        pairs |= {
            "loss": (out, ref),
            "grad_input": (leaves[0].grad, full[0].grad),
            "grad_weight": (leaves[1].grad, full[1].grad[mine]),
            "grad_bias": (leaves[2].grad, full[2].grad[mine]),
        }
        for name, (got, want) in pairs.items():
            if not _rel(got, want) <= TOL:
                failures.append(f"rank {rank}/{world} {kw} {name}: {_rel(got, want):.3g}")
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
