"""python -m dispatch_amp.build: builds ahead, says what, where and how long; --check builds
nothing; a failure exits non-zero with the cause."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dispatch_amp import build
from dispatch_amp._compiled import cache


def test_check_on_an_empty_cache_builds_nothing_and_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    assert build.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "no build for torch " + torch.__version__ in out and str(tmp_path / "cache") in out
    assert "python -m dispatch_amp.build" in out and not (tmp_path / "cache").exists()


def test_a_build_that_cannot_run_exits_non_zero_with_the_cause(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "/nonexistent")
    assert build.main([]) == 1
    err = capsys.readouterr().err
    assert "not built" in err and "'/nonexistent' (from CXX) is not found" in err and "Fix:" in err


@pytest.mark.needs_compiler  # the compiler must run for its error (or ninja's absence) to show
def test_a_compile_error_prints_the_compilers_whole_output(tmp_path, monkeypatch, capsys):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "broken.cpp").write_text("int broken( {\n")
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    original = build.Loader
    monkeypatch.setattr(build, "Loader", lambda: original(csrc=csrc, sources=("broken.cpp",)))
    assert build.main([]) == 1
    err = capsys.readouterr().err
    assert "the build failed" in err and "the build's output:" in err and "broken.cpp" in err


def test_check_and_build_find_the_cached_build(compiled_build):
    check = subprocess.run([sys.executable, "-m", "dispatch_amp.build", "--check"], capture_output=True,
                           text=True, timeout=300, env=compiled_build.env())
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith(f"compiled engine: built for torch {torch.__version__}")
    assert str(compiled_build.root) in check.stdout
    again = subprocess.run([sys.executable, "-m", "dispatch_amp.build"], capture_output=True, text=True,
                           timeout=300, env=compiled_build.env(CXX="/nonexistent"))
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("compiled engine: already built") and again.stderr == ""
