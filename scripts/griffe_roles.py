"""A griffe extension for the docs site (mkdocs.yml): the docstrings' Sphinx roles as Markdown.

The docstrings are written as torch's are (Google-style sections, reStructuredText roles), and
stay so for ``help()`` and IDEs; the site converts them when it reads them, so no source changes:

- ``:math:`x``` becomes ``$x$`` and a ``.. math::`` block ``$$ ... $$`` (pymdownx.arithmatex);
- ``:func:`linear_ce.x``` (also ``:class:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``,
  with or without ``~``) becomes a link where ``x`` has a page on the site (the reference pages
  come from the ``__all__`` lists, scripts/mkdocs_hooks.py) and inline code elsewhere: a link to a
  name without a page would be a broken link, which ``mkdocs build --strict`` refuses;
- an argument line naming several parameters (``a, b: as in f``) becomes one line each, the
  form griffe's Google parser reads;
- a paragraph ending in ``::`` (reStructuredText's literal block) ends in ``:``, and
  ``Example::`` reads "For example:" (``Example:`` alone would start a Google section).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import griffe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mkdocs_hooks import public_names, rendered

_ROLE = re.compile(r":(func|class|meth|mod|attr|data|obj|exc):`(~?)([^`]+)`")
_MATH = re.compile(r":math:`([^`]+)`")
# "    a, b,\n    c: text" in an Args section: several parameters sharing one description.
_SHARED = re.compile(r"^( +)(\w+(?:,\s*\w+)+)\s*:(.*)$", re.M)
_BLOCK = re.compile(r"^( *)\.\. math::\n\n?((?:\1 +.*\n|\n)+)", re.M)


def _target(name: str, pages: list[str]) -> str | None:
    """The page identifier a role's ``name`` refers to, or ``None`` where it has none."""
    if name in pages:
        return name
    tail = name.rsplit(".", 1)[-1]
    candidates = [page for page in pages if page.rsplit(".", 1)[-1] == tail]
    if not name.startswith("linear_ce") and "." in name:
        return None
    if len(candidates) == 1:
        return candidates[0]
    # Two public names alike (linear_ce.linear_cross_entropy and the reference's): the one
    # whose path shares the longest prefix with the role's.
    shared = [(len(_common(page, name)), page) for page in candidates]
    return max(shared)[1] if shared else None


def _common(a: str, b: str) -> str:
    out = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def _block(match: re.Match) -> str:
    indent, body = match.group(1), match.group(2)
    lines = [line.strip() for line in body.rstrip("\n").split("\n")]
    return f"{indent}$$\n" + "".join(f"{indent}{line}\n" for line in lines) + f"{indent}$$\n\n"


def markdown(text: str, pages: list[str]) -> str:
    """``text`` (a docstring) with its roles and literal-block markers as Markdown."""

    def role(match: re.Match) -> str:
        kind, short, name = match.groups()
        name = name.strip()
        shown = name.rsplit(".", 1)[-1] if short else name
        shown += "()" if kind in ("func", "meth") and not shown.endswith(")") else ""
        target = _target(name.rstrip("()"), pages) if kind != "attr" else None
        return f"[`{shown}`][{target}]" if target else f"`{shown}`"

    text = re.sub(r"^( +\w+(?:, *\w+)*,) *\n +(?=\w)", r"\1 ", text, flags=re.M)
    text = _SHARED.sub(
        lambda m: "\n".join(f"{m.group(1)}{n.strip()}:{m.group(3)}" for n in m.group(2).split(",")),
        text,
    )
    text = _BLOCK.sub(_block, text + "\n").rstrip("\n")
    text = _MATH.sub(lambda m: f"${m.group(1)}$", text)
    text = _ROLE.sub(role, text)
    text = re.sub(r"^(\s*)Examples?::$", r"\1For example:", text, flags=re.M)
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.M)


class SphinxRoles(griffe.Extension):
    """Rewrites each docstring as it is loaded (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.pages = [rendered(name) for name, _ in public_names()]

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value, self.pages)
