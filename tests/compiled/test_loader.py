"""load(): once per process, thread-safe; a build said in one line, a failure in one
warning, never retried; nothing built at import."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings

import pytest

from dispatch_amp import CompiledEngineWarning
from dispatch_amp._compiled import build, loader


def _no_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent")


def _counting(monkeypatch, result=None, delay=0.0):
    """Replaces the build with one that counts its calls and returns ``result`` (or fails)."""
    calls = []

    def fake(directory, key, *args):
        calls.append(directory)
        time.sleep(delay)
        if result is None:
            raise build.BuildFailure("no C++ compiler: 'c++' is not found", "install g++")
        return result

    monkeypatch.setattr(build, "build", fake)
    return calls


def test_a_failure_warns_once_returns_none_and_is_never_retried(tmp_path, monkeypatch):
    _no_compiler(monkeypatch)
    tried = []
    real = build.build
    monkeypatch.setattr(build, "build", lambda *a, **k: tried.append(1) or real(*a, **k))
    engine = loader.Loader(root=tmp_path)
    with pytest.warns(CompiledEngineWarning) as record:
        assert engine.load() is None
    assert len(record) == 1
    message = str(record[0].message)
    assert "'/nonexistent' (from CXX) is not found" in message and "the Python engine runs" in message
    assert "DISPATCH_AMP_ENGINE=python" in message
    assert record[0].filename == __file__  # pointed at the caller, not at our modules
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        assert engine.load() is None and engine.load() is None
    assert len(tried) == 1
    # required after the fact: the recorded cause, still no retry.
    with pytest.raises(loader.CompiledEngineError, match="'/nonexistent'"):
        engine.load(required=True)
    assert len(tried) == 1


def test_required_raises_naming_the_cause_and_the_fix(tmp_path, monkeypatch):
    _no_compiler(monkeypatch)
    engine = loader.Loader(root=tmp_path)
    with pytest.raises(loader.CompiledEngineError) as info:
        engine.load(required=True)
    assert "no C++ compiler" in str(info.value) and "Fix: install g++" in str(info.value)
    assert engine.failure is not None and engine.decided


def test_threads_that_load_together_get_one_attempt_and_one_warning(tmp_path, monkeypatch):
    calls = _counting(monkeypatch, delay=0.2)
    engine = loader.Loader(root=tmp_path)
    results = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=lambda: results.append(engine.load())) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [None] * 8 and len(calls) == 1
    assert [w.category for w in record] == [CompiledEngineWarning]


def test_a_build_made_here_is_said_in_one_line_and_loaded_once(tmp_path, monkeypatch, capsys):
    module = object()
    calls = _counting(monkeypatch, result=(module, 42.4))
    engine = loader.Loader(root=tmp_path)
    assert engine.load() is module and engine.load() is module and len(calls) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("dispatch_amp: built the compiled engine") and " in 42 s" in lines[0]
    assert "once per torch release" in lines[0] and f"cached in {engine.directory}" in lines[0]
    assert str(engine.directory).startswith(str(tmp_path)) and engine.build_seconds == 42.4


def test_a_cached_build_says_nothing_and_quiet_says_nothing(tmp_path, monkeypatch, capsys):
    module = object()
    _counting(monkeypatch, result=(module, None))
    assert loader.Loader(root=tmp_path).load() is module
    _counting(monkeypatch, result=(module, 3.0))
    quiet = loader.Loader(root=tmp_path)
    assert quiet.load(quiet=True) is module and quiet.build_seconds == 3.0
    assert capsys.readouterr().err == ""


def test_an_unforeseen_error_falls_back_named(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("surprise")

    monkeypatch.setattr(build, "build", broken)
    with pytest.warns(CompiledEngineWarning, match="KeyError"):
        assert loader.Loader(root=tmp_path).load() is None


def test_importing_the_package_builds_nothing(tmp_path, without_torch_cuda_notice):
    cache = tmp_path / "cache"
    script = (
        "import dispatch_amp, dispatch_amp.autocast, dispatch_amp.demo\n"
        "from dispatch_amp import autocast\n"
        "from dispatch_amp._compiled import loader\n"
        "assert not loader.PROCESS_LOADER.decided\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DISPATCH_AMP_ENGINE"}
    env["DISPATCH_AMP_CACHE_DIR"] = str(cache)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    # torch's own "No CUDA runtime" notice aside (a CUDA build with no GPU), nothing is said.
    assert not cache.exists() and without_torch_cuda_notice(out.stderr) == ""
