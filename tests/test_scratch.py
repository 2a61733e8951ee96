"""Scratch kept between calls (:mod:`linear_ce.engine.scratch`): the loops' large buffers
are given back when a loop returns and taken by the next call.

Keeping must never change a result. The kept buffers are filled with NaN before the
call under test, so a tile read before it is written shows. Every call is also checked
bit for bit against the same call with fresh scratch (``LINEAR_CE_KEEP_SCRATCH=0``) and
against float64. A buffer something still references must not be handed out again.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import linear_ce
from conftest import eps, rel_err
from linear_ce.bench.measure import measure
from linear_ce.engine import chunk_loop
from linear_ce.engine import scratch as scratch_module
from linear_ce.engine.accumulate import DirectSum, SplitSum
from linear_ce.engine.scratch import KEEP_SCRATCH_ENV, keeps_scratch, kept_bytes, release, scratch

CPU = torch.device("cpu")
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh_pool(monkeypatch):
    """Every test starts and ends with nothing kept; small test shapes' buffers are kept
    too (the real threshold would leave them to malloc)."""
    monkeypatch.setattr(scratch_module, "MIN_KEPT_BYTES", 0)
    monkeypatch.delenv(KEEP_SCRATCH_ENV, raising=False)
    release()
    yield
    release()


def _poison_kept() -> None:
    for buffer in scratch_module._kept:
        buffer.fill_(255)  # all-ones bytes: NaN in every float dtype


@keeps_scratch
def _loop(sizes, keep_view=None):
    views = [scratch((n,), torch.uint8, CPU) for n in sizes]
    for i, view in enumerate(views):
        view.fill_(i + 1)
    if keep_view is not None:
        keep_view.append(views[0])
    return [v.data_ptr() for v in views]


def _inputs(dtype, rows=300, features=40, classes=900, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=gen, dtype=torch.float64)
    w = torch.randn(classes, features, generator=gen, dtype=torch.float64) / 3
    t = torch.randint(0, classes, (rows,), generator=gen)
    t[::7] = -100
    return x.to(dtype), w.to(dtype), t


def _step(x, w, t):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_ce.linear_cross_entropy(xs, ws, t, ignore_index=-100)
    loss.backward()
    return loss.detach(), xs.grad, ws.grad


def _forward(x, w, t):
    with torch.no_grad():
        return (linear_ce.linear_cross_entropy(x, w, t, ignore_index=-100, reduction="none"),)


def _logprobs(x, w, t):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_ce.token_logprobs(xs, ws, t.clamp(min=0), entropy=True)
    (out.logprob.sum() + out.entropy.sum() * 0.1).backward()
    return out.logprob.detach(), out.entropy.detach(), xs.grad, ws.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("call", [_step, _forward, _logprobs], ids=["step", "forward", "logprobs"])
def test_kept_scratch_changes_no_result(call, dtype, monkeypatch):
    """A call on kept buffers full of NaN left by a call on other inputs equals, bit for
    bit, the same call on fresh scratch."""
    call(*_inputs(dtype, seed=1))
    assert kept_bytes() > 0, "the first call kept nothing"
    _poison_kept()
    kept = call(*_inputs(dtype))
    monkeypatch.setenv(KEEP_SCRATCH_ENV, "0")
    release()
    fresh = call(*_inputs(dtype))
    assert kept_bytes() == 0
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["split", "wide"])
def test_kept_weight_gradient_sums_change_no_result(kind, monkeypatch):
    """bf16 steps whose weight gradient is summed in scratch: the split sum's low-order
    plane (many chunks) and the wide fp32 sum (``acc_policy="accurate"``), on kept buffers
    full of NaN, equal the same steps on fresh scratch bit for bit."""
    sums = []
    original = chunk_loop.weight_grad_sum

    def spy(*args, **kwargs):
        sums.append(original(*args, **kwargs))
        return sums[-1]

    monkeypatch.setattr(chunk_loop, "weight_grad_sum", spy)
    options = linear_ce.LinearCrossEntropyOptions(
        acc_policy="accurate" if kind == "wide" else "auto"
    )
    if kind == "split":
        monkeypatch.setenv("LINEAR_CE_CHUNK_ROWS", "32")

    def step(x, w, t):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        linear_ce.linear_cross_entropy(xs, ws, t, ignore_index=-100, options=options).backward()
        return xs.grad, ws.grad

    x, w, t = _inputs(torch.bfloat16)
    # A 1-dimensional loss whose second position has every row ignored: that position's
    # sum is never written, and its gradient is zero.
    w2 = torch.stack([w, w.flip(0)], 1)
    t2 = torch.stack([t, torch.full_like(t, -100)], 1)

    def poisoned(*inputs):
        # The same shapes first (so the kept buffers fit), on other values, then NaN.
        step(*(i.flip(0) for i in inputs))
        _poison_kept()
        return step(*inputs)

    kept = poisoned(x, w, t) + poisoned(x, w2, t2)
    expected = SplitSum if kind == "split" else DirectSum
    assert isinstance(sums[-1], expected)
    monkeypatch.setenv(KEEP_SCRATCH_ENV, "0")
    release()
    fresh = step(x, w, t) + step(x, w2, t2)
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)


def test_kept_step_against_float64():
    """The step on kept scratch against the plain float64 expression: within 3 eps of
    fp32 or twice the plain fp32 expression's own error."""
    x, w, t = _inputs(torch.float32)
    _step(*_inputs(torch.float32, seed=2))
    _poison_kept()
    got = _step(x, w, t)

    def plain(x_, w_):
        xs, ws = x_.clone().requires_grad_(), w_.clone().requires_grad_()
        loss = F.cross_entropy(xs @ ws.T, t, ignore_index=-100)
        loss.backward()
        return loss.detach(), xs.grad, ws.grad

    ref = plain(x.double(), w.double())
    own = plain(x, w)
    for g, r, o in zip(got, ref, own, strict=True):
        assert rel_err(g, r) <= max(3 * eps(torch.float32), 2 * rel_err(o, r))


def test_next_call_takes_the_kept_buffers():
    """The same call again takes the buffers the last one gave back: no new memory."""
    first = _loop([3 * MIB, 2 * MIB])
    assert kept_bytes() == 5 * MIB
    second = _loop([3 * MIB, 2 * MIB])
    assert sorted(first) == sorted(second)
    assert kept_bytes() == 5 * MIB


def test_kept_is_the_last_calls_scratch():
    """What a call returns replaces what was kept, so the process holds one call's
    scratch, the last one's."""
    _loop([4 * MIB, 2 * MIB])
    _loop([2 * MIB])
    assert kept_bytes() == 2 * MIB
    _loop([8 * MIB])
    assert kept_bytes() == 8 * MIB


def test_much_larger_buffer_is_freed_not_taken():
    """A request that no kept buffer holds within an eighth to spare frees them all before
    it allocates: a backward never holds its forward's larger tile beside its own."""
    first = _loop([4 * MIB])
    seen = []

    @keeps_scratch
    def smaller():
        view = scratch((MIB + MIB // 8,), torch.uint8, CPU)
        seen.append((view.data_ptr(), kept_bytes()))

    smaller()
    assert seen[0][0] not in first
    assert seen[0][1] == 0
    assert kept_bytes() == MIB + MIB // 8
    near = _loop([MIB])
    assert near == [seen[0][0]]


def test_referenced_buffer_is_not_handed_out_again():
    """A view that outlives its loop keeps its buffer out of the pool: the next call
    writes elsewhere and the view's bytes stay."""
    escaped: list[torch.Tensor] = []
    first = _loop([2 * MIB, 1 * MIB], keep_view=escaped)
    assert kept_bytes() == 1 * MIB
    second = _loop([2 * MIB])
    assert first[0] not in second
    assert bool((escaped[0] == 1).all())


def test_loop_that_raises_keeps_nothing_it_held():
    """A loop that fails: its traceback still holds its tile, so the tile is not kept."""

    @keeps_scratch
    def failing():
        tile = scratch((MIB,), torch.float32, CPU)
        tile.fill_(0)
        raise RuntimeError("fails mid-loop")

    with pytest.raises(RuntimeError, match="fails mid-loop"):
        failing()
    assert kept_bytes() == 0


def test_forked_child_keeps_nothing():
    """A child process (a data loader's worker) starts with nothing kept."""
    import os

    _loop([2 * MIB])
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, str(kept_bytes()).encode())
        os._exit(0)
    os.close(write)
    child = int(os.read(read, 64))
    os.waitpid(pid, 0)
    os.close(read)
    assert child == 0
    assert kept_bytes() == 2 * MIB


def test_outside_a_loop_nothing_is_kept():
    t = scratch((MIB,), torch.float32, CPU)
    assert t.shape == (MIB,) and t.dtype == torch.float32
    del t
    assert kept_bytes() == 0


def test_other_devices_get_torch_empty():
    @keeps_scratch
    def on_meta():
        return scratch((4, 8), torch.float32, torch.device("meta"))

    out = on_meta()
    assert out.device.type == "meta" and out.shape == (4, 8)
    assert kept_bytes() == 0


def test_keep_off_and_bad_value(monkeypatch):
    monkeypatch.setenv(KEEP_SCRATCH_ENV, "0")
    _loop([2 * MIB])
    assert kept_bytes() == 0
    monkeypatch.setenv(KEEP_SCRATCH_ENV, "yes")
    with pytest.raises(ValueError, match=KEEP_SCRATCH_ENV):
        _loop([2 * MIB])


def test_release_frees_the_kept_scratch():
    _loop([2 * MIB])
    assert kept_bytes() == 2 * MIB
    linear_ce.release_scratch()
    assert kept_bytes() == 0


def test_threads_take_distinct_buffers():
    """Two loops running at once never share a buffer."""
    _loop([2 * MIB])
    barrier = threading.Barrier(2)
    seen: dict[int, list[int]] = {}

    @keeps_scratch
    def held(name):
        view = scratch((2 * MIB,), torch.uint8, CPU)
        barrier.wait()
        seen[name] = [view.data_ptr()]
        barrier.wait()

    threads = [threading.Thread(target=held, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen[0] != seen[1]


def test_threads_calls_equal_one_thread():
    """Steps in two threads at once equal the same steps one after the other."""
    inputs = [_inputs(torch.float32, seed=s) for s in (3, 4)]
    alone = [_step(*i) for i in inputs]
    release()
    results: dict[int, tuple] = {}

    def run(i):
        results[i] = _step(*inputs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(2):
        for a, b in zip(results[i], alone[i], strict=True):
            assert torch.equal(a, b)


def test_bench_peak_counts_kept_scratch():
    """The bench's transient peak of a call on kept scratch still counts that scratch:
    memory the call needs, not memory it found."""
    nbytes = 64 * MIB

    def call():
        _loop([nbytes])

    fresh = measure(call, CPU)
    assert kept_bytes() == nbytes
    kept = measure(call, CPU)
    assert fresh.peak_bytes >= nbytes * 0.95
    assert kept.peak_bytes >= nbytes * 0.95
