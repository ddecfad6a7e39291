"""No private method of a recipe, its scaling rule or its state is called outside the module
that defines it: other code goes through their public names (``recipe.state.site(w)``,
``rule.choose(...)``), so a recipe's insides can change without reaching into the
engine, the gemms or the integrations."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "dispatch_amp"
# The modules whose classes make up a recipe: the description, its rule, its state.
OWNERS = ("fp8/recipes.py", "fp8/_scaling.py", "fp8/_state.py")


def _private_methods(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("_")
                        and not item.name.startswith("__")):
                    names.add(item.name)
    return names


def _calls(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of every call of one of ``names`` as an attribute of an object other
    than ``self``/``cls`` (a class calling its own methods)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
            receiver = node.func.value
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                continue
            found.append((node.lineno, node.func.attr))
    return found


def test_the_checker_finds_a_private_call():
    names = _private_methods(SRC / "fp8" / "recipes.py") | {"_prepare"}
    assert _calls("recipe._prepare(site, device)\nself._prepare(site)\n", names) == [(1, "_prepare")]


def test_no_private_recipe_method_is_called_outside_its_module():
    owners = {rel: _private_methods(SRC / rel) for rel in OWNERS}
    assert any(owners.values()), owners  # the recipe classes do have private methods to guard
    violations = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        foreign = set().union(*(names for owner, names in owners.items() if owner != rel))
        violations += [f"{rel}:{line}: .{name}()" for line, name in _calls(path.read_text(), foreign)]
    assert not violations, "private recipe methods called from other modules:\n" + "\n".join(violations)


def _recipe_receiver(node: ast.expr) -> bool:
    # ``recipe``, ``meta.recipe``, ``self.recipe``, ``recipe.state``, ``recipe.rule``, ``owner.rule``...
    if isinstance(node, ast.Name):
        return node.id in ("recipe", "owner", "rule")
    return isinstance(node, ast.Attribute) and node.attr in ("recipe", "state", "rule") and (
        node.attr != "state" or _recipe_receiver(node.value))


def _private_calls_on_recipes(source: str) -> list[tuple[int, str]]:
    return [(node.lineno, node.func.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr.startswith("_") and not node.func.attr.startswith("__")
            and _recipe_receiver(node.func.value)]


def test_the_receiver_check_finds_private_calls_on_a_recipe_however_reached():
    source = "recipe._site(w)\nmeta.recipe._quantize_rows(t)\nrecipe.state._named_state()\nx._y()\n"
    assert [line for line, _ in _private_calls_on_recipes(source)] == [1, 2, 3]


def test_no_private_method_is_called_on_a_recipe_its_rule_or_its_state_outside_their_modules():
    violations = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in OWNERS:
            continue
        violations += [f"{rel}:{line}: .{name}()" for line, name in _private_calls_on_recipes(path.read_text())]
    assert not violations, "private calls on recipes from other modules:\n" + "\n".join(violations)
