"""How the three GEMMs are issued on each backend; the only place that knows.

The chunk loop calls ``logits`` and ``add_grad_input`` with operands already
converted by ``operand``/``weight_operand``; the weight-gradient sum
(:mod:`linear_ce.engine.accumulate`) calls ``add_product`` and ``product_into``. A backend decides the
operand dtype and how a mixed-precision product is formed:

- ``SameDtype``: operands and results share one dtype (fp32/fp64 inputs, or
  a half dtype accumulated in itself).
- ``Upcast``: fp16/bf16 operands converted to fp32 (the whole weight once per
  call, each chunk of rows as it comes); the GEMMs run in fp32.
- ``BlockUpcast``: as ``Upcast``, but the weight is converted one vocabulary
  block at a time, inside each GEMM that reads it: no fp32 copy of the weight
  (``V·F·4`` bytes), at the price of converting it twice per chunk (CPUs
  without fast half GEMMs, for ``acc_policy`` ``"balanced"`` and ``"compact"``).
- ``CudaOutDtype``: CUDA: half operands, fp32 results via
  ``torch.mm(..., out_dtype=torch.float32)``; the softmax is rounded to the
  half dtype before the gradient GEMMs.
- ``NativeHalf``: CPUs with native half GEMMs (AVX512-BF16/AMX, see
  :mod:`linear_ce.engine.capability`), where CPU torch has no ``out_dtype``: half
  operands and half results (each accumulated in fp32 inside the GEMM, then
  rounded once), copied into the fp32 buffers. No fp32 copy of the weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from linear_ce.engine.scratch import scratch

__all__ = [
    "VOCAB_BLOCK_ELEMENTS",
    "BlockUpcast",
    "CudaOutDtype",
    "Gemm",
    "NativeHalf",
    "SameDtype",
    "Upcast",
    "vocab_blocks",
]

#: Elements of one ``(block, F)`` slice of a ``(V, F)`` operand multiplied at a time:
#: 4 MiB in fp32, so a block's temporaries stay a few percent of the gradients'
#: bytes, while each block's GEMM (``block ≥ 256`` rows for ``F ≤ 4096``) stays
#: efficient (a weight-gradient GEMM over few rows runs at a fraction of its rate on a
#: CPU, so the blocks must not be short too).
VOCAB_BLOCK_ELEMENTS = 1 << 20


def vocab_blocks(classes: int, features: int, elements: int | None = None) -> Iterator[slice]:
    """Consecutive slices of ``range(classes)`` of about ``elements // features`` classes
    each (at least one); ``elements`` defaults to ``VOCAB_BLOCK_ELEMENTS``."""
    step = max(1, (elements or VOCAB_BLOCK_ELEMENTS) // max(features, 1))
    for start in range(0, classes, step):
        yield slice(start, min(start + step, classes))


@dataclasses.dataclass(frozen=True)
class Gemm:
    """Base: operands in ``operand_dtype``; results in the accumulation dtype;
    ``class_major``: the layout of :meth:`logits_buffer` (the plan measures which one
    this machine's GEMMs prefer, :mod:`linear_ce.engine.machine`)."""

    operand_dtype: torch.dtype
    class_major: bool = True

    def operand(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.operand_dtype else t.to(self.operand_dtype)

    def weight_operand(self, weight: torch.Tensor) -> torch.Tensor:
        return self.operand(weight)

    def logits_buffer(
        self, rows: int, classes: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The ``(rows, classes)`` logits buffer: class-major (a ``(classes, rows)`` array
        used as its transpose), so the logits GEMM forms ``W·xᵀ``, which MKL runs faster
        than ``x·Wᵀ`` at chunk-sized ``rows`` (docs/benchmarks.md says how much), and the
        weight-gradient GEMM reads it without a transpose; or row-major where
        ``class_major`` is false."""
        if not self.class_major:
            return scratch((rows, classes), dtype, device)
        return scratch((classes, rows), dtype, device).T

    def logits(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
        """``out = x @ weight.T``."""
        torch.mm(x, weight.T, out=out)

    def add_grad_input(
        self, acc: torch.Tensor, grad_logits: torch.Tensor, weight: torch.Tensor
    ) -> None:
        """``acc += grad_logits @ weight``."""
        self.add_product(acc, grad_logits, weight)

    def add_product(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """``acc += a @ b`` for operands from ``operand``: in the GEMM itself where the
        dtypes allow (no temporary, no extra pass), else the product is added."""
        if acc.dtype == a.dtype:
            acc.addmm_(a, b)
        else:
            acc.add_(self.product(a, b))

    def sum_of_products(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``Σ a @ b`` over ``pairs``, a new tensor in the products' dtype (fp32, or the
        half dtype where products are half), each further product added in the GEMM."""
        total = self.product(*pairs[0])
        for a, b in pairs[1:]:
            if total.dtype == a.dtype:
                total.addmm_(a, b)
            else:
                total.add_(self.product(a, b))
        return total

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` for operands from ``operand``, a new tensor in the products' dtype
        (fp32, or the half dtype where products are half)."""
        return a @ b

    def product_into(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` written into ``out`` (of the products' dtype), which is returned."""
        return torch.mm(a, b, out=out)


class SameDtype(Gemm):
    """Operands already in the accumulation dtype."""


class Upcast(Gemm):
    """Half operands converted to fp32 before each product; the weight once per call."""


class BlockUpcast(Gemm):
    """Half operands converted to fp32 before each product; the weight a vocabulary
    block at a time, so no ``(V, F)`` fp32 copy of it ever exists. Each GEMM converts
    its blocks into one buffer of its own: a new tensor per block, hundreds per call,
    left glibc's heap fragmented (a bf16 step's peak swung between 2.3× and 2.7× the
    gradients' bytes with the mmap threshold left dynamic)."""

    def weight_operand(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def logits(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
        # Class-major ``out``: each block of classes is a contiguous slab of ``out.T``
        # (row-major: a strided one, which the GEMM writes as the transposed product).
        for block, part in self._upcast_blocks(weight):
            torch.mm(part, x.T, out=out.T[block])

    def add_grad_input(
        self, acc: torch.Tensor, grad_logits: torch.Tensor, weight: torch.Tensor
    ) -> None:
        for block, part in self._upcast_blocks(weight):
            acc.addmm_(grad_logits[:, block], part)

    def _upcast_blocks(self, weight: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(classes, their rows of weight in fp32)`` per vocabulary block, each copy
        in the same buffer."""
        buffer = None
        for block in vocab_blocks(weight.shape[0], weight.shape[1]):
            if buffer is None:
                buffer = weight.new_empty((block.stop, weight.shape[1]), dtype=self.operand_dtype)
            yield block, buffer[: block.stop - block.start].copy_(weight[block])


class CudaOutDtype(Gemm):
    """Half operands, fp32 products (CUDA only: CPU torch has no ``out_dtype`` mm)."""

    def logits_buffer(
        self, rows: int, classes: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        # Row-major: the layout the out_dtype GEMM is known to write (as torch's builtin).
        return torch.empty((rows, classes), dtype=dtype, device=device)

    def logits(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
        torch.mm(x, weight.T, out_dtype=out.dtype, out=out)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b, out_dtype=torch.float32)

    def product_into(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.product(a, b))


class NativeHalf(Gemm):
    """Half operands and half products on a CPU with native half GEMMs; the
    logits are rounded to the half dtype once, then widened into the buffer."""

    def logits(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
        # Formed class-major like ``out``, a block of classes at a time: the widening
        # copy reads in order, and the half temporary stays one block's size.
        for block in vocab_blocks(weight.shape[0], x.shape[0]):
            out.T[block].copy_(torch.mm(weight[block], x.T))

    def half_tile_buffer(
        self, rows: int, classes: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A ``(rows, classes)`` buffer of the half tile or of its fp32 steps
        (``Plan.rows_per_step``), row-major: a step's rows are then one contiguous
        block, widened and written back at copy speed, where a class-major tile's
        strided rows take several times longer to widen and write back, while the
        GEMMs run alike in either layout."""
        return scratch((rows, classes), dtype, device)

    def half_logits(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
        """``out = x @ weight.T`` into a half tile from :meth:`half_tile_buffer`."""
        if weight.is_contiguous():
            torch.mm(x, weight.T, out=out)
            return
        # A K-dimensional loss's position slice is strided: torch 2.6's mm copies such an
        # operand whole (49 MiB transient for a 16 MiB bf16 slice, measured; 2 MiB on
        # torch 2.13), so it is formed a vocabulary block at a time, each copy one block's.
        for block in vocab_blocks(weight.shape[0], weight.shape[1]):
            torch.mm(x, weight[block].T, out=out[:, block])
