"""The package's modules form a tree: no module imports one that imports it.

Every ``from . import`` / ``from .x import`` counts, and every absolute import of the
package's own modules (``import dispatch_amp.scaler.config``), inside functions and under
``TYPE_CHECKING`` too: a circle that only a type hint or a late import closes still ties
the modules together, and the next top-level import turns it into an ImportError.

Importing ``autocast.context`` from outside ``autocast/`` runs ``autocast/__init__.py``
first, so it counts as importing that package too. The parts (the subpackages and the
top-level modules) form layers as well: no part imports a part that imports it.
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


def _within(module: str, root: str) -> str | None:
    """``module``'s name inside the package ``root`` ("" for the root), or None outside it."""
    if module == root:
        return ""
    return module[len(root) + 1:] if module.startswith(root + ".") else None


def _imports(package_dir: pathlib.Path = PACKAGE, root: str = "dispatch_amp") -> dict[str, set[str]]:
    modules = {_module_name(p, package_dir): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                # ``import dispatch_amp.scaler.config`` runs every package above it too.
                for alias in node.names:
                    target = _within(alias.name, root)
                    if target and target in graph and target != name:
                        graph[name].add(target)
                        graph[name].update(p for p in _packages_above(target) - _packages_above(name) - {name} if p in graph)
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0:
                # An absolute import of one of the package's own modules counts like a relative one.
                target = _within(node.module or "", root)
                if target is None:
                    continue
            else:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                for candidate in (f"{target}.{alias.name}".strip("."), target):
                    if candidate in graph and candidate != name:
                        graph[name].add(candidate)
                        graph[name].update(p for p in _packages_above(candidate) - _packages_above(name) - {name} if p in graph)
                        break
    return graph


def _packages_above(module: str) -> set[str]:
    """The packages whose ``__init__`` runs before ``module`` does (the root excluded)."""
    parts = module.split(".")
    return {".".join(parts[:k]) for k in range(1, len(parts))}


def _parts(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's parts: its subpackages and top-level modules."""
    parts: dict[str, set[str]] = {}
    for module, imported in graph.items():
        if module:
            part = module.split(".")[0]
            parts.setdefault(part, set()).update(c.split(".")[0] for c in imported if c and c.split(".")[0] != part)
    return parts


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


def test_no_part_imports_a_part_that_imports_it():
    parts = _parts(_imports())
    assert {"autocast", "scaler", "diagnostics", "fp8", "integrations"} <= set(parts)
    circles = _circles(parts)
    assert not circles, "circles between parts: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_walker_sees_late_and_type_hint_imports(tmp_path):
    (tmp_path / "__init__.py").write_text("from .low import x\n")
    (tmp_path / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import Y\nx = 1\n")
    (tmp_path / "high.py").write_text("def f():\n    from . import low\n    return low.x\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "sub" / "leaf.py").write_text("from ..low import x\n")
    # Absolute imports of the package's own modules count too; other packages' do not.
    (tmp_path / "sub" / "absolute.py").write_text(
        "import os.path\nimport pkg.high\nfrom pkg.sub import leaf\nfrom pkgother import low\n")
    graph = _imports(tmp_path, root="pkg")
    assert graph["low"] == {"high"} and graph["high"] == {"low"} and graph["sub.leaf"] == {"low"}
    assert graph["sub.absolute"] == {"high", "sub.leaf"}
    assert _circles(graph) == [["high", "low", "high"]]


def test_the_walker_counts_the_packages_a_module_import_runs(tmp_path):
    # a.inner imports b.leaf, which runs b/__init__ (which imports a.other): a circle
    # between the parts, and between the modules too once b/__init__ counts.
    for package in ("a", "b"):
        (tmp_path / package).mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a" / "__init__.py").write_text("from .inner import x\n")
    (tmp_path / "a" / "inner.py").write_text("from ..b.leaf import y\nx = y\n")
    (tmp_path / "a" / "other.py").write_text("z = 1\n")
    (tmp_path / "b" / "__init__.py").write_text("from ..a.other import z\n")
    (tmp_path / "b" / "leaf.py").write_text("from . import sibling\ny = 1\n")
    (tmp_path / "b" / "sibling.py").write_text("")
    graph = _imports(tmp_path)
    # A sibling import runs no package __init__ that has not run already.
    assert graph["b.leaf"] == {"b.sibling"}
    assert graph["a.inner"] == {"b.leaf", "b"} and graph["b"] == {"a.other", "a"}
    assert _parts(graph) == {"a": {"b"}, "b": {"a"}}
    assert _circles(_parts(graph)) == [["a", "b", "a"]]
    assert _circles({m: {c for c in cs if c} for m, cs in graph.items()}) == [["a", "a.inner", "b", "a"]]
