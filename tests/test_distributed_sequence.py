"""Vocab-parallel and DTensor ``sequence_objective`` over gloo on loopback, 2 and 4 processes.

One spawn per world size. Every rank builds the same full inputs from a seed and runs:
the vocab-parallel front on its (uneven) shard of the head, on the fused path (chunks of
whole pairs) and on the four-GEMM fallback (a chunk smaller than a pair), for DPO on a
padded batch and GSPO on packed sequences; and the DTensor forms: the head ``Shard(0)``
with a replicated input (vocab-parallel), and the input's batch ``Shard(0)`` with a
replicated head (each rank's rows hold their own chosen/rejected pairs). Each loss and
gradient is compared with the single-process ``linear_ce.sequence_objective`` on the full
tensors and with the float64 formula of ``tests/sequence_formula.py``. A split along the
sequence dimension must be refused on every rank. Failures are collected per check so the
ranks' collectives stay in step, written to a file per rank, and read here.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import linear_ce
import linear_ce.objectives as obj
import sequence_formula as formula
from conftest import eps, leave_gloo_group, rel_err, run_gloo_rank
from linear_ce import VocabParallel

# Against the single-process call on the same fp32 inputs: the shards change only the
# order of the row statistics' sums (~1e-7 relative), as tests/test_distributed.py.
TOL = 1e-5
B, T, F = 8, 7, 16  # 4 pairs of 7 tokens; 8 rows split evenly over 2 and 4 ranks
BETA = 0.3
FUSED = linear_ce.LinearCrossEntropyOptions(
    batch_chunk_size=16
)  # a pair (~10 scored tokens) per chunk
FALLBACK = linear_ce.LinearCrossEntropyOptions(batch_chunk_size=4)  # under one pair


def _inputs(world: int):
    g = torch.Generator().manual_seed(17)
    V = {2: 101, 4: 203}[world]  # neither divides evenly: uneven shards
    x = torch.randn(B, T, F, generator=g)
    W = torch.randn(V, F, generator=g) / F**0.5 * 2.0
    b = torch.randn(V, generator=g) / 4
    t = torch.randint(0, V, (B, T), generator=g)
    t[:, :2] = -100  # prompts
    t[1, 5:] = -100  # padding
    ref = torch.randn(B, generator=g) * 3 - 20
    adv = torch.randn(B, generator=g)
    return x, W, b, t, ref, adv


def _pair_ids(world: int) -> torch.Tensor:
    """Row i's pair when each rank's rows hold ``"pairs"`` of their own (chosen first)."""
    per_rank = B // world
    rank, j = torch.arange(B) // per_rank, torch.arange(B) % per_rank
    return rank * (per_rank // 2) + j % (per_rank // 2)


def _reference_dpo(x, W, b, t, ref, pair):
    """Float64 DPO sigmoid loss (mean over pairs) and its gradients, from the full logits."""
    x64, W64, b64 = (v.double().requires_grad_() for v in (x, W, b))
    ids = torch.arange(B)[:, None].expand(B, T)
    lp, _, scored = formula.token_terms(x64, W64, b64, t, ids, shift=1, temperature=0.9)
    L = formula.per_sequence(lp, ids, scored, B)
    chosen = torch.stack([L[pair == p][0] for p in range(B // 2)])
    rejected = torch.stack([L[pair == p][1] for p in range(B // 2)])
    rc = torch.stack([ref.double()[pair == p][0] for p in range(B // 2)])
    rr = torch.stack([ref.double()[pair == p][1] for p in range(B // 2)])
    loss = -torch.nn.functional.logsigmoid(BETA * ((chosen - rc) - (rejected - rr))).mean()
    loss.backward()
    return loss.detach(), L.detach(), x64.grad, W64.grad, b64.grad


def _compare(failures, tag, got: dict, single: dict, ref: dict, bounds: dict) -> None:
    for key, value in got.items():
        if rel_err(value, single[key]) > TOL:
            failures.append(f"{tag} {key} vs single process: {rel_err(value, single[key]):.3g}")
        if rel_err(value, ref[key]) > bounds[key]:
            failures.append(
                f"{tag} {key} vs float64: {rel_err(value, ref[key]):.3g} > {bounds[key]:.3g}"
            )


def _bounds(ref64: dict, plain32: dict) -> dict:
    """House rule: within 3 eps(fp32) of float64, or twice the plain fp32 expression's own
    error where that is larger (measured here on the same inputs)."""
    return {k: max(3 * eps(torch.float32), 2 * rel_err(plain32[k], ref64[k])) for k in ref64}


def _run(fn, x, W, b) -> dict:
    xs, Ws, bs = (v.clone().requires_grad_() for v in (x, W, b))
    out = fn(xs, Ws, bs)
    out.loss.backward()
    return dict(
        loss=out.loss.detach(), logprob_sum=out.logprob_sum, x=xs.grad, W=Ws.grad, b=bs.grad
    )


def _check_vocab_parallel(rank: int, world: int) -> list[str]:
    failures = []
    x, W, b, t, ref, adv = _inputs(world)
    V = W.shape[0]
    sizes = [len(p) for p in torch.arange(V).tensor_split(world)]
    start = sum(sizes[:rank])
    own = slice(start, start + sizes[rank])
    half = torch.arange(B) % (B // 2)  # one process's "pairs": row i with i + B/2

    loss64, L64, gx, gW, gb = _reference_dpo(x, W, b, t, ref, half)
    ref64 = dict(loss=loss64, logprob_sum=L64, x=gx, W=gW[own], b=gb[own])
    # The plain fp32 expression, for the house bound.
    x32, W32, b32 = (v.clone().requires_grad_() for v in (x, W, b))
    ids = torch.arange(B)[:, None].expand(B, T)
    lp, _, scored = formula.token_terms(x32, W32, b32, t, ids, shift=1, temperature=0.9)
    L32 = formula.per_sequence(lp, ids, scored, B)
    (lc, lr), (rc, rr) = formula.split(L32), formula.split(ref)
    loss32 = -torch.nn.functional.logsigmoid(BETA * ((lc - rc) - (lr - rr))).mean()
    loss32.backward()
    plain32 = dict(loss=loss32, logprob_sum=L32, x=x32.grad, W=W32.grad[own], b=b32.grad[own])
    bounds = _bounds(ref64, plain32)
    kw = dict(shift=True, group="pairs", temperature=0.9, ref_logprob=ref)

    for path, options in (("fused", FUSED), ("fallback", FALLBACK)):
        got = _run(
            lambda xs, Ws, bs, o=options: linear_ce.sequence_objective(
                xs,
                Ws,
                t,
                obj.dpo(BETA),
                linear_bias=bs,
                options=o,
                **kw,
                vocab_parallel=VocabParallel(),
            ),
            x,
            W[own],
            b[own],
        )
        single = _run(
            lambda xs, Ws, bs, o=options: linear_ce.sequence_objective(
                xs, Ws, t, obj.dpo(BETA), linear_bias=bs, options=o, **kw
            ),
            x,
            W,
            b,
        )
        single["W"], single["b"] = single["W"][own], single["b"][own]
        _compare(failures, f"rank {rank}/{world} dpo {path}", got, single, ref64, bounds)

    # GSPO on packed sequences (cu_seqlens), the shard placed by the caller (no gather).
    cu = torch.tensor([0, 9, 20, 31, 41, 56])
    packed_t = t.reshape(-1)[:56].clone()
    packed_x = x.reshape(-1, F)[:56]
    gspo = dict(cu_seqlens=cu, advantage=adv[:5], old_logprob=ref[:5] / 4)
    got = _run(
        lambda xs, Ws, bs: linear_ce.sequence_objective(
            xs,
            Ws,
            packed_t,
            obj.gspo(0.2, 0.3),
            linear_bias=bs,
            options=FUSED,
            **gspo,
            vocab_parallel=VocabParallel(None, start, V),
        ),
        packed_x,
        W[own],
        b[own],
    )
    single = _run(
        lambda xs, Ws, bs: linear_ce.sequence_objective(
            xs, Ws, packed_t, obj.gspo(0.2, 0.3), linear_bias=bs, options=FUSED, **gspo
        ),
        packed_x,
        W,
        b,
    )
    single["W"], single["b"] = single["W"][own], single["b"][own]
    for key, value in got.items():
        if rel_err(value, single[key]) > TOL:
            failures.append(f"rank {rank}/{world} gspo {key}: {rel_err(value, single[key]):.3g}")
    return failures


def _check_dtensor(rank: int, world: int) -> list[str]:
    failures = []
    mesh = init_device_mesh("cpu", (world,))
    x, W, b, t, ref, _ = _inputs(world)
    kw = dict(shift=True, temperature=0.9, options=FUSED)

    def on_mesh(x_placement, head_placement):
        """Loss, sums and the full gradients of a call with DTensor leaves."""
        xd = distribute_tensor(x, mesh, [x_placement]).requires_grad_()
        Wd = distribute_tensor(W, mesh, [head_placement]).requires_grad_()
        bd = distribute_tensor(b, mesh, [head_placement]).requires_grad_()
        out = linear_ce.sequence_objective(
            xd, Wd, t, obj.dpo(BETA), linear_bias=bd, group="pairs", ref_logprob=ref, **kw
        )
        out.loss.backward()
        placements = (out.loss.placements, out.logprob_sum.placements)
        if placements != ((Replicate(),), (x_placement,)):
            failures.append(f"rank {rank}/{world} output placements {placements}")
        return dict(
            x=xd.grad.full_tensor(),
            W=Wd.grad.full_tensor(),
            b=bd.grad.full_tensor(),
            loss=out.loss.full_tensor(),
            logprob_sum=out.logprob_sum.full_tensor(),
        )

    half = torch.arange(B) % (B // 2)
    cases = {
        # The head split along the vocabulary, the input replicated: vocab-parallel.
        "vocab split": (Replicate(), Shard(0), half),
        # The batch split, the head replicated: each rank's rows hold their own pairs.
        "batch split": (Shard(0), Replicate(), _pair_ids(world)),
    }
    for tag, (x_placement, head_placement, pairing) in cases.items():
        got = on_mesh(x_placement, head_placement)
        single = _run(
            lambda xs, Ws, bs, p=pairing: linear_ce.sequence_objective(
                xs, Ws, t, obj.dpo(BETA), linear_bias=bs, group=p, ref_logprob=ref, **kw
            ),
            x,
            W,
            b,
        )
        loss64, L64, gx, gW, gb = _reference_dpo(x, W, b, t, ref, pairing)
        ref64 = dict(loss=loss64, logprob_sum=L64, x=gx, W=gW, b=gb)
        for key, value in got.items():
            if rel_err(value, single[key]) > TOL:
                failures.append(
                    f"rank {rank}/{world} {tag} {key}: {rel_err(value, single[key]):.3g}"
                )
            # Against float64 the single-process call is held to the house bound in
            # test_sequence_objective; the mesh adds only the order of sums (as TOL).
            if rel_err(value, ref64[key]) > TOL:
                failures.append(
                    f"rank {rank}/{world} {tag} {key} vs float64: {rel_err(value, ref64[key]):.3g}"
                )

    # A split along the sequence dimension would score sequences in pieces: refused.
    xd = distribute_tensor(x, mesh, [Shard(1)])
    try:
        linear_ce.sequence_objective(xd, W, t, obj.dpo(BETA), group="pairs", ref_logprob=ref)
        failures.append(f"rank {rank}/{world} a sequence split was not refused")
    except ValueError as error:
        if "sequence_objective" not in str(error) or "cuts its sequences" not in str(error):
            failures.append(f"rank {rank}/{world} sequence split message: {error}")
    return failures


def _worker(rank: int, world: int, folder: str) -> None:
    run_gloo_rank(
        rank,
        world,
        folder,
        lambda: _check_vocab_parallel(rank, world) + _check_dtensor(rank, world),
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_objective_matches_single_process(tmp_path, world):
    mp.spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    failures = [
        f for r in range(world) for f in json.loads((tmp_path / f"rank{r}.json").read_text())
    ]
    assert not failures, failures


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def mesh(tmp_path, monkeypatch):
    """A one-rank gloo group and its 1-D CPU mesh, torn down afterwards."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        leave_gloo_group()


def test_split_packed_sequences_refused(mesh):
    x = distribute_tensor(torch.randn(12, 4), mesh, [Shard(0)])
    t = torch.randint(0, 5, (12,))
    with pytest.raises(ValueError, match=r"sequence_objective: input of shape \(12, 4\) .* cuts"):
        linear_ce.sequence_objective(
            x,
            torch.randn(5, 4),
            t,
            obj.gspo(),
            cu_seqlens=torch.tensor([0, 5, 12]),
            advantage=torch.ones(2),
        )
    x = distribute_tensor(torch.randn(2, 6, 4), mesh, [Shard(0)])
    ids = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]])
    with pytest.raises(ValueError, match=r"sequence_objective: .* while sequence lays out packed"):
        linear_ce.sequence_objective(
            x, torch.randn(5, 4), ids, obj.gspo(), sequence=ids, advantage=torch.ones(4)
        )


def test_split_batch_mean_of_unknown_objective_refused(mesh):
    x = distribute_tensor(torch.randn(2, 6, 4), mesh, [Shard(0)])
    t = torch.randint(0, 5, (2, 6))
    with pytest.raises(ValueError, match=r"sequence_objective: reduction='mean' .* per group"):
        linear_ce.sequence_objective(
            x, torch.randn(5, 4), t, lambda batch: -batch.logprob, group="pairs"
        )


def test_split_batch_mean_counts_sequences(mesh):
    """On one rank the split runs ``"sum"`` and divides by the counted losses: a
    per-sequence objective's mean over sequences, a per-pair one's over pairs."""
    g = torch.Generator().manual_seed(3)
    x, W = torch.randn(4, 6, 4, generator=g), torch.randn(7, 4, generator=g)
    t = torch.randint(0, 7, (4, 6), generator=g)
    adv, ref = torch.randn(4, generator=g), torch.randn(4, generator=g)
    xd = distribute_tensor(x, mesh, [Shard(0)])
    for objective, side in ((obj.gspo(), dict(advantage=adv)), (obj.dpo(), dict(ref_logprob=ref))):
        group = "pairs" if objective.group_size == 2 else None
        got = linear_ce.sequence_objective(xd, W, t, objective, group=group, **side).loss
        want = linear_ce.sequence_objective(x, W, t, objective, group=group, **side).loss
        # One rank: the same sums, divided once by the count instead of by the op.
        assert rel_err(got.full_tensor(), want) <= 4 * eps(torch.float32)
