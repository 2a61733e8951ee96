"""Memory the package keeps from one call to the next."""

from __future__ import annotations

from linear_ce.engine.scratch import kept_bytes, release

__all__ = ["kept_scratch_bytes", "release_scratch"]


def release_scratch() -> None:
    r"""Free the scratch tiles kept between calls on the CPU.

    A CPU call keeps its large logits tiles when it returns, so the next call of its
    shape writes into pages already there instead of faulting in fresh ones (see
    ``docs/benchmarks.md``, "Scratch kept between calls"). Between calls that is at most
    one call's scratch, the last one's. Call this where that memory is wanted back, for
    example before generation in an RL loop. The next call allocates its scratch again.
    ``LINEAR_CE_KEEP_SCRATCH=0`` keeps nothing at all.

    Example::

        >>> import torch, linear_ce
        >>> x, w = torch.randn(512, 64), torch.randn(4096, 64)
        >>> loss = linear_ce.linear_cross_entropy(x, w, torch.randint(0, 4096, (512,)))
        >>> linear_ce.release_scratch()
        >>> linear_ce.kept_scratch_bytes()
        0
    """
    release()


def kept_scratch_bytes() -> int:
    """The bytes of scratch kept between calls now (see :func:`release_scratch`)."""
    return kept_bytes()
