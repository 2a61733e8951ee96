"""mkdocs hooks for the docs site (mkdocs.yml, ``make docs``).

- The front page is README.md, the reference a page per public name: every name in
  ``linear_ce.__all__`` (a module among them, such as ``linear_ce.objectives``, gets a page per
  name of its own ``__all__``), ``linear_ce.distributed`` and each ``linear_ce.integrations``
  module, read from the source's ``__all__`` lists, so a name added or removed there is added or
  removed here. ``reference/index.md`` lists them with their first docstring line.
- A link from a page to a file outside docs/ (an example script, the source) is written as the
  file's path: the site holds only docs/, and a link out of it would be a broken link.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
_OUTSIDE = re.compile(r"\[([^\]]+)\]\((\.\./[^)#\s]+)(#[^)]*)?\)")


def _exports(module: str) -> list[str]:
    """The ``__all__`` list of ``module``, read from its source without importing it."""
    path = SRC / module.replace(".", "/")
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{path} has no __all__ list; every public module needs one")


def _submodules(package: str) -> set[str]:
    """The names ``package``'s ``__init__`` binds to its submodules (``from linear_ce import
    objectives``), as opposed to functions imported from a module of the same name."""
    source = (SRC / package.replace(".", "/") / "__init__.py").read_text()
    return {
        alias.asname or alias.name
        for node in ast.parse(source).body
        if isinstance(node, ast.ImportFrom) and node.module == package
        for alias in node.names
    }


def public_names() -> list[tuple[str, str]]:
    """``(identifier, section)`` of every name with a reference page, in page order."""
    names, modules = [], _submodules("linear_ce")
    for name in _exports("linear_ce"):
        if name in modules:
            names += [
                (f"linear_ce.{name}.{n}", f"linear_ce.{name}")
                for n in _exports(f"linear_ce.{name}")
            ]
        else:
            names.append((f"linear_ce.{name}", "linear_ce"))
    names += [
        (f"linear_ce.distributed.{n}", "linear_ce.distributed")
        for n in _exports("linear_ce.distributed")
    ]
    for path in sorted((SRC / "linear_ce" / "integrations").glob("[!_]*.py")):
        module = f"linear_ce.integrations.{path.stem}"
        names += [(f"{module}.{n}", module) for n in _exports(module)]
    return names


def rendered(identifier: str) -> str:
    """The object a page renders: ``identifier``, or for a function that ``linear_ce``
    imports from a module of its own name (``linear_ce.token_objective``, which griffe reads
    as that module), the function itself (``linear_ce.token_objective.token_objective``)."""
    package, _, name = identifier.rpartition(".")
    module = f"{package}.{name}"
    own_module = package == "linear_ce" and (SRC / "linear_ce" / f"{name}.py").exists()
    return f"{module}.{name}" if own_module and name in _exports(module) else identifier


def _summary(identifier: str) -> str:
    """The first line of ``identifier``'s docstring (static, like the pages)."""
    import griffe

    try:
        docstring = _package()[identifier.removeprefix("linear_ce.")].docstring
    except (KeyError, griffe.AliasResolutionError):
        return ""
    first = docstring.value.strip().split("\n\n", 1)[0].replace("\n", " ") if docstring else ""
    return re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", first).replace("|", "\\|")


@functools.cache
def _package():
    """The package as griffe reads it, loaded once per build."""
    import griffe

    return griffe.load("linear_ce", search_paths=[str(SRC)])


def _outside(match: re.Match) -> str:
    return f"{match.group(1)} (`{match.group(2).removeprefix('../')}` in the repository)"


def on_files(files, config):
    from mkdocs.structure.files import File

    readme = (ROOT / "README.md").read_text()
    readme = re.sub(r"\]\(docs/", "](", readme)
    readme = re.sub(r"\[([^\]]+)\]\((?!https?:|#)([^)#\s]+)(#[^)]*)?\)", _readme_link, readme)
    files.append(File.generated(config, "index.md", content=readme))
    rows, section = ["# API reference", ""], None
    for identifier, module in public_names():
        if module != section:
            rows += ["", f"## `{module}`", "", "| name | summary |", "|---|---|"]
            section = module
        rows.append(
            f"| [`{identifier.rsplit('.', 1)[-1]}`]({identifier}.md) "
            f"| {_summary(rendered(identifier))} |"
        )
        options = "\n    options:\n      show_root_heading: true\n      show_root_full_path: true\n"
        files.append(
            File.generated(
                config,
                f"reference/{identifier}.md",
                content=f"::: {rendered(identifier)}{options}",
            )
        )
    files.append(File.generated(config, "reference/index.md", content="\n".join(rows) + "\n"))
    return files


def _readme_link(match: re.Match) -> str:
    """A README link as the site's front page sees it: docs/ pages stay links, other files
    (the examples, the changelog) become their paths."""
    text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
    if (ROOT / "docs" / target).exists():
        return f"[{text}]({target}{anchor})"
    return f"{text} (`{target}` in the repository)"


def on_page_markdown(markdown, page, config, files):
    return _OUTSIDE.sub(_outside, markdown)
