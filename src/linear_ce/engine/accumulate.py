r"""The weight gradient's running sum over chunks, :math:`\sum_k G_k^\top X_k`.

The chunk loop creates one with :func:`weight_grad_sum`, calls
``add(position, grad_logits, x)`` once per chunk and output position (operands
as the plan's :class:`~linear_ce.engine.gemm.Gemm` converted them), and ``finish()``
once, which returns the ``(V, P, F)`` gradient in the input dtype. How the sum
is held is the plan's ``weight_grad``:

- ``"direct"``: each chunk's product is added straight into the result (in the
  GEMM itself where the dtypes match; a position's first product is written).
  Exact for fp32/fp64 inputs; for half inputs one rounding to the half dtype per
  chunk, so the error grows with the number of chunks: ``acc_policy="compact"``,
  and ``"balanced"`` over at most ``DIRECT_SUM_MAX_CHUNKS`` chunks (see
  :mod:`linear_ce.engine.plan`).
- ``"wide"``: a separate ``acc_dtype`` ``(V, P, F)`` buffer, converted at the end.
- ``"split"``: the fp32 sum, held in the result's own storage plus a low-order
  plane: fp32's top 16 bits live in the result tensor, the next 8 bits in a
  ``(V, P, F)`` uint8 plane. Each chunk unpacks a
  vocabulary block into an fp32 temporary, adds its product there, and packs it
  back rounded to nearest; ``finish`` rounds each block to the input dtype in
  place. The sum keeps 16 significant bits (bf16's 8 plus 8; for fp16 the top
  16 bits of fp32 hold 8 of its 11, so 16 is 5 more than fp16's): the rounding
  per chunk is 2⁻⁸ (bf16) or 2⁻⁵ (fp16) of the result's own, so the error stays
  the final rounding's up to ~10⁴ (bf16) or ~10² (fp16) chunks and then grows as
  ``√K`` times that rounding (fp16 at 4096 chunks: ~1.7× the final rounding).
  Extra memory: ``V·P·F`` bytes, against ``4·V·P·F`` plus a result-sized copy
  for ``"wide"``. Where the products are half (native half
  GEMMs) it holds a copy of one chunk's operands and adds two chunks per
  unpack/pack, which halves those passes for ``B·(V + F)`` half elements.

Example::

    >>> from linear_ce.engine.gemm import SameDtype
    >>> acc = SplitSum(torch.zeros(10, 1, 8, dtype=torch.bfloat16), SameDtype(torch.float32))
    >>> g, x = torch.randn(4, 10), torch.randn(4, 8)
    >>> acc.add(0, g, x)
    >>> acc.finish().dtype
    torch.bfloat16
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from linear_ce.engine.capability import HALF_DTYPES
from linear_ce.engine.gemm import Gemm, vocab_blocks
from linear_ce.engine.scratch import scratch

if TYPE_CHECKING:
    from linear_ce.engine.plan import Plan

__all__ = [
    "CACHE_BLOCK_ELEMENTS",
    "DirectSum",
    "SplitSum",
    "weight_grad_sum",
]

#: Elements of the fp32 scratch a block of the sum is unpacked into: 1 MiB, so it stays
#: in a core's L2 cache between unpacking, adding and packing (a block that spills it
#: goes to memory three times: a step's sum then costs more than its GEMMs).
CACHE_BLOCK_ELEMENTS = 1 << 18


class DirectSum:
    """Products added straight into ``buffer``, a ``(V, P, F)`` sum: the result itself
    (see module doc, ``"direct"``), or a wider one rounded to ``result_dtype`` by
    ``finish`` (``"wide"``). ``buffer`` need not be zeroed: a position's first product is
    written, not added (one pass over ``(V, F)`` less, a step's fixed cost).

    ``scale`` (a 0-dim tensor): the factor ``finish`` will be given (a mean's ``1/count``).
    Where the GEMM adds into the sum itself (operands of the sum's dtype) and ``scale`` is
    on the CPU (read once, here, before the loop: a device scalar would be a host
    synchronisation), the products take all of it as the GEMM's ``alpha``, applied to its
    fp32 accumulation before the one rounding to the sum's dtype, and ``finish`` none: no
    pass over the whole ``(V, P, F)`` sum (128 MiB at V=32768, F=1024 in fp32, a fixed cost
    of a mean however few rows are valid, which a mostly masked step feels most, and one
    rounding where ``finish``'s factor made two). Elsewhere, where each product is rounded
    to a half dtype the unscaled sum could overflow it, so the products take the power of
    two at or below ``scale`` on ``x``'s side (exact where ``x`` stays normal) and
    ``finish`` the rest, a factor in [1, 2). In the gradient tile instead, a small factor
    pushes its entries into the half dtype's subnormals (fp16, 8192 rows: the input gradient
    4x, the weight gradient 10x the final rounding)."""

    def __init__(
        self,
        buffer: torch.Tensor,
        gemm: Gemm,
        result_dtype: torch.dtype | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        dtype = buffer.dtype
        self.result_dtype = dtype if result_dtype is None else result_dtype
        self.sum = buffer
        self.gemm = gemm
        self._started: set[int] = set()
        self._x_scale = None
        self._alpha = 1.0
        self._scaled = False
        if scale is not None and gemm.operand_dtype == dtype and scale.device.type == "cpu":
            self._alpha = float(scale)
            self._scaled = True
        elif scale is not None and dtype in HALF_DTYPES:
            # 1 where the scale is 0 (every row ignored: no product, a zero sum).
            power = torch.exp2(torch.floor(torch.log2(scale.to(torch.float32))))
            self._x_scale = torch.where(scale > 0, power, 1.0)

    def add(self, position: int, grad_logits: torch.Tensor, x: torch.Tensor) -> None:
        """``sum[:, position] += grad_logitsᵀ · x``."""
        if self._x_scale is not None:
            x = x * self._x_scale.to(x.dtype)
        acc = self.sum[:, position]
        first = position not in self._started
        self._started.add(position)
        if acc.dtype == grad_logits.dtype:
            # A K-dimensional loss's position is a strided slice of the sum: torch 2.6's
            # GEMM into one forms the whole product aside first (56 MiB transient for a
            # 16 MiB bf16 slice, measured), so it goes a vocabulary block at a time there.
            whole = acc.is_contiguous()
            for block in [slice(None)] if whole else vocab_blocks(acc.shape[0], acc.shape[1]):
                a, out = grad_logits[:, block].T, acc[block]
                if first:
                    # beta=0: the buffer's old contents are ignored, NaN included.
                    torch.addmm(out, a, x, beta=0, alpha=self._alpha, out=out)
                else:
                    out.addmm_(a, x, alpha=self._alpha)
            return
        # Another dtype: the product is formed a block of classes at a time, each in the
        # first block's (the largest) storage (see gemm.BlockUpcast on the heap).
        products = None
        for block in vocab_blocks(acc.shape[0], acc.shape[1]):
            a = grad_logits[:, block].T
            if products is None:
                product = products = self.gemm.product(a, x)
            else:
                product = self.gemm.product_into(products[: block.stop - block.start], a, x)
            if first:
                acc[block].copy_(product)
            else:
                acc[block].add_(product)

    def finish(self, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The sum (times ``scale``, a 0-dim tensor, unless the products took it) in the
        result dtype."""
        if self._scaled:
            scale = None
        if scale is not None and self._x_scale is not None:
            scale = scale / self._x_scale
        summed = self._summed() if scale is None else self._summed().mul_(scale)
        return summed.to(self.result_dtype)

    def _summed(self) -> torch.Tensor:
        """The sum, with positions that never got a product (no valid row) zeroed."""
        for position in range(self.sum.shape[1]):
            if position not in self._started:
                self.sum[:, position].zero_()
        return self.sum


class SplitSum:
    """An fp32 sum held in ``result``, a half ``(V, P, F)`` tensor, plus a low-order plane
    (see module doc). Neither need be zeroed: a position's first chunk writes both, and
    ``finish`` zeroes a position no chunk reached."""

    def __init__(self, result: torch.Tensor, gemm: Gemm, *, pair_chunks: bool = False) -> None:
        if result.dtype not in HALF_DTYPES:
            raise ValueError(f"SplitSum holds float16/bfloat16 results, got {result.dtype}")
        shape, device = result.shape, result.device
        self.result = result
        self.gemm = gemm
        self._high = self.result.view(torch.int16)
        # Written by each position's first chunk before it is read (``_update``).
        self._low = scratch(tuple(shape), torch.uint8, device)
        block = next(vocab_blocks(shape[0], shape[-1], CACHE_BLOCK_ELEMENTS)).stop
        self._scratch = scratch((block, shape[-1]), torch.float32, device)
        self._started: set[int] = set()
        self._pair_chunks = pair_chunks
        self._held: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def add(self, position: int, grad_logits: torch.Tensor, x: torch.Tensor) -> None:
        """``sum[:, position] += grad_logitsᵀ · x``, in fp32 (with ``pair_chunks``
        possibly at the next call: the operands are copied, the caller may reuse them)."""
        if self._held is not None:
            held_position, held_grad, held_x = self._held
            self._held = None
            if held_position == position:
                self._update(position, [(held_grad, held_x), (grad_logits, x)])
                return
            self._update(held_position, [(held_grad, held_x)])
        if self._pair_chunks:
            self._held = (position, grad_logits.clone(), x.clone())
        else:
            self._update(position, [(grad_logits, x)])

    def finish(self, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The sum (times ``scale``, a 0-dim tensor, in fp32) rounded to the result dtype,
        in the result's storage; frees the plane."""
        if self._held is not None:
            position, grad_logits, x = self._held
            self._held = None
            self._update(position, [(grad_logits, x)])
        classes, features = self.result.shape[0], self.result.shape[-1]
        for position in range(self.result.shape[1]):
            if position not in self._started:
                # No chunk reached it (every row ignored): the plane was never written.
                self.result[:, position].zero_()
                continue
            for block in vocab_blocks(classes, features, CACHE_BLOCK_ELEMENTS):
                summed = self._unpack(block, position, zero=False)
                if scale is not None:
                    summed.mul_(scale)
                self.result[block, position].copy_(summed)
        self._low = self._scratch = None
        return self.result

    def _update(self, position: int, chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        classes, features = self.result.shape[0], self.result.shape[-1]
        # Nothing to unpack before a position's first chunk: the sum starts at zero.
        zero = position not in self._started
        if chunks[0][0].dtype == self._scratch.dtype:
            # fp32 products: each GEMM adds into the unpacked part itself, no temporary.
            for rows in vocab_blocks(classes, features, CACHE_BLOCK_ELEMENTS):
                acc = self._unpack(rows, position, zero=zero)
                for g, x in chunks:
                    acc.addmm_(g[:, rows].T, x)
                self._pack(acc, rows, position)
            self._started.add(position)
            return
        # Half products a GEMM-sized block at a time; unpack, add, pack in cache-sized parts.
        for block in vocab_blocks(classes, features):
            total = self.gemm.sum_of_products([(g[:, block].T, x) for g, x in chunks])
            for part in vocab_blocks(block.stop - block.start, features, CACHE_BLOCK_ELEMENTS):
                rows = slice(block.start + part.start, block.start + part.stop)
                acc = self._unpack(rows, position, zero=zero)
                acc.add_(total[part])
                self._pack(acc, rows, position)
        self._started.add(position)

    def _unpack(self, block: slice, position: int, *, zero: bool) -> torch.Tensor:
        acc = self._scratch[: block.stop - block.start]
        # The bits below the plane are zero: that is the value the pack rounded to.
        acc.view(torch.int32).zero_()
        if zero:
            return acc
        acc.view(torch.int16).view(*acc.shape, 2)[..., 1].copy_(self._high[block, position])
        acc.view(torch.uint8).view(*acc.shape, 4)[..., 1].copy_(self._low[block, position])
        return acc

    def _pack(self, acc: torch.Tensor, block: slice, position: int) -> None:
        # Round to nearest at the plane's last bit: adding half of the dropped byte's range
        # to the bit pattern carries into the kept bits (and the exponent) exactly as
        # rounding the magnitude does; the sign bit is untouched short of NaN.
        acc.view(torch.int32).add_(0x80)
        self._low[block, position].copy_(acc.view(torch.uint8).view(*acc.shape, 4)[..., 1])
        self._high[block, position].copy_(acc.view(torch.int16).view(*acc.shape, 2)[..., 1])


def weight_grad_sum(
    plan: Plan, shape: tuple[int, ...], device: torch.device, scale: torch.Tensor | None = None
) -> DirectSum | SplitSum:
    """The running sum the plan asks for (``plan.weight_grad``), for a ``(V, P, F)`` gradient
    whose ``finish`` will be given ``scale`` (see :class:`DirectSum`)."""
    if plan.weight_grad == "split":
        # Half products: holding one chunk costs B·(V + F) half elements, halves the passes;
        # under a half tile the chunks are already long and the bytes are the tile's.
        pair = (
            plan.gemm.operand_dtype == plan.input_dtype
            and plan.rows_per_step == plan.rows_per_chunk
        )
        result = torch.empty(shape, dtype=plan.input_dtype, device=device)
        return SplitSum(result, plan.gemm, pair_chunks=pair)
    if plan.weight_grad == "wide":
        # The wide sum is rounded into a new result by ``finish``: scratch of the loop's.
        wide = scratch(tuple(shape), plan.weight_grad_dtype, device)
        return DirectSum(wide, plan.gemm, plan.input_dtype, scale=scale)
    return DirectSum(
        torch.empty(shape, dtype=plan.input_dtype, device=device), plan.gemm, scale=scale
    )
