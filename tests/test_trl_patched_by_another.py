"""Another library's wrapper where :func:`linear_ce.integrations.trl.patch` replaces TRL's own:
refused, and the message names what was found (its qualified name, the module that defines
it), not the TRL version."""

from __future__ import annotations

import functools
import types

import pytest

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'linear-ce[trl]'")

from linear_ce.integrations import trl as lce_trl  # noqa: E402

WRAPPER = """
import functools

def wrap(original):
    @functools.wraps(original)
    def logged_compute_loss(*args, **kwargs):
        return original(*args, **kwargs)

    return logged_compute_loss
"""


def _other_library() -> types.ModuleType:
    module = types.ModuleType("otherlib.tracing")
    exec(compile(WRAPPER, "otherlib/tracing.py", "exec"), module.__dict__)
    return module


@pytest.fixture(autouse=True)
def unpatched():
    lce_trl.unpatch()
    yield
    lce_trl.unpatch()


def test_a_wrapper_of_another_library_is_named(monkeypatch):
    """``functools.wraps`` copies TRL's names and signature onto the wrapper: the message
    reads the module and name from its code. Before: "the installed trl 1.16.0 differs"."""
    original = trl.DPOTrainer._compute_loss
    wrapper = _other_library().wrap(original)
    assert wrapper.__module__ == original.__module__  # what functools.wraps copied
    monkeypatch.setattr(trl.DPOTrainer, "_compute_loss", wrapper)
    with pytest.raises(lce_trl.UnsupportedTRLVersion) as error:
        lce_trl.patch()
    text = str(error.value)
    assert "another library has replaced what linear_ce.integrations.trl patches" in text
    assert (
        "trl.trainer.dpo_trainer.DPOTrainer._compute_loss is "
        "otherlib.tracing.wrap.<locals>.logged_compute_loss in otherlib/tracing.py wrapping "
        "trl.trainer.dpo_trainer.DPOTrainer._compute_loss"
    ) in text
    assert "differs" not in text and trl.__version__ not in text
    assert "Undo that patch, or call patch() before it" in text
    assert not lce_trl.is_patched()


def test_a_callable_object_of_another_library_is_named(monkeypatch):
    class Tracer:
        def __call__(self, model, inputs, return_outputs=False):
            return None

    Tracer.__module__ = "otherlib.objects"
    monkeypatch.setattr(trl.DPOTrainer, "_compute_loss", functools.partial(Tracer()))
    with pytest.raises(lce_trl.UnsupportedTRLVersion, match=r"otherlib\.objects.+Tracer") as error:
        lce_trl.patch()
    assert "differs" not in str(error.value)


def test_a_changed_trl_still_blames_the_version(monkeypatch):
    """What is TRL's own but not as expected: the version message, as before."""
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", object())
    with pytest.raises(lce_trl.UnsupportedTRLVersion, match=r"the installed trl 1\.17\.0 differs"):
        lce_trl.patch()
