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


#: The profile every hypothesis test runs under in CI (and by default).
CI_PROFILE = "ci"


def _register_hypothesis_profiles() -> None:
    """``ci`` (default): a fixed number of derandomised examples, so the suite time is
    bounded and every run tests the same examples (for one hypothesis/Python version and
    test source). No example database: a local ``.hypothesis`` directory must not change
    what runs, so an example found by a failure is kept as an explicit ``@example``; the
    failure prints its reproduction blob. ``long``: many more random examples, with the
    database, ``HYPOTHESIS_PROFILE=long``."""
    import os

    from hypothesis import HealthCheck, settings

    common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
    settings.register_profile(
        CI_PROFILE, max_examples=60, derandomize=True, database=None, print_blob=True, **common
    )
    settings.register_profile("long", max_examples=2000, **common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", CI_PROFILE))


_register_hypothesis_profiles()


def pytest_collection_modifyitems(config, items):
    """Under the ``ci`` profile every hypothesis test must run derandomised without a
    database: a test whose own ``@settings`` overrides that would draw new examples on
    every run (how CI once failed by chance, issue 29)."""
    from hypothesis import settings

    if settings.get_current_profile_name() != CI_PROFILE:
        return
    loose = []
    for item in items:
        test = getattr(item, "obj", None)
        if not getattr(test, "is_hypothesis_test", False):
            continue
        # hypothesis keeps the settings a test runs with here (its pytest plugin reads it too).
        used = getattr(test, "_hypothesis_internal_use_settings", settings.default)
        if not used.derandomize or used.database is not None:
            loose.append(item.nodeid)
    if loose:
        raise pytest.UsageError(
            "hypothesis tests not derandomised or with an example database under the "
            f"'{CI_PROFILE}' profile (set neither derandomize=False nor database in their "
            f"@settings): {', '.join(sorted(set(loose)))}"
        )
