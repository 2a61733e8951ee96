r"""The gradient pass over vocabulary blocks, for heads whose row statistics are known.

Once a forward has produced each row's log-normaliser (and what else its head's
gradient needs, such as the entropy), the gradient of a logit depends on that logit and
its row's statistics alone: no row reduction, no collective over vocabulary shards. This
pass therefore walks the vocabulary in blocks of ``C`` classes and takes every valid row
of a block at once (or large groups of rows, see
:func:`linear_ce.engine.plan.choose_vocab_blocks`). Per block ``b`` and group of rows ``X``:

.. math::

    S = X W_b^\top + b_b, \quad
    G = \partial L / \partial S \text{ (the head, in place)}, \quad
    \nabla W_b \mathrel{+}= G^\top X, \quad
    \nabla X \mathrel{+}= G W_b.

With one group the weight gradient of a block is written by one GEMM whose inner
dimension is the number of rows, instead of being summed over row chunks: the GEMMs
stay large, and half inputs get a single rounding of it. Nothing grows with
``N·V``: the ``(rows, C)`` tile (one more for a softcap's derivative) is reused by
every block.

The tile is laid out as the plan's GEMM backend's logits buffer: class-major on a CPU,
row-major under CUDA's ``out_dtype`` GEMM, or as ``LINEAR_CE_TILE_LAYOUT`` forces it
(:mod:`linear_ce.engine.machine`; ``row-major`` runs CUDA's layout, each block's and group's
tile a dense view of one flat buffer, on a CPU).

With native half GEMMs on a CPU (:class:`~linear_ce.engine.gemm.NativeHalf`), no bias and no
softcap, a head that takes them (``half_blocks``) gets *half blocks*: the logits GEMM writes
the block's logits in the input dtype (the rounding the widened fp32 tile held anyway) into a
row-major tile, the compiled row loops (:mod:`linear_ce.engine.native_rows`) apply the
transform's factor and write the gradient over it, rounded once to the input dtype (as the
fp32 tile's gradient was, to become the GEMMs' operand), and the tile is the gradient GEMMs'
operand: no widening copy, no narrowing copy, half the bytes for the loops.
"""

from __future__ import annotations

import torch

from linear_ce.engine.chunk_loop import (
    Gradients,
    Needs,
    add_grad_input_rows,
    tiles_for,
    without_autocast,
)
from linear_ce.engine.gemm import NativeHalf
from linear_ce.engine.head import KnownStatsHead
from linear_ce.engine.native_rows import native_rows
from linear_ce.engine.plan import Plan, make_plan
from linear_ce.engine.row_chunks import chunk_size, gather_buffers, row_chunks, rows_of
from linear_ce.engine.scratch import keeps_scratch, scratch
from linear_ce.engine.transform import LogitTransform
from linear_ce.options import LinearCrossEntropyOptions

__all__ = ["run_vocab_pass", "vocab_pass_gradients"]


def vocab_pass_gradients(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    head: KnownStatsHead,
    transform: LogitTransform,
    options: LinearCrossEntropyOptions,
    needs: tuple[bool, bool, bool],
) -> Gradients:
    """:func:`run_vocab_pass` on its own plan (:func:`linear_ce.engine.plan.make_plan` with
    ``vocab_pass=True``), for the gradients ``needs`` asks for (input, weight, bias)."""
    rows, in_features = input.shape
    plan = make_plan(
        rows,
        in_features,
        weight.shape[0],
        input.dtype,
        input.device,
        options,
        tiles=tiles_for(False, transform, True),
        vocab_pass=True,
        gathered=not bool(head.valid.all()),
        half_blocks=_half_blocks_allowed(input, head, transform, bias),
    )
    need_x, need_w, need_b = needs
    asked = Needs(need_x, need_w, need_b and bias is not None)
    return run_vocab_pass(input, weight, bias, head, transform, plan, asked)


@without_autocast
@keeps_scratch
def run_vocab_pass(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    head: KnownStatsHead,
    transform: LogitTransform,
    plan: Plan,
    needs: Needs,
) -> Gradients:
    """The gradients ``needs`` asks for of ``head``'s loss (its upstream gradients folded
    in) for ``input`` ``(N, F)``, ``weight`` ``(V, P, F)`` and ``bias`` ``(V, P)``, in
    vocabulary blocks of ``plan.classes_per_block`` classes and groups of
    ``plan.rows_per_chunk`` valid rows."""
    grad_input, grad_weight, grad_bias = needs
    rows, in_features = input.shape
    classes, positions, _ = weight.shape
    acc, device, gemm = plan.acc_dtype, input.device, plan.gemm
    group = min(plan.rows_per_chunk, max(rows, 1))
    block = min(plan.classes_per_block, max(classes, 1))
    groups = row_chunks(head.valid, group, device)
    # Flat storage, viewed per block in the backend's tile layout, so the last (narrower)
    # block and group get dense tiles too.
    half = _half_blocks(input, plan, head, transform, bias)
    class_major = not half and gemm.logits_buffer(2, 3, acc, device).stride(0) == 1
    tile_store = scratch((group * block,), plan.input_dtype if half else acc, device)
    sech2_store = (
        scratch((group * block,), tile_store.dtype, device)
        if transform.softcap is not None
        else None
    )
    x_rows_buf, gx_rows_buf = gather_buffers(groups, group, input, acc, grad_input)
    grad_x = torch.zeros((rows, in_features), dtype=acc, device=device) if grad_input else None
    grad_w = (
        torch.zeros(weight.shape, dtype=plan.input_dtype, device=device) if grad_weight else None
    )
    # One group of rows: a block's weight gradient is one GEMM, written into the result in
    # its dtype where the GEMM's product has it (one rounding, as the sum's), not summed in
    # the scratch and copied (bf16 token_logprobs at N=2048, F=1024, V=32768: three passes
    # over a (C, F) block per block saved).
    direct = [len(g) == 1 and gemm.operand_dtype == plan.input_dtype for g in groups]
    # Otherwise a half weight gradient is summed over groups in a block-sized fp32 scratch.
    w_sum = (
        torch.empty((block, in_features), dtype=acc, device=device)
        if grad_weight and acc != plan.input_dtype and not all(direct)
        else None
    )
    grad_b = torch.zeros((classes, positions), dtype=acc, device=device) if grad_bias else None

    for p in range(positions):
        if not groups[p]:
            continue
        b_p = None if bias is None else bias[:, p].to(acc)
        for start in range(0, classes, block):
            span = slice(start, min(start + block, classes))
            width = span.stop - span.start
            w_op = gemm.weight_operand(weight[span, p, :])
            if grad_weight and not direct[p]:
                w_acc = grad_w[span, p] if w_sum is None else w_sum[:width].zero_()
            for group_rows in groups[p]:
                n = chunk_size(group_rows)
                x_op = gemm.operand(rows_of(input, group_rows, x_rows_buf))
                s = _tile(tile_store, n, width, class_major)
                sech2 = None if sech2_store is None else _tile(sech2_store, n, width, class_major)
                if half:
                    gemm.half_logits(s, x_op, w_op)
                    head.grad_half_block(s, group_rows, p, span, transform.factor)
                else:
                    gemm.logits(s, x_op, w_op)
                    if b_p is not None:
                        s.add_(b_p[span])
                    transform.apply_(s, sech2)
                    head.grad_block(s, group_rows, p, span, transform.factor)
                if sech2 is not None:
                    s.mul_(sech2)
                if grad_bias:
                    grad_b[span, p].add_(s.sum(0))
                if not (grad_input or grad_weight):
                    continue
                g_op = gemm.operand(s)
                if grad_input:
                    add_grad_input_rows(gemm, grad_x, group_rows, g_op, w_op, gx_rows_buf)
                if grad_weight and direct[p]:
                    gemm.product_into(grad_w[span, p], g_op.T, x_op)
                elif grad_weight:
                    gemm.add_product(w_acc, g_op.T, x_op)
            if grad_weight and w_sum is not None and not direct[p]:
                grad_w[span, p].copy_(w_acc)

    out_dtype = plan.input_dtype
    return Gradients(
        input=None if grad_x is None else grad_x.to(out_dtype),
        weight=grad_w,
        bias=None if grad_b is None else grad_b.to(out_dtype),
    )


def _half_blocks(
    input: torch.Tensor,
    plan: Plan,
    head: KnownStatsHead,
    transform: LogitTransform,
    bias: torch.Tensor | None,
) -> bool:
    """Whether the pass takes half blocks (see the module doc): native half GEMMs on a CPU,
    no bias and no softcap (their terms would round in the half tile), a head that takes
    them, and the compiled row loops for the input dtype."""
    return isinstance(plan.gemm, NativeHalf) and _half_blocks_allowed(input, head, transform, bias)


def _half_blocks_allowed(
    input: torch.Tensor,
    head: KnownStatsHead,
    transform: LogitTransform,
    bias: torch.Tensor | None,
) -> bool:
    """Whether the call allows half blocks, should its plan's GEMMs be native half ones."""
    return (
        input.device.type == "cpu"
        and bias is None
        and transform.softcap is None
        and getattr(head, "half_blocks", False)
        and native_rows(input.dtype) is not None
    )


def _tile(store: torch.Tensor, rows: int, classes: int, class_major: bool) -> torch.Tensor:
    """A dense ``(rows, classes)`` view of the front of ``store``, class-major or row-major."""
    flat = store[: rows * classes]
    return flat.view(classes, rows).T if class_major else flat.view(rows, classes)
