"""The documentation stays true: every Python block of README.md and docs/*.md runs.

The blocks of one page run in order in one namespace, so a page can build its inputs once
and use them in later blocks; each page gets a fresh namespace. All pages run in one child
Python process (torch is imported once), never in the test process itself. The blocks check themselves
(``assert``, ``torch.testing.assert_close`` against the plain expression): a block that
stops working, or whose result stops matching, fails here.

Two marker comments, as a block's first line, are understood:

- ``# doc-test: skip (<why>)``: not run (it needs several processes or a GPU);
- ``# doc-test: needs <module>``: run only when ``<module>`` is installed.

Relative links in the pages must point at files that exist, and the README links every page.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_SKIP = re.compile(r"# doc-test: skip \((.+)\)")
_NEEDS = re.compile(r"# doc-test: needs (\w+)")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")

# Runs in the child: each page's blocks in a fresh namespace, their code named after the page
# (and padded to its line numbers) so a traceback points into the markdown. Writes, per page,
# the traceback of its first failing block or None.
_RUNNER = """
import json, sys, traceback
failures = {}
for page, blocks in json.load(sys.stdin).items():
    namespace = {"__name__": "__doc_page__"}
    failures[page] = None
    try:
        for source in blocks:
            exec(compile(source, page, "exec"), namespace)
    except BaseException:
        failures[page] = traceback.format_exc()
with open(sys.argv[1], "w") as out:
    json.dump(failures, out)
"""


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, source)`` of each Python block; ``line`` is the first line of its code."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def _runnable(page: Path) -> list[str]:
    """The sources of the blocks to run, padded to their line numbers; skips the marked ones."""
    out = []
    for line, source in _blocks(page):
        first = source.split("\n", 1)[0]
        if _SKIP.match(first):
            continue
        needs = _NEEDS.match(first)
        if needs and importlib.util.find_spec(needs.group(1)) is None:
            continue
        # Pad with blank lines so the line numbers in a traceback are the page's own.
        out.append("\n" * (line - 1) + source)
    return out


def test_readme_links_every_page():
    linked = {Path(target).name for target in _LINK.findall(PAGES[0].read_text())}
    unlinked = [page.name for page in PAGES[1:] if page.name not in linked]
    assert not unlinked, f"README.md does not link to docs/{unlinked}"


@pytest.fixture(scope="module")
def failures(tmp_path_factory) -> dict[str, str | None]:
    """Every page's blocks, run in one child process: page name -> traceback or None."""
    out = tmp_path_factory.mktemp("docs") / "failures.json"
    pages = {_name(page): _runnable(page) for page in PAGES}
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(out)],
        input=json.dumps({name: blocks for name, blocks in pages.items() if blocks}),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"the documentation runner died:\n{done.stderr}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(page, failures):
    if _name(page) not in failures:
        pytest.skip(f"every Python block of {_name(page)} is marked skip or needs a missing module")
    assert failures[_name(page)] is None, (
        f"a Python block of {_name(page)} failed:\n{failures[_name(page)]}"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_skip_markers_say_why(page):
    for line, source in _blocks(page):
        first = source.split("\n", 1)[0]
        if first.startswith("# doc-test:"):
            assert _SKIP.match(first) or _NEEDS.match(first), (
                f"{page.name}:{line}: unknown marker {first!r}; use "
                "'# doc-test: skip (<why>)' or '# doc-test: needs <module>'"
            )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_exist(page):
    for target in _LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
