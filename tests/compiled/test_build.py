"""Building the compiled engine into its cache directory: once across processes started
together, a cached build loaded without a compiler, and each failure named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils import cpp_extension

from dispatch_amp._compiled import build, cache

BUILT_LINE = "dispatch_amp: built the compiled engine"


def test_processes_started_together_build_once_and_both_load(compiled_build, without_torch_cuda_notice):
    for rc, out, err in compiled_build.runs:
        assert rc == 0, err
    base = torch.__version__.split("+")[0]
    assert [r["built_against"] for r in compiled_build.results] == [base, base]
    builders = [r for r in compiled_build.results if r["build_seconds"] is not None]
    assert len(builders) == 1, compiled_build.results
    # One line from the process that built, on stderr; nothing from the one that waited.
    # (Less torch's own notice on a CUDA build with no GPU: see the fixture.)
    lines = [line for _, _, err in compiled_build.runs
             for line in without_torch_cuda_notice(err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(BUILT_LINE), lines
    directory = compiled_build.results[0]["directory"]
    assert all(r["directory"] == directory for r in compiled_build.results)
    assert "once per torch release" in lines[0] and f"cached in {directory}" in lines[0]
    assert f"torch {torch.__version__}" in lines[0]
    # ninja's log: one compile and one link, ever.
    log = [line.split("\t")[3] for line in open(os.path.join(directory, ".ninja_log")) if not line.startswith("#")]
    assert sorted(log) == sorted(["engine.o", f"{cache.build_key().module_name}.so"]), log


def test_a_cached_build_loads_without_a_compiler_and_says_nothing(compiled_build):
    script = ("from dispatch_amp._compiled import loader; m = loader.load(required=True); "
              "print(m.built_against(), loader.PROCESS_LOADER.build_seconds)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=compiled_build.env(CXX="/nonexistent", PATH="/nonexistent"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [torch.__version__.split("+")[0], "None"]
    assert out.stderr == ""


def test_the_cached_build_is_found_by_its_key(compiled_build):
    key = cache.build_key()
    assert build.is_built(key.directory(compiled_build.root), key)
    module = build.import_built(key.directory(compiled_build.root), key)
    assert module.__name__ == key.module_name


def _failure(tmp_path, **kwargs) -> build.BuildFailure:
    key = cache.build_key(**kwargs)
    with pytest.raises(build.BuildFailure) as info:
        build.build(key.directory(tmp_path / "cache"), key, **kwargs)
    return info.value


def test_no_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    failure = _failure(tmp_path)
    assert "no C++ compiler" in failure.cause and "'/nonexistent/g++' (from CXX)" in failure.cause
    assert "install g++" in failure.fix


@pytest.mark.needs_compiler  # the compiler must run for its error (or ninja's absence) to show
def test_no_ninja_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    failure = _failure(tmp_path)
    assert failure.cause == "ninja is not found" and "pip install ninja" in failure.fix


def test_an_unwritable_cache_directory_is_named(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    key = cache.build_key()
    with pytest.raises(build.BuildFailure) as info:
        build.build(key.directory(blocker), key)
    assert "cannot be written" in info.value.cause and str(blocker) in info.value.cause
    assert cache.CACHE_ENV in info.value.fix


@pytest.mark.needs_compiler  # the compiler must run for its error (or ninja's absence) to show
def test_a_compile_error_is_named_by_its_first_lines(tmp_path):
    # A source that includes nothing fails in well under a second.
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "broken.cpp").write_text("int broken( {\n")
    failure = _failure(tmp_path, csrc=csrc, sources=("broken.cpp",))
    # The compiler's own error lines, not ninja's or torch's, nor the command line.
    assert failure.cause.startswith("the build failed: ") and "broken.cpp:1:" in failure.cause
    assert ": error: " in failure.cause and "-DTORCH" not in failure.cause and "ninja" not in failure.cause
    assert "python -m dispatch_amp.build" in failure.fix
    assert "broken.cpp" in failure.detail and len(failure.detail) > len(failure.cause)


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path):
    # torch's FileBaton waits for its file "lock" to go away: a build killed half way
    # would leave every later one waiting forever. Holding our flock, it is a leftover.
    directory = tmp_path / "engine"
    directory.mkdir()
    (directory / "lock").touch()
    with build._exclusive(directory):
        assert not (directory / "lock").exists()


def test_a_build_for_another_torch_is_refused(tmp_path, monkeypatch):
    class Module:
        @staticmethod
        def built_against():
            return "2.0.0"

    with pytest.raises(build.BuildFailure, match="compiled against torch 2.0.0"):
        build._check_torch(Module, tmp_path)
