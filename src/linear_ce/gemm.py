"""How the three GEMMs are issued on each backend; the only place that knows.

The chunk loop calls ``logits``, ``grad_input`` and ``weight_grad`` with
operands already converted by ``operand``/``weight_operand``; a backend
decides the operand dtype and how a mixed-precision product is formed:

- ``SameDtype``: operands and results share one dtype (fp32/fp64 inputs, or
  a half dtype accumulated in itself).
- ``Upcast``: CPUs without fast half GEMMs: fp16/bf16 operands are converted
  to fp32 (the weight once per call, each chunk of rows as it comes) and the
  GEMMs run in fp32.
- ``CudaOutDtype``: CUDA: half operands, fp32 results via
  ``torch.mm(..., out_dtype=torch.float32)``; the softmax is rounded to the
  half dtype before the gradient GEMMs.
- ``NativeHalf``: CPUs with native half GEMMs (AVX512-BF16/AMX, see
  :mod:`linear_ce.capability`), where CPU torch has no ``out_dtype``: half
  operands and half results (each accumulated in fp32 inside the GEMM, then
  rounded once), copied into the fp32 buffers. No fp32 copy of the weight.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["CudaOutDtype", "Gemm", "NativeHalf", "SameDtype", "Upcast"]

_VOCAB_BLOCK = 4096


@dataclasses.dataclass(frozen=True)
class Gemm:
    """Base: operands in ``operand_dtype``; results in the accumulation dtype."""

    operand_dtype: torch.dtype

    def operand(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.operand_dtype else t.to(self.operand_dtype)

    def weight_operand(self, weight: torch.Tensor) -> torch.Tensor:
        return self.operand(weight)

    def logits_buffer(
        self, rows: int, classes: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The ``(rows, classes)`` logits buffer, stored class-major (a ``(classes,
        rows)`` array used as its transpose): the logits GEMM then forms ``W·xᵀ``,
        which MKL runs ~30% faster than ``x·Wᵀ`` at chunk-sized ``rows``, and the
        weight-gradient GEMM reads it without a transpose."""
        return torch.empty((classes, rows), dtype=dtype, device=device).T

    def logits(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
        """``out = x @ weight.T``."""
        torch.mm(x, weight.T, out=out)

    def add_grad_input(
        self, acc: torch.Tensor, grad_logits: torch.Tensor, weight: torch.Tensor
    ) -> None:
        """``acc += grad_logits @ weight`` (in the GEMM itself where dtypes allow:
        no buffer, no extra pass)."""
        if acc.dtype == grad_logits.dtype:
            acc.addmm_(grad_logits, weight)
        else:
            acc.add_(self._product(grad_logits, weight))

    def weight_grad(self, acc: torch.Tensor, grad_logits: torch.Tensor, x: torch.Tensor) -> None:
        """``acc += grad_logits.T @ x``; ``acc`` may be narrower than the product
        (``acc_policy="compact"``), then it is added in vocabulary blocks."""
        if acc.dtype == grad_logits.dtype:
            acc.addmm_(grad_logits.T, x)
            return
        for start in range(0, acc.shape[0], _VOCAB_BLOCK):
            stop = min(start + _VOCAB_BLOCK, acc.shape[0])
            acc[start:stop].add_(self._product(grad_logits[:, start:stop].T, x))

    def _product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


class SameDtype(Gemm):
    """Operands already in the accumulation dtype."""


class Upcast(Gemm):
    """Half operands converted to fp32 before each product."""


class CudaOutDtype(Gemm):
    """Half operands, fp32 products (CUDA only: CPU torch has no ``out_dtype`` mm)."""

    def logits_buffer(
        self, rows: int, classes: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        # Row-major: the layout the out_dtype GEMM is known to write (as torch's builtin).
        return torch.empty((rows, classes), dtype=dtype, device=device)

    def logits(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
        torch.mm(x, weight.T, out_dtype=out.dtype, out=out)

    def _product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b, out_dtype=torch.float32)


class NativeHalf(Gemm):
    """Half operands and half products on a CPU with native half GEMMs; the
    logits are rounded to the half dtype once, then widened into the buffer."""

    def logits(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
        # Formed class-major like ``out``, so the widening copy reads in order.
        out.copy_(torch.mm(weight, x.T).T)
