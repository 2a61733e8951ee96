"""The compiled row loops' cache (:mod:`linear_ce.engine.native_rows`) as users' machines meet
it: a damaged library, another library under the cached name, a cache others can write, a
compiler that never finishes. Each probe runs a training step in a fresh process over its own
``LINEAR_CE_CACHE_DIR``: the process survives, its result matches the float64 expression as
the torch operations' would, and its warning or error says what was wrong.

The probes' "compiler" (``copycc``) copies a library built once by the real one, so a
rebuild costs a copy, not a compilation."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import eps, rel_err
from linear_ce.engine import environment
from linear_ce.engine import native_rows as nr

#: A training step's loss and gradients, fp32, 64 rows, in a process of its own; prints a
#: JSON report (result or error, warnings, whether the compiled loops loaded).
PROBE = r"""
import json, warnings
import torch
import linear_ce
from linear_ce.engine import native_rows as nr
gen = torch.Generator().manual_seed(0)
x = torch.randn(64, 16, generator=gen).requires_grad_()
W = torch.randn(300, 16, generator=gen).requires_grad_()
t = torch.randint(0, 300, (64,), generator=gen)
report = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        loss = linear_ce.linear_cross_entropy(x, W, t)
        loss.backward()
        report["result"] = [loss.item(), x.grad.tolist(), W.grad.tolist()]
    except Exception as error:
        report["error"] = f"{type(error).__name__}: {error}"
report["warnings"] = [str(w.message) for w in caught]
report["loaded"] = nr._library.library is not None
print(json.dumps(report))
"""

#: A library with no row loops whose constructor, if it is ever loaded, writes the file
#: named by ``PLANTED_MARKER``.
PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("PLANTED_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) fclose(f);
}
int lce_something_else(void) { return 1; }
"""


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> dict[str, Path]:
    """``copycc`` (copies a real build of the loops to its ``-o``), the planted library, and
    ``template``: a cache directory ``copycc`` built."""
    real = shutil.which(nr._compiler()[0])
    if real is None:
        pytest.skip(f"no C compiler {nr._compiler()[0]!r} to build the row loops")
    folder = tmp_path_factory.mktemp("tools")
    nr._library.get(required=True)  # this process's build (the suite's other tests use it)
    good = nr.library_path()
    planted = folder / "planted.so"
    (folder / "planted.c").write_text(PLANTED_C)
    subprocess.run(
        [real, "-shared", "-fPIC", str(folder / "planted.c"), "-o", str(planted)], check=True
    )
    copycc = _script(
        folder / "copycc",
        'if [ "$1" = --version ]; then echo copycc 1.0; exit 0; fi\n'
        'while [ $# -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
        f'exec cp {good} "$out"\n',
    )
    template = folder / "template"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CC", str(copycc))
        nr._load(template, 60.0)
    return {"copycc": copycc, "planted": planted, "template": template}


def _library(cache: Path) -> Path:
    (path,) = cache.glob("native-rows-*.so")
    return path


def _vouch_for(path: Path) -> None:
    """Write ``path``'s record as a build of the package would."""
    data = path.read_bytes()
    record = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    path.with_suffix(".json").write_text(json.dumps(record))


def _probe(cache: Path, mode: str, cc: Path, **env: str) -> dict:
    """:data:`PROBE` in a fresh process over ``cache``: its report; it must not die."""
    environ = {k: v for k, v in os.environ.items() if k not in environment.VARIABLES}
    environ.update(
        LINEAR_CE_CACHE_DIR=str(cache),
        LINEAR_CE_NATIVE_ROWS=mode,
        LINEAR_CE_MEASURE="0",
        CC=str(cc),
        OMP_NUM_THREADS="1",
    )
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_result(report: dict) -> None:
    """The step's loss and gradients against float64. Bound: 3 eps(fp32), or twice the
    plain fp32 expression's own error where that is larger (the house bound)."""
    assert "result" in report, report
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen)
    W = torch.randn(300, 16, generator=gen)
    t = torch.randint(0, 300, (64,), generator=gen)

    def plain(dtype):
        xs, Ws = (v.to(dtype).requires_grad_() for v in (x, W))
        loss = torch.nn.functional.cross_entropy(xs @ Ws.T, t)
        return [loss.detach(), *torch.autograd.grad(loss, (xs, Ws))]

    exact, same = plain(torch.float64), plain(torch.float32)
    got = [torch.tensor(v) for v in report["result"]]
    for name, g, e, s in zip(("loss", "grad x", "grad W"), got, exact, same, strict=True):
        bound = max(3 * eps(torch.float32), 2 * rel_err(s, e))
        assert rel_err(g, e) <= bound, (name, rel_err(g, e), bound)


@pytest.fixture
def cache(tools, tmp_path) -> Path:
    """A copy of the template cache: the library and its record."""
    folder = tmp_path / "cache"
    shutil.copytree(tools["template"], folder)
    return folder


def _whole(path: Path) -> bool:
    record = json.loads(path.with_suffix(".json").read_text())
    return hashlib.sha256(path.read_bytes()).hexdigest() == record["sha256"]


@pytest.mark.parametrize(
    ("damage", "mode", "message"),
    [
        ("truncated", "auto", r"has 5000 bytes, not the \d+ built \(truncated"),
        ("zeroed middle", "1", r"its sha256 \w+… is not the \w+… built \(corrupted\)"),
    ],
)
def test_a_damaged_library_is_built_again(tools, cache, damage, mode, message):
    """Before: SIGBUS (truncated) or SIGSEGV (zeroed middle) at the first call."""
    path = _library(cache)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:5000]
    else:
        middle = len(data) // 2
        data[middle - 8192 : middle + 8192] = bytes(16384)
    path.write_bytes(bytes(data))
    report = _probe(cache, mode, tools["copycc"])
    _check_result(report)
    assert report["loaded"]
    (warning,) = [w for w in report["warnings"] if "not loading the cached" in w]
    assert str(path) in warning and re.search(message, warning), warning
    assert _whole(path)


def test_another_library_without_a_record_is_replaced(tools, cache):
    """A file under the cached name that no build vouches for (a stale or foreign file)."""
    path = _library(cache)
    shutil.copyfile(tools["planted"], path)
    path.with_suffix(".json").unlink()
    report = _probe(cache, "auto", tools["copycc"])
    _check_result(report)
    assert report["loaded"] and _whole(path)


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_another_library_that_loads_without_the_loops(tools, cache, tmp_path, mode):
    """Before: ``AttributeError: … undefined symbol`` from every call in ``auto`` mode."""
    path = _library(cache)
    shutil.copyfile(tools["planted"], path)
    _vouch_for(path)
    report = _probe(cache, mode, tools["copycc"], PLANTED_MARKER=str(tmp_path / "ran"))
    assert not report["loaded"]
    if mode == "auto":
        _check_result(report)
        text = "\n".join(report["warnings"])
        assert "did not build or load" in text and "undefined symbol: lce_" in text, text
    else:
        assert report["error"].startswith("RuntimeError: linear_ce: LINEAR_CE_NATIVE_ROWS=1")
        assert "undefined symbol: lce_" in report["error"]


def _plant(cache: Path, planted: Path) -> None:
    path = _library(cache)
    shutil.copyfile(planted, path)
    _vouch_for(path)


@pytest.mark.parametrize(
    ("mode", "folder_mode", "message"),
    [
        ("auto", 0o1777, "is writable by its group or others (mode 0o1777)"),
        ("1", 0o770, "is writable by its group or others (mode 0o770)"),
    ],
)
def test_a_cache_others_can_write_is_refused(tools, cache, tmp_path, mode, folder_mode, message):
    """Before: the planted library was loaded (its constructor ran in the process)."""
    _plant(cache, tools["planted"])
    cache.chmod(folder_mode)
    marker = tmp_path / "ran"
    report = _probe(cache, mode, tools["copycc"], PLANTED_MARKER=str(marker))
    assert not marker.exists(), "the planted library was loaded"
    assert not report["loaded"]
    wanted = f"the cache directory {cache} {message}"
    if mode == "auto":
        _check_result(report)
        assert any(wanted in w and "mode 0700" in w for w in report["warnings"]), report
    else:
        assert report["error"].startswith("RuntimeError: linear_ce: LINEAR_CE_NATIVE_ROWS=1")
        assert wanted in report["error"]


def test_a_cached_file_others_can_write_is_built_again(tools, cache, tmp_path):
    """In a private directory, a library others could have written is not loaded."""
    _plant(cache, tools["planted"])
    path = _library(cache)
    path.chmod(0o666)
    marker = tmp_path / "ran"
    report = _probe(cache, "auto", tools["copycc"], PLANTED_MARKER=str(marker))
    assert not marker.exists() and report["loaded"]
    _check_result(report)
    assert any("file" in w and "mode 0o666" in w for w in report["warnings"]), report
    assert _whole(path) and path.stat().st_mode & 0o777 == 0o755


@pytest.mark.skipif(os.name != "posix" or os.getuid() != 0, reason="chown needs root")
def test_a_cache_of_another_user_is_refused(tools, cache, tmp_path):
    _plant(cache, tools["planted"])
    os.chown(cache, 65534, 65534)
    marker = tmp_path / "ran"
    report = _probe(cache, "auto", tools["copycc"], PLANTED_MARKER=str(marker))
    assert not marker.exists() and not report["loaded"]
    _check_result(report)
    assert any(f"{cache} belongs to uid 65534" in w for w in report["warnings"]), report


def test_the_default_cache_directory_is_private(monkeypatch, tmp_path):
    """The default directory (``$XDG_CACHE_HOME/linear_ce``) is made with mode 0700; one an
    earlier version made under a umask of 002 (mode 0775) is this user's and made private;
    a directory named by ``LINEAR_CE_CACHE_DIR`` is left as it is, and refused."""
    monkeypatch.delenv("LINEAR_CE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = environment.cache_dir()
    assert folder == tmp_path / "xdg" / "linear_ce"
    nr._private_folder(folder)
    assert folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o775)
    nr._private_folder(folder)
    assert folder.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("LINEAR_CE_CACHE_DIR", str(tmp_path / "named"))
    named = environment.cache_dir()
    named.mkdir(mode=0o775)
    named.chmod(0o775)
    with pytest.raises(RuntimeError, match=r"is writable by its group or others \(mode 0o775\)"):
        nr._private_folder(named)
    assert named.stat().st_mode & 0o777 == 0o775


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # killed, waiting for its parent (init) to reap it


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_compiler_that_never_finishes_is_stopped_with_its_children(tmp_path):
    """Before: the first call waited the build's 300 s, and the compiler's children ran on."""
    pids = tmp_path / "pids"
    hang = _script(
        tmp_path / "hangcc",
        'if [ "$1" = --version ]; then echo hangcc 1.0; exit 0; fi\n'
        f"sleep 1000 &\necho $! >> {pids}\necho $$ >> {pids}\nwait\n",
    )
    start = time.monotonic()
    report = _probe(tmp_path / "cache", "auto", hang, LINEAR_CE_BUILD_TIMEOUT="2")
    assert time.monotonic() - start < 120
    assert not report["loaded"]
    _check_result(report)
    message = f"{hang} did not finish within 2 s, so it was stopped with its process group"
    assert any(message in w for w in report["warnings"]), report
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in started if not _gone(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the compiler's processes outlived the build"
