"""Small helpers shared by the tests (importable as ``from conftest import rel_err, eps``)."""

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable

import pytest
import torch

# Triton's interpreter where no CUDA device is (tests/test_triton_rows.py runs the Triton
# row kernels on CPU tensors): Triton reads TRITON_INTERPRET as its language is first
# imported, which torch._dynamo does when linear_ce is, so it is set before any of that.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist


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


#: torch before 2.8 destroys a gloo process group holding the GIL while it joins gloo's
#: worker threads, and a worker that still holds the last reference to a tensor with a
#: Python object waits for the GIL to drop it: ``destroy_process_group()`` (or the
#: interpreter's exit, which destroys the group too) can hang for good (pytorch PR 154976,
#: in 2.8, releases the GIL there). Seen on torch 2.6: a rank of tests/test_distributed.py
#: hung in it at world 2 and 4, also alone on a quiet machine.
GLOO_TEARDOWN_HANGS = torch.__version__ < "2.8"


def run_gloo_rank(rank: int, world: int, folder: str, check: Callable[[], object]) -> None:
    """One rank of a spawned multi-process test: joins the gloo group of ``world`` ranks
    (its file store in ``folder``), writes what ``check()`` returns (JSON: the failures
    found) to ``folder/rank<rank>.json``, waits until every rank has written its findings
    (so none has a collective in flight), leaves the group and ends at once
    (``os._exit``): exit code 0, or 1 with the traceback printed where ``check`` raised,
    which ``mp.spawn`` reports.

    The rank never reaches the interpreter's finalization, where gloo's worker threads
    may still hold a collective's tensors and dropping them aborts the process (SIGABRT,
    "terminate called without an active exception": pytorch PR 179291; seen once in CI,
    torch 2.13, tests/test_distributed_sequence.py at world 2, after both ranks' checks).
    Where the group's teardown itself can hang (:data:`GLOO_TEARDOWN_HANGS`) it is not
    torn down at all: ``os._exit`` ends the group with the process."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    status = 0
    try:
        found = check()
        _write_findings(folder, rank, found)
        done = dist.FileStore(f"{folder}/done", world)
        done.set(f"rank{rank}", "done")
        done.wait([f"rank{r}" for r in range(world)], datetime.timedelta(seconds=60))
        if not GLOO_TEARDOWN_HANGS:
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


#: The in-process gloo group last left where its teardown can hang, kept alive until the
#: next one is left (see :func:`leave_gloo_group`).
_LEFT_GROUP: list[object] = []


def leave_gloo_group() -> None:
    """``dist.destroy_process_group()`` for a group of the test process itself.

    Where the teardown can hang (:data:`GLOO_TEARDOWN_HANGS`; seen on torch 2.6 in a
    one-rank group's fixture too) the group's object is kept alive past the call, so its
    destructor does not run then, right after the group's last collective, while a worker
    thread may still hold that collective's tensors; it runs when the next group is left
    (or at exit), its workers long idle by then."""
    if GLOO_TEARDOWN_HANGS:
        _LEFT_GROUP[:] = [dist.group.WORLD]
    dist.destroy_process_group()


def _write_findings(folder: str, rank: int, found: object) -> None:
    with open(f"{folder}/rank{rank}.json", "w") as out:
        json.dump(found, out)


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
