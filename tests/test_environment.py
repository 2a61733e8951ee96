"""Every ``LINEAR_CE_*`` variable, read by :mod:`linear_ce.engine.environment`: a bad value is
the same ``ValueError`` on every call whatever path it takes, naming the variable and the
form expected; ``''`` is the default everywhere. A measured-plan profile that does not
have the shape the plan reads is ignored with the warning every bad profile gets."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

import linear_ce
from linear_ce.engine import environment, machine

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    """No variable from the caller's environment; the profile in a fresh directory."""
    for name in environment.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LINEAR_CE_MEASURE", "0")
    monkeypatch.setenv("LINEAR_CE_NATIVE_ROWS", "0")
    monkeypatch.setenv("LINEAR_CE_CACHE_DIR", str(tmp_path / "cache"))
    machine._STORE.clear()
    yield
    machine._STORE.clear()


def _training_step() -> None:
    """A small fp32 training step (chunk loop, no statistics pass, scratch under 1 MiB)."""
    x = torch.randn(6, 8, requires_grad=True)
    linear_ce.linear_cross_entropy(x, torch.randn(20, 8), torch.arange(6)).backward()


def _forward() -> None:
    """A small fp32 call without gradients (the statistics pass's plan)."""
    with torch.no_grad():
        linear_ce.linear_cross_entropy(torch.randn(6, 8), torch.randn(20, 8), torch.arange(6))


CALLS = {"training step": _training_step, "forward": _forward}


def test_every_variable_the_source_reads_is_checked():
    """Each ``LINEAR_CE_*`` name in the package's source is one of the checked variables."""
    source = Path(linear_ce.__file__).parent
    named = set()
    for path in source.rglob("*.py"):
        named |= set(re.findall(r"LINEAR_CE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert named <= set(environment.VARIABLES), named - set(environment.VARIABLES)


# '²' and '٣': str.isdigit() is true, int() refuses the first; neither is a number here.
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("value", ["²", "٣", "OFF", "yes"])
@pytest.mark.parametrize("name", sorted(set(environment.VARIABLES) - {"LINEAR_CE_CACHE_DIR"}))
def test_a_bad_value_is_the_same_error_on_every_call(monkeypatch, name, value, call):
    """Every call checks every variable: training steps too for the statistics pass's
    block, calls with scratch under 1 MiB too for keeping scratch."""
    expected = environment.VARIABLES[name][1]
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        CALLS[call]()
    text = str(error.value)
    assert text.startswith(f"{name} must be ") and text.endswith(f"; got {value!r}"), text
    if name != "LINEAR_CE_ROW_KERNELS":  # its module reads it first, with its own words
        assert text == f"{name} must be {expected}; got {value!r}"


@pytest.mark.parametrize("value", ["", "  "])
@pytest.mark.parametrize("name", sorted(environment.VARIABLES))
def test_empty_is_the_default_everywhere(monkeypatch, name, value):
    default = environment.VARIABLES[name][2]
    monkeypatch.setenv(name, value)
    if name == "LINEAR_CE_CACHE_DIR":
        assert environment.cache_dir() == environment.default_cache_dir()
    else:
        assert environment.read(name) == default
    for call in CALLS.values():
        call()


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("LINEAR_CE_CHUNK_ROWS", " 96 ", 96),
        ("LINEAR_CE_STATS_BLOCK", "off", 0),
        ("LINEAR_CE_STATS_BLOCK", "auto", None),
        ("LINEAR_CE_MEMORY_BUDGET", "0.5", 0.5),
        ("LINEAR_CE_BUILD_TIMEOUT", "2.5", 2.5),
        ("LINEAR_CE_KEEP_SCRATCH", "0", "0"),
        ("LINEAR_CE_CACHE_DIR", "~/x", Path.home() / "x"),
    ],
)
def test_good_values(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert environment.read(name) == value


def test_a_whole_number_is_ascii_digits():
    """``'²'.isdigit()`` is true and ``int('²')`` fails: the message names the variable."""
    assert "²".isdigit()
    bad = pytest.raises(ValueError, match=r"^LINEAR_CE_STEP_ROWS must be a positive number")
    with bad, pytest.MonkeyPatch.context() as patch:
        patch.setenv("LINEAR_CE_STEP_ROWS", "²")
        environment.read("LINEAR_CE_STEP_ROWS")


# --- the measured plan's profile --------------------------------------------------------------

#: Every chunk entry a measured call at F=1024 on one thread reads.
KEYS = [
    f"chunk/float32/F1024/t1/{lay}/B{b}" for b in machine.CANDIDATE_ROWS for lay in ("class", "row")
]


def _write_profile(text: str) -> Path:
    path = machine._STORE._path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _profile(rates: dict) -> str:
    key = machine._machine_key()
    data = {
        "version": machine.CACHE_VERSION,
        "machine": key,
        "rates": rates,
        "checksum": machine._checksum(key, rates),
    }
    return json.dumps(data)


def _planned_rows(monkeypatch) -> int:
    """A measured call's rows per chunk, its measurement a synthetic one (every entry
    the disk lacks: 100 GFLOP/s, steady)."""
    monkeypatch.setenv("LINEAR_CE_MEASURE", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)

    def chunk_rates(dtype, features, rows, layouts=(True, False)):
        return {(b, lay): [100.0] * 4 + [1.0, 1.0] for b in rows for lay in layouts}

    monkeypatch.setattr(machine, "chunk_rates", chunk_rates)
    tuning = machine.tuning_for(CPU, torch.float32, 1024, 6 * 2048 * 1024 * 32768)
    return tuning.rows(256)


@pytest.mark.parametrize(
    ("case", "text", "problem"),
    [
        # Shorter than a chunk entry (6 values): the checksum holds, the plan read [-2].
        ("short entry", _profile({key: [150.0] for key in KEYS}), "bad entry"),
        ("a half entry of 6", _profile({"half/bfloat16/F64/t1/B512": [1.0] * 6}), "bad entry"),
        ("unknown kind", _profile({"other/x": [1.0, 1.0, 1.0]}), "bad entry"),
        ("nested", "[" * 100_000 + "]" * 100_000, "RecursionError"),
        (
            "nested rates",
            _profile({KEYS[0]: [1.0]}).replace("[1.0]", "[" * 50_000 + "]" * 50_000),
            "",
        ),
    ],
)
def test_a_profile_of_another_shape_is_ignored_with_a_warning(monkeypatch, case, text, problem):
    path = _write_profile(text)
    with pytest.warns(RuntimeWarning, match=rf"ignoring the machine profile {path} \(.*{problem}"):
        rows = _planned_rows(monkeypatch)
    assert rows == 256
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _planned_rows(monkeypatch) == 256
