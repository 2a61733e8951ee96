"""Small helpers shared by the tests (importable as ``from conftest import rel_err, eps``)."""

import pytest
import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||got - ref|| / ||ref||, computed in float64.

    When ``ref`` is all zeros the absolute norm of ``got`` is returned instead.
    """
    got64 = got.detach().to(device="cpu", dtype=torch.float64)
    ref64 = ref.detach().to(device="cpu", dtype=torch.float64)
    denom = torch.linalg.vector_norm(ref64).item()
    diff = torch.linalg.vector_norm(got64 - ref64).item()
    return diff / denom if denom > 0 else diff


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating dtype."""
    return torch.finfo(dtype).eps


@pytest.fixture
def seeded() -> None:
    """Seed torch's global generator so a test's random inputs are reproducible."""
    torch.manual_seed(0)


def _register_hypothesis_profiles() -> None:
    """``ci`` (default): a fixed, derandomised number of examples so the suite time is
    bounded and reproducible; ``long``: many more, with ``HYPOTHESIS_PROFILE=long``."""
    import os

    from hypothesis import HealthCheck, settings

    common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
    settings.register_profile("ci", max_examples=60, derandomize=True, **common)
    settings.register_profile("long", max_examples=2000, **common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_register_hypothesis_profiles()
