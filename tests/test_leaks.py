"""No leaks: stored gradients and outputs are freed by reference counting alone, and
many forward+backward calls do not grow the process's memory; for the loss and for the
post-training heads (``token_logprobs``, ``token_objective``, ``linear_divergence``,
``sparse_divergence``, ``sequence_objective``)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import linear_ce
import linear_ce.objectives as objectives
from linear_ce import LinearCrossEntropyOptions

REDUCTIONS = ("mean", "sum", "none")


def _inputs(rows=32, features=64, classes=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g, requires_grad=True)
    W = torch.randn(classes, features, generator=g, requires_grad=True)
    b = torch.randn(classes, generator=g, requires_grad=True)
    t = torch.randint(0, classes, (rows,), generator=g)
    t[::7] = -100
    return x, W, b, t


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.fixture
def gc_disabled():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("allow_retain_graph", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_stored_gradients_freed_without_gc(gc_disabled, allow_retain_graph, backward):
    """mean/sum keep the gradients on the graph node between forward and backward; they
    (and the loss) must die as soon as the loss and graph are dropped, with ``gc`` off,
    whether backward ran or not."""
    x, W, b, t = _inputs()
    options = LinearCrossEntropyOptions(allow_retain_graph=allow_retain_graph)
    loss = linear_ce.linear_cross_entropy(x, W, t, linear_bias=b, options=options)
    stored = [g for g in loss.grad_fn.grads if g is not None]
    assert len(stored) == 3
    refs = [weakref.ref(g) for g in stored] + [weakref.ref(loss), weakref.ref(loss.grad_fn)]
    del stored
    if backward:
        loss.backward()
        x.grad = W.grad = b.grad = None
    del loss
    assert all(r() is None for r in refs), "a reference cycle keeps the graph alive"


def test_row_losses_and_saved_inputs_freed_without_gc(gc_disabled):
    """reduction="none": the output and the graph die with the last reference; the
    saved handles do not keep the caller's tensors alive."""
    x, W, b, t = _inputs()
    hidden = x * 1.0  # a non-leaf, saved by the node
    loss = linear_ce.linear_cross_entropy(hidden, W, t, linear_bias=b, reduction="none")
    refs = [weakref.ref(loss), weakref.ref(hidden)]
    loss.sum().backward()
    del loss, hidden
    assert all(r() is None for r in refs)


def test_outputs_freed_without_gc_after_extras(gc_disabled):
    x, W, _, t = _inputs()
    out = linear_ce.linear_cross_entropy(x, W, t, z_loss=1e-3, return_lse=True, return_z_loss=True)
    refs = [weakref.ref(out.loss), weakref.ref(out.lse), weakref.ref(out.z_loss)]
    out.loss.backward()
    del out
    assert all(r() is None for r in refs)


@pytest.mark.slow
def test_many_calls_do_not_grow_rss():
    """200 forward+backward calls (cycling through the reductions): RSS grows by less than
    8 MiB, while leaking only the weight gradient of each call would add
    200·256·64·4 B = 12.5 MiB."""
    x, W, b, t = _inputs()

    def step(i):
        loss = linear_ce.linear_cross_entropy(
            x, W, t, linear_bias=b, reduction=REDUCTIONS[i % 3], z_loss=1e-4, label_smoothing=0.1
        )
        loss.sum().backward()
        x.grad = W.grad = b.grad = None

    for i in range(12):  # warm the allocator and torch's caches
        step(i)
    gc.collect()
    before = _rss_bytes()
    for i in range(200):
        step(i)
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 8 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 200 calls"


HEADS = (
    "token_logprobs",
    "token_objective",
    "linear_divergence",
    "sparse_divergence",
    "sequence_objective",
)


def _head_outputs(head, x, W, b, t):
    """The head's differentiable outputs and the scalar a training step backpropagates.
    ``linear_divergence`` "mean" and ``token_objective`` compute their gradients in
    forward and keep them on the graph node until backward, as the loss's mean/sum do."""
    if head == "token_logprobs":
        out = linear_ce.token_logprobs(x, W, t, linear_bias=b, entropy=True, top1=True)
        return [out.logprob, out.entropy, out.top1], (out.logprob + out.entropy).sum()
    if head == "token_objective":
        advantage = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
        loss = linear_ce.token_objective(
            x,
            W,
            t,
            lambda lp, ent, advantage: -advantage * lp - 0.1 * ent,
            linear_bias=b,
            entropy=True,
            advantage=advantage,
        )
        return [loss], loss
    if head == "sparse_divergence":
        g = torch.Generator().manual_seed(2)
        ids = torch.stack([torch.randperm(W.shape[0], generator=g)[:8] for _ in range(len(t))])
        stored = torch.randn(ids.shape, generator=g).log_softmax(-1)
        loss = linear_ce.sparse_divergence(x, W, ids, stored, t, linear_bias=b, beta=0.5)
        return [loss], loss
    if head == "sequence_objective":
        # Four sequences of eight tokens, two chosen/rejected pairs (TRL's row order).
        reference = torch.randn(4, generator=torch.Generator().manual_seed(3))
        out = linear_ce.sequence_objective(
            x.reshape(4, 8, -1),
            W,
            t.reshape(4, 8),
            objectives.dpo(beta=0.1),
            group="pairs",
            linear_bias=b,
            entropy=True,
            ref_logprob=reference,
        )
        return [out.loss, out.logprob_sum], out.loss
    teacher_x, teacher_W = x.detach() * 0.5, W.detach().flip(0)
    loss, entropy = linear_ce.linear_divergence(
        x, W, teacher_x, teacher_W, t, student_bias=b, beta=0.5, return_entropy=True
    )
    return [loss, entropy], loss


def _head_node(tensor):
    """The graph node of the head's op or autograd function under ``tensor`` (the
    sums and views above it are C++ nodes that take no weak reference)."""
    todo = [tensor.grad_fn]
    while todo:
        node = todo.pop()
        name = type(node).__name__
        if "linear_ce" in name or "TokenObjective" in name or "SequenceObjective" in name:
            return node
        todo.extend(n for n, _ in node.next_functions if n is not None)
    raise AssertionError(f"no linear_ce node under {tensor.grad_fn}")


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("head", HEADS)
def test_head_outputs_and_graph_freed_without_gc(gc_disabled, head, backward):
    """Each head's outputs, its graph node (with any gradients stored on it) and the
    saved hidden state die with the last reference, with ``gc`` off, whether backward
    ran or not."""
    x, W, b, t = _inputs()
    hidden = x * 1.0  # a non-leaf, saved by the node
    outputs, loss = _head_outputs(head, hidden, W, b, t)
    refs = [weakref.ref(o) for o in outputs] + [weakref.ref(_head_node(loss)), weakref.ref(hidden)]
    if backward:
        loss.backward()
        x.grad = W.grad = b.grad = None
    del outputs, loss, hidden
    assert all(r() is None for r in refs), "a reference cycle keeps the graph alive"


@pytest.mark.slow
def test_many_head_calls_do_not_grow_rss():
    """200 forward+backward calls cycling through the heads: RSS grows by less
    than 8 MiB, while leaking only the weight gradient of each call would add
    200·256·64·4 B = 12.5 MiB."""
    x, W, b, t = _inputs()

    def step(i):
        _, loss = _head_outputs(HEADS[i % len(HEADS)], x, W, b, t)
        loss.backward()
        x.grad = W.grad = b.grad = None

    for i in range(12):  # warm the allocator and torch's caches
        step(i)
    gc.collect()
    before = _rss_bytes()
    for i in range(200):
        step(i)
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 8 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 200 calls"
