"""Every public name has a docstring with an example, and every example runs as written."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest
import torch

import dispatch_amp
import dispatch_amp.fp8
import dispatch_amp.kernels

MODULES = sorted(
    [m.name for m in pkgutil.iter_modules(dispatch_amp.__path__, "dispatch_amp.")]
    + [m.name for m in pkgutil.iter_modules(dispatch_amp.kernels.__path__, "dispatch_amp.kernels.")]
    + [m.name for m in pkgutil.iter_modules(dispatch_amp.fp8.__path__, "dispatch_amp.fp8.")]
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs={"torch": torch, **vars(module)}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed (output above)"


@pytest.mark.parametrize("package", [dispatch_amp, dispatch_amp.kernels, dispatch_amp.fp8], ids=lambda p: p.__name__)
def test_public_names_have_an_example(package):
    missing = []
    for name in package.__all__:
        doc = inspect.getdoc(getattr(package, name)) or ""
        if ">>>" not in doc and "Example" not in doc:
            missing.append(name)
    assert not missing, f"public names without an example in their docstring: {missing}"
