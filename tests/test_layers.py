"""The package's layers (docs/architecture.md): every import points down, none runs in a circle.

Each module of ``src/linear_ce`` belongs to a unit (a folder, or a top-level module); the
table says which other units each may import. The imports are read from the source
(``ast``, every ``import`` statement, inside functions too), independently of the
package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "linear_ce"

_PUBLIC = {"ops", "parallel", "losses", "checks", "engine", "options", "outputs"}
#: What each unit may import besides itself (docs/architecture.md, "What each layer ...").
ALLOWED = {
    "options": set(),
    "outputs": set(),
    "engine": {"options"},
    "checks": {"engine", "options"},
    "losses": {"engine", "checks"},
    "parallel": {"engine", "checks"},
    "ops": {"losses", "engine", "checks", "options"},
    "objectives": {"losses"},
    "functional": _PUBLIC,
    "token_logprobs": _PUBLIC,
    "token_objective": _PUBLIC,
    "divergence": _PUBLIC,
    "sequence_objective": _PUBLIC,
    "sparse_divergence": _PUBLIC,
    "reference": {"checks", "engine", "outputs"},
    "memory": {"engine"},
    "module": {"functional", "options", "outputs"},
    # What is not a head: the vocab-parallel layout (the heads take it as an argument).
    "distributed": {"parallel"},
}
#: Units above every other: they may import anything below them.
TOP = {"__init__", "integrations", "bench"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(path: Path) -> set[str]:
    """The ``linear_ce`` modules ``path`` imports (a name imported from a package counts
    as its submodule where one of that name exists)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "linear_ce"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "linear_ce":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (SRC.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    SRC.parent / Path(*sub.split("."))
                ).is_dir()
                found.add(sub if is_module else node.module)
    return found


MODULES = {_module_name(p): _imports(p) for p in sorted(SRC.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    unit = _unit(module)
    if unit in TOP:
        return
    assert unit in ALLOWED, f"{module}: unit {unit!r} has no row in ALLOWED"
    wrong = sorted(
        imported
        for imported in MODULES[module]
        if _unit(imported) != unit and _unit(imported) not in ALLOWED[unit]
    )
    assert not wrong, f"{module} imports {wrong}; {unit} may import {sorted(ALLOWED[unit])}"


def test_no_unit_imports_a_top_unit():
    wrong = sorted(
        (module, imported)
        for module, imports in MODULES.items()
        if _unit(module) not in TOP
        for imported in imports
        if _unit(imported) in TOP and imported != "linear_ce"
    )
    assert not wrong


def test_no_circle_of_imports():
    """No module reaches itself through the imports (between modules, not only units)."""
    graph = {m: {i for i in imports if i in MODULES and i != m} for m, imports in MODULES.items()}
    # A package's modules import "linear_ce" only as a namespace; it is no edge.
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if nxt == "linear_ce":
                continue
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*path[path.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
