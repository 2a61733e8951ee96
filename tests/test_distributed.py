"""Vocab-parallel linear cross-entropy (``linear_cross_entropy(..., vocab_parallel=)``,
``linear_ce.distributed``) over gloo on loopback.

Each multi-process test spawns its ranks once; every rank loops over many
cases, builds the same full inputs from a seed, runs its shard, and checks its
loss and gradients against (a) a float64 plain formula written here and (b)
the single-process ``linear_ce.linear_cross_entropy`` on the full weight.
Failures are collected per case so the ranks' collectives stay in step, and
written to a file per rank that the tests read; an exception in a rank makes
``torch.multiprocessing.spawn`` re-raise it here.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import linear_ce
from conftest import eps, leave_gloo_group, rel_err, run_gloo_rank
from linear_ce import VocabParallel

IGNORE = -100
DIST_TOL = 1e-5  # the bound against the single-process result (fp32)


# ----------------------------------------------------------------------------- the cases


def _case(name: str, **kw) -> dict:
    base = dict(
        name=name,
        rows=(48,),
        features=24,
        positions=None,
        reduction="mean",
        bias=False,
        class_weight=False,
        ignore=False,
        ignore_index=None,
        smoothing=0.0,
        z_loss=0.0,
        softcap=None,
        token_weight=False,
        prob=False,
        shift=False,
        chunk=16,
        layout="gathered",
        masked=False,
    )
    base.update(kw)
    return base


CASES = [
    _case("mean_ignored_rows", bias=True, ignore=True),
    _case(
        "sum_class_weights_custom_ignore",
        reduction="sum",
        class_weight=True,
        ignore=True,
        ignore_index=3,
        layout="lopsided",
    ),
    _case(
        "none_smoothing_weights",
        reduction="none",
        class_weight=True,
        ignore=True,
        smoothing=0.1,
        bias=True,
    ),
    _case(
        "mean_all_extras",
        class_weight=True,
        ignore=True,
        smoothing=0.2,
        z_loss=1e-2,
        softcap=4.0,
        token_weight=True,
        bias=True,
    ),
    _case("sum_prob_targets", reduction="sum", prob=True, smoothing=0.1, class_weight=True),
    _case(
        "none_k_dim_z_loss",
        reduction="none",
        positions=2,
        z_loss=1e-2,
        bias=True,
        layout="explicit",
    ),
    _case("sum_shift_softcap", rows=(2, 12), reduction="sum", shift=True, softcap=3.0),
    _case("sum_k_dim_ignored", reduction="sum", positions=2, ignore=True, class_weight=True),
    _case("mean_default_options", chunk=None, smoothing=0.05, ignore=True),
    # A -inf logit (a masked class) first in every shard: rows whose target another shard
    # holds must not read it as their target logit (-inf * 0 was NaN).
    _case("mean_masked_shard_starts", bias=True, ignore=True, masked=True),
]


def _num_classes(world: int) -> int:
    return {1: 37, 2: 101, 4: 1001}[world]


def _split(num_classes: int, world: int, layout: str) -> list[int]:
    """Shard sizes in rank order: torch's uneven tensor_split, or a lopsided one."""
    if layout != "lopsided":
        return [len(part) for part in torch.arange(num_classes).tensor_split(world)]
    sizes = [1] * world
    sizes[0] = num_classes - (world - 1)
    if world > 2:
        sizes[0], sizes[1] = num_classes // 2, num_classes - num_classes // 2 - (world - 2)
    return sizes


def _inputs(case: dict, index: int, num_classes: int) -> dict:
    """The full (unsharded) inputs of a case, identical on every rank."""
    g = torch.Generator().manual_seed(1000 + index)
    rows, feat, pos = case["rows"], case["features"], case["positions"]
    w_shape = (num_classes, feat) if pos is None else (num_classes, pos, feat)
    loss_shape = rows if pos is None else (*rows, pos)
    x = torch.randn(*rows, feat, generator=g)
    W = torch.randn(*w_shape, generator=g) / feat**0.5 * 3.0
    b = torch.randn(w_shape[:-1], generator=g) if case["bias"] else None
    cw = torch.rand(num_classes, generator=g) + 0.25 if case["class_weight"] else None
    if case["prob"]:
        t = torch.randn(*rows, num_classes, generator=g).softmax(dim=-1)
    else:
        t = torch.randint(0, num_classes, loss_shape, generator=g)
        ignore_index = IGNORE if case["ignore_index"] is None else case["ignore_index"]
        if case["ignore"]:
            t.view(-1)[::5] = ignore_index
    tw = torch.rand(loss_shape, generator=g) + 0.5 if case["token_weight"] else None
    grad_out = (
        torch.randn(loss_shape, generator=g) if case["reduction"] == "none" else torch.tensor(0.7)
    )
    return dict(x=x, W=W, b=b, cw=cw, t=t, tw=tw, grad_out=grad_out)


def _kwargs(case: dict) -> dict:
    return dict(
        reduction=case["reduction"],
        ignore_index=case["ignore_index"],
        label_smoothing=case["smoothing"],
        z_loss=case["z_loss"],
        softcap=case["softcap"],
        shift=case["shift"],
        options=None
        if case["chunk"] is None
        else linear_ce.LinearCrossEntropyOptions(batch_chunk_size=case["chunk"]),
    )


# ----------------------------------------------------------------------------- the reference


def _plain(case: dict, x, W, b, t, cw, tw):
    """cross_entropy(linear(x, W, b), t) + z-loss, written out on the full logits."""
    # (*, V) for a (V, F) weight; (N, V, P) for a K-dimensional (V, P, F) one.
    logits = (
        torch.einsum("...f,vf->...v", x, W) if W.dim() == 2 else torch.einsum("nf,vpf->nvp", x, W)
    )
    if b is not None:
        logits = logits + b
    if case["softcap"] is not None:
        c = case["softcap"]
        logits = c * torch.tanh(logits / c)
    ignore_index = IGNORE if case["ignore_index"] is None else case["ignore_index"]
    if case["shift"]:
        t = torch.cat([t[:, 1:], torch.full_like(t[:, :1], ignore_index)], dim=1)
    if logits.dim() == 3 and case["positions"] is None:
        logits = logits.flatten(0, 1)
        t = t.flatten(0, 1)
        tw = None if tw is None else tw.flatten()
    ce = F.cross_entropy(
        logits,
        t,
        weight=cw,
        ignore_index=ignore_index,
        label_smoothing=case["smoothing"],
        reduction="none",
    )
    lse = torch.logsumexp(logits, dim=1)
    if case["prob"]:
        omega = torch.ones_like(ce)
    else:
        valid = t != ignore_index
        w_t = torch.ones_like(ce) if cw is None else cw[torch.where(valid, t, 0)]
        omega = torch.where(valid, w_t, 0.0)
    per_row = ce + case["z_loss"] * omega * lse.square()
    if tw is not None:
        per_row = per_row * tw
    if case["reduction"] == "mean":
        return per_row.sum() / omega.sum()
    if case["reduction"] == "sum":
        return per_row.sum()
    return per_row.reshape(case["rows"] if case["positions"] is None else (*case["rows"], -1))


def _loss_and_grads(fn, case, inp, W, b, dtype):
    """Loss and (input, weight, bias) gradients of fn for the given full/shard tensors."""
    x = inp["x"].to(dtype).requires_grad_()
    W = W.to(dtype).detach().requires_grad_()
    b = None if b is None else b.to(dtype).detach().requires_grad_()
    cw = None if inp["cw"] is None else inp["cw"].to(dtype)
    t = inp["t"].to(dtype) if case["prob"] else inp["t"]
    tw = None if inp["tw"] is None else inp["tw"].to(dtype)
    loss = fn(x, W, b, t, cw, tw)
    wrt = [x, W] + ([b] if b is not None else [])
    grads = torch.autograd.grad(loss, wrt, inp["grad_out"].to(dtype))
    return loss.detach(), list(grads)


def _run_case(case: dict, index: int, rank: int, world: int) -> list[str]:
    num_classes = _num_classes(world)
    inp = _inputs(case, index, num_classes)
    sizes = _split(num_classes, world, case["layout"])
    start, size = sum(sizes[:rank]), sizes[rank]
    rows_of = slice(start, start + size)
    if case["masked"]:
        starts = torch.tensor([sum(sizes[:k]) for k in range(world)])
        inp["b"][starts] = -torch.inf
        t = inp["t"]
        t[torch.isin(t, starts)] += 1
    kw = _kwargs(case)
    layout = (
        {} if case["layout"] == "gathered" else dict(vocab_start=start, num_classes=num_classes)
    )

    def sharded(x, W, b, t, cw, tw):
        out = linear_ce.linear_cross_entropy(
            x,
            W,
            t,
            linear_bias=b,
            weight=cw,
            token_weight=tw,
            return_z_loss=True,
            return_lse=True,
            vocab_parallel=VocabParallel(**layout),
            **kw,
        )
        sharded.extras = out
        return out.loss

    def single(x, W, b, t, cw, tw):
        out = linear_ce.linear_cross_entropy(
            x,
            W,
            t,
            linear_bias=b,
            weight=cw,
            token_weight=tw,
            return_z_loss=True,
            return_lse=True,
            **kw,
        )
        single.extras = out
        return out.loss

    def plain(x, W, b, t, cw, tw):
        return _plain(case, x, W, b, t, cw, tw)

    shard_b = None if inp["b"] is None else inp["b"][rows_of]
    got, got_g = _loss_and_grads(sharded, case, inp, inp["W"][rows_of], shard_b, torch.float32)
    one, one_g = _loss_and_grads(single, case, inp, inp["W"], inp["b"], torch.float32)
    ref, ref_g = _loss_and_grads(plain, case, inp, inp["W"], inp["b"], torch.float64)
    p32, p32_g = _loss_and_grads(plain, case, inp, inp["W"], inp["b"], torch.float32)
    # The full-W gradients of weight and bias, restricted to this rank's rows.
    for grads in (one_g, ref_g, p32_g):
        grads[1:] = [g[rows_of] for g in grads[1:]]

    failures = []
    names = ["loss", "grad_input", "grad_weight_shard", "grad_bias_shard"][: 1 + len(got_g)]
    results = zip(names, [got, *got_g], [one, *one_g], [ref, *ref_g], [p32, *p32_g], strict=True)
    for name, g, o, r, p in results:
        vs_single = rel_err(g, o)
        vs_plain = rel_err(g, r)
        bound = max(3 * eps(torch.float32), 2 * rel_err(p, r))
        if not vs_single <= DIST_TOL:
            failures.append(
                f"{case['name']} rank {rank}/{world}: {name} vs single-process "
                f"{vs_single:.2e} > {DIST_TOL}"
            )
        if not vs_plain <= bound:
            failures.append(
                f"{case['name']} rank {rank}/{world}: {name} vs float64 plain "
                f"{vs_plain:.2e} > {bound:.2e}"
            )
    for name in ("z_loss", "lse"):
        err = rel_err(getattr(sharded.extras, name), getattr(single.extras, name))
        if not err <= DIST_TOL:
            failures.append(f"{case['name']} rank {rank}/{world}: {name} {err:.2e} > {DIST_TOL}")

    # Every rank must report bit-identical losses.
    mine = got.reshape(-1).contiguous()
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if not all(torch.equal(e, every[0]) for e in every):
        failures.append(f"{case['name']} rank {rank}/{world}: losses differ between ranks")
    return failures


# ----------------------------------------------------------------------------- counting


def _count_collectives(rank: int, world: int) -> list[str]:
    """Wrap all_reduce / all_gather and compare with the documented numbers."""
    num_classes = _num_classes(world)
    sizes = _split(num_classes, world, "gathered")
    start, size = sum(sizes[:rank]), sizes[rank]
    rows, features, positions, chunk = 40, 8, 2, 16
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, features, generator=g, requires_grad=True)
    W = torch.randn(num_classes, positions, features, generator=g)
    shard = W[start : start + size].clone().requires_grad_()
    t = torch.randint(0, num_classes, (rows, positions), generator=g)
    # Ignored rows are in no chunk: 20 valid rows at position 0 (2 chunks instead of 3),
    # 37 at position 1 (still 3).
    t[:20, 0] = -100
    t[::13, 1] = -100
    valid_rows = (t != -100).sum(0).tolist()
    chunks_per_position = [-(-v // chunk) for v in valid_rows]
    assert chunks_per_position == [2, 3]
    chunks = sum(chunks_per_position)
    options = linear_ce.LinearCrossEntropyOptions(batch_chunk_size=chunk)

    calls: list[tuple[str, object, int]] = []
    real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(("all_reduce", op, tensor.numel()))
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        calls.append(("all_gather", None, tensor.numel()))
        return real_all_gather(tensor_list, tensor, group=group, async_op=async_op)

    def counted(fn):
        calls.clear()
        fn()
        reduces = [c for c in calls if c[0] == "all_reduce"]
        return (
            len(reduces),
            sum(c[1] == dist.ReduceOp.MAX for c in reduces),
            sum(c[0] == "all_gather" for c in calls),
            sum(c[2] == rows * features for c in reduces),
        )

    per_pass = 2 * chunks
    state = {}

    def forward(reduction, layout, input_grad=True):
        def go():
            state["loss"] = linear_ce.linear_cross_entropy(
                x if input_grad else x.detach(),
                shard,
                t,
                reduction=reduction,
                options=options,
                vocab_parallel=VocabParallel(**layout),
            )

        return go

    def backward():
        state["loss"].sum().backward()

    explicit = dict(vocab_start=start, num_classes=num_classes)
    # (what, measured, expected (all_reduce, of which MAX, all_gather, of size N·F))
    checks = []
    dist.all_reduce, dist.all_gather = all_reduce, all_gather
    try:
        checks.append(
            (
                "mean forward",
                counted(forward("mean", explicit)),
                (per_pass + 1, chunks, 0, 1),
            )
        )
        checks.append(("mean backward", counted(backward), (0, 0, 0, 0)))
        checks.append(
            (
                "sum, input without grad",
                counted(forward("sum", explicit, False)),
                (per_pass, chunks, 0, 0),
            )
        )
        checks.append(
            (
                "none forward, gathered layout",
                counted(forward("none", {})),
                (per_pass, chunks, 1, 0),
            )
        )
        checks.append(("none backward", counted(backward), (per_pass + 1, chunks, 0, 1)))
    finally:
        dist.all_reduce, dist.all_gather = real_all_reduce, real_all_gather
    return [
        f"rank {rank}/{world}: {what}: (all_reduce, MAX, all_gather, N·F-sized) = {got}, "
        f"documented {want}"
        for what, got, want in checks
        if got != want
    ]


# ----------------------------------------------------------------------------- the workers


def _worker(rank: int, world: int, folder: str) -> None:
    """Run every case and the collective count on one rank; write the failures found."""

    def check():
        return {
            "cases": [f for i, case in enumerate(CASES) for f in _run_case(case, i, rank, world)],
            "count": _count_collectives(rank, world),
        }

    run_gloo_rank(rank, world, folder, check)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda world: f"world{world}")
def failures(request, tmp_path_factory) -> dict[str, list[str]]:
    """One spawned run per world size (process start-up dominates), shared by the tests."""
    world = request.param
    folder = tmp_path_factory.mktemp(f"world{world}")
    mp.spawn(_worker, args=(world, str(folder)), nprocs=world, join=True)
    merged: dict[str, list[str]] = {"cases": [], "count": []}
    for rank in range(world):
        found = json.loads((folder / f"rank{rank}.json").read_text())
        for task, messages in found.items():
            merged[task].extend(messages)
    return merged


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_matches_single_process_and_float64(failures):
    """Loss, z-loss, lse and gradients equal the full-weight results on every rank,
    and the loss is bit-identical across ranks."""
    assert failures["cases"] == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_collective_count_is_documented(failures):
    """2 all_reduce per chunk and position (MAX, fused SUM), +1 of grad_input per call,
    +1 all_gather of the shard sizes when the layout is not given."""
    assert failures["count"] == []


# ----------------------------------------------------------------------------- in-process checks


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A one-process gloo group, torn down afterwards."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        leave_gloo_group()


def test_single_rank_equals_linear_cross_entropy(one_rank):
    """With one rank the shard is the full weight: results match the float64 formula."""
    case = _case("one", class_weight=True, ignore=True, smoothing=0.1, z_loss=1e-3, bias=True)
    assert _run_case(case, 0, 0, 1) == []


def test_requires_initialised_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        linear_ce.linear_cross_entropy(
            torch.randn(4, 3),
            torch.randn(5, 3),
            torch.randint(0, 5, (4,)),
            vocab_parallel=VocabParallel(),
        )


def test_rejects_dtensor(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    W = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"vocab_parallel is given with DTensor.*\.to_local\(\)"):
        linear_ce.linear_cross_entropy(
            torch.randn(4, 3), W, torch.randint(0, 5, (4,)), vocab_parallel=VocabParallel()
        )


def test_a_shard_outside_the_vocabulary(one_rank):
    with pytest.raises(ValueError, match=r"\[3, 8\) does not lie in \[0, num_classes=7\)"):
        linear_ce.linear_cross_entropy(
            torch.randn(4, 3),
            torch.randn(5, 3),
            torch.randint(0, 5, (4,)),
            vocab_parallel=VocabParallel(None, 3, 7),
        )


def test_targets_and_class_weights_use_the_whole_vocabulary(one_rank):
    x, shard = torch.randn(4, 3), torch.randn(5, 3)
    layout = VocabParallel(None, 0, 9)
    with pytest.raises(ValueError, match="class index 9, outside \\[0, 9\\)"):
        linear_ce.linear_cross_entropy(x, shard, torch.tensor([0, 9, 1, 2]), vocab_parallel=layout)
    with pytest.raises(ValueError, match=r"weight \(class weights\) must have shape \(9,\)"):
        linear_ce.linear_cross_entropy(
            x, shard, torch.tensor([0, 8, 1, 2]), weight=torch.ones(5), vocab_parallel=layout
        )
    with pytest.raises(ValueError, match=r"linear_bias must have shape \(5,\)"):
        linear_ce.linear_cross_entropy(
            x, shard, torch.tensor([0, 8, 1, 2]), linear_bias=torch.ones(9), vocab_parallel=layout
        )
