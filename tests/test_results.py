"""The results store (results/runs.jsonl) and the docs drawn from it.

Every stored run reads back as the bench wrote it, every table between ``results:`` markers
in README.md and docs/*.md is what ``scripts/results.py render`` draws from the store (so a
number in the docs can be traced to a stored run), and the docs stay a reference: no table
cell longer than 300 characters, no commit hash and no issue number in docs/.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("results", ROOT / "scripts" / "results.py")
results = importlib.util.module_from_spec(_SPEC)
sys.modules["results"] = results
_SPEC.loader.exec_module(results)

DOCS = sorted((ROOT / "docs").glob("*.md"))
# A word of 7 to 40 hex digits with a digit and a letter: git's abbreviated or full hash.
_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
_ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def test_every_run_reads_back_as_the_bench_wrote_it(tmp_path):
    from linear_ce.bench import report

    runs = results.load()
    assert runs, "the store is empty"
    labels = {run["cpu_label"] for run in runs}
    heads = [run["cpu_label"] for run in runs if run["headline"]]
    assert sorted(heads) == sorted(labels), "each CPU needs exactly one headline run"
    for run in runs:
        out = tmp_path / f"{run['id']}.json"
        assert results.main(["export", run["id"], str(out)]) == 0
        meta, summaries = report.read_json(out)
        assert meta["machine"] == run["machine"] and len(summaries) == len(run["points"])


def test_the_store_refuses_a_repeated_id(tmp_path):
    line = (ROOT / "results" / "runs.jsonl").read_text().splitlines()[0]
    store = tmp_path / "runs.jsonl"
    store.write_text(line + "\n" + line + "\n")
    with pytest.raises(ValueError, match="already in the store"):
        results.load(store)


def test_committed_tables_match_the_store():
    assert not results.stale(results.load()), (
        "a results table differs from results/runs.jsonl: run `python scripts/results.py render`"
    )


def test_the_markers_draw_tables():
    text = "a\n<!-- results:run zen5-targets-3 -->\nold\n<!-- /results:run -->\nb\n"
    drawn = results.rendered(text, results.load())
    assert "| N=2048 D=1024 V=32768 fp32 | floor |" in drawn and "old" not in drawn
    with pytest.raises(ValueError, match="no run 'nope'"):
        results.rendered(text.replace("zen5-targets-3", "nope"), results.load())


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_are_a_reference(page):
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("|"):
            longest = max(len(cell.strip()) for cell in line.strip("|").split("|"))
            assert longest <= 300, f"{page.name}:{number}: a table cell of {longest} characters"
        assert not _HASH.search(line), f"{page.name}:{number}: a commit hash: {line.strip()}"
        assert not _ISSUE.search(line), f"{page.name}:{number}: an issue number: {line.strip()}"
