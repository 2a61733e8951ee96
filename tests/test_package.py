"""The package as a user gets it.

``python -m build`` makes a wheel and an sdist from a copy of the sources; the wheel,
installed into a fresh virtual environment, imports, reports the version written in
pyproject.toml, ships ``py.typed``, and runs the README's quick start.

Nothing is downloaded: the build runs without isolation (the setuptools already installed),
and the fresh environment installs the wheel with ``--no-deps --no-index``. torch is the one
already installed here, made visible to the fresh environment by a ``.pth`` line, so pip never
resolves ``torch`` (which could fetch a different, CUDA, build).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_PACKAGE_FILES = ("pyproject.toml", "README.md", "src")


def _pyproject_version() -> str:
    found = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml has no version line"
    return found.group(1)


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def _run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=300, check=False, **kwargs
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and sdist built from a copy of the package's sources."""
    pytest.importorskip("build", reason="the dev extra installs build")
    source = tmp_path_factory.mktemp("source")
    for name in _PACKAGE_FILES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, source)
    return out


def test_wheel_and_sdist_contents(dist):
    version = _pyproject_version()
    (wheel,) = dist.glob(f"linear_ce-{version}-py3-none-any.whl")
    (sdist,) = dist.glob(f"linear_ce-{version}.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    assert "linear_ce/py.typed" in names
    assert "linear_ce/bench/__main__.py" in names
    assert all(n.startswith(("linear_ce/", f"linear_ce-{version}.dist-info/")) for n in names)
    with tarfile.open(sdist) as archive:
        members = {m.split("/", 1)[1] for m in archive.getnames() if "/" in m}
    assert {"pyproject.toml", "README.md", "src/linear_ce/py.typed"} <= members


@pytest.mark.slow
def test_wheel_runs_the_quick_start_in_a_fresh_environment(dist, tmp_path):
    (wheel,) = dist.glob("*.whl")
    # Nothing of the source tree on the path: a PYTHONPATH to src/ (and an egg-info an
    # editable install left there) would make pip think the package is already installed.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = tmp_path / "env"
    _run(sys.executable, "-m", "venv", env)
    python = env / ("Scripts" if os.name == "nt" else "bin") / "python"
    site = _run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", env=clean
    )
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel, env=clean)
    # After the install, so pip never sees what the outer environment has installed.
    torch_site = Path(torch.__file__).resolve().parent.parent
    Path(site.stdout.strip(), "outer_torch.pth").write_text(f"{torch_site}\n")

    check = f"""
import importlib.resources
import linear_ce

assert linear_ce.__file__.startswith({str(env)!r}), linear_ce.__file__
assert linear_ce.__version__ == {_pyproject_version()!r}, linear_ce.__version__
assert (importlib.resources.files("linear_ce") / "py.typed").is_file()
"""
    _run(python, "-c", check + _quick_start(), cwd=tmp_path, env=clean)
