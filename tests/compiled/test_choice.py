"""DISPATCH_AMP_ENGINE and dispatch_amp.engine(): which engine runs, decided in one place."""

from __future__ import annotations

import pytest

import dispatch_amp as amp
from dispatch_amp import CompiledEngineWarning
from dispatch_amp._compiled import choice, loader


@pytest.mark.parametrize("value, setting", [
    (None, "default"), ("", "default"), ("  ", "default"),
    ("python", "python"), ("compiled", "compiled"), (" Compiled\n", "compiled"), ("PYTHON", "python"),
])
def test_the_setting_is_read_from_the_environment(monkeypatch, value, setting):
    if value is None:
        monkeypatch.delenv(choice.ENV, raising=False)
    else:
        monkeypatch.setenv(choice.ENV, value)
    assert choice.engine_setting() == setting


@pytest.mark.parametrize("value", ["c++", "native", "1", "py", "compiled,python"])
def test_another_value_raises_naming_the_allowed_ones(monkeypatch, value):
    monkeypatch.setenv(choice.ENV, value)
    with pytest.raises(ValueError) as info:
        choice.engine_setting()
    message = str(info.value)
    assert repr(value) in message and "DISPATCH_AMP_ENGINE=python" in message
    assert "DISPATCH_AMP_ENGINE=compiled" in message and "unset" in message
    with pytest.raises(ValueError):
        amp.engine()


def _loader_that_must_not_run(monkeypatch):
    def refuse(**kwargs):
        raise AssertionError("the compiled engine was loaded")

    monkeypatch.setattr(loader, "load", refuse)


def test_python_never_builds(monkeypatch):
    monkeypatch.setenv(choice.ENV, "python")
    _loader_that_must_not_run(monkeypatch)
    assert choice.compiled_module() is None and amp.engine() == "python"


def test_compiled_that_cannot_build_raises_naming_the_cause_and_the_way_back(tmp_path, monkeypatch):
    monkeypatch.setenv(choice.ENV, "compiled")
    monkeypatch.setenv("CXX", "/nonexistent")
    monkeypatch.setattr(loader, "PROCESS_LOADER", loader.Loader(root=tmp_path))
    with pytest.raises(loader.CompiledEngineError) as info:
        amp.engine()
    message = str(info.value)
    assert message.startswith("DISPATCH_AMP_ENGINE=compiled: ") and "'/nonexistent' (from CXX)" in message
    assert "Fix: install g++" in message and "unset DISPATCH_AMP_ENGINE" in message


def test_the_default_falls_back_to_python_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.delenv(choice.ENV, raising=False)
    monkeypatch.setenv("CXX", "/nonexistent")
    monkeypatch.setattr(loader, "PROCESS_LOADER", loader.Loader(root=tmp_path))
    with pytest.warns(CompiledEngineWarning) as record:
        assert amp.engine() == "python" and amp.engine() == "python"
    assert len(record) == 1


@pytest.mark.parametrize("setting", [None, "compiled"])
def test_a_loaded_module_is_the_compiled_engine(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv(choice.ENV, raising=False)
    else:
        monkeypatch.setenv(choice.ENV, setting)
    module = object()
    asked = []
    monkeypatch.setattr(loader, "load", lambda **kwargs: asked.append(kwargs) or module)
    assert choice.compiled_module() is module and amp.engine() == "compiled"
    assert asked[0].get("required", False) is (setting == "compiled")
