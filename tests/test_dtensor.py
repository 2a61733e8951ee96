"""DTensor arguments (``linear_ce.parallel.dtensor``) over gloo on loopback, 2 and 4 processes.

One spawn per world size: every rank builds the same full inputs from a seed, lays them
out on a device mesh (the weight split along the vocabulary or replicated, the input
replicated, plain, or split along its batch or sequence dimension, uneven), and compares
the loss and gradients with (a) the single-process ``linear_ce`` call on the full tensors
and (b) a float64 plain expression written here. Failures are collected per check so the
ranks' collectives stay in step, and written to a file per rank that the tests read; an
exception in a rank makes ``torch.multiprocessing.spawn`` re-raise it here. The world-2
run also trains a tiny Llama under FSDP2 with the transformers patch, follows the
tensor-parallel example of docs/distributed.md, and counts the collectives per layout.
Bad placements and meshes are checked in this process, on a mesh of one rank.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import linear_ce
import linear_ce.objectives as obj
from conftest import eps, leave_gloo_group, rel_err, run_gloo_rank
from linear_ce.parallel.dtensor import accepts_dtensors

IGNORE = -100
TOL = 1e-5  # against the single-process result, as tests/test_distributed.py
OPTIONS = linear_ce.LinearCrossEntropyOptions(batch_chunk_size=4)

# The features every layout is checked with; each runs with all three reductions.
FEATURES = {
    "class_weights_smoothing_bias": dict(class_weight=True, smoothing=0.1, bias=True),
    "z_loss_token_weight": dict(z_loss=1e-2, token_weight=True),
    "probability_targets": dict(probability=True, smoothing=0.05, class_weight=True),
}


# ----------------------------------------------------------------------------- inputs


def _full_inputs(seed: int, batch: tuple[int, int], features: int, classes: int, **feature):
    """The whole (unsplit) inputs of a case, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, features, generator=g)
    W = torch.randn(classes, features, generator=g) / features**0.5 * 3.0
    b = torch.randn(classes, generator=g) if feature.get("bias") else None
    cw = torch.rand(classes, generator=g) + 0.25 if feature.get("class_weight") else None
    if feature.get("probability"):
        t = torch.randn(*batch, classes, generator=g).softmax(-1)
    else:
        t = torch.randint(0, classes, batch, generator=g)
        t.view(-1)[::5] = IGNORE
    tw = torch.rand(batch, generator=g) + 0.5 if feature.get("token_weight") else None
    up = torch.randn(batch, generator=g)
    return dict(x=x, W=W, b=b, cw=cw, t=t, tw=tw, up=up)


def _loss_kwargs(feature: dict, reduction: str) -> dict:
    return dict(
        reduction=reduction,
        label_smoothing=feature.get("smoothing", 0.0),
        z_loss=feature.get("z_loss", 0.0),
        shift=not feature.get("probability", False),
        options=OPTIONS,
    )


def _plain(full: dict, feature: dict, reduction: str, dtype: torch.dtype):
    """Loss and (input, weight, bias) gradients of the plain expression on the full logits."""
    x = full["x"].to(dtype).requires_grad_()
    W = full["W"].to(dtype).requires_grad_()
    b = None if full["b"] is None else full["b"].to(dtype).requires_grad_()
    cw = None if full["cw"] is None else full["cw"].to(dtype)
    tw = None if full["tw"] is None else full["tw"].to(dtype)
    logits = x @ W.T + (0 if b is None else b)
    t = full["t"]
    if feature.get("probability"):
        t = t.to(dtype)
        ce = F.cross_entropy(
            logits.movedim(-1, 1), t.movedim(-1, 1), weight=cw,
            label_smoothing=feature.get("smoothing", 0.0), reduction="none",
        )  # fmt: skip
        omega = torch.ones_like(ce)
    else:
        t = torch.cat([t[:, 1:], torch.full_like(t[:, :1], IGNORE)], dim=1)
        ce = F.cross_entropy(
            logits.movedim(-1, 1), t, weight=cw, ignore_index=IGNORE,
            label_smoothing=feature.get("smoothing", 0.0), reduction="none",
        )  # fmt: skip
        valid = t != IGNORE
        weight_of_target = torch.ones_like(ce) if cw is None else cw[torch.where(valid, t, 0)]
        omega = torch.where(valid, weight_of_target, 0.0)
    per_row = ce + feature.get("z_loss", 0.0) * omega * torch.logsumexp(logits, -1).square()
    if tw is not None:
        per_row = per_row * tw
    loss = {"mean": per_row.sum() / omega.sum(), "sum": per_row.sum(), "none": per_row}[reduction]
    up = full["up"].to(dtype) if reduction == "none" else torch.tensor(0.7, dtype=dtype)
    wrt = [x, W] + ([b] if b is not None else [])
    return loss.detach(), list(torch.autograd.grad(loss, wrt, up))


def _single(full: dict, feature: dict, reduction: str):
    """The single-process linear_ce call on the full tensors (fp32)."""
    x = full["x"].clone().requires_grad_()
    W = full["W"].clone().requires_grad_()
    b = None if full["b"] is None else full["b"].clone().requires_grad_()
    out = linear_ce.linear_cross_entropy(
        x, W, full["t"], linear_bias=b, weight=full["cw"], token_weight=full["tw"],
        return_lse=True, return_z_loss=True, **_loss_kwargs(feature, reduction),
    )  # fmt: skip
    up = full["up"] if reduction == "none" else torch.tensor(0.7)
    wrt = [x, W] + ([b] if b is not None else [])
    return out, list(torch.autograd.grad(out.loss, wrt, up))


def _place(value: torch.Tensor | None, mesh, placements):
    """``value`` as a DTensor with ``placements`` (``None``: the plain tensor itself)."""
    if value is None or placements is None:
        return value
    return distribute_tensor(value, mesh, placements)


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _expected_grad_placements(weight_placements, input_placements):
    """The head's gradient: a partial sum where the rows are split, else its own placement."""
    return tuple(
        Partial() if (i.is_shard() and not w.is_shard()) else w
        for w, i in zip(weight_placements, input_placements, strict=True)
    )


# ----------------------------------------------------------------------------- the checks


class _Failures(list):
    def check(self, what: str, got, want, bound: float = TOL) -> None:
        err = rel_err(_full(got), want)
        if not err <= bound:
            self.append(f"{what}: {err:.2e} > {bound:.2e}")


def _check_loss_layouts(rank, world, mesh, layouts, classes, batch, label) -> list[str]:
    """Every layout x feature x reduction of linear_cross_entropy against one process."""
    failures = _Failures()
    for f_index, (f_name, feature) in enumerate(FEATURES.items()):
        full = _full_inputs(100 + f_index, batch, 16, classes, **feature)
        for reduction in ("mean", "sum", "none"):
            one, one_g = _single(full, feature, reduction)
            ref, ref_g = _plain(full, feature, reduction, torch.float64)
            p32, p32_g = _plain(full, feature, reduction, torch.float32)
            for w_pl, x_pl, target_as_dtensor in layouts:
                what = f"{label} {f_name} {reduction} W{w_pl} x{x_pl} rank {rank}/{world}"
                x = (_place(full["x"], mesh, x_pl) if x_pl else full["x"].clone()).requires_grad_()
                W = _place(full["W"], mesh, w_pl).requires_grad_()
                b = _place(full["b"], mesh, w_pl)
                if b is not None:
                    b.requires_grad_()
                row_pl = x_pl if target_as_dtensor else None
                out = linear_ce.linear_cross_entropy(
                    x, W, _place(full["t"], mesh, row_pl), linear_bias=b, weight=full["cw"],
                    token_weight=_place(full["tw"], mesh, row_pl), return_lse=True,
                    return_z_loss=True, **_loss_kwargs(feature, reduction),
                )  # fmt: skip
                wants = [Replicate()] * mesh.ndim
                if reduction == "none" and x_pl is not None:
                    wants = [
                        p if (p.is_shard() and not w.is_shard()) else Replicate()
                        for p, w in zip(x_pl, w_pl, strict=True)
                    ]
                if tuple(out.loss.placements) != tuple(wants):
                    failures.append(f"{what}: loss placements {out.loss.placements}")
                up = full["up"] if reduction == "none" else torch.tensor(0.7)
                up = distribute_tensor(up, mesh, out.loss.placements)
                wrt = [x, W] + ([b] if b is not None else [])
                grads = torch.autograd.grad(out.loss, wrt, up)
                if x_pl is not None and tuple(grads[0].placements) != tuple(x_pl):
                    failures.append(f"{what}: input grad placements {grads[0].placements}")
                want_w = _expected_grad_placements(w_pl, x_pl or [Replicate()] * mesh.ndim)
                if tuple(grads[1].placements) != want_w:
                    failures.append(f"{what}: weight grad placements {grads[1].placements}")
                names = ["loss", "grad_input", "grad_weight", "grad_bias"][: 1 + len(grads)]
                for n, got, o, r, p in zip(
                    names,
                    [out.loss, *grads],
                    [one.loss, *one_g],
                    [ref, *ref_g],
                    [p32, *p32_g],
                    strict=True,
                ):
                    failures.check(f"{what} {n} vs one process", got, o)
                    failures.check(
                        f"{what} {n} vs float64",
                        got,
                        r,
                        max(3 * eps(torch.float32), 2 * rel_err(p, r)),
                    )
                failures.check(f"{what} lse", out.lse, one.lse)
                failures.check(f"{what} z_loss", out.z_loss, one.z_loss)
    return failures


def _check_token_heads(rank, world, mesh, classes) -> list[str]:
    """token_logprobs and token_objective with a split head and/or split rows."""
    failures = _Failures()
    g = torch.Generator().manual_seed(11)
    x, W = torch.randn(2, 7, 16, generator=g), torch.randn(classes, 16, generator=g) / 2
    b, t = torch.randn(classes, generator=g), torch.randint(0, classes, (2, 7), generator=g)
    t[0, 1:4] = IGNORE
    up_lp, up_h = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)
    old, adv = torch.randn(2, 7, generator=g) - 3, torch.randn(2, 7, generator=g)
    weight = (t != IGNORE).double().div((t != IGNORE).sum()).float()
    objective = obj.clipped_policy_gradient(0.2, 0.28) + obj.entropy_bonus(0.01)
    kw = dict(shift=True, temperature=0.8, softcap=4.0, options=OPTIONS)

    xs, Ws, bs = (v.clone().requires_grad_() for v in (x, W, b))
    one = linear_ce.token_logprobs(xs, Ws, t, linear_bias=bs, entropy=True, top1=True, **kw)
    one_g = torch.autograd.grad([one.logprob, one.entropy], [xs, Ws, bs], [up_lp, up_h])
    one_obj = linear_ce.token_objective(
        xs, Ws, t, objective, linear_bias=bs, entropy=True, old_logprob=old, advantage=adv,
        weight=weight, **kw,
    )  # fmt: skip
    one_obj_g = torch.autograd.grad(one_obj, [xs, Ws, bs])
    layouts = [
        ((Shard(0),), None),
        ((Shard(0),), (Shard(1),)),
        ((Replicate(),), (Shard(1),)),
        ((Replicate(),), (Shard(0),)),
    ]
    for w_pl, x_pl in layouts:
        what = f"token heads W{w_pl} x{x_pl} rank {rank}/{world}"
        xd = (_place(x, mesh, x_pl) if x_pl else x.clone()).requires_grad_()
        Wd, bd = (_place(v, mesh, w_pl).requires_grad_() for v in (W, b))
        out = linear_ce.token_logprobs(xd, Wd, t, linear_bias=bd, entropy=True, top1=True, **kw)
        ups = [distribute_tensor(u, mesh, out.logprob.placements) for u in (up_lp, up_h)]
        got_g = torch.autograd.grad([out.logprob, out.entropy], [xd, Wd, bd], ups)
        failures.check(f"{what} logprob", out.logprob, one.logprob)
        failures.check(f"{what} entropy", out.entropy, one.entropy)
        if not torch.equal(_full(out.top1), one.top1):
            failures.append(f"{what}: top1 differs")
        for n, got, want in zip(("input", "weight", "bias"), got_g, one_g, strict=True):
            failures.check(f"{what} grad_{n}", got, want)

        side = dict(old_logprob=old, advantage=_place(adv, mesh, x_pl), weight=weight)
        loss = linear_ce.token_objective(
            xd, Wd, t, objective, linear_bias=bd, entropy=True, **side, **kw
        )
        got_g = torch.autograd.grad(loss, [xd, Wd, bd])
        failures.check(f"{what} objective", loss, one_obj)
        for n, got, want in zip(("input", "weight", "bias"), got_g, one_obj_g, strict=True):
            failures.check(f"{what} objective grad_{n}", got, want)
    return failures


def _check_divergence_hook(rank, world, mesh, classes) -> list[str]:
    """linear_divergence on DTensors: both heads split alike, the student's and the
    teacher's hidden states and the labels as rows."""
    from linear_ce.divergence import linear_divergence

    on_mesh = linear_divergence
    failures = _Failures()
    g = torch.Generator().manual_seed(13)
    x, xt = torch.randn(2, 7, 16, generator=g), torch.randn(2, 7, 12, generator=g)
    W, Wt = torch.randn(classes, 16, generator=g), torch.randn(classes, 12, generator=g)
    t = torch.randint(0, classes, (2, 7), generator=g)
    t[1, 2:5] = IGNORE
    kw = dict(shift=True, beta=0.5, hard_weight=0.3, temperature=0.9, options=OPTIONS)
    layouts = [((Shard(0),), None), ((Replicate(),), (Shard(1),)), ((Shard(0),), (Shard(1),))]
    for reduction in ("mean", "sum", "none"):
        xs, Ws = x.clone().requires_grad_(), W.clone().requires_grad_()
        one = linear_divergence(xs, Ws, xt, Wt, t, reduction=reduction, **kw)
        up = torch.randn(2, 7, generator=g) if reduction == "none" else torch.tensor(0.7)
        one_g = torch.autograd.grad(one, [xs, Ws], up)
        for w_pl, x_pl in layouts:
            what = f"divergence {reduction} W{w_pl} x{x_pl} rank {rank}/{world}"
            xd = (_place(x, mesh, x_pl) if x_pl else x.clone()).requires_grad_()
            Wd = _place(W, mesh, w_pl).requires_grad_()
            loss = on_mesh(xd, Wd, xt, _place(Wt, mesh, w_pl), t, reduction=reduction, **kw)
            grads = torch.autograd.grad(
                loss, [xd, Wd], distribute_tensor(up, mesh, loss.placements)
            )
            failures.check(f"{what} loss", loss, one)
            for n, got, want in zip(("input", "weight"), grads, one_g, strict=True):
                failures.check(f"{what} grad_{n}", got, want)
    return failures


def _check_sparse_divergence_hook(rank, world, mesh, classes) -> list[str]:
    """sparse_divergence on DTensors: the student's head split along the vocabulary (the
    stored teacher's support split with it), the hidden states, the teacher's slots and the
    labels as rows."""
    failures = _Failures()
    g = torch.Generator().manual_seed(17)
    x, W = torch.randn(2, 7, 16, generator=g), torch.randn(classes, 16, generator=g)
    top = torch.log_softmax(torch.randn(2, 7, classes, generator=g) * 2, -1).topk(5)
    ids, lp = top.indices, top.values
    ids[0, 3, 4], lp[0, 3, 4] = -1, -torch.inf  # an empty slot
    t = torch.randint(0, classes, (2, 7), generator=g)
    t[1, 2:5] = IGNORE
    kw = dict(shift=True, beta=0.5, hard_weight=0.3, temperature=0.9, options=OPTIONS)
    layouts = [((Shard(0),), None), ((Replicate(),), (Shard(1),)), ((Shard(0),), (Shard(1),))]
    for reduction in ("mean", "sum", "none"):
        xs, Ws = x.clone().requires_grad_(), W.clone().requires_grad_()
        one = linear_ce.sparse_divergence(xs, Ws, ids, lp, t, reduction=reduction, **kw)
        up = torch.randn(2, 7, generator=g) if reduction == "none" else torch.tensor(0.7)
        one_g = torch.autograd.grad(one, [xs, Ws], up)
        for w_pl, x_pl in layouts:
            what = f"sparse divergence {reduction} W{w_pl} x{x_pl} rank {rank}/{world}"
            xd = (_place(x, mesh, x_pl) if x_pl else x.clone()).requires_grad_()
            Wd = _place(W, mesh, w_pl).requires_grad_()
            loss = linear_ce.sparse_divergence(xd, Wd, ids, lp, t, reduction=reduction, **kw)
            grads = torch.autograd.grad(
                loss, [xd, Wd], distribute_tensor(up, mesh, loss.placements)
            )
            failures.check(f"{what} loss", loss, one)
            for n, got, want in zip(("input", "weight"), grads, one_g, strict=True):
                failures.check(f"{what} grad_{n}", got, want)
    return failures


def _check_module(rank, world, mesh, classes) -> list[str]:
    """LinearCrossEntropyLoss whose parameters are split along the vocabulary."""
    failures = _Failures()
    torch.manual_seed(3)
    cw = torch.rand(classes) + 0.5
    one = linear_ce.LinearCrossEntropyLoss(16, classes, bias=True, weight=cw, label_smoothing=0.1)
    split = copy.deepcopy(one)
    for name in ("weight", "bias"):
        param = getattr(split, name)
        setattr(split, name, torch.nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)])))
    x, t = torch.randn(2, 7, 16), torch.randint(0, classes, (2, 7))
    one(x, t, shift=True).backward()
    loss = split(distribute_tensor(x, mesh, [Shard(1)]), t, shift=True)
    loss.backward()
    failures.check(f"module loss rank {rank}", loss, one(x, t, shift=True))
    for name in ("weight", "bias"):
        got = getattr(split, name).grad
        if tuple(got.placements) != (Shard(0),):
            failures.append(f"module {name}.grad placements {got.placements}")
        failures.check(f"module grad {name} rank {rank}", got, getattr(one, name).grad)
    return failures


def _check_plain_head_with_split_rows(rank, world, mesh) -> list[str]:
    """A plain head with sequence-split hidden states: its gradient is this rank's share, the
    sum over its own rows, so the shares add up to the whole gradient."""
    failures = _Failures()
    feature = FEATURES["class_weights_smoothing_bias"]
    full = _full_inputs(200, (2, 7), 16, 101, **feature)
    one, one_g = _single(full, feature, "mean")
    x = distribute_tensor(full["x"], mesh, [Shard(1)]).requires_grad_()
    W, b = full["W"].clone().requires_grad_(), full["b"].clone().requires_grad_()
    loss = linear_ce.linear_cross_entropy(
        x, W, full["t"], linear_bias=b, weight=full["cw"], **_loss_kwargs(feature, "mean")
    )
    grads = torch.autograd.grad(
        loss, [x, W, b], distribute_tensor(torch.tensor(0.7), mesh, [Replicate()])
    )
    failures.check(f"plain head loss rank {rank}", loss, one.loss)
    failures.check(f"plain head grad_input rank {rank}", grads[0], one_g[0])
    for name, share, want in zip(("weight", "bias"), grads[1:], one_g[1:], strict=True):
        total = share.clone()
        dist.all_reduce(total)
        failures.check(f"plain head grad_{name} (summed shares) rank {rank}", total, want)
    return failures


def _check_tensor_parallel_example(rank, world, mesh) -> list[str]:
    """The tensor-parallel example of docs/distributed.md, against the unsplit model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    failures = _Failures()

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(97, 32)
            self.norm = torch.nn.LayerNorm(32)
            self.lm_head = torch.nn.Linear(32, 97, bias=False)

        def hidden(self, ids: torch.Tensor) -> torch.Tensor:
            return self.norm(self.embed(ids))

    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel()})
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))

    loss = linear_ce.linear_cross_entropy(model.hidden(ids), model.lm_head.weight, ids, shift=True)
    loss.backward()
    logits = reference.lm_head(reference.hidden(ids))
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    want.backward()
    failures.check(f"tensor-parallel loss rank {rank}", loss, want)
    for (name, got), (_, ref) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        failures.check(f"tensor-parallel grad {name} rank {rank}", got.grad, ref.grad)
    return failures


def _check_fsdp_llama(rank, world, mesh) -> list[str]:
    """Two SGD steps of a tiny Llama under FSDP2 (layers, head and root each sharded), patched
    by the transformers integration, against the unsharded unpatched model on the whole batch."""
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from linear_ce.integrations.transformers import patch

    failures = _Failures()
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    reference64 = copy.deepcopy(reference).double()
    model = patch(copy.deepcopy(reference))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (2, world, 9), generator=g)  # (steps, ranks, T)
    labels = ids.clone()
    labels[..., :2] = IGNORE
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        loss = model(
            input_ids=ids[step, rank : rank + 1], labels=labels[step, rank : rank + 1]
        ).loss
        loss.backward()
        # FSDP averages the gradients over ranks: the reference loss is the mean of theirs.
        ref_losses = [
            reference(input_ids=ids[step, r : r + 1], labels=labels[step, r : r + 1]).loss
            for r in range(world)
        ]
        torch.stack(ref_losses).mean().backward()
        failures.check(f"fsdp step {step} loss rank {rank}", loss, ref_losses[rank].detach())
        grads = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
        ref_grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
        failures.check(f"fsdp step {step} grads rank {rank}", grads, ref_grads)
        if step == 0:
            losses64 = [
                reference64(input_ids=ids[0, r : r + 1], labels=labels[0, r : r + 1]).loss
                for r in range(world)
            ]
            torch.stack(losses64).mean().backward()
            grads64 = torch.cat([p.grad.flatten() for p in reference64.parameters()])
            bound = max(3 * eps(torch.float32), 2 * rel_err(ref_grads, grads64))
            failures.check(f"fsdp grads vs float64 rank {rank}", grads, grads64, bound)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    params = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    failures.check(
        f"fsdp parameters after 2 steps rank {rank}",
        params,
        torch.cat([p.detach().flatten() for p in reference.parameters()]),
    )
    return failures


# ----------------------------------------------------------------------------- communication


def _comm_counts(mode) -> tuple[int, int]:
    """(all_reduce, all_gather) calls seen by a CommDebugMode."""
    counts = {str(op): n for op, n in mode.get_comm_counts().items()}
    reduces = sum(n for op, n in counts.items() if "all_reduce" in op or "allreduce" in op)
    gathers = sum(n for op, n in counts.items() if "all_gather" in op or "allgather" in op)
    return reduces, gathers


def _count_communication(rank, world, mesh) -> list[str]:
    """The collectives per call of docs/distributed.md#dtensor-arguments, per layout."""
    from torch.distributed.tensor.debug import CommDebugMode

    g = torch.Generator().manual_seed(7)
    classes = 101
    x, W = torch.randn(2, 7, 16, generator=g), torch.randn(classes, 16, generator=g)
    t = torch.randint(0, classes, (2, 7), generator=g)
    chunks = 3  # 12 valid rows after the shift, 4 per chunk
    vocab, rows = (Shard(0),), (Shard(1),)
    # (W, x, target, reduction) -> (forward, backward) counts of (all_reduce, all_gather)
    cases = [
        ((vocab, None, None, "mean"), ((2 * chunks + 1, 0), (0, 0))),
        ((vocab, (Replicate(),), None, "none"), ((2 * chunks, 0), (2 * chunks + 1, 0))),
        ((vocab, rows, None, "mean"), ((2 * chunks + 1, 1), (0, 0))),
        (((Replicate(),), rows, None, "mean"), ((1, 0), (0, 0))),
        (((Replicate(),), rows, rows, "sum"), ((1, 1), (0, 0))),
        (((Replicate(),), rows, None, "none"), ((0, 0), (0, 0))),
        (((Replicate(),), (Replicate(),), None, "mean"), ((0, 0), (0, 0))),
    ]
    failures = []
    for (w_pl, x_pl, t_pl, reduction), want in cases:
        xd = (_place(x, mesh, x_pl) if x_pl else x.clone()).requires_grad_()
        Wd = _place(W, mesh, w_pl).requires_grad_()
        td = _place(t, mesh, t_pl)
        with CommDebugMode() as forward:
            loss = linear_ce.linear_cross_entropy(
                xd, Wd, td, shift=True, reduction=reduction, options=OPTIONS
            )
        up = distribute_tensor(torch.ones(loss.shape), mesh, loss.placements)
        with CommDebugMode() as backward:
            torch.autograd.grad(loss, [xd, Wd], up)
        got = (_comm_counts(forward), _comm_counts(backward))
        if got != want:
            failures.append(
                f"rank {rank}: W{w_pl} x{x_pl} target{t_pl} {reduction}: (forward, backward) "
                f"(all_reduce, all_gather) = {got}, documented {want}"
            )
    return failures


# ----------------------------------------------------------------------------- the workers

_1D = [
    ((Shard(0),), None, False),
    ((Shard(0),), (Replicate(),), True),
    ((Replicate(),), (Replicate(),), False),
    ((Replicate(),), (Shard(1),), False),
    ((Replicate(),), (Shard(0),), True),
    ((Shard(0),), (Shard(1),), True),
]
_2D = [
    ((Replicate(), Shard(0)), (Shard(0), Replicate()), False),
    ((Replicate(), Shard(0)), (Shard(1), Shard(1)), True),
    ((Shard(0), Replicate()), (Replicate(), Shard(1)), False),
    ((Replicate(), Replicate()), (Shard(0), Shard(1)), True),
]


# FSDP2 orders its CPU collectives with stream events, which torch.cpu.Stream lacks before 2.7.
FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")


def _checks(world: int) -> dict[str, Callable[[int], list[str]]]:
    """The checks of one world size, each a function of the rank."""
    mesh = init_device_mesh("cpu", (world,))
    if world == 2:
        checks = {
            "loss": lambda r: _check_loss_layouts(r, 2, mesh, _1D, 101, (2, 7), "1-D"),
            "token": lambda r: _check_token_heads(r, 2, mesh, 101),
            "module": lambda r: _check_module(r, 2, mesh, 101),
            "plain_head": lambda r: _check_plain_head_with_split_rows(r, 2, mesh),
            "divergence": lambda r: _check_divergence_hook(r, 2, mesh, 101),
            "sparse_divergence": lambda r: _check_sparse_divergence_hook(r, 2, mesh, 101),
            "tp_example": lambda r: _check_tensor_parallel_example(r, 2, mesh),
            "count": lambda r: _count_communication(r, 2, mesh),
        }
        if FSDP2_ON_CPU and importlib.util.find_spec("transformers") is not None:
            checks["fsdp"] = lambda r: _check_fsdp_llama(r, 2, mesh)
        return checks
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "loss": lambda r: _check_loss_layouts(r, 4, mesh, _1D, 103, (3, 5), "1-D"),
        "loss_2d": lambda r: _check_loss_layouts(r, 4, mesh_2d, _2D, 103, (2, 7), "2-D"),
        "token": lambda r: _check_token_heads(r, 4, mesh, 103),
    }


def _worker(rank: int, world: int, folder: str) -> None:
    run_gloo_rank(
        rank, world, folder, lambda: {name: check(rank) for name, check in _checks(world).items()}
    )


def _spawn(world: int, folder) -> dict[str, list[str]]:
    """Run every check of ``world`` ranks once; the failures of all ranks, per check."""
    mp.spawn(_worker, args=(world, str(folder)), nprocs=world, join=True)
    merged: dict[str, list[str]] = {}
    for rank in range(world):
        for check, messages in json.loads((folder / f"rank{rank}.json").read_text()).items():
            merged.setdefault(check, []).extend(messages)
    return merged


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict[str, list[str]]:
    return _spawn(2, tmp_path_factory.mktemp("dtensor2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict[str, list[str]]:
    return _spawn(4, tmp_path_factory.mktemp("dtensor4"))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_loss_matches_one_process_and_float64(request, world):
    """Weight Shard(0) (uneven) or Replicate, input plain, replicated, batch- or
    sequence-split (uneven, some ranks empty), 1-D meshes of 2 and 4 ranks: loss, lse and
    gradients of every reduction, with class weights, label smoothing, z-loss, token weights
    and probability targets; gradient placements as autograd's."""
    assert request.getfixturevalue(world)["loss"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_2d_mesh_data_and_tensor_parallel(world4):
    """A (dp, tp) mesh: the head split over one dimension, the rows over the other (or both)."""
    assert world4["loss_2d"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_token_heads(request, world):
    """token_logprobs and token_objective with a split head and/or split rows."""
    assert request.getfixturevalue(world)["token"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hook_on_linear_divergence(world2):
    """accepts_dtensors on linear_divergence (the one line its module would add)."""
    assert world2["divergence"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hook_on_sparse_divergence(world2):
    """sparse_divergence takes DTensors through the same function: a split head runs it with
    the vocab_parallel its placements give; split rows sum a "mean" over the ranks."""
    assert world2["sparse_divergence"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_module_with_split_parameters(world2):
    assert world2["module"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_plain_head_gets_its_share_of_the_gradient(world2):
    assert world2["plain_head"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tensor_parallel_example(world2):
    """parallelize_module with ColwiseParallel on the head, then the loss from its weight."""
    assert world2["tp_example"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 runs on CPU from torch 2.7")
def test_fsdp2_patched_llama_trains_like_unsharded(world2):
    pytest.importorskip("transformers")
    assert world2["fsdp"] == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_communication_per_call_is_documented(world2):
    assert world2["count"] == []


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


def _call(x, W, **kw):
    return linear_ce.linear_cross_entropy(x, W, torch.randint(0, 5, (4,)), **kw)


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        (Shard(1), r"linear_weight has placement Shard\(dim=1\) on mesh dimension 0"),
        (Partial(), r"linear_weight has placement Partial\(sum\) on mesh dimension 0"),
    ],
)
def test_unsupported_weight_placement(mesh, placement, message):
    W = DTensor.from_local(torch.randn(5, 3), mesh, [placement], run_check=False)
    with pytest.raises(ValueError, match=message):
        _call(torch.randn(4, 3), W)


def test_strided_shard_is_named(mesh):
    from torch.distributed.tensor.placement_types import _StridedShard

    W = DTensor.from_local(
        torch.randn(5, 3), mesh, [_StridedShard(0, split_factor=1)], run_check=False
    )
    with pytest.raises(ValueError, match=r"placement _StridedShard\(dim=0, sf=1\)"):
        _call(torch.randn(4, 3), W)


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        (Shard(1), r"input has placement Shard\(dim=1\) .* split along its features"),
        (Partial(), r"input has placement Partial\(sum\) .* a pending reduction"),
    ],
)
def test_unsupported_input_placement(mesh, placement, message):
    x = DTensor.from_local(torch.randn(4, 3), mesh, [placement], run_check=False)
    with pytest.raises(ValueError, match=message):
        _call(x, distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]))


def test_head_tensors_split_alike(mesh):
    W = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"linear_bias is a plain tensor \(replicated: "):
        _call(torch.randn(4, 3), W, linear_bias=torch.randn(5))
    b = distribute_tensor(torch.randn(5), mesh, [Replicate()])
    with pytest.raises(
        ValueError,
        match=r"linear_bias is a DTensor with placements \(Replicate\(\),\) but linear_weight "
        r"is a DTensor with placements \(Shard\(dim=0\),\); the head's tensors must be split",
    ):
        _call(torch.randn(4, 3), W, linear_bias=b)
    # A plain bias counts as replicated: with a replicated weight it is accepted.
    W = distribute_tensor(torch.randn(5, 3), mesh, [Replicate()])
    assert _call(torch.randn(4, 3), W, linear_bias=torch.randn(5)).placements == (Replicate(),)


def test_one_mesh(mesh):
    other = DeviceMesh("cpu", [[0]], mesh_dim_names=("dp", "tp"))
    W = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])
    x = distribute_tensor(torch.randn(4, 3), other, [Replicate(), Replicate()])
    with pytest.raises(ValueError, match="must live on one device mesh"):
        _call(x, W)


def test_mesh_device_type_must_match_the_tensors(mesh):
    W = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"a 'cpu' mesh but input is on meta"):
        _call(torch.randn(4, 3, device="meta"), W)
    cuda_mesh = DeviceMesh("cuda", [0], _init_backend=False)
    W = DTensor.from_local(torch.randn(5, 3, device="meta"), cuda_mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"a 'cuda' mesh but input is on cpu.*init_device_mesh"):
        _call(torch.randn(4, 3), W)


def test_a_function_without_a_vocab_parallel_form(mesh):
    """The hook on a function that names no vocab-parallel form: a split head is an error,
    a replicated one runs locally and gives a replicated DTensor."""

    @accepts_dtensors(rows=("input", "target"), heads=("weight",))
    def score(input, weight, target):
        return (input @ weight.T).gather(-1, target[..., None]).sum()

    x, t = torch.randn(4, 3), torch.randint(0, 5, (4,))
    with pytest.raises(ValueError, match=r"score does not support.*replicate it"):
        score(x, distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]), t)
    W = torch.randn(5, 3)
    out = score(x, distribute_tensor(W, mesh, [Replicate()]), t)
    assert out.placements == (Replicate(),)
    torch.testing.assert_close(out.full_tensor(), score(x, W, t))


def test_stray_dtensor_argument(mesh):
    x = distribute_tensor(torch.randn(4, 3), mesh, [Replicate()])
    with pytest.raises(ValueError, match="logit_scale cannot be a DTensor"):
        _call(
            x, torch.randn(5, 3), logit_scale=distribute_tensor(torch.ones(()), mesh, [Replicate()])
        )
