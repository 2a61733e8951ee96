"""Transient memory of every reduction and dtype path against the README's bounds.

The README promises that a training step (forward and backward) grows memory by
at most 1.3× the bytes of the gradients it returns, ``(N + V·P)·F·itemsize``,
for fp32 inputs and 2.5× for fp16/bf16 (the "transient memory" target). It is
measured here as the README's benchmark measures it: in a process of its own
(``memory_probe``), after one identical warm-up call and a heap trim, the
growth of the resident set from just before the call to its peak, the returned
gradients included. glibc's mmap threshold is fixed, so a freed buffer leaves
the resident set at once (see ``_PREAMBLE``).

The shape (``F = 1024``, ``V = 16384``; ``N = 512`` for fp32, 1024 for bf16)
is one where the README's chunk rule holds the scratch under the bound: in
fp32 ``B = 256`` rows of ``V·4`` bytes are 0.24× the gradients. At it an
``(N, V)`` fp32 logits tensor is 0.48× the fp32 gradients' bytes and 1.9× the
bf16 ones, an fp32 ``(V, F)`` buffer 0.97× / 1.9×: each is more than the room
the bound leaves above the measured peak, so a path that builds either fails
(``test_shape_catches_logits_and_weight_buffers`` checks that room).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from memory_probe import transient_peaks

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/status"
)

FEATURES, CLASSES = 1024, 16384
#: Rows per dtype: twice as many for bf16, whose bound leaves more room, so that an
#: (N, V) fp32 tensor still outgrows that room.
ROWS = {"float32": 512, "bfloat16": 1024}
#: The README's targets: transient memory over the gradients' bytes.
BOUND = {"float32": 1.3, "bfloat16": 2.5}
ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One path: input dtype, reduction, extra keyword arguments (Python source, may
    use ``tw``, the token weights), ``positions`` of a K-dimensional loss (the
    classes are then split so ``V·P`` stays ``CLASSES``), and whether the half
    path is forced onto the non-native (upcast) GEMMs."""

    dtype: str
    reduction: str
    extras: str = ""
    positions: int = 1
    force_upcast: bool = False

    @property
    def classes(self) -> int:
        return CLASSES // self.positions

    @property
    def grad_bytes(self) -> int:
        return (self.rows + self.classes * self.positions) * FEATURES * ITEMSIZE[self.dtype]

    @property
    def rows(self) -> int:
        return ROWS[self.dtype]


VARIANTS = {
    "fp32-mean": Variant("float32", "mean"),
    "fp32-none": Variant("float32", "none"),
    "fp32-sum-softcap": Variant("float32", "sum", "softcap=30.0"),
    "fp32-kdim-none-token-weight": Variant("float32", "none", "token_weight=tw", positions=2),
    "bf16-mean": Variant("bfloat16", "mean"),
    "bf16-none": Variant("bfloat16", "none"),
    "bf16-sum-softcap": Variant("bfloat16", "sum", "softcap=30.0"),
    "bf16-kdim-mean-z-loss": Variant("bfloat16", "mean", "z_loss=1e-4", positions=2),
    "bf16-mean-upcast": Variant("bfloat16", "mean", force_upcast=True),
}

# A fixed mmap threshold: every large buffer is mapped on allocation and unmapped when
# freed, so the peak counts the bytes the call holds, not where glibc's adaptive
# threshold (raised by the warm-up call's frees) happens to place a buffer on the heap.
_PREAMBLE = """
import ctypes, gc, os
import torch, linear_ce, linear_ce.engine.gemm, linear_ce.engine.plan
M_MMAP_THRESHOLD = -3
ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)
"""

# The upcast path as a CPU without AVX512-BF16/AMX runs it: the environment switch
# (issue 16) and the plan's capability answer both say "not native", and the native
# GEMM backend fails loudly if it is reached anyway.
_FORCE_UPCAST = """
os.environ["LINEAR_CE_NATIVE_HALF_GEMM"] = "0"
linear_ce.engine.plan.native_half_gemm = lambda *args: False
def _native_reached(*args):
    raise AssertionError("forced upcast variant reached the native half GEMM backend")
linear_ce.engine.gemm.NativeHalf.logits = _native_reached
"""

_SETUP = """
torch.manual_seed(0)
dtype = torch.{dtype}
W = (torch.randn({classes}, {positions}, {features}) / 16).squeeze(1).to(dtype).requires_grad_()
x = torch.randn({rows}, {features}).to(dtype).requires_grad_()
t = torch.randint(0, {classes}, ({rows}, {positions})).squeeze(1)
tw = torch.rand(t.shape).to(dtype)
up = torch.rand(t.shape).to(dtype)

def step():
    loss = linear_ce.linear_cross_entropy(x, W, t, reduction={reduction!r}, {extras})
    loss.backward(up if loss.dim() else None)

step()  # the warm-up call: library buffers and lazy set-up are not the call's
x.grad = W.grad = None
gc.collect()
ctypes.CDLL(None).malloc_trim(0)
"""


def _setup(variant: Variant) -> str:
    setup = _SETUP.format(
        dtype=variant.dtype,
        classes=variant.classes,
        positions=variant.positions,
        features=FEATURES,
        rows=variant.rows,
        reduction=variant.reduction,
        extras=variant.extras,
    )
    return (_FORCE_UPCAST if variant.force_upcast else "") + setup


@pytest.fixture(scope="module")
def peaks(request) -> dict[str, int]:
    """The transient peak of every variant this session runs a test of, in bytes (one
    process, a fork per variant)."""
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is sys.modules[__name__] and hasattr(item, "callspec")
    }
    names = [n for n in VARIANTS if n in selected]
    measured = transient_peaks(_PREAMBLE, [(_setup(VARIANTS[n]), "step()") for n in names])
    return dict(zip(names, measured, strict=True))


def _report(name: str, peak: int) -> str:
    variant = VARIANTS[name]
    return (
        f"{name}: peak {peak / 2**20:.1f} MiB = {peak / variant.grad_bytes:.3f}x the "
        f"gradients' {variant.grad_bytes / 2**20:.1f} MiB (bound {BOUND[variant.dtype]}x)"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    list(VARIANTS),
)
def test_transient_memory_within_readme_bound(peaks, name):
    variant, peak = VARIANTS[name], peaks[name]
    assert peak <= BOUND[variant.dtype] * variant.grad_bytes, _report(name, peak)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in VARIANTS if not VARIANTS[n].force_upcast])
def test_shape_catches_logits_and_weight_buffers(peaks, name):
    """The room the bound leaves above the measured peak is smaller than an
    ``(N, V)`` fp32 logits tensor and than an fp32 ``(V, F)`` buffer, so a path that
    added either would fail the bound (the test above is then not vacuous)."""
    variant, peak = VARIANTS[name], peaks[name]
    room = BOUND[variant.dtype] * variant.grad_bytes - peak
    logits = variant.rows * variant.classes * variant.positions * 4
    weight_fp32 = variant.classes * variant.positions * FEATURES * 4
    assert room < min(logits, weight_fp32), (
        f"{_report(name, peak)}: {room / 2**20:.1f} MiB of room hides an (N, V) fp32 tensor "
        f"({logits / 2**20:.1f} MiB) or a (V, F) fp32 buffer ({weight_fp32 / 2**20:.1f} MiB)"
    )
