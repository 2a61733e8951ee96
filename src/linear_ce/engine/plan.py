"""The precision and memory plan: every "auto" resolved once per call, as a frozen value.

The chunk loop only reads a :class:`Plan`; which dtype each intermediate has,
which scratch buffers exist and how GEMMs are issued is decided here.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from linear_ce.engine.capability import (
    HALF_DTYPES,
    cpu_flags,
    last_level_cache_bytes,
    native_half_gemm,
)
from linear_ce.engine.environment import check_all
from linear_ce.engine.gemm import BlockUpcast, CudaOutDtype, Gemm, NativeHalf, SameDtype, Upcast
from linear_ce.engine.machine import (
    Tuning,
    forced_stats_block,
    half_gemm_pays,
    memory_budget,
    tuning_for,
)
from linear_ce.options import LinearCrossEntropyOptions, parse_chunking_method

__all__ = [
    "BUDGET_SHARE",
    "CUDA_FREE_MEMORY_SHARE",
    "DIRECT_SUM_MAX_CHUNKS",
    "DIVERGENCE_SHARE",
    "EXP_FLAG",
    "HALF_CPU_BUDGET_SHARE",
    "HALF_TILE_STEP_ROWS",
    "MEASURED_STRETCH",
    "MIN_CLASS_BLOCK",
    "MIN_EFFICIENT_ROWS",
    "ROW_MULTIPLE",
    "STATS_TILE_CACHE_SHARE",
    "STATS_TILE_FALLBACK_BYTES",
    "ChunkCall",
    "Plan",
    "acc_dtype_for",
    "choose_chunk_rows",
    "choose_vocab_blocks",
    "make_plan",
    "reported_dtype",
    "split_sum_supported",
]

#: Fewer rows than this per chunk leaves the GEMMs memory-bound on a CPU.
MIN_EFFICIENT_ROWS = 128
#: Budgeted chunks are rounded down to a multiple of this: a CPU GEMM over an odd number
#: of rows can lose a third of its rate (docs/benchmarks.md, why linear_ce can beat the
#: floor).
ROW_MULTIPLE = 32
#: The ``"budget"`` rule lets the per-chunk scratch take this share of the gradients' bytes:
#: with the gradients themselves that is ≈ 1.25× their bytes, inside the 1.3× bound. Within
#: it the plan keeps the budget's rows unless this machine's GEMMs measured faster at
#: others (:mod:`linear_ce.engine.machine`); ``LINEAR_CE_MEMORY_BUDGET`` sets another share, and every
#: share below scales with it.
BUDGET_SHARE = 0.25
#: Where this machine's GEMMs are measured, a one-tile chunk loop under the default budget
#: (no ``LINEAR_CE_MEMORY_BUDGET``) may take up to this multiple of ``BUDGET_SHARE`` (0.5 of
#: the gradients' bytes: a step's peak ≈ 1.5× them) if longer chunks measured faster: each
#: chunk's weight-gradient GEMM reads and writes the whole ``(V, F)`` sum, so short chunks
#: pay per chunk. A CPU whose GEMMs reach their rate only at longer chunks takes them, at
#: up to 1.5× the gradients' bytes (the store's ``sapphire-rapids`` run in
#: results/runs.jsonl: 352-row chunks); the fixed rule keeps the budget.
MEASURED_STRETCH = 2.0
#: The share of the student's gradient bytes the two (or three) logits tiles of a
#: distillation call (:mod:`linear_ce.ops.divergence`) may take, and they take the budget's
#: longest chunks (``make_plan(longest=True)``): the GEMM measurement does not see the
#: per-chunk passes over two tiles, so the smallest chunk at full GEMM rate runs the
#: step well above its floor where the longest do not (docs/journal.md, distillation).
#: With the gradients themselves and the head's scratch blocks (at most
#: 1/16 of a tile each) a step stays within 1.5× of them: at 0.48, fp32, every beta,
#: 1.47-1.48× at N=512, D=1024, V=8192 and N=2048, D=1024, V=32768 (256-row chunks), 1.47×
#: at N=1024, D=1024, V=2048 (tests/test_divergence.py).
DIVERGENCE_SHARE = 0.48
#: The share for half inputs accumulated in fp32 on a CPU without native half GEMMs
#: (``BlockUpcast``), whose gradients have half the bytes while the scratch rows stay
#: fp32: the quarter share would give chunks of ``MIN_EFFICIENT_ROWS`` at the bench's shape,
#: whose GEMMs run below their rate; this share doubles them, within the 2.5× of the
#: gradients' bytes half inputs may take. The
#: native path takes it too, for its half tile at 2 bytes per logit (544-row chunks there
#: with the split sum; with at most ``DIRECT_SUM_MAX_CHUNKS`` chunks the plane's bytes are
#: added, 2 × 1024 rows).
HALF_CPU_BUDGET_SHARE = 0.5
#: Rows widened to fp32 at a time under a half tile (``Plan.rows_per_step``) where it is
#: not measured (:meth:`linear_ce.engine.machine.Tuning.step_rows`). The half tile carries the
#: GEMMs, so its chunks can be 3× longer in the same bytes (2 per logit instead of an fp32
#: tile's 4 and its half copy's 2), while the fp32 math runs on steps of this many rows.
#: Shorter steps stay in a core's L2 (16 rows at V=32768: 2 MiB of fp32) and can run
#: faster on an idle core, but each of a step's passes is a parallel region of its own,
#: which a busy machine makes wait once per pass: short steps then cost several times the
#: floor (docs/journal.md, native bf16). So the fixed rule keeps 64 rows, and shorter
#: steps are taken only where this machine measured them faster with its threads
#: (``step_rates``, which a busy machine leaves unsteady, hence unused).
HALF_TILE_STEP_ROWS = 64
#: Where it is not measured (:meth:`linear_ce.engine.machine.Tuning.exp2`), half inputs'
#: fp32 math forms ``eᵘ`` with ``torch.exp`` on a CPU with this flag, else as
#: ``2^(u·log₂e)``: which of the two torch vectorises better follows the CPU generation,
#: and the AMX generation is the one whose ``exp`` was the faster (docs/journal.md,
#: ``exp`` or ``exp2``).
EXP_FLAG = "amx_tile"
#: Fewest classes per block of the vocabulary pass (:mod:`linear_ce.engine.vocab_pass`) before
#: its rows are split into groups, where it is not measured
#: (:meth:`linear_ce.engine.machine.Tuning.min_class_block`): the block's three GEMMs have
#: ``C`` as a dimension (and the input gradient's as its inner one), and a CPU's GEMMs
#: come within ~10% of their large-block rate from 512 classes on at the bench's shapes.
MIN_CLASS_BLOCK = 512
#: Class blocks are rounded down to a multiple of this.
CLASS_MULTIPLE = 128
#: The statistics pass's tile (:mod:`linear_ce.engine.stats_pass`) takes at most this share
#: of the last-level cache (and the budget's bytes): the compiled loops read each block's
#: logits back from cache right after its GEMM wrote them.
STATS_TILE_CACHE_SHARE = 0.5
#: The statistics pass's tile where the last-level cache's size is unknown: half of a
#: 32 MiB L3.
STATS_TILE_FALLBACK_BYTES = 16 << 20
#: Under ``"balanced"``, a half weight gradient summed over at most this many chunks (per
#: output position) is held in the result itself (``"direct"``: one rounding per chunk)
#: instead of the split sum. Against float64, relative to the plain bf16 expression's own
#: error (D=256, V=4096, uniform and Zipf targets, 3 seeds): 1.17× at 2 chunks, 1.14× at 3,
#: 1.49× at 4, 2.04× at 8 — the bound is 2×. It saves the split sum's ``V·F`` bytes (spent
#: on longer chunks) and its unpack/add/pack pass per chunk.
DIRECT_SUM_MAX_CHUNKS = 4
#: On CUDA the chunk loop's tiles are sized from the GPU's memory (not a CPU's cache or
#: measurement): the budget's share of the gradients' bytes, and never more than this share
#: of the device's free memory (``torch.cuda.mem_get_info`` when the call is planned), so
#: that a call made with little memory left takes shorter chunks instead of failing.
#: Longer chunks trade memory for fewer passes of the weight-gradient GEMM over the whole
#: ``(V, F)`` sum (``LINEAR_CE_MEMORY_BUDGET`` sets the share; docs/gpu.md).
CUDA_FREE_MEMORY_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one call will do.

    Attributes:
        rows_per_chunk: rows of the input processed together.
        rows_per_step: with native half GEMMs on a CPU (``NativeHalf``), rows whose
            logits the chunk loop widens to fp32 at a time, the chunk's own tile holding
            its logits and gradient in the half dtype (a *half tile*); otherwise
            ``rows_per_chunk``.
        classes_per_block: classes of each vocabulary block of the vocabulary pass
            (:mod:`linear_ce.engine.vocab_pass`); the whole vocabulary in the chunk loop.
        input_dtype: dtype of input, weight and the returned gradients.
        acc_dtype: dtype of the ``(chunk, V)`` logits/softmax buffer, the row
            statistics, the loss and the grad-input accumulator.
        weight_grad_dtype: the precision the ``(V, F)`` weight gradient is
            summed over chunks in.
        weight_grad: how that sum is held (see :mod:`linear_ce.engine.accumulate`):
            ``"direct"`` in the result itself, ``"wide"`` in a separate
            ``weight_grad_dtype`` buffer, ``"split"`` as fp32 spread over the
            half result and a low-order plane.
        gemm: how the three GEMMs are issued (see :mod:`linear_ce.engine.gemm`).
        policy: the resolved ``acc_policy``.
        exp2: form :math:`e^u` as :math:`2^{u \\log_2 e}` in the chunk loop: half inputs
            with fp32 math on a CPU, where that measured faster than ``torch.exp``
            (:meth:`linear_ce.engine.machine.Tuning.exp2`; the fallback: ``EXP_FLAG``,
            the CPU feature that tells which form torch runs faster). Its
            relative error, ≤ ``|u|·2⁻²⁴`` (1.8e-6 over ``u ∈ [−30, 0]``), is ~2⁻¹² of a
            bf16 rounding and ~2⁻⁸ of an fp16 one.
    """

    rows_per_chunk: int
    rows_per_step: int
    classes_per_block: int
    input_dtype: torch.dtype
    acc_dtype: torch.dtype
    weight_grad_dtype: torch.dtype
    weight_grad: str
    gemm: Gemm
    policy: str
    exp2: bool


def split_sum_supported(input_dtype: torch.dtype, acc_dtype: torch.dtype) -> bool:
    """Whether :class:`~linear_ce.engine.accumulate.SplitSum` can hold an ``acc_dtype`` sum for ``input_dtype``:
    half inputs with fp32 accumulation, on a little-endian host (the planes are byte views)."""
    return input_dtype in HALF_DTYPES and acc_dtype == torch.float32 and sys.byteorder == "little"


class ChunkCall(NamedTuple):
    """The call a chunk rule sizes chunks for: ``rows`` (``N``), ``in_features`` (``F``),
    ``num_classes`` (``V``), the user's ``options``, the ``input_dtype`` and the dtype of
    the loop's tiles ``tile_dtype``."""

    rows: int
    in_features: int
    num_classes: int
    options: LinearCrossEntropyOptions
    input_dtype: torch.dtype
    tile_dtype: torch.dtype

    @property
    def grad_bytes(self) -> int:
        """The gradients' bytes ``(N + V)·F·itemsize``: the unit of the memory budget."""
        return (self.rows + self.num_classes) * self.in_features * self.input_dtype.itemsize


def choose_chunk_rows(
    call: ChunkCall,
    tiles: int = 1,
    share: float = BUDGET_SHARE,
    pick: Callable[[int, int], int] | None = None,
    stretch: float = 1.0,
) -> int:
    """Rows per chunk of ``call``, by the documented rule of ``options.chunking_method``.

    ``"budget[:N]"`` (what ``"auto"`` means): the ``tiles`` ``(chunk, V)`` scratch
    buffers of the chunk loop (:func:`linear_ce.engine.chunk_loop.tiles_for`) may take ``share / N``
    (default ``BUDGET_SHARE``) of the gradients' bytes
    ``(rows + V)·F·itemsize``, rounded down to a multiple of ``ROW_MULTIPLE``;
    never fewer than ``MIN_EFFICIENT_ROWS`` rows (GEMM efficiency), never more
    than ``rows``; ``pick`` (the machine's choice, :meth:`linear_ce.engine.machine.Tuning.rows`,
    given those rows and the rows of ``stretch`` times the budget) may take fewer, or more up
    to the stretched budget's; then evened out over the same number of chunks (each rounded up
    to a multiple of ``ROW_MULTIPLE``, within the budget).
    ``"aspect_ratio[:N]"``: torch's rule, ``next_pow2(ceil(rows / ceil(V / F))) / N``.
    """
    rows, in_features, num_classes, options = call[:4]
    if rows == 0:
        return 1
    if options.batch_chunk_size is not None:
        return min(options.batch_chunk_size, rows)
    method, divisor = parse_chunking_method(options.chunking_method)
    if method is None:
        return rows
    if method == "aspect_ratio":
        ratio = -(-num_classes // in_features)
        target = -(-rows // ratio)
        return max(1, min((1 << (target - 1).bit_length()) // divisor, rows))
    grad_bytes = call.grad_bytes
    row_bytes = num_classes * call.tile_dtype.itemsize * tiles
    budget_rows = int(share * grad_bytes / divisor) // max(row_bytes, 1)
    chunk = _budgeted_rows(budget_rows, rows, divisor)
    if pick is not None:
        wide_rows = int(stretch * share * grad_bytes / divisor) // max(row_bytes, 1)
        wide = max(chunk, _budgeted_rows(wide_rows, rows, divisor))
        chunk = max(1, min(pick(chunk, wide), wide))
    return _evened(chunk, rows)


def _budgeted_rows(budget_rows: int, rows: int, divisor: int) -> int:
    """``budget_rows`` rounded down to a multiple of ``ROW_MULTIPLE`` (unless under one),
    at least ``MIN_EFFICIENT_ROWS / divisor``, at most ``rows``, at least 1."""
    if budget_rows >= ROW_MULTIPLE:
        budget_rows -= budget_rows % ROW_MULTIPLE
    return max(1, min(rows, max(budget_rows, MIN_EFFICIENT_ROWS // divisor)))


def _evened(chunk: int, rows: int) -> int:
    """Chunks of ``rows`` as many as ``chunk`` gives, of equal size: ``rows / chunks``
    rounded up to a multiple of ``ROW_MULTIPLE`` (never above ``chunk``): a chunk's GEMMs
    run at the rate of its rows, and equal chunks have no short one running below it."""
    even = -(-rows // -(-rows // chunk))
    if even >= ROW_MULTIPLE:
        even = -(-even // ROW_MULTIPLE) * ROW_MULTIPLE
    return min(chunk, even)


def choose_vocab_blocks(
    call: ChunkCall,
    bytes_per_logit: float,
    bytes_per_row: float = 0.0,
    share: float = BUDGET_SHARE,
    min_class_block: int = MIN_CLASS_BLOCK,
) -> tuple[int, int]:
    """``(rows per group, classes per block)`` of the vocabulary pass of ``call``.

    Its ``(rows, C)`` tiles take ``bytes_per_logit`` bytes per logit (the tiles, and a
    tile's operand copy where the GEMM operands have another dtype), its row buffers
    ``bytes_per_row`` per row of a group (gathered rows, their input gradient, an
    upcast copy), and together they may take the same budget as the chunk loop's,
    ``share / N`` of the gradients' bytes for ``"budget[:N]"``/``"auto"``. Every row
    goes into one group, so each block's weight gradient is one GEMM over all rows,
    unless that leaves fewer than ``min_class_block`` classes (``MIN_CLASS_BLOCK``, or the
    machine's measured choice): then groups of rows are
    sized for that many classes (never fewer than ``MIN_EFFICIENT_ROWS`` rows). ``batch_chunk_size``,
    ``"aspect_ratio"`` and ``None`` set the groups as they set the chunk loop's chunks.
    Blocks are rounded down to a multiple of ``CLASS_MULTIPLE``, within ``[1, V]``.
    """
    rows, _, num_classes, options = call[:4]
    if rows == 0 or num_classes == 0:
        return 1, max(num_classes, 1)
    method, divisor = parse_chunking_method(options.chunking_method)
    budget = share * call.grad_bytes / divisor
    budgeted = options.batch_chunk_size is None and method in ("auto", "budget")
    smallest = min_class_block * bytes_per_logit + bytes_per_row
    if budgeted:
        group = rows
        if group * smallest > budget:
            group = _budgeted_rows(int(budget // smallest), rows, divisor)
    else:
        group = choose_chunk_rows(call)
    classes = int(max(budget - group * bytes_per_row, 0) // (group * bytes_per_logit))
    if classes >= CLASS_MULTIPLE:
        classes -= classes % CLASS_MULTIPLE
    return group, max(1, min(num_classes, max(classes, min_class_block // divisor)))


def acc_dtype_for(input_dtype: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """The accumulation dtype: ``requested``, or float32 for half inputs, else the input's."""
    if requested is None:
        return torch.float32 if input_dtype in HALF_DTYPES else input_dtype
    if requested != input_dtype and (
        requested.itemsize < input_dtype.itemsize or requested in HALF_DTYPES
    ):
        raise ValueError(
            f"acc_dtype={requested} is narrower than the input dtype {input_dtype}; use "
            f"None, {input_dtype} or a wider float (float32/float64)"
        )
    return requested


def reported_dtype(
    name: str,
    input: torch.Tensor,
    options: LinearCrossEntropyOptions,
    loss_dtype: torch.dtype | None,
) -> torch.dtype:
    """The dtype a loss is returned in (see ``loss_dtype`` of
    :func:`linear_ce.linear_cross_entropy`; errors name ``name``)."""
    acc = acc_dtype_for(input.dtype, options.acc_dtype)
    if loss_dtype is None:
        device = input.device.type
        autocast = device in ("cpu", "cuda") and torch.is_autocast_enabled(device)
        return acc if autocast else input.dtype
    if loss_dtype not in (input.dtype, acc):
        raise ValueError(
            f"{name}: loss_dtype must be None, the input dtype {input.dtype} or "
            f"the accumulation dtype {acc}, got {loss_dtype!r}"
        )
    return loss_dtype


def make_plan(
    rows: int,
    in_features: int,
    num_classes: int,
    input_dtype: torch.dtype,
    device: torch.device,
    options: LinearCrossEntropyOptions,
    tiles: int = 1,
    share: float | None = None,
    vocab_pass: bool = False,
    gathered: bool = True,
    half_tile: bool = True,
    longest: bool = False,
    gradients: bool = True,
    stats_pass: bool = False,
    half_blocks: bool = False,
) -> Plan:
    """Resolve ``options`` for one call: chunk size, dtypes, buffers, GEMM backend.

    ``acc_policy="auto"`` is ``"balanced"`` for half inputs with fp32
    accumulation on a CPU: native half GEMMs where the CPU has them
    (:func:`~linear_ce.engine.capability.native_half_gemm`), else fp32 GEMMs on the
    weight upcast a vocabulary block at a time; the weight gradient summed in
    fp32 held as the half result plus a low-order plane
    (:mod:`linear_ce.engine.accumulate`). That keeps the gradients' error independent
    of the number of chunks within 2.5× the gradients' bytes, where an fp32
    ``(V, F)`` accumulator alone takes 1.9× of them once ``V ≫ N``. Where the
    chunks, planned without that plane (its bytes go to the chunks), number at most
    ``DIRECT_SUM_MAX_CHUNKS`` per output position, the sum is held in the result
    itself instead (``"direct"``, within 1.5× the plain expression's error).
    Everywhere else ``"auto"`` is ``"accurate"``.

    ``share`` is the chunk rule's share of the gradients' bytes (see
    :func:`choose_chunk_rows`); ``None``: ``HALF_CPU_BUDGET_SHARE`` for half inputs on a
    CPU without native half GEMMs (``BlockUpcast``), else ``BUDGET_SHARE``. Every share is
    scaled by ``LINEAR_CE_MEMORY_BUDGET / BUDGET_SHARE`` where that is set.

    The machine's choices (:mod:`linear_ce.engine.machine`, measured or the fixed fallback): the
    native half GEMMs the CPU's flags promise are taken where they run faster than fp32;
    fp32/fp64 chunks are the budget's unless another size ran the GEMMs faster,
    where one tile under the default budget may take up to ``MEASURED_STRETCH`` times it
    if that runs them faster (half inputs keep the budget's longest: their weight-gradient
    sum pays per chunk); the
    logits tile takes the layout the GEMMs run faster in; a half tile's fp32 math takes
    the step of rows it runs fastest in, and half inputs' fp32 math the faster form of
    :math:`e^u`; the vocabulary pass's fewest classes per block are those its GEMMs reach
    full rate at.

    ``vocab_pass``: the plan of a vocabulary pass (:mod:`linear_ce.engine.vocab_pass`) with
    ``tiles`` ``(rows, C)`` tiles: row groups and class blocks by
    :func:`choose_vocab_blocks`, at ``BUDGET_SHARE``; ``gathered``: some row is
    ignored, so a group's rows (of either pass) may be gathered into buffers of their own (budgeted).

    ``half_tile``: with native half GEMMs on a CPU the chunk loop may keep a half tile
    (``Plan.rows_per_step``): chunks are planned for ``HALF_CPU_BUDGET_SHARE`` of the
    gradients' bytes at 2 bytes per logit, with ``HALF_TILE_STEP_ROWS``-row fp32 steps where
    not measured
    (the weight-gradient sum then holds no chunk). ``False`` for a caller whose loop
    cannot use one (a companion head).

    ``longest``: keep the budget's longest chunks, not the measured choice (a loop with a companion, whose per-chunk elementwise passes over two or three
    tiles the GEMM measurement does not see: see ``DIVERGENCE_SHARE``).

    ``gradients``: ``False`` for a call that wants no gradient. Its one fp32/fp64 tile
    under the default budget then takes the longest chunks of ``MEASURED_STRETCH`` times
    it, measured or not.

    ``half_blocks``: a vocabulary pass that takes half blocks where the GEMMs are native
    half ones (:mod:`linear_ce.engine.vocab_pass`): its one tile holds the input dtype, so
    its blocks are budgeted at that many bytes per logit, not ``acc_dtype``'s and the
    operand copy's, which left them a third of the budget (bf16 ``token_logprobs``
    backward at N=2048, F=1024, V=32768: 4352-class blocks, not 1408; each block adds its
    input-gradient product into the fp32 sum in a pass of its own, so fewer, wider blocks
    pay fewer passes).

    ``stats_pass``: the plan of a statistics pass (:mod:`linear_ce.engine.stats_pass`, a
    call without gradients whose row math is the compiled loops'): groups of rows and blocks
    of classes by :func:`choose_vocab_blocks` for one tile of the loops' dtype (the input's
    with native half GEMMs, else ``acc_dtype``) of at most ``STATS_TILE_CACHE_SHARE`` of the
    last-level cache (``STATS_TILE_FALLBACK_BYTES`` where unknown) and of
    ``BUDGET_SHARE`` of the gradients' bytes (``share`` does not apply), or the block
    ``LINEAR_CE_STATS_BLOCK`` forces.
    """
    # Every LINEAR_CE_* variable is checked on every call, read by its path or not.
    check_all()
    acc_dtype = acc_dtype_for(input_dtype, options.acc_dtype)
    mixed = acc_dtype != input_dtype
    half_cpu = mixed and device.type == "cpu" and acc_dtype == torch.float32
    flops = 6.0 * rows * in_features * num_classes
    native_cpu = (
        half_cpu
        and native_half_gemm(input_dtype, device)
        and half_gemm_pays(input_dtype, device, in_features, flops)
    )
    policy = options.acc_policy
    if policy == "auto":
        policy = "balanced" if half_cpu else "accurate"
    if not mixed:
        gemm: Gemm = SameDtype(input_dtype)
    elif device.type == "cuda" and policy != "accurate" and acc_dtype == torch.float32:
        gemm = CudaOutDtype(input_dtype)
    elif native_cpu and policy != "accurate":
        gemm = NativeHalf(input_dtype)
    elif half_cpu and policy != "accurate":
        gemm = BlockUpcast(acc_dtype)
    else:
        gemm = Upcast(acc_dtype)
    half_math = input_dtype in HALF_DTYPES and acc_dtype == torch.float32 and device.type == "cpu"
    half = half_tile and not vocab_pass and isinstance(gemm, NativeHalf) and device.type == "cpu"
    # The default budget of a one-tile loop, which the machine's measurement may stretch.
    stretch = MEASURED_STRETCH if share is None and tiles == 1 and memory_budget() is None else 1.0
    if share is None:
        share = HALF_CPU_BUDGET_SHARE if isinstance(gemm, BlockUpcast) or half else BUDGET_SHARE
    scale = (memory_budget() or BUDGET_SHARE) / BUDGET_SHARE
    share *= scale
    tuning = tuning_for(device, gemm.operand_dtype, in_features, flops)
    exp2 = half_math and tuning.exp2(EXP_FLAG not in cpu_flags())
    weight_grad_dtype = input_dtype if policy == "compact" else acc_dtype
    if weight_grad_dtype == input_dtype:
        weight_grad = "direct"
    elif (
        policy == "balanced"
        and device.type == "cpu"
        and split_sum_supported(input_dtype, acc_dtype)
    ):
        weight_grad = "split"
    else:
        weight_grad = "wide"
    # What every pass shares is resolved above, once; each pass is sized by its own planner.
    basis = _Basis(
        call=ChunkCall(rows, in_features, num_classes, options, input_dtype, acc_dtype),
        device=device,
        gemm=gemm,
        policy=policy,
        half_cpu=half_cpu,
        half=half,
        share=share,
        scale=scale,
        stretch=stretch,
        tuning=tuning,
        exp2=exp2,
        weight_grad=weight_grad,
        weight_grad_dtype=weight_grad_dtype,
    )
    if vocab_pass:
        return _plan_vocab_pass(basis, tiles, gathered, half_blocks)
    if stats_pass:
        return _plan_stats_pass(basis, gathered)
    return _plan_chunk_loop(basis, tiles, longest, gradients)


@dataclasses.dataclass(frozen=True)
class _Basis:
    """What every pass's plan starts from (see :func:`make_plan`): the ``call`` (its tiles
    in ``acc_dtype``) and its ``device``, the resolved policy and GEMM backend, whether the
    chunk loop may keep a half tile (``half``), the budget's ``share`` (``scale``:
    ``LINEAR_CE_MEMORY_BUDGET``'s factor), how far the machine's measurement may
    ``stretch`` a one-tile budget, the machine's ``tuning``, the form of ``eᵘ`` and the
    weight-gradient sum."""

    call: ChunkCall
    device: torch.device
    gemm: Gemm
    policy: str
    half_cpu: bool
    half: bool
    share: float
    scale: float
    stretch: float
    tuning: Tuning
    exp2: bool
    weight_grad: str
    weight_grad_dtype: torch.dtype

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype of the input, the weight and the returned gradients."""
        return self.call.input_dtype

    @property
    def acc_dtype(self) -> torch.dtype:
        """The accumulation dtype (:func:`acc_dtype_for`)."""
        return self.call.tile_dtype

    def plan(self, rows_per_chunk: int, classes_per_block: int, **changes: Any) -> Plan:
        """The :class:`Plan` of these sizes (``rows_per_step``: ``rows_per_chunk``), with
        ``changes`` to the basis' GEMM and weight-gradient sum."""
        fields = {
            "rows_per_step": rows_per_chunk,
            "gemm": self.gemm,
            "weight_grad": self.weight_grad,
            "weight_grad_dtype": self.weight_grad_dtype,
            **changes,
        }
        return Plan(
            rows_per_chunk=rows_per_chunk,
            classes_per_block=classes_per_block,
            input_dtype=self.input_dtype,
            acc_dtype=self.acc_dtype,
            policy=self.policy,
            exp2=self.exp2,
            **fields,
        )


def _plan_vocab_pass(basis: _Basis, tiles: int, gathered: bool, half_blocks: bool) -> Plan:
    """The plan of a vocabulary pass (``make_plan(vocab_pass=True)``): row groups and class
    blocks by :func:`choose_vocab_blocks` for ``tiles`` tiles at ``BUDGET_SHARE``."""
    gemm, input_dtype, acc_dtype = basis.gemm, basis.input_dtype, basis.acc_dtype
    in_features = basis.call.in_features
    per_logit = tiles * acc_dtype.itemsize
    if half_blocks and isinstance(gemm, NativeHalf) and tiles == 1:
        per_logit = input_dtype.itemsize
    elif gemm.operand_dtype != acc_dtype:
        per_logit += gemm.operand_dtype.itemsize
    per_row = in_features * (input_dtype.itemsize + acc_dtype.itemsize) if gathered else 0
    if gemm.operand_dtype != input_dtype:
        per_row += in_features * gemm.operand_dtype.itemsize
    rows_per_chunk, classes_per_block = choose_vocab_blocks(
        basis.call,
        per_logit,
        per_row,
        BUDGET_SHARE * basis.scale,
        basis.tuning.min_class_block(MIN_CLASS_BLOCK),
    )
    # Not measured (the pass's tiles are every row by a block of classes), but a forced
    # layout applies to it as to the chunk loop: so CUDA's row-major tile runs on a CPU.
    forced = basis.tuning.forced_class_major()
    if forced is not None:
        gemm = dataclasses.replace(gemm, class_major=forced)
    return basis.plan(rows_per_chunk, classes_per_block, gemm=gemm)


def _plan_stats_pass(basis: _Basis, gathered: bool) -> Plan:
    """The plan of a statistics pass (``make_plan(stats_pass=True)``): row groups and class
    blocks for one cache-sized tile of the loops' dtype, or the block
    ``LINEAR_CE_STATS_BLOCK`` forces."""
    forced_block = forced_stats_block()
    call = basis.call
    input_dtype, num_classes = basis.input_dtype, call.num_classes
    loops_dtype = input_dtype if isinstance(basis.gemm, NativeHalf) else basis.acc_dtype
    cache = last_level_cache_bytes()
    tile_bytes = STATS_TILE_CACHE_SHARE * cache if cache else STATS_TILE_FALLBACK_BYTES
    cache_share = tile_bytes / max(call.grad_bytes, 1)
    rows_per_chunk, classes_per_block = choose_vocab_blocks(
        call,
        loops_dtype.itemsize,
        call.in_features * input_dtype.itemsize if gathered else 0,
        min(BUDGET_SHARE * basis.scale, cache_share),
        forced_block or basis.tuning.min_class_block(MIN_CLASS_BLOCK),
    )
    if forced_block:
        classes_per_block = min(forced_block, num_classes)
    gemm = basis.gemm if basis.half else _chunk_layout(basis, rows_per_chunk)
    return basis.plan(rows_per_chunk, classes_per_block, gemm=gemm)


def _plan_chunk_loop(basis: _Basis, tiles: int, longest: bool, gradients: bool) -> Plan:
    """The plan of the chunk loop: chunks of rows by :func:`choose_chunk_rows` for
    ``tiles`` tiles (one half tile where ``basis.half``) over the whole vocabulary, a half
    tile's step of rows, and the weight-gradient sum held in the result where the chunks
    are few enough (``DIRECT_SUM_MAX_CHUNKS``)."""
    call = basis.call
    rows, num_classes, input_dtype = call.rows, call.num_classes, basis.input_dtype
    tuning, share, stretch, half = basis.tuning, basis.share, basis.stretch, basis.half
    half_cpu = basis.half_cpu
    weight_grad, weight_grad_dtype = basis.weight_grad, basis.weight_grad_dtype
    # A half tile holds 2 bytes per logit in one tile; otherwise ``tiles`` of acc_dtype.
    tile_dtype, tile_count = (input_dtype, 1) if half else (basis.acc_dtype, tiles)
    # Half inputs on a CPU keep the budget's longest chunks (see the docstring), unless
    # LINEAR_CE_CHUNK_ROWS forces them (tuning.rows applies it, at most the budget's).
    keep_longest = (half_cpu or longest) and tuning.forced_rows() is None
    # A call without gradients holds none: its tile is all its scratch (0.5 of the
    # gradients' bytes it does not hold; a plain forward's logits take 1.9×), and each
    # chunk's logits GEMM streams the whole weight, which the measurement's cache-sized
    # blocks do not see: a forward runs nearer its GEMM's time the longer its chunks
    # (docs/journal.md, the forward by blocks of classes).
    if not gradients and stretch > 1.0 and not half_cpu and tuning.forced_rows() is None:
        share, stretch, keep_longest = share * stretch, 1.0, True
    pick = None if keep_longest else tuning.rows

    def chunk_rows(share: float) -> int:
        return choose_chunk_rows(
            call._replace(tile_dtype=tile_dtype), tile_count, share, pick, stretch
        )

    if basis.device.type == "cuda":
        share = min(
            share,
            _cuda_share(basis.device, rows, call.in_features, num_classes, input_dtype),
        )
    rows_per_chunk = chunk_rows(share)
    if weight_grad == "split":
        # Without the split sum's low-order plane (V·F bytes) its budget goes to the chunks.
        plane_share = num_classes / ((rows + num_classes) * input_dtype.itemsize)
        direct_rows = chunk_rows(share + plane_share)
        if -(-rows // direct_rows) <= DIRECT_SUM_MAX_CHUNKS:
            weight_grad, weight_grad_dtype, rows_per_chunk = "direct", input_dtype, direct_rows
    if half:
        rows_per_step = min(rows_per_chunk, tuning.step_rows(num_classes, HALF_TILE_STEP_ROWS))
        gemm = basis.gemm
    else:
        rows_per_step, gemm = rows_per_chunk, _chunk_layout(basis, rows_per_chunk)
    return basis.plan(
        rows_per_chunk,
        num_classes,
        rows_per_step=rows_per_step,
        gemm=gemm,
        weight_grad=weight_grad,
        weight_grad_dtype=weight_grad_dtype,
    )


def _chunk_layout(basis: _Basis, rows_per_chunk: int) -> Gemm:
    """The GEMM backend with the layout of a tile of ``rows_per_chunk`` rows by classes.
    CUDA's tiles are row-major (each row's classes contiguous: the row kernels' coalesced
    reads, :mod:`linear_ce.engine.triton_rows`) unless a layout is forced."""
    forced = basis.tuning.forced_class_major()
    cuda_layout = False if forced is None else forced
    if basis.device.type == "cuda":
        class_major = cuda_layout
    else:
        class_major = basis.tuning.class_major(rows_per_chunk)
    return dataclasses.replace(basis.gemm, class_major=class_major)


def _cuda_share(
    device: torch.device, rows: int, in_features: int, num_classes: int, dtype: torch.dtype
) -> float:
    """``CUDA_FREE_MEMORY_SHARE`` of ``device``'s free memory as a share of the call's
    gradients' bytes ``(rows + V)·F·itemsize`` (the unit of :func:`choose_chunk_rows`)."""
    free, _ = torch.cuda.mem_get_info(device)
    grad_bytes = (rows + num_classes) * in_features * dtype.itemsize
    return CUDA_FREE_MEMORY_SHARE * free / max(grad_bytes, 1)
