"""Benchmark points: shapes, dtypes and the sweep, parsed from the command line."""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "DTYPES",
    "HEADS",
    "Point",
    "parse_dtypes",
    "parse_fractions",
    "parse_heads",
    "parse_reductions",
    "parse_shapes",
    "parse_sweep",
    "points",
]

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp64": torch.float64,
    "float64": torch.float64,
}
_SHORT = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
}


#: The heads a point can measure: the cross-entropy loss; per-token log-probabilities and
#: entropy (:func:`linear_ce.token_logprobs`) with upstream gradients on both; a PPO/GRPO
#: clipped policy-gradient step with an entropy bonus (:func:`linear_ce.token_objective`); distillation
#: (:func:`linear_ce.linear_divergence`, a teacher head of the same shape); a DPO step
#: (:func:`linear_ce.sequence_objective`, pairs of 256-token sequences); sparse distillation
#: from a stored teacher's top-64 (:func:`linear_ce.sparse_divergence`).
HEADS = ("ce", "logprobs", "objective", "divergence", "dpo", "sparse")

#: The cross-entropy reductions a masked point can take (``--reductions``): the loss's
#: ``reduction``; ``"none"`` is backpropagated through the sum of the per-row losses.
REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured configuration: ``N`` rows, ``D`` features, ``V`` classes, the share
    of targets set to the ignore index, the head measured and the loss's reduction (a
    masked cross-entropy point's; ``"mean"`` everywhere else)."""

    N: int
    D: int
    V: int
    dtype: str
    device: str
    ignored: float = 0.0
    head: str = "ce"
    reduction: str = "mean"

    @property
    def swept(self) -> bool:
        """Whether the point belongs to the plotted sweep (plain cross-entropy, no masking,
        the mean)."""
        return self.head == "ce" and self.ignored == 0.0 and self.reduction == "mean"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradients themselves: ``grad_input`` plus ``grad_weight``."""
        return (self.N + self.V) * self.D * self.torch_dtype.itemsize

    @property
    def label(self) -> str:
        extra = "" if self.head == "ce" else f" {self.head}"
        if self.ignored:
            extra += f" {self.ignored:.0%} ignored"
        if self.reduction != "mean":
            extra += f" reduction={self.reduction}"
        return f"N={self.N} D={self.D} V={self.V} {self.dtype}{extra}"


def _positive(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {text!r}")
    return value


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"2048,1024,32768;512,256,4096"`` -> ``[(N, D, V), ...]``."""
    shapes = []
    for part in text.split(";"):
        fields = part.strip().split(",")
        if len(fields) != 3:
            raise ValueError(f"a shape is 'N,D,V' (three integers), got {part!r}")
        shapes.append(tuple(_positive(f.strip(), "each of N, D, V") for f in fields))
    return shapes


def parse_dtypes(text: str) -> list[str]:
    """``"fp32,bf16"`` -> short names, checked against :data:`DTYPES`."""
    names = []
    for name in text.split(","):
        name = name.strip()
        if name not in DTYPES:
            raise ValueError(
                f"unknown dtype {name!r}; expected one of {sorted(set(_SHORT.values()))}"
            )
        names.append(_SHORT[DTYPES[name]])
    return names


def parse_sweep(text: str | None) -> tuple[str, list[int]] | None:
    """``"V=4096,8192"`` -> ``("V", [4096, 8192])``; ``None``/``"none"`` -> ``None``."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    dim, sep, values = text.partition("=")
    dim = dim.strip()
    if not sep or dim not in ("N", "D", "V"):
        raise ValueError(f"--sweep is 'N=a,b,...', 'D=...' or 'V=...', got {text!r}")
    return dim, [_positive(v.strip(), f"each {dim} of --sweep") for v in values.split(",")]


def parse_fractions(text: str | None) -> list[float]:
    """``"0.5,0.75"`` -> ``[0.5, 0.75]`` (each in ``(0, 1)``); ``None``/``"none"`` -> ``[]``."""
    if text is None or text.strip().lower() in ("", "none"):
        return []
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            value = -1.0
        if not 0.0 < value < 1.0:
            raise ValueError(f"--ignored takes fractions in (0, 1), got {part.strip()!r}")
        values.append(value)
    return values


def parse_heads(text: str) -> list[str]:
    """``"ce,logprobs"`` -> names checked against :data:`HEADS`; ``"ce"`` must come first."""
    heads = [h.strip() for h in text.split(",") if h.strip()]
    unknown = [h for h in heads if h not in HEADS]
    if unknown or not heads:
        raise ValueError(f"unknown head(s) {unknown}; choose from {', '.join(HEADS)}")
    return heads


def parse_reductions(text: str) -> list[str]:
    """``"mean,none"`` -> names checked against :data:`REDUCTIONS`."""
    names = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in names if r not in REDUCTIONS]
    if unknown or not names:
        raise ValueError(
            f"unknown reduction(s) {unknown or [text]}; choose from {', '.join(REDUCTIONS)}"
        )
    return list(dict.fromkeys(names))


def points(
    shapes: list[tuple[int, int, int]],
    dtypes: list[str],
    device: str,
    sweep: tuple[str, list[int]] | None,
    sweep_dtypes: list[str],
    ignored: tuple[float, ...] = (),
    heads: tuple[str, ...] = ("ce",),
    extra_dtypes: list[str] | None = None,
    reductions: tuple[str, ...] = ("mean",),
) -> list[Point]:
    """The main shapes in every dtype, then the sweep around the first shape.

    The sweep varies one dimension of the first shape (the shape itself is
    one of its points) in ``sweep_dtypes``; duplicates are measured once.
    Each share in ``ignored`` adds the first shape in each of ``extra_dtypes`` (default:
    the first dtype) with that share of targets ignored, once per reduction in
    ``reductions``; each head other than ``"ce"`` adds the first shape in each of
    ``extra_dtypes``. The unmasked step of each extra dtype and reduction is measured
    too, so a masked point's time can be read against it (``"none"`` differs from the
    others: its backward recomputes the logits).
    """
    result: list[Point] = []
    for dtype in dtypes:
        for n, d, v in shapes:
            result.append(Point(n, d, v, dtype, device))
    if sweep is not None:
        dim, values = sweep
        n, d, v = shapes[0]
        for dtype in sweep_dtypes:
            for value in values:
                sizes = {"N": n, "D": d, "V": v, dim: value}
                result.append(Point(sizes["N"], sizes["D"], sizes["V"], dtype, device))
    n, d, v = shapes[0]
    extra = dtypes[:1] if extra_dtypes is None else extra_dtypes
    for dtype in extra:
        result.extend(
            Point(n, d, v, dtype, device, ignored=share, reduction=reduction)
            for share in ((0.0, *ignored) if ignored else ())
            for reduction in reductions
        )
        result.extend(Point(n, d, v, dtype, device, head=head) for head in heads if head != "ce")
    unique = list(dict.fromkeys(result))
    order = list(dict.fromkeys([*dtypes, *extra]))
    return sorted(
        unique,
        key=lambda p: (
            order.index(p.dtype),
            not p.swept,
            p.head,
            p.ignored,
            REDUCTIONS.index(p.reduction),
            p.N * p.D * p.V,
        ),
    )
