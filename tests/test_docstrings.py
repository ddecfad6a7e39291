"""Every public name has a docstring with an example, and every example runs as written."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pathlib
import pkgutil

import pytest
import torch

import dispatch_amp
import dispatch_amp.fp8
import dispatch_amp.kernels

# The package's parts (``dispatch_amp.autocast`` is the public context: the subpackage of
# that name is reached through sys.modules). Integrations have their own docstring test.
PARTS = [importlib.import_module(f"dispatch_amp.{part}") for part in ("autocast", "scaler", "diagnostics")]
SOURCE = pathlib.Path(dispatch_amp.__file__).parent
# Every module and subpackage of the package (walk_packages finds subpackages through
# sys.modules, so the autocast subpackage too), and the kernels, which live outside it.
MODULES = sorted(
    [m.name for m in pkgutil.walk_packages(dispatch_amp.__path__, "dispatch_amp.") if not m.name.startswith("dispatch_amp.integrations.")]
    + [m.name for m in pkgutil.iter_modules(dispatch_amp.kernels.__path__, "dispatch_amp.kernels.")]
)


def _module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(("dispatch_amp",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def test_every_source_file_is_doctested():
    # A module added to any part, or a new part, is collected without editing this file.
    names = {_module_of(p) for p in SOURCE.rglob("*.py")} - {"dispatch_amp"}
    expected = {n for n in names if not n.startswith("dispatch_amp.integrations.")}
    assert expected <= set(MODULES), f"not doctested: {sorted(expected - set(MODULES))}"
    assert {"dispatch_amp.autocast.policy", "dispatch_amp.scaler.grad_scaler", "dispatch_amp.diagnostics.census"} <= expected


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs={"torch": torch, **vars(module)}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed (output above)"


@pytest.mark.parametrize("package", [dispatch_amp, dispatch_amp.kernels, dispatch_amp.fp8, *PARTS], ids=lambda p: p.__name__)
def test_public_names_have_an_example(package):
    missing = []
    for name in package.__all__:
        doc = inspect.getdoc(getattr(package, name)) or ""
        if ">>>" not in doc and "Example" not in doc:
            missing.append(name)
    assert not missing, f"public names without an example in their docstring: {missing}"
