"""What is measured: each variant turns the inputs into one timed call.

Training variants (``kind="train"``) compute the loss and the gradients of
input and weight; forward variants only the loss, under ``torch.no_grad``.
The floors are the GEMMs alone: ``floor`` the three of a training step
(logits, grad input, grad weight: ``6·N·D·V`` flops) in the input dtype,
``floor-fp32`` the same in fp32 (what half inputs cost where the GEMMs must
run in fp32), ``floor-fwd`` the logits GEMM alone (fp32 for half inputs
without native half GEMMs). At a DPO point the floors are ``floor-scored`` and
``floor-scored-fp32``: the same three GEMMs on the scored rows only (the prompts, a quarter
of each sequence, carry no log-probability, and no head computes their logits).
A floor writes its logits into a buffer made once, when the variant is built, as a
chunked head reuses its tiles: a fresh ``(N, V)`` result faults in its pages on every
call (a GEMM into a new tensor takes up to twice as long as into a reused one), which
is work the GEMMs do not need, and which made a floor slower than ``torch.compile`` of
the plain expression. The
gradients are fresh, as every step's are; the buffer is not in a floor's peak.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from linear_ce.bench.config import HEADS, REDUCTIONS, Point
from linear_ce.engine.capability import HALF_DTYPES, native_half_gemm

__all__ = [
    "DEFAULT",
    "DPO_VARIANTS",
    "SWEEP_ONLY",
    "VARIANTS",
    "Variant",
    "describe_divergence_plan",
    "describe_plan",
    "dpo_scored",
    "half_gemm_rates",
    "make_inputs",
    "measured_at",
    "own_floor_variant",
    "plan_note",
    "reference_variant",
    "slow_half_gemm",
]

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: ``build(x, w, t)`` -> the measured call; a variant whose :attr:`Variant.reductions` go
#: beyond ``"mean"`` also takes ``reduction=`` (one of :data:`~linear_ce.bench.config.REDUCTIONS`).
Build = Callable[..., Callable[[], None]]


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named way to compute the loss; ``unavailable`` says why it cannot run, or None."""

    name: str
    kind: str
    build: Build
    unavailable: Callable[[Point], str | None]
    description: str
    #: The point heads (:data:`linear_ce.bench.config.HEADS`) the variant is measured at.
    heads: tuple[str, ...] = ("ce",)
    #: What the variant's plan chose at a point (:func:`describe_plan`), for the report.
    describe: Callable[[Point], dict] | None = None
    #: The loss reductions it is measured at; beyond ``"mean"`` its build takes ``reduction=``.
    reductions: tuple[str, ...] = ("mean",)
    #: Whether its GEMMs run in the input dtype whatever the CPU (a peer: the plain
    #: expression, torch's builtin, other libraries). Where the half GEMMs are slow
    #: (:func:`slow_half_gemm`) such a variant is measured at fewer rows
    #: (:func:`linear_ce.bench.runner.reduced_rows`).
    half_gemms: bool = False


#: A half GEMM this many times slower than fp32's is not native (oneDNN's conversion loops
#: run one to two orders of magnitude slower; a native one at least at fp32's rate).
SLOW_HALF_FACTOR = 4.0


@functools.cache
def half_gemm_rates(dtype: torch.dtype, features: int) -> tuple[float, float]:
    """GFLOP/s of a small ``torch.mm`` (32 rows, ``features`` ≤ 1024, 256 columns) on one
    thread in ``dtype`` and in fp32, the fastest of four calls after a first: whether the
    half GEMMs are native is measured, since a setting that caps oneDNN's instruction set
    (``ONEDNN_MAX_CPU_ISA``) makes them slow whatever the CPU's flags promise. One thread,
    so that a busy machine's descheduled worker does not stretch a sub-millisecond GEMM."""
    import time

    k = max(1, min(features, 1024))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rates = []
    try:
        for dt in (dtype, torch.float32):
            a, b = torch.randn(32, k).to(dt), torch.randn(k, 256).to(dt)
            torch.mm(a, b)
            best = math.inf
            for _ in range(4):
                start = time.perf_counter()
                torch.mm(a, b)
                best = min(best, time.perf_counter() - start)
            rates.append(2 * 32 * k * 256 / max(best, 1e-9) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return rates[0], rates[1]


def slow_half_gemm(point: Point) -> bool:
    """Whether ``point`` is a half-precision CPU point whose GEMMs in its own dtype run
    more than :data:`SLOW_HALF_FACTOR` times slower than fp32's (:func:`half_gemm_rates`)."""
    if point.torch_dtype not in HALF_DTYPES or point.device != "cpu":
        return False
    half, single = half_gemm_rates(point.torch_dtype, point.D)
    return half * SLOW_HALF_FACTOR < single


def _native(point: Point) -> bool:
    dtype = point.torch_dtype
    if dtype not in HALF_DTYPES:
        return True
    return native_half_gemm(dtype, torch.device(point.device)) and not slow_half_gemm(point)


def _always(point: Point) -> str | None:
    return None


def _gemm_dtype(point: Point) -> torch.dtype:
    return point.torch_dtype if _native(point) else torch.float32


def _logits_buffer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The ``(N, V)`` buffer a floor's logits GEMM writes into on every call."""
    return x.new_empty(x.shape[0], w.shape[0])


def _floor(dtype: torch.dtype | None) -> Build:
    def build(x, w, t, reduction="mean"):
        # The three GEMMs are the same whatever the loss's reduction.
        xd = x.detach().to(dtype or x.dtype)
        wd = w.detach().to(dtype or w.dtype)
        logits = _logits_buffer(xd, wd)

        def call():
            torch.mm(xd, wd.T, out=logits)
            logits @ wd
            logits.T @ xd

        return call

    return build


def _dropping_gradients(
    call: Callable[[], None], x: torch.Tensor, w: torch.Tensor
) -> Callable[[], None]:
    """``call`` (a training step) with the ``reset`` that :func:`~linear_ce.bench.measure.measure`
    runs first: the previous call's gradients of ``x`` and ``w`` are dropped before the
    memory baseline is read."""

    def reset():
        x.grad = w.grad = None

    call.reset = reset
    return call


def _upstream(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random upstream gradients of the per-token log-probability and entropy."""
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randn(t.shape, generator=gen).to(t.device, dtype) for _ in range(2))


def _plain_logprobs(x, w, t):
    logp = torch.log_softmax(F.linear(x, w), dim=-1)
    valid = t != -100
    lp = logp.gather(-1, torch.where(valid, t, 0)[:, None])[:, 0] * valid
    return lp, -(logp.exp() * logp).sum(-1) * valid


def _linear_ce_logprobs(x, w, t):
    import linear_ce

    out = linear_ce.token_logprobs(x, w, t, entropy=True)
    return out.logprob, out.entropy


def _trl_logprobs(patched: bool):
    """Per-token log-probability and entropy through TRL's kernel call, as its fused LM
    head makes it (ignored targets clamped to 0, outputs zeroed there): TRL's own
    ``ChunkedLogProbFunction`` or, ``patched``, the one of :mod:`linear_ce.integrations.trl`."""

    def fn(x, w, t):
        valid = t != -100
        args = (x, w, None, torch.where(valid, t, 0), 1.0, 32768, None, 1.0)
        outputs = ("log_probs", "entropy")
        if patched:
            from linear_ce.integrations.trl import TokenLogprobsFunction

            lp, ent, *_ = TokenLogprobsFunction.apply(*args, outputs, None)
        else:
            from trl.kernels import ChunkedLogProbFunction

            lp, ent, *_ = ChunkedLogProbFunction.apply(*args, outputs)
        return lp * valid, ent * valid

    return fn


def _train_logprobs(fn) -> Build:
    def build(x, w, t):
        g_lp, g_h = _upstream(t, x.dtype)

        def call():
            lp, ent = fn(x, w, t)
            ((lp * g_lp.to(lp.dtype)).sum() + (ent * g_h.to(ent.dtype)).sum()).backward()

        return _dropping_gradients(call, x, w)

    return build


def _rl_side(t: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Old log-probabilities, advantages and token-mean weights of a GRPO-like step."""
    gen = torch.Generator().manual_seed(2)
    valid = (t != -100).to(dtype)
    return {
        "old_logprob": (-torch.rand(t.shape, generator=gen) * 3).to(t.device, dtype),
        "advantage": torch.randn(t.shape, generator=gen).to(t.device, dtype),
        "weight": valid / valid.sum().clamp(min=1),
    }


def _surrogate(logprob, old_logprob, advantage, weight):
    ratio = torch.exp(logprob - old_logprob)
    clipped = ratio.clamp(0.8, 1.2)
    return (-torch.min(ratio * advantage, clipped * advantage) * weight).sum()


#: The objective step's entropy bonus (PPO's; issue 31 measures "clip + entropy bonus").
_ENTROPY_BONUS = 0.01


def _objective(kind: str) -> Build:
    def build(x, w, t):
        side = _rl_side(t, torch.float32 if x.dtype in HALF_DTYPES else x.dtype)

        def call():
            import linear_ce

            if kind == "linear_ce":
                objectives = linear_ce.objectives
                objective = objectives.clipped_policy_gradient(0.2, 0.2)
                objective = objective + objectives.entropy_bonus(_ENTROPY_BONUS)
                linear_ce.token_objective(x, w, t, objective, entropy=True, **side).backward()
                return
            lp, ent = (_linear_ce_logprobs if kind == "logprobs" else _plain_logprobs)(x, w, t)
            bonus = (ent * side["weight"].to(ent.dtype)).sum()
            (_surrogate(lp, **side) - _ENTROPY_BONUS * bonus).backward()

        return _dropping_gradients(call, x, w)

    return build


def _teacher(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher of the point's shape: its own hidden states and head, fixed by a seed."""
    gen = torch.Generator().manual_seed(3)
    xt = torch.randn(x.shape, generator=gen).to(x.device, x.dtype)
    wt = (torch.randn(w.shape, generator=gen) * w.shape[1] ** -0.5).to(w.device, w.dtype)
    return xt, wt


def _floor_two_heads(dtype: torch.dtype | None) -> Build:
    def build(x, w, t):
        xd = x.detach().to(dtype or x.dtype)
        wd = w.detach().to(dtype or w.dtype)
        xt, wt = (a.to(dtype or a.dtype) for a in _teacher(x, w))
        logits, teacher_logits = _logits_buffer(xd, wd), _logits_buffer(xt, wt)

        def call():
            torch.mm(xd, wd.T, out=logits)
            torch.mm(xt, wt.T, out=teacher_logits)
            logits @ wd
            logits.T @ xd

        return call

    return build


def _plain_forward_kl(xs, ws, xt, wt, t):
    valid = t != -100
    log_p = torch.log_softmax(F.linear(xs[valid], ws).float(), dim=-1)
    log_q = torch.log_softmax(F.linear(xt[valid], wt).float(), dim=-1)
    return (log_q.exp() * (log_q - log_p)).sum() / valid.sum()


def _divergence(kind: str) -> Build:
    def build(x, w, t):
        xt, wt = _teacher(x, w)

        def call():
            if kind == "linear_ce":
                import linear_ce

                linear_ce.linear_divergence(x, w, xt, wt, t).backward()
            elif kind == "trl":
                from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

                valid = t != -100
                per_token, _ = ChunkedDivergenceFunction.apply(
                    x[valid], w, None, xt[valid], wt, None, 0.0
                )
                per_token.mean().backward()
            else:
                _plain_forward_kl(x, w, xt, wt, t).backward()

        return _dropping_gradients(call, x, w)

    return build


# ----------------------------------------------------------------------------- DPO step

#: Tokens per sequence of the DPO point (the issue's T = 256): N rows are N / 256
#: sequences, chosen first, then rejected, the first quarter of each a prompt (ignored).
DPO_SEQUENCE = 256
_DPO_BETA = 0.1


def _dpo_shape(point: Point) -> str | None:
    if point.N % (2 * DPO_SEQUENCE):
        return f"N must be a multiple of {2 * DPO_SEQUENCE} (pairs of {DPO_SEQUENCE} tokens)"
    return None


def dpo_scored(t: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: the rows of a DPO point's targets ``t`` that are scored (not a prompt)."""
    rows = torch.ones(t.shape[0] // DPO_SEQUENCE, DPO_SEQUENCE, dtype=torch.bool)
    rows[:, : DPO_SEQUENCE // 4] = False
    return rows.reshape(-1).to(t.device)


def _dpo_batch(
    t: torch.Tensor, classes: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2B, T)`` targets with the prompts ignored and the reference's summed
    log-probabilities ``(2B,)``, near the policy's (logits O(1): about ``-log V`` a token)."""
    rows = torch.where(dpo_scored(t), t, -100).reshape(-1, DPO_SEQUENCE)
    gen = torch.Generator().manual_seed(4)
    scored = (rows != -100).sum(1).double()
    ref = scored * -math.log(classes) + torch.randn(
        rows.shape[0], generator=gen, dtype=torch.float64
    )
    return rows, ref.to(t.device, dtype)


def _floor_scored(dtype: torch.dtype | None) -> Build:
    """The three GEMMs of :func:`_floor` on the scored rows of a DPO point only: what any
    head that skips the prompts must do at least."""

    def build(x, w, t):
        return _floor(dtype)(x.detach()[dpo_scored(t)], w, t)

    return build


def _dpo_loss(logprob_sum: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    chosen, rejected = (logprob_sum - ref).chunk(2)
    return -F.logsigmoid(_DPO_BETA * (chosen - rejected)).mean()


def _dpo(kind: str) -> Build:
    """A DPO (sigmoid) step: the plain expression on the full logits, linear_ce's per-token
    log-probabilities summed in torch (four GEMMs), or the fused sequence objective."""

    def build(x, w, t):
        rows, ref = _dpo_batch(t, w.shape[0], torch.float32 if x.dtype in HALF_DTYPES else x.dtype)
        flat = rows.reshape(-1)

        def call():
            import linear_ce

            if kind == "linear_ce":
                linear_ce.sequence_objective(
                    x.view(*rows.shape, x.shape[-1]),
                    w,
                    rows,
                    linear_ce.objectives.dpo(_DPO_BETA),
                    group="pairs",
                    ref_logprob=ref,
                ).loss.backward()
                return
            if kind == "logprobs":
                lp = linear_ce.token_logprobs(x, w, flat).logprob
            else:
                lp, _ = _plain_logprobs(x, w, flat)
            _dpo_loss(lp.reshape(rows.shape).to(ref.dtype).sum(1), ref).backward()

        return _dropping_gradients(call, x, w)

    return build


#: Slots of the stored teacher at a sparse-distillation point.
SPARSE_K = 64


def _sparse_teacher(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
    """A stored teacher's top-k of the point's shape: ids (int64) and log-probabilities
    (bf16, the usual storage), from :func:`_teacher`'s head by ``token_logprobs(topk=)``."""
    import linear_ce

    xt, wt = _teacher(x, w)
    with torch.no_grad():
        top = linear_ce.token_logprobs(xt, wt, torch.zeros_like(t), topk=SPARSE_K)
    return top.topk_ids, top.topk_logprobs.bfloat16()


def _sparse(kind: str) -> Build:
    """A sparse-distillation training step (forward KL to the stored teacher renormalised
    over its top-k, mean over the valid rows): ``linear_ce.sparse_divergence``, or the
    plain expression, which forms the dense ``(N, V)`` target from the slots each step."""

    def build(x, w, t):
        ids, logprobs = _sparse_teacher(x, w, t)

        def call():
            if kind == "linear_ce":
                import linear_ce

                linear_ce.sparse_divergence(x, w, ids, logprobs, t).backward()
                return
            valid = t != -100
            log_p = torch.log_softmax(F.linear(x[valid], w).float(), dim=-1)
            q = torch.softmax(logprobs[valid].float(), dim=-1)
            dense = torch.zeros_like(log_p).scatter_(1, ids[valid], q)
            log_q = torch.zeros_like(log_p).scatter_(1, ids[valid], q.log())
            ((dense * (log_q - log_p)).sum() / valid.sum()).backward()

        return _dropping_gradients(call, x, w)

    return build


def _floor_fwd(x, w, t):
    dtype_name = str(x.dtype).removeprefix("torch.")
    point = Point(x.shape[0], x.shape[1], w.shape[0], dtype_name, x.device.type)
    dtype = x.dtype if _native(point) else torch.float32
    xd, wd = x.detach().to(dtype), w.detach().to(dtype)
    logits = _logits_buffer(xd, wd)

    def call():
        torch.mm(xd, wd.T, out=logits)

    return call


def _train(loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Build:
    def build(x, w, t):
        def call():
            loss_fn(x, w, t).backward()

        return _dropping_gradients(call, x, w)

    return build


def _train_reduced(loss_fn: Callable[..., torch.Tensor]) -> Build:
    """:func:`_train` of a loss that takes ``reduction=``; ``"none"`` backpropagates the
    sum of the per-row losses."""

    def build(x, w, t, reduction="mean"):
        def loss(x, w, t):
            out = loss_fn(x, w, t, reduction=reduction)
            return out.sum() if reduction == "none" else out

        return _train(loss)(x, w, t)

    return build


def _plain(x, w, t, reduction="mean"):
    return F.cross_entropy(F.linear(x, w), t, reduction=reduction)


def _compiled_plain(x, w, t):
    compiled = torch.compile(_plain, dynamic=True)
    return _train(compiled)(x, w, t)


def _torch_builtin(batch_chunk_size: int | None) -> Build:
    def loss(x, w, t):
        options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=batch_chunk_size)
        return F.linear_cross_entropy(x, w, t, options=options)

    return _train(loss)


def _linear_ce(acc_policy: str | None) -> Callable:
    def loss(x, w, t, reduction="mean"):
        import linear_ce

        options = (
            None
            if acc_policy is None
            else linear_ce.LinearCrossEntropyOptions(acc_policy=acc_policy)
        )
        return linear_ce.linear_cross_entropy(x, w, t, reduction=reduction, options=options)

    return loss


def describe_plan(point: Point, acc_policy: str = "auto", gradients: bool = True) -> dict:
    """The plan ``linear_ce.linear_cross_entropy`` makes at ``point`` (no softcap, default
    options but ``acc_policy``; one tile, with ``gradients`` or without), the fixed rule's
    plan (``LINEAR_CE_MEASURE=0``) next to it, and the measured rates the choice was made
    from (:mod:`linear_ce.engine.machine`; asked in the worker after the warm-up call, so nothing
    is measured again). ``chunk_rates``: GFLOP/s of the three GEMMs of a chunk (logits,
    input gradient, weight gradient, all three), the spread of their rounds and how busy
    the threads were, by rows and layout, for the sizes up to the fixed rule's."""
    import os

    from linear_ce import LinearCrossEntropyOptions
    from linear_ce.engine import machine
    from linear_ce.engine.plan import make_plan

    dtype, device = point.torch_dtype, torch.device(point.device)
    options = LinearCrossEntropyOptions(acc_policy=acc_policy)
    # Without gradients a CPU call takes the statistics pass where the compiled loops of its
    # tile's dtype build (engine.chunk_loop.run_head; the cross-entropy head takes them).
    stats = not gradients and device.type == "cpu" and machine.forced_stats_block() != 0

    def plan_now():
        return make_plan(
            point.N, point.D, point.V, dtype, device, options, gradients=gradients,
            stats_pass=stats, gathered=stats and point.ignored > 0,
        )  # fmt: skip

    plan = plan_now()
    if stats and not _stats_loops(plan):
        stats = False
        plan = plan_now()
    saved = os.environ.get(machine.MEASURE_ENV)
    os.environ[machine.MEASURE_ENV] = "0"
    try:
        fixed = plan_now()
    finally:
        if saved is None:
            del os.environ[machine.MEASURE_ENV]
        else:
            os.environ[machine.MEASURE_ENV] = saved
    known = machine.known_rates(plan.gemm.operand_dtype, point.D)
    half = machine.known_rates(dtype, point.D)["half"] if dtype in HALF_DTYPES else None
    return {
        **_plan_fields(plan, point.N, stats),
        "fixed_rule": _plan_fields(fixed, point.N, stats),
        "chunk_rates": {
            f"{rows} {'class' if major else 'row'}": [round(v, 3) for v in rates]
            for (rows, major), rates in sorted(known["chunk"].items())
            if rows <= max(fixed.rows_per_chunk, machine.CANDIDATE_ROWS[0])
        },
        "half_speedup": None if half is None else [round(v, 3) for v in half],
        "step_rates": {
            rows: [round(v, 3) for v in rates]
            for rows, rates in sorted(machine.known_rates(dtype, 0)["step"].items())
        },
    }


def describe_divergence_plan(point: Point) -> dict:
    """The plan ``linear_ce.linear_divergence`` ran at ``point`` (its default options): the
    call made once more on the point's inputs, its chunk loop watched; where the compiled
    pair loops took its tiles (:func:`linear_ce.engine.chunk_loop._native_pair`), the
    layout says so and in which dtype. No fixed rule or rates beside it: the loop's chunks
    are the budget's longest (``DIVERGENCE_SHARE``), not a measured choice."""
    import linear_ce
    from linear_ce.engine import chunk_loop

    seen = []
    original = chunk_loop.run_chunks

    def watched(input, weight, bias, head, transform, plan, **kwargs):
        vocab, companion = kwargs.get("vocab"), kwargs.get("companion")
        pair = chunk_loop._native_pair(
            input, plan.acc_dtype, head, transform, vocab, bias, companion, plan.gemm
        )
        seen.append((plan, pair))
        return original(input, weight, bias, head, transform, plan, **kwargs)

    x, w, t = make_inputs(point)
    xt, wt = _teacher(x, w)
    chunk_loop.run_chunks = watched
    try:
        linear_ce.linear_divergence(x.requires_grad_(), w.requires_grad_(), xt, wt, t).backward()
    finally:
        chunk_loop.run_chunks = original
    plan, pair = seen[0]
    fields = _plan_fields(plan, int((t != -100).sum()))
    if pair is not None:
        dtype = str(pair.dtype).removeprefix("torch.")
        layout = fields["layout"] if pair.dtype == plan.acc_dtype else "row-major"
        fields |= {"layout": f"{dtype} {layout} tiles", "row_loops": "compiled pair", "exp": None}
    else:
        fields["row_loops"] = "torch"
    return {**fields, "fixed_rule": fields, "chunk_rates": {}, "half_speedup": None}


def _plan_fields(plan, rows: int, stats_pass: bool = False) -> dict:
    half_tile = plan.rows_per_step < plan.rows_per_chunk
    return {
        "rows_per_chunk": plan.rows_per_chunk,
        "chunks": -(-rows // max(plan.rows_per_chunk, 1)),
        "rows_per_step": plan.rows_per_step,
        "layout": (
            f"statistics pass, {plan.classes_per_block}-class blocks"
            if stats_pass
            else f"half tile, {plan.rows_per_step}-row steps"
            if half_tile
            else "class-major"
            if plan.gemm.class_major
            else "row-major"
        ),
        "gemm": type(plan.gemm).__name__,
        "weight_grad": plan.weight_grad,
        # How eᵘ is formed: a choice of half inputs' fp32 math on a CPU only (Plan.exp2).
        "exp": ("exp2" if plan.exp2 else "exp")
        if plan.input_dtype in HALF_DTYPES and type(plan.gemm).__name__ != "CudaOutDtype"
        else None,
        # The row math of the heads that take them (engine/native_rows.py): compiled loops
        # where they build, for half tiles and fp32 tiles on a CPU.
        "row_loops": _row_loops(plan, stats_pass),
    }


def _stats_loops(plan) -> bool:
    """Whether the compiled loops take a statistics pass's tile on ``plan``: fp32 row math,
    and the loops of the tile's dtype (the input's with native half GEMMs) build."""
    from linear_ce.engine.native_rows import native_rows

    native = type(plan.gemm).__name__ == "NativeHalf"
    tile = plan.input_dtype if native else plan.acc_dtype
    return plan.acc_dtype == torch.float32 and native_rows(tile) is not None


def _row_loops(plan, stats_pass: bool = False) -> str | None:
    from linear_ce.engine.native_rows import native_rows

    if stats_pass:
        return "compiled"
    if type(plan.gemm).__name__ == "CudaOutDtype" or plan.input_dtype == torch.float64:
        return None
    half_tile = plan.rows_per_step < plan.rows_per_chunk
    if plan.input_dtype in HALF_DTYPES and not half_tile:
        return "torch"
    return "compiled" if native_rows(plan.input_dtype) is not None else "torch"


def plan_note(plan: dict | None) -> str:
    """A line of the table about a plan from :func:`describe_plan`: its chunks, tile layout
    and GEMM backend, the fixed rule's where they differ, the measured rates (the
    faster layout's, by rows) where a steady measurement is known, and the scratch the
    worker's calls found kept (``kept_scratch_bytes``, :mod:`linear_ce.engine.scratch`)."""
    if not plan:
        return ""

    def short(p: dict) -> str:
        exp = f", {p['exp']}" if p.get("exp") else ""
        loops = f", {p['row_loops']} row loops" if p.get("row_loops") else ""
        return f"{p['chunks']}×{p['rows_per_chunk']} rows, {p['layout']}, {p['gemm']}{exp}{loops}"

    text = short(plan)
    if short(plan["fixed_rule"]) != text:
        text += f" (fixed rule: {short(plan['fixed_rule'])})"
    rates = plan["chunk_rates"]
    if rates:
        best: dict[int, float] = {}
        for key, r in rates.items():
            rows = int(key.split()[0])
            best[rows] = max(best.get(rows, 0.0), r[3])
        text += "; GFLOP/s " + " ".join(f"{b}:{best[b]:.0f}" for b in sorted(best))
        from linear_ce.engine import machine

        quiet = [
            r[-2] <= 1 + machine.NOISE_LIMIT and r[-1] >= machine.MIN_BUSY for r in rates.values()
        ]
        if not all(quiet):
            text += " (unsteady: not used)"
    half = plan["half_speedup"]
    if half:
        from linear_ce.engine import machine

        text += f"; half/fp32 GEMM {half[0]:.2f}×"
        if not (half[-2] <= 1 + machine.NOISE_LIMIT and half[-1] >= machine.MIN_BUSY):
            text += " (unsteady: not used)"
    kept = plan.get("kept_scratch_bytes")
    if kept:
        text += f"; {kept / 2**20:.0f} MiB scratch kept between calls"
    return text


def _forward(loss_fn: Callable) -> Build:
    def build(x, w, t):
        xd, wd = x.detach(), w.detach()

        def call():
            with torch.no_grad():
                loss_fn(xd, wd, t)

        return call

    return build


def _cce(x, w, t):
    from cut_cross_entropy import linear_cross_entropy

    impl = "cce" if x.device.type == "cuda" else "torch_compile"
    return linear_cross_entropy(x, w, t, impl=impl)


def _liger(x, w, t):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss()(w, x, t)


def _needs_module(module: str, cuda_only: bool = False) -> Callable[[Point], str | None]:
    def unavailable(point: Point) -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
        if cuda_only and point.device != "cuda":
            return f"{module} runs on CUDA only"
        return None

    return unavailable


def _same_dtype_floor(point: Point) -> str | None:
    if not _native(point):
        return f"no native {point.dtype} GEMM on this {point.device}; see floor-fp32"
    return None


def _half_only(point: Point) -> str | None:
    return None if point.torch_dtype in HALF_DTYPES else "only for fp16/bf16 inputs"


def _has_builtin(point: Point) -> str | None:
    if not hasattr(F, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
    return None


#: The heads measured against the three GEMMs on all N rows: a DPO point's prompts are
#: never scored, so its floors are the ``floor-scored`` ones.
_NOT_DPO = tuple(h for h in HEADS if h != "dpo")

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant(
            "floor",
            "train",
            _floor(None),
            _same_dtype_floor,
            "the three GEMMs alone, in the input dtype",
            _NOT_DPO,
            reductions=REDUCTIONS,
        ),
        Variant(
            "floor-fp32",
            "train",
            _floor(torch.float32),
            _half_only,
            "the three GEMMs alone, in fp32",
            _NOT_DPO,
            reductions=REDUCTIONS,
        ),
        Variant(
            "floor-scored",
            "train",
            _floor_scored(None),
            lambda point: _dpo_shape(point) or _same_dtype_floor(point),
            "the three GEMMs alone on the scored rows (3/4 of N: no prompt), in the input dtype",
            ("dpo",),
        ),
        Variant(
            "floor-scored-fp32",
            "train",
            _floor_scored(torch.float32),
            lambda point: _dpo_shape(point) or _half_only(point),
            "the three GEMMs alone on the scored rows (3/4 of N: no prompt), in fp32",
            ("dpo",),
        ),
        Variant(
            "floor-2heads",
            "train",
            _floor_two_heads(None),
            _same_dtype_floor,
            "the four GEMMs of distillation alone (two logits, two student gradients)",
            ("divergence",),
        ),
        Variant(
            "floor-2heads-fp32",
            "train",
            _floor_two_heads(torch.float32),
            _half_only,
            "the four GEMMs of distillation alone, in fp32",
            ("divergence",),
        ),
        Variant(
            "plain",
            "train",
            _train_reduced(_plain),
            _always,
            "cross_entropy(linear(x, W), t), eager",
            reductions=REDUCTIONS,
            half_gemms=True,
        ),
        Variant(
            "plain-compile",
            "train",
            _compiled_plain,
            _always,
            "the plain expression under torch.compile",
            half_gemms=True,
        ),
        Variant(
            "torch",
            "train",
            _torch_builtin(None),
            _has_builtin,
            "torch's linear_cross_entropy, default options",
            half_gemms=True,
        ),
        Variant(
            "torch-512",
            "train",
            _torch_builtin(512),
            _has_builtin,
            "torch's linear_cross_entropy, 512-row chunks",
            half_gemms=True,
        ),
        Variant(
            "linear_ce",
            "train",
            _train_reduced(_linear_ce(None)),
            _always,
            "linear_ce, default options",
            describe=describe_plan,
            reductions=REDUCTIONS,
        ),
        *[
            Variant(
                f"linear_ce-{policy}",
                "train",
                _train(_linear_ce(policy)),
                _always,
                f"linear_ce, acc_policy={policy!r}",
                describe=lambda point, policy=policy: describe_plan(point, policy),
            )
            for policy in ("accurate", "balanced", "compact")
        ],
        Variant(
            "cce",
            "train",
            _train(_cce),
            _needs_module("cut_cross_entropy"),
            "Cut Cross-Entropy (torch_compile impl on CPU)",
            half_gemms=True,
        ),
        Variant(
            "liger",
            "train",
            _train(_liger),
            _needs_module("liger_kernel", cuda_only=True),
            "Liger-Kernel fused linear cross-entropy",
            half_gemms=True,
        ),
        Variant(
            "floor-fwd",
            "forward",
            _floor_fwd,
            _always,
            "the logits GEMM alone (fp32 for half inputs without native half GEMMs)",
        ),
        Variant(
            "linear_ce-fwd",
            "forward",
            _forward(_linear_ce(None)),
            _always,
            "linear_ce forward only, no gradients",
            describe=lambda point: describe_plan(point, gradients=False),
        ),
        Variant(
            "logprobs-plain",
            "train",
            _train_logprobs(_plain_logprobs),
            _always,
            "log_softmax of the full logits, gathered, and its entropy; backward of both",
            ("logprobs",),
            half_gemms=True,
        ),
        Variant(
            "logprobs-linear_ce",
            "train",
            _train_logprobs(_linear_ce_logprobs),
            _always,
            "linear_ce.token_logprobs(entropy=True); backward of both",
            ("logprobs",),
        ),
        Variant(
            "logprobs-trl",
            "train",
            _train_logprobs(_trl_logprobs(patched=False)),
            _needs_module("trl"),
            "TRL's fused-head kernel (ChunkedLogProbFunction), log_probs and entropy",
            ("logprobs",),
            half_gemms=True,
        ),
        Variant(
            "logprobs-trl-patched",
            "train",
            _train_logprobs(_trl_logprobs(patched=True)),
            _needs_module("trl"),
            "the same call with linear_ce.integrations.trl patched in",
            ("logprobs",),
        ),
        Variant(
            "objective-plain",
            "train",
            _objective("plain"),
            _always,
            "clipped policy gradient + entropy bonus on log_softmax of the full logits",
            ("objective",),
            half_gemms=True,
        ),
        Variant(
            "objective-logprobs",
            "train",
            _objective("logprobs"),
            _always,
            "linear_ce.token_logprobs, then the same objective outside (4 GEMMs)",
            ("objective",),
        ),
        Variant(
            "objective-linear_ce",
            "train",
            _objective("linear_ce"),
            _always,
            "linear_ce.token_objective(clipped_policy_gradient + entropy_bonus) (3 GEMMs)",
            ("objective",),
        ),
        Variant(
            "divergence-plain",
            "train",
            _divergence("plain"),
            _always,
            "forward KL(teacher || student) on both full logits of the valid rows",
            ("divergence",),
            half_gemms=True,
        ),
        Variant(
            "divergence-linear_ce",
            "train",
            _divergence("linear_ce"),
            _always,
            "linear_ce.linear_divergence(beta=0), mean (4 GEMMs)",
            ("divergence",),
            describe=describe_divergence_plan,
        ),
        Variant(
            "divergence-trl",
            "train",
            _divergence("trl"),
            _needs_module("trl"),
            "TRL's ChunkedDivergenceFunction(beta=0) on the valid rows, mean",
            ("divergence",),
            half_gemms=True,
        ),
        Variant(
            "dpo-plain",
            "train",
            _dpo("plain"),
            _dpo_shape,
            "DPO (sigmoid) on log_softmax of the full logits, summed per sequence",
            ("dpo",),
            half_gemms=True,
        ),
        Variant(
            "dpo-logprobs",
            "train",
            _dpo("logprobs"),
            _dpo_shape,
            "linear_ce.token_logprobs, summed per sequence and DPO in torch (4 GEMMs)",
            ("dpo",),
        ),
        Variant(
            "dpo-linear_ce",
            "train",
            _dpo("linear_ce"),
            _dpo_shape,
            "linear_ce.sequence_objective(objectives.dpo, group='pairs') (3 GEMMs)",
            ("dpo",),
        ),
        Variant(
            "sparse-plain",
            "train",
            _sparse("plain"),
            _always,
            f"forward KL to a stored top-{SPARSE_K} teacher as a dense (N, V) target, on the "
            "full logits of the valid rows",
            ("sparse",),
            half_gemms=True,
        ),
        Variant(
            "sparse-linear_ce",
            "train",
            _sparse("linear_ce"),
            _always,
            f"linear_ce.sparse_divergence, top-{SPARSE_K} bf16 slots, mean (3 GEMMs)",
            ("sparse",),
        ),
    ]
}

#: Measured when ``--variants`` is not given.
DEFAULT = (
    "floor",
    "floor-fp32",
    "plain",
    "plain-compile",
    "torch",
    "torch-512",
    "linear_ce",
    "cce",
    "liger",
    "floor-fwd",
    "linear_ce-fwd",
    "logprobs-plain",
    "logprobs-linear_ce",
    "logprobs-trl",
    "logprobs-trl-patched",
    "objective-plain",
    "objective-logprobs",
    "objective-linear_ce",
    "floor-2heads",
    "floor-2heads-fp32",
    "divergence-plain",
    "divergence-linear_ce",
    "divergence-trl",
    "sparse-plain",
    "sparse-linear_ce",
)

#: The DPO step's rows (``--heads dpo``) and their floors, named with ``--variants``: kept out
#: of :data:`DEFAULT`, whose runs measure every default row.
DPO_VARIANTS = (
    "floor-scored",
    "floor-scored-fp32",
    "dpo-plain",
    "dpo-logprobs",
    "dpo-linear_ce",
)


#: Measured at the swept points only, not at the extra (masked, per-token) ones: the
#: default run stays short (under 5 minutes on 2 cores), and the extra points keep the
#: floors, the plain expression and linear_ce.
SWEEP_ONLY = frozenset(
    {
        "plain-compile",
        "torch",
        "torch-512",
        "linear_ce-accurate",
        "linear_ce-balanced",
        "linear_ce-compact",
        "cce",
        "liger",
        "floor-fwd",
        "linear_ce-fwd",
    }
)


def measured_at(name: str, point: Point) -> bool:
    """Whether variant ``name`` is measured at ``point``: the point's head and reduction
    are among the variant's, and the variant is not :data:`SWEEP_ONLY` unless the point is
    swept."""
    variant = VARIANTS[name]
    return (
        point.head in variant.heads
        and point.reduction in variant.reductions
        and (point.swept or name not in SWEEP_ONLY)
    )


def reference_variant(point: Point, kind: str) -> str:
    """The floor a variant's time is divided by: ``floor-fwd`` for forward
    variants; ``floor-fp32`` for half inputs (the targets' reference), else ``floor``;
    at a distillation point the four-GEMM ``floor-2heads`` (``-fp32``) instead, at a DPO
    point ``floor-scored`` (``-fp32``), the GEMMs of the scored rows."""
    if kind == "forward":
        return "floor-fwd"
    base = _floor_base(point)
    return f"{base}-fp32" if point.torch_dtype in HALF_DTYPES else base


def _floor_base(point: Point) -> str:
    return {"divergence": "floor-2heads", "dpo": "floor-scored"}.get(point.head, "floor")


def own_floor_variant(point: Point, kind: str) -> str | None:
    """For a half-precision training variant, the floor in its own dtype (``floor``, or
    ``floor-2heads`` at a distillation point, ``floor-scored`` at a DPO point): the
    reference of the native-half targets, next to :func:`reference_variant`'s fp32 one.
    ``None`` elsewhere."""
    if kind == "forward" or point.torch_dtype not in HALF_DTYPES:
        return None
    return _floor_base(point)


def make_inputs(point: Point, seed: int = 0) -> Inputs:
    """Hidden states ``(N, D)``, weight ``(V, D)`` scaled so logits are O(1), targets ``(N,)``
    (a share ``point.ignored`` of them set to -100, the ignore index of every variant)."""
    gen = torch.Generator().manual_seed(seed)
    dtype, device = point.torch_dtype, torch.device(point.device)
    x = torch.randn(point.N, point.D, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(point.V, point.D, generator=gen) * point.D**-0.5).to(
        device=device, dtype=dtype
    )
    t = torch.randint(0, point.V, (point.N,), generator=gen)
    if point.ignored:
        t[torch.rand(point.N, generator=gen) < point.ignored] = -100
    return x.requires_grad_(), w.requires_grad_(), t.to(device)
