"""Every docstring example in dispatch_amp.integrations runs, and every public name has one.

tests/test_docstrings.py covers the top-level modules only; these submodules need their
framework, which CI installs with the 'integrations' extra.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pkgutil

import pytest
import torch

import dispatch_amp.integrations

MODULES = {
    m.name: m.name.rsplit(".", 1)[-1]
    for m in pkgutil.iter_modules(dispatch_amp.integrations.__path__, "dispatch_amp.integrations.")
}
NEEDS = {"lightning": "lightning", "fabric": "lightning", "accelerate": "accelerate", "transformers": "transformers"}


def _import(name: str):
    need = NEEDS.get(MODULES[name])
    if need:
        pytest.importorskip(need)
    return importlib.import_module(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    module = _import(name)
    monkeypatch.chdir(tmp_path)  # examples may name output folders
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs={"torch": torch, **vars(module)}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.rsplit(".", 1)[-1].startswith("_")))
def test_public_names_have_an_example(name):
    module = _import(name)
    missing = [n for n in module.__all__ if ">>>" not in (inspect.getdoc(getattr(module, n)) or "")]
    assert not missing, f"public names of {name} without an example: {missing}"


def test_every_framework_module_names_its_framework():
    # A new integration module must say which framework it imports, or a missing framework
    # would fail here instead of skipping for users without the extra.
    assert set(MODULES.values()) - {"_modes", "_half", "_precision_flags", "_fp8_state", "_plan_state", "_policy_state", "timm_scaler",
                                  "metrics"} <= set(NEEDS)
    assert os.path.basename(dispatch_amp.integrations.__file__) == "__init__.py"
