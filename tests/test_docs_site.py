"""The docs site's inputs (mkdocs.yml; the build itself is ``make docs``, run by CI).

Every public name has a reference page, and the docstrings' Sphinx roles become the Markdown
the site renders: links where the target has a page, code elsewhere, ``$...$`` for math.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import griffe_roles  # noqa: E402
import mkdocs_hooks  # noqa: E402


def _public(module: str) -> set[str]:
    """``module``'s public names, from the imported module (not from its source)."""
    return {f"{module}.{name}" for name in importlib.import_module(module).__all__}


def test_every_public_name_has_a_page():
    import linear_ce

    expected = set()
    for name in linear_ce.__all__:
        value = getattr(linear_ce, name)
        is_module = type(value) is type(linear_ce)
        expected |= _public(f"linear_ce.{name}") if is_module else {f"linear_ce.{name}"}
    expected |= _public("linear_ce.distributed") | _public("linear_ce.integrations.transformers")
    pytest.importorskip("trl")
    expected |= _public("linear_ce.integrations.trl")
    pages = {identifier for identifier, _ in mkdocs_hooks.public_names()}
    assert expected <= pages, f"public names without a page: {sorted(expected - pages)}"
    assert "linear_ce.objectives" not in pages, "a module's names get pages, not the module"


def test_roles_become_markdown():
    pages = ["linear_ce.token_logprobs", "linear_ce.reference.linear_cross_entropy"]
    text = (
        "Args:\n    a, b,\n    c: as in :func:`linear_ce.token_logprobs`.\n\n"
        "Uses :math:`e^u`, :class:`torch.Tensor` and :func:`~linear_ce.reference.linear_cross_entropy`."
        "\n\n.. math::\n\n    x = 1\n\nExample::\n\n    f()\n"
    )
    out = griffe_roles.markdown(text, pages)
    link = "[`linear_ce.token_logprobs()`][linear_ce.token_logprobs]"
    assert out.count(link) == 3, out  # one line per parameter of "a, b, c:"
    assert "    a: as in" in out and "    c: as in" in out
    assert "$e^u$" in out and "`torch.Tensor`" in out and "[`torch" not in out
    assert "[`linear_cross_entropy()`][linear_ce.reference.linear_cross_entropy]" in out
    assert "$$\nx = 1\n$$" in out and "For example:" in out and "::" not in out
