"""The package's modules form a tree: no module imports one that imports it.

Every ``from . import`` / ``from .x import`` counts, inside functions and under
``TYPE_CHECKING`` too: a circle that only a type hint or a late import closes still ties
the modules together, and the next top-level import turns it into an ImportError.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "dispatch_amp"


def _module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(package_dir: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    modules = {_module_name(p, package_dir): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = package.split(".") if package else []
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                for candidate in (f"{target}.{alias.name}".strip("."), target):
                    if candidate in graph and candidate != name:
                        graph[name].add(candidate)
                        break
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, path = [], {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for child in sorted(graph[module]):
            if state.get(child) == "open":
                found.append(path[path.index(child):] + [child])
            elif child not in state:
                visit(child)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        # The package's __init__ imports the public modules: it sits above all of them.
        if module and module not in state:
            visit(module)
    return found


def test_no_module_imports_one_that_imports_it():
    circles = _circles({m: {c for c in cs if c} for m, cs in _imports().items()})
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_walker_sees_late_and_type_hint_imports(tmp_path):
    (tmp_path / "__init__.py").write_text("from .low import x\n")
    (tmp_path / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import Y\nx = 1\n")
    (tmp_path / "high.py").write_text("def f():\n    from . import low\n    return low.x\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "sub" / "leaf.py").write_text("from ..low import x\n")
    graph = _imports(tmp_path)
    assert graph["low"] == {"high"} and graph["high"] == {"low"} and graph["sub.leaf"] == {"low"}
    assert _circles(graph) == [["high", "low", "high"]]
