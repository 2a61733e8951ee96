"""Mutation check: does the suite catch the mistakes it claims to?

Each mutation below is a deliberate mistake, written as text replacements in
one source file, with the tests that should catch it. The script copies the
repository to a scratch directory (the working tree is never edited, so an
interrupted run leaves nothing behind), checks that the selected tests pass
there unmutated, then applies one mutation at a time, runs its tests (``-x``:
the first failure is enough) and reports the mutation *killed* (some test
failed) or *survived* (every test passed: the suite misses that mistake).

A mutation whose anchor (the text it replaces) is not found exactly once is
reported as *anchor moved* and the others still run: a refactor that moves the
code must move the mutation too. Exit status 0 only when every mutation chosen
was killed and no anchor moved; a surviving mutation is a gap in the tests
(add the test), not a mutation to drop.

Every head and path has mutations (``family``); one per family is marked
``quick``: ``--quick`` runs those alone, without the unmutated baseline (CI runs
it right after ``make test``, which has run those tests unmutated).

Usage::

    python scripts/mutate.py               # every mutation (``make mutate``)
    python scripts/mutate.py --quick       # one per family (CI, ~2 minutes)
    python scripts/mutate.py -k divergence # those whose family or name has "divergence"
    python scripts/mutate.py --list        # families, names, files, tests; nothing run
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
    """``edits`` are ``(anchor, replacement)`` pairs applied in order to ``path`` (relative
    to the repository); each anchor must occur exactly once. ``tests`` are pytest
    arguments; ``family`` is the head or path the mistake is in; ``quick`` marks the
    family's representative for ``--quick``."""

    family: str
    name: str
    path: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    quick: bool = False


class AnchorMoved(Exception):
    """An anchor of a mutation is not found exactly once in its file."""


def _drop_module_argument(argument: str) -> Mutation:
    line = {
        "linear_bias": "            linear_bias=self.bias,\n",
        "weight": "            weight=self.class_weight,\n",
        "label_smoothing": "            label_smoothing=self.label_smoothing,\n",
        "reduction": "            reduction=self.reduction,\n",
        "options": "            options=self.options,\n",
        "ignore_index": "            ignore_index=self.ignore_index,\n",
        "z_loss": "            z_loss=self.z_loss,\n",
        "softcap": "            softcap=self.softcap,\n",
        "extras": "            **extras,\n",
    }[argument]
    return Mutation(
        "loss",
        f"module forward drops {argument}=",
        "src/linear_ce/module.py",
        ((line, ""),),
        ("tests/test_module.py",),
        quick=argument == "z_loss",
    )


_LOSS: tuple[Mutation, ...] = (
    *(
        _drop_module_argument(a)
        for a in (
            "linear_bias",
            "weight",
            "label_smoothing",
            "reduction",
            "options",
            "ignore_index",
            "z_loss",
            "softcap",
            "extras",
        )
    ),
    Mutation(
        "loss",
        "reference z-loss rows without class and ignore weighting",
        "src/linear_ce/reference.py",
        (
            (
                "z_rows = torch.where(row_weight != 0, call.z_loss * row_weight * lse.square(), 0.0)",
                "z_rows = call.z_loss * lse.square()",
            ),
        ),
        ("tests/test_combinations.py", "-k", "reference"),
    ),
    Mutation(
        "loss",
        "reference ignores token weights",
        "src/linear_ce/reference.py",
        (
            (
                "per_row, z_rows = per_row * token_weight, z_rows * token_weight",
                "per_row, z_rows = per_row * token_weight.mean(), z_rows * token_weight.mean()",
            ),
        ),
        ("tests/test_combinations.py", "-k", "reference"),
    ),
    Mutation(
        "loss",
        "reference lse of the logits before the transform",
        "src/linear_ce/reference.py",
        (
            (
                "    logits = transform.plain(logits)\n",
                "    raw, logits = logits, transform.plain(logits)\n",
            ),
            ("lse = torch.logsumexp(logits, dim=1)", "lse = torch.logsumexp(raw, dim=1)"),
        ),
        ("tests/test_combinations.py", "-k", "reference"),
    ),
    Mutation(
        "loss",
        "cross-entropy head weights every K-dim position with position 0's token weight",
        "src/linear_ce/losses/cross_entropy.py",
        (
            ("loss * terms.token[rows, p]", "loss * terms.token[rows, 0]"),
            ("r = terms.scale[rows, p] * factor", "r = terms.scale[rows, 0] * factor"),
            # The compiled row loops' coefficients (native_fused) too.
            ("r = factor * terms.scale[rows, p]", "r = factor * terms.scale[rows, 0]"),
        ),
        ("tests/test_combinations.py", "-k", "chunked and kdim"),
    ),
    Mutation(
        "loss",
        "mean denominator includes the token weights",
        "src/linear_ce/losses/cross_entropy.py",
        (("        total = omega.sum()\n", "        total = (omega * token).sum()\n"),),
        ("tests/test_combinations.py", "-k", "chunked and mean"),
    ),
    Mutation(
        "loss",
        "a returned lse's upstream gradient left out of the softmax coefficient",
        "src/linear_ce/losses/cross_entropy.py",
        (
            (
                "            softmax = softmax + factor * terms.lse_grad[rows, p]\n",
                "            softmax = softmax + 0.0 * terms.lse_grad[rows, p]\n",
            ),
        ),
        ("tests/test_lse_gradient.py", "-k", "float64 and weighted"),
    ),
    Mutation(
        "loss",
        "a returned lse's upstream gradient left out of the row loops' fused coefficients",
        "src/linear_ce/losses/cross_entropy.py",
        (
            (
                "            c0 = c0 + factor * terms.lse_grad[rows, p]\n",
                "            c0 = c0 + 0.0 * terms.lse_grad[rows, p]\n",
            ),
        ),
        ("tests/test_lse_gradient.py", "-k", "both_row_paths"),
    ),
    Mutation(
        "loss",
        "a mean/sum backward hands over the forward's gradients, dropping the lse's",
        "src/linear_ce/ops/cross_entropy.py",
        (("    if grad_lse is None or not ctx.differentiable_lse:\n", "    if True:\n"),),
        ("tests/test_lse_gradient.py", "-k", "float64 and mean"),
    ),
    Mutation(
        "loss",
        "a mean's recomputed gradient misses the reduction's 1/count",
        "src/linear_ce/losses/cross_entropy.py",
        (
            (
                "        grad = torch.where(total == 0, 0.0, grad / total)\n",
                "        grad = torch.where(total == 0, 0.0, grad)\n",
            ),
        ),
        ("tests/test_lse_gradient.py", "-k", "float64 and mean"),
    ),
    Mutation(
        "loss",
        'a "none" call whose lse alone is differentiated gets no gradient',
        "src/linear_ce/ops/cross_entropy.py",
        (
            (
                "        grad_loss = _upstream_rows(SCHEMA.saved(ctx)[0], None)\n",
                "        return SCHEMA.gradients((None, None, None))\n",
            ),
        ),
        ("tests/test_lse_gradient.py", "-k", "lse_alone"),
    ),
    Mutation(
        "loss",
        "a vocab-parallel mean/sum backward hands over the forward's gradients, dropping the lse's",
        "src/linear_ce/ops/autograd.py",
        (("            if all(g is None for g in grad_outputs[1:]):\n", "            if True:\n"),),
        ("tests/test_lse_gradient.py", "-k", "vocab_parallel"),
    ),
    Mutation(
        "loss",
        "temperature forgotten without a softcap",
        "src/linear_ce/engine/transform.py",
        (
            (
                "            if self.temperature != 1.0:\n                logits.div_(self.temperature)\n            return",
                "            return",
            ),
        ),
        ("tests/test_combinations.py", "-k", "chunked and temperature"),
    ),
    Mutation(
        "loss",
        "capability check always answers False",
        "src/linear_ce/engine/capability.py",
        (
            (
                "    return any(flag in _cpu_flags() for flag in _CPU_FLAGS[dtype])",
                "    return False",
            ),
        ),
        ("tests/test_capability.py",),
    ),
    Mutation(
        "loss",
        "capability check: a oneDNN capped below the dtype's instructions still native",
        "src/linear_ce/engine/capability.py",
        (("    if not _onednn_allows(dtype):\n        return False\n", ""),),
        ("tests/test_capability.py",),
    ),
    Mutation(
        "loss",
        'one chunk for reduction="none"',
        "src/linear_ce/ops/cross_entropy.py",
        (
            (
                "    grads = run_head(\n        call.input,",
                '    if call.reduction == "none":\n'
                "        options = LinearCrossEntropyOptions(chunking_method=None)\n"
                "    grads = run_head(\n        call.input,",
            ),
        ),
        ("tests/test_memory_bounds.py", "-k", "none"),
    ),
    Mutation(
        "loss",
        "an fp32 copy of the weight on the native half path",
        "src/linear_ce/engine/gemm.py",
        (
            (
                'half tile from :meth:`half_tile_buffer`."""\n'
                "        if weight.is_contiguous():\n"
                "            torch.mm(x, weight.T, out=out)\n",
                'half tile from :meth:`half_tile_buffer`."""\n'
                "        if weight.is_contiguous():\n"
                "            out.copy_(torch.mm(x.float(), weight.T.float()))\n",
            ),
        ),
        ("tests/test_memory_bounds.py", "-k", "bf16-mean and not upcast"),
    ),
    Mutation(
        "loss",
        "an fp16 sum in the result takes the mean's 1/count only at the end (overflows)",
        "src/linear_ce/engine/accumulate.py",
        (("            self._x_scale = torch.where(scale > 0, power, 1.0)\n", ""),),
        ("tests/test_precision.py", "-k", "sum_in_the_result"),
    ),
    Mutation(
        "loss",
        "an fp16 sum in the result gets 1/count's power of two twice",
        "src/linear_ce/engine/accumulate.py",
        (("            scale = scale / self._x_scale\n", "            pass\n"),),
        ("tests/test_precision.py", "-k", "sum_in_the_result"),
    ),
    Mutation(
        "native_rows",
        "the OpenMP region's row ranges leave the last row of each out",
        "src/linear_ce/engine/native_rows.c",
        (
            (
                "int64_t r1 = range_start(lo, hi, k + 1, threads, align);",
                "int64_t r1 = range_start(lo, hi, k + 1, threads, align) - 1;",
            ),
        ),
        ("tests/test_native_rows.py", "-k", "openmp_region"),
    ),
    Mutation(
        "machine_plan",
        "the bench's distillation note: the pair tiles' dtype taken from the plan's input",
        "src/linear_ce/bench/variants.py",
        (
            (
                '        dtype = str(pair.dtype).removeprefix("torch.")\n',
                '        dtype = str(plan.input_dtype).removeprefix("torch.")\n',
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "distillation_plan"),
    ),
    Mutation(
        "sequence_objective",
        "a chunk of whole sequences sums its input gradient in an fp32 (N, F) buffer again",
        "src/linear_ce/engine/chunk_loop.py",
        (
            (
                "    narrow = rows_once and grad_input and input.dtype != acc\n",
                "    narrow = False\n",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "bf16_dpo_step_memory"),
    ),
    Mutation(
        "machine_plan",
        "a tie of measured chunk rates goes to the smallest chunk, not the budget's",
        "src/linear_ce/engine/machine.py",
        (
            (
                "        if under and best[under[-1]] >= (1 - TOLERANCE) * top:\n",
                "        if under and best[under[-1]] > top:\n",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "budgets_unless_another"),
    ),
    Mutation(
        "machine_plan",
        "a call without gradients keeps the budget of a call with them",
        "src/linear_ce/engine/plan.py",
        (
            (
                "    if not gradients and stretch > 1.0 and not half_cpu",
                "    if not gradients and stretch > 2.0 and not half_cpu",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "without_gradients"),
    ),
    Mutation(
        "machine_plan",
        "the bench names the last CPU's family and model, not the first's",
        "src/linear_ce/bench/report.py",
        (
            (
                "        if not line.strip() and fields:\n            break\n",
                "",
            ),
        ),
        ("tests/test_bench.py", "-k", "family"),
    ),
    Mutation(
        "machine_plan",
        "the bench's token_logprobs target reads the three-GEMM ratio as the four's",
        "src/linear_ce/bench/targets.py",
        (("                    value * _FOUR_OVER_THREE,\n", "                    value,\n"),),
        ("tests/test_bench.py", "-k", "targets"),
    ),
    Mutation(
        "machine_plan",
        "the bench's faster-than-a-peer targets compare the two ratios to the floor",
        "src/linear_ce/bench/targets.py",
        (
            (
                "            found.append(Target(name, dtype, value, 1.0, value < 1.0))\n",
                "            value = _steady(row) / _steady(peer)\n"
                "            found.append(Target(name, dtype, value, 1.0, value < 1.0))\n",
            ),
        ),
        ("tests/test_bench.py", "-k", "targets"),
    ),
    Mutation(
        "machine_plan",
        "the bench's targets read a half step against the fp32 floor",
        "src/linear_ce/bench/targets.py",
        (
            (
                "    return row.own_ratio if row.own_ratio is not None else row.ratio\n",
                "    return row.ratio\n",
            ),
        ),
        ("tests/test_bench.py", "-k", "targets"),
    ),
    Mutation(
        "machine_plan",
        "the bench reads the floors of a masked point against the unmasked step too",
        "src/linear_ce/bench/report.py",
        (
            (
                '                if not row.variant.startswith("floor")\n                and ',
                "                ",
            ),
        ),
        ("tests/test_bench.py", "-k", "unmasked"),
    ),
    Mutation(
        "machine_plan",
        "the bench's linear_ce rows take the mean whatever the point's reduction",
        "src/linear_ce/bench/variants.py",
        (
            (
                "linear_ce.linear_cross_entropy(x, w, t, reduction=reduction, options=options)",
                "linear_ce.linear_cross_entropy(x, w, t, options=options)",
            ),
        ),
        ("tests/test_bench.py", "-k", "reduction_reaches"),
    ),
    Mutation(
        "machine_plan",
        "the bench's two-head floor writes the teacher's logits into a fresh tensor",
        "src/linear_ce/bench/variants.py",
        (
            (
                "            torch.mm(xt, wt.T, out=teacher_logits)\n",
                "            xt @ wt.T\n",
            ),
        ),
        ("tests/test_bench.py", "-k", "one_buffer"),
    ),
    Mutation(
        "machine_plan",
        "the bench's peers measured at fewer rows keep their time unscaled",
        "src/linear_ce/bench/runner.py",
        (
            (
                'self.seconds.append(answer["seconds"] * point.N / self.rows)',
                'self.seconds.append(answer["seconds"])',
            ),
        ),
        ("tests/test_bench.py", "-k", "slow_half"),
    ),
    Mutation(
        "machine_plan",
        "the bench never finds a half GEMM slow",
        "src/linear_ce/bench/variants.py",
        (("    return half * SLOW_HALF_FACTOR < single\n", "    return False\n"),),
        ("tests/test_bench.py", "-k", "slow_half"),
    ),
    Mutation(
        "machine_plan",
        "the bench's own-dtype ratio reads the own floor even where fp32's was faster",
        "src/linear_ce/bench/report.py",
        (("    return [min(a, b) for a, b in zip(own, fp32, strict=True)]\n", "    return own\n"),),
        ("tests/test_bench.py", "-k", "faster_floor"),
    ),
    Mutation(
        "machine_plan",
        "the bench's in-process run times its calls without the model's step between them",
        "src/linear_ce/bench/runner.py",
        (
            (
                "                        step()\n                        sample = measure(",
                "                        sample = measure(",
            ),
        ),
        ("tests/test_bench.py", "-k", "model_step"),
    ),
    Mutation(
        "machine_plan",
        "the bench's targets read the isolated ratios of an in-process run",
        "src/linear_ce/bench/__main__.py",
        (
            (
                "    checked = summaries if in_summaries is None else in_summaries\n",
                "    checked = summaries\n",
            ),
        ),
        ("tests/test_bench.py", "-k", "progress_lines"),
    ),
    Mutation(
        "machine_plan",
        "the bench's plot draws the memory bar of a peer measured at fewer rows",
        "src/linear_ce/bench/report.py",
        (
            (
                "                if value is None:  # a peer measured at fewer rows has no memory\n                    continue\n",
                "",
            ),
        ),
        ("tests/test_bench.py", "-k", "without_memory"),
    ),
    Mutation(
        "machine_plan",
        "a capped instruction set reads the full CPU's measured rates",
        "src/linear_ce/engine/machine.py",
        (('    return key | ({"isa": capped} if capped else {})\n', "    return key\n"),),
        ("tests/test_machine_plan.py", "-k", "capped"),
    ),
    Mutation(
        "loss",
        "a half sum in the result takes the mean's power of two on x, the rest in a pass",
        "src/linear_ce/engine/accumulate.py",
        (
            (
                'if scale is not None and gemm.operand_dtype == dtype and scale.device.type == "cpu":',
                "if scale is not None and dtype not in HALF_DTYPES and gemm.operand_dtype == dtype"
                ' and scale.device.type == "cpu":',
            ),
        ),
        ("tests/test_precision.py", "-k", "mean_in_its_gemm"),
    ),
    Mutation(
        "loss",
        "a mean's scale is not taken into the weight gradient's GEMMs",
        "src/linear_ce/engine/accumulate.py",
        (("            self._alpha = float(scale)\n", ""),),
        ("tests/test_combinations.py", "-k", "chunked and mean"),
    ),
    Mutation(
        "loss",
        "a mean's scale applied to the weight gradient twice (GEMMs and finish)",
        "src/linear_ce/engine/accumulate.py",
        (
            (
                "        if self._scaled:\n            scale = None\n",
                "        if self._scaled:\n            pass\n",
            ),
        ),
        ("tests/test_combinations.py", "-k", "chunked and mean"),
    ),
)

_SEQUENCE: tuple[Mutation, ...] = (
    Mutation(
        "sequence_objective",
        "the loop cuts its own chunks (groups split)",
        "src/linear_ce/ops/sequence_objective.py",
        (("        chunks=[[c.rows for c in chunks]],\n", ""),),
        # The objective still sees whole groups (the head evaluates its own group chunks);
        # the gradients of rows whose group a loop chunk splits are what go wrong.
        ("tests/test_sequence_objective.py", "-k", "whole_groups or matches_plain_formula"),
    ),
    Mutation(
        "sequence_objective",
        'group="pairs" pairs neighbouring rows',
        "src/linear_ce/engine/sequence_layout.py",
        (
            (
                "        return torch.arange(sequences) % max(sequences // 2, 1)",
                "        return torch.arange(sequences) // 2",
            ),
        ),
        ("tests/test_objectives_builtin.py", "-k", "dpo-sigmoid and float64"),
    ),
    Mutation(
        "sequence_objective",
        "a shift scores across packed sequences",
        "src/linear_ce/engine/sequence_layout.py",
        (("        scored &= same\n", ""),),
        ("tests/test_sequence_objective.py", "-k", "random_packed"),
        quick=True,
    ),
    Mutation(
        "sequence_objective",
        "the four-GEMM path drops the entropy's gradient",
        "src/linear_ce/ops/sequence_objective.py",
        (
            (
                "target, layout.valid, spec.vocab.start, head.row_stats, per_row(g), per_row(h)",
                "target, layout.valid, spec.vocab.start, head.row_stats, per_row(g), None",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "plain_formula and four_gemm"),
    ),
    Mutation(
        "sequence_objective",
        "the half tile's scaled rows reach the weight gradient unscaled",
        "src/linear_ce/engine/chunk_loop.py",
        (
            (
                "x_op = _scale_rows(x_op, factors, self.x_rows_buf[:n])",
                "_scale_rows(x_op, factors, self.x_rows_buf[:n])",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "scaled_rows"),
    ),
    Mutation(
        "sequence_objective",
        "the half tile's scaled rows reach the input gradient unscaled",
        "src/linear_ce/engine/chunk_loop.py",
        (("        _scale_rows(part, factors, part)\n", "        pass\n"),),
        ("tests/test_sequence_objective.py", "-k", "scaled_rows"),
    ),
    Mutation(
        "sequence_objective",
        "rows scaled in blocks: only the first block scaled",
        "src/linear_ce/engine/chunk_loop.py",
        (
            (
                "    for start in range(0, t.shape[0], SCALE_BLOCK_ROWS):\n",
                "    for start in range(0, min(t.shape[0], SCALE_BLOCK_ROWS), SCALE_BLOCK_ROWS):\n",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "fewest_pairs"),
    ),
    Mutation(
        "sequence_objective",
        "the input gradient written once: gathered rows land on the chunk's first rows",
        "src/linear_ce/engine/chunk_loop.py",
        (
            (
                "        grad_x.index_copy_(0, rows, part.to(grad_x.dtype))\n",
                "        grad_x[: part.shape[0]].copy_(part)\n",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "fewest_pairs"),
    ),
    Mutation(
        "sequence_objective",
        "the input gradient written once: a half tile's gathered rows never written",
        "src/linear_ce/engine/chunk_loop.py",
        (
            (
                "    in_place = isinstance(rows, slice) and (buffer is None or buffer.dtype == grad_x.dtype)\n",
                "    in_place = buffer is None or buffer.dtype == grad_x.dtype\n",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "fewest_pairs"),
    ),
    Mutation(
        "sequence_objective",
        "least_capacity bisects to a capacity that makes too many chunks",
        "src/linear_ce/engine/sequence_layout.py",
        (
            (
                "                low = middle + 1\n",
                "                low = middle\n                break\n",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "least_capacity"),
    ),
    Mutation(
        "sequence_objective",
        "the half tile keeps the plan's long chunks (two pairs each)",
        "src/linear_ce/ops/sequence_objective.py",
        (
            (
                "        plan = dataclasses.replace(plan, rows_per_chunk=capacity)\n",
                "        pass\n",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "fewest_pairs"),
    ),
    Mutation(
        "sequence_objective",
        "the scaled rows' tile without the target's column (δ_t dropped)",
        "src/linear_ce/losses/sequence_objective.py",
        (
            (
                "            return out.scatter_add_(1, self.safe_t, (factor * self.owned)[:, None])\n",
                "            return out\n",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "scaled_rows"),
    ),
    Mutation(
        "sequence_objective",
        "the half tile keeps the plan's 64-row steps",
        "src/linear_ce/ops/sequence_objective.py",
        (("min(plan.rows_per_step, SEQUENCE_STEP_ROWS)", "plan.rows_per_step"),),
        ("tests/test_sequence_objective.py", "-k", "fewest_pairs"),
    ),
    Mutation(
        "sequence_objective",
        "the input gradient summed in fp32 again (rows_once dropped)",
        "src/linear_ce/ops/sequence_objective.py",
        (("        rows_once=True,\n", "        rows_once=False,\n"),),
        ("tests/test_sequence_objective.py", "-k", "scaled_rows"),
    ),
    Mutation(
        "sequence_objective",
        "the mean's count is folded in and scaled again in backward",
        "src/linear_ce/ops/sequence_objective.py",
        (
            (
                "ctx.grad_scale = (evaluation.folded_count or 1) / evaluation.count if mean else 1.0",
                "ctx.grad_scale = 1.0 / evaluation.count if mean else 1.0",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "mean_folded"),
    ),
    Mutation(
        "sequence_objective",
        "a per-group loss's mean folds the sequences' count (a pass in backward)",
        "src/linear_ce/losses/sequence_objective.py",
        (
            (
                "        return self.totals.groups if per_group else self.totals.sequences\n",
                "        return self.totals.sequences\n",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "mean_folded"),
    ),
    Mutation(
        "sequence_objective",
        "IPO without length normalisation",
        "src/linear_ce/objectives/sequence.py",
        (
            (
                "            return (phi_c / len_c - phi_r / len_r - 1 / (2 * beta)) ** 2",
                "            return (phi_c - phi_r - 1 / (2 * beta)) ** 2",
            ),
        ),
        ("tests/test_objectives_builtin.py", "-k", "dpo-ipo"),
    ),
)

_TOKEN_HEAD = "src/linear_ce/losses/token_logprob.py"
_TOPK_TESTS = ("tests/test_token_topk.py", "-k", "matches_float64")

_TOKEN_LOGPROBS: tuple[Mutation, ...] = (
    Mutation(
        "token_logprobs",
        "entropy with its sign flipped",
        _TOKEN_HEAD,
        (
            (
                "self.entropy[rows, p] = stats.log_sum_exp - self.row_mean_u",
                "self.entropy[rows, p] = self.row_mean_u - stats.log_sum_exp",
            ),
        ),
        ("tests/test_token_logprobs.py", "-k", "matches_plain_expression"),
        quick=True,
    ),
    Mutation(
        "token_logprobs",
        "log_sum_sq_prob subtracts log Z once, not twice",
        _TOKEN_HEAD,
        (
            (
                'sums[:, slot["sq"]].log() - 2 * stats.log_sum_exp',
                'sums[:, slot["sq"]].log() - stats.log_sum_exp',
            ),
        ),
        ("tests/test_token_logprobs.py", "-k", "statistics_match_plain_expression"),
    ),
    Mutation(
        "token_logprobs",
        "mean logit without the row maximum",
        _TOKEN_HEAD,
        (
            (
                "self.mean_logit[rows, p] = stats.row_max + sums",
                "self.mean_logit[rows, p] = sums",
            ),
        ),
        ("tests/test_token_logprobs.py", "-k", "statistics_match_plain_expression"),
    ),
    Mutation(
        "token_logprobs",
        "top1 under the unique rule lets a tie through",
        _TOKEN_HEAD,
        (("else ties == 1", "else ties <= 2"),),
        ("tests/test_token_logprobs.py", "-k", "top1"),
    ),
    Mutation(
        "token_logprobs",
        "topk: the values are logits, log Z not subtracted",
        _TOKEN_HEAD,
        (
            (
                "        if self.topk:\n"
                "            self.topk_logprobs[rows, p] -= stats.log_sum_exp[:, None]\n",
                "",
            ),
        ),
        _TOPK_TESTS,
    ),
    Mutation(
        "token_logprobs",
        "topk: ignored rows' log-probabilities are 0, not -inf",
        _TOKEN_HEAD,
        (
            (
                "torch.full(shape, -math.inf, dtype=acc_dtype, device=target.device)",
                "torch.zeros(shape, dtype=acc_dtype, device=target.device)",
            ),
        ),
        _TOPK_TESTS,
    ),
    Mutation(
        "token_logprobs",
        "topk: ignored rows' ids are 0, not -1",
        _TOKEN_HEAD,
        (
            (
                "torch.full(shape, -1, dtype=torch.int64, device=target.device)",
                "torch.zeros(shape, dtype=torch.int64, device=target.device)",
            ),
        ),
        _TOPK_TESTS,
    ),
)

_OBJECTIVES = "src/linear_ce/objectives/token.py"

_TOKEN_OBJECTIVE: tuple[Mutation, ...] = (
    Mutation(
        "token_objective",
        "the entropy's upstream gradient is dropped",
        "src/linear_ce/losses/token_objective.py",
        (("for g in (*grads, None)[:2]]", "for g in (grads[0], None)]"),),
        ("tests/test_token_objective.py", "-k", "matches_plain_formula and entropy"),
    ),
    Mutation(
        "token_objective",
        "a tensor the objective closes over loses its gradient in silence",
        "src/linear_ce/losses/token_objective.py",
        (("            self._refuse_other_leaves(total, leaves)\n", ""),),
        ("tests/test_gradient_safety.py", "-k", "closing_over"),
        quick=True,
    ),
    Mutation(
        "token_objective",
        "the chunk loop's gradient (token head) drops the target's one-hot",
        _TOKEN_HEAD,
        (("        out.scatter_add_(1, self.safe_t, (g * self.owned)[:, None])\n", ""),),
        ("tests/test_token_objective.py", "-k", "matches_plain_formula and dtype0"),
    ),
    Mutation(
        "token_objective",
        "the chunk loop's entropy gradient without the mean subtracted",
        _TOKEN_HEAD,
        (
            (
                "out = u.sub_(self.row_mean_u[:, None]).mul_(e)",
                "out = u.mul_(e)",
            ),
        ),
        ("tests/test_token_objective.py", "-k", "matches_plain_formula and dtype0"),
    ),
    Mutation(
        "token_objective",
        "clipped policy gradient: clip_low and clip_high swapped",
        _OBJECTIVES,
        (
            (
                "        ratio = torch.exp(_log_ratio(logprob, old_logprob))\n"
                "        clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)\n"
                "        log_clipping(ratio, advantage, 1.0 - clip_low, 1.0 + clip_high)\n"
                "        capped",
                "        ratio = torch.exp(_log_ratio(logprob, old_logprob))\n"
                "        clipped = ratio.clamp(1.0 - clip_high, 1.0 + clip_low)\n"
                "        log_clipping(ratio, advantage, 1.0 - clip_low, 1.0 + clip_high)\n"
                "        capped",
            ),
        ),
        ("tests/test_objectives_builtin.py", "-k", "token_builtin"),
    ),
    Mutation(
        "token_objective",
        "k3 KL estimator with its sign flipped",
        _OBJECTIVES,
        (
            (
                "            kl = torch.expm1(delta) - delta\n",
                "            kl = delta - torch.expm1(delta)\n",
            ),
        ),
        ("tests/test_objectives_builtin.py", "-k", "token_builtin"),
    ),
    Mutation(
        "token_objective",
        "entropy bonus minimises the entropy",
        _OBJECTIVES,
        (("return _weighted(-coef * entropy, side)", "return _weighted(coef * entropy, side)"),),
        ("tests/test_token_objective.py", "-k", "matches_plain_formula and dtype0-entropy"),
    ),
)

_DIVERGENCE_HEAD = "src/linear_ce/losses/divergence.py"

_LINEAR_DIVERGENCE: tuple[Mutation, ...] = (
    Mutation(
        "linear_divergence",
        "student and teacher swapped (beta=0 runs the reverse KL)",
        _DIVERGENCE_HEAD,
        (
            (
                'self.mode = "forward" if beta == 0.0 else "reverse" if beta == 1.0 else "mixed"',
                'self.mode = "reverse" if beta == 0.0 else "forward" if beta == 1.0 else "mixed"',
            ),
        ),
        ("tests/test_divergence.py", "-k", "matches_plain_float32"),
        quick=True,
    ),
    Mutation(
        "linear_divergence",
        "forward KL's teacher term added to the gradient, not subtracted",
        _DIVERGENCE_HEAD,
        (("c_t = (-w / self.z_t)[:, None]", "c_t = (w / self.z_t)[:, None]"),),
        ("tests/test_divergence.py", "-k", "matches_plain_float32"),
    ),
    Mutation(
        "linear_divergence",
        "mixed (JSD) gradient scaled by beta instead of 1 - beta",
        _DIVERGENCE_HEAD,
        (("scale = w * (1.0 - self.beta) / z_s", "scale = w * self.beta / z_s"),),
        ("tests/test_divergence.py", "-k", "matches_plain_float32"),
    ),
    Mutation(
        "linear_divergence",
        "the hard term forgets the temperature (T != 1 uses Z_s)",
        _DIVERGENCE_HEAD,
        (
            (
                "self.own_z1 = self.hard_on and temperature != 1.0",
                "self.own_z1 = False",
            ),
        ),
        ("tests/test_divergence.py", "-k", "transforms_float64 or property_float64"),
    ),
    Mutation(
        "linear_divergence",
        "the mixture's δ without log(β/(1−β)) (right at β = 0.5 only)",
        _DIVERGENCE_HEAD,
        (
            (
                "shift = (stats.log_sum_exp - log_zt + math.log(beta / (1.0 - beta)))[:, None]",
                "shift = (stats.log_sum_exp - log_zt)[:, None]",
            ),
        ),
        ("tests/test_divergence.py", "-k", "matches_plain_float32"),
    ),
    Mutation(
        "linear_divergence",
        "the hard term's target logit masked by a product (-inf * 0 on another shard's row)",
        _DIVERGENCE_HEAD,
        (
            (
                "picked = torch.where(self.owned_t, u.gather(1, self.safe_t)[:, 0], 0.0)",
                "picked = u.gather(1, self.safe_t)[:, 0] * self.owned_t",
            ),
        ),
        ("tests/test_divergence.py", "-k", "masked_class"),
    ),
)

_SPARSE_HEAD = "src/linear_ce/losses/sparse_divergence.py"

_SPARSE_DIVERGENCE: tuple[Mutation, ...] = (
    Mutation(
        "sparse_divergence",
        "the stored teacher's temperature is dropped",
        _SPARSE_HEAD,
        (("        if scale != 1.0:\n            lp = lp * scale\n", ""),),
        ("tests/test_sparse_divergence.py", "-k", "transforms_float64"),
    ),
    Mutation(
        "sparse_divergence",
        "the teacher's residual mass is dropped (rest=True behaves as renormalised)",
        _SPARSE_HEAD,
        (
            (
                "r_t = torch.where(full, 0.0, -torch.expm1(log_total.clamp(max=0.0)))",
                "r_t = torch.zeros_like(log_total)",
            ),
        ),
        ("tests/test_sparse_divergence.py", "-k", "matches_dense_teacher_float32"),
        quick=True,
    ),
    Mutation(
        "sparse_divergence",
        "reverse KL's slot gradient with its sign flipped",
        _SPARSE_HEAD,
        (("slot = p_k * (self.d_k - mean_d)", "slot = p_k * (mean_d - self.d_k)"),),
        ("tests/test_sparse_divergence.py", "-k", "matches_dense_teacher_float32"),
    ),
    Mutation(
        "sparse_divergence",
        "a -inf stored log-probability is not an empty slot",
        _SPARSE_HEAD,
        (("empty = (ids == -1) | (lp == -math.inf)", "empty = ids == -1"),),
        ("tests/test_sparse_divergence.py", "-k", "empty_slots"),
    ),
)

_VOCAB_PASS = "src/linear_ce/engine/vocab_pass.py"
_VOCAB_PASS_TESTS = ("tests/test_token_logprobs.py", "-k", "many_row_groups_and_class_blocks")

_VOCAB_PASS_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "vocab_pass",
        "the entropy's row dot keeps its last block only (each block written, not added)",
        _TOKEN_HEAD,
        (("                out.add_(part.sum(1))\n", "                out.copy_(part.sum(1))\n"),),
        _VOCAB_PASS_TESTS,
    ),
    Mutation(
        "vocab_pass",
        "the last class of each block is left out (off by one)",
        _VOCAB_PASS,
        (
            (
                "span = slice(start, min(start + block, classes))",
                "span = slice(start, min(start + block - 1, classes))",
            ),
        ),
        _VOCAB_PASS_TESTS,
        quick=True,
    ),
    Mutation(
        "vocab_pass",
        "the bias is not added to a block's logits",
        _VOCAB_PASS,
        (
            (
                "                    if b_p is not None:\n                        s.add_(b_p[span])\n",
                "",
            ),
        ),
        ("tests/test_token_logprobs.py", "-k", "matches_plain_expression"),
    ),
    Mutation(
        "vocab_pass",
        "the softcap's derivative is dropped",
        _VOCAB_PASS,
        (("                if sech2 is not None:\n                    s.mul_(sech2)\n", ""),),
        ("tests/test_head_claims.py", "-k", "row_major_vocab_tile"),
    ),
    Mutation(
        "vocab_pass",
        "the target's one-hot lands at the block's offset 0 (wrong block offset)",
        _TOKEN_HEAD,
        (
            (
                "local = self.target[rows, p] - self.start - classes.start\n            hit",
                "local = self.target[rows, p] - self.start\n            hit",
            ),
            # The same offset where the compiled row loops take the block.
            (
                "local = self.target[rows, p] - self.start - classes.start\n        owned",
                "local = self.target[rows, p] - self.start\n        owned",
            ),
        ),
        _VOCAB_PASS_TESTS,
    ),
    Mutation(
        "vocab_pass",
        "row-major tile built as class-major (the CUDA layout is wrong)",
        _VOCAB_PASS,
        (
            (
                "return flat.view(classes, rows).T if class_major else flat.view(rows, classes)",
                "return flat.view(classes, rows).T if class_major else flat.view(classes, rows).T",
            ),
        ),
        ("tests/test_head_claims.py", "-k", "row_major_vocab_tile"),
    ),
)

_DTENSOR = "src/linear_ce/parallel/dtensor.py"

_DTENSOR_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "dtensor",
        "a Shard(0) head's offset from an even split (uneven vocabularies misplaced)",
        _DTENSOR,
        (("    start = rank * per_rank\n", "    start = rank * (classes // ranks)\n"),),
        ("tests/test_dtensor.py", "-k", "token_heads or loss_matches"),
    ),
    Mutation(
        "dtensor",
        "a split sequence is shifted per rank (the boundary label is lost)",
        _DTENSOR,
        (
            (
                "    if not shift or not splits_sequence or not isinstance(target, torch.Tensor):",
                "    if True:",
            ),
        ),
        ("tests/test_dtensor.py", "-k", "loss_matches and world2"),
        quick=True,
    ),
    Mutation(
        "dtensor",
        'a "mean" over split rows averages each rank\'s mean',
        _DTENSOR,
        (('        local["reduction"] = "sum"\n', ""),),
        ("tests/test_dtensor.py", "-k", "loss_matches and world2"),
    ),
    Mutation(
        "dtensor",
        "the head's gradient is not summed over the ranks that split the rows",
        _DTENSOR,
        (
            (
                "Partial() if d in self.row_dims else p for d, p in enumerate(placements)",
                "p for d, p in enumerate(placements)",
            ),
        ),
        ("tests/test_dtensor.py", "-k", "2d_mesh or plain_head"),
    ),
    Mutation(
        "dtensor",
        "a vocab_parallel given beside DTensor arguments is silently overridden",
        _DTENSOR,
        (('    if arguments.get("vocab_parallel") is not None:\n', "    if False:\n"),),
        ("tests/test_error_names.py", "-k", "dtensor_call_with_vocab_parallel"),
    ),
)

_DISTRIBUTED_TOPK_TESTS = (
    "tests/test_distributed_topk.py::test_topk_and_sparse_divergence_match[2]",
)

_VOCAB_PARALLEL: tuple[Mutation, ...] = (
    Mutation(
        "vocab_parallel",
        "VocabParallel takes a first class at or past the vocabulary's end",
        "src/linear_ce/parallel/shard.py",
        (("        if not 0 <= start < total:\n", "        if not 0 <= start:\n"),),
        ("tests/test_error_names.py", "-k", "errors_name_the_class"),
    ),
    Mutation(
        "vocab_parallel",
        "a local shard running past the vocabulary's end is taken",
        "src/linear_ce/parallel/shard.py",
        (("    if start + local > total:\n", "    if False:\n"),),
        ("tests/test_error_names.py", "-k", "shard_outside_the_vocabulary"),
    ),
    Mutation(
        "vocab_parallel",
        "token head: targets read as local indices (no shard offset)",
        _TOKEN_HEAD,
        (("        local_t = target - self.start\n", "        local_t = target\n"),),
        ("tests/test_distributed_token.py",),
        quick=True,
    ),
    Mutation(
        "vocab_parallel",
        "token head: mean logit over the shard's classes, not the vocabulary's",
        _TOKEN_HEAD,
        (('sums[:, slot["sum_u"]] / self.num_classes', 'sums[:, slot["sum_u"]] / self.local'),),
        ("tests/test_distributed_token.py",),
    ),
    Mutation(
        "vocab_parallel",
        "token gradients: the input's gradient is not summed over shards",
        "src/linear_ce/ops/token_logprobs.py",
        (("    if grads.input is not None:\n        vocab.sum_(grads.input)\n", ""),),
        ("tests/test_distributed_token.py",),
    ),
    Mutation(
        "vocab_parallel",
        "row sums combined by MAX instead of SUM",
        "src/linear_ce/parallel/shard.py",
        (
            (
                "dist.all_reduce(row_sums, op=dist.ReduceOp.SUM, group=self.group)",
                "dist.all_reduce(row_sums, op=dist.ReduceOp.MAX, group=self.group)",
            ),
        ),
        ("tests/test_distributed.py", "-k", "matches_single_process"),
    ),
    Mutation(
        "vocab_parallel",
        "gathered layout: a rank's start includes its own shard (off by one rank)",
        "src/linear_ce/parallel/shard.py",
        (
            (
                "return sum(counts[:rank]), sum(counts)",
                "return sum(counts[: rank + 1]), sum(counts)",
            ),
        ),
        ("tests/test_distributed.py", "-k", "matches_single_process"),
    ),
    Mutation(
        "vocab_parallel",
        "divergence head: the hard term's target without the shard offset",
        _DIVERGENCE_HEAD,
        (
            (
                "self.owned_t, column = self.frame.local_columns(self.target[rows, p])",
                "self.owned_t, column = self.frame.local_columns(\n"
                "            self.target[rows, p] + self.frame.vocab_start\n"
                "        )",
            ),
        ),
        ("tests/test_distributed_divergence.py",),
    ),
    Mutation(
        "vocab_parallel",
        "topk: a shard's candidate ids without the shard offset",
        _TOKEN_HEAD,
        (
            (
                "self.topk_ids[rows, p, :width] = ids + self.start",
                "self.topk_ids[rows, p, :width] = ids",
            ),
        ),
        _DISTRIBUTED_TOPK_TESTS,
    ),
    Mutation(
        "vocab_parallel",
        "topk merge: each rank keeps its own shard's candidates",
        "src/linear_ce/parallel/shard.py",
        (
            (
                "return all_values.gather(-1, order), all_ids.gather(-1, order)",
                "return values, ids",
            ),
        ),
        _DISTRIBUTED_TOPK_TESTS,
    ),
    Mutation(
        "vocab_parallel",
        "topk merge: the candidates of the smallest ids, not the largest values",
        "src/linear_ce/parallel/shard.py",
        (
            (
                "order = all_values.sort(dim=-1, descending=True, stable=True).indices[..., :k]",
                "order = all_ids.argsort(dim=-1, stable=True)[..., :k]",
            ),
        ),
        _DISTRIBUTED_TOPK_TESTS,
    ),
)

_TRL = "src/linear_ce/integrations/trl.py"
_TRL_DISTILLATION = "src/linear_ce/integrations/trl_distillation.py"

_TRL_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "trl",
        "fused head: the temperature is dropped",
        _TRL,
        (
            (
                'return {\n        "temperature": float(temperature),',
                'return {\n        "temperature": 1.0,',
            ),
        ),
        ("tests/test_trl.py", "-k", "kernel_call_matches_trl"),
        quick=True,
    ),
    Mutation(
        "trl",
        "fused head: the entropy's gradient is dropped in backward",
        _TRL,
        (
            (
                "                grad_logprob,\n                grad_entropy,\n",
                "                grad_logprob,\n                None,\n",
            ),
        ),
        ("tests/test_trl.py", "-k", "kernel_call_matches_trl"),
    ),
    Mutation(
        "trl",
        "fused head: is_top1 under the unique rule (a tie is not torch.argmax's)",
        _TRL,
        (('                top1_rule="argmax",\n', '                top1_rule="unique",\n'),),
        ("tests/test_trl.py", "-k", "top1"),
    ),
    Mutation(
        "trl",
        "distillation: TRL's beta read as its complement (student and teacher swapped)",
        _TRL_DISTILLATION,
        (("            beta=float(beta),\n", "            beta=1.0 - float(beta),\n"),),
        ("tests/test_trl_distillation.py", "-k", "patched_loss_equals_trls"),
    ),
    Mutation(
        "trl",
        "distillation: the completion mask inverted",
        _TRL_DISTILLATION,
        (
            (
                "marks = torch.where(valid, 0, _IGNORE).to(torch.long)",
                "marks = torch.where(valid, _IGNORE, 0).to(torch.long)",
            ),
        ),
        ("tests/test_trl_distillation.py", "-k", "patched_loss_equals_trls"),
    ),
)

_TRL_DPO = "src/linear_ce/integrations/trl_sequence.py"
_TRL_GRPO = "src/linear_ce/integrations/trl_grpo.py"
_TRL_KTO = "src/linear_ce/integrations/trl_kto.py"

_TRL_SEQUENCE: tuple[Mutation, ...] = (
    Mutation(
        "trl_sequence",
        "DPO: the reference's chosen and rejected swapped",
        _TRL_DPO,
        (
            (
                "return torch.cat([chosen, rejected]).detach()",
                "return torch.cat([rejected, chosen]).detach()",
            ),
        ),
        ("tests/test_trl_sequence.py", "-k", "matches_trl and hinge"),
    ),
    Mutation(
        "trl_sequence",
        "DPO: loss_weights dropped",
        _TRL_DPO,
        (("term = float(weight) * dpo(", "term = dpo("),),
        ("tests/test_trl_sequence.py", "-k", "matches_trl and hinge"),
    ),
    Mutation(
        "trl_sequence",
        "DPO: label smoothing applied to every loss type (TRL's sigmoid ignores it)",
        _TRL_DPO,
        (
            (
                "label_smoothing=float(trainer.label_smoothing) if loss_type in _SMOOTHED else 0.0,",
                "label_smoothing=float(trainer.label_smoothing),",
            ),
        ),
        ("tests/test_trl_sequence.py", "-k", "matches_trl and sigmoid and label_smoothing"),
    ),
    Mutation(
        "trl_sequence",
        "DPO: logps/chosen logged from the rewards",
        _TRL_DPO,
        (
            (
                'metrics["logps/chosen"].append(accelerator.gather(chosen_logps)',
                'metrics["logps/chosen"].append(accelerator.gather(chosen)',
            ),
        ),
        ("tests/test_trl_sequence.py", "-k", "matches_trl and hinge"),
    ),
    Mutation(
        "trl_sequence",
        "GRPO: the KL estimate's log-ratio with its sign flipped",
        _TRL_GRPO,
        (
            (
                'log_ratio = batch.token_side["ref_logprob"] - batch.token_logprob',
                'log_ratio = batch.token_logprob - batch.token_side["ref_logprob"]',
            ),
        ),
        ("tests/test_trl_grpo.py", "-k", "grpo-kl-delta"),
    ),
    Mutation(
        "trl_sequence",
        "GRPO: CISPO's capped ratio not detached",
        _TRL_GRPO,
        (
            (
                "weight = _ratio(batch).clamp(max=high).detach()",
                "weight = _ratio(batch).clamp(max=high)",
            ),
        ),
        ("tests/test_trl_grpo.py", "-k", "cispo-tool_mask-empty"),
    ),
    Mutation(
        "trl_sequence",
        "GRPO: SAPO's temperatures swapped (positive for a negative advantage)",
        _TRL_GRPO,
        (
            (
                "tau = torch.where(advantage > 0, positive, negative).to(advantage.dtype)",
                "tau = torch.where(advantage > 0, negative, positive).to(advantage.dtype)",
            ),
        ),
        ("tests/test_trl_grpo.py", "-k", "sapo-kl"),
    ),
    Mutation(
        "trl_sequence",
        "GRPO: the off-policy mask keeps the sequences that drifted",
        _TRL_GRPO,
        (
            (
                'kept = (batch.side["advantage"] >= 0) | (mean_gap <= threshold)',
                'kept = (batch.side["advantage"] >= 0) | (mean_gap > threshold)',
            ),
        ),
        ("tests/test_trl_grpo.py", "-k", "grpo-opsm"),
    ),
    Mutation(
        "trl_sequence",
        "GRPO: vLLM's importance-sampling ratios dropped from the clipped surrogate",
        _TRL_GRPO,
        (
            (
                '        return batch.sum_tokens(batch.token_side["is_ratio"])\n',
                "        return batch.length\n",
            ),
        ),
        ("tests/test_trl_grpo.py", "-k", "vllm_token_is"),
        quick=True,
    ),
    Mutation(
        "trl_sequence",
        "GRPO: clip_ratio/low counted on positive advantages",
        _TRL_GRPO,
        (
            (
                "low = ((ratio < 1 - trainer.epsilon_low) & (advantages < 0))",
                "low = ((ratio < 1 - trainer.epsilon_low) & (advantages > 0))",
            ),
        ),
        ("tests/test_trl_grpo.py", "-k", "one_sided_clips"),
    ),
    Mutation(
        "trl_sequence",
        "KTO: the batch's KL estimate dropped (reference point 0)",
        _TRL_KTO,
        (
            (
                'side["kl"] = kl.reshape(()).to(ref.dtype)',
                'side["kl"] = torch.zeros_like(kl).reshape(()).to(ref.dtype)',
            ),
        ),
        ("tests/test_trl_kto.py", "-k", "matches_trl and kto-weighted"),
    ),
    Mutation(
        "trl_sequence",
        "KTO: a negative KL estimate not clamped to 0",
        _TRL_KTO,
        (
            (
                "kl = accelerator.gather_for_metrics(kl).mean().clamp(min=0)",
                "kl = accelerator.gather_for_metrics(kl).mean()",
            ),
        ),
        ("tests/test_trl_kto.py", "-k", "clamps_a_negative_kl"),
    ),
    Mutation(
        "trl_sequence",
        "KTO: desirable and undesirable labels inverted",
        _TRL_KTO,
        (
            (
                'label = torch.as_tensor(batch["label"], dtype=torch.bool, device=device)',
                'label = ~torch.as_tensor(batch["label"], dtype=torch.bool, device=device)',
            ),
        ),
        ("tests/test_trl_kto.py", "-k", "matches_trl and apo_zero_unpaired"),
    ),
    Mutation(
        "trl_sequence",
        "KTO: desirable and undesirable weights swapped",
        _TRL_KTO,
        (
            (
                "            desirable_weight=float(trainer.desirable_weight),\n"
                "            undesirable_weight=float(trainer.undesirable_weight),\n",
                "            desirable_weight=float(trainer.undesirable_weight),\n"
                "            undesirable_weight=float(trainer.desirable_weight),\n",
            ),
        ),
        ("tests/test_trl_kto.py", "-k", "matches_trl and kto-weighted"),
    ),
    Mutation(
        "trl_sequence",
        "KTO: the rewards logged without beta",
        _TRL_KTO,
        (("rewards = trainer.beta * (logps - ref)", "rewards = logps - ref"),),
        ("tests/test_trl_kto.py", "-k", "matches_trl and kto-weighted"),
    ),
)

_MACHINE = "src/linear_ce/engine/machine.py"

_MACHINE_PLAN: tuple[Mutation, ...] = (
    Mutation(
        "machine_plan",
        "LINEAR_CE_CHUNK_ROWS ignored where the plan keeps the longest chunks",
        "src/linear_ce/engine/plan.py",
        (
            (
                "keep_longest = (half_cpu or longest) and tuning.forced_rows() is None",
                "keep_longest = half_cpu or longest",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "forced_rows"),
    ),
    Mutation(
        "machine_plan",
        "chunk rows: the largest candidate within tolerance, not the smallest",
        _MACHINE,
        (
            (
                "        chosen = _smallest_near(best, top)\n",
                "        chosen = max(b for b, r in best.items() if r >= (1 - TOLERANCE) * top)\n",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "budgets_unless_another"),
        quick=True,
    ),
    Mutation(
        "machine_plan",
        "tile layout: the slower layout's GEMMs win",
        _MACHINE,
        (
            (
                "return rates[(b, False)][3] <= (1 + TOLERANCE) * rates[(b, True)][3]",
                "return rates[(b, False)][3] > (1 + TOLERANCE) * rates[(b, True)][3]",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "layout_follows"),
    ),
    Mutation(
        "machine_plan",
        "an unsteady measurement is trusted",
        _MACHINE,
        (
            (
                "    return rates[-2] <= 1 + NOISE_LIMIT and rates[-1] >= MIN_BUSY\n",
                "    return True\n",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "unsteady or busy"),
    ),
    Mutation(
        "machine_plan",
        "native half GEMMs taken where they measured slower",
        _MACHINE,
        (
            (
                "return not _steady(known[key]) or known[key][0] >= HALF_MIN_SPEEDUP",
                "return not _steady(known[key]) or known[key][0] < HALF_MIN_SPEEDUP",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "half_path_taken"),
    ),
    Mutation(
        "machine_plan",
        "vocabulary pass: the largest class block, not the smallest within tolerance",
        _MACHINE,
        (
            (
                "        return fallback if best is None else _smallest_near(best, max(best.values()))\n",
                "        return fallback if best is None else max(best)\n",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "class_block"),
    ),
    Mutation(
        "machine_plan",
        "half tile step: measured rows not scaled to the call's classes",
        _MACHINE,
        (
            (
                "return max(1, best * STEP_MEASURE_CLASSES // max(classes, 1))",
                "return max(1, best)",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "half_tile_step"),
    ),
    Mutation(
        "machine_plan",
        "exponential: exp2 taken where it measured slower than exp",
        _MACHINE,
        (("        return known[key][0] > 1.0\n", "        return known[key][0] < 1.0\n"),),
        ("tests/test_machine_plan.py", "-k", "exp_form"),
    ),
    Mutation(
        "machine_plan",
        "exponential: the plan ignores the measured or forced form",
        "src/linear_ce/engine/plan.py",
        (
            (
                "    exp2 = half_math and tuning.exp2(EXP_FLAG not in cpu_flags())\n",
                "    exp2 = half_math\n",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "exp_form"),
    ),
    Mutation(
        "machine_plan",
        "half tile step measured without the per-step operations",
        _MACHINE,
        (("            for _ in range(STEP_ROW_OPS // 4):\n", "            for _ in range(0):\n"),),
        ("tests/test_machine_plan.py", "-k", "step_measurement"),
    ),
    Mutation(
        "machine_plan",
        "half tile without gradients: every step's statistics over the chunk's first rows",
        "src/linear_ce/engine/chunk_loop.py",
        (
            (
                "at = start if two_sweeps or chunk_stats else 0",
                "at = start if two_sweeps else 0",
            ),
        ),
        ("tests/test_precision.py", "-k", "exp_forms"),
    ),
    Mutation(
        "machine_plan",
        "a companion loop takes the measured smallest chunk, not the budget's longest",
        "src/linear_ce/engine/plan.py",
        (
            (
                "keep_longest = (half_cpu or longest) and tuning.forced_rows() is None",
                "keep_longest = half_cpu and tuning.forced_rows() is None",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "companion_loop"),
    ),
    Mutation(
        "linear_divergence",
        "the head's scratch blocks sized by bytes alone, not capped by the tile's columns",
        _DIVERGENCE_HEAD,
        (
            (
                "return max(1, min(by_bytes, max(int(columns * _MAX_BLOCK_SHARE), _MIN_WIDTH)))",
                "return max(1, by_bytes)",
            ),
        ),
        ("tests/test_divergence.py", "-k", "transient_memory"),
    ),
    Mutation(
        "chunk_loop",
        "a class-major tile's row sum leaves out the classes past the last whole slab",
        "src/linear_ce/engine/row_reductions.py",
        (("out.add_(tile[:, -rest:].sum(dim=1))", "out.add_(0)"),),
        ("tests/test_row_reductions.py",),
        quick=True,
    ),
    Mutation(
        "chunk_loop",
        "a class-major tile's row max leaves out the classes past the last whole slab",
        "src/linear_ce/engine/row_reductions.py",
        (
            (
                "torch.maximum(result, tile[:, -rest:].amax(dim=1), out=result)",
                "result.clone()",
            ),
        ),
        ("tests/test_row_reductions.py",),
    ),
)

_NATIVE_C = "src/linear_ce/engine/native_rows.c"
_NATIVE_TESTS = ("tests/test_native_rows.py",)


_NATIVE_ROWS: tuple[Mutation, ...] = (
    Mutation(
        "native_rows",
        "compiled gradient: the target column's gamma dropped",
        _NATIVE_C,
        (("g_t += gamma[i];", ""),),
        _NATIVE_TESTS,
        quick=True,
    ),
    Mutation(
        "native_rows",
        "compiled gradient: the b (u - mu) term dropped",
        _NATIVE_C,
        (
            (
                "row[j] = STORE(e * (e == 0.0f ? ai + bi + mi : ai + bi * (u - mi)));",
                "row[j] = STORE(e * (e == 0.0f ? ai + bi + mi : ai));",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled exp: a wrong Taylor coefficient (1/25 for 1/24)",
        _NATIVE_C,
        (("p = p * r + 1.0f / 24.0f;", "p = p * r + 1.0f / 25.0f;"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled bf16 rounding truncates instead of rounding to nearest even",
        _NATIVE_C,
        (
            (
                "uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;",
                "uint32_t rounded = b >> 16;",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled stats: a NaN logit no longer makes the row max NaN",
        _NATIVE_C,
        (("*row_max = nan ? NAN : m;", "*row_max = m;"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled stats: a row holding a NaN keeps its fast path's max and sums",
        _NATIVE_C,
        (("if (s == s) {", "if (1) {"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled sums: a wrong coefficient of the exponential's polynomial",
        _NATIVE_C,
        (("p = p * r + 0.04166822507977486f;", "p = p * r + 0.0425f;"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled bf16 sums: the high half of a pair read as the low one",
        _NATIVE_C,
        (("uint32_t b = w & 0xffff0000u;", "uint32_t b = w << 16;"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled half gradient: a masked class's term below the clamp not zeroed",
        _NATIVE_C,
        (("float e = u < EXP_SUM_CLAMP ? 0.0f : exp_sum(x);", "float e = exp_sum(x);"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled half gradient: the b (x - mu) term dropped on the fast path",
        _NATIVE_C,
        (("return e * (a + b * (x - mu));", "return e * a;"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled bf16 gradient: a pair's halves written back swapped",
        _NATIVE_C,
        (
            (
                "uint32_t out = (uint32_t)to_bf16(low) | (uint32_t)to_bf16(high) << 16;",
                "uint32_t out = (uint32_t)to_bf16(high) | (uint32_t)to_bf16(low) << 16;",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled half fused loops: a masked class's term below the clamp not zeroed",
        _NATIVE_C,
        (
            (
                "float x = u < EXP_SUM_CLAMP ? 0.0f : exp_sum(clamp_sum(u));",
                "float x = exp_sum(clamp_sum(u));",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled half fused loops: a row holding a NaN keeps its fast path's sums",
        _NATIVE_C,
        (("return s == s;", "return 1;"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled fp16 widening: inf read as a finite number",
        _NATIVE_C,
        (("bits = (b & 0x7fffu) >= 0x7c00u ? magnitude | 0x7f800000u : bits;", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled fp16 widening: the sign dropped",
        _NATIVE_C,
        (("bits |= (uint32_t)(b & 0x8000u) << 16;", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "row-major fused kernel: a NaN logit no longer makes the row max NaN",
        _NATIVE_C,
        # Blanked to its width, so the macro's line continuation stays where it was.
        (("if (nan) m = NAN;", " " * len("if (nan) m = NAN;")),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "compiled dot sum: a masked class's e * u taken at u = -inf, not the clamped x",
        _NATIVE_C,
        (("d += e * x;", "d += e * u;"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "stats read rows at the tile's width, not its row stride",
        "src/linear_ce/engine/native_rows.py",
        (("else tile.stride(0)", "else tile.shape[1]"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "rows split over threads: the calling thread's range never run",
        "src/linear_ce/engine/native_rows.py",
        (("    run(bounds[0], bounds[1])\n", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "a failed build under auto gives no warning",
        "src/linear_ce/engine/native_rows.py",
        (("                    if not required:\n", "                    if False:\n"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "chunk loop: rows_done before the chunk's statistics are filled",
        "src/linear_ce/engine/chunk_loop.py",
        (
            (
                "    stats[:, 0] = sums.sum_exp\n"
                "    head.native_sums(sums.target_u, sums.dot, stats[:, 1:])\n"
                "    row_stats = RowStats.of(sums.row_max, stats)\n"
                "    head.rows_done(rows, p, row_stats)\n",
                "    row_stats = RowStats.of(sums.row_max, stats)\n"
                "    head.rows_done(rows, p, row_stats)\n"
                "    stats[:, 0] = sums.sum_exp\n"
                "    head.native_sums(sums.target_u, sums.dot, stats[:, 1:])\n",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "token log-prob native sums: the entropy's dot sum left out",
        "src/linear_ce/losses/token_logprob.py",
        (('out[:, self.slot["dot"]] = dot', 'out[:, self.slot["dot"]] = 0.0'),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "token log-prob head claims the loops with top-1 or other statistics asked",
        "src/linear_ce/losses/token_logprob.py",
        (
            (
                "self.native = not (self.top1_on or self.sq_on or self.mean_on or self.topk)",
                "self.native = True",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "cross-entropy head claims the loops with label smoothing",
        "src/linear_ce/losses/cross_entropy.py",
        (
            (
                "self.native = terms.target is not None and not self.smoothing",
                "self.native = terms.target is not None",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "chunk loop takes the loops under a softcap",
        "src/linear_ce/engine/chunk_loop.py",
        (("        and transform.softcap is None\n", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "token log-prob native gradient: the entropy's b with the wrong sign",
        "src/linear_ce/losses/token_logprob.py",
        (("b=-(h.to(z.dtype) * factor) / z", "b=(h.to(z.dtype) * factor) / z"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major kernel: the sum not rescaled when a block's max grows",
        _NATIVE_C,
        (("s[k] * exp_nonpositive(m[k] - part[k])", "s[k]"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major kernel: a block's sum starts from its max, not 0",
        _NATIVE_C,
        (("            part[k] = 0.0f;\n", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major kernel: the c1 (z-loss) term of a dropped",
        _NATIVE_C,
        (
            (
                "if (c1[i] != 0.0f) a[k] += c1[i] * (isinf(m[k]) ? m[k] : m[k] + logf(z));",
                "",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major kernel: the target column's gradient not written",
        _NATIVE_C,
        (("if (t >= 0) tile[t * ld + r0 + k] = part[k];", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major kernel: a thread's rows read their outputs from row 0",
        _NATIVE_C,
        (("int64_t i = r0 + k, t = target[i];", "int64_t i = k, t = target[i];"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major kernel: a NaN logit no longer makes the row max NaN",
        _NATIVE_C,
        (("            m[k] = s[k] = NAN;\n", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "row-major fused kernel: the c1 (z-loss) term of a dropped",
        _NATIVE_C,
        (("if (c1[i] != 0.0f) a += c1[i] * (isinf(m) ? m : m + logf(z));", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "row-major fused kernel: the target column's gamma not added",
        _NATIVE_C,
        (("if (t >= 0) row[t] = STORE(e[t] * a + gamma[i]);", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major tile read with its row count as class stride",
        "src/linear_ce/engine/native_rows.py",
        (("tile.stride(1) if class_major", "tile.shape[0] if class_major"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "chunk loop takes the loops for every head's fp32 tile (token_logprobs too)",
        "src/linear_ce/engine/chunk_loop.py",
        (('(half or getattr(head, "native_fp32", False))', "True"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "cross-entropy head no longer takes the loops for fp32 tiles",
        "src/linear_ce/losses/cross_entropy.py",
        (("self.native_fp32 = self.native", "self.native_fp32 = False"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "token_objective's fp32 tiles keep torch's row math",
        "src/linear_ce/losses/token_objective.py",
        (("    native_fp32 = True\n", "    native_fp32 = False\n"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "sequence_objective's fp32 tiles keep torch's row math",
        "src/linear_ce/losses/sequence_objective.py",
        (("    native_fp32 = True\n", "    native_fp32 = False\n"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "token_objective's plan holds a second fp32 tile where the loops take the call",
        "src/linear_ce/engine/chunk_loop.py",
        (("native=companion is None\n", "native=False\n"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "sequence_objective's plan holds a second fp32 tile where the loops take the call",
        "src/linear_ce/ops/sequence_objective.py",
        (("any(spec.needs), native=native)", "any(spec.needs), native=False)"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major dot sum: the shift of a grown max dropped",
        _NATIVE_C,
        (("(d[k] - (part[k] - m[k]) * s[k])", "d[k]"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major dot sum not rescaled when a block's max grows",
        _NATIVE_C,
        (("d[k] = grown ? shifted : d[k];", "d[k] = grown ? d[k] : d[k];"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major dot sum: a block's terms not added",
        _NATIVE_C,
        (('_Pragma("omp simd") for (int64_t k = 0; k < w; ++k) d[k] += dpart[k];', ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "cross-entropy fused coefficients without the z-loss term",
        "src/linear_ce/losses/cross_entropy.py",
        (("c1 = 2.0 * r * terms.zeta[rows, p]", "c1 = 0.0 * r * terms.zeta[rows, p]"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "DPO scaled rows' fused gradient: the target's gamma with the wrong sign",
        "src/linear_ce/losses/sequence_objective.py",
        (
            (
                "return torch.full_like(owned, -factor), torch.zeros_like(owned), factor * owned",
                "return torch.full_like(owned, -factor), torch.zeros_like(owned), -factor * owned",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "class-major gradient without the entropy's b term",
        _NATIVE_C,
        (
            (
                "p[k] = e * (e == 0.0f ? ai[k] + bi[k] + mi[k] : ai[k] + bi[k] * (u - mi[k]));",
                "p[k] = e * (e == 0.0f ? ai[k] + bi[k] + mi[k] : ai[k]);",
            ),
        ),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "half blocks of the vocabulary pass taken with a bias (its term never added)",
        "src/linear_ce/engine/vocab_pass.py",
        (("        and bias is None\n", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "half blocks of the vocabulary pass taken with a softcap",
        "src/linear_ce/engine/vocab_pass.py",
        (("        and transform.softcap is None\n", ""),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "half blocks without the transform's factor on the raw logits",
        "src/linear_ce/losses/token_logprob.py",
        (("classes, factor, scale=factor)", "classes, factor, scale=1.0)"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "vocabulary pass: each row group's weight gradient written over the last's",
        "src/linear_ce/engine/vocab_pass.py",
        (("direct = [len(g) == 1 and", "direct = [True and"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "the vocabulary pass never takes half blocks",
        "src/linear_ce/losses/token_logprob.py",
        (("    half_blocks = True\n", "    half_blocks = False\n"),),
        _NATIVE_TESTS,
    ),
    Mutation(
        "native_rows",
        "vocabulary pass by the loops: the target's log-prob gradient dropped",
        "src/linear_ce/losses/token_logprob.py",
        (("            gamma=g * owned,\n", "            gamma=0 * owned,\n"),),
        _NATIVE_TESTS,
    ),
)


_PAIR_TESTS = ("tests/test_native_rows.py", "-k", "pair")
_PAIR_CALL_TESTS = ("tests/test_divergence.py", "-k", "pair_loops")
_PAIR_MIXTURE_TESTS = ("tests/test_native_rows.py", "-k", "pair_mixture")
_CHUNK_LOOP = "src/linear_ce/engine/chunk_loop.py"

_PAIR_LOOPS: tuple[Mutation, ...] = (
    Mutation(
        "pair_loops",
        "the mixture's log1p without the bits 1 + y rounds off (y / ((1 + y) - 1))",
        _NATIVE_C,
        (("return d == 0.0f ? y : log_x * (y / d);", "return log_x;"),),
        _PAIR_MIXTURE_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major mixture: delta's shift takes log((1 - beta) / beta), not its inverse",
        _NATIVE_C,
        (
            (
                "float shift = logf(zs[0]) - logf(zt[0]) + log_beta - log_rest;",
                "float shift = logf(zs[0]) - logf(zt[0]) - log_beta + log_rest;",
            ),
        ),
        _PAIR_MIXTURE_TESTS,
    ),
    Mutation(
        "pair_loops",
        "class-major mixture: the teacher's late sum C2 never added",
        _NATIVE_C,
        (("                c2[k] += pt[k];\n", ""),),
        _PAIR_MIXTURE_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major mixture gradient without the (1 - beta) factor",
        _NATIVE_C,
        (("as * a * (rest * (ev[j] - mu) + soft)", "as * a * ((ev[j] - mu) + soft)"),),
        _PAIR_MIXTURE_TESTS,
    ),
    Mutation(
        "pair_loops",
        "class-major forward KL: the cross sum's shift dropped where a block raises the max",
        _NATIVE_C,
        (
            (
                "rt * (c[k] - (dt - ds) * zt[k]);",
                "rt * c[k];",
            ),
        ),
        _PAIR_TESTS,
        quick=True,
    ),
    Mutation(
        "pair_loops",
        "class-major reverse KL: the cross sum's shift dropped where a block raises the max",
        _NATIVE_C,
        (("rs * (c[k] - (ds - dt) * zs[k]);", "rs * c[k];"),),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "class-major pair entropy sum: the shift of a raised max dropped",
        _NATIVE_C,
        (("rs * (d[k] - ds * zs[k]);", "rs * d[k];"),),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "class-major hard-term normaliser not rescaled when a block raises the max",
        _NATIVE_C,
        (("            z1[k] *= exp_nonpositive(-power * ds);\n", ""),),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "class-major pair loop: a row's first max moved by -inf - -inf (the guard dropped)",
        _NATIVE_C,
        (
            (
                "float ds = ms[k] == -INFINITY ? 0.0f : ns - ms[k];",
                "float ds = ns - ms[k];",
            ),
        ),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major forward KL: a masked teacher class's 0 * (-inf) not guarded",
        _NATIVE_C,
        ((" c[k] += b == 0.0f ? 0.0f : b * (v - u);", " c[k] += b * (v - u);"),),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major reverse KL gradient: a masked class's 0 * (-inf) not guarded",
        _NATIVE_C,
        (
            (
                "srow[j] = STORE(a == 0.0f ? 0.0f : as * a * ((dj - mu) + soft));",
                "srow[j] = STORE(as * a * ((dj - mu) + soft));",
            ),
        ),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major pair gradient: the hard term's -h T' at the target dropped",
        _NATIVE_C,
        (
            (
                "if (tg >= 0) srow[tg] = STORE(gt - wi * h * (power > 0.0f ? power : 1.0f));",
                "if (tg >= 0) srow[tg] = STORE(gt - wi * h);",
            ),
        ),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "class-major pair gradient: the target's value not fixed up (-h T' dropped)",
        _NATIVE_C,
        (
            (
                "pd[k] = g - wi * h * (power > 0.0f ? power : 1.0f);",
                "pd[k] = g;",
            ),
        ),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major pair entropy sum of e^u times the scaled logit, not u",
        _NATIVE_C,
        (
            (
                "a * (LOAD(srow[j0 + k]) * cs - ms);",
                "a * (LOAD(srow[j0 + k]) * cs);   ",
            ),
        ),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "class-major pair entropy sum without the factor u",
        _NATIVE_C,
        (("pd[k] += a == 0.0f ? 0.0f : a * u;", "pd[k] += a;"),),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major pair gradient: the hard softmax at temperature 1 without its factor T'",
        _NATIVE_C,
        (
            (
                "float az = power > 0.0f ? wi * h * power / z1[0] : 0.0f;",
                "float az = power > 0.0f ? wi * h / z1[0] : 0.0f;",
            ),
        ),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major hard-term normaliser summed at the student's temperature (power dropped)",
        _NATIVE_C,
        (
            (
                "z1[k] += exp_nonpositive(power * (LOAD(srow[j0 + k]) * cs - ms));",
                "z1[k] += exp_nonpositive((LOAD(srow[j0 + k]) * cs - ms));",
            ),
        ),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major pair gradient: the hard term's softmax (T = 1) left out of p's coefficient",
        _NATIVE_C,
        (
            (
                "float wi = w[i], soft = target && power == 0.0f ? h : 0.0f;",
                "float wi = w[i], soft = 0.0f;",
            ),
        ),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "row-major pair loop: a NaN logit no longer makes the row's maxima NaN",
        _NATIVE_C,
        (("if (nan) ms = mt = NAN;", "                       "),),
        _PAIR_TESTS,
    ),
    Mutation(
        "pair_loops",
        "the pair loops' plan not made again for their tiles (the torch path's tiles)",
        _CHUNK_LOOP,
        (
            (
                "plan = plan_for(2 * pair.dtype.itemsize // plan.acc_dtype.itemsize)",
                "plan = plan",
            ),
        ),
        _PAIR_CALL_TESTS,
        quick=True,
    ),
    Mutation(
        "pair_loops",
        "the pair loops' plan counts half tiles as fp32 ones",
        _CHUNK_LOOP,
        (
            (
                "plan = plan_for(2 * pair.dtype.itemsize // plan.acc_dtype.itemsize)",
                "plan = plan_for(2)",
            ),
        ),
        _PAIR_CALL_TESTS,
    ),
    Mutation(
        "pair_loops",
        "pair sums: the teacher's normaliser read from the student's",
        _DIVERGENCE_HEAD,
        (('"z_t": sums.teacher_sum_exp,', '"z_t": sums.sum_exp,'),),
        _PAIR_CALL_TESTS,
    ),
    Mutation(
        "pair_loops",
        "pair sums: the hard term's own normaliser read as the student's",
        _DIVERGENCE_HEAD,
        (('"z_1": sums.z_1,', '"z_1": sums.sum_exp,'),),
        _PAIR_CALL_TESTS,
    ),
    Mutation(
        "pair_loops",
        "pair sums: the entropy's sum left out",
        _DIVERGENCE_HEAD,
        (('"eu": sums.dot,', '"eu": 0.0 * sums.dot,'),),
        _PAIR_CALL_TESTS,
    ),
    Mutation(
        "pair_loops",
        "pair gradient weights without the transform's factor (temperature, logit scale)",
        _DIVERGENCE_HEAD,
        (
            (
                "weight = None if factor is None else self.row_weight[rows, p].float() * factor",
                "weight = None if factor is None else self.row_weight[rows, p].float()",
            ),
        ),
        _PAIR_CALL_TESTS,
    ),
    Mutation(
        "pair_loops",
        "the hard term's temperature-1 normaliser never asked of the pair loops",
        _DIVERGENCE_HEAD,
        (
            (
                '"power": self.temperature if self.own_z1 else 0.0,',
                '"power": 0.0,',
            ),
        ),
        _PAIR_CALL_TESTS,
    ),
    Mutation(
        "pair_loops",
        "the teacher's tile scaled by the student's transform in the pair loops",
        _CHUNK_LOOP,
        (
            (
                "teacher_scale=other.companion.transform.factor,",
                "teacher_scale=transform.factor,",
            ),
        ),
        _PAIR_CALL_TESTS,
    ),
    Mutation(
        "pair_loops",
        "the pair loops taken with a teacher bias (never added)",
        _CHUNK_LOOP,
        (("        or companion.bias is not None\n", ""),),
        _PAIR_CALL_TESTS,
    ),
    Mutation(
        "pair_loops",
        "the pair loops taken with a teacher softcap (never applied)",
        _CHUNK_LOOP,
        (("        or companion.transform.softcap is not None\n", ""),),
        _PAIR_CALL_TESTS,
    ),
)

_STATS_PASS_FILE = "src/linear_ce/engine/stats_pass.py"
_STATS_PASS_TESTS = ("tests/test_stats_pass.py",)
_STATS_PASS = (
    Mutation(
        "stats_pass",
        "blocks' sums of exp added without shifting them to the row max",
        _STATS_PASS_FILE,
        (
            (
                "sum_exp = torch.where(weight == 0, 0.0, weight * block_z).sum(0)",
                "sum_exp = torch.where(weight == 0, 0.0, block_z).sum(0)",
            ),
        ),
        _STATS_PASS_TESTS,
        quick=True,
    ),
    Mutation(
        "stats_pass",
        "blocks' dot sums shifted without the max's change times their sums of exp",
        _STATS_PASS_FILE,
        (
            (
                "weight * (block_d - shift * block_z)",
                "weight * block_d",
            ),
        ),
        _STATS_PASS_TESTS,
    ),
    Mutation(
        "stats_pass",
        "the target's u left relative to its own block's max",
        _STATS_PASS_FILE,
        (("torch.where(owned, block_t - shift, 0.0)", "torch.where(owned, block_t, 0.0)"),),
        _STATS_PASS_TESTS,
    ),
    Mutation(
        "stats_pass",
        "the target's column not moved into its block",
        _STATS_PASS_FILE,
        (
            (
                "local = torch.where(owned, targets - block_of * block, -1)",
                "local = torch.where(owned, targets, -1)",
            ),
        ),
        _STATS_PASS_TESTS,
    ),
    Mutation(
        "stats_pass",
        "the transform's factor not applied by the pass",
        _STATS_PASS_FILE,
        (
            (
                "loops.stats_call(tile, scale=scale, target=local[b], dot=dot, out=sums[b])",
                "loops.stats_call(tile, target=local[b], dot=dot, out=sums[b])",
            ),
        ),
        _STATS_PASS_TESTS,
    ),
    Mutation(
        "machine_plan",
        "the vocabulary pass's half blocks budgeted as fp32 tiles with a half copy",
        "src/linear_ce/engine/plan.py",
        (
            (
                "    if half_blocks and isinstance(gemm, NativeHalf) and tiles == 1:\n",
                "    if False:\n",
            ),
        ),
        ("tests/test_machine_plan.py", "-k", "half_blocks"),
    ),
    Mutation(
        "stats_pass",
        "the pass's tile sized to the whole cache",
        "src/linear_ce/engine/plan.py",
        (("STATS_TILE_CACHE_SHARE = 0.5", "STATS_TILE_CACHE_SHARE = 1.0"),),
        ("tests/test_stats_pass.py", "-k", "cache"),
    ),
)

_SCRATCH_FILE = "src/linear_ce/engine/scratch.py"
_SCRATCH_TESTS = ("tests/test_scratch.py",)
_SCRATCH = (
    Mutation(
        "scratch",
        "a buffer still referenced when its loop returns is kept and handed out again",
        _SCRATCH_FILE,
        (("    free = [b for b in taken if _unreferenced(b)]", "    free = list(taken)"),),
        _SCRATCH_TESTS,
        quick=True,
    ),
    Mutation(
        "scratch",
        "a taken buffer left in the pool, so two takers share it",
        _SCRATCH_FILE,
        (
            (
                "buffer = _kept.pop(min(fits, key=lambda i: _kept[i].numel())) if fits else None",
                "buffer = _kept[min(fits, key=lambda i: _kept[i].numel())] if fits else None",
            ),
        ),
        _SCRATCH_TESTS,
    ),
    Mutation(
        "scratch",
        "a request served from any larger kept buffer, however much larger",
        _SCRATCH_FILE,
        (("if nbytes <= b.numel() <= nbytes + nbytes // 8]", "if nbytes <= b.numel()]"),),
        _SCRATCH_TESTS,
    ),
    Mutation(
        "scratch",
        "the split sum's position that no chunk reached read from its unzeroed memory",
        "src/linear_ce/engine/accumulate.py",
        (
            (
                "                self.result[:, position].zero_()\n                continue\n",
                "                pass\n",
            ),
        ),
        ("tests/test_precision.py", "-k", "no_zeroed"),
    ),
    Mutation(
        "scratch",
        "a forked child starts with its parent's kept scratch",
        _SCRATCH_FILE,
        (("os.register_at_fork(after_in_child=_forked)", "_forked"),),
        ("tests/test_scratch.py", "-k", "fork"),
    ),
    Mutation(
        "scratch",
        "the pool never trimmed to the last call's scratch",
        _SCRATCH_FILE,
        (("        _kept[:] = free", "        _kept.extend(free)"),),
        _SCRATCH_TESTS,
    ),
    Mutation(
        "scratch",
        "the bench's peak leaves out the scratch a call found kept",
        "src/linear_ce/bench/measure.py",
        (('before = _status_bytes("VmRSS") - kept_bytes()', 'before = _status_bytes("VmRSS")'),),
        ("tests/test_scratch.py", "-k", "bench"),
    ),
)

_RESULTS_TESTS = ("tests/test_results.py", "-k", "committed")
# The docs and the results store: the tables drawn from the store, the site's pages and the
# docstrings' roles (scripts/results.py, scripts/mkdocs_hooks.py, scripts/griffe_roles.py).
_DOCS = (
    Mutation(
        "docs",
        "a bf16 step's ratio to the fp32 floor shown as its ratio to its own floor",
        "scripts/results.py",
        (('"bf16": _own(bf16, "linear_ce"),', '"bf16": bf16.get("linear_ce", {}).get("ratio"),'),),
        _RESULTS_TESTS,
        quick=True,
    ),
    Mutation(
        "docs",
        "a peer's paired ratio read the wrong way round",
        "scripts/results.py",
        (
            (
                "return statistics.median(t / r for t, r in zip(times, ref, strict=True))",
                "return statistics.median(r / t for t, r in zip(times, ref, strict=True))",
            ),
        ),
        _RESULTS_TESTS,
    ),
    Mutation(
        "docs",
        "a module among linear_ce.__all__ gets no pages for its names",
        "scripts/mkdocs_hooks.py",
        (("        if name in modules:", "        if False:"),),
        ("tests/test_docs_site.py",),
    ),
    Mutation(
        "docs",
        "math roles left as Sphinx text",
        "scripts/griffe_roles.py",
        (('    text = _MATH.sub(lambda m: f"${m.group(1)}$", text)\n', ""),),
        ("tests/test_docs_site.py",),
    ),
)

_NATIVE_ROWS_FILE = "src/linear_ce/engine/native_rows.py"
_CACHE_TESTS = ("tests/test_native_cache.py",)
_ENV_TESTS = ("tests/test_environment.py",)
_TRUST = (
    Mutation(
        "trust",
        "a cached library loaded without comparing it with its record",
        _NATIVE_ROWS_FILE,
        (("    digest, found = _digest(path)\n", "    return None\n    digest, found = 0, 0\n"),),
        (*_CACHE_TESTS, "-k", "damaged"),
        quick=True,
    ),
    Mutation(
        "trust",
        "a cache directory or file others can write is trusted",
        _NATIVE_ROWS_FILE,
        (("    if info.st_mode & 0o022:\n", "    if False:\n"),),
        (*_CACHE_TESTS, "-k", "others_can_write"),
    ),
    Mutation(
        "trust",
        "a library without the loops' symbols escapes the warning",
        _NATIVE_ROWS_FILE,
        (("except (OSError, AttributeError, subprocess.", "except (OSError, subprocess."),),
        (*_CACHE_TESTS, "-k", "without_the_loops"),
    ),
    Mutation(
        "trust",
        "a compiler past its time is killed alone, its children left running",
        _NATIVE_ROWS_FILE,
        (("        os.killpg(process.pid, signal.SIGKILL)\n", "        process.kill()\n"),),
        (*_CACHE_TESTS, "-k", "never_finishes"),
    ),
    Mutation(
        "trust",
        "a whole number read with str.isdigit ('²' reaches int())",
        "src/linear_ce/engine/environment.py",
        (("not set(text) <= _DIGITS", "not text.isdigit()"),),
        (*_ENV_TESTS, "-k", "same_error"),
    ),
    Mutation(
        "trust",
        "the variables checked only on the calls that read them",
        "src/linear_ce/engine/plan.py",
        (("    check_all()\n", ""),),
        (*_ENV_TESTS, "-k", "same_error"),
    ),
    Mutation(
        "trust",
        "a profile entry's length not checked",
        _MACHINE,
        (('and len(value) == _ENTRY_LENGTHS.get(key.split("/")[0])', "and value"),),
        (*_ENV_TESTS, "-k", "profile"),
    ),
    Mutation(
        "trust",
        "TRL's refusal blames the version for another library's wrapper",
        _TRL,
        (("other = None if problem is None else _another_patch(current)", "other = None"),),
        ("tests/test_trl_patched_by_another.py",),
    ),
)

_TRITON_KERNELS = "src/linear_ce/engine/triton_row_kernels.py"
_TRITON_TESTS = ("tests/test_triton_rows.py", "-k", "loops_against or small_blocks or rounds")

_TRITON_ROWS: tuple[Mutation, ...] = (
    Mutation(
        "triton_rows",
        "Triton stats: the online max no longer rescales the sum so far",
        _TRITON_KERNELS,
        (("s = s * r + tl.sum(e, 1)", "s = s + tl.sum(e, 1)"),),
        _TRITON_TESTS,
        quick=True,
    ),
    Mutation(
        "triton_rows",
        "Triton stats: the dot sum's rescaling drops its shift term",
        _TRITON_KERNELS,
        (("r * (d - (ref - m) * s)", "r * d"),),
        _TRITON_TESTS,
    ),
    Mutation(
        "triton_rows",
        "Triton gradient: the target column's gamma dropped",
        _TRITON_KERNELS,
        (
            (
                "if HAS_B else e * a\n        g = tl.where(cols[None, :] == t[:, None], "
                "g + gamma[:, None], g)",
                "if HAS_B else e * a\n",
            ),
        ),
        _TRITON_TESTS,
    ),
    Mutation(
        "triton_rows",
        "Triton pair loops: reverse KL's sum not rescaled when the student's max grows",
        _TRITON_KERNELS,
        (("rs * (c - (ds - dt) * zs)", "c"),),
        ("tests/test_triton_rows.py", "-k", "pair_small_blocks"),
    ),
    Mutation(
        "triton_rows",
        "Triton bf16 rounding truncates instead of rounding to nearest even",
        _TRITON_KERNELS,
        (("rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16", "rounded = b >> 16"),),
        _TRITON_TESTS,
    ),
)

MUTATIONS: tuple[Mutation, ...] = (
    *_LOSS,
    *_SEQUENCE,
    *_TOKEN_LOGPROBS,
    *_TOKEN_OBJECTIVE,
    *_LINEAR_DIVERGENCE,
    *_SPARSE_DIVERGENCE,
    *_VOCAB_PASS_MUTATIONS,
    *_DTENSOR_MUTATIONS,
    *_VOCAB_PARALLEL,
    *_TRL_MUTATIONS,
    *_TRL_SEQUENCE,
    *_MACHINE_PLAN,
    *_NATIVE_ROWS,
    *_TRITON_ROWS,
    *_PAIR_LOOPS,
    *_STATS_PASS,
    *_SCRATCH,
    *_TRUST,
    *_DOCS,
)


def _apply(text: str, mutation: Mutation) -> str:
    """``text`` with ``mutation``'s edits; :class:`AnchorMoved` where an anchor is not
    found exactly once."""
    for anchor, replacement in mutation.edits:
        count = text.count(anchor)
        if count != 1:
            raise AnchorMoved(
                f"found {count} times in {mutation.path} (expected once): {anchor.strip()[:120]!r}"
            )
        text = text.replace(anchor, replacement)
    return text


def _anchor_problem(root: Path, mutation: Mutation) -> str | None:
    """Why ``mutation`` cannot be applied in ``root`` (``None``: it can)."""
    path = root / mutation.path
    if not path.is_file():
        return f"{mutation.path} does not exist"
    try:
        _apply(path.read_text(), mutation)
    except AnchorMoved as moved:
        return str(moved)
    return None


def _pytest(scratch: Path, args: tuple[str, ...]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(scratch / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "--tb=line", "-p", "no:cacheprovider", *args],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    # With --tb=line a failure is one "path:line: message" line: show the first.
    failure = next((line for line in lines if line.startswith(str(scratch))), "")
    summary = lines[-1] if lines else ""
    return done.returncode, f"{summary}; {failure[:300]}" if failure else summary


def _copy(scratch: Path) -> None:
    # ``.venv-*``: the version matrix's environments (``make test-matrix``), GBs each.
    ignore = shutil.ignore_patterns(
        ".git",
        ".venv",
        ".venv-*",
        "__pycache__",
        ".pytest_cache",
        ".hypothesis",
        ".ruff_cache",
        "bench-out",
    )
    shutil.copytree(REPO, scratch, ignore=ignore, dirs_exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(scratch / "src")}
    where = subprocess.run(
        [sys.executable, "-c", "import linear_ce; print(linear_ce.__file__)"],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(scratch.resolve()):
        raise SystemExit(f"mutate.py: the scratch copy imports linear_ce from {where}")


def _terminate(signum, frame) -> None:
    # SIGTERM unwinds like Ctrl-C, so the scratch directory is removed.
    raise KeyboardInterrupt


def _run(chosen: list[Mutation], baseline: bool) -> dict[str, str]:
    """Each of ``chosen`` (applicable ones) run on a scratch copy: name -> verdict."""
    verdicts: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="linear_ce-mutate-") as tmp:
        scratch = Path(tmp)
        _copy(scratch)
        if baseline:
            for tests in dict.fromkeys(m.tests for m in chosen):
                status, summary = _pytest(scratch, tests)
                if status != 0:
                    raise SystemExit(f"baseline fails: pytest {' '.join(tests)}: {summary}")
        for mutation in chosen:
            target = scratch / mutation.path
            original = target.read_text()
            target.write_text(_apply(original, mutation))
            start = time.monotonic()
            try:
                status, summary = _pytest(scratch, mutation.tests)
            finally:
                target.write_text(original)
            verdict = {0: "SURVIVED", 1: "killed"}.get(status, f"error (pytest exit {status})")
            verdicts[mutation.name] = verdict
            print(
                f"{verdict:>8}  [{mutation.family}] {mutation.name}  "
                f"({time.monotonic() - start:.0f} s: {summary})",
                flush=True,
            )
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-k", dest="pattern", default="", help="only mutations whose family or name has this"
    )
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument(
        "--quick", action="store_true", help="one mutation per family, without the baseline"
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the unmutated run of the tests"
    )
    options = parser.parse_args()
    chosen = [
        m
        for m in MUTATIONS
        if (options.pattern in m.name or options.pattern in m.family)
        and (m.quick or not options.quick)
    ]
    if not chosen:
        print(f"mutate.py: no mutation's family or name has {options.pattern!r}")
        return 2
    moved = {m.name: problem for m in chosen if (problem := _anchor_problem(REPO, m))}
    if options.list:
        for m in chosen:
            mark = f"  ANCHOR MOVED: {moved[m.name]}" if m.name in moved else ""
            quick = " (quick)" if m.quick else ""
            print(f"[{m.family}] {m.name}{quick}{mark}\n    {m.path}; pytest {' '.join(m.tests)}")
        return 0

    signal.signal(signal.SIGTERM, _terminate)
    start = time.monotonic()
    for m in chosen:
        if m.name in moved:
            print(f"anchor moved  [{m.family}] {m.name}: {moved[m.name]}", flush=True)
    runnable = [m for m in chosen if m.name not in moved]
    verdicts = (
        _run(runnable, baseline=not (options.no_baseline or options.quick)) if runnable else {}
    )
    elapsed = time.monotonic() - start

    print("\nfamily: killed / mutations")
    by_family: dict[str, list[Mutation]] = collections.defaultdict(list)
    for m in chosen:
        by_family[m.family].append(m)
    for family, members in by_family.items():
        killed = sum(verdicts.get(m.name) == "killed" for m in members)
        print(f"  {family}: {killed} / {len(members)}")
    failed = [m for m in chosen if verdicts.get(m.name, "anchor moved") != "killed"]
    print(f"{len(chosen) - len(failed)} of {len(chosen)} mutations killed in {elapsed:.0f} s")
    for m in failed:
        print(f"not killed ({verdicts.get(m.name, 'anchor moved')}): [{m.family}] {m.name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
