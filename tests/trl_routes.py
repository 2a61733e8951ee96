"""Fixtures of the tests of TRL's sequence-loss routes (test_trl_sequence, test_trl_grpo,
test_trl_kto): import them into a test module that has already skipped without TRL."""

from __future__ import annotations

import functools

import pytest
from trl.kernels import chunked_logprob

import linear_ce.integrations.trl_sequence as trl_sequence
from linear_ce.integrations import trl as lce_trl


@pytest.fixture(autouse=True, name="unpatched")
def unpatched_fixture():
    """Each test starts and ends with TRL unpatched."""
    lce_trl.unpatch()
    yield
    lce_trl.unpatch()


@pytest.fixture(name="routed")
def routed_fixture(monkeypatch):
    """Counts the sequence-objective calls of the route and TRL's kernel forwards."""
    calls = {"sequence": 0, "kernel": 0}
    inner = trl_sequence.sequence_objective

    def counted(*args, **kwargs):
        calls["sequence"] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(trl_sequence, "sequence_objective", counted)
    kernel = chunked_logprob.ChunkedLogProbFunction
    forward = kernel.forward

    @functools.wraps(forward)
    def counted_forward(*args):
        calls["kernel"] += 1
        return forward(*args)

    monkeypatch.setattr(kernel, "forward", staticmethod(counted_forward))
    return calls
