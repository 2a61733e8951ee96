"""The model-like work an in-process run (``--in-process``) puts between two head calls.

A training step runs the head in one process between the model's own layers: their GEMMs,
allocations and threads meet the head's chunk tiles, its kept scratch, the OpenMP workers
and the caches. So between any two measured calls the in-process run makes one forward and
backward of a transformer block (:class:`torch.nn.TransformerEncoderLayer`: attention with
``D / 64`` heads, a ``4·D`` feed-forward) on the point's ``N`` tokens as sequences of up to
:data:`SEQUENCE` tokens, ``D`` features wide: about ``72·N·D²`` flops, a third to a half of
the head's ``6·N·D·V`` at a vocabulary of 32 768. The block is in the point's dtype where
its GEMMs are native, else in fp32 (a half block would take minutes there, as the plain
half expression does).

Example::

    >>> step = model_step(Point(512, 64, 1000, "fp32", "cpu"))
    >>> step()  # forward and backward of the block, gradients dropped
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from linear_ce.bench.config import Point
from linear_ce.bench.variants import slow_half_gemm

__all__ = ["SEQUENCE", "model_step"]

#: Tokens per sequence of the block's input (fewer where the point has fewer rows).
SEQUENCE = 256


def model_step(point: Point) -> Callable[[], None]:
    """A callable that runs one forward and backward of a transformer block of width
    ``point.D`` on ``point.N`` tokens (``(N // T, T, D)``, ``T = min(N, SEQUENCE)``) and drops
    the block's gradients, so that every call does the same work."""
    dtype = torch.float32 if slow_half_gemm(point) else point.torch_dtype
    device = torch.device(point.device)
    heads = max(1, min(16, point.D // 64)) if point.D % 64 == 0 else 1
    gen = torch.Generator().manual_seed(5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        block = torch.nn.TransformerEncoderLayer(
            point.D, heads, 4 * point.D, dropout=0.0, batch_first=True
        ).to(device, dtype)
    length = min(point.N, SEQUENCE)
    tokens = torch.randn(point.N // length, length, point.D, generator=gen)
    tokens = tokens.to(device, dtype).requires_grad_()

    def step() -> None:
        block(tokens).float().square().mean().backward()
        tokens.grad = None
        for parameter in block.parameters():
            parameter.grad = None

    return step
