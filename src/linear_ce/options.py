"""User-facing knobs of the chunked loss: what may be set, validated once."""

from __future__ import annotations

import dataclasses
import re

import torch

__all__ = ["ACC_POLICIES", "LinearCrossEntropyOptions", "parse_chunking_method", "resolve_options"]

ACC_POLICIES = ("auto", "accurate", "balanced", "compact")
_ACC_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CHUNKING = re.compile(r"^(auto|aspect_ratio|budget)(?::([1-9][0-9]*))?$")


def parse_chunking_method(method: str | None) -> tuple[str | None, int]:
    """Split ``"aspect_ratio:4"`` into ``("aspect_ratio", 4)``; ``None`` gives ``(None, 1)``."""
    if method is None:
        return None, 1
    match = _CHUNKING.match(method) if isinstance(method, str) else None
    if match is None or (match.group(1) == "auto" and match.group(2) is not None):
        raise ValueError(
            "LinearCrossEntropyOptions: chunking_method must be None, 'auto', 'budget', "
            f"'budget:N', 'aspect_ratio' or 'aspect_ratio:N' with an integer N >= 1, got {method!r}"
        )
    return match.group(1), int(match.group(2) or 1)


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyOptions:
    r"""How the chunked loss runs; never what it computes.

    Every setting gives the same loss and gradients up to rounding; they
    trade memory, speed and the precision of intermediates.

    Args:
        allow_retain_graph: for ``reduction`` ``"mean"``/``"sum"`` the
            gradients are computed during forward and handed over by backward.
            ``False`` (default) hands over the stored buffers themselves, so a
            second backward raises ``RuntimeError``. ``True`` keeps them and
            hands over scaled copies (one extra gradient-sized allocation per
            backward), so ``retain_graph=True`` works. ``reduction="none"``
            recomputes in backward and supports retain_graph either way.
            Under ``torch.compile`` it is promoted to ``True`` with a warning.
        batch_chunk_size: rows per chunk. ``None`` lets :attr:`chunking_method`
            decide. A value together with a non-``"auto"`` method is an error.
        chunking_method: how the chunk size is chosen when
            :attr:`batch_chunk_size` is ``None``:

            - ``"auto"`` (default): ``"budget"``.
            - ``"budget"`` / ``"budget:N"``: the largest chunk whose
              ``(chunk, V)`` scratch fits a memory budget of about a quarter of
              the gradients' bytes (``/N``; the environment variable
              ``LINEAR_CE_MEMORY_BUDGET`` sets the share), rounded down to a
              multiple of 32 rows, at least 128 rows where that does not exceed
              N, so each GEMM stays efficient; on a CPU, fp32/fp64 inputs take
              fewer rows where this machine's GEMMs measure as fast with them
              (:mod:`linear_ce.engine.machine`).
            - ``"aspect_ratio"`` / ``"aspect_ratio:N"``: torch's rule; the
              ``(chunk, V)`` logits take about as many bytes as the ``(N, F)``
              input (``/N``), rounded up to a power of two.
            - ``None``: one chunk of :attr:`batch_chunk_size` rows (all rows if
              that is ``None`` too).
        acc_policy: which intermediates use :attr:`acc_dtype` when it differs
            from the input dtype (fp16/bf16 inputs); see ``docs/precision.md``
            for the measured error against the number of chunks, memory and speed:

            - ``"accurate"``: fp32 copies of the weight (once per call) and of
              each chunk of rows; logits, softmax and all three GEMM outputs in
              ``acc_dtype``; the weight gradient summed in an ``acc_dtype``
              ``(V, F)`` buffer (``V·F·4`` bytes for fp32). Most memory.
            - ``"balanced"``: the GEMMs read half operands where the device has
              native fp16/bf16 GEMMs (CUDA: fp32 results; a CPU with
              AVX512-BF16/AMX: each product rounded to the input dtype once);
              on other CPUs they run in fp32 on the weight upcast one
              vocabulary block at a time (no fp32 copy of it). On a CPU the
              weight gradient is summed in fp32 held in the half result plus a
              low-order plane (``V·F`` more bytes;
              see :mod:`linear_ce.engine.accumulate`); on CUDA in an fp32 buffer.
              Its error does not grow with the number of chunks.
            - ``"compact"``: no weight-gradient buffer: each chunk's weight
              gradient is added straight into the half result. Least memory,
              but one rounding per chunk: the error grows with the number of
              chunks (about 12× the plain expression's at 256 chunks in bf16).
              GEMMs as for ``"balanced"``.
            - ``"auto"`` (default): ``"balanced"`` for half inputs on a CPU,
              ``"accurate"`` everywhere else.

            The environment variable ``LINEAR_CE_NATIVE_HALF_GEMM=0`` makes
            every CPU take the path without native half GEMMs (for tests and
            benchmarks of that path on any machine).
        acc_dtype: accumulation dtype. ``None``: float32 for fp16/bf16 input,
            the input dtype otherwise. Must not be narrower than the input.

    Example::

        >>> opts = LinearCrossEntropyOptions(batch_chunk_size=256)
        >>> opts.batch_chunk_size
        256
    """

    allow_retain_graph: bool = False
    batch_chunk_size: int | None = None
    chunking_method: str | None = "auto"
    acc_policy: str = "auto"
    acc_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.allow_retain_graph, bool):
            raise TypeError(
                "LinearCrossEntropyOptions: allow_retain_graph must be a bool, got "
                f"{type(self.allow_retain_graph).__name__}"
            )
        size = self.batch_chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
            raise ValueError(
                "LinearCrossEntropyOptions: batch_chunk_size must be a positive int or None, "
                f"got {size!r}"
            )
        method, _ = parse_chunking_method(self.chunking_method)
        if size is not None and method not in (None, "auto"):
            raise ValueError(
                f"LinearCrossEntropyOptions: batch_chunk_size={size} and "
                f"chunking_method={self.chunking_method!r} both choose the chunk size; pass only "
                "one (or chunking_method=None)"
            )
        if self.acc_policy not in ACC_POLICIES:
            raise ValueError(
                f"LinearCrossEntropyOptions: acc_policy must be one of {ACC_POLICIES}, got "
                f"{self.acc_policy!r}"
            )
        if self.acc_dtype is not None and self.acc_dtype not in _ACC_DTYPES:
            raise ValueError(
                "LinearCrossEntropyOptions: acc_dtype must be None, torch.float16, "
                f"torch.bfloat16, torch.float32 or torch.float64, got {self.acc_dtype!r}"
            )


def resolve_options(
    options: LinearCrossEntropyOptions | None, caller: str
) -> LinearCrossEntropyOptions:
    """``options``, or the defaults for ``None``; anything else is a ``TypeError`` naming ``caller``."""
    if options is None:
        return _DEFAULT_OPTIONS
    if not isinstance(options, LinearCrossEntropyOptions):
        raise TypeError(
            f"{caller}: options must be a linear_ce.LinearCrossEntropyOptions or None, "
            f"got {type(options).__name__}"
        )
    return options


_DEFAULT_OPTIONS = LinearCrossEntropyOptions()
